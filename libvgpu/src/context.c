/*
 * context.c: the driver's own memory counts. Contexts (created or primary), modules and
 * libraries are charged what the driver's usage for this process grew by while making them
 * (measured through NVML), or context_mib, until they are destroyed or unloaded.
 */
#define _GNU_SOURCE
#include <string.h>

#include "memory.h"

#define DEFAULT_CONTEXT_BYTES (256ull << 20) /* when the driver's own usage cannot be measured */

static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
#define MAX_TRACKED 1024
static struct owned {
    void *handle; /* a CUcontext, CUmodule or CUlibrary */
    int dev;
    uint64_t bytes;
} owned[MAX_TRACKED];
static int primary_refs[VGPU_MAX_DEV];
static CUcontext primary_ctx[VGPU_MAX_DEV];
static uint64_t primary_bytes[VGPU_MAX_DEV];

void vgpu_ctx_after_fork_child(void) {
    pthread_mutex_init(&ctx_lock, NULL);
    memset(owned, 0, sizeof(owned));
    memset(primary_refs, 0, sizeof(primary_refs));
    memset(primary_ctx, 0, sizeof(primary_ctx));
    memset(primary_bytes, 0, sizeof(primary_bytes));
}

static void own(void *handle, int dev, uint64_t bytes) {
    for (int i = 0; i < MAX_TRACKED; i++)
        if (!owned[i].handle) {
            owned[i] = (struct owned){handle, dev, bytes};
            return;
        }
}

static int disown(void *handle, struct owned *out) {
    for (int i = 0; i < MAX_TRACKED; i++)
        if (owned[i].handle == handle) {
            *out = owned[i];
            memset(&owned[i], 0, sizeof(owned[i]));
            return 1;
        }
    return 0;
}

/* Measuring the driver's memory for this process around a call. */
struct measure {
    int ok;
    uint64_t before, local_before;
};

static void measure_begin(int dev, struct measure *m) {
    m->ok = vgpu_nvml_process_used(dev, &m->before) >= 0; /* not listed yet: 0 bytes */
    m->local_before = vgpu_mem_local_alloc(dev);
}

/* The driver's own growth during the call (allocations counted meanwhile excluded), or -1. */
static int64_t measure_end(int dev, const struct measure *m) {
    uint64_t after;
    if (!m->ok || vgpu_nvml_process_used(dev, &after) != 0) return -1;
    uint64_t local = vgpu_mem_local_alloc(dev);
    uint64_t counted = local > m->local_before ? local - m->local_before : 0;
    int64_t grew = (int64_t)after - (int64_t)m->before - (int64_t)counted;
    return grew > 0 ? grew : 0;
}

static uint64_t context_estimate(int measurable) {
    if (vgpu.cfg.context_bytes >= 0) return (uint64_t)vgpu.cfg.context_bytes;
    return measurable ? 0 : DEFAULT_CONTEXT_BYTES;
}

typedef CUresult (*ctx_call)(void *args);

/* Charges a context's own memory around call(): reserve the estimate, create, correct to the
 * measured size. On OOM after creation, undo() destroys it. Returns the bytes charged. */
static CUresult charged_create(int dev, ctx_call call, void *args, void (*undo)(void *),
                               uint64_t *charged, CUcontext *pctx) {
    struct vgpu_pidsnap snap;
    vgpu_host_pid_before(dev, &snap);
    struct measure m;
    measure_begin(dev, &m);
    uint64_t est = context_estimate(m.ok);
    CUresult rc = vgpu_mem_reserve(dev, est, 1);
    if (rc != CUDA_SUCCESS) return rc;
    rc = call(args);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, est, 1);
        return rc;
    }
    vgpu_host_pid_after(dev, &snap, *pctx);
    uint64_t actual = est;
    if (vgpu.cfg.context_bytes < 0) {
        int64_t grew = measure_end(dev, &m);
        actual = grew >= 0 ? (uint64_t)grew : DEFAULT_CONTEXT_BYTES;
    }
    if (vgpu_mem_settle(dev, est, actual, 1) != CUDA_SUCCESS) {
        undo(args);
        vgpu_mem_release(dev, est, 1);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *charged = actual;
    return CUDA_SUCCESS;
}

struct ctx_args {
    int version;
    CUcontext *pctx;
    unsigned int flags;
    CUdevice dev;
    void *params;
    int nparams;
};

static CUresult do_ctx_create(void *p) {
    struct ctx_args *a = p;
    switch (a->version) {
    case 3: return REAL(cuCtxCreate_v3)(a->pctx, a->params, a->nparams, a->flags, a->dev);
    case 4: return REAL(cuCtxCreate_v4)(a->pctx, a->params, a->flags, a->dev);
    default: return REAL(cuCtxCreate_v2)(a->pctx, a->flags, a->dev);
    }
}

