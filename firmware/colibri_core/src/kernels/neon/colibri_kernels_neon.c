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
 *   f16 weights    widened by FCVTL/FCVTL2 (vcvt_f32_f16, ARMv8.0, exact
 *                  like colibri_f16_to_f32; 8 a step for 1-2 tokens, 4 for
 *                  more), then as f32; f32 accumulation even where fp16
 *                  arithmetic exists
 *   int8, f32 act  widened int8 -> int32 -> f32 (exact; 16 a step for one
 *                  token, 8 for more), then as f32, times the row's scale,
 *                  the compensation E, the bias
 *   int8, int8 act SMULL/SMULL2 + SADALP (ARMv8.0) or SDOT (dotprod): the
 *                  int32 sum is exact integer arithmetic (wrapping modulo
 *                  2^32 like the reference), so these outputs are the
 *                  reference's bits
 *   int4 (I4)      nibbles unpacked 32 at a time (AND, USHR, ZIP, TBL);
 *                  int8 act. bit for bit (4 rows as lanes, groups summed in
 *                  order), f32 act. fused (below, "I4 weights")
 *
 * Tolerance (tests/c/colibri_kernel_test.c, tests/c/colibri_q4_test.c): f32 sums in another order and
 * with FMA, so a dot product of length in differs from the reference by at
 * most about in · 2^-24 · Σ|w·x| (the reordering bound); NaN and ±inf
 * propagate as in the reference (a NaN or inf input, or a 0 · inf, makes the
 * output NaN or inf exactly where the reference's does, barring sums that
 * overflow f32 in one order and not in the other). The quantiser, the
 * activations and the int8 × int8 linear kernels are bit-exact; the norms
 * sum their statistics in 8 lanes (about n · 2^-24 relative).
 *
 * q8 metadata is read only through colibri_q8_scale / colibri_q8_compensate.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_NEON)

#include <arm_neon.h>
#include <float.h>
#include <math.h>

#if defined(__linux__)
#include <sys/auxv.h>
#endif

#include "colibri_format.h"
#include "../../colibri_math.h"

#define NEON_INLINE static inline __attribute__((always_inline))
/* The SDOT functions (GCC's arm_neon.h declares vdotq_s32 for this target;
 * "+dotprod" alone does not match it). Called only when HWCAP_ASIMDDP says
 * the CPU has SDOT, which every such core pairs with ARMv8.2. */
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
    /* acc[j][t]; with one token, acc[j][1] takes the odd half of each 8. */
    float32x4_t acc[8][4];
    const size_t A = T == 1 ? 2 : T;
#pragma GCC unroll 8
    for (size_t j = 0; j < O; j++)
#pragma GCC unroll 4
        for (size_t t = 0; t < A; t++)
            acc[j][t] = vdupq_n_f32(0.0f);
    size_t k = 0;
    if (T <= 2) { /* 8 weights a step: one 128-bit load, FCVTL + FCVTL2 */
        for (; k + 8 <= in; k += 8) {
            float32x4_t xa[2], xb[2];
#pragma GCC unroll 2
            for (size_t t = 0; t < T; t++) {
                xa[t] = vld1q_f32(tk->x[t] + k);
                xb[t] = vld1q_f32(tk->x[t] + k + 4);
            }
#pragma GCC unroll 8
            for (size_t j = 0; j < O; j++) {
                const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(w + j * in + k));
                const float32x4_t wa = vcvt_f32_f16(vget_low_f16(h)), wb = vcvt_high_f32_f16(h);
                if (T == 1) {
                    acc[j][0] = vfmaq_f32(acc[j][0], wa, xa[0]);
                    acc[j][1] = vfmaq_f32(acc[j][1], wb, xb[0]);
                } else {
#pragma GCC unroll 2
                    for (size_t t = 0; t < T; t++)
                        acc[j][t] = vfmaq_f32(vfmaq_f32(acc[j][t], wa, xa[t]), wb, xb[t]);
                }
            }
        }
    }
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
            float sum = vaddvq_f32(T == 1 ? vaddq_f32(acc[j][0], acc[j][1]) : acc[j][t]);
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
    if (T == 1) { /* 16 weights a step: one 128-bit load, SXTL/SXTL2 twice */
        for (; k + 16 <= in; k += 16) {
            const float *xr = tk->x[0] + k;
            const float32x4_t x0 = vld1q_f32(xr), x1 = vld1q_f32(xr + 4);
            const float32x4_t x2 = vld1q_f32(xr + 8), x3 = vld1q_f32(xr + 12);
#pragma GCC unroll 8
            for (size_t j = 0; j < O; j++) {
                const int8x16_t q = vld1q_s8(w + j * in + k);
                const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
                acc[j][0] = vfmaq_f32(acc[j][0], vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), x0);
                acc[j][0] = vfmaq_f32(acc[j][0], vcvtq_f32_s32(vmovl_high_s16(lo)), x1);
                acc[j][0] = vfmaq_f32(acc[j][0], vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), x2);
                acc[j][0] = vfmaq_f32(acc[j][0], vcvtq_f32_s32(vmovl_high_s16(hi)), x3);
            }
        }
    }
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

