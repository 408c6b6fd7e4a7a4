/*
 * Optimised backend, AArch64 NEON: the block form of int8 activations
 * (INT8_BLOCKS: one f32 scale per COLIBRI_ACT_BLOCK = 32 columns of a
 * token's row) with I8 and I4 weights. Two instruction sets, picked by
 * colibri_kernels_neon_caps() from the CPU's features:
 *
 *   SDOT (dotprod, ARMv8.2+)  vdotq_s32: 16 products s8 x s8 into 4 int32
 *   ARMv8.0                   SMULL + SMLAL2 into int16 lanes, then SADALP
 *                             into int32 (I8: two products a lane,
 *                             2 · 128 · 127 < 2^15; I4: four, 4 · 8 · 127)
 *
 * Every kernel gives the reference's bits (colibri_matvec_q8b,
 * colibri_matvec_q4b): the integer sums of a block are exact in any order,
 * and per output row the f32 operations are the reference's, in its order,
 * unfused (the engine builds with -ffp-contract=off). Four output rows are
 * the four lanes of a vector: per block, each row's products go into its own
 * int32 vector S_r, which is never cleared; the four rows' S are reduced
 * into one vector (ADDP, lanes = rows) and the block's sums are that
 * vector less the previous block's (exact in wrapping int32, as every true
 * block sum fits in int32). Then per lane v += (float)sum · a_b (I8) or
 * v += (float)sum · (s_g · a_b) (I4), block after block.
 *
 * - One token (decode): 8 rows at a time (two vectors of 4).
 * - Several tokens (prefill, an expert's ring of tokens): 4 rows for up to
 *   4 tokens at a time, each row's weights loaded (and decoded) once for
 *   them; tokens run inside a row block, so its rows stay in L1.
 * - I4: the nibbles made int8 in registers, the low nibble (the even
 *   column) and the high (the odd) apart (q4_nibbles_*: Q on ARMv8.0,
 *   16 · Q for SDOT), the token's 32 activations split into evens and odds
 *   (UZP1, UZP2) to match.
 *   Groups of 32 columns or more (a block lies in one group); smaller
 *   groups (8, 16) take the reference kernel.
 * - E, the companion bias and the layer bias: the operations of
 *   colibri_q8_compensate, colibri_q4_epilogue and colibri_emit in their
 *   order, four rows a vector; a row's E entries are added one by one in
 *   storage order (f16 widened by FCVTL, exact), reading x only at columns
 *   bounded by colibri_q8_term_col.
 *
 * A row's partial last block is copied into zero-padded buffers (zero
 * weights and zero activations add nothing; nothing is read past a row).
 * Rows past the matrix in the last row block repeat its last row; their
 * results are never stored.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_NEON)

#include <arm_neon.h>

#include "colibri_format.h"

#define NB_INLINE static inline __attribute__((always_inline))
/* As colibri_kernels_neon.c: called only where HWCAP_ASIMDDP says the CPU has SDOT. */
#define NB_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define NB_V80

/* ---- Loads of one block: 32 columns from c, or the n < 32 there and zeros ---- */

NB_INLINE int8x16x2_t load_i8(const int8_t *p, size_t n)
{
    int8x16x2_t v;
    if (n == 32) {
        v.val[0] = vld1q_s8(p);
        v.val[1] = vld1q_s8(p + 16);
        return v;
    }
    int8_t buf[32] = {0};
    memcpy(buf, p, n);
    v.val[0] = vld1q_s8(buf);
    v.val[1] = vld1q_s8(buf + 16);
    return v;
}

/* Columns [c, c + n) of an I4 row (c even, n <= 32) as 16 packed bytes,
 * zero beyond n. */
NB_INLINE int8x16_t q4_packed(const uint8_t *row, size_t c, size_t n)
{
    if (n == 32)
        return vreinterpretq_s8_u8(vld1q_u8(row + (c >> 1)));
    uint8_t buf[16] = {0};
    memcpy(buf, row + (c >> 1), (n + 1) >> 1);
    if (n & 1u)
        buf[n >> 1] &= 0x0Fu; /* a column past n shares the last byte */
    return vreinterpretq_s8_u8(vld1q_u8(buf));
}

/* ---- The per-block products (accumulated into s, 4 int32 lanes) ---- */

