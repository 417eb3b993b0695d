/* Every C entry point against the fake sidecar (socket from the environment),
 * including the error paths. Prints "ok" and exits 0 when all held; otherwise
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

int main(void) {
    ckpt_client *c = NULL;
    CHECK(ckpt_connect(NULL, &c) == CKPT_OK && c != NULL);
    CHECK(ckpt_connected(c) == 1);
    CHECK(ckpt_protocol_version() == 16);
    float *w = NULL;
    CHECK(ckpt_alloc(c, 4096, (void **)&w) == CKPT_OK && w != NULL);
    CHECK(ckpt_alloc(c, 0, (void **)&w) == CKPT_E_INVALID);
    void *h = NULL; /* a hand-over region: for copies made at save */
    CHECK(ckpt_alloc_hand_over(c, 4096, &h) == CKPT_OK && h != NULL && h != (void *)w);
    CHECK(ckpt_alloc_hand_over(NULL, 4096, &h) == CKPT_E_INVALID);
    CHECK(ckpt_free(c, h) == CKPT_OK);
    for (int i = 0; i < 16; i++) w[i] = (float)i;
    uint64_t shape[1] = {16};
    ckpt_tensor t = {"w", "F32", shape, 1, w, 64};
    ckpt_blob b = {"meta", "hello", 5};
    uint64_t id = 0;
    CHECK(ckpt_set_lazy_release(c, 1) == CKPT_OK);
    CHECK(ckpt_set_lazy_release(NULL, 1) == CKPT_E_INVALID);
    CHECK(ckpt_save(c, 1, &t, 1, &b, 1, &id) == CKPT_OK);
    CHECK(ckpt_wait(c, id, CKPT_RELEASED, 10000) == CKPT_OK);
    CHECK(ckpt_wait(c, id, CKPT_DURABLE, 10000) == CKPT_OK);
    int state = -1;
    CHECK(ckpt_poll(c, id, &state) == CKPT_OK && state == CKPT_DURABLE);
    /* The fake has no drain target: an error at once, never a hang. */
    CHECK(ckpt_wait_replicated(c, id, -1) == CKPT_E_NOT_FOUND && strstr(ckpt_last_error(), "no drain target"));
    CHECK(ckpt_wait(c, id, CKPT_REPLICATED, -1) == CKPT_E_NOT_FOUND);
    CHECK(ckpt_poll(c, id, &state) == CKPT_OK && state == CKPT_DURABLE);
    double copy = 0, waited = 0, persist = 0;
    CHECK(ckpt_save_figures(c, id, &copy, &waited, &persist) == CKPT_OK && copy >= 0 && persist >= 0);
    CHECK(ckpt_wait(c, id, 7, 0) == CKPT_E_INVALID);
    CHECK(ckpt_poll(c, 999999, &state) == CKPT_E_NOT_FOUND);

    /* Errors: memory not from ckpt_alloc, NULLs, the sidecar's refusal. */
    float heap[16];
    ckpt_tensor bad = {"h", "F32", shape, 1, heap, 64};
    CHECK(ckpt_save(c, 2, &bad, 1, NULL, 0, &id) == CKPT_E_REGION);
    CHECK(strstr(ckpt_last_error(), "not inside") != NULL);
    ckpt_tensor noname = {NULL, "F32", shape, 1, w, 64};
    CHECK(ckpt_save(c, 2, &noname, 1, NULL, 0, &id) == CKPT_E_INVALID);
    CHECK(ckpt_save(c, 2, NULL, 3, NULL, 0, &id) == CKPT_E_INVALID);
    CHECK(ckpt_save(NULL, 2, &t, 1, NULL, 0, &id) == CKPT_E_INVALID);
    CHECK(ckpt_save(c, 1, &t, 1, NULL, 0, &id) == CKPT_OK); /* step 1 is taken */
    CHECK(ckpt_wait(c, id, CKPT_DURABLE, 10000) == CKPT_E_BAD_REQUEST);
    CHECK(ckpt_poll(c, id, &state) == CKPT_OK && state == CKPT_FAILED && strstr(ckpt_last_error(), "already"));

    /* save_file: sent (the fake writes no files and says so); memory and
       arguments checked here. The real sidecar's writes: tests/it/real_sidecar.rs. */
    CHECK(ckpt_save_file(c, "/tmp/x.pt", w, 64, &id) == CKPT_OK);
    CHECK(ckpt_wait(c, id, CKPT_DURABLE, 10000) == CKPT_E_BAD_REQUEST);
    CHECK(strstr(ckpt_last_error(), "file /tmp/x.pt") != NULL);
    CHECK(ckpt_save_file(c, "/tmp/x.pt", heap, 64, &id) == CKPT_E_REGION);
    CHECK(ckpt_save_file(c, NULL, w, 64, &id) == CKPT_E_INVALID);
    CHECK(ckpt_save_file(c, "/tmp/x.pt", w, 64, NULL) == CKPT_E_INVALID);

    /* List. */
    size_t n = 0;
    int64_t latest = -2;
    CHECK(ckpt_list(c, NULL, 0, &n, &latest) == CKPT_OK && n == 1 && latest == 1);
    uint64_t steps[4];
    CHECK(ckpt_list(c, steps, 4, &n, NULL) == CKPT_OK && n == 1 && steps[0] == 1);

    /* Load into the same place after the model moved on. */
    for (int i = 0; i < 16; i++) w[i] = -1.0f;
    uint64_t got = 0;
    int source = 0;
    CHECK(ckpt_load(c, -1, &t, 1, &got, &source) == CKPT_OK && got == 1 && source == CKPT_SOURCE_RAM);
    for (int i = 0; i < 16; i++) CHECK(w[i] == (float)i);
    CHECK(ckpt_load(c, 42, &t, 1, &got, &source) == CKPT_E_NOT_FOUND);
    CHECK(ckpt_load(c, -5, &t, 1, &got, &source) == CKPT_E_INVALID);
    CHECK(ckpt_load(c, 1, NULL, 0, NULL, NULL) == CKPT_OK);
    uint64_t len = 0;
    char buf[16] = {0};
    CHECK(ckpt_loaded_blob(c, "meta", NULL, 0, &len) == CKPT_OK && len == 5);
    CHECK(ckpt_loaded_blob(c, "meta", buf, 2, &len) == CKPT_E_TRUNCATED && len == 5);
    CHECK(ckpt_loaded_blob(c, "meta", buf, sizeof buf, &len) == CKPT_OK && !memcmp(buf, "hello", 5));
    CHECK(ckpt_loaded_blob(c, "nope", buf, sizeof buf, &len) == CKPT_E_NOT_FOUND);
    size_t nt = 0;
    CHECK(ckpt_loaded_tensor_count(c, &nt) == CKPT_OK && nt == 1);
    const char *name = NULL, *dtype = NULL;
    const uint64_t *sh = NULL;
    uint32_t ndim = 0;
    uint64_t tlen = 0;
    CHECK(ckpt_loaded_tensor(c, 0, &name, &dtype, &sh, &ndim, &tlen) == CKPT_OK);
    CHECK(!strcmp(name, "w") && !strcmp(dtype, "F32") && ndim == 1 && sh[0] == 16 && tlen == 64);
    CHECK(ckpt_loaded_tensor(c, 1, &name, NULL, NULL, NULL, NULL) == CKPT_E_INVALID);
    uint64_t at = 0;
    CHECK(ckpt_loaded_tensor_offset(c, 0, &at) == CKPT_OK && at == UINT64_MAX); /* a plain load places nothing */
    /* All at once: what the per-tensor calls say, and a range past the count refused. */
    ckpt_loaded_tensor_info info[2];
    memset(info, 0, sizeof info);
    CHECK(ckpt_loaded_tensors(c, 0, 1, info) == CKPT_OK);
    CHECK(info[0].name == name && info[0].dtype == dtype && info[0].shape == sh && info[0].ndim == 1);
    CHECK(info[0].len_bytes == 64 && info[0].offset == UINT64_MAX);
    CHECK(ckpt_loaded_tensors(c, 0, 2, info) == CKPT_E_INVALID);
    CHECK(ckpt_loaded_tensors(c, 1, 0, NULL) == CKPT_OK);
    CHECK(ckpt_loaded_tensors(c, SIZE_MAX, 2, info) == CKPT_E_INVALID);
    /* The names and shapes in one piece each: where the per-tensor calls point. */
    const char *names = NULL;
    const uint64_t *dims = NULL;
    size_t names_len = 0, n_dims = 0;
    CHECK(ckpt_loaded_table(c, &names, &names_len, &dims, &n_dims) == CKPT_OK);
    CHECK(names == name && names_len == 2 && names[1] == '\0' && dims == sh && n_dims == 1 && dims[0] == 16);
    CHECK(ckpt_loaded_table(c, NULL, NULL, NULL, NULL) == CKPT_OK);

    /* Packed load: the sidecar lays the checkpoint out in memory from
       ckpt_alloc; too small a range first (it says what it needs, writes
       nothing), then enough, and the bytes read back where it says. */
    unsigned char *p = NULL;
    CHECK(ckpt_alloc(c, 8192, (void **)&p) == CKPT_OK && p != NULL);
    memset(p, 0xAB, 8192);
    uint64_t need = 0;
    got = 0;
    CHECK(ckpt_load_packed(c, -1, p, 32, &got, &source, &need) == CKPT_OK && got == 1 && need >= 64 && need > 32);
    CHECK(p[0] == 0xAB && p[31] == 0xAB);
    CHECK(ckpt_loaded_tensor_offset(c, 0, &at) == CKPT_OK && at == UINT64_MAX);
    CHECK(ckpt_load_packed(c, 1, p, 8192, &got, &source, &need) == CKPT_OK && got == 1 && source == CKPT_SOURCE_RAM && need <= 8192);
    CHECK(ckpt_loaded_tensor_count(c, &nt) == CKPT_OK && nt == 1);
    CHECK(ckpt_loaded_tensor_offset(c, 0, &at) == CKPT_OK && at + 64 <= need);
    CHECK(ckpt_loaded_tensors(c, 0, 1, info) == CKPT_OK && info[0].offset == at && info[0].len_bytes == 64);
    float back[16];
    memcpy(back, p + at, sizeof back);
    for (int i = 0; i < 16; i++) CHECK(back[i] == (float)i);
    CHECK(ckpt_loaded_tensor_offset(c, 1, &at) == CKPT_E_INVALID);
    CHECK(ckpt_loaded_blob(c, "meta", buf, sizeof buf, &len) == CKPT_OK && len == 5 && !memcmp(buf, "hello", 5));
    CHECK(ckpt_load_packed(c, 42, p, 8192, &got, &source, &need) == CKPT_E_NOT_FOUND);
    CHECK(ckpt_load_packed(c, -5, p, 8192, &got, &source, &need) == CKPT_E_INVALID);
    CHECK(ckpt_load_packed(c, 1, heap, sizeof heap, &got, &source, &need) == CKPT_E_REGION);
    CHECK(ckpt_load_packed(NULL, 1, p, 8192, &got, &source, &need) == CKPT_E_INVALID);
    CHECK(ckpt_free(c, p) == CKPT_OK);

    /* Status as JSON. */
    size_t jlen = 0;
    CHECK(ckpt_status_json(c, NULL, 0, &jlen) == CKPT_OK && jlen > 2);
    char *json = malloc(jlen + 1);
    CHECK(ckpt_status_json(c, json, jlen, &jlen) == CKPT_E_TRUNCATED);
    CHECK(ckpt_status_json(c, json, jlen + 1, &jlen) == CKPT_OK && json[0] == '{' && strstr(json, "server_pid"));
    free(json);

    CHECK(ckpt_set_timeout(c, 5000) == CKPT_OK);
    CHECK(ckpt_reconnect(c) == CKPT_OK);
    CHECK(ckpt_free(c, heap) == CKPT_E_NOT_FOUND);
    CHECK(ckpt_free(c, w) == CKPT_OK);
    CHECK(ckpt_default_client() == NULL && strstr(ckpt_last_error(), "CKPT_SIDECAR_PRELOAD"));
    CHECK(ckpt_close(c) == CKPT_OK);
    CHECK(ckpt_close(NULL) == CKPT_OK);
    printf("ok\n");
    return 0;
}
