/*
 * A trainer whose tensors live in CUDA device memory, for the CUDA path's
 * tests (tests/it/cuda_fake.rs): built against libckpt and linked with
 * libcuda.so.1 like any CUDA program; the tests put the fake driver's folder
 * on LD_LIBRARY_PATH. Usage: cuda_trainer MODE DIR_UNUSED
 *
 *   roundtrip            two allocations, three tensors (two at offsets in
 *                        one allocation); the last write before the save is
 *                        an async copy the driver finishes late, so only the
 *                        sidecar's stream wait makes the saved bytes right;
 *                        the trainer writes again right after Released; then
 *                        a load into a third allocation, compared bit-exact.
 *   die-after-release    saves, waits for Released, prints "released", SIGKILLs itself.
 *   die-before-release   queues a very late write, saves, prints "saved" and waits
 *                        to be killed (by the test, before the event the save waits
 *                        on completed: it never will).
 *   die-mid-copy         saves, waits until its own stream (and so the save's event)
 *                        has completed, prints "synced" and waits to be killed (by
 *                        the test, while the sidecar's late copies run).
 *   many                 64 allocations, two tensors in each (one at an offset),
 *                        saved behind the event, loaded back in place, bit-exact.
 *   refused              the sidecar has no driver: registration fails, saying so.
 *   sidecar-dies-guarded saves, makes its stream wait on the sidecar's copy
 *                        (ckpt_stream_wait_copy), prints "guarded"; the test kills the
 *                        sidecar; the save fails, then device work on that very stream
 *                        completes (cuStreamSynchronize) and it prints "trained on".
 *   sidecar-dies         saves behind a very late write, prints "saved", expects
 *                        the save to fail when the test kills the sidecar, then
 *                        trains on (device work) and prints "trained on".
 *   vmm-roundtrip        two VMM allocations (cuMemCreate, exportable as a POSIX
 *                        fd, mapped with cuMemMap) hold three tensors (two at
 *                        offsets in one); saved behind a late write, overwritten
 *                        after Released, loaded back in place, bit-exact.
 *   vmm-die-after-release  the same save; waits for Released, prints "released",
 *                        SIGKILLs itself.
 *   vmm-check            loads step 5 into fresh (cuMemAlloc) memory and checks it
 *                        holds exactly what the VMM trainers saved.
 *   vmm-unexportable     a VMM allocation created without the POSIX fd handle
 *                        type: registration fails, saying why.
 *   guard / no-guard     saves, then (guard) makes its stream wait on the
 *                        sidecar's copy with ckpt_stream_wait_copy, prints
 *                        "on_stream=1 state=pending" when it was queued while
 *                        the sidecar still copied, and
 *                        overwrites the tensor on that stream at once; prints
 *                        "snapshot=saved" or "snapshot=overwritten" after
 *                        loading the step back (no-guard: the control).
 *   parts                two clients, ranks 0 and 1 of 2, each save its own device
 *                        tensor (behind a late write) as its part of step 8; a third
 *                        client loads both back into fresh memory, bit-exact.
 *   realloc              saves a tensor, frees its allocation, allocates again at the
 *                        same address (the driver reuses it: checked) with other
 *                        bytes and saves the same descriptor again, twice (same
 *                        size, then smaller); each step loads back with its own
 *                        bytes, and after each re-save the sidecar holds one import
 *                        (the stale one closed: "open=1,1", read from the fake's
 *                        counters of the sidecar, file $CKPT_TEST_SIDECAR_STATS).
 *   free-and-reuse       saves a 6 MiB allocation (Durable), frees it and allocates
 *                        6 MiB again (the fake lands it at the same address; with
 *                        FAKE_CUDA_DEVICE_MEMORY_BYTES=8 MiB only if the sidecar
 *                        let go of the freed memory: "realloc failed: 2" if not),
 *                        then a second client (as the torch.save hook is beside
 *                        a Checkpointer) registers and saves the new allocation
 *                        ("second client refused: ..." if the sidecar still had
 *                        the old one open at that address: ALREADY_MAPPED).
 *   span                 four VMM chunks mapped back to back in one reserved range
 *                        (PyTorch's expandable segments); tensors crossing two and
 *                        three chunks (one registered by its start only, one with
 *                        ckpt_register_cuda_range) and one inside a chunk: saved
 *                        behind a late write, overwritten, loaded back in place
 *                        bit-exact; then a range running into an unmapped chunk
 *                        is refused, at registration and at save ("refused: ...").
 *   capture              a save on a stream capturing a CUDA graph is refused
 *                        ("capture-save=refused: ..."); a save made before the
 *                        capture, guarded on the capturing stream, is waited for on
 *                        the CPU ("capture-guard on_stream=0 state=not-pending").
 */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
