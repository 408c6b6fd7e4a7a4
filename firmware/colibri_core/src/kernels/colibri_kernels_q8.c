/*
 * int8 weights Q [out, in] with per-output-channel scales s and the optional
 * sparse f16 compensation E (W ≈ Q·S + E), docs/model-format.md "Quantised
 * weights". Two paths, both following the format's arithmetic literally:
 *
 *   f32 activations:  v_o = (Σ_j (float)Q_oj · x_j) · s_o + Σ_E e · x_j + b_o
 *   int8 activations: v_o = (float)(Σ_j Q_oj · xq_j) · (s_o · a) + Σ_E e · x_j + b_o
 *
 * Sums run in index order, f32 (or int32 for Q·xq), then the scale, then the
 * E entries of the row in storage order, then the bias.
 */
#include <math.h>

#include "../colibri_kernels.h"

void colibri_matvec_q8(const colibri_matrix *w, const float *x, const float *b,
                       int acc, float s, float *restrict y)
{
    const int8_t *qo = w->data;
    const size_t in = w->cols, out = w->rows;
    for (size_t o = 0; o < out; o++, qo += in) {
        float sum = 0.0f;
        for (size_t k = 0; k < in; k++)
            sum += (float)qo[k] * x[k];
        colibri_emit(y, o, colibri_q8_compensate(w, o, x, sum * colibri_q8_scale(w, o)), b, acc, s);
    }
}

/*
 * Σ a[k] · b[k] over int8 vectors, accumulated in 32 bits.
 *
 * Kept as one small function so a Cortex-M7 build can replace it with the
 * DSP extension: sign-extend four int8 of each operand into two pairs of
 * int16 (SXTB16, and SXTB16 of the operand rotated by 8), then two SMLAD per
 * four products (dual 16 x 16 multiply, both added to a 32-bit accumulator),
 * as CMSIS-NN's arm_nn_read_q7x4 + __SXTB16 + __SMLAD do. The portable form
 * is the same arithmetic: int16 products (|Q·xq| <= 128 · 127 fits in 16
 * bits signed pairs) summed into 32 bits. The sum wraps modulo 2^32 like
 * SMLAD (and numpy int32) instead of overflowing, which is only possible for
 * rows longer than 132 104 entries; done in uint32 so it is never undefined.
 */
static int32_t dot_i8(const int8_t *a, const int8_t *b, size_t n)
{
    uint32_t acc = 0;
    for (size_t k = 0; k < n; k++)
        acc += (uint32_t)((int32_t)(int16_t)a[k] * (int16_t)b[k]);
    return (int32_t)acc;
}

void colibri_matvec_q8q8(const colibri_matrix *w, const float *x, const int8_t *xq, float a,
                         const float *b, int acc, float s, float *restrict y)
{
    const int8_t *qo = w->data;
    const size_t in = w->cols, out = w->rows;
    for (size_t o = 0; o < out; o++, qo += in) {
        const int32_t sum = dot_i8(qo, xq, in);
        colibri_emit(y, o, colibri_q8_compensate(w, o, x, (float)sum * (colibri_q8_scale(w, o) * a)), b, acc, s);
    }
}

void colibri_quantize_rows_ref(const float *x, const uint16_t *rows, size_t n, size_t in,
                           int8_t *restrict q, float *restrict a)
{
    for (size_t i = 0; i < n; i++, q += in) {
        const float *xi = x + (rows ? rows[i] : i) * in;
        float m = 0.0f, nonfinite = 0.0f;
        for (size_t k = 0; k < in; k++) {
            const float v = fabsf(xi[k]);
            if (v > m)
                m = v;
            nonfinite += v * 0.0f; /* stays 0 unless some v is NaN or inf */
        }
        if (nonfinite != 0.0f || m == 0.0f) {
            /* All zeros: a = 0. A NaN or inf has no int8 value and no finite
             * scale: a = NaN (what nonfinite holds then) makes every output
             * of the row NaN instead of a made-up number. */
            for (size_t k = 0; k < in; k++)
                q[k] = 0;
            a[i] = nonfinite;
            continue;
        }
        /* 127 / m overflows for m below 2^-121; for such tiny rows x and m
         * are first scaled by 2^100, exactly (powers of two), which leaves
         * every other row's products unchanged (s = 1). */
        const float s = m < 0x1p-100f ? 0x1p100f : 1.0f;
        const float inv = 127.0f / (m * s);
        for (size_t k = 0; k < in; k++) {
            q[k] = colibri_quantize_one(xi[k], s, inv);
        }
        a[i] = m / 127.0f;
    }
}

/* ---- The block form (INT8_BLOCKS): a scale per COLIBRI_ACT_BLOCK columns ---- */

void colibri_quantize_blocks_ref(const float *x, const uint16_t *rows, size_t n, size_t in,
                                 int8_t *restrict q, float *restrict a)
{
    colibri_quantize_blocks_with(colibri_quantize_rows_ref, x, rows, n, in, q, a);
}

void colibri_matvec_q8b(const colibri_matrix *w, const float *x, const int8_t *xq, const float *a,
                        const float *b, int acc, float s, float *restrict y)
{
    const int8_t *qo = w->data;
    const size_t in = w->cols, out = w->rows, nb = colibri_act_blocks(in);
    for (size_t o = 0; o < out; o++, qo += in) {
        float v = 0.0f;
        for (size_t blk = 0; blk < nb; blk++) {
            const size_t c = blk * COLIBRI_ACT_BLOCK, len = in - c < COLIBRI_ACT_BLOCK ? in - c : COLIBRI_ACT_BLOCK;
            v += (float)dot_i8(qo + c, xq + c, len) * a[blk];
        }
        colibri_emit(y, o, colibri_q8_compensate(w, o, x, v * colibri_q8_scale(w, o)), b, acc, s);
    }
}
