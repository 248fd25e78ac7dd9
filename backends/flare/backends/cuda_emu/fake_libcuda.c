/* fake_libcuda.c: a stand-in libcuda.so.1 for testing Flare's CUDA backend without a GPU.
 *
 * Built by flare.backends.cuda_emu.fake_driver and found through LD_LIBRARY_PATH,
 * it is what the REAL cuda-bindings load: they resolve every driver entry point through
 * cuGetProcAddress_v2 (symbol, CUDA version) and call it with C arguments converted from
 * Python. So argument types, out-parameters, return conventions and error codes of every
 * call Flare makes are exercised for real; only the GPU is missing. Kernels run in the
 * host emulator: cuModuleGetFunction looks the kernel name up in the emulator's shared
 * library ($FLARE_FAKE_CUDA_KERNELS), cuLaunchKernel calls it with kernelParams[0] (the
 * KArgs block). Stream capture records launches; graph launch replays them.
 *
 * Behaves like the driver where Flare could otherwise be fooled: every call before cuInit
 * fails with CUDA_ERROR_NOT_INITIALIZED; memory and module calls need a current context;
 * fresh device and pinned memory hold garbage; copies and synchronizes during a capture
 * fail; handles are checked. Not a CUDA implementation: one device, synchronous streams.
 *
 * Environment: FLARE_FAKE_CUDA_KERNELS (path of the emulator library, required to launch),
 * FLARE_FAKE_CUDA_MEMORY (bytes, default 1 GiB), FLARE_FAKE_CUDA_CC (e.g. "90").
 * flare_fake_cuda_live(counts[6]) reports live allocations, pinned buffers, modules,
 * streams, graphs and exec graphs (leak checks).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;
typedef void* CUgraph;
typedef void* CUgraphExec;

enum {
    SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101,
    INVALID_IMAGE = 200, INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_FOUND = 500,
    ILLEGAL_STATE = 401, LAUNCH_FAILED = 719, CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901,
    GRAPH_EXEC_UPDATE_FAILURE = 910
};

#define KARGS_SIZE 616  /* sizeof(KArgs), static_asserted in kernels/common.cuh */
#define MAX_OBJ 4096

typedef const char* (*HostKernel)(const void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned);

typedef struct { HostKernel fn; char name[128]; unsigned g[3], b[3]; unsigned char args[KARGS_SIZE]; } Node;
typedef struct { int live; Node* nodes; int n, cap; } Graph;           /* graphs and exec graphs */
typedef struct { int live; unsigned char* base; size_t size; } Block;  /* device and pinned memory */
typedef struct { int live; unsigned char* image; size_t size; } Module;
typedef struct { int live; Graph* capture; } Stream;
typedef struct { int live; HostKernel fn; char name[128]; } Function;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized, ctx_refs, ctx_current;
static size_t capacity = (size_t)1 << 30, used;
static Block mem[MAX_OBJ], pinned[MAX_OBJ];
static Module modules[MAX_OBJ];
static Stream streams[MAX_OBJ];
static Graph graphs[MAX_OBJ], execs[MAX_OBJ];
static Function functions[MAX_OBJ];
static void* kernels;
static unsigned fills;

#define ENTER(need_ctx)                                                                  \
    pthread_mutex_lock(&lock);                                                           \
    if (!initialized) { pthread_mutex_unlock(&lock); return NOT_INITIALIZED; }           \
    if ((need_ctx) && (!ctx_refs || !ctx_current)) { pthread_mutex_unlock(&lock); return INVALID_CONTEXT; }
#define LEAVE(code) do { CUresult rc_ = (code); pthread_mutex_unlock(&lock); return rc_; } while (0)

/* handles are 1-based slot numbers (never 0, never a host pointer) */
#define HANDLE(i) ((void*)(uintptr_t)((i) + 1))
#define SLOT(h) ((long)(uintptr_t)(h) - 1)

static void garbage(unsigned char* p, size_t n) {
    const uint32_t pat[3] = {0x7FC0DEADu, 0xFFFF7E57u, 0x12345678u + ++fills};
    for (size_t i = 0; i < n; ++i) p[i] = ((const unsigned char*)pat)[i % 12];
}

static int any_capture(void) {
    for (int i = 0; i < MAX_OBJ; ++i)
        if (streams[i].live && streams[i].capture) return 1;
    return 0;
}