/* ---- I4 weights (format v5) ----
 * Nibbles are unpacked 32 columns (16 bytes) at a time: low and high
 * nibbles split (AND, USHR), interleaved back into column order (ZIP1,
 * ZIP2) and made signed -8..7 by one table lookup (TBL).
 *
 *   int8 act.  4 rows in the 4 lanes of a vector, one token at a time: per
 *              group and row Σ Q·xq exact in int32 (SMULL/SMLAL2 + SADALP,
 *              or SDOT), the rows' sums gathered into lanes (ADDP), then
 *              v += (float)sum · s_g and at the end v · a, unfused, as the
 *              reference: its bits.
 *   f32 act.   4 rows by 1-2 tokens: each weight widened to f32, times its
 *              group's scale, fused-multiply-added per token into 4-lane
 *              accumulators; within the f32 tolerance above (|w| = |Q|·s_g).
 * A group narrower than 32 columns, or a row's last partial 32, goes
 * through zero-padded copies (nothing read past a row or a vector). */

NEON_INLINE int8x16x2_t q4_decode32(uint8x16_t packed)
{
    static const int8_t lut_values[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
    const int8x16_t lut = vld1q_s8(lut_values);
    const uint8x16_t lo = vandq_u8(packed, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(packed, 4);
    int8x16x2_t q;
    q.val[0] = vqtbl1q_s8(lut, vzip1q_u8(lo, hi)); /* columns 0..15 */
    q.val[1] = vqtbl1q_s8(lut, vzip2q_u8(lo, hi)); /* columns 16..31 */
    return q;
}

/* Columns [c, c + n) of a row (c even, n <= 32), zero beyond n. */
NEON_INLINE int8x16x2_t q4_decode_at(const uint8_t *row, size_t c, size_t n)
{
    if (n == 32)
        return q4_decode32(vld1q_u8(row + (c >> 1)));
    uint8_t buf[16] = {0};
    memcpy(buf, row + (c >> 1), (n + 1) >> 1);
    if (n & 1u)
        buf[n >> 1] &= 0x0Fu; /* a column past n shares the last byte */
    return q4_decode32(vld1q_u8(buf));
}

NEON_INLINE int8x16x2_t q4_xq_at(const int8_t *xq, size_t c, size_t n)
{
    int8x16x2_t v;
    if (n == 32) {
        v.val[0] = vld1q_s8(xq + c);
        v.val[1] = vld1q_s8(xq + c + 16);
        return v;
    }
    int8_t buf[32] = {0};
    memcpy(buf, xq + c, n);
    v.val[0] = vld1q_s8(buf);
    v.val[1] = vld1q_s8(buf + 16);
    return v;
}

/* Σ of 32 products Q·xq added into the 4 int32 lanes of acc. */
NEON_INLINE int32x4_t q4_dot32(int32x4_t acc, int8x16x2_t q, int8x16x2_t x)
{
    int16x8_t p = vmull_s8(vget_low_s8(q.val[0]), vget_low_s8(x.val[0]));
    p = vmlal_high_s8(p, q.val[0], x.val[0]); /* |sum of two| <= 2 · 8 · 128 */
    int16x8_t p2 = vmull_s8(vget_low_s8(q.val[1]), vget_low_s8(x.val[1]));
    p2 = vmlal_high_s8(p2, q.val[1], x.val[1]);
    return vpadalq_s16(vpadalq_s16(acc, p), p2);
}

NEON_DOTPROD NEON_INLINE int32x4_t q4_dot32_dp(int32x4_t acc, int8x16x2_t q, int8x16x2_t x)
{
    return vdotq_s32(vdotq_s32(acc, q.val[0], x.val[0]), q.val[1], x.val[1]);
}

/* One token, rows o .. o + 3 (rows past the matrix repeat its last one):
 * v[r] = (Σ_g (float)(Σ_{c in g} Q·xq) · s_g) · a, the reference's bits. */
#define NEON_Q4Q8_ROWS4(NAME, ATTR, DOT)                                                                    \
    static ATTR void NAME(const colibri_matrix *w, size_t o, const int8_t *xq, float a, float v[4])          \
    {                                                                                                        \
        const size_t in = w->cols, group = (size_t)1 << w->q4_group_log2, G = w->q4_groups;                \
        const uint8_t *row[4];                                                                               \
        const uint16_t *sc[4];                                                                               \
        for (size_t r = 0; r < 4; r++) {                                                                     \
            const size_t orow = o + r < w->rows ? o + r : w->rows - 1;                                       \
            row[r] = colibri_q4_row(w, orow);                                                                \
            sc[r] = colibri_q4_scales(w, orow);                                                              \
        }                                                                                                    \
        float32x4_t acc = vdupq_n_f32(0.0f);                                                                 \
        for (size_t g = 0; g < G; g++) {                                                                     \
            const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in;                           \
            int32x4_t s0 = vdupq_n_s32(0), s1 = s0, s2 = s0, s3 = s0;                                        \
            for (size_t c = c0; c < end; c += 32) {                                                          \
                const size_t n = end - c < 32 ? end - c : 32;                                                \
                const int8x16x2_t x = q4_xq_at(xq, c, n);                                                    \
                s0 = DOT(s0, q4_decode_at(row[0], c, n), x);                                                 \
                s1 = DOT(s1, q4_decode_at(row[1], c, n), x);                                                 \
                s2 = DOT(s2, q4_decode_at(row[2], c, n), x);                                                 \
                s3 = DOT(s3, q4_decode_at(row[3], c, n), x);                                                 \
            }                                                                                                \
            const int32x4_t sum = vpaddq_s32(vpaddq_s32(s0, s1), vpaddq_s32(s2, s3));                       \
            uint16x4_t h = vdup_n_u16(sc[0][g]);                                                             \
            h = vset_lane_u16(sc[1][g], h, 1);                                                               \
            h = vset_lane_u16(sc[2][g], h, 2);                                                               \
            h = vset_lane_u16(sc[3][g], h, 3);                                                               \
            /* v += (float)sum · s_g: two roundings, as the reference */                                    \
            acc = vaddq_f32(acc, vmulq_f32(vcvtq_f32_s32(sum), vcvt_f32_f16(vreinterpret_f16_u16(h))));      \
        }                                                                                                    \
        vst1q_f32(v, vmulq_n_f32(acc, a));                                                                   \
    }
NEON_Q4Q8_ROWS4(q4q8_rows4, NEON_NOATTR, q4_dot32)
NEON_Q4Q8_ROWS4(q4q8_rows4_dp, NEON_DOTPROD, q4_dot32_dp)

/* T (1 or 2) tokens, rows o .. o + 3 (rows past the matrix repeat the last
 * one): v[t·4 + r] = Σ_c (Q·s_g) · x_t, fused. */
NEON_INLINE void q4f_rows4(const colibri_matrix *w, size_t o, size_t T, const float *const *xr, float v[8])
{
    const size_t in = w->cols, group = (size_t)1 << w->q4_group_log2, G = w->q4_groups;
    const uint8_t *row[4];
    const uint16_t *sc[4];
    for (size_t r = 0; r < 4; r++) {
        const size_t orow = o + r < w->rows ? o + r : w->rows - 1;
        row[r] = colibri_q4_row(w, orow);
        sc[r] = colibri_q4_scales(w, orow);
    }
    float32x4_t acc[8];
    for (size_t i = 0; i < 8; i++)
        acc[i] = vdupq_n_f32(0.0f);
    for (size_t g = 0; g < G; g++) {
        const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in;
        for (size_t c = c0; c < end; c += 32) {
            const size_t n = end - c < 32 ? end - c : 32, parts = (n + 3) / 4;
            float32x4_t x[2][8];
            for (size_t t = 0; t < T; t++) {
                if (n == 32) {
                    for (size_t k = 0; k < 8; k++)
                        x[t][k] = vld1q_f32(xr[t] + c + 4 * k);
                } else {
                    float buf[32] = {0};
                    memcpy(buf, xr[t] + c, n * sizeof *buf);
                    for (size_t k = 0; k < 8; k++)
                        x[t][k] = vld1q_f32(buf + 4 * k);
                }
            }
            for (size_t r = 0; r < 4; r++) {
                const float s = colibri_q8_half(sc[r][g]);
                const int8x16x2_t q = q4_decode_at(row[r], c, n);
                int16x8_t h[4];
                h[0] = vmovl_s8(vget_low_s8(q.val[0]));
                h[1] = vmovl_high_s8(q.val[0]);
                h[2] = vmovl_s8(vget_low_s8(q.val[1]));
                h[3] = vmovl_high_s8(q.val[1]);
                for (size_t k = 0; k < parts; k++) {
                    const int16x8_t hk = h[k / 2];
                    const int32x4_t i32 = k % 2 ? vmovl_high_s16(hk) : vmovl_s16(vget_low_s16(hk));
                    const float32x4_t wk = vmulq_n_f32(vcvtq_f32_s32(i32), s);
                    for (size_t t = 0; t < T; t++)
                        acc[t * 4 + r] = vfmaq_f32(acc[t * 4 + r], wk, x[t][k]);
                }
            }
        }
    }
    for (size_t i = 0; i < T * 4; i++)
        v[i] = vaddvq_f32(acc[i]);
}

/* The tokens of one block (T <= 4) over every row of an I4 matrix. */
static void rows_q4(const colibri_matrix *w, const float *b, const neon_tokens *tk, size_t T, int acc, int int8_act,
                    int dotprod)
{
    const size_t out = w->rows;
    for (size_t o = 0; o < out; o += 4) {
        const size_t R = out - o < 4 ? out - o : 4;
        if (int8_act) {
            for (size_t t = 0; t < T; t++) {
                float v[4];
                if (dotprod)
                    q4q8_rows4_dp(w, o, tk->q[t], tk->a[t], v);
                else
                    q4q8_rows4(w, o, tk->q[t], tk->a[t], v);
                for (size_t r = 0; r < R; r++)
                    colibri_emit(tk->y[t], o + r, colibri_q4_epilogue(w, o + r, tk->x[t], v[r]), b, acc, tk->s[t]);
            }
            continue;
        }
        for (size_t t = 0; t < T; t += 2) {
            const size_t pair = T - t >= 2 ? 2 : 1;
            float v[8];
            if (pair == 2)
                q4f_rows4(w, o, 2, tk->x + t, v);
            else
                q4f_rows4(w, o, 1, tk->x + t, v);
            for (size_t u = 0; u < pair; u++)
                for (size_t r = 0; r < R; r++)
                    colibri_emit(tk->y[t + u], o + r, colibri_q4_epilogue(w, o + r, tk->x[t + u], v[u * 4 + r]), b,
                                 acc, tk->s[t + u]);
        }
    }
}

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
    case COLIBRI_DTYPE_I4:
        rows_q4(w, b, tk, T, acc, int8_act, dotprod);
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
            q[k] = colibri_quantize_one(xi[k], s, inv);
        }
        a[i] = m / 127.0f;
    }
}

