/*
 * A CUDA driver test double: built by the tests as libcuda.so.1 (soname libcuda.so.1).
 * Simulated devices (double_state.h) with real memory accounting, contexts that take memory,
 * and kernels that take simulated GPU time on a device timeline shared across processes.
 * Exports the driver entry points the shim hooks, a few it does not (to prove the proxy
 * forwards them), cuGetProcAddress(_v2) answering with its own functions, and two test
 * helpers: cuDoubleBusyNs and cuDoubleDeviceUsed.
 */
#include "double_state.h"

#include "../../../libvgpu/src/cuda_api.h"

#ifndef CUDA_ERROR_NO_DEVICE
#define CUDA_ERROR_NO_DEVICE 100
#endif

#define EXPORT __attribute__((visibility("default")))

static int initialised;

struct dctx {
    int dev;
    int primary;
};

static struct dctx primary_ctx[DBL_MAX_DEV];
static int primary_refs[DBL_MAX_DEV];
static __thread struct dctx *current;
static pthread_mutex_t local = PTHREAD_MUTEX_INITIALIZER;

enum { A_PTR, A_VMM, A_ARRAY, A_MIPMAP, A_MODULE, A_ASYNC, A_MAP };
struct alloc {
    uint64_t key, size;
    struct dctx *ctx;
    int dev, kind;
};
static struct alloc *allocs;
static size_t nallocs, capallocs;

struct dfunc {
    uint64_t ns;
};
struct dmod {
    int dev;
    int lazy_loaded; /* CUDA_DOUBLE_LAZY_MODULE_MIB charged (first function fetched) */
};
struct dgraph {
    uint64_t total_ns;
    int nodes;
    uint64_t mem_bytes; /* memory allocation nodes */
};
/* Graph memory, as a real driver: allocation nodes take memory from the device's graph pool
 * at launch; it stays reserved (reused by later launches) until cuDeviceGraphMemTrim. */
static uint64_t graph_reserved[DBL_MAX_DEV];

/* ---- memory ------------------------------------------------------------------------------ */

static void cp_gate(void);
static struct dbl_pid *cp_running_self_locked(void);

static CUresult charge(int dev, uint64_t bytes) {
    struct dbl_pid *p = cp_running_self_locked(); /* takes the lock once this process may run */
    struct dbl_dev *d = &dbl->dev[dbl_phys(p, dev)];
    if (!p || bytes > d->total || d->used > d->total - bytes) {
        dbl_unlock();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    d->used += bytes;
    p->used[dbl_phys(p, dev)] += bytes;
    dbl_unlock();
    return CUDA_SUCCESS;
}

static void count_context(int dev, int delta) {
    dbl_lock();
    struct dbl_pid *p = dbl_pid_locked(dbl_self());
    if (p) p->contexts[dbl_phys(p, dev)] += (uint32_t)delta;
    dbl_unlock();
}

static void uncharge(int dev, uint64_t bytes) {
    dbl_lock();
    struct dbl_pid *p = dbl_pid_locked(dbl_self());
    dev = dbl_phys(p, dev);
    struct dbl_dev *d = &dbl->dev[dev];
    d->used -= bytes < d->used ? bytes : d->used;
    if (p) p->used[dev] -= bytes < p->used[dev] ? bytes : p->used[dev];
    dbl_unlock();
}

static void remember(uint64_t key, uint64_t size, struct dctx *ctx, int dev, int kind) {
    pthread_mutex_lock(&local);
    if (nallocs == capallocs) {
        capallocs = capallocs ? capallocs * 2 : 256;
        allocs = realloc(allocs, capallocs * sizeof(*allocs));
    }
    allocs[nallocs++] = (struct alloc){key, size, ctx, dev, kind};
    pthread_mutex_unlock(&local);
}

static int forget(uint64_t key, int kind, struct alloc *out) {
    pthread_mutex_lock(&local);
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].key == key && allocs[i].kind == kind) {
            *out = allocs[i];
            allocs[i] = allocs[--nallocs];
            pthread_mutex_unlock(&local);
            return 1;
        }
    pthread_mutex_unlock(&local);
    return 0;
}

static void forget_ctx(struct dctx *ctx) {
    pthread_mutex_lock(&local);
    for (size_t i = 0; i < nallocs;) {
        if (allocs[i].ctx == ctx && allocs[i].kind != A_VMM && allocs[i].kind != A_ASYNC) {
            uncharge(allocs[i].dev, allocs[i].size);
            allocs[i] = allocs[--nallocs];
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&local);
}

static uint64_t new_addr(uint64_t size) {
    return __atomic_fetch_add(&dbl->next_addr, (size + 511) / 512 * 512 + 512, __ATOMIC_RELAXED);
}

static CUresult need_ctx(void) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    cp_gate(); /* a locked or checkpointed process's calls block until it is unlocked */
    return current ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult alloc(CUdeviceptr *p, uint64_t size, int kind) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!p || !size) return CUDA_ERROR_INVALID_VALUE;
    dbl_burn(dbl_env.alloc_cpu_ns);
    if ((rc = charge(current->dev, size))) return rc;
    *p = new_addr(size);
    remember(*p, size, current, current->dev, kind);
    return CUDA_SUCCESS;
}

static CUresult release(uint64_t key, int kind) {
    struct alloc a;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!forget(key, kind, &a)) return CUDA_ERROR_INVALID_VALUE;
    dbl_burn(dbl_env.alloc_cpu_ns);
    uncharge(a.dev, a.size);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return alloc(p, n, A_PTR); }
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned f) {
    (void)f;
    return alloc(p, n, A_PTR);
}
/* ---- stream-ordered allocation: memory pools ---------------------------------------------
 * As a real driver: a pool reserves device memory and keeps what is freed into it for reuse;
 * at a synchronisation it gives back what it holds beyond its release threshold (default 0;
 * PyTorch sets UINT64_MAX, so nothing is given back), and cuMemPoolTrimTo gives back down to
 * a size. The pool's reserved memory is what the device (and NVML) sees as used. */
