/*
 * sneakyprog HOW [MIB]: a program linked to libsneaky.so (which links libcuda.so.1) that
 * allocates through the driver entry points libsneaky leads to (HOW: handle, getproc, next,
 * rawdlopen; see sneaky.c; vsym: dlvsym on its handle, by the versions a symbol could have),
 * three times MIB (600) MiB, and prints "sneaky allocs=A,B,C total=T" (T: the total cuMemGetInfo reports through
 * the same route), or "sneaky missing=1" when the route gives no entry point.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../../libvgpu/src/cuda_api.h"

void *sneaky_next(const char *);
void *sneaky_rawdlopen(const char *);

static const char *how;
static void *self;

static void *entry(const char *name, const char *base) {
    if (!strcmp(how, "handle")) return dlsym(self, name);
    if (!strcmp(how, "getproc")) {
        cuGetProcAddress_v2_fn gp = (cuGetProcAddress_v2_fn)dlsym(self, "cuGetProcAddress_v2");
        void *fn = NULL;
        CUdriverProcAddressQueryResult st;
        return gp && gp(base, &fn, 12040, 0, &st) == CUDA_SUCCESS ? fn : NULL;
    }
    if (!strcmp(how, "next")) return sneaky_next(name);
    if (!strcmp(how, "vsym")) {
        static const char *const versions[] = {"libcuda.so.1", "GLIBC_2.2.5", "GLIBC_2.34", "Base"};
        void *p = NULL;
        for (int i = 0; i < 4 && !p; i++) p = dlvsym(self, name, versions[i]);
        return p;
    }
    return sneaky_rawdlopen(name);
}

int main(int argc, char **argv) {
    how = argc > 1 ? argv[1] : "handle";
    self = dlopen("libsneaky.so", RTLD_NOW | RTLD_NOLOAD);
    cuInit_fn init = (cuInit_fn)entry("cuInit", "cuInit");
    cuDevicePrimaryCtxRetain_fn retain =
        (cuDevicePrimaryCtxRetain_fn)entry("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))dlsym(self, "cuCtxSetCurrent");
    cuMemAlloc_v2_fn alloc = (cuMemAlloc_v2_fn)entry("cuMemAlloc_v2", "cuMemAlloc");
    cuMemGetInfo_v2_fn info = (cuMemGetInfo_v2_fn)entry("cuMemGetInfo_v2", "cuMemGetInfo");
    if (!self || !init || !retain || !set || !alloc || !info) {
        printf("sneaky missing=1\n");
        return 2;
    }
    CUcontext ctx = NULL;
    if (init(0) || retain(&ctx, 0) || set(ctx)) return 3;
    int rc[3];
    for (int i = 0; i < 3; i++) {
        CUdeviceptr p = 0;
        rc[i] = alloc(&p, (unsigned long long)(argc > 2 ? atoi(argv[2]) : 600) << 20);
    }
    size_t free_b = 0, total = 0;
    info(&free_b, &total);
    printf("sneaky allocs=%d,%d,%d total=%zu\n", rc[0], rc[1], rc[2], total);
    return 0;
}