/* The block form (colibri_quantize_blocks_fn): each block of a row is
 * quantised as quantize_rows_neon quantises a row, so bit-exact too. */
static void quantize_blocks_neon(const float *x, const uint16_t *rows, size_t n, size_t in, int8_t *restrict q,
                                 float *restrict a)
{
    colibri_quantize_blocks_with(quantize_rows_neon, x, rows, n, in, q, a);
}

/* ---- Activations, bit-exact: colibri_math.h's exp, tanh and erf
 * evaluated two lanes at a time in float64x2 (the same double arithmetic,
 * operation by operation, as the scalar functions on AArch64, where
 * colibri_real is double and nothing is fused), and the same float
 * operations around them. Each branch of a scalar function (its NaN,
 * saturation and range cases) is a lane mask; a branch's polynomial runs
 * only when some lane of the 4 takes it. ReLU: v < 0 selects 0, so a NaN
 * fails the comparison and stays, -0 stays -0, as the reference. ---- */

typedef float64x2_t f64v;

NEON_INLINE f64v vpoly(const double *c, unsigned n, f64v z)
{
    f64v p = vdupq_n_f64(c[n - 1]);
    for (unsigned i = n - 1; i-- > 0;)
        p = vaddq_f64(vmulq_f64(p, z), vdupq_n_f64(c[i]));
    return p;
}

