/*
 * probe: runs a scenario of CUDA driver / NVML calls given as arguments and prints one line per
 * step ("<step> rc=<CUresult> ..."), so the Python tests can drive every path of the shim.
 *
 * How it reaches the driver (PROBE_MODE):
 *   link     the symbols it is linked against (libcuda.so.1 / libnvidia-ml.so.1), as a program
 *            built with -lcuda does;
 *   dlopen   dlopen("libcuda.so.1") + dlsym on the handle, as PyTorch and ctypes do;
 *   getproc  dlopen + dlsym("cuGetProcAddress_v2") only, everything else through
 *            cuGetProcAddress (version 12040), as the CUDA 12 runtime does.
 * PROBE_CUDA_LIB names the library dlopen'ed as the driver (default libcuda.so.1);
 * PROBE_DLMOPEN=1 loads it with dlmopen(LM_ID_NEWLM), where LD_PRELOAD does not reach.
 *
 * Steps (sizes take K/M/G suffixes):
 *   init | ctx[:dev] | release[:dev] | ctxcreate[:dev] | ctxdestroy | reset[:dev]
 *   allocs:COUNT:N (kept) | alloc:N | managed:N | async:N | pool:N | pitch:W:H | vmm:N[:dev] | array:W:H
 *   array3d:W:H:D | mipmap:W:H:LEVELS | free | freeall
 *   info | total[:dev] | nvml[:idx] | module | unload
 *   launch:N:US | launchex:N:US | coop:N:US | graph:N:NODES:US | sync
 *   burst:N:US                             N launches then a sync; prints the wall time (and when it began)
 *   nvmlprocs | nvmlutil                   NVML's process list / device utilisation as seen here
 *   graphmem:N (a graph with an N-byte memory allocation node, launched) | graphtrim
 *   vmmmap:N (cuMemCreate, map it, release the handle while mapped) | unmap
 *   keeppool (the device's pool keeps what is freed, as PyTorch sets it) | trim
 *   util:WARM_S:MEASURE_S:US:KIND[:all]   launch KIND (kernel|ex|coop|graph|legacy) for WARM+MEASURE
 *                                          seconds; print the utilisation of the last MEASURE
 *                                          (over whole launch periods: first to last launch)
 *   timeline:SECONDS:US                    launch for SECONDS; print the gaps between launches
 *   threads:N:ROUNDS:SIZE                  N threads allocating, launching and freeing at once
 *   hammer:N:ROUNDS:SIZE                   N threads allocating three blocks and freeing them, over
 *                                          and over (refusals at the limit counted apart); peak:
 *                                          the card's own count, the highest one seen
 *   bench:N                                N launches, then N alloc+free pairs: CPU ns per op
 *   benchrounds:N                          prints benchready, then a round of bench:N ("round ...")
 *                                          per line read on stdin, until end of input
 *   pairs:SECONDS                          4 KiB alloc+free pairs for SECONDS; how many, and how
 *                                          many NVML process lists this process asked for meanwhile
 *   capture:N:US                           a stream captured (global mode): N kernels of US into
 *                                          it, the graph instantiated and launched
 *   capturewhile:US[:sync]                 another thread launches a kernel of US (and with sync
 *                                          synchronises the context) while this one captures a
 *                                          stream (global mode)
 *   alloc1:N | pitch1:W:H | info1 | total1  the v1 ABI (32-bit: cuMemAlloc, cuMemAllocPitch,
 *                                          cuMemGetInfo, cuDeviceTotalMem without _v2)
 *   procaddr | errstr | devused[:dev] | fork:N | sleep:MS | waitfile:PATH | ready | wait
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../../libvgpu/src/cuda_api.h"

/* linked symbols (link mode) */
CUresult cuInit(unsigned int);
CUresult cuDeviceGetCount(int *);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
nvmlReturn_t nvmlInit_v2(void);

typedef CUresult (*cuCtxSetCurrent_fn)(CUcontext);
typedef CUresult (*cuModuleGetFunction_fn)(CUfunction *, CUmodule, const char *);
typedef CUresult (*cuCtxSynchronize_fn)(void);
typedef CUresult (*cuGraphCreate_fn)(CUgraph *, unsigned int);
typedef CUresult (*cuGraphAddKernelNode_v2_fn)(CUgraphNode *, CUgraph, const CUgraphNode *,
                                               size_t, const CUDA_KERNEL_NODE_PARAMS_v2 *);
typedef CUresult (*cuGraphInstantiateWithFlags_fn)(CUgraphExec *, CUgraph, unsigned long long);
typedef CUresult (*cuGraphDestroy_fn)(CUgraph);
typedef CUresult (*cuGraphExecDestroy_fn)(CUgraphExec);
typedef CUresult (*cuGetErrorString_fn)(CUresult, const char **);
typedef nvmlReturn_t (*nvmlDeviceGetHandleByIndex_v2_fn)(unsigned int, nvmlDevice_t *);
typedef unsigned long long (*cuDoubleBusyNs_fn)(int, int, unsigned long long, unsigned long long);
typedef unsigned long long (*cuDoubleDeviceUsed_fn)(int);
typedef unsigned long long (*nvmlDoubleProcessQueries_fn)(void);