static int in_blocks(Block* blocks, uintptr_t p, size_t n) {
    for (int i = 0; i < MAX_OBJ; ++i)
        if (blocks[i].live && (uintptr_t)blocks[i].base <= p && p + n <= (uintptr_t)blocks[i].base + blocks[i].size)
            return 1;
    return 0;
}

static Graph* stream_capture(CUstream s) {
    long i = SLOT(s);
    return (i >= 0 && i < MAX_OBJ && streams[i].live) ? streams[i].capture : NULL;
}

static int stream_ok(CUstream s) {
    long i = SLOT(s);
    return s == NULL || (i >= 0 && i < MAX_OBJ && streams[i].live);
}

/* ---- errors, init, devices, contexts -------------------------------------------------- */

static const char* err_name(CUresult e) {
    switch (e) {
        case SUCCESS: return "CUDA_SUCCESS";
        case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
        case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
        case NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
        case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
        case INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
        case INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
        case INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
        case ILLEGAL_STATE: return "CUDA_ERROR_ILLEGAL_STATE";
        case NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
        case LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
        case CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
        case GRAPH_EXEC_UPDATE_FAILURE: return "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE";
        default: return NULL;
    }
}
CUresult cuGetErrorName(CUresult e, const char** s) { *s = err_name(e); return *s ? SUCCESS : INVALID_VALUE; }
CUresult cuGetErrorString(CUresult e, const char** s) { *s = err_name(e); return *s ? SUCCESS : INVALID_VALUE; }

CUresult cuInit(unsigned flags) {
    if (flags != 0) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (!initialized) {
        const char* m = getenv("FLARE_FAKE_CUDA_MEMORY");
        if (m) capacity = (size_t)strtoull(m, NULL, 10);
        const char* k = getenv("FLARE_FAKE_CUDA_KERNELS");
        if (k) kernels = dlopen(k, RTLD_NOW | RTLD_LOCAL);
        initialized = 1;
    }
    LEAVE(SUCCESS);
}

CUresult cuDriverGetVersion(int* v) { if (!v) return INVALID_VALUE; *v = 13000; return SUCCESS; }

CUresult cuDeviceGetCount(int* n) { ENTER(0); if (!n) LEAVE(INVALID_VALUE); *n = 1; LEAVE(SUCCESS); }

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    ENTER(0);
    if (!d) LEAVE(INVALID_VALUE);
    if (ordinal != 0) LEAVE(INVALID_DEVICE);
    *d = 0;
    LEAVE(SUCCESS);
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    ENTER(0);
    if (d != 0) LEAVE(INVALID_DEVICE);
    if (!name || len <= 0) LEAVE(INVALID_VALUE);
    snprintf(name, (size_t)len, "Flare stand-in GPU (host emulator)");
    LEAVE(SUCCESS);
}

CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    ENTER(0);
    if (d != 0) LEAVE(INVALID_DEVICE);
    if (!v) LEAVE(INVALID_VALUE);
    const char* cc = getenv("FLARE_FAKE_CUDA_CC");
    int arch = cc ? atoi(cc) : 90;
    if (attr == 75) *v = arch / 10;        /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
    else if (attr == 76) *v = arch % 10;   /* ..._MINOR */
    else *v = 0;
    LEAVE(SUCCESS);
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    ENTER(0);
    if (d != 0) LEAVE(INVALID_DEVICE);
    if (!bytes) LEAVE(INVALID_VALUE);
    *bytes = capacity;
    LEAVE(SUCCESS);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    ENTER(0);
    if (d != 0) LEAVE(INVALID_DEVICE);
    if (!c) LEAVE(INVALID_VALUE);
    ++ctx_refs;
    *c = (CUcontext)(uintptr_t)0xC0DE;
    LEAVE(SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    ENTER(0);
    if (d != 0) LEAVE(INVALID_DEVICE);
    if (ctx_refs == 0) LEAVE(INVALID_CONTEXT);
    if (--ctx_refs == 0) ctx_current = 0;
    LEAVE(SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext c) {
    ENTER(0);
    if (c != NULL && (c != (CUcontext)(uintptr_t)0xC0DE || ctx_refs == 0)) LEAVE(INVALID_CONTEXT);
    ctx_current = c != NULL;
    LEAVE(SUCCESS);
}

/* ---- memory ------------------------------------------------------------------------------ */

CUresult cuMemGetInfo_v2(size_t* free_, size_t* total) {
    ENTER(1);
    if (!free_ || !total) LEAVE(INVALID_VALUE);
    *free_ = capacity - used;
    *total = capacity;
    LEAVE(SUCCESS);
}

static CUresult alloc_in(Block* blocks, size_t n, void** out, int device) {
    if (device && used + n > capacity) return OUT_OF_MEMORY;
    for (int i = 0; i < MAX_OBJ; ++i) {
        if (blocks[i].live) continue;
        void* p = NULL;
        if (posix_memalign(&p, 256, n ? n : 1)) return OUT_OF_MEMORY;
        garbage(p, n);  /* neither the driver nor cuMemAllocHost zeroes memory */
        blocks[i] = (Block){1, p, n};
        if (device) used += n;
        *out = p;
        return SUCCESS;
    }
    return OUT_OF_MEMORY;
}

static CUresult free_in(Block* blocks, uintptr_t p, int device) {
    for (int i = 0; i < MAX_OBJ; ++i) {
        if (blocks[i].live && (uintptr_t)blocks[i].base == p) {
            free(blocks[i].base);
            if (device) used -= blocks[i].size;
            blocks[i].live = 0;
            return SUCCESS;
        }
    }
    return INVALID_VALUE;
}

CUresult cuMemAlloc_v2(CUdeviceptr* d, size_t n) {
    ENTER(1);
    if (!d || n == 0) LEAVE(INVALID_VALUE);
    void* p = NULL;
    CUresult rc = alloc_in(mem, n, &p, 1);
    if (rc == SUCCESS) *d = (CUdeviceptr)(uintptr_t)p;
    LEAVE(rc);
}

CUresult cuMemFree_v2(CUdeviceptr d) { ENTER(1); LEAVE(free_in(mem, (uintptr_t)d, 1)); }

CUresult cuMemAllocHost_v2(void** p, size_t n) {
    ENTER(1);
    if (!p || n == 0) LEAVE(INVALID_VALUE);
    LEAVE(alloc_in(pinned, n, p, 0));
}

CUresult cuMemFreeHost(void* p) { ENTER(1); LEAVE(free_in(pinned, (uintptr_t)p, 0)); }

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    ENTER(1);
    if (!stream_ok(s)) LEAVE(INVALID_HANDLE);
    if (any_capture()) LEAVE(CAPTURE_UNSUPPORTED);
    if (!in_blocks(mem, (uintptr_t)dst, n) || !in_blocks(pinned, (uintptr_t)src, n)) LEAVE(INVALID_VALUE);
    memcpy((void*)(uintptr_t)dst, src, n);
    LEAVE(SUCCESS);
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    ENTER(1);
    if (!stream_ok(s)) LEAVE(INVALID_HANDLE);
    if (any_capture()) LEAVE(CAPTURE_UNSUPPORTED);
    if (!in_blocks(mem, (uintptr_t)src, n) || !in_blocks(pinned, (uintptr_t)dst, n)) LEAVE(INVALID_VALUE);
    memcpy(dst, (const void*)(uintptr_t)src, n);
    LEAVE(SUCCESS);
}

CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    ENTER(1);
    if (!stream_ok(s)) LEAVE(INVALID_HANDLE);
    if (!in_blocks(mem, (uintptr_t)d, n)) LEAVE(INVALID_VALUE);
    memset((void*)(uintptr_t)d, v, n);
    LEAVE(SUCCESS);
}

/* ---- streams ------------------------------------------------------------------------------ */

CUresult cuStreamCreate(CUstream* s, unsigned flags) {
    ENTER(1);
    if (!s || flags > 1) LEAVE(INVALID_VALUE);
    for (int i = 0; i < MAX_OBJ; ++i)
        if (!streams[i].live) { streams[i] = (Stream){1, NULL}; *s = HANDLE(i); LEAVE(SUCCESS); }
    LEAVE(OUT_OF_MEMORY);
}

CUresult cuStreamDestroy_v2(CUstream s) {
    ENTER(1);
    long i = SLOT(s);
    if (s == NULL || i < 0 || i >= MAX_OBJ || !streams[i].live) LEAVE(INVALID_HANDLE);
    streams[i].live = 0;
    LEAVE(SUCCESS);
}

