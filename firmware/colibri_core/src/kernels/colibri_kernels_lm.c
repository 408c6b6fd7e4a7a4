/*
 * Reference kernels of token models (docs/lm.md): the embedding gather,
 * RoPE's rotation and one head's causal attention over the KV cache.
 * Plain C in index order, f32, no FMA, as the other reference kernels.
 */
#include "../colibri_kernels.h"
#include "../colibri_math.h"
#include "colibri_format.h"

void colibri_embed_ref(const colibri_matrix *table, const int32_t *tokens, size_t n, float *restrict y)
{
    const size_t d = table->cols;
    for (size_t i = 0; i < n; i++, y += d) {
        const size_t r = (size_t)tokens[i];
        switch (table->dtype) {
        case COLIBRI_DTYPE_F32:
            memcpy(y, (const float *)table->data + r * d, d * sizeof *y);
            break;
        case COLIBRI_DTYPE_F16: {
            const uint16_t *row = (const uint16_t *)table->data + r * d;
            for (size_t j = 0; j < d; j++)
                y[j] = colibri_f16_to_f32(row[j]);
            break;
        }
        default: { /* I8: W ≈ Q·S + E, row r: Q[r, j]·s_r, plus E's entries of row r */
            const int8_t *row = (const int8_t *)table->data + r * d;
            const float s = colibri_q8_scale(table, r);
            for (size_t j = 0; j < d; j++)
                y[j] = (float)row[j] * s;
            uint32_t k, end;
            colibri_q8_terms(table, r, &k, &end);
            for (; k < end; k++)
                y[colibri_q8_term_col(table, k)] += colibri_q8_value(colibri_q8_term_bits(table, k));
            break;
        }
        }
    }
}

void colibri_rope_ref(float *x, size_t heads, size_t hd, const float *cos, const float *sin)
{
    const size_t half = hd / 2;
    for (size_t h = 0; h < heads; h++, x += hd)
        for (size_t j = 0; j < half; j++) {
            const float a = x[j], b = x[j + half];
            x[j] = a * cos[j] - b * sin[j];
            x[j + half] = b * cos[j] + a * sin[j];
        }
}

static float cached(const void *row, size_t j, int f16)
{
    return f16 ? colibri_f16_to_f32(((const uint16_t *)row)[j]) : ((const float *)row)[j];
}

void colibri_attend_ref(const float *q, const void *k, const void *v, size_t stride, size_t len, size_t hd,
                        int f16, float scale, float *scores, float *out)
{
    const size_t elem = f16 ? 2u : 4u;
    for (size_t t = 0; t < len; t++) {
        const void *kt = (const uint8_t *)k + t * stride * elem;
        float dot = 0.0f;
        for (size_t j = 0; j < hd; j++)
            dot += q[j] * cached(kt, j, f16);
        scores[t] = dot * scale;
    }
    colibri_softmax_f32(scores, len);
    /* q is dead from here on: out may be q. */
    for (size_t j = 0; j < hd; j++)
        out[j] = 0.0f;
    for (size_t t = 0; t < len; t++) {
        const void *vt = (const uint8_t *)v + t * stride * elem;
        const float p = scores[t];
        for (size_t j = 0; j < hd; j++)
            out[j] += p * cached(vt, j, f16);
    }
}
