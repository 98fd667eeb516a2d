/* Calls libouter's dlopen (which needs libouter's RUNPATH) and, as a control, tries the same
 * bare name itself (no RUNPATH here, so that one must fail). */
#include <dlfcn.h>
#include <stdio.h>

int outer_load(void);

int main(void) {
    void *direct = dlopen("libinner.so", RTLD_NOW); /* first: afterwards it is loaded anyway */
    int via_outer = outer_load();
    printf("runpath outer_rc=%d direct_found=%d\n", via_outer, direct != NULL);
    return 0;
}