CUresult cuStreamSynchronize(CUstream s) {
    ENTER(1);
    if (!stream_ok(s)) LEAVE(INVALID_HANDLE);
    if (stream_capture(s)) LEAVE(CAPTURE_UNSUPPORTED);
    LEAVE(SUCCESS);
}

/* ---- modules and launches ----------------------------------------------------------------- */

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    ENTER(1);
    if (!m || !image) LEAVE(INVALID_VALUE);
    const unsigned char* p = image;
    size_t n;
    if (memcmp(p, "\x7f" "ELF", 4) == 0) {  /* a CUBIN: its size from the ELF64 header */
        uint64_t shoff; uint16_t shentsize, shnum;
        memcpy(&shoff, p + 0x28, 8); memcpy(&shentsize, p + 0x3A, 2); memcpy(&shnum, p + 0x3C, 2);
        n = (size_t)(shoff + (uint64_t)shentsize * shnum);
    } else if (strstr((const char*)p, ".target")) {  /* NUL-terminated PTX */
        n = strlen((const char*)p) + 1;
    } else {
        LEAVE(INVALID_IMAGE);
    }
    for (int i = 0; i < MAX_OBJ; ++i) {
        if (modules[i].live) continue;
        modules[i] = (Module){1, malloc(n), n};
        memcpy(modules[i].image, p, n);
        *m = HANDLE(i);
        LEAVE(SUCCESS);
    }
    LEAVE(OUT_OF_MEMORY);
}

CUresult cuModuleUnload(CUmodule m) {
    ENTER(1);
    long i = SLOT(m);
    if (i < 0 || i >= MAX_OBJ || !modules[i].live) LEAVE(INVALID_HANDLE);
    free(modules[i].image);
    modules[i].live = 0;
    LEAVE(SUCCESS);
}

static int image_has(const Module* mod, const char* name) {
    size_t k = strlen(name);
    for (size_t i = 0; i + k <= mod->size; ++i)
        if (memcmp(mod->image + i, name, k) == 0) return 1;
    return 0;
}

CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    ENTER(1);
    long i = SLOT(m);
    if (!f || !name) LEAVE(INVALID_VALUE);
    if (i < 0 || i >= MAX_OBJ || !modules[i].live) LEAVE(INVALID_HANDLE);
    if (!image_has(&modules[i], name) || strlen(name) >= 128) LEAVE(NOT_FOUND);  /* the image must name it */
    HostKernel fn = kernels ? (HostKernel)dlsym(kernels, name) : NULL;
    if (!fn) LEAVE(NOT_FOUND);
    for (int j = 0; j < MAX_OBJ; ++j) {
        if (functions[j].live && functions[j].fn == fn) { *f = HANDLE(j); LEAVE(SUCCESS); }
        if (!functions[j].live) {
            functions[j].live = 1;
            functions[j].fn = fn;
            snprintf(functions[j].name, sizeof functions[j].name, "%s", name);
            *f = HANDLE(j);
            LEAVE(SUCCESS);
        }
    }
    LEAVE(OUT_OF_MEMORY);
}

static CUresult run_nodes(const Node* nodes, int n) {
    for (int i = 0; i < n; ++i) {
        const char* err = nodes[i].fn(nodes[i].args, nodes[i].g[0], nodes[i].g[1], nodes[i].g[2],
                                      nodes[i].b[0], nodes[i].b[1], nodes[i].b[2]);
        if (err) {
            fprintf(stderr, "fake libcuda: %s: %s\n", nodes[i].name, err);
            return LAUNCH_FAILED;
        }
    }
    return SUCCESS;
}

