/*
 * int4 weights Q [out, in], two per byte, with one f16 scale per group of
 * 1 << q4_group_log2 columns and the optional sparse f16 compensation E
 * (W ≈ Q·S + E), docs/model-format.md "Quantised weights: I4 with
 * Q4_PARAMS". Two paths, both following the format's arithmetic literally:
 *
 *   f32 activations:  v_o = Σ_g (Σ_{c in g} (float)Q_oc · x_c) · s_og
 *   int8 activations: v_o = (Σ_g (float)(Σ_{c in g} Q_oc · xq_c) · s_og) · a
 *
 * then + Σ_E e · x_c (the unquantised x) in storage order, + the companion's
 * bias, + the layer's bias. Each group's sum runs in column order, f32 (or
 * int32 for Q·xq: at most 256 · 8 · 127 in magnitude, never near overflow),
 * the groups in order; no FMA (the engine builds with -ffp-contract=off).
 * Every backend's int8-activation kernel gives these bits.
 */
#include "../colibri_kernels.h"

/* The scale of a group: f16 bits validated ±0 or normal, widened exactly. */
static float group_scale(const uint16_t *scales, size_t g)
{
    return colibri_q8_half(scales[g]);
}

/* Columns [c, end) of a row, c even: Σ (float)Q_c · x_c in column order,
 * two nibbles (one byte) a step, the odd last column of the row alone. */
static float group_dot_f32(const uint8_t *row, const float *x, size_t c, size_t end)
{
    float p = 0.0f;
    for (; c + 2 <= end; c += 2) {
        const uint8_t byte = row[c >> 1];
        p += (float)colibri_q4_nibble(&byte, 0) * x[c];
        p += (float)colibri_q4_nibble(&byte, 1) * x[c + 1];
    }
    if (c < end)
        p += (float)colibri_q4_nibble(row, c) * x[c];
    return p;
}

static int32_t group_dot_i8(const uint8_t *row, const int8_t *xq, size_t c, size_t end)
{
    int32_t p = 0;
    for (; c < end; c++)
        p += colibri_q4_nibble(row, c) * (int32_t)xq[c];
    return p;
}

void colibri_matvec_q4(const colibri_matrix *w, const float *x, const float *b,
                       int acc, float s, float *restrict y)
{
    const size_t in = w->cols, out = w->rows, group = (size_t)1 << w->q4_group_log2, G = w->q4_groups;
    for (size_t o = 0; o < out; o++) {
        const uint8_t *row = colibri_q4_row(w, o);
        const uint16_t *scales = colibri_q4_scales(w, o);
        float v = 0.0f;
        for (size_t g = 0; g < G; g++) {
            const size_t c = g * group, end = c + group < in ? c + group : in;
            v += group_dot_f32(row, x, c, end) * group_scale(scales, g);
        }
        colibri_emit(y, o, colibri_q4_epilogue(w, o, x, v), b, acc, s);
    }
}

void colibri_matvec_q4q8(const colibri_matrix *w, const float *x, const int8_t *xq, float a,
                         const float *b, int acc, float s, float *restrict y)
{
    const size_t in = w->cols, out = w->rows, group = (size_t)1 << w->q4_group_log2, G = w->q4_groups;
    for (size_t o = 0; o < out; o++) {
        const uint8_t *row = colibri_q4_row(w, o);
        const uint16_t *scales = colibri_q4_scales(w, o);
        float v = 0.0f;
        for (size_t g = 0; g < G; g++) {
            const size_t c = g * group, end = c + group < in ? c + group : in;
            v += (float)group_dot_i8(row, xq, c, end) * group_scale(scales, g);
        }
        colibri_emit(y, o, colibri_q4_epilogue(w, o, x, v * a), b, acc, s);
    }
}

void colibri_matvec_q4b(const colibri_matrix *w, const float *x, const int8_t *xq, const float *a,
                        const float *b, int acc, float s, float *restrict y)
{
    const size_t in = w->cols, out = w->rows, log2 = w->q4_group_log2;
    const size_t unit = log2 < 5 ? (size_t)1 << log2 : COLIBRI_ACT_BLOCK; /* both powers of two */
    for (size_t o = 0; o < out; o++) {
        const uint8_t *row = colibri_q4_row(w, o);
        const uint16_t *scales = colibri_q4_scales(w, o);
        float v = 0.0f;
        for (size_t c = 0; c < in; c += unit) {
            const size_t end = c + unit < in ? c + unit : in;
            v += (float)group_dot_i8(row, xq, c, end) * (group_scale(scales, c >> log2) * a[c / COLIBRI_ACT_BLOCK]);
        }
        colibri_emit(y, o, colibri_q4_epilogue(w, o, x, v), b, acc, s);
    }
}
