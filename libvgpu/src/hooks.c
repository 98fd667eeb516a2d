/*
 * hooks.c: the hook table, how the real driver is found, start-up, cuGetProcAddress, and the
 * dlopen redirect.
 *
 * How calls reach the hooks
 *  - Programs linked against libcuda.so.1 bind to our exported symbols (LD_PRELOAD comes first
 *    in the global scope).
 *  - Programs that dlopen("libcuda.so.1") and dlsym() from the handle (the CUDA runtime,
 *    PyTorch, ctypes) would bypass LD_PRELOAD: dlsym on a handle searches only that library
 *    and its dependencies. Our dlopen() therefore answers requests for libcuda / libnvidia-ml
 *    with a handle to a small proxy library (libvgpu-cuda.so / libvgpu-nvml.so beside this
 *    one) whose dependencies are [libvgpu.so, the real library]: dlsym on it finds our hook for
 *    hooked names and the real function for every other name.
 *    The driver is recognised by identity, not by file name: every other dlopen() is loaded
 *    the way glibc would for its caller (the caller's RUNPATH still applies) and a library
 *    that itself defines the driver's entry points (a renamed copy) gets the proxy too.
 *  - A library that links libcuda hands the real driver out through dlsym on its own handle
 *    or dlsym(RTLD_NEXT) from inside it: dlsym.c answers a hooked name with the hook whenever
 *    the driver would have answered, and passes every other lookup to glibc untouched.
 *  - CUDA 12+ runtimes fetch entry points with cuGetProcAddress(_v2): we answer it with our
 *    hook for hooked names (matched by the real pointer the driver returns, then by name and
 *    version).
 *
 * Nothing here runs at load time: no constructor. The first hooked call initialises (config,
 * region, real symbols) under pthread_once; libraries that call dlopen/dlsym from their own
 * constructors, before anything of ours ran, are fine.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vgpu.h"

#define ROW(sym, base, since, lib, ptsz, hook) \
    [H_##sym] = {#sym, base, since, VGPU_LIB_##lib, ptsz, (void *)(hook), NULL},

struct vgpu_hook vgpu_hooks[H_COUNT] = {VGPU_HOOK_TABLE(ROW)};
#undef ROW

struct vgpu_proc vgpu = {
    .reg_fd = -1,
    .slot = -1,
    .slow_lock = PTHREAD_MUTEX_INITIALIZER,
};
_Atomic int vgpu_cuda_go;
int vgpu_debug_on;

static const char *const lib_names[VGPU_LIB_COUNT][3] = {
    {"libcuda.so.1", "libcuda.so", NULL},
    {"libnvidia-ml.so.1", "libnvidia-ml.so", NULL},
};
static const char *const proxy_names[VGPU_LIB_COUNT] = {"libvgpu-cuda.so", "libvgpu-nvml.so"};

/* ---- logging, sleeping ------------------------------------------------------------------ */

