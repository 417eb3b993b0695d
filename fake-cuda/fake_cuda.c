/*
 * A fake CUDA driver (libcuda.so.1) for tests: the subset of the driver API
 * the product uses, on host memory, as strict as NVIDIA's driver where the
 * driver reference says what happens (a test that passes only on a lenient
 * fake is a test of the fake). TEST-ONLY: never installed, bundled or shipped.
 *
 * - Devices: CKPT_FAKE_CUDA_DEVICES=N physical devices (default 1), each
 *   with its own UUID (cuDeviceGetUuid_v2); CUDA_VISIBLE_DEVICES (indexes or
 *   GPU-<uuid>, up to the first invalid entry) picks and orders the ones a
 *   process sees, as the real driver does. Each device has one primary
 *   context. A call that needs a context, with none current on the calling
 *   thread, returns CUDA_ERROR_INVALID_CONTEXT (201); recording an event on
 *   a stream of another context is refused (400).
 * - "Device memory" (cuMemAlloc_v2) is a memfd: a header page (shared with
 *   every importer: who exported it, how many processes have it open) and
 *   the bytes, mapped read-write; the device pointer is their address in the
 *   process. Its legacy IPC handle names (exporter pid, fd, allocation id,
 *   address): cuIpcOpenMemHandle_v2 in another process opens
 *   /proc/<pid>/fd/<fd>, so the memory of a process that exits is gone with
 *   it (nothing is left in /dev/shm), as the real driver frees it at exit.
 *   As the reference says: a handle cannot be opened in the process that
 *   exported it (201); the same handle opened twice gives the same pointer,
 *   reference counted (cuIpcCloseMemHandle once per open); opening a handle
 *   of memory at an address where this process still has an older import
 *   of the exporter's (freed) memory open fails with
 *   CUDA_ERROR_ALREADY_MAPPED (208); cuMemFree_v2 of memory another process
 *   still has open keeps it allocated (it still counts against the device's
 *   memory until the last importer closes it) and counts "frees_pinned".
 * - Device memory is capped per device and process:
 *   FAKE_CUDA_DEVICE_MEMORY_BYTES (default 16 GiB; cuDeviceTotalMem_v2 and
 *   cuMemGetInfo_v2 say it); past it cuMemAlloc_v2 and cuMemCreate fail
 *   with CUDA_ERROR_OUT_OF_MEMORY (2).
 * - Host registration (cuMemHostRegister_v2) keeps the ranges: a range
 *   overlapping a registered one is refused (712), unregistering an
 *   unregistered address too (713), and FAKE_CUDA_HOST_REGISTER_BYTES caps
 *   the bytes registered at once (2). A device-to-host copy into memory not
 *   registered (pageable) is synchronous, as the reference says: the call
 *   returns once the stream's earlier work and the copy are done.
 * - Streams are worker threads. Asynchronous copies sleep
 *   FAKE_CUDA_COPY_DELAY_US (default 2000; read at the process's first
 *   cuInit) before copying: late on purpose, so a missing stream wait or
 *   event shows up as wrong bytes. cuStreamDestroy_v2 returns at once; the
 *   stream's queued work runs on (or never ends) without it.
 * - Events live in a memfd shared by every process that opens them:
 *   cuEventRecord numbers the record and queues "completed = n" on the
 *   stream; cuStreamWaitEvent queues a wait for the number recorded when it
 *   is called. An event completes only when the work queued before its
 *   record has, in the process that recorded it: a wait on an event whose
 *   last recorder died before the record ran never completes (the worst the
 *   reference allows).
 * - Stream memory operations: cuStreamWaitValue32_v2 waits on a 32-bit word
 *   of registered host memory (its address from cuMemHostGetDevicePointer_v2)
 *   or device memory; cuStreamWriteValue32_v2 writes one.
 * - VMM (cuMemCreate & co.): a physical allocation is a memfd, reference
 *   counted by its handles and mappings; cuMemExportToShareableHandle with
 *   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR gives a dup of it, so the bytes
 *   outlive the exporter as long as an importer holds them (as the real
 *   driver's do). It belongs to one physical device: mapping access for
 *   another device is refused (101). cuMemAddressReserve reserves PROT_NONE
 *   address space, cuMemMap maps the memfd there still inaccessible, and only
 *   cuMemSetAccess makes it readable and writable: an importer that forgets
 *   it faults. Mapped VMM memory is not legacy-IPC capable (cuIpcGetMemHandle
 *   refuses). Several cuMemMap at consecutive offsets of one reserved range
 *   (PyTorch's expandable segments) are separate mappings:
 *   cuMemGetAddressRange and cuMemRetainAllocationHandle on a pointer answer
 *   for the mapping holding it (as the real driver does: the chunk, not the
 *   reservation); a reserved address with nothing mapped is unknown memory.
 * - Allocation identity: every mapping gets a CU_POINTER_ATTRIBUTE_BUFFER_ID
 *   never given before; cuMemFree_v2 keeps the freed address range reserved
 *   and the next cuMemAlloc_v2 that fits lands there, as real drivers often
 *   do, so a stale cache keyed by address shows up as wrong bytes.
 * - Counters: with FAKE_CUDA_STATS_DIR set, the file <dir>/<pid> says how many
 *   imported allocations are open ("imports_open N": legacy IPC opens and
 *   imported VMM handles not yet released), how many were ever opened, how
 *   many host ranges are registered, how many VMM mappings exist
 *   ("vmm_maps N"), how many IPC events were opened ("events_opened N"),
 *   how many frees were pinned by an importer
 *   ("frees_pinned N"), how many legacy imports were opened in a context of
 *   another physical device than the memory's ("peer_imports N") and the
 *   device memory this process holds ("device_used_bytes N").
 *
 * - Refusals a real driver may give (CKPT_FAKE_CUDA_REFUSE, a comma-separated
 *   list read at the first cuInit): "stream_wait" makes cuStreamWaitValue32
 *   return CUDA_ERROR_NOT_SUPPORTED (801: stream memory operations are not
 *   available on every driver and platform); "devptr_without_devicemap"
 *   refuses cuMemHostGetDevicePointer (1) for host memory registered without
 *   CU_MEMHOSTREGISTER_DEVICEMAP, as a device without unified addressing does.
 * - CUDA-graph capture (cuStreamBeginCapture_v2 .. cuStreamEndCapture,
 *   cuStreamIsCapturing): work queued on a capturing stream is only
 *   captured, never run (graphs are never launched here): cuEventRecord
 *   records nothing (an event polled elsewhere says done at once, as a real
 *   one never recorded does), stream waits and copies run nothing, and
 *   cuStreamSynchronize of a capturing stream is refused (900).
 * - An imported interprocess event whose creator died is undefined for the
 *   reference; here cuEventQuery on it fails (999), never says NOT_READY.
 *   FAKE_CUDA_EVENT_OPEN_DELAY_US makes cuIpcOpenEventHandle block that long
 *   first (an import seen blocking on a busy GPU).
 * - MIG: with CKPT_FAKE_CUDA_MIG=1 every device is a MIG instance:
 *   cuDeviceGetUuid_v2 gives the instance's UUID (named MIG-<uuid> in
 *   CUDA_VISIBLE_DEVICES), cuDeviceGetUuid the parent GPU's.
 *
 * What it does not prove: real DMA bandwidth, pinned-memory behaviour,
 * peer access, or the real driver's error cases beyond the ones above.
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
typedef struct { char bytes[16]; } CUuuid;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_NO_DEVICE = 100,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_ALREADY_MAPPED = 208,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_HOST_ALREADY_REGISTERED = 712,
    E_HOST_NOT_REGISTERED = 713,
    E_NOT_SUPPORTED = 801,
    E_STREAM_CAPTURE_UNSUPPORTED = 900,
    E_UNKNOWN = 999,
};

#define MEM_MAGIC "FKCUMEM"
#define EVT_MAGIC "FKCUEVT"
#define ALLOCS_MAX 4096
#define DEVICES_MAX 16

/* One primary context per visible device: `ordinal` in this process,
 * `phys` the physical device. */
