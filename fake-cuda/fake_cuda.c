/*
 * A fake CUDA driver (libcuda.so.1) for tests: the subset of the driver API
 * the product uses, on host memory, with the cross-process semantics that
 * matter. TEST-ONLY: never installed, bundled or shipped.
 *
 * - "Device memory" (cuMemAlloc_v2) is a POSIX shm object mapped read-write;
 *   the device pointer is its address in the process. Its legacy IPC handle
 *   names the object, so cuIpcOpenMemHandle_v2 in another process maps the
 *   same bytes.
 * - Streams are worker threads. Asynchronous copies sleep
 *   FAKE_CUDA_COPY_DELAY_US (default 2000; read at the process's first
 *   cuInit) before copying: late on purpose,
 *   so a missing stream wait or event shows up as wrong bytes.
 * - Events live in a small shm object shared by every process that opens
 *   them: cuEventRecord numbers the record and queues "completed = n" on the
 *   stream; cuStreamWaitEvent queues a wait for the number recorded when it
 *   is called. An event completes only when the work queued before it has.
 *   A wait on an event whose creating process, or the process that last
 *   recorded it, is gone ends (assumed: the real driver tears a dead
 *   process's context and its queued work down; unverified).
 * - VMM (cuMemCreate & co.): a physical allocation is a memfd, reference
 *   counted by its handles and mappings; cuMemExportToShareableHandle with
 *   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR gives a dup of it, so the bytes
 *   outlive the exporter as long as an importer holds them (as the real
 *   driver's do). cuMemAddressReserve reserves PROT_NONE address space,
 *   cuMemMap maps the memfd there still inaccessible, and only cuMemSetAccess
 *   makes it readable and writable: an importer that forgets it faults.
 *   Mapped VMM memory is not legacy-IPC capable (cuIpcGetMemHandle refuses).
 *   Several cuMemMap at consecutive offsets of one reserved range (PyTorch's
 *   expandable segments) are separate mappings: cuMemGetAddressRange and
 *   cuMemRetainAllocationHandle on a pointer answer for the mapping holding
 *   it (as the real driver does: the chunk, not the reservation); a reserved
 *   address with nothing mapped is unknown memory.
 * - Allocation identity: every mapping gets a CU_POINTER_ATTRIBUTE_BUFFER_ID
 *   never given before; cuMemFree_v2 keeps the freed address range reserved
 *   and the next cuMemAlloc_v2 that fits lands there, as real drivers often
 *   do, so a stale cache keyed by address shows up as wrong bytes.
 * - Counters: with FAKE_CUDA_STATS_DIR set, the file <dir>/<pid> says how many
 *   imported allocations are open ("imports_open N": legacy IPC opens and
 *   imported VMM handles not yet released), how many were ever opened, how
 *   many host ranges are registered and how many VMM mappings exist
 *   ("vmm_maps N").
 *
 * What it does not prove: real DMA bandwidth, pinned-memory behaviour,
 * multi-GPU, peer access, or the real driver's error cases.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fctx *CUcontext;
typedef struct fstream *CUstream;
typedef struct fevent *CUevent;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_UNKNOWN = 999,
};

#define MEM_MAGIC "FKCUMEM"
#define EVT_MAGIC "FKCUEVT"
#define NAME_MAX_BYTES 48
#define ALLOCS_MAX 4096

struct fctx { int device; };
static struct fctx g_ctx = { 0 };
static __thread CUcontext t_current;
static atomic_int g_init;
static long g_delay_us = 2000;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
/* A VMM physical allocation: a memfd, alive while handles or mappings hold it. */
struct vmm { int fd; size_t size; int refs; int imported; int handle_types; };
/* A mapping of device memory: cuMemAlloc, a legacy IPC import, or a VMM
 * mapping (vmm set); id: its CU_POINTER_ATTRIBUTE_BUFFER_ID (never reused). */