int cuInit(unsigned);
int cuDeviceGet(int *, int);
int cuDevicePrimaryCtxRetain(CUcontext *, int);
int cuCtxSetCurrent(CUcontext);
int cuMemAlloc_v2(CUdeviceptr *, size_t);
int cuMemFree_v2(CUdeviceptr);
int cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
int cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
int cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
int cuStreamCreate(CUstream *, unsigned);
int cuStreamSynchronize(CUstream);
int cuStreamBeginCapture_v2(CUstream, int);
int cuStreamEndCapture(CUstream, void **);
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
int cuMemGetAllocationGranularity(size_t *, const CUmemAllocationProp *, int);
int cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
int cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
int cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
int cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
int cuMemRelease(CUmemGenericAllocationHandle);
int cuMemUnmap(CUdeviceptr, size_t);
int cuMemAddressFree(CUdeviceptr, size_t);

#define CU(x) do { int r_ = (x); if (r_ != 0) { fprintf(stderr, "%s:%d: %s = %d\n", __FILE__, __LINE__, #x, r_); exit(2); } } while (0)
#define CK(x) do { int r_ = (x); if (r_ != 0) { fprintf(stderr, "%s:%d: %s = %d: %s\n", __FILE__, __LINE__, #x, r_, ckpt_last_error()); exit(3); } } while (0)

#define A_BYTES (3u << 20)
#define B_BYTES ((1u << 20) + 4096)

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 2654435761u + seed * 97u) >> 5);
}

static CUdeviceptr dev_alloc(size_t n, unsigned seed) {
    CUdeviceptr d;
    CU(cuMemAlloc_v2(&d, n));
    unsigned char *h = malloc(n);
    fill(h, n, seed);
    CU(cuMemcpyHtoD_v2(d, h, n));
    free(h);
    return d;
}

/* After the sidecar was killed with save `id` unreleased: the save fails,
 * and device work on `stream` (writing `b`, read back through `scratch`)
 * still runs. 0, or the exit status naming what went wrong. */
static int train_on_after_sidecar_died(ckpt_client *c, uint64_t id, CUstream stream, CUdeviceptr b,
                                       unsigned char *scratch, unsigned seed) {
    int r = ckpt_wait(c, id, CKPT_RELEASED, 120000);
    if (r == CKPT_OK) { fprintf(stderr, "the save was released although the sidecar was killed\n"); return 5; }
    fprintf(stderr, "save failed as expected: %s\n", ckpt_last_error());
    unsigned char *h = malloc(B_BYTES);
    fill(h, B_BYTES, seed);
    CU(cuMemcpyHtoDAsync_v2(b, h, B_BYTES, stream));
    CU(cuStreamSynchronize(stream));
    CU(cuMemcpyDtoH_v2(scratch, b, B_BYTES));
    if (memcmp(h, scratch, B_BYTES)) { fprintf(stderr, "device memory wrong after the sidecar died\n"); return 6; }
    printf("trained on\n");
    return 0;
}

static int refused(ckpt_client *c) {
    CUdeviceptr d = dev_alloc(4096, 1);
    uint32_t rid;
    int r = ckpt_register_cuda(c, (void *)(uintptr_t)d, &rid);
    if (r == CKPT_OK) { fprintf(stderr, "a sidecar without CUDA registered device memory\n"); return 4; }
    printf("refused: %s\n", ckpt_last_error());
    return 0;
}

#define MANY 64
#define MANY_BYTES (64u << 10)

static int many(ckpt_client *c, CUstream stream) {
    static CUdeviceptr d[MANY];
    static char names[2 * MANY][32];
    static unsigned char want[MANY][MANY_BYTES], got[MANY_BYTES];
    static uint64_t shape[1] = {MANY_BYTES / 2};
    static unsigned char zero[MANY_BYTES + 8192];
    ckpt_tensor t[2 * MANY];
    for (int i = 0; i < MANY; i++) {
        d[i] = dev_alloc(MANY_BYTES + 8192, 100 + i);
        uint32_t rid;
        CK(ckpt_register_cuda(c, (void *)(uintptr_t)(d[i] + 100), &rid));
        fill(want[i], MANY_BYTES, 200 + i);
        CU(cuMemcpyHtoDAsync_v2(d[i], want[i], MANY_BYTES / 2, stream));
        CU(cuMemcpyHtoDAsync_v2(d[i] + MANY_BYTES / 2 + 8192, want[i] + MANY_BYTES / 2, MANY_BYTES / 2, stream));
        snprintf(names[2 * i], 32, "t%d.lo", i);
        snprintf(names[2 * i + 1], 32, "t%d.hi", i);
        t[2 * i] = (ckpt_tensor){names[2 * i], "U8", shape, 1, (void *)(uintptr_t)d[i], MANY_BYTES / 2};
        t[2 * i + 1] = (ckpt_tensor){names[2 * i + 1], "U8", shape, 1, (void *)(uintptr_t)(d[i] + MANY_BYTES / 2 + 8192), MANY_BYTES / 2};
    }
    uint64_t id, got_step;
    int source;
    CK(ckpt_save_on_stream(c, 9, t, 2 * MANY, NULL, 0, stream, &id));
    CK(ckpt_wait(c, id, CKPT_DURABLE, 120000));
    CU(cuStreamSynchronize(stream));
    for (int i = 0; i < MANY; i++) CU(cuMemcpyHtoD_v2(d[i], zero, sizeof zero));
    CK(ckpt_load(c, 9, t, 2 * MANY, &got_step, &source));
    for (int i = 0; i < MANY; i++) {
        CU(cuMemcpyDtoH_v2(got, d[i], MANY_BYTES / 2));
        CU(cuMemcpyDtoH_v2(got + MANY_BYTES / 2, d[i] + MANY_BYTES / 2 + 8192, MANY_BYTES / 2));
        if (memcmp(got, want[i], MANY_BYTES)) { fprintf(stderr, "allocation %d differs after the round trip\n", i); return 11; }
        CU(cuMemFree_v2(d[i]));
    }
    CK(ckpt_close(c));
    printf("ok\n");
    return 0;
}

