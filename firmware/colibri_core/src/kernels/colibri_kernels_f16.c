/*
 * f16 weights, f32 activations (docs/model-format.md "Quantised weights"):
 * each weight is widened to f32 (colibri_f16_to_f32, exact) and the row is
 * computed exactly as for f32 weights, summing in index order.
 */
#include "../colibri_kernels.h"

void colibri_matvec_f16(const colibri_matrix *w, const float *x, const float *b,
                        int acc, float s, float *restrict y)
{
    const uint16_t *wo = w->data;
    const size_t in = w->cols, out = w->rows;
    for (size_t o = 0; o < out; o++, wo += in) {
        float sum = 0.0f;
        for (size_t k = 0; k < in; k++)
            sum += colibri_f16_to_f32(wo[k]) * x[k];
        colibri_emit(y, o, sum, b, acc, s);
    }
}