struct alloc { uintptr_t base; size_t size; int imported; char name[NAME_MAX_BYTES]; struct vmm *vmm; unsigned long long id; };
static struct alloc g_allocs[ALLOCS_MAX];
static unsigned long g_seq;
static unsigned long long g_buffer_ids;
/* Address ranges cuMemFree_v2 gave back, kept reserved (PROT_NONE) so the
 * next cuMemAlloc_v2 that fits reuses the address, as real drivers do. */
#define HOLES_MAX 256
struct hole { uintptr_t base; size_t size; };
static struct hole g_holes[HOLES_MAX];
static long g_imports_open, g_imports_total, g_host_registered, g_vmm_maps;

static void write_stats_locked(void) {
    const char *dir = getenv("FAKE_CUDA_STATS_DIR");
    if (!dir || !*dir) return;
    char path[512], tmp[520], buf[256];
    snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int n = snprintf(buf, sizeof buf, "imports_open %ld\nimports_total %ld\nhost_registered %ld\nvmm_maps %ld\n", g_imports_open, g_imports_total, g_host_registered, g_vmm_maps);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return;
    if (write(fd, buf, n) == n) rename(tmp, path);
    close(fd);
}

static struct alloc *find_alloc_locked(uintptr_t p) {
    for (int i = 0; i < ALLOCS_MAX; i++)
        if (g_allocs[i].base && p >= g_allocs[i].base && p < g_allocs[i].base + g_allocs[i].size) return &g_allocs[i];
    return NULL;
}

static struct alloc *free_slot_locked(void) {
    for (int i = 0; i < ALLOCS_MAX; i++)
        if (!g_allocs[i].base) return &g_allocs[i];
    return NULL;
}

#define NEED_INIT() do { if (!atomic_load(&g_init)) return E_NOT_INITIALIZED; } while (0)

/* ---- streams: one worker thread each ---- */

/* recorder_pid: the last process that recorded the event (an importer may
 * record it too: the sidecar's done event). */
struct evshared { _Atomic uint64_t recorded; _Atomic uint64_t completed; int owner_pid; _Atomic int recorder_pid; };

/* Whether the process that created an event is gone (dead or a zombie): the
 * driver tears its context down, so waits on its events end. */
static int owner_gone(int pid) {
    if (kill(pid, 0) == -1 && errno == ESRCH) return 1;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && p[2] == 'Z';
}
struct fevent { struct evshared *sh; char name[NAME_MAX_BYTES]; int owner; };

enum { OP_COPY, OP_SIGNAL, OP_WAIT };
struct op { int kind; void *dst; const void *src; size_t len; struct evshared *ev; uint64_t seq; struct op *next; };
struct fstream {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct op *head, *tail;
    int busy, stop;
    pthread_t th;
};

static void sleep_us(long us) {
    struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

static void *worker(void *arg) {
    struct fstream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head) break;
        struct op *o = s->head;
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        if (o->kind == OP_COPY) {
            sleep_us(g_delay_us);
            memcpy(o->dst, o->src, o->len);
        } else if (o->kind == OP_SIGNAL) {
            uint64_t c = atomic_load(&o->ev->completed);
            while (c < o->seq && !atomic_compare_exchange_weak(&o->ev->completed, &c, o->seq)) {}
        } else {
            /* ASSUMPTION (unverified on a real driver): a wait ends when the
             * event's creator or its last recorder is gone, as their
             * context's queued work is torn down with them. */
            while (atomic_load(&o->ev->completed) < o->seq && !owner_gone(o->ev->owner_pid) && !owner_gone(atomic_load(&o->ev->recorder_pid))) sleep_us(200);
        }
        free(o);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static struct fstream *stream_new(void) {
    struct fstream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->th, NULL, worker, s) != 0) { free(s); return NULL; }
    return s;
}

static pthread_once_t g_default_once = PTHREAD_ONCE_INIT;
static struct fstream *g_default;
static void default_init(void) { g_default = stream_new(); }
/* NULL, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2): the default stream. */
static struct fstream *resolve(CUstream s) {
    if ((uintptr_t)s > 2) return s;
    pthread_once(&g_default_once, default_init);
    return g_default;
}