/* A VMM allocation of `n` bytes (a multiple of the granularity), mapped
 * read-write; exportable as a POSIX fd when `exportable`. The handle is
 * released at once: the mapping keeps the memory, as PyTorch's expandable
 * segments do. */
static CUdeviceptr vmm_alloc(size_t n, int exportable) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;                                 /* PINNED */
    /* POSIX_FILE_DESCRIPTOR (1), or CKPT_TEST_VMM_HANDLE_TYPES (8: FABRIC only, as
     * PyTorch's expandable segments where an IMEX channel exists). */
    const char *types = getenv("CKPT_TEST_VMM_HANDLE_TYPES");
    prop.requestedHandleTypes = exportable ? (types && *types ? atoi(types) : 1) : 0;
    prop.location.type = 1;                        /* DEVICE */
    prop.location.id = 0;
    size_t g;
    CU(cuMemGetAllocationGranularity(&g, &prop, 0));
    if (n % g) { fprintf(stderr, "%zu is not a multiple of the granularity %zu\n", n, g); exit(2); }
    CUmemGenericAllocationHandle h;
    CU(cuMemCreate(&h, n, &prop, 0));
    CUdeviceptr d;
    CU(cuMemAddressReserve(&d, n, 0, 0, 0));
    CU(cuMemMap(d, n, 0, h, 0));
    CUmemAccessDesc access = {{1, 0}, 3};          /* device 0, READWRITE */
    CU(cuMemSetAccess(d, n, &access, 1));
    CU(cuMemRelease(h));
    return d;
}

static void vmm_free(CUdeviceptr d, size_t n) {
    CU(cuMemUnmap(d, n));
    CU(cuMemAddressFree(d, n));
}

#define VA_BYTES ((size_t)4 << 20)
#define VB_BYTES ((size_t)2 << 20)
#define VT1_BYTES ((size_t)1 << 20)
#define VT2_OFF (((size_t)1 << 20) + 8192)
#define VT2_BYTES (((size_t)2 << 20) + 4096)
#define VT3_BYTES (((size_t)2 << 20) - 4096)

static uint64_t vs1[1] = {VT1_BYTES}, vs2[1] = {VT2_BYTES / 4}, vs3[1] = {VT3_BYTES};

/* The saved state of the VMM modes: what each tensor must hold. */
static void vmm_want(unsigned char *a, unsigned char *b) {
    fill(a, VA_BYTES, 31);
    fill(b, VB_BYTES, 32);
}

static int vmm_unexportable(ckpt_client *c) {
    CUdeviceptr d = vmm_alloc(VB_BYTES, 0);
    uint32_t rid;
    if (ckpt_register_cuda(c, (void *)(uintptr_t)d, &rid) == CKPT_OK) { fprintf(stderr, "an unexportable VMM allocation was registered\n"); return 4; }
    printf("refused: %s\n", ckpt_last_error());
    vmm_free(d, VB_BYTES);
    return 0;
}

static int vmm_check(ckpt_client *c) {
    unsigned char *wa = malloc(VA_BYTES), *wb = malloc(VB_BYTES), *got = malloc(8u << 20);
    vmm_want(wa, wb);
    CUdeviceptr r = dev_alloc(8u << 20, 7);
    uint32_t rr;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)r, &rr));
    ckpt_tensor l[3] = {
        {"v.first", "U8", vs1, 1, (void *)(uintptr_t)r, VT1_BYTES},
        {"v.second", "F32", vs2, 1, (void *)(uintptr_t)(r + (2u << 20)), VT2_BYTES},
        {"w", "U8", vs3, 1, (void *)(uintptr_t)(r + (5u << 20)), VT3_BYTES},
    };
    uint64_t got_step;
    int source;
    CK(ckpt_load(c, 5, l, 3, &got_step, &source));
    CU(cuMemcpyDtoH_v2(got, r, 8u << 20));
    if (got_step != 5) { fprintf(stderr, "loaded step %llu\n", (unsigned long long)got_step); return 7; }
    if (memcmp(got, wa, VT1_BYTES) || memcmp(got + (2u << 20), wa + VT2_OFF, VT2_BYTES) || memcmp(got + (5u << 20), wb + 4096, VT3_BYTES)) {
        fprintf(stderr, "the committed VMM snapshot differs from what was saved\n");
        return 8;
    }
    CK(ckpt_close(c));
    printf("ok\n");
    return 0;
}

