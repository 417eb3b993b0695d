/*
 * trainer.c: a small C "trainer" that checkpoints every step through libckpt.
 *
 * Its model (a few float tensors and a step counter) lives in shared memory
 * from ckpt_alloc and changes every step by a deterministic update. Each step
 * it waits until the previous checkpoint is released (the only wait on the
 * critical path), updates the model, and saves it as checkpoint <step>;
 * durable acks are polled as they come and all awaited at the end.
 *
 * With --resume it loads the latest checkpoint, recomputes from the step
 * number alone what the model must be at that step, and checks that every
 * byte it got back (tensors and the blob) is exactly that; then trains on.
 *
 *   ./trainer --steps 50                   # fresh run
 *   ./trainer --steps 100 --resume         # continue from latest, verified
 *   ./trainer --steps 50 --crash-at 20     # SIGKILL itself after step 20's release
 *
 * Socket: --socket PATH, else $CKPT_SIDECAR_SOCKET (set by `ckpt-sidecar launch`).
 * Exit status: 0 ok, 1 checkpointing error at the end, 2 verification failed,
 * 3 usage or setup error.
 */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"

#define N_TENSORS 4
#define PENDING_MAX 256

typedef struct {
    const char *name;
    uint64_t shape[2];
    uint32_t ndim;
    uint64_t n_elems;
    uint64_t offset_bytes; /* in the region */
} tensor_spec;

static tensor_spec specs[N_TENSORS];
static uint64_t region_bytes;
static unsigned char *region;     /* ckpt_alloc memory: the live model */
static unsigned char *expected;   /* malloc: the model recomputed for --resume */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint32_t mix(uint64_t a, uint64_t b) {
    uint64_t x = a * 0x9e3779b97f4a7c15ULL ^ (b + 0x632be59bd9b4e5ffULL);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 29;
    return (uint32_t)x;
}

/* Lays the tensors out in one region, each 64-byte aligned. */
static void plan(uint64_t width) {
    uint64_t off = 0;
    specs[0] = (tensor_spec){"embed.weight", {width, 64}, 2, 0, 0};
    specs[1] = (tensor_spec){"layer.0.weight", {64, 64}, 2, 0, 0};
    specs[2] = (tensor_spec){"layer.0.bias", {64, 0}, 1, 0, 0};
    specs[3] = (tensor_spec){"step", {1, 0}, 1, 0, 0}; /* I64 */
    for (int k = 0; k < N_TENSORS; k++) {
        uint64_t n = 1;
        for (uint32_t d = 0; d < specs[k].ndim; d++) n *= specs[k].shape[d];
        specs[k].n_elems = n;
        specs[k].offset_bytes = off;
        off += (n * (k == 3 ? 8 : 4) + 63) / 64 * 64;
    }
    region_bytes = off;
}

/* The model at step 0. */
static void init_model(unsigned char *m) {
    for (int k = 0; k < 3; k++) {
        float *w = (float *)(m + specs[k].offset_bytes);
        for (uint64_t i = 0; i < specs[k].n_elems; i++) w[i] = (float)(mix(k, i) % 2001) / 1000.0f - 1.0f;
    }
    *(int64_t *)(m + specs[3].offset_bytes) = 0;
}

/* One training step: the model at step s from the model at step s - 1. */
static void update_model(unsigned char *m, uint64_t s) {
    for (int k = 0; k < 3; k++) {
        float *w = (float *)(m + specs[k].offset_bytes);
        for (uint64_t i = 0; i < specs[k].n_elems; i++) {
            float g = (float)(mix(s * 4 + (uint64_t)k, i) % 1001) / 1000.0f - 0.5f;
            w[i] = w[i] * 0.999f - 0.01f * g;
        }
    }
    *(int64_t *)(m + specs[3].offset_bytes) = (int64_t)s;
}

static void blob_text(char *buf, size_t cap, uint64_t s) {
    snprintf(buf, cap, "trainer.c state: step=%llu data_position=%llu", (unsigned long long)s, (unsigned long long)(s * 32));
}