void vgpu_log(const char *fmt, ...) {
    char line[1024];
    int n = snprintf(line, sizeof(line), "libvgpu[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(line) - 2) len = sizeof(line) - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len); /* one write: lines from processes don't mix */
    (void)w;
}

void vgpu_sleep_ns(uint64_t ns) {
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull),
                          .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---- the real dlopen, and the redirect ------------------------------------------------- */

typedef void *(*dlopen_fn)(const char *, int);
static dlopen_fn _Atomic real_dlopen_ptr;

static __attribute__((noinline)) dlopen_fn resolve_real_dlopen(void) {
    dlopen_fn f = (dlopen_fn)vgpu_dlsym(RTLD_NEXT, "dlopen");
    if (!f) f = (dlopen_fn)dlvsym(RTLD_NEXT, "dlopen", "GLIBC_2.34");
    if (!f) f = (dlopen_fn)dlvsym(RTLD_NEXT, "dlopen", "GLIBC_2.2.5");
    atomic_store_explicit(&real_dlopen_ptr, f, memory_order_release);
    return f;
}

static inline dlopen_fn real_dlopen(void) {
    dlopen_fn f = atomic_load_explicit(&real_dlopen_ptr, memory_order_acquire);
    return VGPU_LIKELY(f != NULL) ? f : resolve_real_dlopen();
}

/* Which driver library a dlopen() name asks for, or -1. */
static int driver_lib_of(const char *file) {
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    if (strncmp(base, "libcuda.so", 10) == 0 && (base[10] == 0 || base[10] == '.'))
        return VGPU_LIB_CUDA;
    if (strncmp(base, "libnvidia-ml.so", 15) == 0 && (base[15] == 0 || base[15] == '.'))
        return VGPU_LIB_NVML;
    return -1;
}

static char proxy_path[VGPU_LIB_COUNT][PATH_MAX];
static pthread_once_t proxy_once = PTHREAD_ONCE_INIT;

static void find_proxies(void) {
    Dl_info info;
    char self[PATH_MAX];
    if (!dladdr((void *)&vgpu_hooks, &info) || !info.dli_fname || !realpath(info.dli_fname, self))
        return;
    char *slash = strrchr(self, '/');
    if (!slash) return;
    *slash = 0;
    for (int lib = 0; lib < VGPU_LIB_COUNT; lib++) {
        char p[PATH_MAX];
        if (snprintf(p, sizeof(p), "%s/%s", self, proxy_names[lib]) >= (int)sizeof(p)) continue;
        if (access(p, R_OK) == 0) memcpy(proxy_path[lib], p, sizeof(p));
    }
}

/* Swaps h, a handle to the real driver library lib, for its proxy (see the top). */
static void *to_proxy(void *h, const char *file, int flags, int lib) {
    pthread_once(&proxy_once, find_proxies);
    if (!proxy_path[lib][0]) {
        static _Atomic int warned;
        if (!atomic_exchange(&warned, 1))
            vgpu_log("%s not found beside libvgpu.so: programs that dlopen %s are not limited",
                     proxy_names[lib], file);
        return h;
    }
    void *p = real_dlopen()(proxy_path[lib], (flags & ~RTLD_NOLOAD) | RTLD_LAZY);
    if (!p) {
        vgpu_log("cannot load %s (%s): programs that dlopen %s are not limited",
                 proxy_path[lib], dlerror(), file);
        return h;
    }
    dlclose(h); /* the proxy holds its own reference to the real library */
    return p;
}

static __attribute__((noinline)) void *dlopen_driver(const char *file, int flags, int lib) {
    void *h = real_dlopen()(file, flags);
    return h ? to_proxy(h, file, flags, lib) : NULL;
}

/* A driver library by identity, whatever its file is called: the object itself (not one of
 * its dependencies) defines the driver's entry points, and it is not one of ours. A copy of
 * libcuda.so.1 under another name, loaded by path or found on the library path, is the
 * driver; so is a renamed NVML (dlsym.c). */
static int driver_identity(void *h) {
    struct link_map *lm = NULL;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) != 0 || !lm) return -1;
    return vgpu_driver_object(lm);
}

/* Where dlopen(file) would find a bare name for the object that called it: that object's
 * RPATH/RUNPATH (with $ORIGIN), LD_LIBRARY_PATH and the system directories, in the order
 * glibc searches them (dlinfo RTLD_DI_SERINFO). Empty if none has it (ld.so.cache may). */
