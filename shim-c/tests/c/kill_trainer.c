/* kill_trainer.c: the trainer of tests/it/kill.rs, killed (or losing its
 * sidecar) at random points. Its model is a few tensors in two regions from
 * ckpt_alloc whose every byte is a function of the step (content_word below;
 * tests/it/kill.rs computes the same), so a checkpoint holding anything but
 * exactly its own step's bytes is caught.
 *
 * Each step s: write the model of step s, log "save s", ckpt_save, wait for
 * CKPT_RELEASED, log "released s" (only then may the tensors change), log
 * "step s". Every log line is flushed before the next call, so a SIGKILL
 * loses none.
 *
 *   --socket PATH     the sidecar (required)
 *   --mib N           model size in MiB (default 4)
 *   --resume          ckpt_load(latest) first and check every byte of it
 *   --keep-going      a failed call is logged and training goes on (the
 *                     sidecar may be gone); without it, exit 4
 *   --step-ms MS      sleep per step (the "training")
 *   --max-steps N     stop after step N (exit 0)
 *
 * Log lines: "resumed none" | "resumed K ok" | "resumed K BAD <what>",
 * "save S", "released S", "step S", "durable S" (--keep-going: polled),
 * "error S <call> <rc> <ckpt_last_error()>", "failed S <rc> <message>".
 * Exit: 0 done, 2 resume verification failed, 3 setup, 4 call failed.
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt.h"

#define N_TENSORS 4
#define PENDING_MAX 64

static uint64_t content_word(uint64_t step, uint64_t tensor, uint64_t i) {
    return (i * 0x9E3779B97F4A7C15ULL) ^ (step * 0xD1B54A32D192ED03ULL) ^ ((tensor + 1) * 0x94D049BB133111EBULL);
}

typedef struct {
    const char *name;
    uint64_t words;
    uint64_t shape[1];
    uint64_t *data;
} tensor_t;

static tensor_t ts[N_TENSORS];
static ckpt_tensor desc[N_TENSORS];

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}

static void fill(uint64_t step) {
    for (int k = 0; k < N_TENSORS; k++) {
        if (k == 3) {
            ts[k].data[0] = step;
            continue;
        }
        uint64_t *w = ts[k].data;
        for (uint64_t i = 0; i < ts[k].words; i++) w[i] = content_word(step, (uint64_t)k, i);
    }
}

/* 0 when the model is exactly that of `step`, else the first bad tensor + 1. */
static int check(uint64_t step) {
    for (int k = 0; k < N_TENSORS; k++) {
        if (k == 3) {
            if (ts[k].data[0] != step) return k + 1;
            continue;
        }
        const uint64_t *w = ts[k].data;
        for (uint64_t i = 0; i < ts[k].words; i++)
            if (w[i] != content_word(step, (uint64_t)k, i)) return k + 1;
    }
    return 0;
}

static void sleep_ms(uint64_t ms) {
    struct timespec d = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&d, NULL);
}