/* colibri_exp_real: e^x = e^r · 2^k, for lanes within |x| <= 110. */
NEON_INLINE f64v vexp_real(f64v x)
{
    const f64v t = vmulq_f64(x, vdupq_n_f64(COLIBRI_INV_LN2));
    const f64v half = vdupq_n_f64(0.5);
    const f64v h = vbslq_f64(vcltq_f64(t, vdupq_n_f64(0.0)), vsubq_f64(t, half), vaddq_f64(t, half));
    const int64x2_t k = vcvtq_s64_f64(h); /* truncates, as (int) */
    const f64v nf = vcvtq_f64_s64(k);
    const f64v r = vsubq_f64(vsubq_f64(x, vmulq_f64(nf, vdupq_n_f64(COLIBRI_LN2_HI))),
                             vmulq_f64(nf, vdupq_n_f64(COLIBRI_LN2_LO)));
    const f64v p = vaddq_f64(vdupq_n_f64(1.0),
                             vmulq_f64(r, vpoly(colibri_exp_taylor, COLIBRI_MATH_COUNT(colibri_exp_taylor), r)));
    const f64v scale = vreinterpretq_f64_s64(vshlq_n_s64(vaddq_s64(k, vdupq_n_s64(1023)), 52));
    return vmulq_f64(p, scale);
}