struct fctx { int ordinal; int phys; };
static struct fctx g_ctx[DEVICES_MAX];
static int g_nphys = 1, g_nvis = 1, g_vis[DEVICES_MAX];
static __thread CUcontext t_current;
static atomic_int g_init;
static long g_delay_us = 2000;
static size_t g_device_cap = (size_t)16 << 30, g_host_cap = (size_t)-1;
static size_t g_device_used[DEVICES_MAX];
static int g_refuse_stream_wait, g_refuse_devptr_without_devicemap, g_mig;
static long g_event_open_delay_us;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
/* The header page of a cuMemAlloc_v2 allocation's memfd, shared with every
 * process that opened it. */
struct memhdr { char magic[8]; int owner_pid; int phys; unsigned long long alloc_id; uint64_t base; uint64_t size; _Atomic int importers; };
/* A VMM physical allocation: a memfd, alive while handles or mappings hold it. */
struct vmm { int fd; size_t size; int refs; int imported; int handle_types; int phys; int counted; };
/* A mapping of device memory: cuMemAlloc, a legacy IPC import, or a VMM
 * mapping (vmm set); id: its CU_POINTER_ATTRIBUTE_BUFFER_ID (never reused).
 * For cuMemAlloc and imports: `hdr` the shared header, `fd` the memfd (the
 * exporter's, named by its handle); for imports `refs` the opens of one
 * handle and the exporter's (pid, allocation id, address). */
struct alloc {
    uintptr_t base; size_t size; int imported; struct vmm *vmm; unsigned long long id;
    int ordinal; int phys; struct memhdr *hdr; int fd; int refs;
    int src_pid; unsigned long long src_id; uint64_t src_base;
    int pool; /* from cuMemAllocAsync: a stream-ordered pool's, not legacy-IPC capable */
};
static struct alloc g_allocs[ALLOCS_MAX];
static unsigned long long g_buffer_ids, g_alloc_ids;
/* Address ranges cuMemFree_v2 gave back, kept reserved (PROT_NONE) so the
 * next cuMemAlloc_v2 that fits reuses the address, as real drivers do. */
#define HOLES_MAX 256
struct hole { uintptr_t base; size_t size; };
static struct hole g_holes[HOLES_MAX];
/* Freed allocations another process still had open: still allocated. */
#define PINNED_MAX 1024
struct pinned { struct memhdr *hdr; size_t size; int phys; };
static struct pinned g_pinned[PINNED_MAX];
/* Registered host ranges. */
#define HOSTREGS_MAX 256
struct hostreg { uintptr_t base; size_t len; unsigned flags; };
static struct hostreg g_hostregs[HOSTREGS_MAX];
static size_t g_host_registered_bytes;
static long g_imports_open, g_imports_total, g_host_registered, g_vmm_maps, g_frees_pinned, g_peer_imports, g_events_opened;

static size_t page_bytes(void) { return (size_t)sysconf(_SC_PAGESIZE); }
static size_t page_round(size_t n) {
    size_t pg = page_bytes();
    return (n + pg - 1) / pg * pg;
}

