/*
 * Optimised backend: AArch64 NEON (Advanced SIMD). ARMv8.0 is the baseline
 * (a Raspberry Pi 4's Cortex-A72); the int8 × int8 dot product uses SDOT
 * (the dotprod extension, ARMv8.2+) where the CPU has it, detected in
 * colibri_init through the Linux auxiliary vector and stored in the kernel
 * table (k->linear / k->linear_acc and k->name): no static cache, no ifunc.
 * Compiled to nothing unless colibri_backend.h selects it.
 *
 * Linear kernels: the n token rows of a call are a small GEMM. Tokens go in
 * blocks of up to 4 and outputs in tiles of 8 (1-2 tokens) or 4 (3-4
 * tokens): every weight vector loaded is used by each token of the block,
 * every activation vector by each output of the tile, and the tile's
 * T × O independent vector accumulators hide the FMA latency.
 *
 *   f32 weights    vfmaq_f32 over 4 lanes, then the lanes summed (vaddvq)
 *                  and the tail (in % 4) added in index order
 *   f16 weights    widened 4 at a time by FCVTL (vcvt_f32_f16, ARMv8.0,
 *                  exact like colibri_f16_to_f32), then as f32; f32
 *                  accumulation even where fp16 arithmetic exists
 *   int8, f32 act  widened int8 -> int32 -> f32 (exact), then as f32, times
 *                  the row's scale, the compensation E, the bias
 *   int8, int8 act SMULL/SMULL2 + SADALP (ARMv8.0) or SDOT (dotprod): the
 *                  int32 sum is exact integer arithmetic (wrapping modulo
 *                  2^32 like the reference), so these outputs are the
 *                  reference's bits
 *
 * Tolerance (tests/c/colibri_neon_test.c): f32 sums in another order and
 * with FMA, so a dot product of length in differs from the reference by at
 * most about in · 2^-24 · Σ|w·x| (the reordering bound); NaN and ±inf
 * propagate as in the reference (a NaN or inf input, or a 0 · inf, makes the
 * output NaN or inf exactly where the reference's does, barring sums that
 * overflow f32 in one order and not in the other). The quantiser,
 * ReLU and the int8 × int8 linear kernels are bit-exact.
 *
 * q8 metadata is read only through colibri_q8_scale / colibri_q8_compensate.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_NEON)

#include <arm_neon.h>
#include <math.h>

#if defined(__linux__)
#include <sys/auxv.h>
#endif

#include "colibri_format.h"

#define NEON_INLINE static inline __attribute__((always_inline))
#define NEON_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))

/* The up to 4 tokens of one block: their activation rows (f32, and int8
 * with its scale for INT8_ACT), output rows and gate scales. */
typedef struct neon_tokens {
    const float *x[4];
    const int8_t *q[4];
    float a[4];
    float *y[4];
    float s[4];
} neon_tokens;

/* ---- Tiles: dot products of O weight rows (from row o) with T tokens,
 * into d[j * 4 + t]. T and O are compile-time constants at every call. ---- */

NEON_INLINE void tile_f32(const float *w, size_t in, const neon_tokens *tk, size_t T, size_t O, float *d)
{
    float32x4_t acc[8][4];
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            acc[j][t] = vdupq_n_f32(0.0f);
    size_t k = 0;
    for (; k + 4 <= in; k += 4) {
        float32x4_t xv[4];
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            xv[t] = vld1q_f32(tk->x[t] + k);
#pragma GCC unroll 8
        for (size_t j = 0; j < O; j++) {
            const float32x4_t wv = vld1q_f32(w + j * in + k);
#pragma GCC unroll 4
            for (size_t t = 0; t < T; t++)
                acc[j][t] = vfmaq_f32(acc[j][t], wv, xv[t]);
        }
    }
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++) {
            float sum = vaddvq_f32(acc[j][t]);
            for (size_t kk = k; kk < in; kk++)
                sum += w[j * in + kk] * tk->x[t][kk];
            d[j * 4 + t] = sum;
        }
}