NEON_INLINE int any_lane(uint32x4_t m)
{
    return vmaxvq_u32(m) != 0;
}

NEON_INLINE float32x4_t copysign4(float32x4_t mag, float32x4_t sign)
{
    return vbslq_f32(vdupq_n_u32(0x80000000u), sign, mag);
}

/* colibri_expf */
NEON_INLINE float32x4_t vexpf(float32x4_t x)
{
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(x, x));
    const uint32x4_t over = vcgtq_f32(x, vdupq_n_f32(COLIBRI_EXPF_MAX_FINITE));
    const uint32x4_t under = vcltq_f32(x, vdupq_n_f32(COLIBRI_EXPF_MIN_NONZERO));
    const float32x4_t xc = vbslq_f32(vorrq_u32(nan, vorrq_u32(over, under)), vdupq_n_f32(0.0f), x);
    const float32x2_t lo = vcvt_f32_f64(vexp_real(vcvt_f64_f32(vget_low_f32(xc))));
    float32x4_t r = vcvt_high_f32_f64(lo, vexp_real(vcvt_high_f64_f32(xc)));
    r = vbslq_f32(over, vdupq_n_f32(__builtin_inff()), r);
    r = vbslq_f32(under, vdupq_n_f32(0.0f), r);
    return vbslq_f32(nan, vaddq_f32(x, x), r);
}

NEON_INLINE float32x4_t vsigmoid(float32x4_t v)
{
    const float32x4_t one = vdupq_n_f32(1.0f);
    return vdivq_f32(one, vaddq_f32(one, vexpf(vnegq_f32(v))));
}

/* tanh's small branch: x + x · (z · P(z)), z = x², in double. */
NEON_INLINE f64v vtanh_small(f64v x)
{
    const f64v z = vmulq_f64(x, x);
    return vaddq_f64(x, vmulq_f64(x, vmulq_f64(z, vpoly(colibri_tanh_c, COLIBRI_MATH_COUNT(colibri_tanh_c), z))));
}

