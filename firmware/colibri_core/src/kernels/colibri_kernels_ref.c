/*
 * Portable reference kernels (colibri_kernels.h): the linear dispatch, f32
 * weights and the element-wise kernels; plain C loops, f32 accumulation.
 * Every optimised backend is tested against these.
 */
#include <float.h>
#include <math.h>

#include "../colibri_kernels.h"
#include "../colibri_math.h"
#include "colibri_format.h"

/* ---- Linear layers: one dispatch on the weight dtype per token ---- */

/* y = v or y += s · v for one token; see colibri_matvec_*. */
static void matvec(const colibri_matrix *w, const float *x, const int8_t *xq, float a,
                   const float *b, int acc, float s, float *restrict y)
{
    /* An if-chain in the order the compiler lays out the F16 / I8 / F32
     * switch this was, I4 tested last: the older dtypes' paths compile as
     * before (their Cortex-M7 instruction counts are pinned by tests). */
    if (w->dtype == COLIBRI_DTYPE_F16) {
        colibri_matvec_f16(w, x, b, acc, s, y);
    } else if (w->dtype == COLIBRI_DTYPE_I8) {
        if (xq)
            colibri_matvec_q8q8(w, x, xq, a, b, acc, s, y);
        else
            colibri_matvec_q8(w, x, b, acc, s, y);
    } else if (w->dtype == COLIBRI_DTYPE_I4) {
        if (xq)
            colibri_matvec_q4q8(w, x, xq, a, b, acc, s, y);
        else
            colibri_matvec_q4(w, x, b, acc, s, y);
    } else { /* F32; weight dtypes are validated */
        colibri_matvec_f32(w, x, b, acc, s, y);
    }
}

void colibri_linear_ref(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w,
                    const float *b, const colibri_qrows *xq, float *restrict y)
{
    const size_t in = w->cols, out = w->rows;
    for (size_t i = 0; i < n; i++)
        matvec(w, x + (rows ? rows[i] : i) * in, xq ? xq->q + i * in : NULL, xq ? xq->a[i] : 0.0f,
               b, 0, 1.0f, y + i * out);
}

void colibri_linear_acc_ref(const float *x, size_t n, const colibri_matrix *w, const float *b,
                        const uint16_t *rows, const float *scale, const colibri_qrows *xq,
                        float *restrict y)
{
    const size_t in = w->cols, out = w->rows;
    for (size_t i = 0; i < n; i++)
        matvec(w, x + i * in, xq ? xq->q + i * in : NULL, xq ? xq->a[i] : 0.0f,
               b, 1, scale ? scale[i] : 1.0f, y + (rows ? rows[i] : i) * out);
}

/* The block form (INT8_BLOCKS): I8 and I4 weights only (validated); token
 * i's block scales are row i of xq->a [n, colibri_act_blocks(in)]. */
static void matvec_blocks(const colibri_matrix *w, const float *x, const int8_t *xq, const float *a,
                          const float *b, int acc, float s, float *restrict y)
{
    if (w->dtype == COLIBRI_DTYPE_I4)
        colibri_matvec_q4b(w, x, xq, a, b, acc, s, y);
    else
        colibri_matvec_q8b(w, x, xq, a, b, acc, s, y);
}

void colibri_linear_blocks_ref(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w,
                               const float *b, const colibri_qrows *xq, float *restrict y)
{
    const size_t in = w->cols, out = w->rows, nb = colibri_act_blocks(in);
    for (size_t i = 0; i < n; i++)
        matvec_blocks(w, x + (rows ? rows[i] : i) * in, xq->q + i * in, xq->a + i * nb, b, 0, 1.0f, y + i * out);
}

void colibri_linear_acc_blocks_ref(const float *x, size_t n, const colibri_matrix *w, const float *b,
                                   const uint16_t *rows, const float *scale, const colibri_qrows *xq,
                                   float *restrict y)
{
    const size_t in = w->cols, out = w->rows, nb = colibri_act_blocks(in);
    for (size_t i = 0; i < n; i++)
        matvec_blocks(w, x + i * in, xq->q + i * in, xq->a + i * nb, b, 1, scale ? scale[i] : 1.0f,
                      y + (rows ? rows[i] : i) * out);
}