NEON_INLINE float32x4_t load_f16x4(const uint16_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

NEON_INLINE void tile_f16(const uint16_t *w, size_t in, const neon_tokens *tk, size_t T, size_t O, float *d)
{
    float32x4_t acc[8][4];
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            acc[j][t] = vdupq_n_f32(0.0f);
    size_t k = 0;
    for (; k + 4 <= in; k += 4) {
        float32x4_t xv[4];
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            xv[t] = vld1q_f32(tk->x[t] + k);
#pragma GCC unroll 8
        for (size_t j = 0; j < O; j++) {
            const float32x4_t wv = load_f16x4(w + j * in + k);
#pragma GCC unroll 4
            for (size_t t = 0; t < T; t++)
                acc[j][t] = vfmaq_f32(acc[j][t], wv, xv[t]);
        }
    }
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++) {
            float sum = vaddvq_f32(acc[j][t]);
            for (size_t kk = k; kk < in; kk++)
                sum += colibri_f16_to_f32(w[j * in + kk]) * tk->x[t][kk];
            d[j * 4 + t] = sum;
        }
}

/* int8 weights, f32 activations: 8 weights widened to two f32 vectors. */
NEON_INLINE void tile_q8(const int8_t *w, size_t in, const neon_tokens *tk, size_t T, size_t O, float *d)
{
    float32x4_t acc[8][4];
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            acc[j][t] = vdupq_n_f32(0.0f);
    size_t k = 0;
    for (; k + 8 <= in; k += 8) {
        float32x4_t xlo[4], xhi[4];
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++) {
            xlo[t] = vld1q_f32(tk->x[t] + k);
            xhi[t] = vld1q_f32(tk->x[t] + k + 4);
        }
#pragma GCC unroll 8
        for (size_t j = 0; j < O; j++) {
            const int16x8_t w16 = vmovl_s8(vld1_s8(w + j * in + k));
            const float32x4_t wlo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w16)));
            const float32x4_t whi = vcvtq_f32_s32(vmovl_high_s16(w16));
#pragma GCC unroll 4
            for (size_t t = 0; t < T; t++) {
                acc[j][t] = vfmaq_f32(acc[j][t], wlo, xlo[t]);
                acc[j][t] = vfmaq_f32(acc[j][t], whi, xhi[t]);
            }
        }
    }
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++) {
            float sum = vaddvq_f32(acc[j][t]);
            for (size_t kk = k; kk < in; kk++)
                sum += (float)w[j * in + kk] * tk->x[t][kk];
            d[j * 4 + t] = sum;
        }
}

/* Σ a[k] · b[k] for k in [k0, in), wrapping modulo 2^32 like the reference. */
NEON_INLINE uint32_t dot_i8_tail(const int8_t *a, const int8_t *b, size_t k0, size_t in)
{
    uint32_t acc = 0;
    for (size_t k = k0; k < in; k++)
        acc += (uint32_t)((int32_t)a[k] * (int32_t)b[k]);
    return acc;
}

/* int8 × int8, ARMv8.0: 16 products per SMULL + SMULL2 pair (int16, exact:
 * |q · xq| <= 128²), pairwise added into int32 lanes (SADALP). */
NEON_INLINE void tile_q8q8(const int8_t *w, size_t in, const neon_tokens *tk, size_t T, size_t O, int32_t *d)
{
    int32x4_t acc[8][4];
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            acc[j][t] = vdupq_n_s32(0);
    size_t k = 0;
    for (; k + 16 <= in; k += 16) {
        int8x16_t xv[4];
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            xv[t] = vld1q_s8(tk->q[t] + k);
#pragma GCC unroll 8
        for (size_t j = 0; j < O; j++) {
            const int8x16_t wv = vld1q_s8(w + j * in + k);
#pragma GCC unroll 4
            for (size_t t = 0; t < T; t++) {
                acc[j][t] = vpadalq_s16(acc[j][t], vmull_s8(vget_low_s8(wv), vget_low_s8(xv[t])));
                acc[j][t] = vpadalq_s16(acc[j][t], vmull_high_s8(wv, xv[t]));
            }
        }
    }
    if (k + 8 <= in) {
#pragma GCC unroll 8
        for (size_t j = 0; j < O; j++) {
            const int8x8_t wv = vld1_s8(w + j * in + k);
#pragma GCC unroll 4
            for (size_t t = 0; t < T; t++)
                acc[j][t] = vpadalq_s16(acc[j][t], vmull_s8(wv, vld1_s8(tk->q[t] + k)));
        }
        k += 8;
    }
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            d[j * 4 + t] = (int32_t)((uint32_t)vaddvq_s32(acc[j][t]) + dot_i8_tail(w + j * in, tk->q[t], k, in));
}