/* tanh's large branch: 1 - 2/(e^2|x| + 1), |x| in [0.55, 9.1). */
NEON_INLINE f64v vtanh_large(f64v a2)
{
    const f64v one = vdupq_n_f64(1.0);
    return vsubq_f64(one, vdivq_f64(vdupq_n_f64(2.0), vaddq_f64(vexp_real(a2), one)));
}

/* colibri_tanhf */
NEON_INLINE float32x4_t vtanhf(float32x4_t x)
{
    const float32x4_t ax = vabsq_f32(x);
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(x, x));
    const uint32x4_t sat = vcgeq_f32(ax, vdupq_n_f32(COLIBRI_TANHF_SATURATE));
    const uint32x4_t small = vcltq_f32(ax, vdupq_n_f32(0.55f));
    const uint32x4_t large = vbicq_u32(vmvnq_u32(vorrq_u32(nan, sat)), small);
    float32x4_t r = copysign4(vdupq_n_f32(1.0f), x);
    if (any_lane(small)) {
        const float32x4_t xs = vbslq_f32(small, x, vdupq_n_f32(0.0f));
        const float32x2_t lo = vcvt_f32_f64(vtanh_small(vcvt_f64_f32(vget_low_f32(xs))));
        r = vbslq_f32(small, vcvt_high_f32_f64(lo, vtanh_small(vcvt_high_f64_f32(xs))), r);
    }
    if (any_lane(large)) {
        const float32x4_t a2 = vmulq_f32(vdupq_n_f32(2.0f), vbslq_f32(large, ax, vdupq_n_f32(1.0f)));
        const float32x2_t lo = vcvt_f32_f64(vtanh_large(vcvt_f64_f32(vget_low_f32(a2))));
        const float32x4_t t = vcvt_high_f32_f64(lo, vtanh_large(vcvt_high_f64_f32(a2)));
        r = vbslq_f32(large, copysign4(t, x), r);
    }
    return vbslq_f32(nan, vaddq_f32(x, x), r);
}

NEON_INLINE f64v verf_small(f64v x)
{
    const f64v z = vmulq_f64(x, x);
    return vaddq_f64(x, vmulq_f64(x, vpoly(colibri_erf_q, COLIBRI_MATH_COUNT(colibri_erf_q), z)));
}

/* 1 - e^-a² R(a), R from the [1, 2.5) or [2.5, 4) fit as hi selects. */
NEON_INLINE f64v verf_large(f64v a, uint64x2_t hi, int need_lo, int need_hi)
{
    f64v r = vdupq_n_f64(0.0);
    if (need_lo)
        r = vpoly(colibri_erfc_r_low, COLIBRI_MATH_COUNT(colibri_erfc_r_low), vsubq_f64(a, vdupq_n_f64(1.75)));
    if (need_hi)
        r = vbslq_f64(hi, vpoly(colibri_erfc_r_high, COLIBRI_MATH_COUNT(colibri_erfc_r_high),
                                vsubq_f64(a, vdupq_n_f64(3.25))), r);
    const f64v erfc = vmulq_f64(vexp_real(vmulq_f64(vnegq_f64(a), a)), r);
    return vsubq_f64(vdupq_n_f64(1.0), erfc);
}

