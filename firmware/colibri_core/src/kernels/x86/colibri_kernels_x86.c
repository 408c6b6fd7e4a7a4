/*
 * Optimised backend: x86-64: AVX2, FMA and F16C (AVX-512 where it pays), chosen by cpuid in colibri_init.
 * Compiled to nothing unless colibri_backend.h selects it.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_X86)

void colibri_kernels_x86(colibri_kernels *k)
{
    (void)k; /* no kernel of this backend yet: the reference kernels stand */
}

#endif /* COLIBRI_BACKEND_X86 */
