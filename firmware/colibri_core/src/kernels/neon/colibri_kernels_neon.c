/*
 * Optimised backend: AArch64 NEON (ARMv8.0 baseline; SDOT and fp16 arithmetic where the CPU has them).
 * Compiled to nothing unless colibri_backend.h selects it.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_NEON)

void colibri_kernels_neon(colibri_kernels *k)
{
    (void)k; /* no kernel of this backend yet: the reference kernels stand */
}

#endif /* COLIBRI_BACKEND_NEON */
