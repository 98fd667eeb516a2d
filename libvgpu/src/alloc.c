/*
 * alloc.c: the allocation hooks (cuMemAlloc, managed, pitch, VMM, arrays), their frees, and
 * the memory queries, which report the slice. The counting is memory.c's (see there).
 */
#define _GNU_SOURCE
#include <string.h>

#include "memory.h"

#define PITCH_ALIGN 512ull

/* ---- allocation hooks ------------------------------------------------------------------- */


VGPU_EXPORT VGPU_HOT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    int dev;
    CUcontext ctx;
    CUresult rc = vgpu_mem_begin(H_cuMemAlloc_v2, bytes, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL(cuMemAlloc_v2)(dptr, bytes);
    for (struct vgpu_reclaim w = {0}; vgpu_reclaim_again(&w, dev, bytes, rc);)
        rc = REAL(cuMemAlloc_v2)(dptr, bytes);
    return vgpu_mem_end(rc, rc == CUDA_SUCCESS ? *dptr : 0, K_PTR, dev, ctx, bytes);
}

VGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    int dev;
    CUcontext ctx;
    CUresult rc = vgpu_mem_begin(H_cuMemAllocManaged, bytes, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL(cuMemAllocManaged)(dptr, bytes, flags);
    return vgpu_mem_end(rc, rc == CUDA_SUCCESS ? *dptr : 0, K_PTR, dev, ctx, bytes);
}

VGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                        size_t height, unsigned int elem) {
    uint64_t est = ((width + PITCH_ALIGN - 1) / PITCH_ALIGN) * PITCH_ALIGN * height;
    int dev;
    CUcontext ctx;
    CUresult rc = vgpu_mem_begin(H_cuMemAllocPitch_v2, est, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elem);
    if (dev < 0 || rc != CUDA_SUCCESS) return vgpu_mem_end(rc, 0, K_PTR, dev, ctx, est);
    uint64_t actual = (uint64_t)*pitch * height;
    if (vgpu_mem_settle(dev, est, actual, 0) != CUDA_SUCCESS) {
        REAL(cuMemFree_v2)(*dptr);
        vgpu_mem_release(dev, est, 0);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return vgpu_mem_end(rc, *dptr, K_PTR, dev, ctx, actual);
}

static VGPU_HOT CUresult free_ptr(int id, CUdeviceptr p, CUstream s) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    void *real = atomic_load(&vgpu_hooks[id].real);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    struct entry e;
    int had = p && accounting() && vgpu_mem_take(p, K_PTR, &e);
    int async = !had && p && accounting() && vgpu_mem_take(p, K_ASYNC, &e);
    rc = id == H_cuMemFree_v2 ? ((cuMemFree_v2_fn)real)(p) : ((cuMemFreeAsync_fn)real)(p, s);
    if (had) {
        if (rc == CUDA_SUCCESS) vgpu_mem_release(e.dev, e.size, 0);
        else vgpu_mem_put_back(&e);
    } else if (async) { /* back into its pool: counted while the pool keeps it */
        if (rc != CUDA_SUCCESS) vgpu_mem_put_back(&e);
        vgpu_pool_freed((CUmemoryPool)e.ctx);
    }
    return rc;
}

VGPU_EXPORT VGPU_HOT CUresult cuMemFree_v2(CUdeviceptr p) {
    return free_ptr(H_cuMemFree_v2, p, NULL);
}
VGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    return free_ptr(H_cuMemFreeAsync, p, s);
}
VGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    return free_ptr(H_cuMemFreeAsync_ptsz, p, s);
}