struct dpool {
    int dev, live;
    uint64_t reserved, idle, threshold; /* idle: freed into the pool, reusable */
};
#define DBL_POOLS 16
static struct dpool default_pool[DBL_MAX_DEV], pools[DBL_POOLS];
static struct dpool *device_pool[DBL_MAX_DEV];

static int pool_ok(struct dpool *p) {
    return p && ((p >= default_pool && p < default_pool + DBL_MAX_DEV) ||
                 (p >= pools && p < pools + DBL_POOLS && p->live));
}
static struct dpool *current_pool(int dev) {
    default_pool[dev].dev = dev;
    return device_pool[dev] ? device_pool[dev] : &default_pool[dev];
}
static CUresult pool_alloc(CUdeviceptr *p, uint64_t n, struct dpool *pool) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!p || !n || !pool_ok(pool)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    CUresult rc = CUDA_SUCCESS;
    if (pool->idle >= n) {
        pool->idle -= n; /* reused: the device gives nothing new */
    } else if (!(rc = charge(pool->dev, n))) {
        pool->reserved += n;
    }
    pthread_mutex_unlock(&local);
    if (rc) return rc;
    *p = new_addr(n);
    remember(*p, n, (struct dctx *)pool, pool->dev, A_ASYNC);
    return CUDA_SUCCESS;
}
static void pool_give_back(struct dpool *pool, uint64_t keep) { /* local lock held */
    uint64_t over = pool->reserved > keep ? pool->reserved - keep : 0;
    uint64_t x = over < pool->idle ? over : pool->idle;
    if (!x) return;
    uncharge(pool->dev, x);
    pool->reserved -= x;
    pool->idle -= x;
}
static void pools_synchronised(void) {
    pthread_mutex_lock(&local);
    for (int d = 0; d < DBL_MAX_DEV; d++) pool_give_back(&default_pool[d], default_pool[d].threshold);
    for (int i = 0; i < DBL_POOLS; i++)
        if (pools[i].live) pool_give_back(&pools[i], pools[i].threshold);
    pthread_mutex_unlock(&local);
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) {
    (void)s;
    CUresult rc = need_ctx();
    if (rc) return rc;
    return pool_alloc(p, n, current_pool(current->dev));
}
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) {
    return cuMemAllocAsync(p, n, s);
}
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s) {
    (void)s;
    return pool_alloc(p, n, (struct dpool *)pool);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool,
                                             CUstream s) {
    return cuMemAllocFromPoolAsync(p, n, pool, s);
}
EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pool || dev < 0 || dev >= dbl_env.nvis) return CUDA_ERROR_INVALID_VALUE;
    *pool = (CUmemoryPool)current_pool(dev);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pool || dev < 0 || dev >= dbl_env.nvis) return CUDA_ERROR_INVALID_VALUE;
    default_pool[dev].dev = dev;
    *pool = (CUmemoryPool)&default_pool[dev];
    return CUDA_SUCCESS;
}
struct dbl_pool_props { /* the start of CUmemPoolProps */
    int allocType, handleTypes;
    CUmemLocation location;
};
EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const struct dbl_pool_props *props) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pool || !props || props->location.id < 0 || props->location.id >= dbl_env.nvis)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    for (int i = 0; i < DBL_POOLS; i++)
        if (!pools[i].live) {
            pools[i] = (struct dpool){props->location.id, 1, 0, 0, 0};
            *pool = (CUmemoryPool)&pools[i];
            pthread_mutex_unlock(&local);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&local);
    return CUDA_ERROR_OUT_OF_MEMORY;
}
EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    struct dpool *p = (struct dpool *)pool;
    if (!pool_ok(p)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    pool_give_back(p, keep);
    pthread_mutex_unlock(&local);
    return CUDA_SUCCESS;
}
#define DBL_POOL_RELEASE_THRESHOLD 4
#define DBL_POOL_RESERVED_CURRENT 5
#define DBL_POOL_USED_CURRENT 7
EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    struct dpool *p = (struct dpool *)pool;
    if (!pool_ok(p) || !value) return CUDA_ERROR_INVALID_VALUE;
    if (attr != DBL_POOL_RELEASE_THRESHOLD) return CUDA_ERROR_INVALID_VALUE;
    p->threshold = *(cuuint64_t *)value;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    struct dpool *p = (struct dpool *)pool;
    if (!pool_ok(p) || !value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    CUresult rc = CUDA_SUCCESS;
    switch (attr) {
    case DBL_POOL_RELEASE_THRESHOLD: *(cuuint64_t *)value = p->threshold; break;
    case DBL_POOL_RESERVED_CURRENT: *(cuuint64_t *)value = p->reserved; break;
    case DBL_POOL_USED_CURRENT: *(cuuint64_t *)value = p->reserved - p->idle; break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&local);
    return rc;
}
static CUresult free_async(CUdeviceptr ptr) {
    struct alloc a;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!forget(ptr, A_ASYNC, &a)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    ((struct dpool *)a.ctx)->idle += a.size; /* back into its pool, still reserved */
    pthread_mutex_unlock(&local);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h,
                                   unsigned elem) {
    (void)elem;
    if (!pitch) return CUDA_ERROR_INVALID_VALUE;
    size_t pt = (w + 1023) / 1024 * 1024; /* the double aligns rows to 1 KiB */
    CUresult rc = alloc(p, (uint64_t)pt * h, A_PTR);
    if (!rc) *pitch = pt;
    return rc;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    CUresult rc = release(p, A_PTR);
    if (rc == CUDA_ERROR_INVALID_VALUE && !free_async(p)) { /* a stream-ordered one */
        pools_synchronised();
        return CUDA_SUCCESS;
    }
    return rc;
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    (void)s;
    return free_async(p);
}
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync(p, s); }

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n,
                            const CUmemAllocationProp *prop, unsigned long long flags) {
    (void)flags;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!h || !prop || !n || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        prop->location.id < 0 || prop->location.id >= (int)dbl_env.nvis)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = charge(prop->location.id, n);
    if (rc) return rc;
    *h = new_addr(n) | 1;
    remember(*h, n, NULL, prop->location.id, A_VMM);
    return CUDA_SUCCESS;
}
/* VMM as a real driver: physical memory lives until its handle is released AND no mapping
 * of it is left; releasing a mapped handle only drops the handle. Mappings: A_MAP entries
 * (key: the address, size: the handle); a released handle is kept as A_VMM with ctx 1. */