static int vmm(ckpt_client *c, CUstream stream, const char *mode) {
    CUdeviceptr a = vmm_alloc(VA_BYTES, 1), b = vmm_alloc(VB_BYTES, 1);
    uint32_t ra, ra2, rb;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)(a + VT2_OFF), &ra));
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)a, &ra2));
    if (ra != ra2) { fprintf(stderr, "one VMM allocation, two regions: %u %u\n", ra, ra2); return 4; }
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)b, &rb));
    ckpt_tensor t[3] = {
        {"v.first", "U8", vs1, 1, (void *)(uintptr_t)a, VT1_BYTES},
        {"v.second", "F32", vs2, 1, (void *)(uintptr_t)(a + VT2_OFF), VT2_BYTES},
        {"w", "U8", vs3, 1, (void *)(uintptr_t)(b + 4096), VT3_BYTES},
    };
    unsigned char *wa = malloc(VA_BYTES), *wb = malloc(VB_BYTES);
    vmm_want(wa, wb);
    /* The state to save: written by late async copies on the trainer's stream. */
    CU(cuMemcpyHtoDAsync_v2(a, wa, VA_BYTES, stream));
    CU(cuMemcpyHtoDAsync_v2(b, wb, VB_BYTES, stream));
    uint64_t id;
    CK(ckpt_save_on_stream(c, 5, t, 3, NULL, 0, stream, &id));
    CK(ckpt_wait(c, id, CKPT_RELEASED, 120000));
    if (!strcmp(mode, "vmm-die-after-release")) {
        printf("released\n");
        fflush(stdout);
        raise(SIGKILL);
    }
    /* Released: the next step overwrites the tensors at once. */
    unsigned char *next = malloc(VA_BYTES), *got = malloc(VA_BYTES);
    fill(next, VA_BYTES, 41);
    CU(cuMemcpyHtoDAsync_v2(a, next, VA_BYTES, stream));
    CU(cuMemcpyHtoDAsync_v2(b, next, VB_BYTES, stream));
    CK(ckpt_wait(c, id, CKPT_DURABLE, 120000));
    CU(cuStreamSynchronize(stream));
    uint64_t got_step;
    int source;
    CK(ckpt_load(c, 5, t, 3, &got_step, &source));
    CU(cuMemcpyDtoH_v2(got, a, VA_BYTES));
    if (memcmp(got, wa, VT1_BYTES) || memcmp(got + VT2_OFF, wa + VT2_OFF, VT2_BYTES)) { fprintf(stderr, "allocation a differs after the VMM round trip\n"); return 8; }
    if (memcmp(got + VT1_BYTES, next + VT1_BYTES, VT2_OFF - VT1_BYTES)) { fprintf(stderr, "the load wrote outside its tensors\n"); return 9; }
    CU(cuMemcpyDtoH_v2(got, b, VB_BYTES));
    if (memcmp(got + 4096, wb + 4096, VT3_BYTES)) { fprintf(stderr, "allocation b differs after the VMM round trip\n"); return 10; }
    CK(ckpt_unregister_cuda(c, (void *)(uintptr_t)b));
    CK(ckpt_close(c));
    vmm_free(a, VA_BYTES);
    vmm_free(b, VB_BYTES);
    printf("ok\n");
    return 0;
}

/* The fake driver's counter `key` in the sidecar's process (-1: unknown). */
static long sidecar_stat(const char *key) {
    const char *path = getenv("CKPT_TEST_SIDECAR_STATS");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return -1;
    char k[64];
    long v, got = -1;
    while (fscanf(f, "%63s %ld", k, &v) == 2)
        if (!strcmp(k, key)) got = v;
    fclose(f);
    return got;
}