static int search_for_caller(const char *file, const void *caller, char *out, size_t outlen) {
    Dl_info di;
    struct link_map *lm = NULL;
    if (!dladdr1(caller, &di, (void **)&lm, RTLD_DL_LINKMAP) || !lm) return -1;
    Dl_serinfo size;
    if (dlinfo(lm, RTLD_DI_SERINFOSIZE, &size) != 0 || size.dls_size > 65536) return -1;
    union {
        Dl_serinfo si;
        char bytes[65536];
    } *buf = mmap(NULL, sizeof(*buf), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return -1;
    int rc = -1;
    buf->si.dls_size = size.dls_size;
    buf->si.dls_cnt = size.dls_cnt;
    if (dlinfo(lm, RTLD_DI_SERINFO, &buf->si) == 0) {
        for (unsigned int i = 0; i < buf->si.dls_cnt && rc < 0; i++) {
            const char *dir = buf->si.dls_serpath[i].dls_name;
            /* the system directories come after ld.so.cache: glibc's own call does those */
            if (!dir || !*dir || (buf->si.dls_serpath[i].dls_flags & LA_SER_DEFAULT)) continue;
            if (snprintf(out, outlen, "%s/%s", dir, file) >= (int)outlen) continue;
            if (access(out, F_OK) == 0) rc = 0;
        }
    }
    munmap(buf, sizeof(*buf));
    return rc;
}

/* Every other dlopen: load it as glibc would for the caller, then look at what was loaded.
 * A bare name is first looked up among the loaded objects, then on the caller's own search
 * path (so its RUNPATH still applies), else by glibc from here (ld.so.cache). */
static __attribute__((noinline)) void *dlopen_checked(const char *file, int flags,
                                                      const void *caller) {
    dlopen_fn real = real_dlopen();
    void *h = NULL;
    if (strchr(file, '/')) {
        h = real(file, flags);
    } else {
        h = real(file, flags | RTLD_NOLOAD);
        char path[PATH_MAX];
        if (!h && !(flags & RTLD_NOLOAD) && search_for_caller(file, caller, path, sizeof(path)) == 0)
            h = real(path, flags);
        if (!h && !(flags & RTLD_NOLOAD)) h = real(file, flags);
    }
    if (!h) return NULL;
    int lib = driver_identity(h);
    return lib >= 0 ? to_proxy(h, file, flags, lib) : h;
}

/* dlmopen into a namespace of its own: LD_PRELOAD does not reach there, so the driver (by
 * name or identity) is handed out from the base namespace through its proxy instead. */
typedef void *(*dlmopen_fn)(Lmid_t, const char *, int);
VGPU_EXPORT void *dlmopen(Lmid_t lmid, const char *file, int flags) {
    static dlmopen_fn _Atomic real_ptr;
    dlmopen_fn real = atomic_load(&real_ptr);
    if (!real) {
        real = (dlmopen_fn)vgpu_dlsym(RTLD_NEXT, "dlmopen");
        atomic_store(&real_ptr, real);
    }
    if (!real) return NULL;
    if (lmid == LM_ID_BASE && file) return dlopen_checked(file, flags, __builtin_return_address(0));
    void *h = real(lmid, file, flags);
    if (!h || !file) return h;
    int lib = driver_lib_of(file);
    if (lib < 0) lib = driver_identity(h);
    if (lib < 0) return h;
    dlclose(h);
    return dlopen_driver(lib == VGPU_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1",
                         flags & ~RTLD_NOLOAD, lib);
}

VGPU_EXPORT void *dlopen(const char *file, int flags) {
    if (!file) return real_dlopen()(file, flags);
    int lib = driver_lib_of(file);
    if (VGPU_UNLIKELY(lib >= 0)) return dlopen_driver(file, flags, lib);
    return dlopen_checked(file, flags, __builtin_return_address(0));
}

/* ---- resolving the real libraries --------------------------------------------------------- */

static void *lib_handle[VGPU_LIB_COUNT];

static void resolve_lib(int lib) {
    dlopen_fn real = real_dlopen();
    void *h = NULL;
    for (int i = 0; !h && lib_names[lib][i]; i++) h = real(lib_names[lib][i], RTLD_LAZY | RTLD_NOLOAD);
    for (int i = 0; !h && lib_names[lib][i]; i++) h = real(lib_names[lib][i], RTLD_LAZY);
    lib_handle[lib] = h;
    if (!h) return;
    for (int id = 0; id < H_COUNT; id++) {
        if (vgpu_hooks[id].lib != lib) continue;
        void *p = vgpu_dlsym(h, vgpu_hooks[id].name);
        atomic_store_explicit(&vgpu_hooks[id].real, p, memory_order_release);
    }
}

/* ---- start-up ------------------------------------------------------------------------------ */

static pthread_once_t state_once = PTHREAD_ONCE_INIT;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static int nvml_ok;

static void atfork_prepare(void) { pthread_mutex_lock(&vgpu.slow_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&vgpu.slow_lock); }
static void atfork_child(void) {
    pthread_mutex_init(&vgpu.slow_lock, NULL);
    vgpu_region_after_fork_child();
    vgpu_mem_after_fork_child();
    vgpu_priority_after_fork_child();
}

static void init_state(void) {
    char err[PATH_MAX + 512];
    const char *dbg = getenv("LIBVGPU_DEBUG");
    vgpu_debug_on = dbg && *dbg && *dbg != '0';
#ifdef VGPU_TEST_HOOKS /* never in the shipped build: a user could hold the lock with it */
    const char *t = getenv("LIBVGPU_TEST_SLEEP_IN_LOCK_MS"); /* the update under the lock */
    const char *m = getenv("LIBVGPU_TEST_SLEEP_MID_UPDATE_MS"); /* the one without it */
    vgpu.test_locked_path = t != NULL;
    if (t || m) vgpu.test_sleep_in_lock_ms = (unsigned)atoi(t ? t : m);
    vgpu.test_hold_burst = getenv("LIBVGPU_TEST_HOLD_BURST_UNTIL"); /* after what the card allows */
#endif
    if (vgpu_config_load(&vgpu.cfg, err, sizeof(err)) != 0) {
        vgpu_log("invalid configuration: %s; CUDA is disabled until it is fixed", err);
        atomic_store(&vgpu.state, VGPU_BROKEN);
        return;
    }
    const struct vgpu_config *c = &vgpu.cfg;
    unsigned f = 0;
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        if (c->memory_bytes[i] != VGPU_UNLIMITED) f |= VGPU_F_MEMORY;
        if (c->cores_percent[i]) f |= VGPU_F_COMPUTE;
    }
    if (c->node_region_dir[0]) f |= VGPU_F_PRIORITY;
    int want_region = f || c->container_region[0] || c->activity_file[0];
    if (want_region && vgpu_region_open() == 0) f |= VGPU_F_REGION;
    if (want_region && !(f & VGPU_F_REGION)) { /* vgpu_region_open said why */
        atomic_store(&vgpu.state, VGPU_BROKEN);
        return;
    }
    vgpu.features = f;
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    atomic_store(&vgpu.state, VGPU_READY);
}