static int mapped(CUmemGenericAllocationHandle h) {
    int n = 0;
    pthread_mutex_lock(&local);
    for (size_t i = 0; i < nallocs; i++) n += allocs[i].kind == A_MAP && allocs[i].size == h;
    pthread_mutex_unlock(&local);
    return n;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    struct alloc a;
    if (!forget(h, A_VMM, &a) || a.ctx) {
        if (a.ctx) remember(h, a.size, a.ctx, a.dev, A_VMM);
        return CUDA_ERROR_INVALID_VALUE; /* unknown, or released already */
    }
    if (mapped(h)) remember(h, a.size, (struct dctx *)1, a.dev, A_VMM); /* memory stays */
    else uncharge(a.dev, a.size);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) {
    (void)align, (void)addr, (void)flags;
    if (!p || !size) return CUDA_ERROR_INVALID_VALUE;
    *p = new_addr(size);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
    (void)p, (void)size;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset,
                         CUmemGenericAllocationHandle h, unsigned long long flags) {
    (void)size, (void)offset, (void)flags;
    struct alloc a;
    if (!forget(h, A_VMM, &a)) return CUDA_ERROR_INVALID_HANDLE;
    remember(h, a.size, a.ctx, a.dev, A_VMM);
    if (a.ctx) return CUDA_ERROR_INVALID_HANDLE; /* released: no new mappings */
    remember(p, h, NULL, a.dev, A_MAP);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    struct alloc m, a;
    if (!forget(p, A_MAP, &m)) return CUDA_ERROR_INVALID_VALUE;
    (void)size;
    if (!mapped(m.size) && forget(m.size, A_VMM, &a)) {
        if (a.ctx) uncharge(a.dev, a.size); /* released before: the memory goes now */
        else remember(m.size, a.size, NULL, a.dev, A_VMM);
    }
    return CUDA_SUCCESS;
}

static uint64_t elem_bytes(CUarray_format f, unsigned ch) {
    uint64_t b = (f == 0x01 || f == 0x08) ? 1 : (f == 0x02 || f == 0x09 || f == 0x10) ? 2 : 4;
    return b * (ch ? ch : 1);
}
static uint64_t d1(size_t v) { return v ? v : 1; }
static uint64_t round64k(uint64_t n) { return (n + 65535) / 65536 * 65536; }

static CUresult array(void **out, uint64_t bytes, int kind) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    bytes = round64k(bytes); /* arrays are tiled: the double rounds them to 64 KiB */
    if ((rc = charge(current->dev, bytes))) return rc;
    uint64_t key = new_addr(bytes);
    *out = (void *)(uintptr_t)key;
    remember(key, bytes, current, current->dev, kind);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array((void **)a, d1(d->Width) * d1(d->Height) * elem_bytes(d->Format, d->NumChannels),
                 A_ARRAY);
}
EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array((void **)a,
                 d1(d->Width) * d1(d->Height) * d1(d->Depth) * elem_bytes(d->Format, d->NumChannels),
                 A_ARRAY);
}
EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned levels) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    uint64_t total = 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++)
        total += d1(d->Width >> l) * (d->Height ? d1(d->Height >> l) : 1) *
                 (d->Depth ? d1(d->Depth >> l) : 1) * elem_bytes(d->Format, d->NumChannels);
    return array((void **)a, total, A_MIPMAP);
}
EXPORT CUresult cuArrayDestroy(CUarray a) { return release((uint64_t)(uintptr_t)a, A_ARRAY); }
EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) {
    return release((uint64_t)(uintptr_t)a, A_MIPMAP);
}

static CUresult requirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, uint64_t key, int kind) {
    if (!r) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].key == key && allocs[i].kind == kind) {
            memset(r, 0, sizeof(*r));
            r->size = allocs[i].size;
            r->alignment = 65536;
            pthread_mutex_unlock(&local);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&local);
    return CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, CUarray a,
                                             CUdevice dev) {
    (void)dev;
    return requirements(r, (uint64_t)(uintptr_t)a, A_ARRAY);
}
EXPORT CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r,
                                                      CUmipmappedArray a, CUdevice dev) {
    (void)dev;
    return requirements(r, (uint64_t)(uintptr_t)a, A_MIPMAP);
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    dbl_lock();
    struct dbl_dev *d = &dbl->dev[dbl_phys(dbl_pid_locked(dbl_self()), current->dev)];
    *free_bytes = d->total - d->used;
    *total = d->total;
    dbl_unlock();
    return CUDA_SUCCESS;
}

/* ---- devices and contexts -------------------------------------------------------------- */

/* The v1 ABI (CUDA before 3.2: 32-bit sizes and device pointers), which drivers still export. */
EXPORT CUresult cuMemAlloc(unsigned int *p, unsigned int n) {
    CUdeviceptr d = 0;
    CUresult rc = alloc(&d, n, A_PTR);
    if (!rc && p) *p = (unsigned int)d;
    return rc;
}
EXPORT CUresult cuMemAllocPitch(unsigned int *p, unsigned int *pitch, unsigned int w, unsigned int h,
                                unsigned int elem) {
    CUdeviceptr d = 0;
    size_t pt = 0;
    CUresult rc = cuMemAllocPitch_v2(&d, &pt, w, h, elem);
    if (!rc && p) *p = (unsigned int)d;
    if (!rc && pitch) *pitch = (unsigned int)pt;
    return rc;
}
EXPORT CUresult cuMemGetInfo(unsigned int *f, unsigned int *t) {
    size_t a = 0, b = 0;
    CUresult rc = cuMemGetInfo_v2(&a, &b);
    if (!rc && f) *f = a > 0xffffffffu ? 0xffffffffu : (unsigned int)a;
    if (!rc && t) *t = b > 0xffffffffu ? 0xffffffffu : (unsigned int)b;
    return rc;
}