/* int8 × int8 with SDOT: 16 products per instruction into 4 int32 lanes. */
NEON_INLINE NEON_DOTPROD void tile_q8q8_dp(const int8_t *w, size_t in, const neon_tokens *tk, size_t T, size_t O,
                                           int32_t *d)
{
    int32x4_t acc[8][4];
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            acc[j][t] = vdupq_n_s32(0);
    size_t k = 0;
    for (; k + 16 <= in; k += 16) {
        int8x16_t xv[4];
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            xv[t] = vld1q_s8(tk->q[t] + k);
#pragma GCC unroll 8
        for (size_t j = 0; j < O; j++) {
            const int8x16_t wv = vld1q_s8(w + j * in + k);
#pragma GCC unroll 4
            for (size_t t = 0; t < T; t++)
                acc[j][t] = vdotq_s32(acc[j][t], wv, xv[t]);
        }
    }
    if (k + 8 <= in) {
#pragma GCC unroll 8
        for (size_t j = 0; j < O; j++) {
            const int8x8_t wv = vld1_s8(w + j * in + k);
#pragma GCC unroll 4
            for (size_t t = 0; t < T; t++) {
                const int32x2_t p = vdot_s32(vdup_n_s32(0), wv, vld1_s8(tk->q[t] + k));
                acc[j][t] = vaddq_s32(acc[j][t], vcombine_s32(p, vdup_n_s32(0)));
            }
        }
        k += 8;
    }
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            d[j * 4 + t] = (int32_t)((uint32_t)vaddvq_s32(acc[j][t]) + dot_i8_tail(w + j * in, tk->q[t], k, in));
}

/* ---- Row drivers: every output of one token block, tile by tile, each
 * output finished as the reference's colibri_emit does. ---- */

NEON_INLINE void emit_f(const neon_tokens *tk, size_t T, size_t O, size_t o, const float *d, const float *b, int acc)
{
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            colibri_emit(tk->y[t], o + j, d[j * 4 + t], b, acc, tk->s[t]);
}

NEON_INLINE void emit_q8(const colibri_matrix *w, const neon_tokens *tk, size_t T, size_t O, size_t o, const float *d,
                         const float *b, int acc)
{
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            colibri_emit(tk->y[t], o + j,
                         colibri_q8_compensate(w, o + j, tk->x[t], d[j * 4 + t] * colibri_q8_scale(w, o + j)),
                         b, acc, tk->s[t]);
}

NEON_INLINE void emit_q8q8(const colibri_matrix *w, const neon_tokens *tk, size_t T, size_t O, size_t o,
                           const int32_t *d, const float *b, int acc)
{
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < T; t++)
            colibri_emit(tk->y[t], o + j,
                         colibri_q8_compensate(w, o + j, tk->x[t],
                                               (float)d[j * 4 + t] * (colibri_q8_scale(w, o + j) * tk->a[t])),
                         b, acc, tk->s[t]);
}

NEON_INLINE void rows_f32_t(const colibri_matrix *w, const float *b, const neon_tokens *tk, size_t T, size_t O, int acc)
{
    const float *wd = w->data;
    const size_t in = w->cols, out = w->rows;
    float d[32];
    size_t o = 0;
    for (; o + O <= out; o += O) {
        tile_f32(wd + o * in, in, tk, T, O, d);
        emit_f(tk, T, O, o, d, b, acc);
    }
    for (; o < out; o++) {
        tile_f32(wd + o * in, in, tk, T, 1, d);
        emit_f(tk, T, 1, o, d, b, acc);
    }
}