static void undo_ctx_create(void *p) { REAL(cuCtxDestroy_v2)(*((struct ctx_args *)p)->pctx); }

static CUresult ctx_create(int id, struct ctx_args *a) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!atomic_load(&vgpu_hooks[id].real)) return CUDA_ERROR_NOT_FOUND;
    if (!accounting() || a->dev < 0 || a->dev >= VGPU_MAX_DEV || !a->pctx) return do_ctx_create(a);
    uint64_t charged = 0;
    pthread_mutex_lock(&ctx_lock);
    rc = charged_create(a->dev, do_ctx_create, a, undo_ctx_create, &charged, a->pctx);
    if (rc == CUDA_SUCCESS) own(*a->pctx, a->dev, charged);
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

VGPU_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    struct ctx_args a = {2, pctx, flags, dev, NULL, 0};
    return ctx_create(H_cuCtxCreate_v2, &a);
}
VGPU_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                                    unsigned int flags, CUdevice dev) {
    struct ctx_args a = {3, pctx, flags, dev, params, n};
    return ctx_create(H_cuCtxCreate_v3, &a);
}
VGPU_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                                    CUdevice dev) {
    struct ctx_args a = {4, pctx, flags, dev, params, 0};
    return ctx_create(H_cuCtxCreate_v4, &a);
}

VGPU_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuCtxDestroy_v2_fn real = REAL(cuCtxDestroy_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(ctx);
    if (rc != CUDA_SUCCESS || !accounting()) return rc;
    struct owned o;
    pthread_mutex_lock(&ctx_lock);
    int had = disown(ctx, &o);
    pthread_mutex_unlock(&ctx_lock);
    if (had) vgpu_mem_release(o.dev, o.bytes, 1);
    vgpu_mem_forget_context(ctx);
    return rc;
}

struct retain_args {
    CUcontext *pctx;
    CUdevice dev;
};
static CUresult do_retain(void *p) {
    struct retain_args *a = p;
    return REAL(cuDevicePrimaryCtxRetain)(a->pctx, a->dev);
}
static void undo_retain(void *p) { REAL(cuDevicePrimaryCtxRelease_v2)(((struct retain_args *)p)->dev); }

VGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!REAL(cuDevicePrimaryCtxRetain)) return CUDA_ERROR_NOT_FOUND;
    struct retain_args a = {pctx, dev};
    if (!accounting() || dev < 0 || dev >= VGPU_MAX_DEV || !pctx) return do_retain(&a);
    pthread_mutex_lock(&ctx_lock);
    if (primary_refs[dev] > 0) {
        rc = do_retain(&a);
        if (rc == CUDA_SUCCESS) primary_refs[dev]++;
    } else {
        uint64_t charged = 0;
        rc = charged_create(dev, do_retain, &a, undo_retain, &charged, pctx);
        if (rc == CUDA_SUCCESS) {
            primary_refs[dev] = 1;
            primary_ctx[dev] = *pctx;
            primary_bytes[dev] = charged;
        }
    }
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

VGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuDevicePrimaryCtxRelease_v2_fn real = REAL(cuDevicePrimaryCtxRelease_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(dev);
    if (rc != CUDA_SUCCESS || !accounting() || dev < 0 || dev >= VGPU_MAX_DEV) return rc;
    CUcontext gone = NULL;
    uint64_t bytes = 0;
    pthread_mutex_lock(&ctx_lock);
    if (primary_refs[dev] > 0 && --primary_refs[dev] == 0) {
        gone = primary_ctx[dev];
        bytes = primary_bytes[dev];
        primary_ctx[dev] = NULL;
        primary_bytes[dev] = 0;
    }
    pthread_mutex_unlock(&ctx_lock);
    if (gone) {
        vgpu_mem_release(dev, bytes, 1);
        vgpu_mem_forget_context(gone);
    }
    return rc;
}

VGPU_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuDevicePrimaryCtxReset_v2_fn real = REAL(cuDevicePrimaryCtxReset_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(dev);
    if (rc == CUDA_SUCCESS && accounting() && dev >= 0 && dev < VGPU_MAX_DEV) {
        pthread_mutex_lock(&ctx_lock);
        CUcontext c = primary_ctx[dev];
        pthread_mutex_unlock(&ctx_lock);
        if (c) vgpu_mem_forget_context(c); /* its allocations are gone; the context stays charged */
    }
    return rc;
}

/* Modules and libraries: whatever the driver's usage for this process grew by while loading
 * (measured through NVML when it can see this process) is charged until the unload. */
