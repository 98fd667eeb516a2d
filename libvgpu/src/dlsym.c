/*
 * dlsym.c: the driver's entry points reach code in the process only as the shim's hooks,
 * whichever way they are looked up.
 *
 * The dlopen redirect (hooks.c) covers handles to the driver itself. A library that merely
 * links libcuda is another way in: dlsym on its handle searches its dependencies (the real
 * driver), dlsym(RTLD_NEXT) from inside it finds the driver after it, and glibc's own dlopen
 * (looked up in libc) hands out real driver handles. So the shim exports dlsym: for a name the
 * hook table hooks (cu*, nvml*), a lookup whose answer is a function of a driver library (by
 * identity, whatever its file is called) answers with the hook. Every other name is a sibling
 * call into glibc's dlsym: glibc sees the caller's own return address, so RTLD_NEXT and
 * RTLD_DEFAULT keep their meaning for the caller, nothing is allocated, nothing initialised
 * (libraries call dlsym from their constructors, allocators from their first malloc).
 *
 * glibc's dlsym is found with dlvsym (which the shim leaves alone) by its version; RTLD_NEXT
 * for a hooked name is answered by walking the objects after the caller and reading each
 * one's dynamic symbol table (a dependency's link map is no dlsym handle).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <string.h>

#include "vgpu.h"

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn _Atomic glibc_dlsym_ptr;

/* The path every dlsym takes is not instrumented in the sanitizer build: the sanitizer's own
 * start-up looks its interceptors up with dlsym before its shadow memory exists. */
#define UNINSTRUMENTED __attribute__((no_sanitize_address))

static __attribute__((noinline)) UNINSTRUMENTED dlsym_fn resolve_glibc_dlsym(void) {
    /* the default version first (GLIBC_2.34 since dlsym moved into libc), then the older
     * ones per architecture (x86_64, aarch64, i386) */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17",
                                           "GLIBC_2.27", "GLIBC_2.2", "GLIBC_2.0"};
    dlsym_fn f = NULL;
    for (size_t i = 0; !f && i < sizeof(versions) / sizeof(versions[0]); i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (!f) { /* another version: libc's (or an old glibc's libdl's) own symbol table */
        Dl_info di;
        struct link_map *lm = NULL;
        if (dladdr1((void *)&resolve_glibc_dlsym, &di, (void **)&lm, RTLD_DL_LINKMAP))
            for (; lm && !f; lm = lm->l_next) {
                const char *slash = lm->l_name ? strrchr(lm->l_name, '/') : NULL;
                const char *file = slash ? slash + 1 : lm->l_name ? lm->l_name : "";
                if (!strcmp(file, "libc.so.6") || !strcmp(file, "libdl.so.2"))
                    f = (dlsym_fn)vgpu_object_symbol(lm, "dlsym");
            }
    }
    atomic_store_explicit(&glibc_dlsym_ptr, f, memory_order_release);
    return f;
}

static inline UNINSTRUMENTED dlsym_fn glibc_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&glibc_dlsym_ptr, memory_order_acquire);
    return VGPU_LIKELY(f != NULL) ? f : resolve_glibc_dlsym();
}

void *vgpu_dlsym(void *handle, const char *name) {
    dlsym_fn f = glibc_dlsym();
    return f ? f(handle, name) : NULL;
}

/* ---- a loaded object's own dynamic symbols ----------------------------------------------- */

static uint32_t gnu_hash(const char *s) {
    uint32_t h = 5381;
    for (; *s; s++) h = h * 33 + (unsigned char)*s;
    return h;
}

static uint32_t sysv_hash(const char *s) {
    uint32_t h = 0;
    for (; *s; s++) {
        h = (h << 4) + (unsigned char)*s;
        h ^= (h >> 24) & 0xf0;
    }
    return h & 0x0fffffff;
}