static struct {
    cuInit_fn cuInit;
    cuDeviceGetCount_fn cuDeviceGetCount;
    cuDevicePrimaryCtxRetain_fn cuDevicePrimaryCtxRetain;
    cuDevicePrimaryCtxRelease_v2_fn cuDevicePrimaryCtxRelease;
    cuDevicePrimaryCtxReset_v2_fn cuDevicePrimaryCtxReset;
    cuCtxSetCurrent_fn cuCtxSetCurrent;
    cuCtxCreate_v2_fn cuCtxCreate;
    cuCtxDestroy_v2_fn cuCtxDestroy;
    cuMemAlloc_v2_fn cuMemAlloc;
    cuMemAllocManaged_fn cuMemAllocManaged;
    cuMemAllocAsync_fn cuMemAllocAsync;
    cuMemAllocFromPoolAsync_fn cuMemAllocFromPoolAsync;
    cuMemAllocPitch_v2_fn cuMemAllocPitch;
    cuMemFree_v2_fn cuMemFree;
    cuMemFreeAsync_fn cuMemFreeAsync;
    CUresult (*cuDeviceGetMemPool)(CUmemoryPool *, CUdevice);
    CUresult (*cuMemPoolTrimTo)(CUmemoryPool, size_t);
    CUresult (*cuMemPoolSetAttribute)(CUmemoryPool, int, void *);
    cuMemCreate_fn cuMemCreate;
    cuMemRelease_fn cuMemRelease;
    CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                         unsigned long long);
    CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
    cuArrayCreate_v2_fn cuArrayCreate;
    cuArray3DCreate_v2_fn cuArray3DCreate;
    cuMipmappedArrayCreate_fn cuMipmappedArrayCreate;
    cuArrayDestroy_fn cuArrayDestroy;
    cuMipmappedArrayDestroy_fn cuMipmappedArrayDestroy;
    cuMemGetInfo_v2_fn cuMemGetInfo;
    cuDeviceTotalMem_v2_fn cuDeviceTotalMem;
    cuModuleLoadData_fn cuModuleLoadData;
    cuModuleUnload_fn cuModuleUnload;
    cuModuleGetFunction_fn cuModuleGetFunction;
    cuLaunchKernel_fn cuLaunchKernel;
    cuLaunchKernelEx_fn cuLaunchKernelEx;
    cuLaunchCooperativeKernel_fn cuLaunchCooperativeKernel;
    cuGraphLaunch_fn cuGraphLaunch;
    cuGraphCreate_fn cuGraphCreate;
    cuGraphAddKernelNode_v2_fn cuGraphAddKernelNode;
    CUresult (*cuGraphAddMemAllocNode)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                                       CUDA_MEM_ALLOC_NODE_PARAMS *);
    CUresult (*cuDeviceGraphMemTrim)(CUdevice);
    cuGraphInstantiateWithFlags_fn cuGraphInstantiateWithFlags;
    cuGraphDestroy_fn cuGraphDestroy;
    cuGraphExecDestroy_fn cuGraphExecDestroy;
    cuCtxSynchronize_fn cuCtxSynchronize;
    cuGetErrorString_fn cuGetErrorString;
    cuGetProcAddress_v2_fn cuGetProcAddress;
    nvmlInit_v2_fn nvmlInit;
    nvmlDeviceGetHandleByIndex_v2_fn nvmlDeviceGetHandleByIndex;
    nvmlDeviceGetMemoryInfo_fn nvmlDeviceGetMemoryInfo;
    nvmlDeviceGetMemoryInfo_v2_fn nvmlDeviceGetMemoryInfo_v2;
    nvmlReturn_t (*nvmlProcs)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_v2_t *);
    nvmlReturn_t (*nvmlUtil)(nvmlDevice_t, nvmlUtilization_t *);
    CUresult (*cuLaunchGrid)(CUfunction, int, int);
    CUresult (*cuStreamCreate)(CUstream *, unsigned int);
    CUresult (*cuStreamBeginCapture)(CUstream, int);
    CUresult (*cuStreamEndCapture)(CUstream, CUgraph *);
    cuDoubleBusyNs_fn busy;
    cuDoubleDeviceUsed_fn device_used;
    nvmlDoubleProcessQueries_fn nvml_queries;
} D;

static void *cuda_handle, *nvml_handle;
static const char *mode;

/* name: exported symbol; base: cuGetProcAddress name */
static void *sym(const char *name, const char *base) {
    void *p = NULL;
    if (strcmp(mode, "link") == 0) {
        p = dlsym(RTLD_DEFAULT, name);
    } else if (strcmp(mode, "getproc") == 0 && base) {
        CUdriverProcAddressQueryResult st;
        if (D.cuGetProcAddress(base, &p, 12040, 0, &st) != CUDA_SUCCESS) p = NULL;
    } else {
        p = dlsym(cuda_handle, name);
    }
    return p;
}

/* A v1 entry point (CUDA before 3.2): by its own name, or cuGetProcAddress at version 3000. */
static void *sym_v1(const char *name) {
    void *p = NULL;
    if (strcmp(mode, "getproc") == 0) {
        CUdriverProcAddressQueryResult st;
        if (D.cuGetProcAddress(name, &p, 3000, 0, &st) != CUDA_SUCCESS) p = NULL;
        return p;
    }
    return dlsym(strcmp(mode, "link") == 0 ? RTLD_DEFAULT : cuda_handle, name);
}

static void resolve(void) {
    mode = getenv("PROBE_MODE");
    if (!mode) mode = "link";
    if (strcmp(mode, "link") != 0) {
        const char *lib = getenv("PROBE_CUDA_LIB"); /* the driver under another name */
        lib = lib && *lib ? lib : "libcuda.so.1";
        const char *ns = getenv("PROBE_DLMOPEN"); /* the driver in a link-map namespace of its own */
        cuda_handle = ns && *ns ? dlmopen(LM_ID_NEWLM, lib, RTLD_NOW | RTLD_LOCAL)
                                : dlopen(lib, RTLD_NOW | RTLD_LOCAL);
        nvml_handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!cuda_handle || !nvml_handle) {
            printf("dlopen failed: %s\n", dlerror());
            exit(2);
        }
        D.cuGetProcAddress = (cuGetProcAddress_v2_fn)dlsym(cuda_handle, "cuGetProcAddress_v2");
    } else {
        D.cuGetProcAddress = cuGetProcAddress_v2;
        D.nvmlInit = nvmlInit_v2; /* a real reference: the program is linked against NVML */
        nvml_handle = RTLD_DEFAULT;
    }