static void describe(ckpt_tensor *t, unsigned char *base) {
    for (int k = 0; k < N_TENSORS; k++) {
        t[k].name = specs[k].name;
        t[k].dtype = k == 3 ? "I64" : "F32";
        t[k].shape = specs[k].shape;
        t[k].ndim = specs[k].ndim;
        t[k].data = base + specs[k].offset_bytes;
        t[k].len_bytes = specs[k].n_elems * (k == 3 ? 8 : 4);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void usage(void) {
    fprintf(stderr, "usage: trainer [--steps N] [--resume] [--width ROWS] [--crash-at STEP] [--step-ms MS] [--socket PATH] [--quiet]\n");
    exit(3);
}

int main(int argc, char **argv) {
    uint64_t steps = 20, width = 1024, crash_at = 0, step_ms = 0;
    int resume = 0, quiet = 0;
    const char *socket_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--width") && i + 1 < argc) width = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--crash-at") && i + 1 < argc) crash_at = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--step-ms") && i + 1 < argc) step_ms = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--socket") && i + 1 < argc) socket_path = argv[++i];
        else if (!strcmp(argv[i], "--resume")) resume = 1;
        else if (!strcmp(argv[i], "--quiet")) quiet = 1;
        else usage();
    }
    if (width == 0) usage();
    plan(width);
    printf("trainer: %s, model %llu bytes in %d tensors\n", ckpt_version(), (unsigned long long)region_bytes, N_TENSORS);

    ckpt_client *c = NULL;
    if (ckpt_connect(socket_path, &c) != CKPT_OK) {
        fprintf(stderr, "trainer: cannot connect: %s\n", ckpt_last_error());
        return 3;
    }
    ckpt_install_sigterm_handler(); /* SIGTERM: finish the step, checkpoint, exit */
    if (ckpt_alloc(c, region_bytes, (void **)&region) != CKPT_OK) {
        fprintf(stderr, "trainer: ckpt_alloc: %s\n", ckpt_last_error());
        return 3;
    }
    ckpt_tensor t[N_TENSORS];
    describe(t, region);

    uint64_t start = 0;
    if (resume) {
        uint64_t got = 0;
        int source = 0;
        int rc = ckpt_load(c, -1, t, N_TENSORS, &got, &source);
        if (rc == CKPT_E_NOT_FOUND) {
            printf("trainer: no checkpoint to resume from (%s); starting at step 0\n", ckpt_last_error());
            init_model(region);
        } else if (rc != CKPT_OK) {
            fprintf(stderr, "trainer: resume failed (%d): %s\n", rc, ckpt_last_error());
            return 2;
        } else {
            expected = malloc(region_bytes);
            if (!expected) return 3;
            memset(expected, 0, region_bytes);
            init_model(expected);
            for (uint64_t s = 1; s <= got; s++) update_model(expected, s);
            int bad = 0;
            for (int k = 0; k < N_TENSORS; k++) {
                if (memcmp(region + specs[k].offset_bytes, expected + specs[k].offset_bytes, t[k].len_bytes) != 0) {
                    fprintf(stderr, "trainer: VERIFY FAILED: tensor %s differs from the model at step %llu\n", specs[k].name, (unsigned long long)got);
                    bad = 1;
                }
            }
            char want[128], blob[128];
            uint64_t blob_len = 0;
            blob_text(want, sizeof want, got);
            memset(blob, 0, sizeof blob);
            rc = ckpt_loaded_blob(c, "trainer_state", blob, sizeof blob - 1, &blob_len);
            if (rc != CKPT_OK || blob_len != strlen(want) || memcmp(blob, want, blob_len) != 0) {
                fprintf(stderr, "trainer: VERIFY FAILED: blob trainer_state is \"%s\" (%d: %s), expected \"%s\"\n", blob, rc, rc ? ckpt_last_error() : "", want);
                bad = 1;
            }
            if (bad) return 2;
            printf("trainer: resumed from step %llu (source %s), state verified: %llu bytes identical to a recomputed model\n", (unsigned long long)got,
                   source == CKPT_SOURCE_RAM ? "ram" : "disk", (unsigned long long)region_bytes);
            start = got;
            free(expected);
        }
    } else {
        init_model(region);
    }

    uint64_t pending[PENDING_MAX], pending_step[PENDING_MAX];
    size_t n_pending = 0;
    double *stalls = calloc(steps + 1, sizeof(double));
    double persist_total = 0;
    uint64_t n_saved = 0, n_durable = 0, n_failed = 0, last_id = 0;
    int have_last = 0;
    for (uint64_t s = start + 1; s <= steps; s++) {
        /* The tensors may change only once the previous save is released. */
        if (have_last && ckpt_wait(c, last_id, CKPT_RELEASED, -1) != CKPT_OK)
            fprintf(stderr, "trainer: step %llu: previous save not released: %s (training goes on)\n", (unsigned long long)s, ckpt_last_error());
        update_model(region, s);
        if (step_ms) {
            struct timespec d = {(time_t)(step_ms / 1000), (long)(step_ms % 1000) * 1000000L};
            nanosleep(&d, NULL);
        }

        char text[128];
        blob_text(text, sizeof text, s);
        ckpt_blob b = {"trainer_state", text, strlen(text)};
        double t0 = now_s();
        uint64_t id;
        if (ckpt_save(c, s, t, N_TENSORS, &b, 1, &id) != CKPT_OK) {
            fprintf(stderr, "trainer: step %llu: save failed: %s (training goes on)\n", (unsigned long long)s, ckpt_last_error());
            have_last = 0;
            n_failed++;
            continue;
        }
        n_saved++;
        last_id = id;
        have_last = 1;
        /* Measure the stall: what a trainer that waits at once would lose. */
        if (ckpt_wait(c, id, CKPT_RELEASED, -1) == CKPT_OK) stalls[n_saved - 1] = now_s() - t0;
        if (n_pending == PENDING_MAX) { /* bounded: wait for the oldest */
            if (ckpt_wait(c, pending[0], CKPT_DURABLE, -1) != CKPT_OK) n_failed++;
            else n_durable++;
            memmove(pending, pending + 1, (PENDING_MAX - 1) * sizeof pending[0]);
            memmove(pending_step, pending_step + 1, (PENDING_MAX - 1) * sizeof pending_step[0]);
            n_pending--;
        }
        pending[n_pending] = id;
        pending_step[n_pending++] = s;

        /* Collect durable acks that have arrived, without blocking. */
        size_t keep = 0;
        for (size_t i = 0; i < n_pending; i++) {
            int state = CKPT_PENDING;
            if (ckpt_poll(c, pending[i], &state) != CKPT_OK) state = CKPT_FAILED;
            if (state == CKPT_DURABLE) {
                double persist = -1;
                ckpt_save_figures(c, pending[i], NULL, NULL, &persist);
                if (persist > 0) persist_total += persist;
                n_durable++;
                if (!quiet) printf("trainer: step %llu durable (persist %.2f ms)\n", (unsigned long long)pending_step[i], persist * 1e3);
            } else if (state == CKPT_FAILED) {
                fprintf(stderr, "trainer: checkpoint of step %llu failed: %s\n", (unsigned long long)pending_step[i], ckpt_last_error());
                n_failed++;
            } else {
                pending_step[keep] = pending_step[i];
                pending[keep++] = pending[i];
            }
        }
        n_pending = keep;
        if (!quiet) printf("trainer: step %llu saved, stall %.3f ms\n", (unsigned long long)s, stalls[n_saved - 1] * 1e3);

        if (crash_at && s == crash_at) {
            printf("trainer: crashing on purpose after step %llu was released\n", (unsigned long long)s);
            fflush(stdout);
            raise(SIGKILL);
        }
        if (ckpt_preempted()) {
            printf("trainer: preempted (SIGTERM) after step %llu; waiting for it to be durable\n", (unsigned long long)s);
            break;
        }
    }
    for (size_t i = 0; i < n_pending; i++) {
        if (ckpt_wait(c, pending[i], CKPT_DURABLE, 120000) != CKPT_OK) {
            fprintf(stderr, "trainer: checkpoint of step %llu failed: %s\n", (unsigned long long)pending_step[i], ckpt_last_error());
            n_failed++;
        } else {
            double persist = -1;
            ckpt_save_figures(c, pending[i], NULL, NULL, &persist);
            if (persist > 0) persist_total += persist;
            n_durable++;
        }
    }
    if (n_saved) {
        qsort(stalls, n_saved, sizeof(double), cmp_double);
        double mib = (double)region_bytes / (1 << 20);
        printf("trainer: done: %llu saves, %llu durable, %llu failed; stall median %.3f ms, max %.3f ms; persist %.2f MiB/s (%.3f MiB per checkpoint)\n",
               (unsigned long long)n_saved, (unsigned long long)n_durable, (unsigned long long)n_failed, stalls[n_saved / 2] * 1e3, stalls[n_saved - 1] * 1e3,
               persist_total > 0 ? mib * (double)n_durable / persist_total : 0.0, mib);
    } else {
        printf("trainer: nothing to do (at step %llu of %llu)\n", (unsigned long long)start, (unsigned long long)steps);
    }
    free(stalls);
    ckpt_close(c);
    return n_failed ? 1 : 0;
}
