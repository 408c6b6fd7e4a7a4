/*
 * Optimised backend: 32-bit Arm with the DSP extension (Cortex-M4/M7): FPU-unrolled f32, SMLAD/SXTB16 int8.
 * Compiled to nothing unless colibri_backend.h selects it.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_CMSIS)

void colibri_kernels_cmsis(colibri_kernels *k)
{
    (void)k; /* no kernel of this backend yet: the reference kernels stand */
}

#endif /* COLIBRI_BACKEND_CMSIS */