/* The address of name if the object lm itself defines it (not its dependencies), else NULL. */
void *vgpu_object_symbol(const struct link_map *lm, const char *name) {
    if (!lm || !lm->l_ld) return NULL;
    ElfW(Addr) base = lm->l_addr, symtab = 0, strtab = 0, gnu = 0, sysv = 0;
    for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; d++) {
        ElfW(Addr) p = d->d_un.d_ptr;
        p = p < base ? base + p : p; /* glibc relocates these in place, except read-only ones */
        if (d->d_tag == DT_SYMTAB) symtab = p;
        else if (d->d_tag == DT_STRTAB) strtab = p;
        else if (d->d_tag == DT_GNU_HASH) gnu = p;
        else if (d->d_tag == DT_HASH) sysv = p;
    }
    if (!symtab || !strtab || (!gnu && !sysv)) return NULL;
    const ElfW(Sym) *sym = (const ElfW(Sym) *)symtab;
    const char *str = (const char *)strtab;
    if (gnu) {
        const uint32_t *h = (const uint32_t *)gnu;
        uint32_t nbuckets = h[0], symoffset = h[1], bloom_size = h[2], want = gnu_hash(name);
        const ElfW(Addr) *bloom = (const ElfW(Addr) *)(h + 4);
        const uint32_t *buckets = (const uint32_t *)(bloom + bloom_size);
        const uint32_t *chain = buckets + nbuckets;
        if (!nbuckets) return NULL;
        for (uint32_t i = buckets[want % nbuckets]; i >= symoffset; i++) {
            uint32_t hv = chain[i - symoffset];
            if ((hv | 1) == (want | 1) && sym[i].st_shndx != SHN_UNDEF &&
                strcmp(str + sym[i].st_name, name) == 0)
                return (void *)(base + sym[i].st_value);
            if (hv & 1) break;
        }
        return NULL;
    }
    const uint32_t *h = (const uint32_t *)sysv;
    uint32_t nbucket = h[0];
    const uint32_t *bucket = h + 2, *chain = bucket + nbucket;
    if (!nbucket) return NULL;
    for (uint32_t i = bucket[sysv_hash(name) % nbucket]; i; i = chain[i])
        if (sym[i].st_shndx != SHN_UNDEF && strcmp(str + sym[i].st_name, name) == 0)
            return (void *)(base + sym[i].st_value);
    return NULL;
}

/* Which driver library lm is (VGPU_LIB_*), by what it defines itself, or -1 (also for
 * libvgpu.so, which defines the same names). */
int vgpu_driver_object(const struct link_map *lm) {
    static const char *const marks[VGPU_LIB_COUNT][2] = {
        {"cuInit", "cuLaunchKernel"},
        {"nvmlInit_v2", "nvmlDeviceGetHandleByIndex_v2"},
    };
    Dl_info self;
    struct link_map *own = NULL;
    if (!lm || (dladdr1((void *)&vgpu_hooks, &self, (void **)&own, RTLD_DL_LINKMAP) && own == lm))
        return -1;
    for (int lib = 0; lib < VGPU_LIB_COUNT; lib++)
        if (vgpu_object_symbol(lm, marks[lib][0]) && vgpu_object_symbol(lm, marks[lib][1]))
            return lib;
    return -1;
}

/* ---- the lookup ------------------------------------------------------------------------- */

static inline UNINSTRUMENTED int same(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

/* The row whose hooked symbol is called name, or -1. Only cu* and nvml* names get this far. */
static UNINSTRUMENTED int hooked(const char *name) {
    for (int id = 0; id < H_COUNT; id++)
        if (vgpu_hooks[id].hook && same(vgpu_hooks[id].name, name)) return id;
    return -1;
}

static void *as_hook(void *p, int id) {
    Dl_info di;
    struct link_map *lm = NULL;
    if (p && dladdr1(p, &di, (void **)&lm, RTLD_DL_LINKMAP) && vgpu_driver_object(lm) >= 0)
        return vgpu_hooks[id].hook;
    return p;
}

/* dlsym(RTLD_NEXT, name) for the object that called from `caller`: the first object after it
 * (in load order, which is the global scope's for the objects loaded at start) defining name. */
static void *next_after(const void *caller, const char *name) {
    Dl_info di;
    struct link_map *lm = NULL;
    if (!dladdr1(caller, &di, (void **)&lm, RTLD_DL_LINKMAP) || !lm) return NULL;
    for (lm = lm->l_next; lm; lm = lm->l_next) {
        void *p = vgpu_object_symbol(lm, name);
        if (p) return p;
    }
    return NULL;
}

static __attribute__((noinline)) void *driver_dlsym(void *handle, const char *name,
                                                    const void *caller, int id) {
    void *p = handle == RTLD_NEXT ? next_after(caller, name) : vgpu_dlsym(handle, name);
    return as_hook(p, id);
}

static inline UNINSTRUMENTED int maybe_hooked(const char *name) {
    return name && ((name[0] == 'c' && name[1] == 'u') ||
                    (name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l'));
}

/* Sibling calls are what keeps the caller's return address for glibc: asked for at every
 * optimisation level (the sanitizer build is -O1; clang makes them from -O1 on). */
#if defined(__clang__)
#define VGPU_SIBLING_CALLS
#else
#define VGPU_SIBLING_CALLS __attribute__((optimize("optimize-sibling-calls")))
#endif
VGPU_EXPORT VGPU_SIBLING_CALLS UNINSTRUMENTED void *dlsym(void *handle, const char *name) {
    if (VGPU_UNLIKELY(maybe_hooked(name))) {
        int id = hooked(name);
        if (id >= 0) return driver_dlsym(handle, name, __builtin_return_address(0), id);
    }
    return glibc_dlsym()(handle, name);
}
