/*
 * I4 weight matrices for the kernel tests, built directly (no image): random
 * nibbles, f16 group scales, an optional f16 companion bias and compensation
 * E, wired into a colibri_matrix as the plan's weight() does (the seam in
 * colibri_kernels.h). Also an independent double-precision evaluation of one
 * output row, decoding nibbles and f16 by its own arithmetic, so the
 * reference kernels are checked against the format's definition and not
 * against themselves. Header-only: the host driver (colibri_q4_test.c) and
 * the Cortex-M7 one (cm7/kernel_test.c) share it, each with its allocator.
 */
#ifndef COLIBRI_Q4_CASES_H
#define COLIBRI_Q4_CASES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "colibri_format.h"
#include "colibri_kernels.h"
#include "colibri_rng.h"

typedef struct q4_rng {
    uint64_t state;
} q4_rng;

static inline uint64_t q4_next(q4_rng *r)
{
    return colibri_splitmix64(&r->state);
}

static inline size_t q4_below(q4_rng *r, size_t n)
{
    return (size_t)(q4_next(r) % n);
}

static inline float q4_unit(q4_rng *r) /* [-1, 1) */
{
    return (float)((double)(q4_next(r) >> 40) / (double)(1u << 23) - 1.0);
}

/* f16 bits of a normal number with a random significand: sign, and a
 * biased exponent in [elo, ehi] (1..30). */
static inline uint16_t q4_f16_normal(q4_rng *r, int negative, unsigned elo, unsigned ehi)
{
    const unsigned e = elo + (unsigned)q4_below(r, ehi - elo + 1u);
    return (uint16_t)((negative ? 0x8000u : 0u) | e << 10 | (unsigned)q4_below(r, 1024));
}

/* f16 -> double by the definition (not the engine's conversion). */
static inline double q4_f16_value(uint16_t h)
{
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e ? ldexp(1024.0 + m, e - 25) : ldexp((double)m, -24);
    return (h & 0x8000u) ? -v : v;
}

/* Column c of a packed row, by the format's text: byte c / 2, low nibble
 * for even c, two's complement. */
static inline int q4_nibble_def(const uint8_t *row, size_t c)
{
    int v = (c % 2 ? row[c / 2] / 16 : row[c / 2] % 16);
    return v >= 8 ? v - 16 : v;
}

typedef void *(*q4_alloc_fn)(size_t bytes);

typedef struct q4_shape {
    size_t rows, cols;
    unsigned group_log2; /* 3..8 */
    int with_e;          /* a compensation term E */
    int with_bias;       /* a companion bias */
} q4_shape;

/* Fills *w with a random I4 matrix of the shape; buffers from alloc. Scales:
 * normal f16 in [2^-10, 2^3) with about 1 in 16 a zero (+0 or -0); bias:
 * normal or ±0, either sign; E: 0-3 entries a row, increasing columns,
 * f16 values normal or subnormal, row pointers 1, 2 or 4 bytes wide. */