/* I8: w0·x0 + w1·x1 over 32 columns. */
NB_INLINE int32x4_t dot8_v80(int32x4_t s, int8x16_t w0, int8x16_t x0, int8x16_t w1, int8x16_t x1)
{
    int16x8_t p0 = vmull_s8(vget_low_s8(w0), vget_low_s8(x0));
    p0 = vmlal_high_s8(p0, w0, x0);
    int16x8_t p1 = vmull_s8(vget_low_s8(w1), vget_low_s8(x1));
    p1 = vmlal_high_s8(p1, w1, x1);
    return vpadalq_s16(vpadalq_s16(s, p0), p1);
}

/* I4: lo·xe + hi·xo, |Q| <= 8: all four products of a lane in one int16. */
NB_INLINE int32x4_t dot4_v80(int32x4_t s, int8x16_t lo, int8x16_t xe, int8x16_t hi, int8x16_t xo)
{
    int16x8_t p = vmull_s8(vget_low_s8(lo), vget_low_s8(xe));
    p = vmlal_high_s8(p, lo, xe);
    p = vmlal_s8(p, vget_low_s8(hi), vget_low_s8(xo));
    p = vmlal_high_s8(p, hi, xo);
    return vpadalq_s16(s, p);
}

NB_INLINE NB_DOTPROD int32x4_t dot8_dp(int32x4_t s, int8x16_t w0, int8x16_t x0, int8x16_t w1, int8x16_t x1)
{
    return vdotq_s32(vdotq_s32(s, w0, x0), w1, x1);
}

#define dot4_dp dot8_dp

/* I4 nibbles as int8, the low nibble (the even column) and the high (the
 * odd). ARMv8.0: Q itself (SHL 4, SSHR 4; SSHR 4), so four products share
 * an int16 lane. SDOT: 16 · Q (SHL 4; AND 0xF0), one step shorter: the
 * block's sums are 16 times the true ones, |16 · 32 · 8 · 127| < 2^31, and
 * the reduction shifts them back (exact: multiples of 16). */
NB_INLINE void q4_nibbles_v80(int8x16_t p, int8x16_t *lo, int8x16_t *hi)
{
    *lo = vshrq_n_s8(vshlq_n_s8(p, 4), 4);
    *hi = vshrq_n_s8(p, 4);
}

NB_INLINE void q4_nibbles_dp(int8x16_t p, int8x16_t *lo, int8x16_t *hi)
{
    *lo = vshlq_n_s8(p, 4);
    *hi = vandq_s8(p, vdupq_n_s8((int8_t)0xF0));
}

/* The block sums of 4 rows from the change in their reduced running sums. */
NB_INLINE int32x4_t q4_sums_v80(int32x4_t change)
{
    return change;
}

NB_INLINE int32x4_t q4_sums_dp(int32x4_t change)
{
    return vshrq_n_s32(change, 4);
}

/* The rows o .. o + R - 1 (the last row repeated past the matrix): their
 * weights, and for I4 their group scales. */
NB_INLINE void rows_at(const colibri_matrix *w, int i4, size_t o, size_t R, const void **row, const uint16_t **sc)
{
#pragma GCC unroll 8
    for (size_t r = 0; r < R; r++) {
        const size_t orow = o + r < w->rows ? o + r : w->rows - 1;
        if (i4) {
            row[r] = colibri_q4_row(w, orow);
            sc[r] = colibri_q4_scales(w, orow);
        } else {
            row[r] = (const int8_t *)w->data + orow * (size_t)w->cols;
            sc[r] = NULL;
        }
    }
}