int main(int argc, char **argv) {
    const char *socket_path = NULL;
    uint64_t mib = 4, step_ms = 0, max_steps = UINT64_MAX;
    int resume = 0, keep_going = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--socket") && i + 1 < argc) socket_path = argv[++i];
        else if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--step-ms") && i + 1 < argc) step_ms = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--max-steps") && i + 1 < argc) max_steps = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--resume")) resume = 1;
        else if (!strcmp(argv[i], "--keep-going")) keep_going = 1;
        else {
            fprintf(stderr, "kill_trainer: bad argument %s\n", argv[i]);
            return 3;
        }
    }
    if (!socket_path || mib == 0) {
        fprintf(stderr, "kill_trainer: --socket PATH required, --mib > 0\n");
        return 3;
    }
    /* Region 1: "a" (half the words) and "b" (a quarter); region 2: "c" (a
     * quarter) and "step" (one I64), so reconnection re-registers two. */
    uint64_t words = mib * (1u << 20) / 8;
    ts[0] = (tensor_t){"a", words / 2, {words / 2}, NULL};
    ts[1] = (tensor_t){"b", words / 4, {words / 4}, NULL};
    ts[2] = (tensor_t){"c", words / 4, {words / 4}, NULL};
    ts[3] = (tensor_t){"step", 1, {1}, NULL};

    ckpt_client *c = NULL;
    int rc = ckpt_connect(socket_path, &c);
    if (rc != CKPT_OK) {
        logf_("error 0 connect %d %s", rc, ckpt_last_error());
        return 3;
    }
    void *r1 = NULL, *r2 = NULL;
    uint64_t r1_bytes = (ts[0].words + ts[1].words) * 8, r2_bytes = (ts[2].words + 1) * 8;
    if ((rc = ckpt_alloc(c, r1_bytes, &r1)) != CKPT_OK || (rc = ckpt_alloc(c, r2_bytes, &r2)) != CKPT_OK) {
        logf_("error 0 alloc %d %s", rc, ckpt_last_error());
        return 3;
    }
    ts[0].data = (uint64_t *)r1;
    ts[1].data = (uint64_t *)r1 + ts[0].words;
    ts[2].data = (uint64_t *)r2;
    ts[3].data = (uint64_t *)r2 + ts[2].words;
    for (int k = 0; k < N_TENSORS; k++)
        desc[k] = (ckpt_tensor){ts[k].name, k == 3 ? "I64" : "U64", ts[k].shape, 1, ts[k].data, ts[k].words * 8};

    uint64_t start = 0;
    if (resume) {
        uint64_t got = 0;
        int source = 0;
        rc = ckpt_load(c, -1, desc, N_TENSORS, &got, &source);
        if (rc == CKPT_E_NOT_FOUND) {
            logf_("resumed none");
        } else if (rc != CKPT_OK) {
            logf_("error 0 load %d %s", rc, ckpt_last_error());
            return 3;
        } else {
            char blob[64] = {0}, want[64];
            uint64_t blob_len = 0;
            snprintf(want, sizeof want, "step=%" PRIu64, got);
            int bad = check(got);
            int brc = ckpt_loaded_blob(c, "state", blob, sizeof blob - 1, &blob_len);
            if (bad) {
                logf_("resumed %" PRIu64 " BAD tensor %s (source %d)", got, ts[bad - 1].name, source);
                return 2;
            }
            if (brc != CKPT_OK || blob_len != strlen(want) || memcmp(blob, want, blob_len)) {
                logf_("resumed %" PRIu64 " BAD blob \"%s\" (%d)", got, blob, brc);
                return 2;
            }
            logf_("resumed %" PRIu64 " ok (source %s)", got, source == CKPT_SOURCE_RAM ? "ram" : "disk");
            start = got;
        }
    }

    uint64_t pending[PENDING_MAX], pending_step[PENDING_MAX];
    size_t n_pending = 0;
    for (uint64_t s = start + 1; s <= max_steps; s++) {
        fill(s);
        char state[64];
        snprintf(state, sizeof state, "step=%" PRIu64, s);
        ckpt_blob b = {"state", state, strlen(state)};
        uint64_t id = 0;
        logf_("save %" PRIu64, s);
        rc = ckpt_save(c, s, desc, N_TENSORS, &b, 1, &id);
        if (rc == CKPT_OK) {
            rc = ckpt_wait(c, id, CKPT_RELEASED, 120000);
            if (rc == CKPT_OK) {
                logf_("released %" PRIu64, s);
                if (n_pending == PENDING_MAX) { /* keep the newest */
                    memmove(pending, pending + 1, (PENDING_MAX - 1) * sizeof pending[0]);
                    memmove(pending_step, pending_step + 1, (PENDING_MAX - 1) * sizeof pending_step[0]);
                    n_pending--;
                }
                pending[n_pending] = id;
                pending_step[n_pending++] = s;
            } else {
                logf_("error %" PRIu64 " wait %d %s", s, rc, ckpt_last_error());
            }
        } else {
            logf_("error %" PRIu64 " save %d %s", s, rc, ckpt_last_error());
        }
        if (rc != CKPT_OK && !keep_going) return 4;
        if (keep_going) { /* durable acks as they come, without blocking */
            size_t keep = 0;
            for (size_t i = 0; i < n_pending; i++) {
                int w = ckpt_wait(c, pending[i], CKPT_DURABLE, 0);
                if (w == CKPT_OK) {
                    logf_("durable %" PRIu64, pending_step[i]);
                } else if (w == CKPT_E_TIMEOUT) {
                    pending[keep] = pending[i];
                    pending_step[keep++] = pending_step[i];
                } else {
                    logf_("failed %" PRIu64 " %d %s", pending_step[i], w, ckpt_last_error());
                }
            }
            n_pending = keep;
        }
        if (step_ms) sleep_ms(step_ms);
        logf_("step %" PRIu64, s);
    }
    for (size_t i = 0; i < n_pending; i++) {
        int w = ckpt_wait(c, pending[i], CKPT_DURABLE, 120000);
        if (w == CKPT_OK) logf_("durable %" PRIu64, pending_step[i]);
        else logf_("failed %" PRIu64 " %d %s", pending_step[i], w, ckpt_last_error());
    }
    ckpt_close(c);
    logf_("done");
    return 0;
}