static void write_stats_locked(void) {
    const char *dir = getenv("FAKE_CUDA_STATS_DIR");
    if (!dir || !*dir) return;
    char path[512], tmp[520], buf[512];
    snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    size_t used = 0;
    for (int i = 0; i < DEVICES_MAX; i++) used += g_device_used[i];
    int n = snprintf(buf, sizeof buf,
                     "imports_open %ld\nimports_total %ld\nhost_registered %ld\nvmm_maps %ld\nfrees_pinned %ld\npeer_imports %ld\ndevice_used_bytes %zu\nevents_opened %ld\n",
                     g_imports_open, g_imports_total, g_host_registered, g_vmm_maps, g_frees_pinned, g_peer_imports, used, g_events_opened);
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

/* Freed memory whose last importer has closed it is given back. */
static void reap_pinned_locked(void) {
    for (int i = 0; i < PINNED_MAX; i++) {
        struct pinned *p = &g_pinned[i];
        if (!p->hdr || atomic_load(&p->hdr->importers) > 0) continue;
        g_device_used[p->phys] -= p->size;
        munmap(p->hdr, page_bytes());
        memset(p, 0, sizeof *p);
    }
}

#define NEED_INIT() do { if (!atomic_load(&g_init)) return E_NOT_INITIALIZED; } while (0)
#define NEED_CTX() do { NEED_INIT(); if (!t_current) return E_INVALID_CONTEXT; } while (0)

/* The ordinal, in this process, of physical device `phys` (-1: not visible). */
static int ordinal_of(int phys) {
    for (int i = 0; i < g_nvis; i++)
        if (g_vis[i] == phys) return i;
    return -1;
}

static void uuid_of(int phys, char out[16]) {
    memcpy(out, "fakecuda-uuid-", 14);
    out[14] = (char)0xd0;
    out[15] = (char)phys;
}

/* ---- streams: one worker thread each ---- */

/* recorder_pid: the last process that recorded the event (an importer may
 * record it too). */
struct evshared { _Atomic uint64_t recorded; _Atomic uint64_t completed; int owner_pid; _Atomic int recorder_pid; };
/* The event's page in this process, unmapped when neither the event nor a
 * queued operation uses it any more (cuEventDestroy_v2 returns at once). */
struct evmap { struct evshared *sh; _Atomic int refs; };
struct fevent { struct evshared *sh; struct evmap *map; int fd; int owner; unsigned long long id; struct fctx *ctx; };
static void evmap_unref(struct evmap *m) {
    if (atomic_fetch_sub(&m->refs, 1) == 1) {
        munmap(m->sh, (size_t)sysconf(_SC_PAGESIZE));
        free(m);
    }
}

enum { OP_COPY, OP_SIGNAL, OP_WAIT, OP_WAIT_VALUE, OP_WRITE_VALUE };
struct op { int kind; void *dst; const void *src; size_t len; struct evshared *ev; struct evmap *evm; uint64_t seq; uint32_t value; unsigned flags; struct op *next; };
struct fstream {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct op *head, *tail;
    int busy, stop;
    /* Capturing a graph: work queued is captured, never run. */
    _Atomic int capturing;
    pthread_t th;
    struct fctx *ctx;
};

static void sleep_us(long us) {
    struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

static int value_reached(uint32_t now, uint32_t value, unsigned flags) {
    switch (flags & 3) {
    case 0: return (int32_t)(now - value) >= 0; /* GEQ */
    case 1: return now == value;                /* EQ */
    case 2: return (now & value) != 0;          /* AND */
    default: return ~(now | value) != 0;        /* NOR */
    }
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
        } else if (o->kind == OP_WAIT) {
            /* Completes only when the recorder's queued work did: never,
             * if the recorder died first. */
            while (atomic_load(&o->ev->completed) < o->seq) sleep_us(200);
        } else if (o->kind == OP_WAIT_VALUE) {
            while (!value_reached(atomic_load((_Atomic uint32_t *)o->dst), o->value, o->flags)) sleep_us(200);
        } else {
            atomic_store((_Atomic uint32_t *)o->dst, o->value);
        }
        if (o->evm) evmap_unref(o->evm);
        free(o);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
    }
    int stop = s->stop;
    pthread_mutex_unlock(&s->mu);
    if (stop) {
        /* Destroyed (cuStreamDestroy_v2 returned long ago): the last of it. */
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
    }
    return NULL;
}

static struct fstream *stream_new(struct fctx *ctx) {
    struct fstream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->ctx = ctx;
    if (pthread_create(&s->th, NULL, worker, s) != 0) { free(s); return NULL; }
    pthread_detach(s->th);
    return s;
}

/* The default stream of each context, made at first use. */
static struct fstream *g_default[DEVICES_MAX];
/* NULL, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2): the default
 * stream of the current context (NULL with none). */
static struct fstream *resolve(CUstream s) {
    if ((uintptr_t)s > 2) return s;
    if (!t_current) return NULL;
    pthread_mutex_lock(&g_mu);
    struct fstream **d = &g_default[t_current->ordinal];
    if (!*d) *d = stream_new(t_current);
    struct fstream *out = *d;
    pthread_mutex_unlock(&g_mu);
    return out;
}

static CUresult enqueue(CUstream hs, struct op o) {
    struct fstream *s = resolve(hs);
    if (!s) return E_INVALID_CONTEXT;
    if (atomic_load(&s->capturing)) {
        /* Captured into the graph, which is never launched here. */
        if (o.evm) evmap_unref(o.evm);
        return OK;
    }
    struct op *p = malloc(sizeof *p);
    if (!p) return E_OUT_OF_MEMORY;
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

static size_t env_bytes(const char *name, size_t dflt) {
    const char *v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) : dflt;
}

/* One entry of CUDA_VISIBLE_DEVICES: a physical index or GPU-<uuid>; -1 if invalid. */
static int parse_visible(const char *e, size_t n) {
    while (n && *e == ' ') { e++; n--; }
    if (n > 4 && (strncmp(e, "GPU-", 4) == 0 || (g_mig && strncmp(e, "MIG-", 4) == 0))) {
        for (int p = 0; p < g_nphys; p++) {
            char u[16], text[40];
            uuid_of(p, u);
            int k = 0;
            for (int i = 0; i < 16; i++) k += snprintf(text + k, sizeof text - k, "%02x", (unsigned char)u[i]);
            if (n - 4 <= 32 && n - 4 > 0 && strncmp(text, e + 4, n - 4) == 0) return p;
        }
        return -1;
    }
    if (n == 0) return -1;
    int v = 0;
    for (size_t i = 0; i < n; i++) {
        if (e[i] < '0' || e[i] > '9') return -1;
        v = v * 10 + (e[i] - '0');
    }
    return v < g_nphys ? v : -1;
}

static void init_devices(void) {
    const char *n = getenv("CKPT_FAKE_CUDA_DEVICES");
    g_nphys = n && *n ? atoi(n) : 1;
    if (g_nphys < 0) g_nphys = 0;
    if (g_nphys > DEVICES_MAX) g_nphys = DEVICES_MAX;
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    g_nvis = 0;
    if (!vis) {
        for (int p = 0; p < g_nphys; p++) g_vis[g_nvis++] = p;
    } else {
        /* As the real driver: the list up to its first invalid entry. */
        const char *e = vis;
        while (*e && g_nvis < DEVICES_MAX) {
            const char *end = strchr(e, ',');
            size_t len = end ? (size_t)(end - e) : strlen(e);
            int p = parse_visible(e, len);
            if (p < 0 || ordinal_of(p) >= 0) break;
            g_vis[g_nvis++] = p;
            if (!end) break;
            e = end + 1;
        }
    }
    for (int i = 0; i < g_nvis; i++) g_ctx[i] = (struct fctx){ i, g_vis[i] };
    g_device_cap = env_bytes("FAKE_CUDA_DEVICE_MEMORY_BYTES", g_device_cap);
    g_host_cap = env_bytes("FAKE_CUDA_HOST_REGISTER_BYTES", g_host_cap);
}