static int realloc_mode(ckpt_client *c, CUstream stream) {
    const size_t n = A_BYTES, small = 1u << 20;
    CUdeviceptr a = dev_alloc(n, 1);
    uint32_t rid;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)a, &rid));
    uint64_t s1[1] = {n}, s3[1] = {small};
    /* The trainer's descriptors stay as they are (a kept save plan): same address, same size. */
    ckpt_tensor t[1] = {{"w", "U8", s1, 1, (void *)(uintptr_t)a, n}};
    unsigned char *want[3] = {malloc(n), malloc(n), malloc(n)}, *got = malloc(n);
    long open_after[2] = {-1, -1};
    uint64_t id;
    for (int k = 0; k < 3; k++) {
        size_t len = k == 2 ? small : n;
        if (k > 0) {
            CU(cuMemFree_v2(a));
            CUdeviceptr again = dev_alloc(len, 90 + k);
            if (again != a) { fprintf(stderr, "the driver did not reuse the freed address (%llx, then %llx)\n", a, again); return 20; }
        }
        if (k == 2) t[0] = (ckpt_tensor){"w", "U8", s3, 1, (void *)(uintptr_t)a, small};
        fill(want[k], len, 80 + k);
        CU(cuMemcpyHtoDAsync_v2(a, want[k], len, stream));
        CK(ckpt_save_on_stream(c, 20 + k, t, 1, NULL, 0, stream, &id));
        CK(ckpt_wait(c, id, CKPT_DURABLE, 120000));
        if (k > 0) open_after[k - 1] = sidecar_stat("imports_open");
    }
    CU(cuStreamSynchronize(stream));
    CUdeviceptr r = dev_alloc(n, 3);
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)r, &rid));
    for (int k = 0; k < 3; k++) {
        size_t len = k == 2 ? small : n;
        ckpt_tensor l[1] = {{"w", "U8", k == 2 ? s3 : s1, 1, (void *)(uintptr_t)r, len}};
        uint64_t got_step;
        int source;
        CK(ckpt_load(c, 20 + k, l, 1, &got_step, &source));
        CU(cuMemcpyDtoH_v2(got, r, len));
        if (memcmp(got, want[k], len)) { fprintf(stderr, "step %d does not hold the bytes of the allocation saved then\n", 20 + k); return 21; }
    }
    CK(ckpt_close(c));
    printf("open=%ld,%ld\nok\n", open_after[0], open_after[1]);
    return 0;
}

#define CHUNK ((size_t)2 << 20)

/* `n` VMM chunks of CHUNK bytes, each its own cuMemCreate (exportable as a
 * POSIX fd), mapped back to back into one reserved range; chunk k is left
 * unmapped when bit k of `holes` is set. */
static CUdeviceptr vmm_chunks(int n, unsigned holes) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.requestedHandleTypes = 1;
    prop.location.type = 1;
    CUdeviceptr base;
    CU(cuMemAddressReserve(&base, n * CHUNK, 0, 0, 0));
    for (int k = 0; k < n; k++) {
        if (holes & (1u << k)) continue;
        CUmemGenericAllocationHandle h;
        CU(cuMemCreate(&h, CHUNK, &prop, 0));
        CU(cuMemMap(base + k * CHUNK, CHUNK, 0, h, 0));
        CUmemAccessDesc access = {{1, 0}, 3};
        CU(cuMemSetAccess(base + k * CHUNK, CHUNK, &access, 1));
        CU(cuMemRelease(h));
    }
    return base;
}

static int span(ckpt_client *c, CUstream stream) {
    const size_t total = 4 * CHUNK, MiB = 1u << 20;
    CUdeviceptr b = vmm_chunks(4, 0);
    /* t1 crosses chunks 0-1, t2 chunks 1-2-3, t3 lies inside chunk 3. */
    size_t off[3] = {MiB, 3 * MiB + 4096, 7 * MiB}, len[3] = {2 * MiB, 4 * MiB - 4096, MiB};
    uint64_t s1[1] = {2 * MiB / 4}, s2[1] = {4 * MiB - 4096}, s3[1] = {MiB};
    ckpt_tensor t[3] = {
        {"t1", "F32", s1, 1, (void *)(uintptr_t)(b + off[0]), len[0]},
        {"t2", "U8", s2, 1, (void *)(uintptr_t)(b + off[1]), len[1]},
        {"t3", "U8", s3, 1, (void *)(uintptr_t)(b + off[2]), len[2]},
    };
    uint32_t r0, r2;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)(b + off[0]), &r0));
    CK(ckpt_register_cuda_range(c, (void *)(uintptr_t)(b + off[1]), len[1], &r2));
    unsigned char *want = malloc(total), *next = malloc(total), *got = malloc(total);
    fill(want, total, 61);
    fill(next, total, 62);
    CU(cuMemcpyHtoDAsync_v2(b, want, total, stream));
    uint64_t id, got_step;
    int source;
    CK(ckpt_save_on_stream(c, 4, t, 3, NULL, 0, stream, &id));
    CK(ckpt_wait(c, id, CKPT_RELEASED, 120000));
    CU(cuMemcpyHtoDAsync_v2(b, next, total, stream));
    CK(ckpt_wait(c, id, CKPT_DURABLE, 120000));
    CU(cuStreamSynchronize(stream));
    CK(ckpt_load(c, 4, t, 3, &got_step, &source));
    CU(cuMemcpyDtoH_v2(got, b, total));
    for (int k = 0; k < 3; k++)
        if (memcmp(got + off[k], want + off[k], len[k])) { fprintf(stderr, "t%d differs after the round trip across chunks\n", k + 1); return 30; }
    if (memcmp(got, next, off[0]) || memcmp(got + off[0] + len[0], next + off[0] + len[0], off[1] - off[0] - len[0])) {
        fprintf(stderr, "the load wrote outside its tensors\n");
        return 31;
    }
    /* Chunk 1 of this range is not mapped: a range into it is refused. */
    CUdeviceptr h = vmm_chunks(2, 2u);
    uint32_t rh;
    if (ckpt_register_cuda_range(c, (void *)(uintptr_t)(h + MiB), 2 * MiB, &rh) == CKPT_OK) { fprintf(stderr, "a range into unmapped memory was registered\n"); return 32; }
    printf("refused: %s\n", ckpt_last_error());
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)h, &rh));
    ckpt_tensor bad[1] = {{"bad", "U8", s1, 1, (void *)(uintptr_t)(h + MiB), 2 * MiB}};
    if (ckpt_save_on_stream(c, 5, bad, 1, NULL, 0, stream, &id) == CKPT_OK) { fprintf(stderr, "a tensor running into unmapped memory was saved\n"); return 33; }
    printf("save refused: %s\n", ckpt_last_error());
    CK(ckpt_close(c));
    for (int k = 0; k < 4; k++) CU(cuMemUnmap(b + k * CHUNK, CHUNK));
    CU(cuMemAddressFree(b, total));
    printf("ok\n");
    return 0;
}

