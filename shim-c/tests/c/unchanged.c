/* ckpt_save_flagged against the real sidecar (socket from the environment):
 * a tensor flagged CKPT_TENSOR_UNCHANGED since a step this client saved is
 * taken from the sidecar's copy of that step, not from the trainer's memory
 * (so a write the flag did not declare is not saved: the flag is a promise);
 * without the flag the new bytes are saved; flags on steps the sidecar does
 * not hold as this client saved them are ignored (copied as usual); unknown
 * flag bits are refused. Prints "ok" and exits 0 when all held; otherwise
 * exits with the number of the failed check. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ckpt.h"

static int check_no = 0;
#define CHECK(cond)                                                                         \
    do {                                                                                    \
        check_no++;                                                                         \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "check %d failed: %s (last error: %s)\n", check_no, #cond, ckpt_last_error()); \
            exit(check_no);                                                                 \
        }                                                                                   \
    } while (0)

#define N 4096

static void fill(unsigned char *p, unsigned char v) { memset(p, v, N); }

/* Saves w (flags[0]) and b (flags[1]) as `step`, waits until durable. */
static void save(ckpt_client *c, uint64_t step, ckpt_tensor *t, const uint32_t *flags, int64_t since) {
    uint64_t id = 0;
    CHECK(ckpt_save_flagged(c, step, t, 2, flags, since, NULL, 0, NULL, &id) == CKPT_OK);
    CHECK(ckpt_wait(c, id, CKPT_DURABLE, 30000) == CKPT_OK);
}

/* Loads `step` into the two destinations and says whether w is all `v`. */
static int loaded_w_is(ckpt_client *c, uint64_t step, ckpt_tensor *dst, unsigned char v) {
    uint64_t got = 0;
    int source = 0;
    CHECK(ckpt_load(c, (int64_t)step, dst, 2, &got, &source) == CKPT_OK && got == step);
    const unsigned char *p = dst[0].data;
    for (int i = 0; i < N; i++)
        if (p[i] != v) return 0;
    return 1;
}

int main(void) {
    ckpt_client *c = NULL;
    CHECK(ckpt_connect(NULL, &c) == CKPT_OK);
    unsigned char *w = NULL, *b = NULL, *out = NULL;
    CHECK(ckpt_alloc(c, N, (void **)&w) == CKPT_OK);
    CHECK(ckpt_alloc(c, N, (void **)&b) == CKPT_OK);
    CHECK(ckpt_alloc(c, 2 * N, (void **)&out) == CKPT_OK);
    uint64_t shape[1] = {N};
    ckpt_tensor t[2] = {{"w", "U8", shape, 1, w, N}, {"b", "U8", shape, 1, b, N}};
    ckpt_tensor dst[2] = {{"w", "U8", shape, 1, out, N}, {"b", "U8", shape, 1, out + N, N}};
    const uint32_t w_unchanged[2] = {CKPT_TENSOR_UNCHANGED, 0};

    fill(w, 1), fill(b, 2);
    save(c, 1, t, NULL, -1); /* no flags: a plain save */
    CHECK(loaded_w_is(c, 1, dst, 1));
    /* w written without telling: flagged unchanged since 1, the sidecar
     * takes step 1's bytes (the promise is the caller's). */
    fill(w, 7), fill(b, 3);
    save(c, 2, t, w_unchanged, 1);
    CHECK(loaded_w_is(c, 2, dst, 1));
    CHECK(out[N] == 3); /* b, not flagged, is copied */
    /* Not flagged: the new bytes. */
    save(c, 3, t, NULL, 1);
    CHECK(loaded_w_is(c, 3, dst, 7));
    /* Flagged since a step this client did not save last (2, not 3): the
     * sidecar does not hold it as named, so it copies w as usual. */
    fill(w, 9);
    save(c, 4, t, w_unchanged, 2);
    CHECK(loaded_w_is(c, 4, dst, 9));
    /* since_step < 0: flags ignored. */
    fill(w, 11);
    save(c, 5, t, w_unchanged, -1);
    CHECK(loaded_w_is(c, 5, dst, 11));
    /* Unknown flag bits are refused before anything is sent. */
    const uint32_t bad[2] = {2, 0};
    uint64_t id = 0;
    CHECK(ckpt_save_flagged(c, 6, t, 2, bad, 5, NULL, 0, NULL, &id) == CKPT_E_INVALID);
    CHECK(strstr(ckpt_last_error(), "unknown flag bits") != NULL);
    CHECK(ckpt_save_flagged(c, 6, t, 2, NULL, 5, NULL, 0, NULL, NULL) == CKPT_E_INVALID);
    CHECK(ckpt_close(c) == CKPT_OK);
    printf("ok\n");
    return 0;
}