void colibri_matvec_f32(const colibri_matrix *w, const float *x, const float *b,
                        int acc, float s, float *restrict y)
{
    const float *wo = w->data;
    const size_t in = w->cols, out = w->rows;
    for (size_t o = 0; o < out; o++, wo += in) {
        float sum = 0.0f;
        for (size_t k = 0; k < in; k++)
            sum += wo[k] * x[k];
        colibri_emit(y, o, sum, b, acc, s);
    }
}

static float sigmoid(float v)
{
    return 1.0f / (1.0f + colibri_expf(-v));
}

void colibri_activation_ref(float *x, size_t n, uint32_t kind)
{
    /* Constants: 1/√2 and √(2/π). */
    const float inv_sqrt2 = 0.70710678118654752f;
    const float sqrt_2_over_pi = 0.79788456080286536f;

    for (size_t i = 0; i < n; i++) {
        const float v = x[i];
        switch (kind) {
        case COLIBRI_ACT_RELU:
            x[i] = v < 0.0f ? 0.0f : v; /* NaN fails the test and stays NaN, as in PyTorch */
            break;
        case COLIBRI_ACT_GELU_ERF:
            x[i] = 0.5f * v * (1.0f + colibri_erff(v * inv_sqrt2));
            break;
        case COLIBRI_ACT_GELU_TANH:
            x[i] = 0.5f * v * (1.0f + colibri_tanhf(sqrt_2_over_pi * (v + 0.044715f * v * v * v)));
            break;
        case COLIBRI_ACT_SILU:
            x[i] = v * sigmoid(v);
            break;
        case COLIBRI_ACT_TANH:
            x[i] = colibri_tanhf(v);
            break;
        case COLIBRI_ACT_SIGMOID:
            x[i] = sigmoid(v);
            break;
        default: /* unreachable: activation kinds are validated */
            break;
        }
    }
}

void colibri_mul_ref(float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] *= y[i];
}

void colibri_add_ref(float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] += y[i];
}

void colibri_layernorm_ref(float *x, size_t rows, size_t n,
                           const float *gamma, const float *beta, float eps)
{
    for (size_t r = 0; r < rows; r++, x += n) {
        float mean = 0.0f, var = 0.0f;
        for (size_t i = 0; i < n; i++)
            mean += x[i];
        mean /= (float)n;
        for (size_t i = 0; i < n; i++)
            var += (x[i] - mean) * (x[i] - mean);
        var /= (float)n;
        /* Statistics beyond f32 (an overflowed or non-finite variance) make
         * the row NaN: x / inf would be a confident 0 (docs/model-format.md
         * "Numerics: non-finite values"). NaN already fails the test. */
        const float den = var <= FLT_MAX ? sqrtf(var + eps) : NAN;
        for (size_t i = 0; i < n; i++) {
            float v = (x[i] - mean) / den;
            if (gamma)
                v *= gamma[i];
            if (beta)
                v += beta[i];
            x[i] = v;
        }
    }
}

void colibri_rmsnorm_ref(float *x, size_t rows, size_t n, const float *gamma, float eps)
{
    for (size_t r = 0; r < rows; r++, x += n) {
        float ms = 0.0f;
        for (size_t i = 0; i < n; i++)
            ms += x[i] * x[i];
        ms /= (float)n;
        const float den = sqrtf(ms + eps);
        for (size_t i = 0; i < n; i++)
            x[i] = gamma ? x[i] / den * gamma[i] : x[i] / den;
    }
}

void colibri_softmax_f32(float *x, size_t n)
{
    /* The maximum only keeps exp() in range: a NaN it passes over still
     * makes its exp() and so the sum NaN, and every output with it; +inf
     * is the maximum and inf - inf is NaN. Both as PyTorch. */
    float max = x[0], sum = 0.0f;
    for (size_t i = 1; i < n; i++)
        if (x[i] > max)
            max = x[i];
    for (size_t i = 0; i < n; i++) {
        /* e^0 = 1 exactly (colibri_expf's value too): the maximum's term, and
         * every one equal to it, costs no exp. */
        const float d = x[i] - max;
        x[i] = d == 0.0f ? 1.0f : colibri_expf_as(d, 1);
        sum += x[i];
    }
    for (size_t i = 0; i < n; i++)
        x[i] /= sum;
}