/* VMM: physical memory is created per device and lives until cuMemRelease (no context). */
VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                 const CUmemAllocationProp *prop, unsigned long long flags) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemCreate_fn real = REAL(cuMemCreate);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    if (!accounting() || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        prop->location.id < 0 || prop->location.id >= VGPU_MAX_DEV)
        return real(handle, bytes, prop, flags);
    int dev = prop->location.id;
    rc = vgpu_mem_reserve(dev, bytes, 0);
    if (rc != CUDA_SUCCESS) return rc;
    rc = real(handle, bytes, prop, flags);
    for (struct vgpu_reclaim w = {0}; vgpu_reclaim_again(&w, dev, bytes, rc);)
        rc = real(handle, bytes, prop, flags);
    return vgpu_mem_end(rc, rc == CUDA_SUCCESS ? *handle : 0, K_VMM, dev, NULL, bytes);
}

/* A handle's memory lives until it is released and no mapping of it is left. */
VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemRelease_fn real = REAL(cuMemRelease);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    struct entry e;
    int had = handle && accounting() && vgpu_mem_take(handle, K_VMM, &e);
    rc = real(handle);
    if (had) {
        if (rc != CUDA_SUCCESS) vgpu_mem_put_back(&e);
        else if (vgpu_mem_is_mapped(handle)) vgpu_mem_track(handle, K_VMM_GONE, e.size, e.dev, NULL);
        else vgpu_mem_release(e.dev, e.size, 0);
    }
    return rc;
}

VGPU_EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset,
                              CUmemGenericAllocationHandle handle, unsigned long long flags) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemMap_fn real = REAL(cuMemMap);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(va, size, offset, handle, flags);
    if (rc == CUDA_SUCCESS && accounting() && va) vgpu_mem_track(va, K_MAP, handle, 0, NULL);
    return rc;
}

VGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemUnmap_fn real = REAL(cuMemUnmap);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(va, size);
    if (rc != CUDA_SUCCESS || !accounting()) return rc;
    CUmemGenericAllocationHandle gone[64];
    int n = vgpu_mem_take_mappings(va, size, gone, 64);
    for (int k = 0; k < n; k++) {
        struct entry e;
        if (!vgpu_mem_is_mapped(gone[k]) && vgpu_mem_take(gone[k], K_VMM_GONE, &e))
            vgpu_mem_release(e.dev, e.size, 0);
    }
    return rc;
}

/* ---- arrays ---------------------------------------------------------------------------- */

static uint64_t element_bytes(CUarray_format f, unsigned channels) {
    uint64_t b;
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: b = 1; break;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: b = 2; break;
    default: b = 4; break; /* 32-bit formats; others are corrected by the driver's answer */
    }
    return b * (channels ? channels : 1);
}

static uint64_t dim(size_t v) { return v ? v : 1; }

static uint64_t array3d_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    uint64_t total = 0, e = element_bytes(d->Format, d->NumChannels);
    int layered = (d->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t w = dim(d->Width >> l), h = d->Height ? dim(d->Height >> l) : 1;
        uint64_t z = layered ? dim(d->Depth) : (d->Depth ? dim(d->Depth >> l) : 1);
        total += w * h * z * e;
    }
    return total;
}

/* After an array was created with est reserved: correct to the driver's own size. */
static CUresult settle_array(int dev, uint64_t est, uint64_t actual, void *handle, int kind) {
    if (vgpu_mem_settle(dev, est, actual, 0) == CUDA_SUCCESS) return CUDA_SUCCESS;
    if (kind == K_ARRAY) REAL(cuArrayDestroy)((CUarray)handle);
    else REAL(cuMipmappedArrayDestroy)((CUmipmappedArray)handle);
    vgpu_mem_release(dev, est, 0);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static uint64_t array_actual(CUarray a, int dev, uint64_t est) {
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    cuArrayGetMemoryRequirements_fn get = REAL(cuArrayGetMemoryRequirements);
    memset(&req, 0, sizeof(req));
    if (get && get(&req, a, dev) == CUDA_SUCCESS && req.size) return req.size;
    return est;
}

static CUresult array_create(int id, CUarray *arr, uint64_t est, const void *desc) {
    int dev;
    CUcontext ctx;
    CUresult rc = vgpu_mem_begin(id, est, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (id == H_cuArrayCreate_v2)
        rc = REAL(cuArrayCreate_v2)(arr, (const CUDA_ARRAY_DESCRIPTOR *)desc);
    else
        rc = REAL(cuArray3DCreate_v2)(arr, (const CUDA_ARRAY3D_DESCRIPTOR *)desc);
    if (dev < 0 || rc != CUDA_SUCCESS) return vgpu_mem_end(rc, 0, K_ARRAY, dev, ctx, est);
    uint64_t actual = array_actual(*arr, dev, est);
    rc = settle_array(dev, est, actual, *arr, K_ARRAY);
    if (rc != CUDA_SUCCESS) return rc;
    return vgpu_mem_end(CUDA_SUCCESS, (uint64_t)(uintptr_t)*arr, K_ARRAY, dev, ctx, actual);
}

VGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *d) {
    uint64_t est = d ? dim(d->Width) * dim(d->Height) * element_bytes(d->Format, d->NumChannels)
                     : 0;
    return array_create(H_cuArrayCreate_v2, arr, est, d);
}

VGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    return array_create(H_cuArray3DCreate_v2, arr, d ? array3d_bytes(d, 1) : 0, d);
}

VGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr,
                                            const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    uint64_t est = d ? array3d_bytes(d, levels) : 0;
    int dev;
    CUcontext ctx;
    CUresult rc = vgpu_mem_begin(H_cuMipmappedArrayCreate, est, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL(cuMipmappedArrayCreate)(arr, d, levels);
    if (dev < 0 || rc != CUDA_SUCCESS) return vgpu_mem_end(rc, 0, K_MIPMAP, dev, ctx, est);
    uint64_t actual = est;
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    memset(&req, 0, sizeof(req));
    cuMipmappedArrayGetMemoryRequirements_fn get = REAL(cuMipmappedArrayGetMemoryRequirements);
    if (get && get(&req, *arr, dev) == CUDA_SUCCESS && req.size) actual = req.size;
    rc = settle_array(dev, est, actual, *arr, K_MIPMAP);
    if (rc != CUDA_SUCCESS) return rc;
    return vgpu_mem_end(CUDA_SUCCESS, (uint64_t)(uintptr_t)*arr, K_MIPMAP, dev, ctx, actual);
}

static CUresult destroy_array(int id, void *handle, int kind) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    void *real = atomic_load(&vgpu_hooks[id].real);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    struct entry e;
    int had = handle && accounting() && vgpu_mem_take((uint64_t)(uintptr_t)handle, (uint8_t)kind, &e);
    rc = kind == K_ARRAY ? ((cuArrayDestroy_fn)real)((CUarray)handle)
                         : ((cuMipmappedArrayDestroy_fn)real)((CUmipmappedArray)handle);
    if (had) {
        if (rc == CUDA_SUCCESS) vgpu_mem_release(e.dev, e.size, 0);
        else vgpu_mem_put_back(&e);
    }
    return rc;
}

VGPU_EXPORT CUresult cuArrayDestroy(CUarray a) { return destroy_array(H_cuArrayDestroy, a, K_ARRAY); }
VGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) {
    return destroy_array(H_cuMipmappedArrayDestroy, a, K_MIPMAP);
}

/* ---- queries report the slice ---------------------------------------------------------- */

VGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemGetInfo_v2_fn real = REAL(cuMemGetInfo_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(free_bytes, total_bytes);
    if (rc != CUDA_SUCCESS || !accounting() || !free_bytes || !total_bytes) return rc;
    CUdevice dev;
    vgpu_current_device(&dev);
    uint64_t limit = vgpu_limit(dev);
    if (limit == VGPU_UNLIMITED) return rc;
    vgpu_mem_true_up(dev, 1);
    uint64_t used = vgpu_container_used(dev);
    uint64_t total = limit < *total_bytes ? limit : *total_bytes;
    uint64_t now = vgpu_mem_allowed(dev); /* an elastic slice: what it may hold now */
    if (now > total) now = total;
    uint64_t avail = used >= now ? 0 : now - used;
    *total_bytes = (size_t)total;
    if (avail < *free_bytes) *free_bytes = (size_t)avail;
    return rc;
}

VGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuDeviceTotalMem_v2_fn real = REAL(cuDeviceTotalMem_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(bytes, dev);
    if (rc != CUDA_SUCCESS || !bytes || !accounting()) return rc;
    uint64_t limit = vgpu_limit(dev);
    if (limit < *bytes) *bytes = (size_t)limit;
    return rc;
}

/* ---- the v1 ABI ---------------------------------------------------------------------------
 * The entry points without _v2 (CUDA before 3.2: 32-bit sizes and device pointers) would
 * allocate past the limit and show the whole card. Allocations through them are refused
 * (CUDA_ERROR_NOT_SUPPORTED) while limits apply: no 64-bit program built since CUDA 3.2 uses
 * them. Queries answer the slice, as the _v2 ones do, clamped to 32 bits. */

/* CUDA_SUCCESS: call the driver (no limits here); else the answer. */
static CUresult v1_allowed(int id) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!atomic_load(&vgpu_hooks[id].real)) return CUDA_ERROR_NOT_FOUND;
    if (!accounting()) return CUDA_SUCCESS;
    static _Atomic int warned;
    if (!atomic_exchange(&warned, 1))
        vgpu_log("%s (the CUDA v1 ABI) is refused under a memory limit; use %s_v2",
                 vgpu_hooks[id].name, vgpu_hooks[id].name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define V1_REAL(id, type) ((type)atomic_load(&vgpu_hooks[id].real))

VGPU_EXPORT CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytes) {
    CUresult rc = v1_allowed(H_cuMemAlloc);
    if (rc != CUDA_SUCCESS) return rc;
    return V1_REAL(H_cuMemAlloc, CUresult(*)(unsigned int *, unsigned int))(dptr, bytes);
}

VGPU_EXPORT CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pitch, unsigned int w,
                                     unsigned int h, unsigned int elem) {
    CUresult rc = v1_allowed(H_cuMemAllocPitch);
    if (rc != CUDA_SUCCESS) return rc;
    typedef CUresult (*fn)(unsigned int *, unsigned int *, unsigned int, unsigned int,
                           unsigned int);
    return V1_REAL(H_cuMemAllocPitch, fn)(dptr, pitch, w, h, elem);
}

VGPU_EXPORT CUresult cuArrayCreate(CUarray *arr, const void *desc) {
    CUresult rc = v1_allowed(H_cuArrayCreate);
    if (rc != CUDA_SUCCESS) return rc;
    return V1_REAL(H_cuArrayCreate, CUresult(*)(CUarray *, const void *))(arr, desc);
}

VGPU_EXPORT CUresult cuArray3DCreate(CUarray *arr, const void *desc) {
    CUresult rc = v1_allowed(H_cuArray3DCreate);
    if (rc != CUDA_SUCCESS) return rc;
    return V1_REAL(H_cuArray3DCreate, CUresult(*)(CUarray *, const void *))(arr, desc);
}

VGPU_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CUresult rc = v1_allowed(H_cuCtxCreate);
    if (rc != CUDA_SUCCESS) return rc;
    return V1_REAL(H_cuCtxCreate, cuCtxCreate_v2_fn)(pctx, flags, dev);
}

static unsigned int u32(size_t v) { return v > 0xffffffffu ? 0xffffffffu : (unsigned int)v; }

VGPU_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes) {
    size_t f = 0, t = 0;
    CUresult rc = cuMemGetInfo_v2(&f, &t); /* the slice */
    if (rc == CUDA_SUCCESS && free_bytes) *free_bytes = u32(f);
    if (rc == CUDA_SUCCESS && total_bytes) *total_bytes = u32(t);
    return rc;
}

VGPU_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    size_t b = 0;
    CUresult rc = cuDeviceTotalMem_v2(&b, dev);
    if (rc == CUDA_SUCCESS && bytes) *bytes = u32(b);
    return rc;
}
