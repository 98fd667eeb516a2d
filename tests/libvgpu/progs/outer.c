/* libouter.so has RUNPATH $ORIGIN/inner and dlopens libinner.so by bare name: glibc finds it
 * through the RUNPATH of the *caller* of dlopen, which the shim's dlopen must preserve. */
#include <dlfcn.h>
#include <stdio.h>

int outer_load(void) {
    void *h = dlopen("libinner.so", RTLD_NOW);
    if (!h) {
        printf("outer dlopen failed: %s\n", dlerror());
        return 1;
    }
    int (*answer)(void) = (int (*)(void))dlsym(h, "inner_answer");
    return answer && answer() == 42 ? 0 : 1;
}