struct load_args {
    int id;
    void **out;
    const void *a;
    unsigned int n;
    int *opts;
    void **vals;
    int *lopts;
    void **lvals;
    unsigned int ln;
};

static CUresult do_load(void *p) {
    struct load_args *l = p;
    switch (l->id) {
    case H_cuModuleLoad: return REAL(cuModuleLoad)((CUmodule *)l->out, l->a);
    case H_cuModuleLoadData: return REAL(cuModuleLoadData)((CUmodule *)l->out, l->a);
    case H_cuModuleLoadDataEx:
        return REAL(cuModuleLoadDataEx)((CUmodule *)l->out, l->a, l->n, l->opts, l->vals);
    case H_cuModuleLoadFatBinary: return REAL(cuModuleLoadFatBinary)((CUmodule *)l->out, l->a);
    case H_cuLibraryLoadData:
        return REAL(cuLibraryLoadData)((CUlibrary *)l->out, l->a, l->opts, l->vals, l->n,
                                       l->lopts, l->lvals, l->ln);
    default:
        return REAL(cuLibraryLoadFromFile)((CUlibrary *)l->out, l->a, l->opts, l->vals, l->n,
                                           l->lopts, l->lvals, l->ln);
    }
}

static void undo_load(void *p) {
    struct load_args *l = p;
    if (l->id == H_cuLibraryLoadData || l->id == H_cuLibraryLoadFromFile)
        REAL(cuLibraryUnload)(*(CUlibrary *)l->out);
    else
        REAL(cuModuleUnload)(*(CUmodule *)l->out);
}

static CUresult load(struct load_args *l) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!atomic_load(&vgpu_hooks[l->id].real)) return CUDA_ERROR_NOT_FOUND;
    if (!accounting() || !l->out) return do_load(l);
    CUdevice dev;
    vgpu_current_device(&dev);
    if (dev >= VGPU_MAX_DEV) return do_load(l);
    struct measure m;
    measure_begin(dev, &m);
    rc = do_load(l);
    if (rc != CUDA_SUCCESS) return rc;
    int64_t grew = measure_end(dev, &m);
    if (grew <= 0) return rc;
    if (vgpu_mem_reserve(dev, (uint64_t)grew, 1) != CUDA_SUCCESS) {
        undo_load(l);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&ctx_lock);
    own(*l->out, dev, (uint64_t)grew);
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

VGPU_EXPORT CUresult cuModuleLoad(CUmodule *m, const char *fname) {
    struct load_args l = {.id = H_cuModuleLoad, .out = (void **)m, .a = fname};
    return load(&l);
}
VGPU_EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    struct load_args l = {.id = H_cuModuleLoadData, .out = (void **)m, .a = image};
    return load(&l);
}
VGPU_EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, int *opts,
                                        void **vals) {
    struct load_args l = {.id = H_cuModuleLoadDataEx, .out = (void **)m, .a = image, .n = n,
                          .opts = opts, .vals = vals};
    return load(&l);
}
VGPU_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin) {
    struct load_args l = {.id = H_cuModuleLoadFatBinary, .out = (void **)m, .a = fatbin};
    return load(&l);
}
VGPU_EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, int *opts, void **vals,
                                       unsigned int n, int *lopts, void **lvals, unsigned int ln) {
    struct load_args l = {H_cuLibraryLoadData, (void **)lib, code, n, opts, vals, lopts, lvals, ln};
    return load(&l);
}
VGPU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *file, int *opts,
                                           void **vals, unsigned int n, int *lopts, void **lvals,
                                           unsigned int ln) {
    struct load_args l = {H_cuLibraryLoadFromFile, (void **)lib, file, n, opts, vals, lopts,
                          lvals, ln};
    return load(&l);
}

static CUresult unload(int id, void *handle) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    void *real = atomic_load(&vgpu_hooks[id].real);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = id == H_cuModuleUnload ? ((cuModuleUnload_fn)real)((CUmodule)handle)
                                : ((cuLibraryUnload_fn)real)((CUlibrary)handle);
    if (rc != CUDA_SUCCESS || !accounting() || !handle) return rc;
    struct owned o;
    pthread_mutex_lock(&ctx_lock);
    int had = disown(handle, &o);
    pthread_mutex_unlock(&ctx_lock);
    if (had) vgpu_mem_release(o.dev, o.bytes, 1);
    return rc;
}

VGPU_EXPORT CUresult cuModuleUnload(CUmodule m) { return unload(H_cuModuleUnload, m); }
VGPU_EXPORT CUresult cuLibraryUnload(CUlibrary l) { return unload(H_cuLibraryUnload, l); }