static inline void q4_build(q4_rng *r, q4_alloc_fn alloc, const q4_shape *sh, colibri_matrix *w)
{
    const size_t rows = sh->rows, cols = sh->cols, stride = (cols + 1) / 2;
    const size_t group = (size_t)1 << sh->group_log2, G = (cols + group - 1) / group;
    uint8_t *nib = alloc(rows * stride);
    uint16_t *scale = alloc(rows * G * sizeof *scale);
    for (size_t i = 0; i < rows * stride; i++)
        nib[i] = (uint8_t)q4_next(r);
    if (cols % 2)
        for (size_t o = 0; o < rows; o++)
            nib[o * stride + stride - 1] &= 0x0Fu; /* the unused nibble is zero (validated) */
    for (size_t i = 0; i < rows * G; i++) {
        const size_t pick = q4_below(r, 32);
        scale[i] = pick == 0 ? 0x8000u : pick == 1 ? 0u : q4_f16_normal(r, 0, 5, 17);
    }
    memset(w, 0, sizeof *w);
    w->dtype = COLIBRI_DTYPE_I4;
    w->rows = (uint32_t)rows;
    w->cols = (uint32_t)cols;
    w->data = nib;
    w->scale = scale;
    w->q8_f16 = 1;
    w->q4_group_log2 = sh->group_log2;
    w->q4_groups = (uint32_t)G;
    if (sh->with_bias) {
        uint16_t *bias = alloc(rows * sizeof *bias);
        for (size_t o = 0; o < rows; o++) {
            const size_t pick = q4_below(r, 16);
            bias[o] = pick == 0 ? 0x8000u : pick == 1 ? 0u : q4_f16_normal(r, (int)q4_below(r, 2), 8, 15);
        }
        w->q4_bias = bias;
    }
    if (sh->with_e) {
        uint32_t *ptr32 = alloc((rows + 1) * sizeof *ptr32);
        uint16_t *col = alloc(rows * 3 * sizeof *col + 2), *val = alloc(rows * 3 * sizeof *val + 2);
        uint32_t nnz = 0;
        for (size_t o = 0; o < rows; o++) {
            ptr32[o] = nnz;
            const size_t count = q4_below(r, 4);
            size_t at = 0;
            for (size_t k = 0; k < count && at < cols; k++, at++) {
                at += q4_below(r, cols - at);
                col[nnz] = (uint16_t)at;
                val[nnz] = q4_below(r, 8) == 0 ? (uint16_t)(q4_next(r) & 0x83FFu) /* subnormal or ±0 */
                                                : q4_f16_normal(r, (int)q4_below(r, 2), 1, 10);
                nnz++;
            }
        }
        ptr32[rows] = nnz;
        /* The narrowest width that holds nnz, or a wider one: all three occur. */
        unsigned width = nnz <= 0xFFu ? 1u : nnz <= 0xFFFFu ? 2u : 4u;
        width <<= q4_below(r, 2);
        if (width > 4)
            width = 4;
        void *ptr = ptr32;
        if (width == 1) {
            uint8_t *p = alloc(rows + 1);
            for (size_t o = 0; o <= rows; o++)
                p[o] = (uint8_t)ptr32[o];
            ptr = p;
        } else if (width == 2) {
            uint16_t *p = alloc((rows + 1) * sizeof *p);
            for (size_t o = 0; o <= rows; o++)
                p[o] = (uint16_t)ptr32[o];
            ptr = p;
        }
        if (nnz) {
            w->q8_nnz = nnz;
            w->q8_ptr = (uint8_t)width;
            w->row_ptr = ptr;
            w->col = col;
            w->val = val;
        }
    }
}

/* Row o's compensation entries [*k, *end), read from the row pointers by
 * their width (independently of colibri_q8_terms). */
static inline void q4_terms_def(const colibri_matrix *w, size_t o, uint32_t *k, uint32_t *end)
{
    *k = *end = 0;
    if (w->q8_ptr == 1) {
        *k = ((const uint8_t *)w->row_ptr)[o];
        *end = ((const uint8_t *)w->row_ptr)[o + 1];
    } else if (w->q8_ptr == 2) {
        *k = ((const uint16_t *)w->row_ptr)[o];
        *end = ((const uint16_t *)w->row_ptr)[o + 1];
    } else if (w->q8_ptr == 4) {
        *k = ((const uint32_t *)w->row_ptr)[o];
        *end = ((const uint32_t *)w->row_ptr)[o + 1];
    }
}

/* Output o of one token in double, by the format's definition: Σ_c Q_oc ·
 * s_o,c/group · xm_c + Σ_E e · x_col + bias_o, where xm is x (f32
 * activations) or xq · a (int8 activations: xq non-NULL). *mag gets the sum
 * of the terms' magnitudes, and *terms their count (for tolerances). */
static inline double q4_expect(const colibri_matrix *w, size_t o, const float *x, const int8_t *xq, float a, double *mag,
                        size_t *terms)
{
    const size_t cols = w->cols, stride = (cols + 1) / 2, group = (size_t)1 << w->q4_group_log2;
    const size_t G = (cols + group - 1) / group;
    const uint8_t *row = (const uint8_t *)w->data + o * stride;
    const uint16_t *sc = (const uint16_t *)w->scale + o * G;
    double v = 0.0, m = 0.0;
    for (size_t c = 0; c < cols; c++) {
        const double xm = xq ? (double)xq[c] * (double)a : (double)x[c];
        const double t = (double)q4_nibble_def(row, c) * q4_f16_value(sc[c / group]) * xm;
        v += t;
        m += fabs(t);
    }
    uint32_t k, end;
    q4_terms_def(w, o, &k, &end);
    const size_t nnz = end - k;
    for (; k < end; k++) {
        const double t = q4_f16_value(w->val[k]) * (double)x[w->col[k]];
        v += t;
        m += fabs(t);
    }
    if (w->q4_bias) {
        const double t = q4_f16_value(w->q4_bias[o]);
        v += t;
        m += fabs(t);
    }
    *mag = m;
    *terms = cols + G + nnz + 2;
    return v;
}

#endif /* COLIBRI_Q4_CASES_H */