/* Group g's f16 scales of 4 rows, widened (exact: validated ±0 or normal). */
NB_INLINE float32x4_t q4_scales4(const uint16_t *const *sc, size_t g)
{
    uint16x4_t h = vdup_n_u16(sc[0][g]);
    h = vld1_lane_u16(sc[1] + g, h, 1);
    h = vld1_lane_u16(sc[2] + g, h, 2);
    h = vld1_lane_u16(sc[3] + g, h, 3);
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

/* ---- 4·H rows for T tokens: v[t · 4H + r] the running value after every
 * block. T and H are constants at every call (the functions are inlined);
 * T · H <= 4. ---- */

#define NB_DEFINE_ROWS(SFX, ATTR)                                                                                \
    /* Block [c, c + n) of the rows for the T tokens (ab[t]: token t's block scale, sg[h]: I4 group scales). */  \
    NB_INLINE ATTR void step_##SFX(int i4, int T, int H, const void *const *row, const int8_t *const *xq,       \
                                   size_t c, size_t n, const float32x4_t *sg, const float *ab, int32x4_t (*S)[8], \
                                   int32x4_t (*prev)[2], float32x4_t (*acc)[2])                                   \
    {                                                                                                            \
        int8x16x2_t x[4];                                                                                        \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                      \
        {                                                                                                        \
            x[t] = load_i8(xq[t] + c, n);                                                                        \
            if (i4) { /* evens, odds: the nibbles' order */                                                      \
                const int8x16_t even = vuzp1q_s8(x[t].val[0], x[t].val[1]);                                      \
                x[t].val[1] = vuzp2q_s8(x[t].val[0], x[t].val[1]);                                               \
                x[t].val[0] = even;                                                                              \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < 4 * H; r++)                                                  \
        {                                                                                                        \
            if (i4) {                                                                                            \
                const int8x16_t p = q4_packed((const uint8_t *)row[r], c, n);                                    \
                int8x16_t lo, hi;                                                                                \
                q4_nibbles_##SFX(p, &lo, &hi);                                                                   \
                _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                              \
                    S[t][r] = dot4_##SFX(S[t][r], lo, x[t].val[0], hi, x[t].val[1]);                            \
            } else {                                                                                             \
                const int8x16x2_t wv = load_i8((const int8_t *)row[r] + c, n);                                   \
                _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                              \
                    S[t][r] = dot8_##SFX(S[t][r], wv.val[0], x[t].val[0], wv.val[1], x[t].val[1]);              \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                      \
            _Pragma("GCC unroll 2") for (int h = 0; h < H; h++)                                                  \
            {                                                                                                    \
                const int32x4_t red = vpaddq_s32(vpaddq_s32(S[t][4 * h], S[t][4 * h + 1]),                       \
                                                 vpaddq_s32(S[t][4 * h + 2], S[t][4 * h + 3]));                  \
                const int32x4_t change = vsubq_s32(red, prev[t][h]);                                             \
                const float32x4_t sum = vcvtq_f32_s32(i4 ? q4_sums_##SFX(change) : change);                       \
                prev[t][h] = red;                                                                                \
                const float32x4_t k = i4 ? vmulq_n_f32(sg[h], ab[t]) : vdupq_n_f32(ab[t]);                       \
                acc[t][h] = vaddq_f32(acc[t][h], vmulq_f32(sum, k));                                             \
            }                                                                                                    \
    }                                                                                                            \
    NB_INLINE ATTR void rows_##SFX(int i4, int T, int H, const colibri_matrix *w, size_t o,                     \
                                   const int8_t *const *xq, const float *const *xa, float *v)                   \
    {                                                                                                            \
        const size_t in = w->cols, group_mask = i4 ? ((size_t)1 << w->q4_group_log2) - 1u : 0u;                \
        const size_t log2 = i4 ? w->q4_group_log2 : 0u;                                                          \
        const void *row[8];                                                                                      \
        const uint16_t *sc[8];                                                                                   \
        rows_at(w, i4, o, (size_t)(4 * H), row, sc);                                                             \
        int32x4_t S[4][8], prev[4][2];                                                                           \
        float32x4_t acc[4][2], sg[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};                                   \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                      \
        {                                                                                                        \
            _Pragma("GCC unroll 8") for (int r = 0; r < 4 * H; r++) S[t][r] = vdupq_n_s32(0);                   \
            _Pragma("GCC unroll 2") for (int h = 0; h < H; h++)                                                  \
            {                                                                                                    \
                prev[t][h] = vdupq_n_s32(0);                                                                     \
                acc[t][h] = vdupq_n_f32(0.0f);                                                                   \
            }                                                                                                    \
        }                                                                                                        \
        float ab[4];                                                                                             \
        size_t c = 0;                                                                                            \
        for (; c + 32 <= in; c += 32) {                                                                          \
            if (i4 && !(c & group_mask))                                                                         \
                _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) sg[h] = q4_scales4(sc + 4 * h, c >> log2);  \
            _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) ab[t] = xa[t][c / 32];                          \
            step_##SFX(i4, T, H, row, xq, c, 32, sg, ab, S, prev, acc);                                          \
        }                                                                                                        \
        if (c < in) {                                                                                            \
            if (i4 && !(c & group_mask))                                                                         \
                for (int h = 0; h < H; h++)                                                                      \
                    sg[h] = q4_scales4(sc + 4 * h, c >> log2);                                                   \
            for (int t = 0; t < T; t++)                                                                          \
                ab[t] = xa[t][c / 32];                                                                           \
            step_##SFX(i4, T, H, row, xq, c, in - c, sg, ab, S, prev, acc);                                      \
        }                                                                                                        \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                      \
            _Pragma("GCC unroll 2") for (int h = 0; h < H; h++)                                                  \
                vst1q_f32(v + (size_t)(t * 4 * H + 4 * h), acc[t][h]);                                           \
    }                                                                                                            \
    /* One row block: 8 rows for one token (H = 2), or 4 rows for T = 1..4. */                                   \
    static ATTR void rows_any_##SFX(int i4, int T, int H, const colibri_matrix *w, size_t o,                     \
                                    const int8_t *const *xq, const float *const *xa, float *v)                  \
    {                                                                                                            \
        switch ((H == 2 ? 0 : T) * 2 + i4) {                                                                     \
        case 0: rows_##SFX(0, 1, 2, w, o, xq, xa, v); break;                                                     \
        case 1: rows_##SFX(1, 1, 2, w, o, xq, xa, v); break;                                                     \
        case 2: rows_##SFX(0, 1, 1, w, o, xq, xa, v); break;                                                     \
        case 3: rows_##SFX(1, 1, 1, w, o, xq, xa, v); break;                                                     \
        case 4: rows_##SFX(0, 2, 1, w, o, xq, xa, v); break;                                                     \
        case 5: rows_##SFX(1, 2, 1, w, o, xq, xa, v); break;                                                     \
        case 6: rows_##SFX(0, 3, 1, w, o, xq, xa, v); break;                                                     \
        case 7: rows_##SFX(1, 3, 1, w, o, xq, xa, v); break;                                                     \
        case 8: rows_##SFX(0, 4, 1, w, o, xq, xa, v); break;                                                     \
        default: rows_##SFX(1, 4, 1, w, o, xq, xa, v); break;                                                    \
        }                                                                                                        \
    }