static CUresult enqueue(CUstream hs, struct op o) {
    struct fstream *s = resolve(hs);
    struct op *p = malloc(sizeof *p);
    if (!s || !p) { free(p); return E_OUT_OF_MEMORY; }
    *p = o;
    p->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = p; else s->head = p;
    s->tail = p;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return OK;
}

static void drain(struct fstream *s) {
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* ---- init, devices, contexts ---- */

CUresult cuInit(unsigned flags) {
    (void)flags;
    /* The delay is the process's from its first cuInit on: a process may
     * change the variable afterwards for the children it starts. */
    if (!atomic_load(&g_init)) {
        const char *d = getenv("FAKE_CUDA_COPY_DELAY_US");
        if (d && *d) g_delay_us = atol(d);
    }
    atomic_store(&g_init, 1);
    return OK;
}
CUresult cuDriverGetVersion(int *v) { if (!v) return E_INVALID_VALUE; *v = 12080; return OK; }
CUresult cuDeviceGetCount(int *n) { NEED_INIT(); if (!n) return E_INVALID_VALUE; *n = 1; return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { NEED_INIT(); if (!d) return E_INVALID_VALUE; if (ordinal != 0) return E_INVALID_DEVICE; *d = 0; return OK; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    NEED_INIT();
    if (!name || len <= 0) return E_INVALID_VALUE;
    if (d != 0) return E_INVALID_DEVICE;
    snprintf(name, (size_t)len, "ckpt-sidecar fake CUDA device (host memory, tests only)");
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { NEED_INIT(); if (!bytes) return E_INVALID_VALUE; if (d != 0) return E_INVALID_DEVICE; *bytes = (size_t)16 << 30; return OK; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { NEED_INIT(); if (!c) return E_INVALID_VALUE; if (d != 0) return E_INVALID_DEVICE; *c = &g_ctx; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { NEED_INIT(); return d == 0 ? OK : E_INVALID_DEVICE; }
CUresult cuCtxSetCurrent(CUcontext c) { NEED_INIT(); if (c && c != &g_ctx) return E_INVALID_CONTEXT; t_current = c; return OK; }
CUresult cuCtxGetCurrent(CUcontext *c) { NEED_INIT(); if (!c) return E_INVALID_VALUE; *c = t_current; return OK; }
CUresult cuCtxSynchronize(void) { NEED_INIT(); drain(resolve(NULL)); return OK; }

CUresult cuGetErrorString(CUresult e, const char **s) {
    if (!s) return E_INVALID_VALUE;
    switch (e) {
    case OK: *s = "no error"; break;
    case E_INVALID_VALUE: *s = "invalid argument"; break;
    case E_OUT_OF_MEMORY: *s = "out of memory"; break;
    case E_NOT_INITIALIZED: *s = "initialization error"; break;
    case E_INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case E_INVALID_CONTEXT: *s = "invalid device context"; break;
    case E_INVALID_HANDLE: *s = "invalid resource handle"; break;
    case E_NOT_FOUND: *s = "named symbol not found"; break;
    case E_NOT_READY: *s = "device not ready"; break;
    default: *s = "unknown error"; break;
    }
    return OK;
}
CUresult cuGetErrorName(CUresult e, const char **s) { return cuGetErrorString(e, s); }

/* ---- memory ---- */

static void *map_object(const char *name, int create, size_t *size) {
    int fd = shm_open(name, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0) return NULL;
    if (create && ftruncate(fd, (off_t)*size) != 0) { close(fd); shm_unlink(name); return NULL; }
    if (!create) {
        struct stat st;
        if (fstat(fd, &st) != 0) { close(fd); return NULL; }
        *size = (size_t)st.st_size;
    }
    void *p = mmap(NULL, *size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) { if (create) shm_unlink(name); return NULL; }
    return p;
}

static size_t page_round(size_t n) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    NEED_INIT();
    if (!dptr || size == 0) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = free_slot_locked();
    if (!a) { pthread_mutex_unlock(&g_mu); return E_OUT_OF_MEMORY; }
    char name[NAME_MAX_BYTES];
    snprintf(name, sizeof name, "/fakecuda-%d-%lu", (int)getpid(), ++g_seq);
    void *p = map_object(name, 1, &size);
    if (!p) { pthread_mutex_unlock(&g_mu); return E_OUT_OF_MEMORY; }
    /* The first freed range it fits takes it: the new memory lands at the old address. */
    size_t span = page_round(size);
    for (int i = 0; i < HOLES_MAX; i++) {
        struct hole *h = &g_holes[i];
        if (!h->base || h->size < span) continue;
        void *q = mremap(p, span, span, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)h->base);
        if (q == MAP_FAILED) break;
        p = q;
        h->base += span;
        h->size -= span;
        if (!h->size) h->base = 0;
        break;
    }
    a->base = (uintptr_t)p;
    a->size = size;
    a->imported = 0;
    a->id = ++g_buffer_ids;
    memcpy(a->name, name, sizeof name);
    pthread_mutex_unlock(&g_mu);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)dptr);
    if (!a || a->imported || a->vmm || a->base != (uintptr_t)dptr) { pthread_mutex_unlock(&g_mu); return E_INVALID_VALUE; }
    /* The range stays reserved (inaccessible) for a later cuMemAlloc_v2. */
    size_t span = page_round(a->size);
    int kept = 0;
    for (int i = 0; i < HOLES_MAX && !kept; i++) {
        if (g_holes[i].base) continue;
        kept = mmap((void *)a->base, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) != MAP_FAILED;
        if (kept) g_holes[i] = (struct hole){ a->base, span };
    }
    if (!kept) munmap((void *)a->base, span);
    shm_unlink(a->name);
    memset(a, 0, sizeof *a);
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)p);
    if (a) {
        if (base) *base = a->base;
        if (size) *size = a->size;
    }
    pthread_mutex_unlock(&g_mu);
    return a ? OK : E_NOT_FOUND;
}

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr p) {
    NEED_INIT();
    if (!data) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)p);
    struct alloc copy = a ? *a : (struct alloc){ 0 };
    pthread_mutex_unlock(&g_mu);
    if (!a) return E_INVALID_VALUE;
    switch (attribute) {
    case 1: *(CUcontext *)data = &g_ctx; return OK;           /* CONTEXT */
    case 2: *(unsigned *)data = 2; return OK;                 /* MEMORY_TYPE: DEVICE */
    case 3: *(CUdeviceptr *)data = p; return OK;              /* DEVICE_POINTER */
    case 7: *(unsigned long long *)data = copy.id; return OK; /* BUFFER_ID */
    case 9: *(int *)data = 0; return OK;                      /* DEVICE_ORDINAL */
    case 10: *(int *)data = copy.vmm ? 0 : 1; return OK;      /* IS_LEGACY_CUDA_IPC_CAPABLE */
    case 11: *(CUdeviceptr *)data = copy.base; return OK;     /* RANGE_START_ADDR */
    case 12: *(size_t *)data = copy.size; return OK;          /* RANGE_SIZE */
    case 13: *(int *)data = 1; return OK;                     /* MAPPED (unmapped: not found above) */
    default: return E_INVALID_VALUE;
    }
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr dptr) {
    NEED_INIT();
    if (!h) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)dptr);
    int ok = a && !a->imported && !a->vmm && a->base == (uintptr_t)dptr;
    if (ok) {
        memset(h, 0, sizeof *h);
        memcpy(h->reserved, MEM_MAGIC, 8);
        memcpy(h->reserved + 8, a->name, NAME_MAX_BYTES);
    }
    pthread_mutex_unlock(&g_mu);
    return ok ? OK : E_INVALID_VALUE;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle h, unsigned flags) {
    (void)flags;
    NEED_INIT();
    if (!dptr || memcmp(h.reserved, MEM_MAGIC, 8) != 0) return E_INVALID_VALUE;
    char name[NAME_MAX_BYTES];
    memcpy(name, h.reserved + 8, NAME_MAX_BYTES);
    name[NAME_MAX_BYTES - 1] = 0;
    size_t size = 0;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = free_slot_locked();
    void *p = a ? map_object(name, 0, &size) : NULL;
    if (!p) { pthread_mutex_unlock(&g_mu); return a ? E_INVALID_HANDLE : E_OUT_OF_MEMORY; }
    a->base = (uintptr_t)p;
    a->size = size;
    a->imported = 1;
    a->id = ++g_buffer_ids;
    memcpy(a->name, name, NAME_MAX_BYTES);
    g_imports_open++;
    g_imports_total++;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)dptr);
    if (!a || !a->imported || a->vmm || a->base != (uintptr_t)dptr) { pthread_mutex_unlock(&g_mu); return E_INVALID_VALUE; }
    munmap((void *)a->base, a->size);
    memset(a, 0, sizeof *a);
    g_imports_open--;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
    (void)flags;
    NEED_INIT();
    if (!p || !len) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    g_host_registered++;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemHostUnregister(void *p) {
    NEED_INIT();
    if (!p) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    g_host_registered--;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    return OK;
}