CUresult cuInit(unsigned flags) {
    (void)flags;
    /* The delay is the process's from its first cuInit on: a process may
     * change the variable afterwards for the children it starts. */
    pthread_mutex_lock(&g_mu);
    if (!atomic_load(&g_init)) {
        const char *d = getenv("FAKE_CUDA_COPY_DELAY_US");
        if (d && *d) g_delay_us = atol(d);
        const char *refuse = getenv("CKPT_FAKE_CUDA_REFUSE");
        if (refuse) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", refuse);
            for (char *save = NULL, *t = strtok_r(buf, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
                if (!strcmp(t, "stream_wait")) g_refuse_stream_wait = 1;
                else if (!strcmp(t, "devptr_without_devicemap")) g_refuse_devptr_without_devicemap = 1;
                else fprintf(stderr, "fake libcuda: CKPT_FAKE_CUDA_REFUSE: unknown refusal %s (ignored)\n", t);
            }
        }
        const char *mig = getenv("CKPT_FAKE_CUDA_MIG");
        g_mig = mig && *mig && strcmp(mig, "0");
        const char *od = getenv("FAKE_CUDA_EVENT_OPEN_DELAY_US");
        if (od && *od) g_event_open_delay_us = atol(od);
        init_devices();
        atomic_store(&g_init, 1);
    }
    pthread_mutex_unlock(&g_mu);
    return g_nvis ? OK : E_NO_DEVICE;
}
#define NEED_DEV(d) do { if ((d) < 0 || (d) >= g_nvis) return E_INVALID_DEVICE; } while (0)
CUresult cuDriverGetVersion(int *v) { if (!v) return E_INVALID_VALUE; *v = 12080; return OK; }
CUresult cuDeviceGetCount(int *n) { NEED_INIT(); if (!n) return E_INVALID_VALUE; *n = g_nvis; return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { NEED_INIT(); if (!d) return E_INVALID_VALUE; NEED_DEV(ordinal); *d = ordinal; return OK; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    NEED_INIT();
    if (!name || len <= 0) return E_INVALID_VALUE;
    NEED_DEV(d);
    snprintf(name, (size_t)len, "ckpt-sidecar fake CUDA device %d (host memory, tests only)", g_vis[d]);
    return OK;
}
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { NEED_INIT(); if (!u) return E_INVALID_VALUE; NEED_DEV(d); uuid_of(g_vis[d], u->bytes); return OK; }
/* The parent GPU's UUID under MIG (cuDeviceGetUuid_v2 gives the instance's). */
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
    CUresult r = cuDeviceGetUuid_v2(u, d);
    if (r == OK && g_mig) u->bytes[13] = 'P';
    return r;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { NEED_INIT(); if (!bytes) return E_INVALID_VALUE; NEED_DEV(d); *bytes = g_device_cap; return OK; }
CUresult cuDeviceGetAttribute(int *v, int attrib, CUdevice d) {
    NEED_INIT();
    if (!v) return E_INVALID_VALUE;
    NEED_DEV(d);
    switch (attrib) {
    case 20: { const char *m = getenv("FAKE_CUDA_COMPUTE_MODE"); *v = m && *m ? atoi(m) : 0; return OK; } /* COMPUTE_MODE */
    case 33: *v = 0; return OK;        /* PCI_BUS_ID */
    case 34: *v = g_vis[d]; return OK; /* PCI_DEVICE_ID */
    case 50: *v = 0; return OK;        /* PCI_DOMAIN_ID */
    case 75: *v = 9; return OK;        /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *v = 0; return OK;        /* COMPUTE_CAPABILITY_MINOR */
    case 89: case 92: case 93: case 94: *v = 1; return OK; /* unified addressing / stream mem ops */
    default: return E_INVALID_VALUE;
    }
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { NEED_INIT(); if (!c) return E_INVALID_VALUE; NEED_DEV(d); *c = &g_ctx[d]; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { NEED_INIT(); NEED_DEV(d); return OK; }
CUresult cuCtxSetCurrent(CUcontext c) {
    NEED_INIT();
    if (c && (c < &g_ctx[0] || c >= &g_ctx[g_nvis])) return E_INVALID_CONTEXT;
    t_current = c;
    return OK;
}
CUresult cuCtxGetCurrent(CUcontext *c) { NEED_INIT(); if (!c) return E_INVALID_VALUE; *c = t_current; return OK; }
CUresult cuCtxGetDevice(CUdevice *d) { NEED_CTX(); if (!d) return E_INVALID_VALUE; *d = t_current->ordinal; return OK; }
CUresult cuCtxSynchronize(void) { NEED_CTX(); drain(resolve(NULL)); return OK; }

CUresult cuGetErrorString(CUresult e, const char **s) {
    if (!s) return E_INVALID_VALUE;
    switch (e) {
    case OK: *s = "no error"; break;
    case E_INVALID_VALUE: *s = "invalid argument"; break;
    case E_OUT_OF_MEMORY: *s = "out of memory"; break;
    case E_NOT_INITIALIZED: *s = "initialization error"; break;
    case E_NO_DEVICE: *s = "no CUDA-capable device is detected"; break;
    case E_INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case E_INVALID_CONTEXT: *s = "invalid device context"; break;
    case E_ALREADY_MAPPED: *s = "resource already mapped"; break;
    case E_INVALID_HANDLE: *s = "invalid resource handle"; break;
    case E_NOT_FOUND: *s = "named symbol not found"; break;
    case E_NOT_READY: *s = "device not ready"; break;
    case E_HOST_ALREADY_REGISTERED: *s = "part or all of the requested memory range is already mapped"; break;
    case E_HOST_NOT_REGISTERED: *s = "pointer does not correspond to a registered memory region"; break;
    case E_NOT_SUPPORTED: *s = "operation not supported"; break;
    case E_STREAM_CAPTURE_UNSUPPORTED: *s = "operation not permitted when stream is capturing"; break;
    default: *s = "unknown error"; break;
    }
    return OK;
}
CUresult cuGetErrorName(CUresult e, const char **s) { return cuGetErrorString(e, s); }

/* ---- memory ---- */

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    NEED_CTX();
    if (!free_bytes || !total_bytes) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    reap_pinned_locked();
    size_t used = g_device_used[t_current->phys];
    pthread_mutex_unlock(&g_mu);
    *total_bytes = g_device_cap;
    *free_bytes = used < g_device_cap ? g_device_cap - used : 0;
    return OK;
}

/* Counts `size` bytes against physical device `phys`; 0 when over the cap. */
static int charge_locked(int phys, size_t size) {
    reap_pinned_locked();
    if (g_device_used[phys] + size > g_device_cap || g_device_used[phys] + size < size) return 0;
    g_device_used[phys] += size;
    return 1;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    NEED_CTX();
    if (!dptr || size == 0) return E_INVALID_VALUE;
    size_t pg = page_bytes(), span = page_round(size);
    pthread_mutex_lock(&g_mu);
    struct alloc *a = free_slot_locked();
    if (!a || !charge_locked(t_current->phys, span)) { pthread_mutex_unlock(&g_mu); return E_OUT_OF_MEMORY; }
    int fd = memfd_create("fakecuda-mem", MFD_CLOEXEC);
    void *h = MAP_FAILED, *p = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)(pg + span)) == 0) {
        h = mmap(NULL, pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)pg);
    }
    if (h == MAP_FAILED || p == MAP_FAILED) {
        if (h != MAP_FAILED) munmap(h, pg);
        if (p != MAP_FAILED) munmap(p, span);
        if (fd >= 0) close(fd);
        g_device_used[t_current->phys] -= span;
        pthread_mutex_unlock(&g_mu);
        return E_OUT_OF_MEMORY;
    }
    /* The first freed range it fits takes it: the new memory lands at the old address. */
    for (int i = 0; i < HOLES_MAX; i++) {
        struct hole *ho = &g_holes[i];
        if (!ho->base || ho->size < span) continue;
        void *q = mremap(p, span, span, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)ho->base);
        if (q == MAP_FAILED) break;
        p = q;
        ho->base += span;
        ho->size -= span;
        if (!ho->size) ho->base = 0;
        break;
    }
    struct memhdr *hdr = h;
    memcpy(hdr->magic, MEM_MAGIC, 8);
    hdr->owner_pid = (int)getpid();
    hdr->phys = t_current->phys;
    hdr->alloc_id = ++g_alloc_ids;
    hdr->base = (uint64_t)(uintptr_t)p;
    hdr->size = size;
    atomic_store(&hdr->importers, 0);
    *a = (struct alloc){ .base = (uintptr_t)p, .size = size, .id = ++g_buffer_ids, .ordinal = t_current->ordinal,
                         .phys = t_current->phys, .hdr = hdr, .fd = fd };
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