NB_DEFINE_ROWS(v80, NB_V80)
NB_DEFINE_ROWS(dp, NB_DOTPROD)

typedef void (*nb_rows_fn)(int i4, int T, int H, const colibri_matrix *w, size_t o, const int8_t *const *xq,
                           const float *const *xa, float *v);

/* ---- The end of each output row: the reference's operations in its order ---- */

/* An f16 value (E's, validated finite, maybe subnormal) -> f32 exactly (FCVTL). */
NB_INLINE float half_to_f32(uint16_t h)
{
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

/* v + Σ e · x[col] over row o's E entries in storage order. */
NB_INLINE float add_terms(const colibri_matrix *w, size_t o, const float *xi, float v)
{
    uint32_t k, end;
    colibri_q8_terms(w, o, &k, &end);
    for (; k < end; k++)
        v += half_to_f32(colibri_q8_term_bits(w, k)) * xi[colibri_q8_term_col(w, k)];
    return v;
}

static void epilogue_row(const colibri_matrix *w, int i4, size_t row, float vr, const float *xi, float *yi,
                         const float *b, int acc, float s)
{
    if (!i4)
        vr *= colibri_q8_scale(w, row);
    if (w->q8_ptr)
        vr = add_terms(w, row, xi, vr);
    if (i4 && w->q4_bias)
        vr += colibri_q8_half(w->q4_bias[row]);
    else if (!i4 && w->q8_bias)
        vr += colibri_q8_param(w, (size_t)w->rows + row);
    colibri_emit(yi, row, vr, b, acc, s);
}

NB_INLINE float32x4_t widen4(const uint16_t *h)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
}

/* Rows o .. o + 3, all in the matrix, one vector a step. */
static void epilogue4(const colibri_matrix *w, int i4, size_t o, const float *v, const float *xi, float *yi,
                      const float *b, int acc, float s)
{
    const colibri_q8_block par = colibri_q8_params_at(w, o);
    float32x4_t v4 = vld1q_f32(v);
    if (!i4)
        v4 = vmulq_f32(v4, par.scale_f16 ? widen4(par.scale_f16) : vld1q_f32(par.scale_f32));
    if (w->q8_ptr) {
        float t[4];
        vst1q_f32(t, v4);
        for (size_t r = 0; r < 4; r++)
            t[r] = add_terms(w, o + r, xi, t[r]);
        v4 = vld1q_f32(t);
    }
    if (i4 && w->q4_bias)
        v4 = vaddq_f32(v4, widen4(w->q4_bias + o));
    else if (!i4 && (par.bias_f16 || par.bias_f32))
        v4 = vaddq_f32(v4, par.bias_f16 ? widen4(par.bias_f16) : vld1q_f32(par.bias_f32));
    if (b)
        v4 = vaddq_f32(v4, vld1q_f32(b + o));
    if (acc)
        v4 = vaddq_f32(vld1q_f32(yi + o), vmulq_n_f32(v4, s));
    vst1q_f32(yi + o, v4);
}