/* ---- VMM: physical allocations (memfd), reserved ranges, mappings ---- */

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
#define HANDLE_TYPE_POSIX_FD 1
#define VMM_GRANULARITY ((size_t)2 << 20)

static void vmm_unref_locked(struct vmm *v) {
    if (--v->refs == 0) {
        close(v->fd);
        free(v);
    }
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
    (void)option;
    NEED_INIT();
    if (!g || !prop) return E_INVALID_VALUE;
    *g = VMM_GRANULARITY;
    return OK;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
    (void)flags;
    NEED_INIT();
    if (!h || !prop || size == 0 || size % VMM_GRANULARITY) return E_INVALID_VALUE;
    if (prop->location.type != 1 || prop->location.id != 0) return E_INVALID_DEVICE;
    struct vmm *v = calloc(1, sizeof *v);
    if (!v) return E_OUT_OF_MEMORY;
    v->fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
    if (v->fd < 0 || ftruncate(v->fd, (off_t)size) != 0) { if (v->fd >= 0) close(v->fd); free(v); return E_OUT_OF_MEMORY; }
    v->size = size;
    v->refs = 1;
    v->handle_types = prop->requestedHandleTypes;
    *h = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return OK;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    NEED_INIT();
    struct vmm *v = (struct vmm *)(uintptr_t)h;
    if (!v) return E_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    if (v->imported && v->imported++ == 1) {
        /* The import's own handle goes (retained handles count apart). */
        g_imports_open--;
        write_stats_locked();
    }
    vmm_unref_locked(v);
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
    (void)flags;
    NEED_INIT();
    struct vmm *v = (struct vmm *)(uintptr_t)h;
    if (!out || !v || type != HANDLE_TYPE_POSIX_FD) return E_INVALID_VALUE;
    if (!(v->handle_types & HANDLE_TYPE_POSIX_FD)) return E_INVALID_VALUE;
    int fd = fcntl(v->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return E_OUT_OF_MEMORY;
    *(int *)out = fd;
    return OK;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type) {
    NEED_INIT();
    if (!h || type != HANDLE_TYPE_POSIX_FD) return E_INVALID_VALUE;
    int fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return E_INVALID_HANDLE;
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0 || st.st_size % VMM_GRANULARITY) { close(fd); return E_INVALID_HANDLE; }
    struct vmm *v = calloc(1, sizeof *v);
    if (!v) { close(fd); return E_OUT_OF_MEMORY; }
    v->fd = fd;
    v->size = (size_t)st.st_size;
    v->refs = 1;
    v->imported = 1; /* 1: the import's handle is held; 2: released */
    v->handle_types = HANDLE_TYPE_POSIX_FD;
    pthread_mutex_lock(&g_mu);
    g_imports_open++;
    g_imports_total++;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    *h = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
    (void)alignment; (void)addr; (void)flags;
    NEED_INIT();
    if (!ptr || size == 0 || size % VMM_GRANULARITY) return E_INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return E_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    if (!ptr || size == 0) return E_INVALID_VALUE;
    return munmap((void *)(uintptr_t)ptr, size) == 0 ? OK : E_INVALID_VALUE;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
    (void)flags;
    NEED_INIT();
    struct vmm *v = (struct vmm *)(uintptr_t)h;
    if (!ptr || !v || offset != 0 || size == 0 || size % VMM_GRANULARITY || size > v->size) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = free_slot_locked();
    if (!a || find_alloc_locked((uintptr_t)ptr) || find_alloc_locked((uintptr_t)ptr + size - 1)) { pthread_mutex_unlock(&g_mu); return E_INVALID_VALUE; }
    /* Mapped, but inaccessible until cuMemSetAccess. */
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, v->fd, 0);
    if (p == MAP_FAILED) { pthread_mutex_unlock(&g_mu); return E_OUT_OF_MEMORY; }
    a->base = (uintptr_t)ptr;
    a->size = size;
    a->imported = 0;
    a->vmm = v;
    a->id = ++g_buffer_ids;
    v->refs++;
    g_vmm_maps++;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    NEED_INIT();
    if (!ptr || !desc || count == 0) return E_INVALID_VALUE;
    if (desc[0].location.type != 1 || desc[0].location.id != 0) return E_INVALID_DEVICE;
    int prot = desc[0].flags == 3 ? PROT_READ | PROT_WRITE : desc[0].flags == 1 ? PROT_READ : PROT_NONE;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)ptr);
    int ok = a && a->vmm && (uintptr_t)ptr + size <= a->base + a->size && mprotect((void *)(uintptr_t)ptr, size, prot) == 0;
    pthread_mutex_unlock(&g_mu);
    return ok ? OK : E_INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)ptr);
    if (!a || !a->vmm || a->base != (uintptr_t)ptr || a->size != size) { pthread_mutex_unlock(&g_mu); return E_INVALID_VALUE; }
    /* The range stays reserved (PROT_NONE) until cuMemAddressFree. */
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    vmm_unref_locked(a->vmm);
    memset(a, 0, sizeof *a);
    g_vmm_maps--;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
    NEED_INIT();
    if (!h) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)addr);
    struct vmm *v = a ? a->vmm : NULL;
    if (v) v->refs++;
    pthread_mutex_unlock(&g_mu);
    if (!v) return E_INVALID_VALUE;
    *h = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return OK;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
    NEED_INIT();
    struct vmm *v = (struct vmm *)(uintptr_t)h;
    if (!prop || !v) return E_INVALID_VALUE;
    memset(prop, 0, sizeof *prop);
    prop->type = 1; /* PINNED */
    prop->requestedHandleTypes = v->handle_types;
    prop->location.type = 1; /* DEVICE */
    prop->location.id = 0;
    return OK;
}