/* Stream-ordered allocation (cudaMallocAsync): memory of the device's
 * default pool, not legacy-IPC capable (its pool exports it, not used here). */
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s) {
    (void)s;
    CUresult r = cuMemAlloc_v2(dptr, size);
    if (r != OK) return r;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)*dptr);
    if (a) a->pool = 1;
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    NEED_CTX();
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
    /* No new import from now on (the handle names the fd). */
    close(a->fd);
    int pinned = 0;
    if (atomic_load(&a->hdr->importers) > 0) {
        /* Another process still has it open: it stays allocated. */
        for (int i = 0; i < PINNED_MAX && !pinned; i++) {
            if (g_pinned[i].hdr) continue;
            g_pinned[i] = (struct pinned){ a->hdr, span, a->phys };
            pinned = 1;
        }
        g_frees_pinned++;
    }
    if (!pinned) {
        g_device_used[a->phys] -= span;
        munmap(a->hdr, page_bytes());
    }
    memset(a, 0, sizeof *a);
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    NEED_CTX();
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
    case 1: *(CUcontext *)data = &g_ctx[copy.ordinal]; return OK; /* CONTEXT */
    case 2: *(unsigned *)data = 2; return OK;                 /* MEMORY_TYPE: DEVICE */
    case 3: *(CUdeviceptr *)data = p; return OK;              /* DEVICE_POINTER */
    case 7: *(unsigned long long *)data = copy.id; return OK; /* BUFFER_ID */
    case 9: *(int *)data = copy.ordinal; return OK;           /* DEVICE_ORDINAL */
    case 10: *(int *)data = copy.vmm || copy.pool ? 0 : 1; return OK; /* IS_LEGACY_CUDA_IPC_CAPABLE */
    case 11: *(CUdeviceptr *)data = copy.base; return OK;     /* RANGE_START_ADDR */
    case 12: *(size_t *)data = copy.size; return OK;          /* RANGE_SIZE */
    case 13: *(int *)data = 1; return OK;                     /* MAPPED (unmapped: not found above) */
    case 17: *(void **)data = copy.pool ? (void *)&g_ctx[copy.ordinal] : NULL; return OK; /* MEMPOOL_HANDLE */
    default: return E_INVALID_VALUE;
    }
}

/* A legacy handle: magic, exporter pid, its memfd's number, allocation id, address. */
struct memhandle { char magic[8]; int pid; int fd; unsigned long long alloc_id; uint64_t base; };

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr dptr) {
    NEED_CTX();
    if (!h) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)dptr);
    int ok = a && !a->imported && !a->vmm && !a->pool && a->base == (uintptr_t)dptr;
    if (ok) {
        struct memhandle m = { .pid = (int)getpid(), .fd = a->fd, .alloc_id = a->hdr->alloc_id, .base = a->base };
        memcpy(m.magic, MEM_MAGIC, 8);
        memset(h, 0, sizeof *h);
        memcpy(h->reserved, &m, sizeof m);
    }
    pthread_mutex_unlock(&g_mu);
    return ok ? OK : E_INVALID_VALUE;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle h, unsigned flags) {
    (void)flags;
    NEED_CTX();
    struct memhandle m;
    memcpy(&m, h.reserved, sizeof m);
    if (!dptr || memcmp(m.magic, MEM_MAGIC, 8) != 0) return E_INVALID_VALUE;
    /* "Memory handles cannot be opened in the process that exported them." */
    if (m.pid == (int)getpid()) return E_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < ALLOCS_MAX; i++) {
        struct alloc *o = &g_allocs[i];
        if (!o->base || !o->imported || o->src_pid != m.pid) continue;
        if (o->src_id == m.alloc_id) {
            /* The same handle again: the same mapping, counted. */
            o->refs++;
            pthread_mutex_unlock(&g_mu);
            *dptr = (CUdeviceptr)o->base;
            return OK;
        }
        if (o->src_base == m.base) {
            /* An older import of the exporter's memory at that address is open. */
            pthread_mutex_unlock(&g_mu);
            return E_ALREADY_MAPPED;
        }
    }
    struct alloc *a = free_slot_locked();
    if (!a) { pthread_mutex_unlock(&g_mu); return E_OUT_OF_MEMORY; }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", m.pid, m.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    size_t pg = page_bytes();
    struct memhdr *hdr = fd < 0 ? MAP_FAILED : mmap(NULL, pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (hdr == MAP_FAILED || memcmp(hdr->magic, MEM_MAGIC, 8) != 0 || hdr->alloc_id != m.alloc_id || hdr->owner_pid != m.pid) {
        /* The exporter is gone, freed it, or the number names something else now. */
        if (hdr != MAP_FAILED) munmap(hdr, pg);
        if (fd >= 0) close(fd);
        pthread_mutex_unlock(&g_mu);
        return E_INVALID_HANDLE;
    }
    size_t size = (size_t)hdr->size;
    void *p = mmap(NULL, page_round(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)pg);
    close(fd);
    if (p == MAP_FAILED) { munmap(hdr, pg); pthread_mutex_unlock(&g_mu); return E_OUT_OF_MEMORY; }
    atomic_fetch_add(&hdr->importers, 1);
    *a = (struct alloc){ .base = (uintptr_t)p, .size = size, .imported = 1, .id = ++g_buffer_ids, .ordinal = t_current->ordinal,
                         .phys = hdr->phys, .hdr = hdr, .fd = -1, .refs = 1, .src_pid = m.pid, .src_id = m.alloc_id, .src_base = m.base };
    if (hdr->phys != t_current->phys) g_peer_imports++;
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
    if (--a->refs == 0) {
        munmap((void *)a->base, page_round(a->size));
        atomic_fetch_sub(&a->hdr->importers, 1);
        munmap(a->hdr, page_bytes());
        memset(a, 0, sizeof *a);
        g_imports_open--;
        write_stats_locked();
    }
    pthread_mutex_unlock(&g_mu);
    return OK;
}

