/*
 * pools.c: stream-ordered pools (cuMemAllocAsync, cuMemAllocFromPoolAsync) and graph memory,
 * counted at what the driver holds reserved for them rather than at their live blocks.
 */
#define _GNU_SOURCE
#include <string.h>

#include "memory.h"

#define MAX_POOLS 64
static struct {
    CUmemoryPool pool;
    int dev;
    uint64_t counted;
} pools[MAX_POOLS];
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t graph_counted[VGPU_MAX_DEV]; /* graph memory counted (pool lock) */
static _Atomic uint64_t graph_checked_at;

void vgpu_pools_after_fork_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    memset(pools, 0, sizeof(pools)); /* a child has no pools of its own yet */
    memset(graph_counted, 0, sizeof(graph_counted));
}

/* ---- stream-ordered pools ------------------------------------------------------------------
 * What counts is what a pool has reserved on the device, not its live blocks: freed blocks
 * stay reserved for reuse (PyTorch sets the release threshold to UINT64_MAX, so nothing is
 * ever given back unless trimmed), and a pool gives memory back at synchronisations or a
 * trim. Each pool's reserved size (the driver's own CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) is
 * reconciled with what was counted for it after every stream-ordered allocation and free,
 * on a trim, on memory queries and before an allocation is refused. */

static int pool_reserved(CUmemoryPool pool, uint64_t *bytes) {
    cuMemPoolGetAttribute_fn get = REAL(cuMemPoolGetAttribute);
    cuuint64_t v = 0;
    if (!get || !pool || get(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
        return -1;
    *bytes = v;
    return 0;
}

/* Brings the count of pool i to its reserved size; `reserved` bytes were counted already for
 * the allocation being made (0 otherwise). Pool lock held. */
static void reconcile_locked(int i, uint64_t reserved) {
    uint64_t now;
    if (pool_reserved(pools[i].pool, &now) != 0) return;
    uint64_t had = pools[i].counted + reserved;
    if (now > had) vgpu_mem_reserve_held(pools[i].dev, now - had, 0); /* the driver holds it already */
    else if (now < had) vgpu_mem_release(pools[i].dev, had - now, 0);
    pools[i].counted = now;
}

static int pool_slot_locked(CUmemoryPool pool, int dev) {
    int spare = -1;
    for (int i = 0; i < MAX_POOLS; i++) {
        if (pools[i].pool == pool) return i;
        if (spare < 0 && !pools[i].pool) spare = i;
    }
    if (spare >= 0) pools[spare].pool = pool, pools[spare].dev = dev, pools[spare].counted = 0;
    return spare;
}

/* ---- graph memory ------------------------------------------------------------------------
 * Memory allocation nodes take memory from the device's graph pool when a graph runs; it
 * stays reserved for later launches until cuDeviceGraphMemTrim. The count follows the
 * driver's CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT after graph launches (at most every
 * GRAPH_CHECK_NS per process), trims, memory queries and before refusals. */
#define GRAPH_CHECK_NS (100ull * 1000000ull)

static void reconcile_graph_mem_locked(int dev) {
    cuDeviceGetGraphMemAttribute_fn get = REAL(cuDeviceGetGraphMemAttribute);
    cuuint64_t now = 0;
    if (!get || get(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &now) != CUDA_SUCCESS) return;
    if (now > graph_counted[dev]) vgpu_mem_reserve_held(dev, now - graph_counted[dev], 0); /* held already */
    else if (now < graph_counted[dev]) vgpu_mem_release(dev, graph_counted[dev] - now, 0);
    graph_counted[dev] = now;
}

void vgpu_graph_launched(void) {
    if (!accounting()) return;
    uint64_t now = vgpu_coarse_real_ns(), last = atomic_load(&graph_checked_at);
    if (now - last < GRAPH_CHECK_NS || !atomic_compare_exchange_strong(&graph_checked_at, &last, now))
        return;
    CUdevice dev;
    vgpu_current_device(&dev);
    if (dev < 0 || dev >= VGPU_MAX_DEV) return;
    pthread_mutex_lock(&pool_lock);
    reconcile_graph_mem_locked(dev);
    pthread_mutex_unlock(&pool_lock);
}

VGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuDeviceGraphMemTrim_fn real = REAL(cuDeviceGraphMemTrim);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(dev);
    if (rc == CUDA_SUCCESS && accounting() && dev >= 0 && dev < VGPU_MAX_DEV) {
        pthread_mutex_lock(&pool_lock);
        reconcile_graph_mem_locked(dev);
        pthread_mutex_unlock(&pool_lock);
    }
    return rc;
}

/* Every pool of dev, and its graph memory, reconciled (memory queries; before refusals). */
void vgpu_pools_reconcile(int dev) {
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].pool && pools[i].dev == dev) reconcile_locked(i, 0);
    reconcile_graph_mem_locked(dev);
    pthread_mutex_unlock(&pool_lock);
}