NEON_INLINE void rows_f16_t(const colibri_matrix *w, const float *b, const neon_tokens *tk, size_t T, size_t O, int acc)
{
    const uint16_t *wd = w->data;
    const size_t in = w->cols, out = w->rows;
    float d[32];
    size_t o = 0;
    for (; o + O <= out; o += O) {
        tile_f16(wd + o * in, in, tk, T, O, d);
        emit_f(tk, T, O, o, d, b, acc);
    }
    for (; o < out; o++) {
        tile_f16(wd + o * in, in, tk, T, 1, d);
        emit_f(tk, T, 1, o, d, b, acc);
    }
}

NEON_INLINE void rows_q8_t(const colibri_matrix *w, const float *b, const neon_tokens *tk, size_t T, size_t O, int acc)
{
    const int8_t *wd = w->data;
    const size_t in = w->cols, out = w->rows;
    float d[32];
    size_t o = 0;
    for (; o + O <= out; o += O) {
        tile_q8(wd + o * in, in, tk, T, O, d);
        emit_q8(w, tk, T, O, o, d, b, acc);
    }
    for (; o < out; o++) {
        tile_q8(wd + o * in, in, tk, T, 1, d);
        emit_q8(w, tk, T, 1, o, d, b, acc);
    }
}

NEON_INLINE void rows_q8q8_t(const colibri_matrix *w, const float *b, const neon_tokens *tk, size_t T, size_t O,
                             int acc)
{
    const int8_t *wd = w->data;
    const size_t in = w->cols, out = w->rows;
    int32_t d[32];
    size_t o = 0;
    for (; o + O <= out; o += O) {
        tile_q8q8(wd + o * in, in, tk, T, O, d);
        emit_q8q8(w, tk, T, O, o, d, b, acc);
    }
    for (; o < out; o++) {
        tile_q8q8(wd + o * in, in, tk, T, 1, d);
        emit_q8q8(w, tk, T, 1, o, d, b, acc);
    }
}

NEON_INLINE NEON_DOTPROD void rows_q8q8_dp_t(const colibri_matrix *w, const float *b, const neon_tokens *tk, size_t T,
                                             size_t O, int acc)
{
    const int8_t *wd = w->data;
    const size_t in = w->cols, out = w->rows;
    int32_t d[32];
    size_t o = 0;
    for (; o + O <= out; o += O) {
        tile_q8q8_dp(wd + o * in, in, tk, T, O, d);
        emit_q8q8(w, tk, T, O, o, d, b, acc);
    }
    for (; o < out; o++) {
        tile_q8q8_dp(wd + o * in, in, tk, T, 1, d);
        emit_q8q8(w, tk, T, 1, o, d, b, acc);
    }
}

/* One function per dtype with T (1..4) made a constant: 8 outputs per tile
 * for 1-2 tokens, 4 for 3-4 (at most 16 accumulators, 32 vector registers). */
#define NEON_ROWS(name, impl, attr)                                                                  \
    static attr void name(const colibri_matrix *w, const float *b, const neon_tokens *tk, size_t T, \
                          int acc)                                                                   \
    {                                                                                                \
        switch (T) {                                                                                 \
        case 1:                                                                                      \
            impl(w, b, tk, 1, 8, acc);                                                               \
            break;                                                                                   \
        case 2:                                                                                      \
            impl(w, b, tk, 2, 8, acc);                                                               \
            break;                                                                                   \
        case 3:                                                                                      \
            impl(w, b, tk, 3, 4, acc);                                                               \
            break;                                                                                   \
        default:                                                                                     \
            impl(w, b, tk, 4, 4, acc);                                                               \
            break;                                                                                   \
        }                                                                                            \
    }

#define NEON_NOATTR
NEON_ROWS(rows_f32, rows_f32_t, NEON_NOATTR)
NEON_ROWS(rows_f16, rows_f16_t, NEON_NOATTR)
NEON_ROWS(rows_q8, rows_q8_t, NEON_NOATTR)
NEON_ROWS(rows_q8q8, rows_q8q8_t, NEON_NOATTR)
NEON_ROWS(rows_q8q8_dp, rows_q8q8_dp_t, NEON_DOTPROD)

