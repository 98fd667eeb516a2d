/*
 * A library that uses dlopen/dlsym from its constructor, as profilers, MPI stacks and the
 * CUDA runtime's loaders do. Under a shim with a global dlsym override this is where
 * recursion and deadlocks happen; under libvgpu it must just work, and the pointer it gets
 * from the libcuda handle must be the shim's hook. Its constructor also calls cuInit, so the
 * shim initialises while the dynamic loader's lock is held.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int (*init_fn)(unsigned int);
static char report[512];

static const char *lib_of(void *p) {
    Dl_info i;
    if (!p || !dladdr(p, &i) || !i.dli_fname) return "none";
    const char *slash = strrchr(i.dli_fname, '/');
    return slash ? slash + 1 : i.dli_fname;
}

__attribute__((constructor)) static void ctor(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *alloc = h ? dlsym(h, "cuMemAlloc_v2") : NULL;
    void *next_malloc = dlsym(RTLD_NEXT, "malloc");
    void *any_init = dlsym(RTLD_DEFAULT, "cuInit");
    init_fn init = h ? (init_fn)dlsym(h, "cuInit") : NULL;
    int rc = init ? init(0) : -1;
    snprintf(report, sizeof(report), "ctor alloc_lib=%s init_lib=%s malloc=%d cuinit_rc=%d",
             lib_of(alloc), lib_of(any_init), next_malloc != NULL, rc);
}

const char *ctor_report(void) { return report; }