/* What a pool holds reserved but not in use: a new block up to this size needs nothing new. */
static uint64_t pool_idle(CUmemoryPool pool) {
    cuMemPoolGetAttribute_fn get = REAL(cuMemPoolGetAttribute);
    cuuint64_t reserved = 0, used = 0;
    if (!get || get(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS ||
        get(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != CUDA_SUCCESS)
        return 0;
    return reserved > used ? reserved - used : 0;
}

static CUresult alloc_async(int id, CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                            CUstream s) {
    int dev;
    CUcontext ctx;
    CUresult rc = vgpu_mem_begin(id, 0, &dev, &ctx); /* ready, real present, which GPU */
    if (rc != CUDA_SUCCESS) return rc;
    void *real = atomic_load(&vgpu_hooks[id].real);
    int from_pool = !(id == H_cuMemAllocAsync || id == H_cuMemAllocAsync_ptsz);
    CUmemoryPool counted_pool = pool;
    cuDeviceGetMemPool_fn current = REAL(cuDeviceGetMemPool);
    if (dev >= 0 && !from_pool && (!current || current(&counted_pool, dev) != CUDA_SUCCESS))
        counted_pool = NULL;
    uint64_t reserved;
    int by_pool = dev >= 0 && counted_pool && pool_reserved(counted_pool, &reserved) == 0;
    uint64_t idle = by_pool ? pool_idle(counted_pool) : 0;
    uint64_t need = bytes > idle ? bytes - idle : 0; /* reuse needs nothing new */
    if (dev >= 0) {
        rc = vgpu_mem_reserve(dev, need, 0);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            vgpu_mem_true_up(dev, 1);
            rc = vgpu_mem_reserve(dev, need, 0);
        }
        if (rc != CUDA_SUCCESS) return rc;
    }
    struct vgpu_reclaim w = {0};
    do
        rc = from_pool ? ((cuMemAllocFromPoolAsync_fn)real)(dptr, bytes, pool, s)
                       : ((cuMemAllocAsync_fn)real)(dptr, bytes, s);
    while (vgpu_reclaim_again(&w, dev, need, rc));
    if (dev < 0) return rc;
    if (!by_pool) return vgpu_mem_end(rc, rc == CUDA_SUCCESS ? *dptr : 0, K_PTR, dev, ctx, bytes);
    pthread_mutex_lock(&pool_lock);
    int i = pool_slot_locked(counted_pool, dev);
    if (i >= 0) reconcile_locked(i, need);
    pthread_mutex_unlock(&pool_lock);
    if (i < 0) { /* no room to follow it: per block */
        if (need < bytes && rc == CUDA_SUCCESS) vgpu_mem_reserve_held(dev, bytes - need, 0);
        return vgpu_mem_end(rc, rc == CUDA_SUCCESS ? *dptr : 0, K_PTR, dev, ctx, bytes);
    }
    if (rc == CUDA_SUCCESS) vgpu_mem_track(*dptr, K_ASYNC, 0, dev, (CUcontext)counted_pool);
    return rc;
}

VGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemPoolTrimTo_fn real = REAL(cuMemPoolTrimTo);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(pool, keep);
    if (rc != CUDA_SUCCESS || !accounting()) return rc;
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].pool == pool) reconcile_locked(i, 0);
    pthread_mutex_unlock(&pool_lock);
    return rc;
}

VGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s) {
    return alloc_async(H_cuMemAllocAsync, dptr, bytes, NULL, s);
}
VGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s) {
    return alloc_async(H_cuMemAllocAsync_ptsz, dptr, bytes, NULL, s);
}
VGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                             CUstream s) {
    return alloc_async(H_cuMemAllocFromPoolAsync, dptr, bytes, pool, s);
}
VGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes,
                                                  CUmemoryPool pool, CUstream s) {
    return alloc_async(H_cuMemAllocFromPoolAsync_ptsz, dptr, bytes, pool, s);
}

void vgpu_pool_freed(CUmemoryPool pool) {
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].pool == pool) reconcile_locked(i, 0);
    pthread_mutex_unlock(&pool_lock);
}
