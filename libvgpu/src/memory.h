/*
 * memory.h: what the memory files share. memory.c: the allocation table and the container's
 * counters (reserve, release, the NVML floor, the true-up); alloc.c: the allocation, free and
 * query hooks; pools.c: stream-ordered pools and graph memory; context.c: contexts, modules
 * and libraries. Process-local: nothing here is part of the region contract.
 */
#ifndef VGPU_MEMORY_H
#define VGPU_MEMORY_H

#include "vgpu.h"

/* K_MAP: a VMM mapping (key: its address, size: the handle); K_VMM_GONE: a handle released
 * while still mapped (its memory lives until the last mapping goes). */
enum { K_PTR = 1, K_VMM = 2, K_ARRAY = 3, K_MIPMAP = 4, K_ASYNC = 5, K_MAP = 6, K_VMM_GONE = 7 };

/* One counted allocation: handle -> (size, GPU, context; for K_ASYNC its pool). */
struct entry {
    uint64_t key;
    uint64_t size;
    CUcontext ctx;
    uint8_t kind;
    uint8_t dev;
};

static inline CUresult ready(void) {
    if (VGPU_LIKELY(atomic_load_explicit(&vgpu_cuda_go, memory_order_acquire))) return CUDA_SUCCESS;
    return vgpu_not_ready();
}

static inline int accounting(void) { return (vgpu.features & VGPU_F_REGION) != 0; }

/* memory.c: the table. track() returns the size of a stale entry it replaced (released). */
uint64_t vgpu_mem_track(uint64_t key, uint8_t kind, uint64_t size, int dev, CUcontext ctx);
int vgpu_mem_take(uint64_t key, uint8_t kind, struct entry *out);
void vgpu_mem_put_back(const struct entry *e);
int vgpu_mem_is_mapped(CUmemGenericAllocationHandle handle);
/* Removes every mapping in [va, va + size); writes up to cap of their handles to gone. */
int vgpu_mem_take_mappings(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle *gone,
                           int cap);

/* memory.c: the counters. */
CUresult vgpu_mem_reserve_held(int dev, uint64_t bytes, int overhead); /* held already: no limit */
CUresult vgpu_mem_settle(int dev, uint64_t est, uint64_t actual, int overhead);
uint64_t vgpu_mem_local_alloc(int dev); /* this process's counted allocations on dev */
/* Before an allocation of bytes with hook id: ready, real present, reserved (dev < 0: not
 * accounted). After it: rolled back if the driver failed, else remembered under key. */
CUresult vgpu_mem_begin(int id, uint64_t bytes, int *dev, CUcontext *ctx);
CUresult vgpu_mem_end(CUresult rc, uint64_t key, int kind, int dev, CUcontext ctx,
                      uint64_t bytes);

/* pools.c */
void vgpu_pools_reconcile(int dev);    /* every pool of dev, and its graph memory */
void vgpu_pool_freed(CUmemoryPool pool); /* a block went back into pool */
void vgpu_pools_after_fork_child(void);

/* context.c */
void vgpu_ctx_after_fork_child(void);

#endif /* VGPU_MEMORY_H */