EXPORT CUresult cuInit(unsigned flags) {
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    dbl_ready();
    if (!dbl_env.nvis) return CUDA_ERROR_NO_DEVICE; /* no device node of any card */
    initialised = 1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDriverGetVersion(int *v) {
    dbl_ready();
    *v = dbl_env.driver_version;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int *n) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *n = dbl_env.nvis;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= dbl_env.nvis) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
/* Physical device d's uuid (NVML's: GPU-d00b1e00-7369-6d2d-6770-7500000000<d>). */
static void dbl_uuid(int d, CUuuid *u) {
    memset(u, 0, sizeof(*u));
    memcpy(u->bytes, "\xd0\x0b\x1e\x00sim-gpu", 11);
    u->bytes[15] = (char)d;
}
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dbl_env.nvis) return CUDA_ERROR_INVALID_DEVICE;
    dbl_uuid(dbl_env.vis[d], u);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    dbl_ready();
    dbl_device_name(d >= 0 && d < dbl_env.nvis ? dbl_env.vis[d] : d, name, (size_t)len);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dbl_env.nvis) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = dbl->dev[dbl_env.vis[d]].total;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d) {
    size_t b = 0;
    CUresult rc = cuDeviceTotalMem_v2(&b, d);
    if (!rc && bytes) *bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned int)b;
    return rc;
}
EXPORT CUresult cuGetErrorString(CUresult e, const char **s) {
    *s = e == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory" : e ? "error" : "no error";
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *out, CUdevice dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!out || dev < 0 || dev >= dbl_env.nvis) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = charge(dev, dbl_env.context);
    if (rc) return rc;
    count_context(dev, 1);
    struct dctx *c = calloc(1, sizeof(*c));
    c->dev = dev;
    current = c;
    *out = (CUcontext)c;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxCreate_v2(CUcontext *c, unsigned flags, CUdevice dev) {
    (void)flags;
    return ctx_create(c, dev);
}
EXPORT CUresult cuCtxCreate_v3(CUcontext *c, CUexecAffinityParam *p, int n, unsigned flags,
                               CUdevice dev) {
    (void)p, (void)n, (void)flags;
    return ctx_create(c, dev);
}
EXPORT CUresult cuCtxCreate_v4(CUcontext *c, CUctxCreateParams *p, unsigned flags, CUdevice dev) {
    (void)p, (void)flags;
    return ctx_create(c, dev);
}
EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    struct dctx *c = (struct dctx *)ctx;
    if (!c || c->primary) return CUDA_ERROR_INVALID_CONTEXT;
    forget_ctx(c);
    uncharge(c->dev, dbl_env.context);
    count_context(c->dev, -1);
    if (current == c) current = NULL;
    free(c);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    current = (struct dctx *)ctx;
    return CUDA_SUCCESS;
}
static __thread struct dctx *ctx_stack[16];
static __thread int ctx_depth;
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (ctx_depth == 16) return CUDA_ERROR_INVALID_VALUE;
    ctx_stack[ctx_depth++] = current;
    current = (struct dctx *)ctx;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
    if (!ctx_depth) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx) *ctx = (CUcontext)current;
    current = ctx_stack[--ctx_depth];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) {
    *ctx = (CUcontext)current;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    *d = current->dev;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *out, CUdevice dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!out || dev < 0 || dev >= dbl_env.nvis) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    CUresult rc = CUDA_SUCCESS;
    int fresh = primary_refs[dev] == 0;
    if (fresh && !(rc = charge(dev, dbl_env.context))) count_context(dev, 1);
    if (!rc && fresh && dbl_env.context_create_ns) dbl_sleep_until(dbl_now() + dbl_env.context_create_ns);
    if (!rc) {
        primary_refs[dev]++;
        primary_ctx[dev].dev = dev;
        primary_ctx[dev].primary = 1;
        *out = (CUcontext)&primary_ctx[dev];
    }
    pthread_mutex_unlock(&local);
    return rc;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    if (dev < 0 || dev >= dbl_env.nvis) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&local);
    int gone = primary_refs[dev] > 0 && --primary_refs[dev] == 0;
    pthread_mutex_unlock(&local);
    if (gone) {
        forget_ctx(&primary_ctx[dev]);
        uncharge(dev, dbl_env.context);
        count_context(dev, -1);
        if (current == &primary_ctx[dev]) current = NULL;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    if (dev < 0 || dev >= dbl_env.nvis) return CUDA_ERROR_INVALID_DEVICE;
    forget_ctx(&primary_ctx[dev]);
    return CUDA_SUCCESS;
}

/* ---- modules --------------------------------------------------------------------------- */

static CUresult module_load(void **out) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (dbl_env.module && (rc = charge(current->dev, dbl_env.module))) return rc;
    struct dmod *m = calloc(1, sizeof(*m));
    m->dev = current->dev;
    *out = m;
    if (dbl_env.module) remember((uint64_t)(uintptr_t)m, dbl_env.module, current, m->dev, A_MODULE);
    return CUDA_SUCCESS;
}
static CUresult module_unload(void *m) {
    struct alloc a;
    if (!m) return CUDA_ERROR_INVALID_HANDLE;
    if (forget((uint64_t)(uintptr_t)m, A_MODULE, &a)) uncharge(a.dev, a.size);
    if (forget((uint64_t)(uintptr_t)m + 1, A_MODULE, &a)) uncharge(a.dev, a.size);
    free(m);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleLoad(CUmodule *m, const char *f) {
    (void)f;
    return module_load((void **)m);
}
EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *img) {
    (void)img;
    return module_load((void **)m);
}
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *img, unsigned n, int *o, void **v) {
    (void)img, (void)n, (void)o, (void)v;
    return module_load((void **)m);
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *img) {
    (void)img;
    return module_load((void **)m);
}
EXPORT CUresult cuModuleUnload(CUmodule m) { return module_unload(m); }
EXPORT CUresult cuLibraryLoadData(CUlibrary *l, const void *c, int *o, void **v, unsigned n,
                                  int *lo, void **lv, unsigned ln) {
    (void)c, (void)o, (void)v, (void)n, (void)lo, (void)lv, (void)ln;
    return module_load((void **)l);
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *f, int *o, void **v, unsigned n,
                                      int *lo, void **lv, unsigned ln) {
    (void)f, (void)o, (void)v, (void)n, (void)lo, (void)lv, (void)ln;
    return module_load((void **)l);
}
EXPORT CUresult cuLibraryUnload(CUlibrary l) { return module_unload(l); }