static void push(Graph* g, const Node* node) {
    if (g->n == g->cap) {
        g->cap = g->cap ? 2 * g->cap : 16;
        g->nodes = realloc(g->nodes, sizeof(Node) * (size_t)g->cap);
    }
    g->nodes[g->n++] = *node;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream s, void** params, void** extra) {
    ENTER(1);
    long i = SLOT(f);
    if (i < 0 || i >= MAX_OBJ || !functions[i].live) LEAVE(INVALID_HANDLE);
    if (!stream_ok(s)) LEAVE(INVALID_HANDLE);
    if (!params || !params[0] || extra) LEAVE(INVALID_VALUE);  /* Flare passes one parameter block */
    if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 || bx * by * bz == 0 || bx * by * bz > 1024
        || shared > 48 * 1024)
        LEAVE(INVALID_VALUE);
    Node node;
    node.fn = functions[i].fn;
    snprintf(node.name, sizeof node.name, "%s", functions[i].name);
    node.g[0] = gx; node.g[1] = gy; node.g[2] = gz;
    node.b[0] = bx; node.b[1] = by; node.b[2] = bz;
    memcpy(node.args, params[0], KARGS_SIZE);  /* the driver copies parameters at the call */
    Graph* cap = stream_capture(s);
    if (cap) { push(cap, &node); LEAVE(SUCCESS); }
    LEAVE(run_nodes(&node, 1));
}

/* ---- graphs -------------------------------------------------------------------------------- */

CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
    ENTER(1);
    long i = SLOT(s);
    if (s == NULL || i < 0 || i >= MAX_OBJ || !streams[i].live) LEAVE(INVALID_HANDLE);  /* not the legacy stream */
    if (mode < 0 || mode > 2) LEAVE(INVALID_VALUE);
    if (streams[i].capture) LEAVE(ILLEGAL_STATE);
    streams[i].capture = calloc(1, sizeof(Graph));
    streams[i].capture->live = 1;
    LEAVE(SUCCESS);
}

static CUresult new_graph(Graph* table, const Graph* from, void** out) {
    for (int i = 0; i < MAX_OBJ; ++i) {
        if (table[i].live) continue;
        table[i] = (Graph){1, NULL, 0, 0};
        for (int k = 0; k < from->n; ++k) push(&table[i], &from->nodes[k]);
        *out = HANDLE(i);
        return SUCCESS;
    }
    return OUT_OF_MEMORY;
}

CUresult cuStreamEndCapture(CUstream s, CUgraph* g) {
    ENTER(1);
    long i = SLOT(s);
    if (!g) LEAVE(INVALID_VALUE);
    if (s == NULL || i < 0 || i >= MAX_OBJ || !streams[i].live) LEAVE(INVALID_HANDLE);
    Graph* cap = streams[i].capture;
    if (!cap) LEAVE(ILLEGAL_STATE);
    streams[i].capture = NULL;
    CUresult rc = new_graph(graphs, cap, g);
    free(cap->nodes);
    free(cap);
    LEAVE(rc);
}

static Graph* lookup(Graph* table, void* h) {
    long i = SLOT(h);
    return (i >= 0 && i < MAX_OBJ && table[i].live) ? &table[i] : NULL;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec* e, CUgraph g, unsigned long long flags) {
    ENTER(1);
    Graph* src = lookup(graphs, g);
    if (!e || !src || flags != 0) LEAVE(INVALID_VALUE);
    LEAVE(new_graph(execs, src, e));
}

CUresult cuGraphExecUpdate_v2(CUgraphExec e, CUgraph g, void* result_info) {
    ENTER(1);
    Graph* ex = lookup(execs, e);
    Graph* src = lookup(graphs, g);
    if (!ex || !src) LEAVE(INVALID_VALUE);
    int same = ex->n == src->n;
    for (int k = 0; same && k < src->n; ++k) same = ex->nodes[k].fn == src->nodes[k].fn;
    if (result_info) memset(result_info, 0, 24);  /* CUgraphExecUpdateResultInfo: result + 2 nodes */
    if (!same) {
        if (result_info) *(int*)result_info = 2;  /* CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED */
        LEAVE(GRAPH_EXEC_UPDATE_FAILURE);
    }
    for (int k = 0; k < src->n; ++k) ex->nodes[k] = src->nodes[k];
    LEAVE(SUCCESS);
}

CUresult cuGraphLaunch(CUgraphExec e, CUstream s) {
    ENTER(1);
    Graph* ex = lookup(execs, e);
    if (!ex || !stream_ok(s)) LEAVE(INVALID_HANDLE);
    if (stream_capture(s)) LEAVE(CAPTURE_UNSUPPORTED);
    LEAVE(run_nodes(ex->nodes, ex->n));
}

