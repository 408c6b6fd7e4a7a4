#include "../../colibri_kernels.h"
#include "../colibri_backend.h"
#if defined(COLIBRI_BACKEND_RVV)
#include <riscv_vector.h>
void colibri_kernels_rvv(colibri_kernels *k){ k->name="riscv rvv"; }
#endif