#define R(field, name, base) D.field = (__typeof__(D.field))sym(name, base)
    R(cuInit, "cuInit", "cuInit");
    R(cuDeviceGetCount, "cuDeviceGetCount", "cuDeviceGetCount");
    R(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain");
    R(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
    R(cuDevicePrimaryCtxReset, "cuDevicePrimaryCtxReset_v2", "cuDevicePrimaryCtxReset");
    R(cuCtxSetCurrent, "cuCtxSetCurrent", "cuCtxSetCurrent");
    R(cuCtxCreate, "cuCtxCreate_v2", NULL);
    R(cuCtxDestroy, "cuCtxDestroy_v2", "cuCtxDestroy");
    R(cuMemAlloc, "cuMemAlloc_v2", "cuMemAlloc");
    R(cuMemAllocManaged, "cuMemAllocManaged", "cuMemAllocManaged");
    R(cuMemAllocAsync, "cuMemAllocAsync", "cuMemAllocAsync");
    R(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync");
    R(cuMemAllocPitch, "cuMemAllocPitch_v2", "cuMemAllocPitch");
    R(cuMemFree, "cuMemFree_v2", "cuMemFree");
    R(cuMemFreeAsync, "cuMemFreeAsync", "cuMemFreeAsync");
    R(cuDeviceGetMemPool, "cuDeviceGetMemPool", "cuDeviceGetMemPool");
    R(cuMemPoolTrimTo, "cuMemPoolTrimTo", "cuMemPoolTrimTo");
    R(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", "cuMemPoolSetAttribute");
    R(cuMemCreate, "cuMemCreate", "cuMemCreate");
    R(cuMemRelease, "cuMemRelease", "cuMemRelease");
    R(cuMemAddressReserve, "cuMemAddressReserve", "cuMemAddressReserve");
    R(cuMemMap, "cuMemMap", "cuMemMap");
    R(cuMemUnmap, "cuMemUnmap", "cuMemUnmap");
    R(cuArrayCreate, "cuArrayCreate_v2", "cuArrayCreate");
    R(cuArray3DCreate, "cuArray3DCreate_v2", "cuArray3DCreate");
    R(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", "cuMipmappedArrayCreate");
    R(cuArrayDestroy, "cuArrayDestroy", "cuArrayDestroy");
    R(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", "cuMipmappedArrayDestroy");
    R(cuMemGetInfo, "cuMemGetInfo_v2", "cuMemGetInfo");
    R(cuDeviceTotalMem, "cuDeviceTotalMem_v2", "cuDeviceTotalMem");
    R(cuModuleLoadData, "cuModuleLoadData", "cuModuleLoadData");
    R(cuModuleUnload, "cuModuleUnload", "cuModuleUnload");
    R(cuModuleGetFunction, "cuModuleGetFunction", "cuModuleGetFunction");
    R(cuLaunchKernel, "cuLaunchKernel", "cuLaunchKernel");
    R(cuLaunchKernelEx, "cuLaunchKernelEx", "cuLaunchKernelEx");
    R(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel");
    R(cuGraphLaunch, "cuGraphLaunch", "cuGraphLaunch");
    R(cuLaunchGrid, "cuLaunchGrid", "cuLaunchGrid");
    R(cuCtxSynchronize, "cuCtxSynchronize", "cuCtxSynchronize");
    R(cuGetErrorString, "cuGetErrorString", "cuGetErrorString");
    R(cuStreamCreate, "cuStreamCreate", "cuStreamCreate");
    R(cuStreamBeginCapture, "cuStreamBeginCapture_v2", "cuStreamBeginCapture");
    R(cuStreamEndCapture, "cuStreamEndCapture", "cuStreamEndCapture");
#undef R
    /* graph building and test helpers: straight from the library */
    void *h = cuda_handle ? cuda_handle : RTLD_DEFAULT;
    D.cuGraphCreate = (cuGraphCreate_fn)dlsym(h, "cuGraphCreate");
    D.cuGraphAddKernelNode = (cuGraphAddKernelNode_v2_fn)dlsym(h, "cuGraphAddKernelNode_v2");
    D.cuGraphAddMemAllocNode = (__typeof__(D.cuGraphAddMemAllocNode))dlsym(h, "cuGraphAddMemAllocNode");
    D.cuDeviceGraphMemTrim = (__typeof__(D.cuDeviceGraphMemTrim))sym("cuDeviceGraphMemTrim",
                                                                    "cuDeviceGraphMemTrim");
    D.cuGraphInstantiateWithFlags =
        (cuGraphInstantiateWithFlags_fn)dlsym(h, "cuGraphInstantiateWithFlags");
    D.cuGraphDestroy = (cuGraphDestroy_fn)dlsym(h, "cuGraphDestroy");
    D.cuGraphExecDestroy = (cuGraphExecDestroy_fn)dlsym(h, "cuGraphExecDestroy");
    D.busy = (cuDoubleBusyNs_fn)dlsym(h, "cuDoubleBusyNs");
    D.device_used = (cuDoubleDeviceUsed_fn)dlsym(h, "cuDoubleDeviceUsed");
    if (!D.nvmlInit) D.nvmlInit = (nvmlInit_v2_fn)dlsym(nvml_handle, "nvmlInit_v2");
    D.nvmlDeviceGetHandleByIndex =
        (nvmlDeviceGetHandleByIndex_v2_fn)dlsym(nvml_handle, "nvmlDeviceGetHandleByIndex_v2");
    D.nvmlDeviceGetMemoryInfo = (nvmlDeviceGetMemoryInfo_fn)dlsym(nvml_handle, "nvmlDeviceGetMemoryInfo");
    D.nvmlProcs = (__typeof__(D.nvmlProcs))dlsym(nvml_handle, "nvmlDeviceGetComputeRunningProcesses_v2");
    D.nvmlUtil = (__typeof__(D.nvmlUtil))dlsym(nvml_handle, "nvmlDeviceGetUtilizationRates");
    D.nvml_queries = (nvmlDoubleProcessQueries_fn)dlsym(nvml_handle, "nvmlDoubleProcessQueries");
    D.nvmlDeviceGetMemoryInfo_v2 =
        (nvmlDeviceGetMemoryInfo_v2_fn)dlsym(nvml_handle, "nvmlDeviceGetMemoryInfo_v2");
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t size_arg(const char *s) {
    char *end;
    uint64_t v = strtoull(s, &end, 10);
    switch (*end) {
    case 'K': return v << 10;
    case 'M': return v << 20;
    case 'G': return v << 30;
    default: return v;
    }
}

enum { K_PTR, K_ASYNC, K_VMM, K_ARRAY, K_MIPMAP };
static struct {
    int kind;
    uint64_t h;
} stack[65536];
static int depth;
static CUcontext primary; /* the last retained primary context, for worker threads */
static CUdeviceptr mapped_va; /* vmmmap / unmap */
static uint64_t mapped_size;
static CUcontext created[64];
static int ncreated;
static CUmodule modules[64];
static int nmodules;
static CUfunction kernels[4096];

static void push(int kind, uint64_t h) {
    if (depth < 65536) stack[depth++] = (typeof(stack[0])){kind, h};
}

static CUresult pop_free(void) {
    if (!depth) return CUDA_ERROR_INVALID_VALUE;
    depth--;
    switch (stack[depth].kind) {
    case K_ASYNC: return D.cuMemFreeAsync(stack[depth].h, NULL);
    case K_VMM: return D.cuMemRelease(stack[depth].h);
    case K_ARRAY: return D.cuArrayDestroy((CUarray)(uintptr_t)stack[depth].h);
    case K_MIPMAP: return D.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)stack[depth].h);
    default: return D.cuMemFree(stack[depth].h);
    }
}

static CUfunction kernel(unsigned us) {
    if (us < 4096 && kernels[us]) return kernels[us];
    if (!nmodules) {
        if (D.cuModuleLoadData(&modules[0], "image") != CUDA_SUCCESS) return NULL;
        nmodules = 1;
    }
    char name[32];
    snprintf(name, sizeof(name), "k%u", us);
    CUfunction f = NULL;
    D.cuModuleGetFunction(&f, modules[0], name);
    if (us < 4096) kernels[us] = f;
    return f;
}

static CUgraphExec make_graph(int nodes, unsigned us) {
    CUgraph g;
    CUgraphExec e;
    D.cuGraphCreate(&g, 0);
    for (int i = 0; i < nodes; i++) {
        CUDA_KERNEL_NODE_PARAMS_v2 p;
        memset(&p, 0, sizeof(p));
        p.func = kernel(us);
        CUgraphNode n;
        D.cuGraphAddKernelNode(&n, g, NULL, 0, &p);
    }
    D.cuGraphInstantiateWithFlags(&e, g, 0);
    D.cuGraphDestroy(g); /* the executable graph stands alone */
    return e;
}

static CUresult launch_one(const char *kind, CUfunction f, CUgraphExec g) {
    if (strcmp(kind, "ex") == 0) {
        CUlaunchConfig c;
        memset(&c, 0, sizeof(c));
        c.gridDimX = c.gridDimY = c.gridDimZ = c.blockDimX = c.blockDimY = c.blockDimZ = 1;
        return D.cuLaunchKernelEx(&c, f, NULL, NULL);
    }
    if (strcmp(kind, "coop") == 0) return D.cuLaunchCooperativeKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL);
    if (strcmp(kind, "graph") == 0) return D.cuGraphLaunch(g, NULL);
    if (strcmp(kind, "legacy") == 0) return D.cuLaunchGrid(f, 1, 1);
    return D.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
}

struct worker {
    int rounds;
    uint64_t size;
    int failures;
};

static void *work(void *p) {
    struct worker *w = p;
    D.cuCtxSetCurrent(primary);
    CUfunction f = kernels[1];
    for (int i = 0; i < w->rounds; i++) {
        CUdeviceptr a = 0, b = 0;
        if (D.cuMemAlloc(&a, w->size) || D.cuMemAllocAsync(&b, w->size, NULL)) w->failures++;
        if (f && D.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) w->failures++;
        if (a && D.cuMemFree(a)) w->failures++;
        if (b && D.cuMemFreeAsync(b, NULL)) w->failures++;
    }
    return NULL;
}

/* hammer: allocations and frees only, refusals at the limit expected; the card's own count
 * (the double's, not the shim's) sampled after every allocation that succeeded. */
struct hammer {
    int rounds;
    uint64_t size;
    long ok, refused, errors;
    unsigned long long peak;
};

static void *hammer(void *p) { /* each round: up to three blocks held at once, then freed */
    struct hammer *h = p;
    D.cuCtxSetCurrent(primary);
    for (int i = 0; i < h->rounds; i++) {
        CUdeviceptr a[3] = {0};
        for (int k = 0; k < 3; k++) {
            CUresult rc = D.cuMemAlloc(&a[k], h->size);
            if (rc == CUDA_ERROR_OUT_OF_MEMORY) h->refused++;
            else if (rc) h->errors++;
            else h->ok++;
        }
        unsigned long long used = D.device_used(0);
        if (used > h->peak) h->peak = used;
        for (int k = 0; k < 3; k++)
            if (a[k] && D.cuMemFree(a[k])) h->errors++;
    }
    return NULL;
}

static CUfunction elsewhere_fn;
static int elsewhere_sync;
static void *launch_elsewhere(void *p) { /* capturewhile: the other thread */
    CUresult *rc = p;
    D.cuCtxSetCurrent(primary);
    *rc = D.cuLaunchKernel(elsewhere_fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    if (!*rc && elsewhere_sync) *rc = D.cuCtxSynchronize();
    return NULL;
}

/* Begins a global-mode capture on a new stream: its rc, the stream in *s. */
static CUresult begin_capture(CUstream *s) {
    CUresult rc = D.cuStreamCreate(s, 0);
    return rc ? rc : D.cuStreamBeginCapture(*s, 0);
}

static double cpu_ns_since(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    return (t1.tv_sec - t0->tv_sec) * 1e9 + (t1.tv_nsec - t0->tv_nsec);
}

/* bench: the calling thread's CPU ns per launch over COUNT launches, then per alloc+free pair
 * over COUNT pairs (4 KiB each) */
static CUresult bench_round(long count, double *launch, double *alloc) {
    CUresult rc = CUDA_SUCCESS;
    CUfunction f = kernel(0);
    struct timespec t0;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    for (long i = 0; i < count && !rc; i++)
        rc = D.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    *launch = cpu_ns_since(&t0) / count;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    for (long i = 0; i < count && !rc; i++) {
        CUdeviceptr p = 0;
        rc = D.cuMemAlloc(&p, 4096);
        if (!rc) rc = D.cuMemFree(p);
    }
    *alloc = cpu_ns_since(&t0) / count;
    return rc;
}

static int step(char *arg) {
    char *a[8] = {0};
    int n = 0;
    for (char *t = strtok(arg, ":"); t && n < 8; t = strtok(NULL, ":")) a[n++] = t;
    const char *cmd = a[0];
    CUresult rc = CUDA_SUCCESS;
    if (!strcmp(cmd, "init")) {
        uint64_t t0 = now_ns();
        rc = D.cuInit(0);
        uint64_t t1 = now_ns();
        int count = 0;
        if (!rc) D.cuDeviceGetCount(&count);
        printf("init rc=%d devices=%d init_us=%llu done_ns=%llu\n", rc, count,
               (unsigned long long)((t1 - t0) / 1000), (unsigned long long)t1);
    } else if (!strcmp(cmd, "ctx")) {
        CUcontext c = NULL;
        rc = D.cuDevicePrimaryCtxRetain(&c, a[1] ? atoi(a[1]) : 0);
        if (!rc) D.cuCtxSetCurrent(c), primary = c;
        printf("ctx rc=%d\n", rc);
    } else if (!strcmp(cmd, "release")) {
        rc = D.cuDevicePrimaryCtxRelease(a[1] ? atoi(a[1]) : 0);
        printf("release rc=%d\n", rc);
    } else if (!strcmp(cmd, "reset")) {
        rc = D.cuDevicePrimaryCtxReset(a[1] ? atoi(a[1]) : 0);
        printf("reset rc=%d\n", rc);
    } else if (!strcmp(cmd, "ctxcreate")) {
        CUcontext c = NULL;
        rc = D.cuCtxCreate(&c, 0, a[1] ? atoi(a[1]) : 0);
        if (!rc && ncreated < 64) created[ncreated++] = c;
        printf("ctxcreate rc=%d\n", rc);
    } else if (!strcmp(cmd, "ctxdestroy")) {
        rc = ncreated ? D.cuCtxDestroy(created[--ncreated]) : CUDA_ERROR_INVALID_CONTEXT;
        printf("ctxdestroy rc=%d\n", rc);
    } else if (!strcmp(cmd, "alloc") || !strcmp(cmd, "managed") || !strcmp(cmd, "async") ||
               !strcmp(cmd, "pool")) {
        CUdeviceptr p = 0;
        uint64_t sz = size_arg(a[1]);
        int kind = K_PTR;
        if (!strcmp(cmd, "alloc")) rc = D.cuMemAlloc(&p, sz);
        else if (!strcmp(cmd, "managed")) rc = D.cuMemAllocManaged(&p, sz, 1);
        else if (!strcmp(cmd, "async")) rc = D.cuMemAllocAsync(&p, sz, NULL), kind = K_ASYNC;
        else {
            CUmemoryPool pool = NULL;
            D.cuDeviceGetMemPool(&pool, 0);
            rc = D.cuMemAllocFromPoolAsync(&p, sz, pool, NULL), kind = K_ASYNC;
        }
        if (!rc) push(kind, p);
        printf("%s rc=%d\n", cmd, rc);
    } else if (!strcmp(cmd, "allocs")) { /* allocs:N:SIZE, all kept */
        int count = atoi(a[1]), ok = 0;
        for (int i = 0; i < count; i++) {
            CUdeviceptr p = 0;
            rc = D.cuMemAlloc(&p, size_arg(a[2]));
            if (rc) break;
            push(K_PTR, p);
            ok++;
        }
        printf("allocs rc=%d ok=%d\n", rc, ok);
    } else if (!strcmp(cmd, "pitch")) {
        CUdeviceptr p = 0;
        size_t pitch = 0;
        rc = D.cuMemAllocPitch(&p, &pitch, size_arg(a[1]), size_arg(a[2]), 4);
        if (!rc) push(K_PTR, p);
        printf("pitch rc=%d pitch=%zu\n", rc, pitch);
    } else if (!strcmp(cmd, "vmm")) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof(prop));
        prop.type = 1;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = a[2] ? atoi(a[2]) : 0;
        CUmemGenericAllocationHandle h = 0;
        rc = D.cuMemCreate(&h, size_arg(a[1]), &prop, 0);
        if (!rc) push(K_VMM, h);
        printf("vmm rc=%d\n", rc);
    } else if (!strcmp(cmd, "vmmmap")) { /* create, map, release the handle while mapped */
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof(prop));
        prop.type = 1;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        uint64_t size = size_arg(a[1]);
        CUmemGenericAllocationHandle h = 0;
        rc = D.cuMemCreate(&h, size, &prop, 0);
        if (!rc) rc = D.cuMemAddressReserve(&mapped_va, size, 0, 0, 0);
        if (!rc) rc = D.cuMemMap(mapped_va, size, 0, h, 0);
        if (!rc) rc = D.cuMemRelease(h);
        mapped_size = size;
        printf("vmmmap rc=%d\n", rc);
    } else if (!strcmp(cmd, "unmap")) {
        rc = D.cuMemUnmap(mapped_va, mapped_size);
        printf("unmap rc=%d\n", rc);
    } else if (!strcmp(cmd, "array")) {
        CUDA_ARRAY_DESCRIPTOR d = {size_arg(a[1]), size_arg(a[2]), CU_AD_FORMAT_FLOAT, 1};
        CUarray arr;
        rc = D.cuArrayCreate(&arr, &d);
        if (!rc) push(K_ARRAY, (uint64_t)(uintptr_t)arr);
        printf("array rc=%d\n", rc);
    } else if (!strcmp(cmd, "array3d") || !strcmp(cmd, "mipmap")) {
        CUDA_ARRAY3D_DESCRIPTOR d;
        memset(&d, 0, sizeof(d));
        d.Width = size_arg(a[1]);
        d.Height = size_arg(a[2]);
        d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
        d.NumChannels = 4;
        if (!strcmp(cmd, "array3d")) {
            d.Depth = size_arg(a[3]);
            CUarray arr;
            rc = D.cuArray3DCreate(&arr, &d);
            if (!rc) push(K_ARRAY, (uint64_t)(uintptr_t)arr);
        } else {
            CUmipmappedArray arr;
            rc = D.cuMipmappedArrayCreate(&arr, &d, (unsigned)atoi(a[3]));
            if (!rc) push(K_MIPMAP, (uint64_t)(uintptr_t)arr);
        }
        printf("%s rc=%d\n", cmd, rc);
    } else if (!strcmp(cmd, "free")) {
        rc = pop_free();
        printf("free rc=%d\n", rc);
    } else if (!strcmp(cmd, "freeall")) {
        while (depth && !rc) rc = pop_free();
        printf("freeall rc=%d\n", rc);
    } else if (!strcmp(cmd, "info")) {
        size_t fr = 0, tot = 0;
        rc = D.cuMemGetInfo(&fr, &tot);
        printf("info rc=%d free=%zu total=%zu\n", rc, fr, tot);
    } else if (!strcmp(cmd, "total")) {
        size_t tot = 0;
        rc = D.cuDeviceTotalMem(&tot, a[1] ? atoi(a[1]) : 0);
        printf("total rc=%d total=%zu\n", rc, tot);
    } else if (!strcmp(cmd, "nvml")) {
        nvmlDevice_t dev;
        nvmlMemory_t m;
        nvmlMemory_v2_t m2;
        memset(&m2, 0, sizeof(m2));
        m2.version = nvmlMemory_v2;
        int r = D.nvmlInit();
        if (!r) r = D.nvmlDeviceGetHandleByIndex(a[1] ? (unsigned)atoi(a[1]) : 0, &dev);
        if (!r) r = D.nvmlDeviceGetMemoryInfo(dev, &m);
        int r2 = r ? r : D.nvmlDeviceGetMemoryInfo_v2(dev, &m2);
        printf("nvml rc=%d total=%llu used=%llu free=%llu rc2=%d total2=%llu used2=%llu "
               "free2=%llu\n", r, m.total, m.used, m.free, r2, m2.total, m2.used, m2.free);
        rc = r;
    } else if (!strcmp(cmd, "nvmlprocs") || !strcmp(cmd, "nvmlutil")) {
        nvmlDevice_t dev;
        int r = D.nvmlInit();
        if (!r) r = D.nvmlDeviceGetHandleByIndex(0, &dev);
        if (!strcmp(cmd, "nvmlutil")) {
            nvmlUtilization_t u = {0, 0};
            if (!r) r = D.nvmlUtil(dev, &u);
            printf("nvmlutil rc=%d gpu=%u\n", r, u.gpu);
        } else {
            nvmlProcessInfo_v2_t p[64];
            unsigned int n = 64;
            if (!r) r = D.nvmlProcs(dev, &n, p);
            printf("nvmlprocs rc=%d self=%d n=%u pids=", r, (int)getpid(), r ? 0 : n);
            for (unsigned int i = 0; !r && i < n; i++) printf("%s%u", i ? "," : "", p[i].pid);
            printf("\n");
        }
        rc = r;
    } else if (!strcmp(cmd, "module")) {
        rc = nmodules < 64 ? D.cuModuleLoadData(&modules[nmodules], "image") : 1;
        if (!rc) nmodules++;
        printf("module rc=%d\n", rc);
    } else if (!strcmp(cmd, "unload")) {
        rc = nmodules ? D.cuModuleUnload(modules[--nmodules]) : 1;
        memset(kernels, 0, sizeof(kernels));
        printf("unload rc=%d\n", rc);
    } else if (!strcmp(cmd, "launch") || !strcmp(cmd, "launchex") || !strcmp(cmd, "coop") ||
               !strcmp(cmd, "graph")) {
        int count = atoi(a[1]);
        int nodes = !strcmp(cmd, "graph") ? atoi(a[2]) : 1;
        unsigned us = (unsigned)atoi(!strcmp(cmd, "graph") ? a[3] : a[2]);
        const char *kind = !strcmp(cmd, "launchex") ? "ex" : !strcmp(cmd, "launch") ? "kernel" : cmd;
        CUfunction f = kernel(us);
        CUgraphExec g = !strcmp(cmd, "graph") ? make_graph(nodes, us) : NULL;
        for (int i = 0; i < count && !rc; i++) rc = launch_one(kind, f, g);
        if (g) D.cuGraphExecDestroy(g);
        printf("%s rc=%d\n", cmd, rc);
    } else if (!strcmp(cmd, "graphmem")) { /* a graph with one memory allocation node, launched */
        CUgraph g;
        CUgraphExec e;
        CUgraphNode node;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        memset(&p, 0, sizeof(p));
        p.bytesize = size_arg(a[1]);
        D.cuGraphCreate(&g, 0);
        rc = D.cuGraphAddMemAllocNode(&node, g, NULL, 0, &p);
        if (!rc) rc = D.cuGraphInstantiateWithFlags(&e, g, 0);
        if (!rc) rc = D.cuGraphLaunch(e, NULL);
        if (!rc) D.cuGraphExecDestroy(e);
        D.cuGraphDestroy(g);
        printf("graphmem rc=%d\n", rc);
    } else if (!strcmp(cmd, "graphtrim")) {
        rc = D.cuDeviceGraphMemTrim(0);
        printf("graphtrim rc=%d\n", rc);
    } else if (!strcmp(cmd, "keeppool") || !strcmp(cmd, "trim")) {
        /* keeppool: release threshold UINT64_MAX, as PyTorch sets it; trim: cuMemPoolTrimTo 0 */
        CUmemoryPool pool = NULL;
        rc = D.cuDeviceGetMemPool(&pool, 0);
        cuuint64_t keep = ~0ull;
        if (!rc) rc = !strcmp(cmd, "trim") ? D.cuMemPoolTrimTo(pool, 0)
                                            : D.cuMemPoolSetAttribute(pool, 4, &keep);
        printf("%s rc=%d\n", cmd, rc);
    } else if (!strcmp(cmd, "burst")) { /* burst:N:US  N launches and a sync: wall time */
        int count = atoi(a[1]);
        CUfunction f = kernel((unsigned)atoi(a[2]));
        uint64_t t0 = now_ns();
        for (int i = 0; i < count && !rc; i++) rc = launch_one("kernel", f, NULL);
        if (!rc) rc = D.cuCtxSynchronize();
        printf("burst rc=%d ms=%.1f at_ms=%.1f\n", rc, (now_ns() - t0) / 1e6, t0 / 1e6);
    } else if (!strcmp(cmd, "sync")) {
        rc = D.cuCtxSynchronize();
        printf("sync rc=%d\n", rc);
    } else if (!strcmp(cmd, "util")) {
        double warm = atof(a[1]), measure = atof(a[2]);
        unsigned us = (unsigned)atoi(a[3]);
        const char *kind = a[4];
        int all = a[5] && !strcmp(a[5], "all");
        CUfunction f = kernel(us);
        CUgraphExec g = !strcmp(kind, "graph") ? make_graph(4, us / 4) : NULL;
        uint64_t t0 = now_ns(), tw = t0 + (uint64_t)(warm * 1e9), t1 = tw + (uint64_t)(measure * 1e9);
        long launches = 0;
        uint64_t first = 0, last = 0; /* returns of the first and last launches measured */
        while (now_ns() < t1 && !rc) {
            rc = launch_one(kind, f, g);
            launches++;
            uint64_t t = now_ns();
            if (t >= tw) {
                if (!first) first = t;
                last = t;
            }
        }
        uint64_t end = now_ns();
        if (g) D.cuGraphExecDestroy(g);
        /* over whole launch periods: from the first launch measured to the last one (a launch
         * starts on the GPU as it returns, the limiter having held it before), unless fewer
         * than two launches fell in the measured time */
        if (last <= first) first = tw, last = end;
        unsigned long long b = D.busy(0, all ? 0 : -1, first, last);
        printf("util rc=%d util=%.1f launches=%ld\n", rc, 100.0 * (double)b / (double)(last - first),
               launches);
    } else if (!strcmp(cmd, "floorback")) {
        /* floorback:SECS:US:PCT  launches for SECS, then: how long after its first launch this
         * process's share of the GPU stayed at PCT or more in every 250 ms window (stepped by
         * 10 ms; the first window's end at best; SECS - 0.1 s: never) */
        double secs = atof(a[1]), pct = atof(a[3]);
        CUfunction f = kernel((unsigned)atoi(a[2]));
        uint64_t t0 = now_ns(), end = t0 + (uint64_t)(secs * 1e9), w = 250000000ull;
        while (!rc && now_ns() < end) rc = launch_one("kernel", f, NULL);
        if (!rc) rc = D.cuCtxSynchronize();
        /* the windows end 100 ms before the launches did: the last launches run later, queued
         * behind the card's other work */
        uint64_t back = w;
        for (uint64_t s = t0; s + w + 100000000ull <= end; s += 10000000ull)
            if (100.0 * (double)D.busy(0, -1, s, s + w) / (double)w < pct) back = s + w - t0;
        printf("floorback rc=%d back_ms=%.1f\n", rc, back / 1e6);
    } else if (!strcmp(cmd, "timeline")) {
        double secs = atof(a[1]);
        unsigned us = (unsigned)atoi(a[2]);
        CUfunction f = kernel(us);
        uint64_t t0 = now_ns(), end = t0 + (uint64_t)(secs * 1e9), last = t0;
        printf("timeline start_ms=%.1f", t0 / 1e6);
        long launches = 0;
        while (!rc) {
            rc = D.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            uint64_t t = now_ns();
            launches++;
            if (t - last > 50000000ull) printf(" gap=%.1f-%.1f", last / 1e6, t / 1e6);
            last = t;
            if (t >= end) break;
        }
        printf(" end_ms=%.1f launches=%ld rc=%d\n", last / 1e6, launches, rc);
    } else if (!strcmp(cmd, "alloc1") || !strcmp(cmd, "pitch1")) { /* the v1 ABI */
        unsigned int p = 0, pitch = 0;
        if (!strcmp(cmd, "alloc1")) {
            CUresult (*f)(unsigned int *, unsigned int) = (__typeof__(f))sym_v1("cuMemAlloc");
            rc = f ? f(&p, (unsigned int)size_arg(a[1])) : 500;
        } else {
            CUresult (*f)(unsigned int *, unsigned int *, unsigned int, unsigned int, unsigned int) =
                (__typeof__(f))sym_v1("cuMemAllocPitch");
            rc = f ? f(&p, &pitch, (unsigned int)size_arg(a[1]), (unsigned int)size_arg(a[2]), 4) : 500;
        }
        printf("%s rc=%d\n", cmd, rc);
    } else if (!strcmp(cmd, "info1") || !strcmp(cmd, "total1")) {
        unsigned int fr = 0, tot = 0;
        if (!strcmp(cmd, "info1")) {
            CUresult (*f)(unsigned int *, unsigned int *) = (__typeof__(f))sym_v1("cuMemGetInfo");
            rc = f ? f(&fr, &tot) : 500;
        } else {
            CUresult (*f)(unsigned int *, CUdevice) = (__typeof__(f))sym_v1("cuDeviceTotalMem");
            rc = f ? f(&tot, 0) : 500;
        }
        printf("%s rc=%d free=%u total=%u\n", cmd, rc, fr, tot);
    } else if (!strcmp(cmd, "capture")) { /* capture:N:US */
        CUfunction f = kernel((unsigned)atoi(a[2]));
        CUstream s = NULL;
        CUgraph g = NULL;
        CUgraphExec e = NULL;
        CUresult begin = begin_capture(&s), launch = CUDA_SUCCESS, end, run = CUDA_SUCCESS;
        for (int i = 0; i < atoi(a[1]) && !begin && !launch; i++)
            launch = D.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        end = begin ? begin : D.cuStreamEndCapture(s, &g);
        if (!end) run = D.cuGraphInstantiateWithFlags(&e, g, 0);
        if (!end && !run) run = D.cuGraphLaunch(e, NULL);
        if (!end && !run) run = D.cuCtxSynchronize();
        rc = begin ? begin : launch ? launch : end ? end : run;
        printf("capture rc=%d begin=%d launch=%d end=%d run=%d\n", rc, begin, launch, end, run);
    } else if (!strcmp(cmd, "capturewhile")) { /* capturewhile:US[:sync] */
        elsewhere_fn = kernel((unsigned)atoi(a[1]));
        elsewhere_sync = a[2] && !strcmp(a[2], "sync");
        CUstream s = NULL;
        CUgraph g = NULL;
        CUresult other = CUDA_SUCCESS, end;
        rc = begin_capture(&s);
        pthread_t t;
        if (!rc) pthread_create(&t, NULL, launch_elsewhere, &other), pthread_join(t, NULL);
        if (!rc) rc = D.cuLaunchKernel(elsewhere_fn, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        end = D.cuStreamEndCapture(s, &g);
        if (!rc) rc = end;
        printf("capturewhile rc=%d other=%d end=%d\n", rc, other, end);
    } else if (!strcmp(cmd, "procaddr")) {
        void *via_proc = NULL, *via_dlsym = NULL, *via_default;
        CUdriverProcAddressQueryResult st;
        rc = D.cuGetProcAddress("cuMemAlloc", &via_proc, 12040, 0, &st);
        via_dlsym = cuda_handle ? dlsym(cuda_handle, "cuMemAlloc_v2") : NULL;
        via_default = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
        void *launch_proc = NULL, *ptsz = NULL;
        D.cuGetProcAddress("cuLaunchKernel", &launch_proc, 12040, 0, &st);
        D.cuGetProcAddress("cuLaunchKernel", &ptsz, 12040,
                           CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st);
        Dl_info i1, i2, i3;
        memset(&i1, 0, sizeof(i1));
        memset(&i2, 0, sizeof(i2));
        memset(&i3, 0, sizeof(i3));
        dladdr(via_proc, &i1);
        dladdr(launch_proc, &i2);
        dladdr(ptsz, &i3);
        printf("procaddr rc=%d memalloc_lib=%s memalloc_sym=%s launch_lib=%s ptsz_sym=%s "
               "same_as_default=%d same_as_dlsym=%d\n",
               rc, i1.dli_fname ? strrchr(i1.dli_fname, '/') + 1 : "?",
               i1.dli_sname ? i1.dli_sname : "?",
               i2.dli_fname ? strrchr(i2.dli_fname, '/') + 1 : "?",
               i3.dli_sname ? i3.dli_sname : "?", via_proc == via_default,
               via_dlsym ? via_proc == via_dlsym : -1);
    } else if (!strcmp(cmd, "errstr")) {
        const char *s = NULL;
        rc = D.cuGetErrorString ? D.cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &s) : 500;
        printf("errstr rc=%d text=%s\n", rc, s ? s : "?");
    } else if (!strcmp(cmd, "devused")) { /* the simulated card's own count, not the shim's */
        printf("devused used=%llu\n", D.device_used(a[1] ? atoi(a[1]) : 0));
    } else if (!strcmp(cmd, "fork")) { /* a child that allocates after fork, then exits */
        fflush(stdout);
        pid_t child = fork();
        if (child == 0) {
            CUdeviceptr p = 0;
            CUresult r = D.cuMemAlloc(&p, size_arg(a[1]));
            printf("child alloc rc=%d\n", r);
            fflush(stdout);
            _exit(0);
        }
        int status = 0;
        waitpid(child, &status, 0);
        printf("fork rc=0 status=%d\n", status);
    } else if (!strcmp(cmd, "threads")) { /* threads:N:ROUNDS:SIZE alloc/launch/free at once */
        int n = atoi(a[1]);
        pthread_t tids[64];
        struct worker w[64];
        kernel(1);
        for (int i = 0; i < n && i < 64; i++) {
            w[i] = (struct worker){atoi(a[2]), size_arg(a[3]), 0};
            pthread_create(&tids[i], NULL, work, &w[i]);
        }
        int failures = 0;
        for (int i = 0; i < n && i < 64; i++) {
            pthread_join(tids[i], NULL);
            failures += w[i].failures;
        }
        printf("threads rc=0 failures=%d\n", failures);
    } else if (!strcmp(cmd, "hammer")) { /* hammer:THREADS:ROUNDS:SIZE */
        int n = atoi(a[1]);
        pthread_t tids[64];
        struct hammer h[64];
        for (int i = 0; i < n && i < 64; i++) {
            h[i] = (struct hammer){atoi(a[2]), size_arg(a[3]), 0, 0, 0, 0};
            pthread_create(&tids[i], NULL, hammer, &h[i]);
        }
        long ok = 0, refused = 0, errors = 0;
        unsigned long long peak = 0;
        for (int i = 0; i < n && i < 64; i++) {
            pthread_join(tids[i], NULL);
            ok += h[i].ok;
            refused += h[i].refused;
            errors += h[i].errors;
            if (h[i].peak > peak) peak = h[i].peak;
        }
        printf("hammer rc=0 ok=%ld refused=%ld errors=%ld peak=%llu\n", ok, refused, errors, peak);
    } else if (!strcmp(cmd, "pairs")) { /* alloc+free pairs for a while: NVML lists asked */
        uint64_t t0 = now_ns(), until = t0 + (uint64_t)(atof(a[1]) * 1e9), t1 = t0;
        unsigned long long q0 = D.nvml_queries ? D.nvml_queries() : 0;
        long n = 0;
        while (!rc && (t1 = now_ns()) < until) {
            CUdeviceptr p = 0;
            rc = D.cuMemAlloc(&p, 4096);
            if (!rc) rc = D.cuMemFree(p);
            n++;
        }
        unsigned long long q = D.nvml_queries ? D.nvml_queries() - q0 : 0;
        printf("pairs rc=%d n=%ld elapsed_ms=%llu queries=%llu\n", rc, n,
               (unsigned long long)((t1 - t0) / 1000000), q);
    } else if (!strcmp(cmd, "bench")) { /* CPU ns per launch and per alloc+free pair */
        double launch, alloc;
        rc = bench_round(atol(a[1]), &launch, &alloc);
        printf("bench rc=%d launch_ns=%.1f alloc_ns=%.1f\n", rc, launch, alloc);
    } else if (!strcmp(cmd, "benchrounds")) { /* a round of bench:N per line read on stdin */
        long count = atol(a[1]), rounds = 0;
        char line[64];
        printf("benchready\n");
        fflush(stdout);
        while (!rc && fgets(line, sizeof line, stdin)) {
            double launch, alloc;
            rc = bench_round(count, &launch, &alloc);
            printf("round rc=%d launch_ns=%.1f alloc_ns=%.1f\n", rc, launch, alloc);
            fflush(stdout);
            rounds++;
        }
        printf("benchrounds rc=%d rounds=%ld\n", rc, rounds);
    } else if (!strcmp(cmd, "sleep")) {
        usleep((useconds_t)atoi(a[1]) * 1000);
    } else if (!strcmp(cmd, "waitfile")) { /* a barrier: wait until the file exists */
        while (access(a[1], F_OK) != 0) usleep(200);
    } else if (!strcmp(cmd, "ready")) {
        printf("ready\n");
    } else if (!strcmp(cmd, "wait")) {
        printf("waiting\n");
        fflush(stdout);
        for (;;) pause();
    } else {
        printf("unknown step %s\n", cmd);
        return 2;
    }
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    resolve();
    for (int i = 1; i < argc; i++)
        if (step(argv[i])) return 2;
    return 0;
}