static int guarded(ckpt_client *c, CUstream stream, int guard) {
    CUdeviceptr a = dev_alloc(A_BYTES, 1);
    unsigned char *want = malloc(A_BYTES), *next = malloc(A_BYTES), *got = malloc(A_BYTES);
    fill(want, A_BYTES, 51);
    fill(next, A_BYTES, 52);
    CU(cuMemcpyHtoD_v2(a, want, A_BYTES));
    uint32_t ra;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)a, &ra));
    uint64_t s1[1] = {A_BYTES};
    ckpt_tensor t[1] = {{"a", "U8", s1, 1, (void *)(uintptr_t)a, A_BYTES}};
    uint64_t id;
    CK(ckpt_save_on_stream(c, 6, t, 1, NULL, 0, stream, &id));
    if (guard) {
        int on_stream = -1, state = -1;
        CK(ckpt_stream_wait_copy(c, id, stream, 120000, &on_stream));
        CK(ckpt_poll(c, id, &state));
        /* With the fake's late copies the save is still pending here: the CPU did not wait for the copy. */
        printf("on_stream=%d state=%s\n", on_stream, state == CKPT_PENDING ? "pending" : "not-pending");
    }
    /* The next step overwrites the tensor on the same stream, at once. */
    CU(cuMemcpyHtoDAsync_v2(a, next, A_BYTES, stream));
    CK(ckpt_wait(c, id, CKPT_DURABLE, 120000));
    CU(cuStreamSynchronize(stream));
    CU(cuMemcpyHtoD_v2(a, want + 1, A_BYTES - 1)); /* neither: the load must bring the snapshot back */
    uint64_t got_step;
    int source;
    CK(ckpt_load(c, 6, t, 1, &got_step, &source));
    CU(cuMemcpyDtoH_v2(got, a, A_BYTES));
    printf("snapshot=%s\n", !memcmp(got, want, A_BYTES) ? "saved" : !memcmp(got, next, A_BYTES) ? "overwritten" : "garbled");
    CK(ckpt_close(c));
    return 0;
}

static int capture(ckpt_client *c, CUstream stream) {
    CUdeviceptr a = dev_alloc(A_BYTES, 1);
    uint32_t ra;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)a, &ra));
    uint64_t s1[1] = {A_BYTES}, id;
    ckpt_tensor t[1] = {{"a", "U8", s1, 1, (void *)(uintptr_t)a, A_BYTES}};
    void *graph;
    /* CU_STREAM_CAPTURE_MODE_RELAXED (2): the shim's own calls stay legal. */
    CU(cuStreamBeginCapture_v2(stream, 2));
    int r = ckpt_save_on_stream(c, 4, t, 1, NULL, 0, stream, &id);
    CU(cuStreamEndCapture(stream, &graph));
    if (r == CKPT_OK) { fprintf(stderr, "a save on a capturing stream was accepted\n"); return 4; }
    printf("capture-save=refused: %s\n", ckpt_last_error());
    CK(ckpt_save_on_stream(c, 4, t, 1, NULL, 0, stream, &id));
    int on_stream = -1, state = -1;
    CU(cuStreamBeginCapture_v2(stream, 2));
    r = ckpt_stream_wait_copy(c, id, stream, 120000, &on_stream);
    CU(cuStreamEndCapture(stream, &graph));
    CK(r);
    CK(ckpt_poll(c, id, &state));
    printf("capture-guard on_stream=%d state=%s\n", on_stream, state == CKPT_PENDING ? "pending" : "not-pending");
    CK(ckpt_wait(c, id, CKPT_DURABLE, 120000));
    CK(ckpt_close(c));
    return 0;
}