static void rows_any(const colibri_matrix *w, const float *b, const neon_tokens *tk, size_t T, int acc, int int8_act,
                     int dotprod)
{
    switch (w->dtype) {
    case COLIBRI_DTYPE_F16:
        rows_f16(w, b, tk, T, acc);
        break;
    case COLIBRI_DTYPE_I8:
        if (!int8_act)
            rows_q8(w, b, tk, T, acc);
        else if (dotprod)
            rows_q8q8_dp(w, b, tk, T, acc);
        else
            rows_q8q8(w, b, tk, T, acc);
        break;
    default: /* F32; weight dtypes are validated */
        rows_f32(w, b, tk, T, acc);
        break;
    }
}

/* ---- The linear kernels (colibri_linear_fn, colibri_linear_acc_fn) ---- */

NEON_INLINE void linear_neon(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w, const float *b,
                             const colibri_qrows *xq, float *restrict y, int dotprod)
{
    const size_t in = w->cols, out = w->rows;
    for (size_t i = 0; i < n; i += 4) {
        const size_t T = n - i < 4 ? n - i : 4;
        neon_tokens tk;
        for (size_t t = 0; t < T; t++) {
            tk.x[t] = x + (rows ? rows[i + t] : i + t) * in;
            tk.q[t] = xq ? xq->q + (i + t) * in : NULL;
            tk.a[t] = xq ? xq->a[i + t] : 0.0f;
            tk.y[t] = y + (i + t) * out;
            tk.s[t] = 1.0f;
        }
        rows_any(w, b, &tk, T, 0, xq != NULL, dotprod);
    }
}

NEON_INLINE void linear_acc_neon(const float *x, size_t n, const colibri_matrix *w, const float *b,
                                 const uint16_t *rows, const float *scale, const colibri_qrows *xq,
                                 float *restrict y, int dotprod)
{
    const size_t in = w->cols, out = w->rows;
    for (size_t i = 0; i < n; i += 4) {
        const size_t T = n - i < 4 ? n - i : 4;
        neon_tokens tk;
        for (size_t t = 0; t < T; t++) {
            tk.x[t] = x + (i + t) * in;
            tk.q[t] = xq ? xq->q + (i + t) * in : NULL;
            tk.a[t] = xq ? xq->a[i + t] : 0.0f;
            tk.y[t] = y + (rows ? rows[i + t] : i + t) * out;
            tk.s[t] = scale ? scale[i + t] : 1.0f;
        }
        rows_any(w, b, &tk, T, 1, xq != NULL, dotprod);
    }
}

static void linear_v80(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w, const float *b,
                       const colibri_qrows *xq, float *restrict y)
{
    linear_neon(x, rows, n, w, b, xq, y, 0);
}

static void linear_dp(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w, const float *b,
                      const colibri_qrows *xq, float *restrict y)
{
    linear_neon(x, rows, n, w, b, xq, y, 1);
}

static void linear_acc_v80(const float *x, size_t n, const colibri_matrix *w, const float *b, const uint16_t *rows,
                           const float *scale, const colibri_qrows *xq, float *restrict y)
{
    linear_acc_neon(x, n, w, b, rows, scale, xq, y, 0);
}

static void linear_acc_dp(const float *x, size_t n, const colibri_matrix *w, const float *b, const uint16_t *rows,
                          const float *scale, const colibri_qrows *xq, float *restrict y)
{
    linear_acc_neon(x, n, w, b, rows, scale, xq, y, 1);
}

/* ---- Per-token int8 quantisation, bit-exact to colibri_quantize_rows_ref:
 * the maximum of finite values is order-independent, and the per-element
 * (x · s) · inv, FRINTA (roundf: half away from zero), clamp and convert
 * are the reference's operations one by one. ---- */

