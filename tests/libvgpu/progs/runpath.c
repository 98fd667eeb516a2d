/* Calls libouter's dlopen (which needs libouter's RUNPATH) and, as a control, tries the same
 * bare name itself (no RUNPATH here, so that one must fail). */
#include <dlfcn.h>
#include <stdio.h>

int outer_load(void);

int main(void) {
    int via_outer = outer_load();
    void *direct = dlopen("libinner.so", RTLD_NOW);
    printf("runpath outer_rc=%d direct_found=%d\n", via_outer, direct != NULL);
    return 0;
}