static int parts(ckpt_client *c, CUstream stream) {
    ckpt_client *r[2];
    CUdeviceptr d[2];
    unsigned char *want[2];
    uint64_t id[2], s1[1] = {B_BYTES};
    char names[2][16];
    ckpt_tensor t[2];
    for (int k = 0; k < 2; k++) {
        CK(ckpt_connect(NULL, &r[k]));
        CK(ckpt_set_rank(r[k], (uint32_t)k, 2));
        d[k] = dev_alloc(B_BYTES, 60 + k);
        want[k] = malloc(B_BYTES);
        fill(want[k], B_BYTES, 70 + k);
        uint32_t rid;
        CK(ckpt_register_cuda(r[k], (void *)(uintptr_t)d[k], &rid));
        CU(cuMemcpyHtoDAsync_v2(d[k], want[k], B_BYTES, stream));
        snprintf(names[k], sizeof names[k], "part%d.w", k);
        t[k] = (ckpt_tensor){names[k], "U8", s1, 1, (void *)(uintptr_t)d[k], B_BYTES};
        CK(ckpt_save_on_stream(r[k], 8, &t[k], 1, NULL, 0, stream, &id[k]));
    }
    for (int k = 0; k < 2; k++) CK(ckpt_wait(r[k], id[k], CKPT_DURABLE, 120000));
    CU(cuStreamSynchronize(stream));
    CUdeviceptr back = dev_alloc(2 * B_BYTES + 4096, 9);
    uint32_t rb;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)back, &rb));
    ckpt_tensor l[2] = {
        {"part0.w", "U8", s1, 1, (void *)(uintptr_t)back, B_BYTES},
        {"part1.w", "U8", s1, 1, (void *)(uintptr_t)(back + B_BYTES + 4096), B_BYTES},
    };
    uint64_t got_step;
    int source;
    CK(ckpt_load(c, 8, l, 2, &got_step, &source));
    unsigned char *got = malloc(B_BYTES);
    for (int k = 0; k < 2; k++) {
        CU(cuMemcpyDtoH_v2(got, back + (CUdeviceptr)k * (B_BYTES + 4096), B_BYTES));
        if (memcmp(got, want[k], B_BYTES)) { fprintf(stderr, "rank %d's part differs after the round trip\n", k); return 13; }
        CK(ckpt_close(r[k]));
    }
    CK(ckpt_close(c));
    printf("ok\n");
    return 0;
}