int vgpu_ensure_state(void) {
    int s = atomic_load_explicit(&vgpu.state, memory_order_acquire);
    if (VGPU_LIKELY(s != VGPU_UNINIT)) return s;
    pthread_once(&state_once, init_state);
    return atomic_load(&vgpu.state);
}

static void init_cuda(void) {
    resolve_lib(VGPU_LIB_CUDA);
    if (!lib_handle[VGPU_LIB_CUDA]) vgpu_log("the real libcuda.so.1 was not found");
}

int vgpu_ensure_cuda(void) {
    int s = vgpu_ensure_state();
    pthread_once(&cuda_once, init_cuda);
    if (s == VGPU_READY && lib_handle[VGPU_LIB_CUDA]) atomic_store(&vgpu_cuda_go, 1);
    return s;
}

CUresult vgpu_not_ready(void) {
    int s = vgpu_ensure_cuda();
    if (s != VGPU_READY) return CUDA_ERROR_NOT_INITIALIZED;
    return lib_handle[VGPU_LIB_CUDA] ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* Resolves the NVML rows without initialising NVML (for the NVML hooks themselves). */
static pthread_once_t nvml_resolve_once = PTHREAD_ONCE_INIT;
static void resolve_nvml_only(void) {
    if (!lib_handle[VGPU_LIB_NVML]) resolve_lib(VGPU_LIB_NVML);
}
int vgpu_resolve_nvml(void) {
    pthread_once(&nvml_resolve_once, resolve_nvml_only);
    return lib_handle[VGPU_LIB_NVML] ? 0 : -1;
}

static void init_nvml(void) {
    vgpu_resolve_nvml();
    nvmlInit_v2_fn init = REAL(nvmlInit_v2);
    nvml_ok = init && init() == NVML_SUCCESS;
}

int vgpu_ensure_nvml(void) {
    pthread_once(&nvml_once, init_nvml);
    return nvml_ok ? 0 : -1;
}

VGPU_HOT int vgpu_current_device(CUdevice *dev) {
    if (atomic_load_explicit(&vgpu.single_dev, memory_order_relaxed)) {
        *dev = 0;
        return 0;
    }
    cuCtxGetDevice_fn get = REAL(cuCtxGetDevice);
    if (!get || get(dev) != CUDA_SUCCESS || *dev < 0) {
        *dev = 0;
        return -1;
    }
    return 0;
}

int vgpu_device_uuid(int dev, char *out, size_t outlen) {
    cuDeviceGetUuid_fn get = REAL(cuDeviceGetUuid);
    CUuuid u;
    if (!get || get(&u, dev) != CUDA_SUCCESS) return -1;
    const unsigned char *b = (const unsigned char *)u.bytes;
    snprintf(out, outlen,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
    return 0;
}

/* ---- cuInit ------------------------------------------------------------------------------ */

VGPU_EXPORT CUresult cuInit(unsigned int flags) {
    CUresult rc = vgpu_not_ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuInit_fn real = REAL(cuInit);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    rc = real(flags);
    if (rc != CUDA_SUCCESS) return rc;
    if (!atomic_load(&vgpu.ndev)) {
        int n = 0;
        cuDeviceGetCount_fn count = REAL(cuDeviceGetCount);
        if (count && count(&n) == CUDA_SUCCESS && n > 0) {
            atomic_store(&vgpu.single_dev, n == 1);
            atomic_store(&vgpu.ndev, n);
        }
    }
    if (vgpu.features & VGPU_F_REGION) vgpu_region_claim_slot();
    return CUDA_SUCCESS;
}

/* ---- cuGetProcAddress ------------------------------------------------------------------- */

static int hook_by_real(void *fn) {
    for (int id = 0; id < H_COUNT; id++)
        if (vgpu_hooks[id].lib == VGPU_LIB_CUDA && vgpu_hooks[id].hook &&
            atomic_load_explicit(&vgpu_hooks[id].real, memory_order_relaxed) == fn)
            return id;
    return -1;
}

static int hook_by_name(const char *symbol, int version, cuuint64_t flags) {
    int best = -1, best_ptsz = -1;
    for (int id = 0; id < H_COUNT; id++) {
        const struct vgpu_hook *h = &vgpu_hooks[id];
        if (!h->base || !h->hook || strcmp(h->base, symbol) != 0 || h->since > version) continue;
        int *slot = h->ptsz ? &best_ptsz : &best;
        if (*slot < 0 || vgpu_hooks[*slot].since < h->since) *slot = id;
    }
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best_ptsz >= 0) return best_ptsz;
    return best;
}

static CUresult answer(const char *symbol, void **pfn, int version, cuuint64_t flags,
                       CUresult rc) {
    if (rc != CUDA_SUCCESS || !symbol || !pfn || !*pfn) return rc;
    int id = hook_by_real(*pfn);
    if (id < 0) id = hook_by_name(symbol, version, flags);
    if (id >= 0) *pfn = vgpu_hooks[id].hook;
    return rc;
}

VGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                                      cuuint64_t flags) {
    vgpu_ensure_cuda();
    cuGetProcAddress_fn real = REAL(cuGetProcAddress);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    return answer(symbol, pfn, version, flags, real(symbol, pfn, version, flags));
}

VGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                         cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *status) {
    vgpu_ensure_cuda();
    cuGetProcAddress_v2_fn real = REAL(cuGetProcAddress_v2);
    if (!real) {
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return cuGetProcAddress(symbol, pfn, version, flags);
    }
    return answer(symbol, pfn, version, flags, real(symbol, pfn, version, flags, status));
}