static CUresult destroy(Graph* table, void* h) {
    Graph* x = lookup(table, h);
    if (!x) return INVALID_HANDLE;
    free(x->nodes);
    *x = (Graph){0, NULL, 0, 0};
    return SUCCESS;
}

CUresult cuGraphExecDestroy(CUgraphExec e) { ENTER(1); LEAVE(destroy(execs, e)); }
CUresult cuGraphDestroy(CUgraph g) { ENTER(1); LEAVE(destroy(graphs, g)); }

/* ---- entry points ------------------------------------------------------------------------------ */

typedef struct { const char* name; void* fn; } Entry;
static const Entry ENTRIES[] = {
    {"cuGetErrorName", (void*)cuGetErrorName}, {"cuGetErrorString", (void*)cuGetErrorString},
    {"cuInit", (void*)cuInit}, {"cuDriverGetVersion", (void*)cuDriverGetVersion},
    {"cuDeviceGetCount", (void*)cuDeviceGetCount}, {"cuDeviceGet", (void*)cuDeviceGet},
    {"cuDeviceGetName", (void*)cuDeviceGetName}, {"cuDeviceGetAttribute", (void*)cuDeviceGetAttribute},
    {"cuDeviceTotalMem", (void*)cuDeviceTotalMem_v2},
    {"cuDevicePrimaryCtxRetain", (void*)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", (void*)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxSetCurrent", (void*)cuCtxSetCurrent}, {"cuMemGetInfo", (void*)cuMemGetInfo_v2},
    {"cuMemAlloc", (void*)cuMemAlloc_v2}, {"cuMemFree", (void*)cuMemFree_v2},
    {"cuMemAllocHost", (void*)cuMemAllocHost_v2}, {"cuMemFreeHost", (void*)cuMemFreeHost},
    {"cuMemcpyHtoDAsync", (void*)cuMemcpyHtoDAsync_v2}, {"cuMemcpyDtoHAsync", (void*)cuMemcpyDtoHAsync_v2},
    {"cuMemsetD8Async", (void*)cuMemsetD8Async}, {"cuStreamCreate", (void*)cuStreamCreate},
    {"cuStreamDestroy", (void*)cuStreamDestroy_v2}, {"cuStreamSynchronize", (void*)cuStreamSynchronize},
    {"cuModuleLoadData", (void*)cuModuleLoadData}, {"cuModuleUnload", (void*)cuModuleUnload},
    {"cuModuleGetFunction", (void*)cuModuleGetFunction}, {"cuLaunchKernel", (void*)cuLaunchKernel},
    {"cuStreamBeginCapture", (void*)cuStreamBeginCapture_v2}, {"cuStreamEndCapture", (void*)cuStreamEndCapture},
    {"cuGraphInstantiateWithFlags", (void*)cuGraphInstantiateWithFlags},
    {"cuGraphExecUpdate", (void*)cuGraphExecUpdate_v2}, {"cuGraphLaunch", (void*)cuGraphLaunch},
    {"cuGraphExecDestroy", (void*)cuGraphExecDestroy}, {"cuGraphDestroy", (void*)cuGraphDestroy},
};

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, unsigned long long flags, int* status) {
    (void)version;
    (void)flags;
    if (!symbol || !pfn) return INVALID_VALUE;
    *pfn = NULL;
    if (!strcmp(symbol, "cuGetProcAddress")) *pfn = (void*)cuGetProcAddress_v2;
    for (size_t i = 0; !*pfn && i < sizeof ENTRIES / sizeof ENTRIES[0]; ++i)
        if (!strcmp(symbol, ENTRIES[i].name)) *pfn = ENTRIES[i].fn;
    if (status) *status = *pfn ? 0 : 1;  /* CU_GET_PROC_ADDRESS_SUCCESS / _SYMBOL_NOT_FOUND */
    return *pfn ? SUCCESS : NOT_FOUND;
}

void flare_fake_cuda_live(int counts[6]) {
    pthread_mutex_lock(&lock);
    memset(counts, 0, 6 * sizeof(int));
    for (int i = 0; i < MAX_OBJ; ++i) {
        counts[0] += mem[i].live;
        counts[1] += pinned[i].live;
        counts[2] += modules[i].live;
        counts[3] += streams[i].live;
        counts[4] += graphs[i].live;
        counts[5] += execs[i].live;
    }
    pthread_mutex_unlock(&lock);
}