/* Synchronous copies: after everything queued on the default stream. */
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { NEED_INIT(); drain(resolve(NULL)); memcpy((void *)(uintptr_t)dst, src, n); return OK; }
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { NEED_INIT(); drain(resolve(NULL)); memcpy(dst, (const void *)(uintptr_t)src, n); return OK; }

static CUresult copy_async(void *dst, const void *src, size_t n, CUstream s) {
    NEED_INIT();
    struct op o = { .kind = OP_COPY, .dst = dst, .src = src, .len = n };
    return enqueue(s, o);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) { return copy_async((void *)(uintptr_t)dst, src, n, s); }
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) { return copy_async(dst, (const void *)(uintptr_t)src, n, s); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { return copy_async((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, s); }

/* ---- streams ---- */

CUresult cuStreamCreate(CUstream *ph, unsigned flags) {
    (void)flags;
    NEED_INIT();
    if (!ph) return E_INVALID_VALUE;
    *ph = stream_new();
    return *ph ? OK : E_OUT_OF_MEMORY;
}
CUresult cuStreamSynchronize(CUstream s) { NEED_INIT(); drain(resolve(s)); return OK; }
CUresult cuStreamQuery(CUstream hs) {
    NEED_INIT();
    struct fstream *s = resolve(hs);
    pthread_mutex_lock(&s->mu);
    int idle = !s->head && !s->busy;
    pthread_mutex_unlock(&s->mu);
    return idle ? OK : E_NOT_READY;
}
CUresult cuStreamDestroy_v2(CUstream s) {
    NEED_INIT();
    if ((uintptr_t)s <= 2) return E_INVALID_HANDLE;
    drain(s);
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL);
    free(s);
    return OK;
}

/* ---- events ---- */

CUresult cuEventCreate(CUevent *ph, unsigned flags) {
    (void)flags;
    NEED_INIT();
    if (!ph) return E_INVALID_VALUE;
    struct fevent *e = calloc(1, sizeof *e);
    if (!e) return E_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_mu);
    snprintf(e->name, sizeof e->name, "/fakecuda-ev-%d-%lu", (int)getpid(), ++g_seq);
    pthread_mutex_unlock(&g_mu);
    size_t size = sizeof(struct evshared);
    e->sh = map_object(e->name, 1, &size);
    if (!e->sh) { free(e); return E_OUT_OF_MEMORY; }
    e->owner = 1;
    e->sh->owner_pid = (int)getpid();
    atomic_store(&e->sh->recorder_pid, (int)getpid());
    *ph = e;
    return OK;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    NEED_INIT();
    if (!e) return E_INVALID_HANDLE;
    atomic_store(&e->sh->recorder_pid, (int)getpid());
    uint64_t seq = atomic_fetch_add(&e->sh->recorded, 1) + 1;
    struct op o = { .kind = OP_SIGNAL, .ev = e->sh, .seq = seq };
    return enqueue(s, o);
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
    (void)flags;
    NEED_INIT();
    if (!e) return E_INVALID_HANDLE;
    struct op o = { .kind = OP_WAIT, .ev = e->sh, .seq = atomic_load(&e->sh->recorded) };
    return enqueue(s, o);
}
CUresult cuEventQuery(CUevent e) {
    NEED_INIT();
    if (!e) return E_INVALID_HANDLE;
    return atomic_load(&e->sh->completed) >= atomic_load(&e->sh->recorded) ? OK : E_NOT_READY;
}
CUresult cuEventSynchronize(CUevent e) {
    NEED_INIT();
    if (!e) return E_INVALID_HANDLE;
    uint64_t want = atomic_load(&e->sh->recorded);
    while (atomic_load(&e->sh->completed) < want) sleep_us(200);
    return OK;
}
CUresult cuEventDestroy_v2(CUevent e) {
    NEED_INIT();
    if (!e) return E_INVALID_HANDLE;
    munmap(e->sh, sizeof(struct evshared));
    if (e->owner) shm_unlink(e->name);
    free(e);
    return OK;
}
CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e) {
    NEED_INIT();
    if (!h || !e) return E_INVALID_VALUE;
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, EVT_MAGIC, 8);
    memcpy(h->reserved + 8, e->name, NAME_MAX_BYTES);
    return OK;
}
CUresult cuIpcOpenEventHandle(CUevent *ph, CUipcEventHandle h) {
    NEED_INIT();
    if (!ph || memcmp(h.reserved, EVT_MAGIC, 8) != 0) return E_INVALID_VALUE;
    struct fevent *e = calloc(1, sizeof *e);
    if (!e) return E_OUT_OF_MEMORY;
    memcpy(e->name, h.reserved + 8, NAME_MAX_BYTES);
    e->name[NAME_MAX_BYTES - 1] = 0;
    size_t size = 0;
    e->sh = map_object(e->name, 0, &size);
    if (!e->sh || size < sizeof(struct evshared)) { if (e->sh) munmap(e->sh, size); free(e); return E_INVALID_HANDLE; }
    *ph = e;
    return OK;
}