/* Kernel "k<us>" runs <us> microseconds; any other name runs CUDA_DOUBLE_KERNEL_US. */
EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    if (!f || !m || !name) return CUDA_ERROR_INVALID_VALUE;
    struct dmod *mod = (struct dmod *)m;
    if (dbl_env.lazy_module && !mod->lazy_loaded) { /* lazy loading: the code arrives now */
        CUresult rc = charge(mod->dev, dbl_env.lazy_module);
        if (rc) return rc;
        mod->lazy_loaded = 1;
        remember((uint64_t)(uintptr_t)mod + 1, dbl_env.lazy_module, current, mod->dev, A_MODULE);
    }
    struct dfunc *fn = calloc(1, sizeof(*fn));
    fn->ns = name[0] == 'k' && name[1] >= '0' && name[1] <= '9'
                 ? strtoull(name + 1, NULL, 10) * 1000
                 : dbl_env.kernel_ns;
    *f = (CUfunction)fn;
    return CUDA_SUCCESS;
}

/* ---- launches -------------------------------------------------------------------------- */

static uint64_t pending[4096]; /* end times of this process's queued kernels */
static uint64_t launched, last_end;

static int captured(CUstream s, uint64_t ns, int count);

static CUresult run_on(CUstream s, uint64_t ns, int count) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (captured(s, ns, count)) return CUDA_SUCCESS; /* recorded into the graph, not run */
    dbl_burn(dbl_env.launch_cpu_ns);
    int dev = current->dev;
    for (int k = 0; k < count; k++) {
        pthread_mutex_lock(&local);
        uint64_t slot = launched % (uint64_t)dbl_env.queue;
        uint64_t wait_until = pending[slot];
        pthread_mutex_unlock(&local);
        dbl_sleep_until(wait_until); /* the queue is full: the launch blocks, as a driver's does */
        dbl_lock();
        /* restored onto another device: its work runs there */
        struct dbl_dev *d = &dbl->dev[dbl->remapped ? dbl_phys(dbl_pid_locked(dbl_self()), dev) : dev];
        uint64_t now = dbl_now();
        uint64_t start = d->busy_until > now ? d->busy_until : now;
        struct dbl_kernel *r = &d->ring[d->head % DBL_RING];
        r->pid = dbl_self();
        r->start = start;
        r->end = start + ns;
        d->busy_until = r->end;
        d->head++;
        uint64_t end = r->end;
        dbl_unlock();
        pthread_mutex_lock(&local);
        pending[launched % (uint64_t)dbl_env.queue] = end;
        launched++;
        if (end > last_end) last_end = end;
        pthread_mutex_unlock(&local);
    }
    return CUDA_SUCCESS;
}

static CUresult run(uint64_t ns, int count) { return run_on(NULL, ns, count); }

static uint64_t fn_ns(CUfunction f) { return f ? ((struct dfunc *)f)->ns : dbl_env.kernel_ns; }

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned sh, CUstream s, void **p,
                               void **e) {
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)sh, (void)p, (void)e;
    return run_on(s, fn_ns(f), 1);
}
EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                    unsigned bx, unsigned by, unsigned bz, unsigned sh, CUstream s,
                                    void **p, void **e) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sh, s, p, e);
}
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e) {
    (void)p, (void)e;
    return run_on(c ? c->hStream : NULL, fn_ns(f), 1);
}
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e) {
    return cuLaunchKernelEx(c, f, p, e);
}
EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                          unsigned bx, unsigned by, unsigned bz, unsigned sh,
                                          CUstream s, void **p) {
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)sh, (void)p;
    return run_on(s, fn_ns(f), 1);
}
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy,
                                               unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                               unsigned sh, CUstream s, void **p) {
    return cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, sh, s, p);
}

/* the legacy launch API (cuFuncSetBlockShape + cuLaunch / cuLaunchGrid / cuLaunchGridAsync) */
EXPORT CUresult cuLaunch(CUfunction f) { return run(fn_ns(f), 1); }
EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h) {
    (void)w, (void)h;
    return run(fn_ns(f), 1);
}
EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s) {
    (void)w, (void)h;
    return run_on(s, fn_ns(f), 1);
}