/* colibri_erff */
NEON_INLINE float32x4_t verff(float32x4_t x)
{
    const float32x4_t ax = vabsq_f32(x);
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(x, x));
    const uint32x4_t sat = vcgeq_f32(ax, vdupq_n_f32(COLIBRI_ERFF_SATURATE));
    const uint32x4_t small = vcltq_f32(ax, vdupq_n_f32(1.0f));
    const uint32x4_t large = vbicq_u32(vmvnq_u32(vorrq_u32(nan, sat)), small);
    float32x4_t r = copysign4(vdupq_n_f32(1.0f), x);
    if (any_lane(small)) {
        const float32x4_t xs = vbslq_f32(small, x, vdupq_n_f32(0.0f));
        const float32x2_t lo = vcvt_f32_f64(verf_small(vcvt_f64_f32(vget_low_f32(xs))));
        r = vbslq_f32(small, vcvt_high_f32_f64(lo, verf_small(vcvt_high_f64_f32(xs))), r);
    }
    if (any_lane(large)) {
        const float32x4_t a = vbslq_f32(large, ax, vdupq_n_f32(1.0f));
        const uint32x4_t hi = vcgeq_f32(a, vdupq_n_f32(2.5f)); /* not ax < 2.5f */
        const int need_hi = any_lane(hi), need_lo = any_lane(vmvnq_u32(hi));
        const uint64x2_t hi_lo = vmovl_u32(vget_low_u32(hi)), hi_hi = vmovl_high_u32(hi);
        /* A widened all-ones 32-bit mask is 0x00000000FFFFFFFF: make it all ones. */
        const uint64x2_t m_lo = vtstq_u64(hi_lo, hi_lo), m_hi = vtstq_u64(hi_hi, hi_hi);
        const float32x2_t lo = vcvt_f32_f64(verf_large(vcvt_f64_f32(vget_low_f32(a)), m_lo, need_lo, need_hi));
        const float32x4_t e = vcvt_high_f32_f64(lo, verf_large(vcvt_high_f64_f32(a), m_hi, need_lo, need_hi));
        r = vbslq_f32(large, copysign4(e, x), r);
    }
    return vbslq_f32(nan, vaddq_f32(x, x), r);
}

/* One activation on 4 lanes, the reference's float arithmetic around the
 * functions (colibri_activation_ref). */
NEON_INLINE float32x4_t act4(float32x4_t v, uint32_t kind)
{
    const float32x4_t half = vdupq_n_f32(0.5f), one = vdupq_n_f32(1.0f);
    switch (kind) {
    case COLIBRI_ACT_GELU_ERF:
        return vmulq_f32(vmulq_f32(half, v), vaddq_f32(one, verff(vmulq_f32(v, vdupq_n_f32(0.70710678118654752f)))));
    case COLIBRI_ACT_GELU_TANH: {
        const float32x4_t cube = vmulq_f32(vmulq_f32(vmulq_f32(vdupq_n_f32(0.044715f), v), v), v);
        const float32x4_t in = vmulq_f32(vdupq_n_f32(0.79788456080286536f), vaddq_f32(v, cube));
        return vmulq_f32(vmulq_f32(half, v), vaddq_f32(one, vtanhf(in)));
    }
    case COLIBRI_ACT_SILU:
        return vmulq_f32(v, vsigmoid(v));
    case COLIBRI_ACT_TANH:
        return vtanhf(v);
    case COLIBRI_ACT_SIGMOID:
        return vsigmoid(v);
    default: /* COLIBRI_ACT_RELU */
        return vbslq_f32(vcltq_f32(v, vdupq_n_f32(0.0f)), vdupq_n_f32(0.0f), v);
    }
}

#define NEON_ACT_LOOP(KIND)                                   \
    for (; i + 4 <= n; i += 4)                                \
        vst1q_f32(x + i, act4(vld1q_f32(x + i), KIND));

static void activation_neon(float *x, size_t n, uint32_t kind)
{
    size_t i = 0;
    switch (kind) { /* one loop per kind, each with its function inlined */
    case COLIBRI_ACT_RELU:
        NEON_ACT_LOOP(COLIBRI_ACT_RELU)
        break;
    case COLIBRI_ACT_GELU_ERF:
        NEON_ACT_LOOP(COLIBRI_ACT_GELU_ERF)
        break;
    case COLIBRI_ACT_GELU_TANH:
        NEON_ACT_LOOP(COLIBRI_ACT_GELU_TANH)
        break;
    case COLIBRI_ACT_SILU:
        NEON_ACT_LOOP(COLIBRI_ACT_SILU)
        break;
    case COLIBRI_ACT_TANH:
        NEON_ACT_LOOP(COLIBRI_ACT_TANH)
        break;
    case COLIBRI_ACT_SIGMOID:
        NEON_ACT_LOOP(COLIBRI_ACT_SIGMOID)
        break;
    default: /* unreachable: activation kinds are validated */
        return;
    }
    colibri_activation_ref(x + i, n - i, kind); /* the last n % 4 */
}

/* ---- Norms: the row sums (Σx, Σ(x - mean)², Σx²) in 8 lanes, then the
 * reference's per-element operations one by one (the same division by the
 * same denominator, the same products). Only the sums' order differs: a
 * relative difference of about n · 2^-24 in mean and variance. ---- */