static void quantize_rows_neon(const float *x, const uint16_t *rows, size_t n, size_t in, int8_t *restrict q,
                               float *restrict a)
{
    for (size_t i = 0; i < n; i++, q += in) {
        const float *xi = x + (rows ? rows[i] : i) * in;
        float32x4_t vm = vdupq_n_f32(0.0f), vnf = vdupq_n_f32(0.0f);
        const float32x4_t zero = vdupq_n_f32(0.0f);
        size_t k = 0;
        for (; k + 4 <= in; k += 4) {
            const float32x4_t v = vabsq_f32(vld1q_f32(xi + k));
            vm = vmaxq_f32(vm, v);
            vnf = vaddq_f32(vnf, vmulq_f32(v, zero)); /* stays 0 unless some v is NaN or inf */
        }
        float m = vmaxvq_f32(vm), nonfinite = vaddvq_f32(vnf);
        for (; k < in; k++) {
            const float v = fabsf(xi[k]);
            if (v > m)
                m = v;
            nonfinite += v * 0.0f;
        }
        if (nonfinite != 0.0f || m == 0.0f) {
            /* As the reference: zeros, a = 0 (all zeros) or NaN (NaN or inf). */
            for (k = 0; k < in; k++)
                q[k] = 0;
            a[i] = nonfinite;
            continue;
        }
        const float s = m < 0x1p-100f ? 0x1p100f : 1.0f;
        const float inv = 127.0f / (m * s);
        const float32x4_t vs = vdupq_n_f32(s), vinv = vdupq_n_f32(inv);
        const float32x4_t hi = vdupq_n_f32(127.0f), lo = vdupq_n_f32(-127.0f);
        for (k = 0; k + 8 <= in; k += 8) {
            float32x4_t v0 = vrndaq_f32(vmulq_f32(vmulq_f32(vld1q_f32(xi + k), vs), vinv));
            float32x4_t v1 = vrndaq_f32(vmulq_f32(vmulq_f32(vld1q_f32(xi + k + 4), vs), vinv));
            v0 = vmaxq_f32(vminq_f32(v0, hi), lo);
            v1 = vmaxq_f32(vminq_f32(v1, hi), lo);
            const int16x8_t q16 = vcombine_s16(vmovn_s32(vcvtq_s32_f32(v0)), vmovn_s32(vcvtq_s32_f32(v1)));
            vst1_s8(q + k, vmovn_s16(q16));
        }
        for (; k < in; k++) {
            float v = roundf((xi[k] * s) * inv);
            if (v > 127.0f)
                v = 127.0f;
            else if (v < -127.0f)
                v = -127.0f;
            q[k] = (int8_t)v;
        }
        a[i] = m / 127.0f;
    }
}

/* ---- Activations: ReLU vectorised, bit-exact (v < 0 selects 0; a NaN
 * fails the comparison and stays, -0 stays -0, as the reference); the
 * others are the reference's (colibri_math.h, in double). ---- */

static void activation_neon(float *x, size_t n, uint32_t kind)
{
    if (kind != COLIBRI_ACT_RELU) {
        colibri_activation_ref(x, n, kind);
        return;
    }
    const float32x4_t zero = vdupq_n_f32(0.0f);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = vld1q_f32(x + i);
        vst1q_f32(x + i, vbslq_f32(vcltq_f32(v, zero), zero, v));
    }
    for (; i < n; i++)
        x[i] = x[i] < 0.0f ? 0.0f : x[i];
}

/* ---- The table ---- */

/* SDOT (FEAT_DotProd): from the Linux auxiliary vector; elsewhere only if
 * the build's target has it. */
static int neon_has_dotprod(void)
{
#if defined(__linux__) && defined(HWCAP_ASIMDDP)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__ARM_FEATURE_DOTPROD)
    return 1;
#else
    return 0;
#endif
}

void colibri_kernels_neon(colibri_kernels *k)
{
    const int dotprod = neon_has_dotprod();
    k->name = dotprod ? "aarch64 neon+dotprod" : "aarch64 neon";
    k->linear = dotprod ? linear_dp : linear_v80;
    k->linear_acc = dotprod ? linear_acc_dp : linear_acc_v80;
    k->quantize_rows = quantize_rows_neon;
    k->activation = activation_neon;
}

#endif /* COLIBRI_BACKEND_NEON */
