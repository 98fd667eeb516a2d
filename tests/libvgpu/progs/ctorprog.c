/* Loads ctorlib (linked, or with dlopen when given "dlopen") and prints what its constructor
 * saw; then allocates through the shim to show the process works normally afterwards. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

const char *ctor_report(void) __attribute__((weak)); /* absent when not linked */
typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*retain_fn)(void **, int);
typedef int (*set_fn)(void *);

int main(int argc, char **argv) {
    const char *(*report)(void) = ctor_report;
    if (argc > 1 && strcmp(argv[1], "dlopen") == 0) {
        void *lib = dlopen("libctor.so", RTLD_NOW);
        if (!lib) {
            printf("dlopen libctor.so failed: %s\n", dlerror());
            return 1;
        }
        report = (const char *(*)(void))dlsym(lib, "ctor_report");
    }
    printf("%s\n", report());
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    void *ctx = NULL;
    unsigned long long p = 0;
    int rc = ((retain_fn)dlsym(h, "cuDevicePrimaryCtxRetain"))(&ctx, 0);
    if (!rc) rc = ((set_fn)dlsym(h, "cuCtxSetCurrent"))(ctx);
    if (!rc) rc = ((alloc_fn)dlsym(h, "cuMemAlloc_v2"))(&p, 1 << 20);
    printf("after alloc_rc=%d\n", rc);
    return 0;
}