EXPORT CUresult cuGraphCreate(CUgraph *g, unsigned flags) {
    (void)flags;
    *g = (CUgraph)calloc(1, sizeof(struct dgraph));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                        size_t ndeps, const CUDA_KERNEL_NODE_PARAMS_v2 *params) {
    (void)deps, (void)ndeps;
    struct dgraph *gr = (struct dgraph *)g;
    gr->total_ns += fn_ns(params->func);
    gr->nodes++;
    *node = (CUgraphNode)(uintptr_t)gr->nodes;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph g, unsigned long long f) {
    (void)f;
    struct dgraph *copy = malloc(sizeof(*copy));
    *copy = *(struct dgraph *)g;
    *exec = (CUgraphExec)copy;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                       size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    (void)deps, (void)ndeps;
    if (!g || !params || !params->bytesize) return CUDA_ERROR_INVALID_VALUE;
    struct dgraph *gr = (struct dgraph *)g;
    gr->mem_bytes += params->bytesize;
    params->dptr = new_addr(params->bytesize);
    *node = (CUgraphNode)(uintptr_t)(gr->nodes + 1000);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream s) {
    struct dgraph *g = (struct dgraph *)exec;
    if (!g || (!g->nodes && !g->mem_bytes)) return CUDA_ERROR_INVALID_VALUE;
    if (g->mem_bytes) {
        CUresult rc = need_ctx();
        if (rc) return rc;
        int dev = current->dev;
        pthread_mutex_lock(&local);
        if (graph_reserved[dev] < g->mem_bytes) {
            rc = charge(dev, g->mem_bytes - graph_reserved[dev]);
            if (!rc) graph_reserved[dev] = g->mem_bytes;
        }
        pthread_mutex_unlock(&local);
        if (rc) return rc;
    }
    return g->nodes ? run_on(s, g->total_ns / (uint64_t)g->nodes, g->nodes) : CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    if (dev < 0 || dev >= dbl_env.nvis) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&local);
    uncharge(dev, graph_reserved[dev]);
    graph_reserved[dev] = 0;
    pthread_mutex_unlock(&local);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value) {
    if (dev < 0 || dev >= dbl_env.nvis || !value) return CUDA_ERROR_INVALID_VALUE;
    if (attr != CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT && attr != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    *(cuuint64_t *)value = graph_reserved[dev];
    pthread_mutex_unlock(&local);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream s) { return cuGraphLaunch(exec, s); }
EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec) {
    free(exec);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphDestroy(CUgraph g) {
    free(g);
    return CUDA_SUCCESS;
}

/* ---- streams and stream capture -----------------------------------------------------------
 * As a real driver: work launched into a capturing stream is recorded into its graph, not run,
 * and while a capture is under way some calls are illegal. A thread whose capture interaction
 * mode (cuThreadExchangeStreamCaptureMode; global by default) is global may not make a
 * "potentially unsafe" call (synchronising or querying an event, synchronising a stream or the
 * context) while its own non-relaxed capture or any other thread's global-mode capture is under
 * way; thread-local: only its own; relaxed: never. Synchronising or querying an event recorded
 * inside a capture is illegal in every mode. An illegal call returns
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the captures it conflicts with: their
 * cuStreamEndCapture returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. */
struct dstream {
    int capturing, mode, invalidated;
    pthread_t owner; /* the thread that began the capture */
    struct dgraph *graph;
};
#define DBL_CAPTURES 64
static struct dstream *capturing[DBL_CAPTURES]; /* captures under way in this process (local) */
static __thread int capture_mode; /* this thread's interaction mode: global (0) by default */

/* A stream handle the double made (not NULL, CU_STREAM_LEGACY or CU_STREAM_PER_THREAD). */
static struct dstream *stream_of(CUstream s) {
    return (uintptr_t)s > 2 ? (struct dstream *)s : NULL;
}

static int captured(CUstream s, uint64_t ns, int count) {
    struct dstream *st = stream_of(s);
    if (!st) return 0;
    pthread_mutex_lock(&local);
    int on = st->capturing;
    if (on) st->graph->total_ns += ns * (uint64_t)count, st->graph->nodes += count;
    pthread_mutex_unlock(&local);
    return on;
}

/* An unsafe call from this thread: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (and the captures
 * it conflicts with invalidated) if a capture forbids it, else CUDA_SUCCESS. */
static CUresult capture_rules(void) {
    if (capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&local);
    for (int i = 0; i < DBL_CAPTURES; i++) {
        struct dstream *c = capturing[i];
        if (!c) continue;
        int mine = pthread_equal(c->owner, pthread_self());
        if ((mine && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
            (!mine && c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL &&
             capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL)) {
            c->invalidated = 1;
            rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    pthread_mutex_unlock(&local);
    return rc;
}

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    (void)flags;
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    *s = (CUstream)calloc(1, sizeof(struct dstream));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    struct dstream *st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    if (st->capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    free(st);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
    struct dstream *st = stream_of(s);
    if (!st) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* not the legacy stream */
    if (mode < 0 || mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    for (int i = 0; i < DBL_CAPTURES && !st->capturing; i++)
        if (!capturing[i]) {
            capturing[i] = st;
            *st = (struct dstream){1, mode, 0, pthread_self(), calloc(1, sizeof(struct dgraph))};
            rc = CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&local);
    return rc;
}
EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *graph) {
    struct dstream *st = stream_of(s);
    if (!st || !graph) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&local);
    int was = st->capturing, bad = st->invalidated;
    struct dgraph *g = st->graph;
    for (int i = 0; i < DBL_CAPTURES; i++)
        if (capturing[i] == st) capturing[i] = NULL;
    *st = (struct dstream){0};
    pthread_mutex_unlock(&local);
    if (!was) return CUDA_ERROR_INVALID_VALUE;
    if (bad) {
        free(g);
        *graph = NULL;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *graph = (CUgraph)g;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamIsCapturing(CUstream s, int *status) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    struct dstream *st = stream_of(s);
    pthread_mutex_lock(&local);
    *status = !st || !st->capturing ? CU_STREAM_CAPTURE_STATUS_NONE
              : st->invalidated     ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                    : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    pthread_mutex_unlock(&local);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    if (!mode || *mode < 0 || *mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    int old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* Events: an event completes when this process's work queued before it has run. One recorded
 * into a capturing stream is a node of the capture: waiting on it is illegal. */
struct devent {
    uint64_t t;
    int recorded;
    struct dstream *captured_in;
};

/* A wait on e (synchronise, query, elapsed time): the capture rules first. */
static CUresult event_rules(struct devent *e) {
    pthread_mutex_lock(&local);
    struct dstream *c = e->captured_in;
    if (c && c->capturing) c->invalidated = 1;
    pthread_mutex_unlock(&local);
    return c ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : capture_rules();
}
EXPORT CUresult cuEventCreate(CUevent *e, unsigned flags) {
    (void)flags;
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    *e = (CUevent)calloc(1, sizeof(struct devent));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventRecord(CUevent e, CUstream s) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = dbl_now();
    struct dstream *st = stream_of(s);
    pthread_mutex_lock(&local);
    ((struct devent *)e)->t = last_end > now ? last_end : now;
    ((struct devent *)e)->recorded = 1;
    ((struct devent *)e)->captured_in = st && st->capturing ? st : NULL;
    pthread_mutex_unlock(&local);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventSynchronize(CUevent e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = event_rules((struct devent *)e);
    if (rc) return rc;
    dbl_sleep_until(((struct devent *)e)->t);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventQuery(CUevent e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = event_rules((struct devent *)e);
    if (rc) return rc;
    return dbl_now() >= ((struct devent *)e)->t ? CUDA_SUCCESS : 600; /* NOT_READY */
}
EXPORT CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    struct devent *x = (struct devent *)a, *y = (struct devent *)b;
    if (!ms || !x || !y || !x->recorded || !y->recorded) return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = event_rules(x);
    if (!rc) rc = event_rules(y);
    if (rc) return rc;
    if (dbl_now() < x->t || dbl_now() < y->t) return 600; /* NOT_READY */
    *ms = (float)((double)((int64_t)y->t - (int64_t)x->t) / 1e6);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventDestroy_v2(CUevent e) {
    free(e);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void) {
    CUresult rc = capture_rules();
    if (rc) return rc;
    pthread_mutex_lock(&local);
    uint64_t t = last_end;
    pthread_mutex_unlock(&local);
    dbl_sleep_until(t);
    pools_synchronised();
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamSynchronize(CUstream s) {
    (void)s;
    return cuCtxSynchronize();
}

/* ---- test helpers (not CUDA) ------------------------------------------------------------ */

EXPORT unsigned long long cuDoubleBusyNs(int dev, int pid, unsigned long long t0,
                                         unsigned long long t1) {
    dbl_ready();
    if (pid < 0) pid = dbl_self(); /* -1: the caller, as the driver knows it */
    dbl_lock();
    uint64_t b = dbl_busy_locked(dev, pid, t0, t1);
    dbl_unlock();
    return b;
}
EXPORT unsigned long long cuDoubleDeviceUsed(int dev) {
    dbl_ready();
    dbl_lock();
    dbl_pid_locked(dbl_self());
    uint64_t u = dbl->dev[dev].used;
    dbl_unlock();
    return u;
}

#include "checkpoint.c"

/* ---- cuGetProcAddress ------------------------------------------------------------------- */

/* With CUDA_DOUBLE_PROC_ALIASES=1 these two are handed out instead of the exported symbols,
 * the way a real driver may hand out internal entry points. */
static CUresult alias_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return alloc(p, n, A_PTR); }
static CUresult alias_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                     unsigned bx, unsigned by, unsigned bz, unsigned sh,
                                     CUstream s, void **p, void **e) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sh, s, p, e);
}

EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t,
                                    CUdriverProcAddressQueryResult *);

static const struct {
    const char *base;
    int since, ptsz;
    void *fn, *alias;
} procs[] = {
#define P(base, since, ptsz, fn) {base, since, ptsz, (void *)fn, NULL}
    P("cuInit", 2000, 0, cuInit),
    P("cuDriverGetVersion", 2020, 0, cuDriverGetVersion),
    P("cuDeviceGetCount", 2000, 0, cuDeviceGetCount),
    P("cuDeviceGet", 2000, 0, cuDeviceGet),
    P("cuDeviceGetUuid", 9020, 0, cuDeviceGetUuid),
    P("cuDeviceTotalMem", 3020, 0, cuDeviceTotalMem_v2),
    P("cuDeviceTotalMem", 2000, 0, cuDeviceTotalMem),
    P("cuMemAlloc", 2000, 0, cuMemAlloc),
    P("cuMemAllocPitch", 2000, 0, cuMemAllocPitch),
    P("cuMemGetInfo", 2000, 0, cuMemGetInfo),
    P("cuGetErrorString", 6000, 0, cuGetErrorString),
    P("cuCtxCreate", 3020, 0, cuCtxCreate_v2),
    P("cuCtxCreate", 11040, 0, cuCtxCreate_v3),
    P("cuCtxCreate", 12050, 0, cuCtxCreate_v4),
    P("cuCtxDestroy", 4000, 0, cuCtxDestroy_v2),
    P("cuCtxSetCurrent", 4000, 0, cuCtxSetCurrent),
    P("cuCtxGetCurrent", 4000, 0, cuCtxGetCurrent),
    P("cuCtxPushCurrent", 4000, 0, cuCtxPushCurrent_v2),
    P("cuCtxPopCurrent", 4000, 0, cuCtxPopCurrent_v2),
    P("cuCtxGetDevice", 2000, 0, cuCtxGetDevice),
    P("cuCtxSynchronize", 2000, 0, cuCtxSynchronize),
    P("cuEventCreate", 2000, 0, cuEventCreate),
    P("cuEventRecord", 2000, 0, cuEventRecord),
    P("cuEventSynchronize", 2000, 0, cuEventSynchronize),
    P("cuEventQuery", 2000, 0, cuEventQuery),
    P("cuEventElapsedTime", 2000, 0, cuEventElapsedTime),
    P("cuEventDestroy", 4000, 0, cuEventDestroy_v2),
    P("cuStreamCreate", 2000, 0, cuStreamCreate),
    P("cuStreamDestroy", 4000, 0, cuStreamDestroy_v2),
    P("cuStreamSynchronize", 2000, 0, cuStreamSynchronize),
    P("cuStreamBeginCapture", 10010, 0, cuStreamBeginCapture_v2),
    P("cuStreamEndCapture", 10000, 0, cuStreamEndCapture),
    P("cuStreamIsCapturing", 10000, 0, cuStreamIsCapturing),
    P("cuThreadExchangeStreamCaptureMode", 10010, 0, cuThreadExchangeStreamCaptureMode),
    P("cuDevicePrimaryCtxRetain", 7000, 0, cuDevicePrimaryCtxRetain),
    P("cuDevicePrimaryCtxRelease", 11000, 0, cuDevicePrimaryCtxRelease_v2),
    P("cuDevicePrimaryCtxReset", 11000, 0, cuDevicePrimaryCtxReset_v2),
    {"cuMemAlloc", 3020, 0, (void *)cuMemAlloc_v2, (void *)alias_cuMemAlloc_v2},
    P("cuMemAllocPitch", 3020, 0, cuMemAllocPitch_v2),
    P("cuMemAllocManaged", 6000, 0, cuMemAllocManaged),
    P("cuMemAllocAsync", 11020, 0, cuMemAllocAsync),
    P("cuMemAllocAsync", 11020, 1, cuMemAllocAsync_ptsz),
    P("cuMemAllocFromPoolAsync", 11020, 0, cuMemAllocFromPoolAsync),
    P("cuMemAllocFromPoolAsync", 11020, 1, cuMemAllocFromPoolAsync_ptsz),
    P("cuMemFree", 3020, 0, cuMemFree_v2),
    P("cuMemFreeAsync", 11020, 0, cuMemFreeAsync),
    P("cuDeviceGetMemPool", 11020, 0, cuDeviceGetMemPool),
    P("cuDeviceGetDefaultMemPool", 11020, 0, cuDeviceGetDefaultMemPool),
    P("cuMemPoolCreate", 11020, 0, cuMemPoolCreate),
    P("cuMemPoolTrimTo", 11020, 0, cuMemPoolTrimTo),
    P("cuMemPoolSetAttribute", 11020, 0, cuMemPoolSetAttribute),
    P("cuMemPoolGetAttribute", 11020, 0, cuMemPoolGetAttribute),
    P("cuMemFreeAsync", 11020, 1, cuMemFreeAsync_ptsz),
    P("cuMemCreate", 10020, 0, cuMemCreate),
    P("cuMemRelease", 10020, 0, cuMemRelease),
    P("cuMemAddressReserve", 10020, 0, cuMemAddressReserve),
    P("cuMemAddressFree", 10020, 0, cuMemAddressFree),
    P("cuMemMap", 10020, 0, cuMemMap),
    P("cuMemUnmap", 10020, 0, cuMemUnmap),
    P("cuMemGetInfo", 3020, 0, cuMemGetInfo_v2),
    P("cuArrayCreate", 3020, 0, cuArrayCreate_v2),
    P("cuArray3DCreate", 3020, 0, cuArray3DCreate_v2),
    P("cuMipmappedArrayCreate", 5000, 0, cuMipmappedArrayCreate),
    P("cuArrayDestroy", 2000, 0, cuArrayDestroy),
    P("cuMipmappedArrayDestroy", 5000, 0, cuMipmappedArrayDestroy),
    P("cuModuleLoadData", 2000, 0, cuModuleLoadData),
    P("cuModuleUnload", 2000, 0, cuModuleUnload),
    P("cuModuleGetFunction", 2000, 0, cuModuleGetFunction),
    {"cuLaunchKernel", 4000, 0, (void *)cuLaunchKernel, (void *)alias_cuLaunchKernel},
    P("cuLaunchKernel", 7000, 1, cuLaunchKernel_ptsz),
    P("cuLaunchKernelEx", 11060, 0, cuLaunchKernelEx),
    P("cuLaunchKernelEx", 11060, 1, cuLaunchKernelEx_ptsz),
    P("cuLaunchCooperativeKernel", 9000, 0, cuLaunchCooperativeKernel),
    P("cuLaunchCooperativeKernel", 9000, 1, cuLaunchCooperativeKernel_ptsz),
    P("cuGraphLaunch", 10000, 0, cuGraphLaunch),
    P("cuGraphAddMemAllocNode", 11040, 0, cuGraphAddMemAllocNode),
    P("cuDeviceGraphMemTrim", 11040, 0, cuDeviceGraphMemTrim),
    P("cuDeviceGetGraphMemAttribute", 11040, 0, cuDeviceGetGraphMemAttribute),
    P("cuLaunch", 2000, 0, cuLaunch),
    P("cuLaunchGrid", 2000, 0, cuLaunchGrid),
    P("cuLaunchGridAsync", 2000, 0, cuLaunchGridAsync),
    P("cuGraphLaunch", 10000, 1, cuGraphLaunch_ptsz),
    P("cuGetProcAddress", 11030, 0, cuGetProcAddress),
    P("cuGetProcAddress", 12000, 0, cuGetProcAddress_v2),
#ifndef DBL_NO_CHECKPOINT
    P("cuCheckpointProcessGetRestoreThreadId", 12080, 0, cuCheckpointProcessGetRestoreThreadId),
    P("cuCheckpointProcessGetState", 12080, 0, cuCheckpointProcessGetState),
    P("cuCheckpointProcessLock", 12080, 0, cuCheckpointProcessLock),
    P("cuCheckpointProcessCheckpoint", 12080, 0, cuCheckpointProcessCheckpoint),
    P("cuCheckpointProcessRestore", 12080, 0, cuCheckpointProcessRestore),
    P("cuCheckpointProcessUnlock", 12080, 0, cuCheckpointProcessUnlock),
#endif
#undef P
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status) {
    int best = -1, best_ptsz = -1;
    for (int i = 0; i < (int)(sizeof(procs) / sizeof(procs[0])); i++) {
        if (strcmp(procs[i].base, symbol) != 0 || procs[i].since > version) continue;
        int *b = procs[i].ptsz ? &best_ptsz : &best;
        if (*b < 0 || procs[*b].since < procs[i].since) *b = i;
    }
    int pick = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best_ptsz >= 0 ? best_ptsz
                                                                                         : best;
    if (pick < 0) {
        *pfn = NULL;
        if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = dbl_env.proc_aliases && procs[pick].alias ? procs[pick].alias : procs[pick].fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

__attribute__((constructor)) static void double_env(void) { dbl_ready(); }