static void epilogue(const colibri_matrix *w, int i4, size_t o, size_t R, const float *v, const float *xi, float *yi,
                     const float *b, int acc, float s)
{
    size_t r = 0;
    for (; r + 4 <= R; r += 4)
        epilogue4(w, i4, o + r, v + r, xi, yi, b, acc, s);
    for (; r < R; r++)
        epilogue_row(w, i4, o + r, v[r], xi, yi, b, acc, s);
}

/* ---- The driver ---- */

/* Token i reads x row xrows ? xrows[i] : i (for E) and block rows i of xq;
 * writes y row yrows ? yrows[i] : i, stored (acc 0) or added with gate s_i. */
static void gemm_blocks(nb_rows_fn rows_fn, const float *x, const uint16_t *xrows, const uint16_t *yrows,
                        const float *scale, const colibri_qrows *xq, const colibri_matrix *w, const float *b, float *y,
                        size_t n, int acc)
{
    const int i4 = w->dtype == COLIBRI_DTYPE_I4;
    const size_t in = w->cols, out = w->rows, nb = colibri_act_blocks(in);
    const int H = n == 1 ? 2 : 1;
    const size_t block = (size_t)(4 * H);
    for (size_t o = 0; o < out; o += block) {
        const size_t R = out - o < block ? out - o : block;
        for (size_t i = 0; i < n; i += 4) {
            const int T = n - i < 4 ? (int)(n - i) : 4;
            const int8_t *q[4];
            const float *a[4];
            float v[16];
            for (int t = 0; t < T; t++) {
                q[t] = xq->q + (i + (size_t)t) * in;
                a[t] = xq->a + (i + (size_t)t) * nb;
            }
            rows_fn(i4, T, H, w, o, q, a, v);
            for (int t = 0; t < T; t++) {
                const size_t ti = i + (size_t)t;
                epilogue(w, i4, o, R, v + block * (size_t)t, x + (xrows ? xrows[ti] : ti) * in,
                         y + (yrows ? yrows[ti] : ti) * out, b, acc, scale ? scale[ti] : 1.0f);
            }
        }
    }
}

/* I4 groups below a block's 32 columns take the reference kernel. */
static int reference_only(const colibri_matrix *w)
{
    return w->dtype == COLIBRI_DTYPE_I4 && w->q4_group_log2 < 5;
}

#define NB_DEFINE_LINEAR(SFX)                                                                                    \
    static void linear_blocks_##SFX(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w,    \
                                    const float *b, const colibri_qrows *xq, float *restrict y)                 \
    {                                                                                                            \
        if (reference_only(w))                                                                                   \
            colibri_linear_blocks_ref(x, rows, n, w, b, xq, y);                                                  \
        else if (w->rows && n)                                                                                   \
            gemm_blocks(rows_any_##SFX, x, rows, NULL, NULL, xq, w, b, y, n, 0);                                 \
    }                                                                                                            \
    static void linear_acc_blocks_##SFX(const float *x, size_t n, const colibri_matrix *w, const float *b,     \
                                        const uint16_t *rows, const float *scale, const colibri_qrows *xq,      \
                                        float *restrict y)                                                       \
    {                                                                                                            \
        if (reference_only(w))                                                                                   \
            colibri_linear_acc_blocks_ref(x, n, w, b, rows, scale, xq, y);                                       \
        else if (w->rows && n)                                                                                   \
            gemm_blocks(rows_any_##SFX, x, NULL, rows, scale, xq, w, b, y, n, 1);                                \
    }

NB_DEFINE_LINEAR(v80)
NB_DEFINE_LINEAR(dp)

void colibri_neon_blocks(colibri_kernels *k, int dotprod)
{
    k->linear_blocks = dotprod ? linear_blocks_dp : linear_blocks_v80;
    k->linear_acc_blocks = dotprod ? linear_acc_blocks_dp : linear_acc_blocks_v80;
}

#endif /* COLIBRI_BACKEND_NEON */