NEON_INLINE float sum8(const float *x, size_t n, float mean, int mode, size_t *k_out)
{
    /* mode 0: Σ x; 1: Σ (x - mean)²; 2: Σ x² */
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = vdupq_n_f32(0.0f);
    const float32x4_t m = vdupq_n_f32(mean);
    size_t k = 0;
    for (; k + 8 <= n; k += 8) {
        float32x4_t v0 = vld1q_f32(x + k), v1 = vld1q_f32(x + k + 4);
        if (mode == 1) {
            v0 = vsubq_f32(v0, m);
            v1 = vsubq_f32(v1, m);
        }
        if (mode == 0) {
            a0 = vaddq_f32(a0, v0);
            a1 = vaddq_f32(a1, v1);
        } else {
            a0 = vaddq_f32(a0, vmulq_f32(v0, v0));
            a1 = vaddq_f32(a1, vmulq_f32(v1, v1));
        }
    }
    *k_out = k;
    return vaddvq_f32(vaddq_f32(a0, a1));
}

static void layernorm_neon(float *x, size_t rows, size_t n, const float *gamma, const float *beta, float eps)
{
    for (size_t r = 0; r < rows; r++, x += n) {
        size_t k;
        float mean = sum8(x, n, 0.0f, 0, &k);
        for (; k < n; k++)
            mean += x[k];
        mean /= (float)n;
        float var = sum8(x, n, mean, 1, &k);
        for (; k < n; k++)
            var += (x[k] - mean) * (x[k] - mean);
        var /= (float)n;
        /* As the reference: statistics beyond f32 make the row NaN. */
        const float den = var <= FLT_MAX ? sqrtf(var + eps) : NAN;
        const float32x4_t vm = vdupq_n_f32(mean), vd = vdupq_n_f32(den);
        size_t i = 0;
        for (; i + 4 <= n; i += 4) {
            float32x4_t v = vdivq_f32(vsubq_f32(vld1q_f32(x + i), vm), vd);
            if (gamma)
                v = vmulq_f32(v, vld1q_f32(gamma + i));
            if (beta)
                v = vaddq_f32(v, vld1q_f32(beta + i));
            vst1q_f32(x + i, v);
        }
        for (; i < n; i++) {
            float v = (x[i] - mean) / den;
            if (gamma)
                v *= gamma[i];
            if (beta)
                v += beta[i];
            x[i] = v;
        }
    }
}

static void rmsnorm_neon(float *x, size_t rows, size_t n, const float *gamma, float eps)
{
    for (size_t r = 0; r < rows; r++, x += n) {
        size_t k;
        float ms = sum8(x, n, 0.0f, 2, &k);
        for (; k < n; k++)
            ms += x[k] * x[k];
        ms /= (float)n;
        const float den = sqrtf(ms + eps);
        const float32x4_t vd = vdupq_n_f32(den);
        size_t i = 0;
        for (; i + 4 <= n; i += 4) {
            const float32x4_t v = vdivq_f32(vld1q_f32(x + i), vd);
            vst1q_f32(x + i, gamma ? vmulq_f32(v, vld1q_f32(gamma + i)) : v);
        }
        for (; i < n; i++)
            x[i] = gamma ? x[i] / den * gamma[i] : x[i] / den;
    }
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

void colibri_kernels_neon_caps(colibri_kernels *k, int allow_dotprod)
{
    const int dotprod = allow_dotprod && neon_has_dotprod();
    k->name = dotprod ? "aarch64 neon+dotprod" : "aarch64 neon";
    k->linear = dotprod ? linear_dp : linear_v80;
    k->linear_acc = dotprod ? linear_acc_dp : linear_acc_v80;
    k->quantize_rows = quantize_rows_neon;
    k->quantize_blocks = quantize_blocks_neon;
    colibri_neon_blocks(k, dotprod);
    k->activation = activation_neon;
    k->layernorm = layernorm_neon;
    k->rmsnorm = rmsnorm_neon;
}

void colibri_kernels_neon(colibri_kernels *k)
{
    colibri_kernels_neon_caps(k, 1);
}

#endif /* COLIBRI_BACKEND_NEON */