/* The registered host range holding p..p+len, or NULL. */
static struct hostreg *hostreg_of_locked(uintptr_t p, size_t len) {
    for (int i = 0; i < HOSTREGS_MAX; i++) {
        struct hostreg *r = &g_hostregs[i];
        if (r->base && p >= r->base && p + len <= r->base + r->len) return r;
    }
    return NULL;
}

CUresult cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
    NEED_CTX();
    if (!p || !len) return E_INVALID_VALUE;
    uintptr_t b = (uintptr_t)p;
    pthread_mutex_lock(&g_mu);
    struct hostreg *slot = NULL;
    for (int i = 0; i < HOSTREGS_MAX; i++) {
        struct hostreg *r = &g_hostregs[i];
        if (!r->base) { if (!slot) slot = r; continue; }
        if (b < r->base + r->len && r->base < b + len) { pthread_mutex_unlock(&g_mu); return E_HOST_ALREADY_REGISTERED; }
    }
    if (!slot || g_host_registered_bytes + len > g_host_cap || g_host_registered_bytes + len < len) { pthread_mutex_unlock(&g_mu); return E_OUT_OF_MEMORY; }
    *slot = (struct hostreg){ b, len, flags };
    g_host_registered_bytes += len;
    g_host_registered++;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemHostUnregister(void *p) {
    NEED_INIT();
    if (!p) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct hostreg *r = NULL;
    for (int i = 0; i < HOSTREGS_MAX && !r; i++)
        if (g_hostregs[i].base == (uintptr_t)p) r = &g_hostregs[i];
    if (!r) { pthread_mutex_unlock(&g_mu); return E_HOST_NOT_REGISTERED; }
    g_host_registered_bytes -= r->len;
    memset(r, 0, sizeof *r);
    g_host_registered--;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    return OK;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags) {
    NEED_CTX();
    if (!d || !p || flags) return E_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct hostreg *r = hostreg_of_locked((uintptr_t)p, 1);
    /* CU_MEMHOSTREGISTER_DEVICEMAP (2) */
    int ok = r && (!g_refuse_devptr_without_devicemap || (r->flags & 2));
    pthread_mutex_unlock(&g_mu);
    if (!ok) return E_INVALID_VALUE;
    *d = (CUdeviceptr)(uintptr_t)p;
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
#define HANDLE_TYPE_FABRIC 8
/* A fabric handle: magic, exporter pid, its memfd's number. */
#define FAB_MAGIC "FKCUFAB"
struct fabhandle { char magic[8]; int pid; int fd; };
#define VMM_GRANULARITY ((size_t)2 << 20)

static void vmm_unref_locked(struct vmm *v) {
    if (--v->refs == 0) {
        if (v->counted) g_device_used[v->phys] -= v->size;
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
    if (prop->location.type != 1 || prop->location.id < 0 || prop->location.id >= g_nvis) return E_INVALID_DEVICE;
    int phys = g_vis[prop->location.id];
    struct vmm *v = calloc(1, sizeof *v);
    if (!v) return E_OUT_OF_MEMORY;
    /* The memfd's name says its physical device, for an importer. */
    char name[32];
    snprintf(name, sizeof name, "fakecuda-vmm-%d", phys);
    v->fd = memfd_create(name, MFD_CLOEXEC);
    if (v->fd < 0 || ftruncate(v->fd, (off_t)size) != 0) { if (v->fd >= 0) close(v->fd); free(v); return E_OUT_OF_MEMORY; }
    pthread_mutex_lock(&g_mu);
    int charged = charge_locked(phys, size);
    pthread_mutex_unlock(&g_mu);
    if (!charged) { close(v->fd); free(v); return E_OUT_OF_MEMORY; }
    v->counted = 1;
    v->phys = phys;
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
    if (out && v && type == HANDLE_TYPE_FABRIC && (v->handle_types & HANDLE_TYPE_FABRIC)) {
        struct fabhandle f = { .pid = (int)getpid(), .fd = v->fd };
        memcpy(f.magic, FAB_MAGIC, 8);
        memset(out, 0, 64);
        memcpy(out, &f, sizeof f);
        return OK;
    }
    if (!out || !v || type != HANDLE_TYPE_POSIX_FD) return E_INVALID_VALUE;
    if (!(v->handle_types & HANDLE_TYPE_POSIX_FD)) return E_INVALID_VALUE;
    int fd = fcntl(v->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return E_OUT_OF_MEMORY;
    *(int *)out = fd;
    return OK;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type) {
    NEED_INIT();
    if (!h || (type != HANDLE_TYPE_POSIX_FD && type != HANDLE_TYPE_FABRIC)) return E_INVALID_VALUE;
    int fd;
    if (type == HANDLE_TYPE_FABRIC) {
        /* The exporter's memfd, by its number in the exporter (as an IMEX channel would find it). */
        struct fabhandle f;
        memcpy(&f, os_handle, sizeof f);
        if (memcmp(f.magic, FAB_MAGIC, 8) != 0) return E_INVALID_VALUE;
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/fd/%d", f.pid, f.fd);
        fd = open(path, O_RDWR | O_CLOEXEC);
    } else {
        fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
    }
    if (fd < 0) return E_INVALID_HANDLE;
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0 || st.st_size % VMM_GRANULARITY) { close(fd); return E_INVALID_HANDLE; }
    struct vmm *v = calloc(1, sizeof *v);
    if (!v) { close(fd); return E_OUT_OF_MEMORY; }
    v->fd = fd;
    v->size = (size_t)st.st_size;
    v->refs = 1;
    v->imported = 1; /* 1: the import's handle is held; 2: released */
    /* The exporter's memfd name: "/memfd:fakecuda-vmm-<phys> (deleted)". */
    char link[64], path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t nl = readlink(path, link, sizeof link - 1);
    link[nl > 0 ? nl : 0] = 0;
    const char *at = strstr(link, "fakecuda-vmm-");
    v->phys = at ? atoi(at + strlen("fakecuda-vmm-")) : 0;
    v->handle_types = type;
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
    int ord = ordinal_of(v->phys);
    *a = (struct alloc){ .ordinal = ord < 0 ? 0 : ord, .phys = v->phys, .fd = -1 };
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
    if (desc[0].location.type != 1 || desc[0].location.id < 0 || desc[0].location.id >= g_nvis) return E_INVALID_DEVICE;
    int phys = g_vis[desc[0].location.id];
    int prot = desc[0].flags == 3 ? PROT_READ | PROT_WRITE : desc[0].flags == 1 ? PROT_READ : PROT_NONE;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_alloc_locked((uintptr_t)ptr);
    /* Access for a device the memory does not live on: refused (no peer access here). */
    if (a && a->vmm && a->vmm->phys != phys) { pthread_mutex_unlock(&g_mu); return E_INVALID_DEVICE; }
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
    int ord = ordinal_of(v->phys);
    prop->location.id = ord < 0 ? 0 : ord;
    return OK;
}

/* ---- copies ---- */

/* Synchronous copies: after everything queued on the context's default stream. */
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { NEED_CTX(); drain(resolve(NULL)); memcpy((void *)(uintptr_t)dst, src, n); return OK; }
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { NEED_CTX(); drain(resolve(NULL)); memcpy(dst, (const void *)(uintptr_t)src, n); return OK; }

static CUresult copy_async(void *dst, const void *src, size_t n, CUstream s) {
    NEED_CTX();
    struct op o = { .kind = OP_COPY, .dst = dst, .src = src, .len = n };
    return enqueue(s, o);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) { return copy_async((void *)(uintptr_t)dst, src, n, s); }
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    CUresult r = copy_async(dst, (const void *)(uintptr_t)src, n, s);
    if (r != OK) return r;
    pthread_mutex_lock(&g_mu);
    int pinned = hostreg_of_locked((uintptr_t)dst, n) != NULL;
    pthread_mutex_unlock(&g_mu);
    /* Into pageable memory the copy is synchronous (the reference): the call
     * returns once the stream's earlier work and the copy are done. */
    if (!pinned) drain(resolve(s));
    return OK;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { return copy_async((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, s); }

/* ---- streams ---- */

CUresult cuStreamCreate(CUstream *ph, unsigned flags) {
    (void)flags;
    NEED_CTX();
    if (!ph) return E_INVALID_VALUE;
    *ph = stream_new(t_current);
    return *ph ? OK : E_OUT_OF_MEMORY;
}
CUresult cuStreamSynchronize(CUstream s) {
    NEED_INIT();
    struct fstream *f = resolve(s);
    if (!f) return E_INVALID_CONTEXT;
    if (atomic_load(&f->capturing)) return E_STREAM_CAPTURE_UNSUPPORTED;
    drain(f);
    return OK;
}

/* ---- graph capture: captured work is never run (see the top) ---- */

CUresult cuStreamBeginCapture_v2(CUstream hs, int mode) {
    (void)mode;
    NEED_INIT();
    struct fstream *s = resolve(hs);
    if (!s) return E_INVALID_CONTEXT;
    int no = 0;
    return atomic_compare_exchange_strong(&s->capturing, &no, 1) ? OK : E_INVALID_VALUE;
}
CUresult cuStreamBeginCapture(CUstream hs, int mode) { return cuStreamBeginCapture_v2(hs, mode); }
CUresult cuStreamEndCapture(CUstream hs, void **graph) {
    NEED_INIT();
    struct fstream *s = resolve(hs);
    if (!s) return E_INVALID_CONTEXT;
    if (!graph) return E_INVALID_VALUE;
    int yes = 1;
    if (!atomic_compare_exchange_strong(&s->capturing, &yes, 0)) return E_INVALID_VALUE;
    *graph = (void *)s; /* a token: graphs are never launched here */
    return OK;
}
/* CU_STREAM_CAPTURE_STATUS_NONE (0) or _ACTIVE (1). */
CUresult cuStreamIsCapturing(CUstream hs, int *status) {
    NEED_INIT();
    if (!status) return E_INVALID_VALUE;
    struct fstream *s = resolve(hs);
    if (!s) return E_INVALID_CONTEXT;
    *status = atomic_load(&s->capturing) ? 1 : 0;
    return OK;
}
CUresult cuStreamQuery(CUstream hs) {
    NEED_INIT();
    struct fstream *s = resolve(hs);
    if (!s) return E_INVALID_CONTEXT;
    pthread_mutex_lock(&s->mu);
    int idle = !s->head && !s->busy;
    pthread_mutex_unlock(&s->mu);
    return idle ? OK : E_NOT_READY;
}
/* Returns at once, as the real driver does: queued work runs on (or never
 * ends), and the worker frees the stream once it is idle. */
CUresult cuStreamDestroy_v2(CUstream s) {
    NEED_INIT();
    if ((uintptr_t)s <= 2) return E_INVALID_HANDLE;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return OK;
}

/* The 32-bit word at `addr`: registered host memory (its device pointer)
 * or device memory of this process; NULL otherwise. */
static _Atomic uint32_t *memop_word(CUdeviceptr addr) {
    if (addr % 4) return NULL;
    pthread_mutex_lock(&g_mu);
    int ok = hostreg_of_locked((uintptr_t)addr, 4) != NULL || find_alloc_locked((uintptr_t)addr) != NULL;
    pthread_mutex_unlock(&g_mu);
    return ok ? (_Atomic uint32_t *)(uintptr_t)addr : NULL;
}
CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) {
    NEED_INIT();
    if (g_refuse_stream_wait) return E_NOT_SUPPORTED;
    _Atomic uint32_t *w = memop_word(addr);
    if (!w) return E_INVALID_VALUE;
    struct op o = { .kind = OP_WAIT_VALUE, .dst = (void *)w, .value = value, .flags = flags };
    return enqueue(s, o);
}
CUresult cuStreamWriteValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) {
    (void)flags;
    NEED_INIT();
    _Atomic uint32_t *w = memop_word(addr);
    if (!w) return E_INVALID_VALUE;
    struct op o = { .kind = OP_WRITE_VALUE, .dst = (void *)w, .value = value };
    return enqueue(s, o);
}
CUresult cuStreamWaitValue32(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) { return cuStreamWaitValue32_v2(s, addr, value, flags); }
CUresult cuStreamWriteValue32(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) { return cuStreamWriteValue32_v2(s, addr, value, flags); }

/* ---- events ---- */

/* A legacy event handle: magic, creator pid, its memfd's number, event id. */
struct evhandle { char magic[8]; int pid; int fd; unsigned long long id; };
static unsigned long long g_event_ids;

CUresult cuEventCreate(CUevent *ph, unsigned flags) {
    (void)flags;
    NEED_CTX();
    if (!ph) return E_INVALID_VALUE;
    struct fevent *e = calloc(1, sizeof *e);
    if (!e) return E_OUT_OF_MEMORY;
    e->fd = memfd_create("fakecuda-event", MFD_CLOEXEC);
    size_t pg = page_bytes();
    e->sh = e->fd < 0 || ftruncate(e->fd, (off_t)pg) != 0 ? MAP_FAILED : mmap(NULL, pg, PROT_READ | PROT_WRITE, MAP_SHARED, e->fd, 0);
    if (e->sh == MAP_FAILED) { if (e->fd >= 0) close(e->fd); free(e); return E_OUT_OF_MEMORY; }
    pthread_mutex_lock(&g_mu);
    e->id = ++g_event_ids;
    pthread_mutex_unlock(&g_mu);
    /* The id follows the counters in the page: an opener checks it. */
    memcpy((char *)e->sh + sizeof(struct evshared), &e->id, sizeof e->id);
    e->map = calloc(1, sizeof *e->map);
    if (!e->map) { munmap(e->sh, pg); close(e->fd); free(e); return E_OUT_OF_MEMORY; }
    e->map->sh = e->sh;
    atomic_store(&e->map->refs, 1);
    e->owner = 1;
    e->ctx = t_current;
    e->sh->owner_pid = (int)getpid();
    atomic_store(&e->sh->recorder_pid, (int)getpid());
    *ph = e;
    return OK;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    NEED_INIT();
    if (!e) return E_INVALID_HANDLE;
    struct fstream *f = resolve(s);
    if (!f) return E_INVALID_CONTEXT;
    /* An event and a stream of different contexts: refused. */
    if (f->ctx != e->ctx) return E_INVALID_HANDLE;
    /* Under capture only a dependency in the graph: nothing is recorded. */
    if (atomic_load(&f->capturing)) return OK;
    atomic_store(&e->sh->recorder_pid, (int)getpid());
    uint64_t seq = atomic_fetch_add(&e->sh->recorded, 1) + 1;
    struct op o = { .kind = OP_SIGNAL, .ev = e->sh, .evm = e->map, .seq = seq };
    atomic_fetch_add(&e->map->refs, 1);
    CUresult r = enqueue(s, o);
    if (r != OK) evmap_unref(e->map);
    return r;
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
    (void)flags;
    NEED_INIT();
    if (!e) return E_INVALID_HANDLE;
    struct op o = { .kind = OP_WAIT, .ev = e->sh, .evm = e->map, .seq = atomic_load(&e->sh->recorded) };
    atomic_fetch_add(&e->map->refs, 1);
    CUresult r = enqueue(s, o);
    if (r != OK) evmap_unref(e->map);
    return r;
}
/* Whether process `pid` is alive (not gone, not a zombie). */
static int pid_alive(int pid) {
    if (kill(pid, 0) != 0 && errno != EPERM) return 0;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    const char *rp = strrchr(buf, ')');
    return !(rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'));
}
CUresult cuEventQuery(CUevent e) {
    NEED_INIT();
    if (!e) return E_INVALID_HANDLE;
    /* Undefined for the reference once the exporter died: an error here. */
    if (!e->owner && !pid_alive(e->sh->owner_pid)) return E_UNKNOWN;
    return atomic_load(&e->sh->completed) >= atomic_load(&e->sh->recorded) ? OK : E_NOT_READY;
}
/* Never returns for a record whose recorder died before it ran. */
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
    evmap_unref(e->map);
    if (e->fd >= 0) close(e->fd);
    free(e);
    return OK;
}
CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e) {
    NEED_INIT();
    if (!h || !e || !e->owner) return E_INVALID_VALUE;
    struct evhandle m = { .pid = (int)getpid(), .fd = e->fd, .id = e->id };
    memcpy(m.magic, EVT_MAGIC, 8);
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &m, sizeof m);
    return OK;
}
CUresult cuIpcOpenEventHandle(CUevent *ph, CUipcEventHandle h) {
    NEED_CTX();
    if (g_event_open_delay_us > 0) sleep_us(g_event_open_delay_us);
    struct evhandle m;
    memcpy(&m, h.reserved, sizeof m);
    if (!ph || memcmp(m.magic, EVT_MAGIC, 8) != 0) return E_INVALID_VALUE;
    if (m.pid == (int)getpid()) return E_INVALID_CONTEXT;
    struct fevent *e = calloc(1, sizeof *e);
    if (!e) return E_OUT_OF_MEMORY;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", m.pid, m.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    size_t pg = page_bytes();
    e->sh = fd < 0 ? MAP_FAILED : mmap(NULL, pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    unsigned long long id = 0;
    if (e->sh != MAP_FAILED) memcpy(&id, (char *)e->sh + sizeof(struct evshared), sizeof id);
    if (e->sh == MAP_FAILED || e->sh->owner_pid != m.pid || id != m.id) {
        if (e->sh != MAP_FAILED) munmap(e->sh, pg);
        free(e);
        return E_INVALID_HANDLE;
    }
    e->map = calloc(1, sizeof *e->map);
    if (!e->map) { munmap(e->sh, pg); free(e); return E_OUT_OF_MEMORY; }
    e->map->sh = e->sh;
    atomic_store(&e->map->refs, 1);
    e->fd = -1;
    e->id = m.id;
    e->ctx = t_current;
    pthread_mutex_lock(&g_mu);
    g_events_opened++;
    write_stats_locked();
    pthread_mutex_unlock(&g_mu);
    *ph = e;
    return OK;
}