static int free_and_reuse(ckpt_client *c, CUstream stream) {
    size_t n = 6u << 20;
    CUdeviceptr a = dev_alloc(n, 31);
    uint32_t rid;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)a, &rid));
    uint64_t s1[1] = {n};
    ckpt_tensor t[1] = {{"w", "U8", s1, 1, (void *)(uintptr_t)a, n}};
    uint64_t id;
    CK(ckpt_save_on_stream(c, 1, t, 1, NULL, 0, stream, &id));
    CK(ckpt_wait(c, id, CKPT_DURABLE, 120000));
    CU(cuStreamSynchronize(stream));
    CU(cuMemFree_v2(a));
    CUdeviceptr b;
    int r = cuMemAlloc_v2(&b, n);
    if (r != 0) { printf("realloc failed: %d\n", r); return 0; }
    if (b != a) { fprintf(stderr, "the fake did not reuse the freed address\n"); return 21; }
    unsigned char *h = malloc(n);
    fill(h, n, 32);
    CU(cuMemcpyHtoD_v2(b, h, n));
    ckpt_client *c2;
    CK(ckpt_connect(NULL, &c2));
    uint32_t rid2;
    if (ckpt_register_cuda(c2, (void *)(uintptr_t)b, &rid2) != CKPT_OK) { printf("second client refused: %s\n", ckpt_last_error()); return 0; }
    t[0].data = (void *)(uintptr_t)b;
    CK(ckpt_save_on_stream(c2, 2, t, 1, NULL, 0, stream, &id));
    CK(ckpt_wait(c2, id, CKPT_DURABLE, 120000));
    CK(ckpt_close(c2));
    CK(ckpt_close(c));
    CU(cuMemFree_v2(b));
    printf("ok\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: cuda_trainer MODE\n"); return 2; }
    const char *mode = argv[1];
    CUcontext ctx;
    int dev;
    CU(cuInit(0));
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CUstream stream;
    CU(cuStreamCreate(&stream, 1));

    ckpt_client *c;
    CK(ckpt_connect(NULL, &c));
    CK(ckpt_cuda_probe());
    if (!strcmp(mode, "refused")) return refused(c);
    if (!strcmp(mode, "many")) return many(c, stream);
    if (!strcmp(mode, "vmm-unexportable")) return vmm_unexportable(c);
    if (!strcmp(mode, "parts")) return parts(c, stream);
    if (!strcmp(mode, "capture")) return capture(c, stream);
    if (!strcmp(mode, "realloc")) return realloc_mode(c, stream);
    if (!strcmp(mode, "span")) return span(c, stream);
    if (!strcmp(mode, "free-and-reuse")) return free_and_reuse(c, stream);
    if (!strcmp(mode, "guard") || !strcmp(mode, "no-guard")) return guarded(c, stream, !strcmp(mode, "guard"));
    if (!strcmp(mode, "vmm-check")) return vmm_check(c);
    if (!strncmp(mode, "vmm-", 4)) return vmm(c, stream, mode);
    CUdeviceptr a = dev_alloc(A_BYTES, 1), b = dev_alloc(B_BYTES, 2);
    uint32_t ra, ra2, rb;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)(a + 4096), &ra));
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)a, &ra2));
    if (ra != ra2) { fprintf(stderr, "one allocation, two regions: %u %u\n", ra, ra2); return 4; }
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)b, &rb));

    /* Tensors: a[0..1 MiB), a[1 MiB + 8192 .. +1 MiB), all of b. */
    uint64_t s1[1] = {1u << 20}, s2[1] = {1u << 18}, s3[1] = {B_BYTES};
    ckpt_tensor t[3] = {
        {"a.first", "U8", s1, 1, (void *)(uintptr_t)a, 1u << 20},
        {"a.second", "F32", s2, 1, (void *)(uintptr_t)(a + (1u << 20) + 8192), 1u << 20},
        {"b", "U8", s3, 1, (void *)(uintptr_t)b, B_BYTES},
    };

    /* The state to save: written by a late async copy on the trainer's stream. */
    unsigned char *want_a = malloc(A_BYTES), *want_b = malloc(B_BYTES);
    fill(want_a, A_BYTES, 11);
    fill(want_b, B_BYTES, 12);
    CU(cuMemcpyHtoDAsync_v2(a, want_a, A_BYTES, stream));
    CU(cuMemcpyHtoDAsync_v2(b, want_b, B_BYTES, stream));
    uint64_t id;
    CK(ckpt_save_on_stream(c, 5, t, 3, NULL, 0, stream, &id));

    if (!strcmp(mode, "die-before-release")) {
        printf("saved\n");
        fflush(stdout);
        for (;;) pause();
    }
    if (!strcmp(mode, "die-mid-copy")) {
        CU(cuStreamSynchronize(stream));
        printf("synced\n");
        fflush(stdout);
        for (;;) pause();
    }
    if (!strcmp(mode, "sidecar-dies-guarded")) {
        int on_stream = -1;
        CK(ckpt_stream_wait_copy(c, id, stream, 120000, &on_stream));
        printf("guarded on_stream=%d\n", on_stream);
        fflush(stdout);
        /* The next step on the stream that waited on the copy: it must run. */
        return train_on_after_sidecar_died(c, id, stream, b, want_b, 98);
    }
    if (!strcmp(mode, "sidecar-dies")) {
        printf("saved\n");
        fflush(stdout);
        /* Training goes on: more device work, no checkpoint needed. */
        return train_on_after_sidecar_died(c, id, stream, b, want_b, 99);
    }

    CK(ckpt_wait(c, id, CKPT_RELEASED, 120000));
    if (!strcmp(mode, "die-after-release")) {
        printf("released\n");
        fflush(stdout);
        raise(SIGKILL);
    }
    /* Released: the next step may overwrite the tensors at once. */
    unsigned char *next = malloc(A_BYTES);
    fill(next, A_BYTES, 21);
    CU(cuMemcpyHtoDAsync_v2(a, next, A_BYTES, stream));
    CK(ckpt_wait(c, id, CKPT_DURABLE, 120000));
    CU(cuStreamSynchronize(stream));

    /* Restore into a third allocation, at other offsets. */
    CUdeviceptr r = dev_alloc(5u << 20, 3);
    uint32_t rr;
    CK(ckpt_register_cuda(c, (void *)(uintptr_t)r, &rr));
    ckpt_tensor l[3] = {
        {"a.first", "U8", s1, 1, (void *)(uintptr_t)(r + 4096), 1u << 20},
        {"a.second", "F32", s2, 1, (void *)(uintptr_t)(r + (2u << 20)), 1u << 20},
        {"b", "U8", s3, 1, (void *)(uintptr_t)(r + (3u << 20) + 4096), B_BYTES},
    };
    uint64_t got_step;
    int source;
    CK(ckpt_load(c, 5, l, 3, &got_step, &source));
    unsigned char *got = malloc(5u << 20);
    CU(cuMemcpyDtoH_v2(got, r, 5u << 20));
    if (got_step != 5) { fprintf(stderr, "loaded step %llu\n", (unsigned long long)got_step); return 7; }
    if (memcmp(got + 4096, want_a, 1u << 20)) { fprintf(stderr, "a.first differs after the round trip\n"); return 8; }
    if (memcmp(got + (2u << 20), want_a + (1u << 20) + 8192, 1u << 20)) { fprintf(stderr, "a.second differs after the round trip\n"); return 9; }
    if (memcmp(got + (3u << 20) + 4096, want_b, B_BYTES)) { fprintf(stderr, "b differs after the round trip\n"); return 10; }
    CK(ckpt_unregister_cuda(c, (void *)(uintptr_t)r));
    CK(ckpt_close(c));
    CU(cuMemFree_v2(a));
    CU(cuMemFree_v2(b));
    CU(cuMemFree_v2(r));
    printf("ok\n");
    return 0;
}
