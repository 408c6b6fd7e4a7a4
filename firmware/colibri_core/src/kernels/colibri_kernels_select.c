/*
 * The kernel table (colibri_kernels.h): the reference kernels, and the
 * build's backend (colibri_backend.h) on top of them.
 */
#include "../colibri_kernels.h"
#include "colibri_backend.h"

void colibri_kernels_reference(colibri_kernels *k)
{
    k->name = "reference";
    k->linear = colibri_linear_ref;
    k->linear_acc = colibri_linear_acc_ref;
    k->quantize_rows = colibri_quantize_rows_ref;
    k->quantize_blocks = colibri_quantize_blocks_ref;
    k->linear_blocks = colibri_linear_blocks_ref;
    k->linear_acc_blocks = colibri_linear_acc_blocks_ref;
    k->activation = colibri_activation_ref;
    k->mul = colibri_mul_ref;
    k->add = colibri_add_ref;
    k->layernorm = colibri_layernorm_ref;
    k->rmsnorm = colibri_rmsnorm_ref;
    k->embed = colibri_embed_ref;
    k->rope = colibri_rope_ref;
    k->attend = colibri_attend_ref;
}

void colibri_kernels_optimised(colibri_kernels *k)
{
    colibri_kernels_reference(k);
#if defined(COLIBRI_BACKEND_X86)
    colibri_kernels_x86(k);
#elif defined(COLIBRI_BACKEND_NEON)
    colibri_kernels_neon(k);
#elif defined(COLIBRI_BACKEND_CMSIS)
    colibri_kernels_cmsis(k);
#elif defined(COLIBRI_BACKEND_RVV)
    colibri_kernels_rvv(k);
#endif
}
