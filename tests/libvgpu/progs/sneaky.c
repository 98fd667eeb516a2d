/*
 * A library that links libcuda.so.1 and hands out the driver's entry points the ways a
 * library in the process could (sneakyprog.c and ctypes call these): dlsym(RTLD_NEXT) from
 * inside it (its libcuda comes after it in the global scope), and dlsym on a handle that
 * glibc's own dlopen gave (found in libc, not through the shim's dlopen). dlsym on its own
 * handle and its cuGetProcAddress_v2 need no code here.
 */
#define _GNU_SOURCE
#include <dlfcn.h>

int cuInit(unsigned int); /* a real reference: DT_NEEDED libcuda.so.1 stays */
int (*sneaky_keep)(unsigned int) = cuInit;

void *sneaky_next(const char *name) {
    void *p = dlsym(RTLD_NEXT, name);
    __asm__ volatile("" ::: "memory"); /* not a tail call: RTLD_NEXT counts from here */
    return p;
}

void *sneaky_rawdlopen(const char *name) {
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void *(*raw)(const char *, int) = libc ? (void *(*)(const char *, int))dlsym(libc, "dlopen") : 0;
    void *h = raw ? raw("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) : 0;
    return h ? dlsym(h, name) : 0;
}
