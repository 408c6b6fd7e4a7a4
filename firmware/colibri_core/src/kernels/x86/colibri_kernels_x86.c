/*
 * Optimised backend: x86-64 with AVX2, FMA and F16C, and AVX-512F for the
 * f32-activation GEMM where the CPU has it, chosen by cpuid and xgetbv in
 * colibri_init (colibri_kernels_x86 below). Compiled to nothing unless
 * colibri_backend.h selects it.
 *
 * The file itself is built for baseline x86-64 (no -mavx2): only the kernel
 * functions carry __attribute__((target(...))), so one binary runs on any
 * x86-64 and a CPU without the features keeps the reference kernels. No
 * static state: the features are read at every colibri_init and the choice
 * lives in the context's kernel table.
 *
 * What the kernels do (tolerances: docs/model-format.md "Numerics"):
 *
 * - linear / linear_acc, every weight dtype: the n tokens are a small GEMM.
 *   The output rows are walked in blocks of R rows, and for each block every
 *   group of T <= 4 tokens runs one register-blocked micro-kernel (T x R
 *   accumulators of 8 lanes along the input dimension, FMA), so each weight
 *   load (and its f16 -> f32 or int8 -> f32 widening) serves T tokens and the
 *   weights stream through the cache once per call while the tokens' rows
 *   stay in L1. One token (GEMV) uses R = 8 rows: 8 independent FMA chains,
 *   bandwidth-bound. Tails of the input dimension are zero-padded copies.
 *   With AVX-512F the same driver runs 16-lane accumulators, 4 tokens x 6
 *   rows (24 of the 32 registers): about twice AVX2's throughput at 16-64
 *   tokens on the Sapphire Rapids host it was measured on (1024x256, 16
 *   tokens: 135 us against 314 us), the same at batch 1 (bandwidth-bound).
 *   The reduction order differs from the reference's index order: f32, f16
 *   and q8 with f32 activations agree within the stated tolerance.
 * - q8 with int8 activations: Q · xq in int32 (|Q| <= 128 and |xq| <= 127,
 *   so the sign trick |Q| (u8) x sign(xq, Q) (s8) through maddubs gives pairs
 *   of at most 2 · 128 · 127 = 32512 < 2^15: never saturates), integer sums
 *   are exact (wrapping mod 2^32 as the reference), and the epilogue is the
 *   reference's: bit for bit equal to it. With AVX-512 VNNI, vpdpbusd on
 *   (xq + 128) as u8 and Q as s8, less 128·Σ Q: the same exact sums, about
 *   1.2-1.9x faster than AVX2's in the kernel (16-64 tokens).
 * - With f32 activations and 8 tokens or more, each block of f16 or int8
 *   rows is widened to f32 once (on the stack, at most 24 KiB) and every
 *   token group runs the f32 micro-kernel on it: the same values, so the
 *   same results, without converting the weights again per group of 4.
 * - Epilogue (emit_rows): per token, the block's outputs four rows at a time
 *   with the reference's IEEE operations in its order; I8 scales and
 *   companion biases are loaded four at a time through the block accessors
 *   (colibri_q8_params_at, widened by F16C), the compensation entries added
 *   row by row in storage order (colibri_q8_terms): q8 x int8 stays bit for
 *   bit the reference's.
 * - activation: every kind vectorised with the engine's own exp, tanh and
 *   erf (colibri_math.h) done in double exactly as the scalar ones (each
 *   branch computed, the lane's picked), in the same operation order and
 *   without FMA (those functions are compiled for AVX2 only, so nothing can
 *   be contracted; AVX-512's exp uses explicitly rounded intrinsics): bit for
 *   bit equal to the reference.
 * - I4 weights (format v5): with int8 activations, and with f32 ones below
 *   4 tokens, x86/colibri_kernels_x86_q4.c, AVX2 at every level (a file of
 *   its own, so this one's compile time does not grow); with f32 activations
 *   from 4 tokens on, each row block widened to f32 (Q · s_g, exact) once
 *   and the f32 micro-kernels above over it (gemm_i4_*, X86_I4_WIDE_MAX).
 * - attend (token models' attention): x86/colibri_kernels_x86_lm.c.
 * - quantize_rows, mul, add: vectorised, bit for bit equal to the reference.
 * - layernorm, rmsnorm: the reference's (not hot in the models timed).
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_X86)

#include <cpuid.h>
#include <immintrin.h>
#include <math.h>

#include "../../colibri_math.h"
#include "colibri_format.h"
#include "colibri_x86_terms.h"

#define X86_GEMM __attribute__((target("avx2,fma,f16c")))
#define X86_GEMM512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define X86_GEMM512VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))
/* Element-wise kernels that must round as the reference: AVX2 without FMA,
 * so no multiply-add can be fused even where contraction is allowed. */
#define X86_EXACT __attribute__((target("avx2")))
/* The same with AVX-512F, whose FMA cannot be left out of the target: its
 * double arithmetic goes through the explicitly rounded intrinsics
 * (_mm512_mul_round_pd ...), which the compiler never contracts. */
#define X86_EXACT512 __attribute__((target("avx512f,avx2")))
#define X86_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* The micro-kernels are specialised by forced inlining: tile shape, dtype
 * and token count become constants, at the price of ~500 KB of code and a
 * 90 s -O2 compile. The sanitizer builds check this same source for memory
 * errors and undefined behaviour, not its schedule, so they inline as the
 * compiler likes: seconds instead of 13 minutes under ASan. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define X86_UNSPECIALISED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define X86_UNSPECIALISED 1
#endif
#ifdef X86_UNSPECIALISED
#define X86_INLINE static inline
#else
#define X86_INLINE static inline __attribute__((always_inline))
#endif

/* DT_I8Q: I8 weights with int8 activations. A driver instance is specialised
 * for one of these, so the f32-activation GEMMs carry no int8 path (its code
 * changed their register allocation) and the int8 one no widening. */
enum { DT_F32, DT_F16, DT_I8, DT_I4, DT_I8Q };

/* ---- Linear layers, f32 / f16 / int8 weights with f32 activations ---- */

/* Eight weights of a row from element k, widened to f32. */
X86_INLINE X86_GEMM __m256 load_w8(int dt, const void *row, size_t k)
{
    if (dt == DT_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
    if (dt == DT_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + k))));
    return _mm256_loadu_ps((const float *)row + k);
}

/* The last in - k (< 8) weights of a row, widened, zero-padded. */
X86_INLINE X86_GEMM __m256 load_w_tail(int dt, const void *row, size_t k, size_t in)
{
    float buf[8] = {0};
    for (size_t j = k; j < in; j++) {
        if (dt == DT_F16)
            buf[j - k] = colibri_f16_to_f32(((const uint16_t *)row)[j]);
        else if (dt == DT_I8)
            buf[j - k] = (float)((const int8_t *)row)[j];
        else
            buf[j - k] = ((const float *)row)[j];
    }
    return _mm256_loadu_ps(buf);
}

X86_INLINE X86_GEMM __m256 load_x_tail(const float *x, size_t k, size_t in)
{
    float buf[8] = {0};
    for (size_t j = k; j < in; j++)
        buf[j - k] = x[j];
    return _mm256_loadu_ps(buf);
}

/* The four horizontal sums of a, b, c, d, in a fixed order. */
X86_INLINE X86_GEMM __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Reduces the T·R accumulators to v[t·R + r], four rows of a token per
 * store (the chunks emit_rows loads back, so the stores forward to its
 * loads); a token's last chunk may write up to 3 floats past its rows,
 * which the next token's chunk rewrites: v holds T·R + 3 floats. */
X86_INLINE X86_GEMM void reduce_block(const __m256 *acc, int T, int R, float *v)
{
    const __m256 z = _mm256_setzero_ps();
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r += 4) {
            const __m256 *a = acc + t * R + r;
            _mm_storeu_ps(v + t * R + r, hsum4(a[0], r + 1 < R ? a[1] : z, r + 2 < R ? a[2] : z, r + 3 < R ? a[3] : z));
        }
}

/* v[t·R + r] = row (o + r) of W · x_t, for t < T, r < R. */
X86_INLINE X86_GEMM void dot_block(int dt, int T, int R, const void *W, size_t in, size_t o,
                                   const float *const *xr, float *v)
{
    const size_t esize = dt == DT_F32 ? 4 : dt == DT_F16 ? 2 : 1;
    const char *wr[8];
    __m256 acc[32];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        wr[r] = (const char *)W + (o + (size_t)r) * in * esize;
#pragma GCC unroll 32
    for (int i = 0; i < T * R; i++)
        acc[i] = _mm256_setzero_ps();

    size_t k = 0;
    for (; k + 8 <= in; k += 8) {
        __m256 xv[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm256_loadu_ps(xr[t] + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256 wv = load_w8(dt, wr[r], k);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[t * R + r] = _mm256_fmadd_ps(wv, xv[t], acc[t * R + r]);
        }
    }
    if (k < in) {
        __m256 xv[4];
        for (int t = 0; t < T; t++)
            xv[t] = load_x_tail(xr[t], k, in);
        for (int r = 0; r < R; r++) {
            const __m256 wv = load_w_tail(dt, wr[r], k, in);
            for (int t = 0; t < T; t++)
                acc[t * R + r] = _mm256_fmadd_ps(wv, xv[t], acc[t * R + r]);
        }
    }
    reduce_block(acc, T, R, v);
}

/* dot_block with 16 lanes (AVX-512F): the same products, the 16-lane sums
 * folded to 8 lanes before the input dimension's tail of 8 and the
 * zero-padded rest, then reduced as dot_block's. */
X86_INLINE X86_GEMM512 void dot_block512(int dt, int T, int R, const void *W, size_t in, size_t o,
                                         const float *const *xr, float *v)
{
    const size_t esize = dt == DT_F32 ? 4 : dt == DT_F16 ? 2 : 1;
    const char *wr[8];
    __m512 acc[32];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        wr[r] = (const char *)W + (o + (size_t)r) * in * esize;
#pragma GCC unroll 32
    for (int i = 0; i < T * R; i++)
        acc[i] = _mm512_setzero_ps();

    /* One token (GEMV) of f16 or int8 weights: the rows two blocks ahead
     * are prefetched, a cache line per row as k passes it (beyond the
     * matrix a prefetch is a no-op: it never faults). f32 rows stream fast
     * enough for the hardware prefetcher: measured 5% slower with it. */
    const size_t ahead = 2 * (size_t)R * in * esize;
    size_t k = 0;
    for (; k + 16 <= in; k += 16) {
        __m512 xv[4];
        if (T == 1 && esize < 4 && !((k * esize) & 63))
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                _mm_prefetch(wr[r] + ahead + k * esize, _MM_HINT_T0);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_loadu_ps(xr[t] + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 wv;
            if (dt == DT_F16)
                wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)wr[r] + k)));
            else if (dt == DT_I8)
                wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)wr[r] + k))));
            else
                wv = _mm512_loadu_ps((const float *)wr[r] + k);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[t * R + r] = _mm512_fmadd_ps(wv, xv[t], acc[t * R + r]);
        }
    }
    __m256 a8[32];
#pragma GCC unroll 32
    for (int i = 0; i < T * R; i++)
        a8[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)));
    if (k + 8 <= in) {
        for (int r = 0; r < R; r++) {
            const __m256 wv = load_w8(dt, wr[r], k);
            for (int t = 0; t < T; t++)
                a8[t * R + r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[t] + k), a8[t * R + r]);
        }
        k += 8;
    }
    if (k < in) {
        for (int r = 0; r < R; r++) {
            const __m256 wv = load_w_tail(dt, wr[r], k, in);
            for (int t = 0; t < T; t++)
                a8[t * R + r] = _mm256_fmadd_ps(wv, load_x_tail(xr[t], k, in), a8[t * R + r]);
        }
    }
    reduce_block(a8, T, R, v);
}

/* ---- q8 with int8 activations: exact int32 dot products ---- */

X86_INLINE X86_GEMM __m256i load_q_tail(const int8_t *p, size_t k, size_t in)
{
    int8_t buf[32] = {0};
    for (size_t j = k; j < in; j++)
        buf[j - k] = p[j];
    return _mm256_loadu_si256((const __m256i *)buf);
}

/* Pairwise Q·xq of 32 int8 into 8 int32: |Q| as u8 times xq with Q's sign. */
X86_INLINE X86_GEMM __m256i dot32(__m256i wabs, __m256i wv, __m256i xv, __m256i ones)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)), ones);
}

X86_INLINE X86_GEMM int32_t hsum_i32(__m256i a)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* v[t·R + r] = Σ_j Q_(o+r)j · xq_tj in int32 (wrapping, as the reference). */
X86_INLINE X86_GEMM void dot_block_q8q8(int T, int R, const int8_t *W, size_t in, size_t o,
                                        const int8_t *const *xq, int32_t *v)
{
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *wr[8];
    __m256i acc[32];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        wr[r] = W + (o + (size_t)r) * in;
#pragma GCC unroll 32
    for (int i = 0; i < T * R; i++)
        acc[i] = _mm256_setzero_si256();

    size_t k = 0;
    for (; k + 32 <= in; k += 32) {
        __m256i xv[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm256_loadu_si256((const __m256i *)(xq[t] + k));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wr[r] + k));
            const __m256i wabs = _mm256_abs_epi8(wv);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[t * R + r] = _mm256_add_epi32(acc[t * R + r], dot32(wabs, wv, xv[t], ones));
        }
    }
    if (k < in) {
        __m256i xv[4];
        for (int t = 0; t < T; t++)
            xv[t] = load_q_tail(xq[t], k, in);
        for (int r = 0; r < R; r++) {
            const __m256i wv = load_q_tail(wr[r], k, in);
            const __m256i wabs = _mm256_abs_epi8(wv);
            for (int t = 0; t < T; t++)
                acc[t * R + r] = _mm256_add_epi32(acc[t * R + r], dot32(wabs, wv, xv[t], ones));
        }
    }
    for (int i = 0; i < T * R; i++)
        v[i] = hsum_i32(acc[i]);
}

/* The same sums with AVX-512 VNNI (vpdpbusd: four u8 x s8 products added to
 * each int32 lane, wrapping). xq + 128 (its sign bit flipped) is the u8
 * operand, so Σ (xq + 128)·Q - 128·Σ Q = Σ Q·xq, exactly in wrapping int32
 * arithmetic, for any int8 values; 128·Σ Q is summed per row alongside. */
X86_INLINE X86_GEMM512VNNI void dot_block_q8q8_vnni(int T, int R, const int8_t *W, size_t in, size_t o,
                                                     const int8_t *const *xq, int32_t *v)
{
    const __m512i flip = _mm512_set1_epi8(-128), c128 = _mm512_set1_epi8(-128); /* 0x80: 128 as u8 */
    const int8_t *wr[8];
    __m512i acc[32], rsum[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        wr[r] = W + (o + (size_t)r) * in;
        rsum[r] = _mm512_setzero_si512();
    }
#pragma GCC unroll 32
    for (int i = 0; i < T * R; i++)
        acc[i] = _mm512_setzero_si512();

    const size_t ahead = 2 * (size_t)R * in; /* as dot_block512's prefetch */
    size_t k = 0;
    for (; k + 64 <= in; k += 64) {
        __m512i xv[4];
        if (T == 1)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)wr[r] + ahead + k, _MM_HINT_T0);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_xor_si512(_mm512_loadu_si512(xq[t] + k), flip);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512i wv = _mm512_loadu_si512(wr[r] + k);
            rsum[r] = _mm512_dpbusd_epi32(rsum[r], c128, wv);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[t * R + r] = _mm512_dpbusd_epi32(acc[t * R + r], xv[t], wv);
        }
    }
    if (k < in) { /* masked loads, zeros beyond: the padding adds 128 · 0 to both sums */
        const __mmask64 m = ~0ull >> (64 - (in - k));
        __m512i xv[4];
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, xq[t] + k), flip);
        for (int r = 0; r < R; r++) {
            const __m512i wv = _mm512_maskz_loadu_epi8(m, wr[r] + k);
            rsum[r] = _mm512_dpbusd_epi32(rsum[r], c128, wv);
            for (int t = 0; t < T; t++)
                acc[t * R + r] = _mm512_dpbusd_epi32(acc[t * R + r], xv[t], wv);
        }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++)
            v[t * R + r] = _mm512_reduce_add_epi32(_mm512_sub_epi32(acc[t * R + r], rsum[r]));
}

/* ---- The GEMM driver shared by linear and linear_acc ---- */

/* One call's tokens: token i reads x row xrow(i) (and int8 row i of xq),
 * and writes y row yrow(i), stored (acc 0) or added with gate s_i. */
typedef struct gemm_args {
    const float *x;
    const uint16_t *xrows;   /* x row of token i: xrows ? xrows[i] : i */
    const uint16_t *yrows;   /* y row of token i: yrows ? yrows[i] : i */
    const float *scale;      /* gate s_i, or NULL: 1 */
    const colibri_qrows *xq; /* int8 rows (I8 weights with INT8_ACT), or NULL */
    const colibri_matrix *w;
    const float *b;
    float *y;
    int acc;
} gemm_args;

/* Four scales (or companion biases) of a colibri_q8_block from row r on,
 * widened exactly (F16C's conversion is exact for every f16). */
X86_INLINE X86_GEMM __m128 q8_four(const uint16_t *h, const float *f, int r)
{
    if (h)
        return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(h + r)));
    return _mm_loadu_ps(f + r);
}

X86_INLINE X86_GEMM float q8_one(const uint16_t *h, const float *f, int r)
{
    return h ? _cvtsh_ss(h[r]) : f[r];
}

/* The end of outputs o .. o + R - 1 of token i from their R sums: v the
 * f32-activation dot products (rewritten in place), or vi the int32 sums
 * of q8 x int8 (then v is scratch). Per output, the reference's operations
 * in its order (colibri_q8_scale, colibri_q8_compensate, colibri_emit),
 * through the q8 block accessors and four rows at a time where they are
 * element-wise (no FMA: the engine builds with -ffp-contract=off). */
#define EMIT_ALL 0   /* scale, E, biases, emit */
#define EMIT_SCALE 1 /* the I8 scale only (v written), before terms_tokens */
#define EMIT_REST 2  /* after terms_tokens: the biases and the emit */
X86_INLINE X86_GEMM void emit_rows(const gemm_args *g, int dt, int R, size_t i, size_t o, float *v,
                                   const int32_t *vi, int phase)
{
    const colibri_matrix *w = g->w;
    const size_t in = w->cols, out = w->rows;
    float *yi = g->y + (g->yrows ? g->yrows[i] : i) * out;
    const float s = g->scale ? g->scale[i] : 1.0f;
    int r;
    if (dt == DT_I8) {
        const colibri_q8_block p = colibri_q8_params_at(w, o);
        if (phase == EMIT_REST) {
            /* v was scaled by the EMIT_SCALE pass */
        } else if (vi) { /* (float)sum · (s_o · a) */
            const float a = g->xq->a[i];
            for (r = 0; r + 4 <= R; r += 4)
                _mm_storeu_ps(v + r, _mm_mul_ps(_mm_cvtepi32_ps(_mm_setr_epi32(vi[r], vi[r + 1], vi[r + 2], vi[r + 3])),
                                                _mm_mul_ps(q8_four(p.scale_f16, p.scale_f32, r), _mm_set1_ps(a))));
            for (; r < R; r++)
                v[r] = (float)vi[r] * (q8_one(p.scale_f16, p.scale_f32, r) * a);
        } else { /* v · s_o */
            for (r = 0; r + 4 <= R; r += 4)
                _mm_storeu_ps(v + r, _mm_mul_ps(_mm_loadu_ps(v + r), q8_four(p.scale_f16, p.scale_f32, r)));
            for (; r < R; r++)
                v[r] *= q8_one(p.scale_f16, p.scale_f32, r);
        }
        if (phase == EMIT_SCALE)
            return;
        if (w->q8_ptr && phase == EMIT_ALL) /* + Σ e · x[col], row by row in storage order */
            colibri_x86_e_terms(w, o, R, g->x + (g->xrows ? g->xrows[i] : i) * in, v);
        if (p.bias_f16 || p.bias_f32) { /* + the companion's bias */
            for (r = 0; r + 4 <= R; r += 4)
                _mm_storeu_ps(v + r, _mm_add_ps(_mm_loadu_ps(v + r), q8_four(p.bias_f16, p.bias_f32, r)));
            for (; r < R; r++)
                v[r] += q8_one(p.bias_f16, p.bias_f32, r);
        }
    }
    if (phase == EMIT_SCALE)
        return;
    if (dt == DT_I4) { /* + Σ e · x[col] in storage order, + the companion bias (colibri_q4_epilogue) */
        if (w->q8_ptr && phase == EMIT_ALL)
            colibri_x86_e_terms(w, o, R, g->x + (g->xrows ? g->xrows[i] : i) * in, v);
        if (w->q4_bias)
            for (r = 0; r < R; r++)
                v[r] += _cvtsh_ss(w->q4_bias[o + (size_t)r]);
    }
    /* colibri_emit: + b, then store or add s · v */
    for (r = 0; r + 4 <= R; r += 4) {
        __m128 x = _mm_loadu_ps(v + r);
        float *yo = yi + o + (size_t)r;
        if (g->b)
            x = _mm_add_ps(x, _mm_loadu_ps(g->b + o + (size_t)r));
        if (g->acc)
            x = _mm_add_ps(_mm_loadu_ps(yo), _mm_mul_ps(_mm_set1_ps(s), x));
        _mm_storeu_ps(yo, x);
    }
    for (; r < R; r++)
        colibri_emit(yi, o + (size_t)r, v[r], g->b, g->acc, s);
}

/* E of rows o .. o + R - 1 for tokens i .. i + T - 1 (2 <= T <= 4) at
 * once, the tokens in the lanes: v[t·R + r] += e · x_t[col] over row o + r's
 * entries in storage order (colibri_q8_terms, colibri_q8_term_col: read in
 * place, bounded where they are used), each product rounded, then added:
 * per token the reference's operations in its order, so colibri_x86_e_terms'
 * bits, with each entry read once for the T tokens instead of once each.
 * x is gathered with 64-bit offsets (a row index times cols may pass 2^31);
 * lanes from T on read token i's row and are never stored. */
X86_INLINE X86_GEMM void terms_tokens(const gemm_args *g, int T, int R, size_t i, size_t o, float *v)
{
    const colibri_matrix *w = g->w;
    const size_t in = w->cols;
    int64_t base[4];
    for (int t = 0; t < 4; t++) {
        const size_t ti = i + (size_t)(t < T ? t : 0);
        base[t] = (int64_t)((g->xrows ? g->xrows[ti] : ti) * in);
    }
    const __m256i vbase = _mm256_loadu_si256((const __m256i *)base);
    for (int r = 0; r < R; r++) {
        uint32_t k, end;
        colibri_q8_terms(w, o + (size_t)r, &k, &end);
        if (k >= end)
            continue;
        float lane[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int t = 0; t < T; t++)
            lane[t] = v[t * R + r];
        __m128 acc = _mm_loadu_ps(lane);
        for (; k < end; k++) {
            const __m256i at = _mm256_add_epi64(vbase, _mm256_set1_epi64x((long long)colibri_q8_term_col(w, k)));
            const __m128 e = _mm_set1_ps(_cvtsh_ss(colibri_q8_term_bits(w, k)));
            acc = _mm_add_ps(acc, _mm_mul_ps(e, _mm256_i64gather_ps(g->x, at, 4)));
        }
        _mm_storeu_ps(lane, acc);
        for (int t = 0; t < T; t++)
            v[t * R + r] = lane[t];
    }
}

/* Rows [o, o + R) of an f16 or int8 matrix [*, in], widened to f32 into
 * wide [R, in] (exact conversions). At most X86_WIDEN_MAX floats: the
 * largest row block (6 rows) of a 1024-wide matrix, 24 KiB of stack. */
#define X86_WIDEN_MAX 6144
X86_INLINE X86_GEMM void widen_rows(int dt, const void *W, size_t o, size_t R, size_t in, float *wide)
{
    const size_t count = R * in;
    size_t k = 0;
    if (dt == DT_F16) {
        const uint16_t *h = (const uint16_t *)W + o * in;
        for (; k + 8 <= count; k += 8)
            _mm256_storeu_ps(wide + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + k))));
        for (; k < count; k++)
            wide[k] = _cvtsh_ss(h[k]);
    } else {
        const int8_t *q = (const int8_t *)W + o * in;
        for (; k + 8 <= count; k += 8)
            _mm256_storeu_ps(wide + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k)))));
        for (; k < count; k++)
            wide[k] = (float)q[k];
    }
}

/* I4 rows widened for the f32 micro-kernels, from 4 tokens on (fewer, and
 * matrices wider than this many columns, take the fused kernel of
 * x86/colibri_kernels_x86_q4.c, which decodes the weights per token pair):
 * 6 rows of up to 2048 columns (48 KiB of stack), one row of up to 12288.
 * The fused kernel sums as the micro-kernel of its level does (AVX2: 8
 * lanes along the columns; AVX-512: 16 lanes folded to 8; the same
 * reduction), so a token's outputs have the same bits whatever the call's
 * token count: a prompt's last token alone (colibri_lm_forward's last-token
 * logits) gets its bits in the whole call. Threads split a call's tokens in
 * chunks of 4 or more (colibri_engine.c), so their bits are one thread's. */
#define X86_I4_WIDE_MAX 12288

/* Whether one token's pass over W should read it one row after another
 * (R = 1) rather than R_ONE rows side by side. From memory, R_ONE rows read
 * in step are R_ONE streams a row apart, and some cores' prefetchers do not
 * keep up with them: on an AMD EPYC (Zen 4) a 1408 x 512 f16 matrix streamed
 * at 10.6 GB/s in blocks of 8 rows and 21 GB/s one row at a time (the core's
 * plain read rate), f32 at 16.5 and 22 GB/s (make bench-lm-stream). From
 * the cache the 8 rows win (a row's single accumulator waits on its FMA's
 * latency, and each row pays its own horizontal sum): the tiny models'
 * decode ran 25-50% slower with R = 1, and the edge feature model (experts
 * of 256 K weights, f32: 1 MiB) took 2.7 times the instructions. So only
 * matrices of 512 K weights or more (an f16 MiB, two f32 MiB: the 100 M-class
 * token models' experts and heads, read from memory at every token) go row
 * by row. Each row's sum is the same sequence of operations either way: the
 * bits do not change. The int8 conversions keep R_ONE: one row of them is
 * bound by the arithmetic (9.7 GB/s either way). */
#define X86_STREAM_WEIGHTS (512u * 1024u)

static inline int streamed(const colibri_matrix *w)
{
    return (size_t)w->rows * w->cols >= X86_STREAM_WEIGHTS;
}

/* The driver, once per instruction set: SFX names it, TGT is its target
 * attribute, DOT its f32-activation micro-kernel, Q8DOT its q8 x int8 one.
 * R_ONE rows per block for one token, R_FEW for two or three, R_MANY with
 * groups of four tokens; Q4WIDEN widens I4 rows (its level's conversions). */
#define X86_DEFINE_GEMM(SFX, TGT, DOT, Q8DOT, R_ONE, R_FEW, R_MANY, Q4WIDEN)                              \
    /* Rows [o, o + R) for tokens [i, i + T); the f32-activation products read                     \
     * rows [wo, wo + R) of W, of dtype ddt (the matrix's, or its rows widened).                   \
     */                                                                                            \
    X86_INLINE TGT void block_##SFX(const gemm_args *g, int dt, int T, int R, size_t i, size_t o,  \
                                    int ddt, const void *W, size_t wo)                             \
    {                                                                                              \
        const colibri_matrix *w = g->w;                                                            \
        const size_t in = w->cols;                                                                 \
        if (dt == DT_I8Q) {                                                                        \
            const int8_t *xq[4] = {NULL};                                                          \
            int32_t vi[32];                                                                        \
            float v[32];                                                                           \
            for (int t = 0; t < T; t++)                                                            \
                xq[t] = g->xq->q + (i + (size_t)t) * in;                                           \
            Q8DOT(T, R, w->data, in, o, xq, vi);                                                   \
            if (T > 1 && w->q8_ptr) {                                                              \
                for (int t = 0; t < T; t++)                                                        \
                    emit_rows(g, DT_I8, R, i + (size_t)t, o, v + t * R, vi + t * R, EMIT_SCALE);   \
                terms_tokens(g, T, R, i, o, v);                                                    \
                for (int t = 0; t < T; t++)                                                        \
                    emit_rows(g, DT_I8, R, i + (size_t)t, o, v + t * R, NULL, EMIT_REST);          \
                return;                                                                            \
            }                                                                                      \
            for (int t = 0; t < T; t++)                                                            \
                emit_rows(g, DT_I8, R, i + (size_t)t, o, v + t * R, vi + t * R, EMIT_ALL);         \
            return;                                                                                \
        }                                                                                          \
        const float *xr[4] = {NULL};                                                               \
        float v[32];                                                                               \
        for (int t = 0; t < T; t++)                                                                \
            xr[t] = g->x + (g->xrows ? g->xrows[i + (size_t)t] : i + (size_t)t) * in;              \
        DOT(ddt, T, R, W, in, wo, xr, v);                                                          \
        if (T > 1 && w->q8_ptr && (dt == DT_I8 || dt == DT_I4)) {                                  \
            for (int t = 0; t < T; t++)                                                            \
                emit_rows(g, dt, R, i + (size_t)t, o, v + t * R, NULL, EMIT_SCALE);                \
            terms_tokens(g, T, R, i, o, v);                                                        \
            for (int t = 0; t < T; t++)                                                            \
                emit_rows(g, dt, R, i + (size_t)t, o, v + t * R, NULL, EMIT_REST);                 \
            return;                                                                                \
        }                                                                                          \
        for (int t = 0; t < T; t++)                                                                \
            emit_rows(g, dt, R, i + (size_t)t, o, v + t * R, NULL, EMIT_ALL);                      \
    }                                                                                              \
                                                                                                   \
    /* All tokens for rows [o, o + R): token groups of 4, then the rest. ddt                      \
     * is a constant at each call, so the micro-kernel is specialised for it.                      \
     */                                                                                            \
    X86_INLINE TGT void groups_##SFX(const gemm_args *g, int dt, int R, size_t n, size_t o,        \
                                     int ddt, const void *W, size_t wo)                            \
    {                                                                                              \
        size_t i = 0;                                                                              \
        for (; i + 4 <= n; i += 4)                                                                 \
            block_##SFX(g, dt, 4, R, i, o, ddt, W, wo);                                            \
        switch (n - i) {                                                                           \
        case 3:                                                                                    \
            block_##SFX(g, dt, 3, R, i, o, ddt, W, wo);                                            \
            break;                                                                                 \
        case 2:                                                                                    \
            block_##SFX(g, dt, 2, R, i, o, ddt, W, wo);                                            \
            break;                                                                                 \
        case 1:                                                                                    \
            block_##SFX(g, dt, 1, R, i, o, ddt, W, wo);                                            \
            break;                                                                                 \
        default:                                                                                   \
            break;                                                                                 \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Rows [o, o + R) for all tokens. With f32 activations and 8 tokens or                        \
     * more, f16 and int8 rows are widened to f32 once (exactly: the same                          \
     * values) instead of once per token group.                                                    \
     */                                                                                            \
    X86_INLINE TGT void row_block_##SFX(const gemm_args *g, int dt, int R, size_t n, size_t o)     \
    {                                                                                              \
        const size_t in = g->w->cols;                                                              \
        if (dt != DT_F32 && dt != DT_I8Q && n >= 8 && (size_t)R * in <= X86_WIDEN_MAX) {          \
            float wide[X86_WIDEN_MAX];                                                             \
            widen_rows(dt, g->w->data, o, (size_t)R, in, wide);                                    \
            groups_##SFX(g, dt, R, n, o, DT_F32, wide, 0);                                         \
        } else {                                                                                   \
            groups_##SFX(g, dt, R, n, o, dt, g->w->data, o);                                       \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Rows in blocks of R (the rest one at a time), all tokens per block,                         \
     * so each weight row is read from memory once per call. */                                    \
    X86_INLINE TGT void gemm_rows_##SFX(const gemm_args *g, int dt, int R, size_t n)               \
    {                                                                                              \
        const size_t out = g->w->rows;                                                             \
        size_t o = 0;                                                                              \
        for (; o + (size_t)R <= out; o += (size_t)R)                                               \
            row_block_##SFX(g, dt, R, n, o);                                                       \
        for (; o < out; o++)                                                                       \
            row_block_##SFX(g, dt, 1, n, o);                                                       \
    }                                                                                              \
                                                                                                   \
    X86_INLINE TGT void gemm_dt_##SFX(const gemm_args *g, int dt, size_t n)                        \
    {                                                                                              \
        if (n == 1)                                                                                \
            gemm_rows_##SFX(g, dt, R_ONE, n);                                                      \
        else if (n < 4)                                                                            \
            gemm_rows_##SFX(g, dt, R_FEW, n);                                                      \
        else                                                                                       \
            gemm_rows_##SFX(g, dt, R_MANY, n);                                                     \
    }                                                                                              \
    /* I4 with f32 activations, 4 tokens or more: each block of rows widened                       \
     * to f32 (Q · s_g, exact) once for all the call's tokens, then the f32                        \
     * micro-kernel over them.                                                                     \
     */                                                                                            \
    X86_INLINE TGT void i4_rows_##SFX(const gemm_args *g, int R, size_t n)                         \
    {                                                                                              \
        const size_t in = g->w->cols, out = g->w->rows;                                            \
        float wide[X86_I4_WIDE_MAX];                                                               \
        size_t o = 0;                                                                              \
        if ((size_t)R * in <= X86_I4_WIDE_MAX)                                                     \
            for (; o + (size_t)R <= out; o += (size_t)R) {                                         \
                Q4WIDEN(g->w, o, (size_t)R, wide);                                                 \
                groups_##SFX(g, DT_I4, R, n, o, DT_F32, wide, 0);                                  \
            }                                                                                      \
        for (; o < out; o++) {                                                                     \
            Q4WIDEN(g->w, o, 1, wide);                                                             \
            groups_##SFX(g, DT_I4, 1, n, o, DT_F32, wide, 0);                                      \
        }                                                                                          \
    }                                                                                              \
    static TGT __attribute__((noinline, unused)) void gemm_i4_##SFX(const gemm_args *g, size_t n)          \
    {                                                                                              \
        i4_rows_##SFX(g, R_MANY, n);                                                               \
    }                                                                                              \
    static TGT __attribute__((noinline, unused)) void gemm_f32_##SFX(const gemm_args *g, size_t n)         \
    {                                                                                              \
        if (n == 1 && streamed(g->w))                                                              \
            gemm_rows_##SFX(g, DT_F32, 1, n);                                                        \
        else                                                                                       \
            gemm_dt_##SFX(g, DT_F32, n);                                                           \
    }                                                                                              \
    static TGT __attribute__((noinline, unused)) void gemm_f16_##SFX(const gemm_args *g, size_t n)         \
    {                                                                                              \
        if (n == 1 && streamed(g->w))                                                              \
            gemm_rows_##SFX(g, DT_F16, 1, n);                                                        \
        else                                                                                       \
            gemm_dt_##SFX(g, DT_F16, n);                                                           \
    }                                                                                              \
    static TGT __attribute__((noinline, unused)) void gemm_i8_##SFX(const gemm_args *g, size_t n)          \
    {                                                                                              \
        gemm_dt_##SFX(g, DT_I8, n);                                                                \
    }

/* AVX2: 8 accumulators of 8 lanes (4 tokens x 2 rows; 8 rows for one token). */
X86_DEFINE_GEMM(avx2, X86_GEMM, dot_block, dot_block_q8q8, 8, 4, 2, colibri_x86_q4_widen)
/* AVX-512F: 24 accumulators of 16 lanes (4 tokens x 6 rows) of the 32 registers. */
X86_DEFINE_GEMM(avx512, X86_GEMM512, dot_block512, dot_block_q8q8, 8, 4, 6, colibri_x86_q4_widen512)
/* AVX-512 VNNI, used for q8 x int8 only: 16 + 4 accumulators (4 tokens x 4 rows). */
X86_DEFINE_GEMM(vnni, X86_GEMM512VNNI, dot_block512, dot_block_q8q8_vnni, 8, 4, 4, colibri_x86_q4_widen512)

static X86_GEMM __attribute__((noinline)) void gemm_q8q8(const gemm_args *g, size_t n)
{
    gemm_dt_avx2(g, DT_I8Q, n);
}

static X86_GEMM512VNNI __attribute__((noinline)) void gemm_q8q8_vnni(const gemm_args *g, size_t n)
{
    gemm_dt_vnni(g, DT_I8Q, n);
}

/* avx512: 0 AVX2, 1 AVX-512F, 2 AVX-512F and VNNI. */
static void gemm(const gemm_args *g, size_t n, int avx512)
{
    if (n == 0)
        return;
    switch (g->w->dtype) {
    case COLIBRI_DTYPE_F16:
        if (avx512)
            gemm_f16_avx512(g, n);
        else
            gemm_f16_avx2(g, n);
        break;
    case COLIBRI_DTYPE_I8:
        if (g->xq && avx512 == 2)
            gemm_q8q8_vnni(g, n);
        else if (g->xq)
            gemm_q8q8(g, n);
        else if (avx512)
            gemm_i8_avx512(g, n);
        else
            gemm_i8_avx2(g, n);
        break;
    case COLIBRI_DTYPE_I4: /* int8 activations: x86/colibri_kernels_x86_q4.c, AVX2 */
        if (g->xq || n < 4 || g->w->cols > X86_I4_WIDE_MAX)
            colibri_x86_q4_gemm(g->x, g->xrows, g->yrows, g->scale, g->xq, g->w, g->b, g->y, n, g->acc, avx512);
        else if (avx512)
            gemm_i4_avx512(g, n);
        else
            gemm_i4_avx2(g, n);
        break;
    default: /* F32; weight dtypes are validated */
        if (avx512)
            gemm_f32_avx512(g, n);
        else
            gemm_f32_avx2(g, n);
        break;
    }
}

#define X86_DEFINE_LINEAR(SFX, AVX512)                                                                      \
    static void linear_##SFX(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w,         \
                             const float *b, const colibri_qrows *xq, float *restrict y)                      \
    {                                                                                                         \
        const gemm_args g = {x, rows, NULL, NULL, w->dtype == COLIBRI_DTYPE_I8 || w->dtype == COLIBRI_DTYPE_I4 ? xq : NULL, w, b, y, 0};      \
        gemm(&g, n, AVX512);                                                                                  \
    }                                                                                                         \
    static void linear_acc_##SFX(const float *x, size_t n, const colibri_matrix *w, const float *b,           \
                                 const uint16_t *rows, const float *scale, const colibri_qrows *xq,           \
                                 float *restrict y)                                                           \
    {                                                                                                         \
        const gemm_args g = {x, NULL, rows, scale, w->dtype == COLIBRI_DTYPE_I8 || w->dtype == COLIBRI_DTYPE_I4 ? xq : NULL, w, b, y, 1};     \
        gemm(&g, n, AVX512);                                                                                  \
    }
X86_DEFINE_LINEAR(avx2, 0)
X86_DEFINE_LINEAR(avx512, 1)
X86_DEFINE_LINEAR(vnni, 2)

/* ---- Element-wise kernels, bit for bit the reference's ---- */

/* colibri_expf of 4 floats (as doubles, all within [MIN_NONZERO, MAX_FINITE]),
 * the same double operations in the same order as colibri_exp_reduced and
 * colibri_expf: returns the 4 float results. */
X86_INLINE X86_EXACT __m128 expf4_in_range(__m128 xf)
{
    const __m256d x = _mm256_cvtps_pd(xf);
    const __m256d t = _mm256_mul_pd(x, _mm256_set1_pd(COLIBRI_INV_LN2));
    const __m256d half = _mm256_set1_pd(0.5);
    const __m256d neg = _mm256_cmp_pd(t, _mm256_setzero_pd(), _CMP_LT_OQ);
    const __m256d rounded = _mm256_blendv_pd(_mm256_add_pd(t, half), _mm256_sub_pd(t, half), neg);
    const __m128i n = _mm256_cvttpd_epi32(rounded);
    const __m256d nd = _mm256_cvtepi32_pd(n);
    const __m256d r = _mm256_sub_pd(_mm256_sub_pd(x, _mm256_mul_pd(nd, _mm256_set1_pd(COLIBRI_LN2_HI))),
                                    _mm256_mul_pd(nd, _mm256_set1_pd(COLIBRI_LN2_LO)));
    const unsigned terms = COLIBRI_MATH_COUNT(colibri_exp_taylor);
    __m256d p = _mm256_set1_pd(colibri_exp_taylor[terms - 1]);
    for (unsigned i = terms - 1; i-- > 0;)
        p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(colibri_exp_taylor[i]));
    p = _mm256_add_pd(_mm256_set1_pd(1.0), _mm256_mul_pd(r, p));
    const __m256i k64 = _mm256_add_epi64(_mm256_cvtepi32_epi64(n), _mm256_set1_epi64x(1023));
    const __m256d scale = _mm256_castsi256_pd(_mm256_slli_epi64(k64, 52));
    return _mm256_cvtpd_ps(_mm256_mul_pd(p, scale));
}

/* colibri_expf of 8 floats, NaN, overflow and underflow included. */
X86_INLINE X86_EXACT __m256 expf8(__m256 x)
{
    const __m256 hi = _mm256_set1_ps(COLIBRI_EXPF_MAX_FINITE), lo = _mm256_set1_ps(COLIBRI_EXPF_MIN_NONZERO);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 big = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    const __m256 small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    /* In range for the arithmetic (NaN -> 0); the masks pick the rest. */
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(_mm256_andnot_ps(nan, x), lo), hi);
    __m256 e = _mm256_set_m128(expf4_in_range(_mm256_extractf128_ps(xc, 1)), expf4_in_range(_mm256_castps256_ps128(xc)));
    e = _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), big);
    e = _mm256_blendv_ps(e, _mm256_setzero_ps(), small);
    return _mm256_blendv_ps(e, _mm256_add_ps(x, x), nan);
}

/* 1 / (1 + e^-v), as the reference's sigmoid. */
X86_INLINE X86_EXACT __m256 sigmoid8(__m256 v)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 negv = _mm256_xor_ps(v, _mm256_set1_ps(-0.0f));
    return _mm256_div_ps(one, _mm256_add_ps(one, expf8(negv)));
}

/* colibri_poly of 4 doubles: Horner, c[n-1] first. */
X86_INLINE X86_EXACT __m256d poly4(const colibri_real *c, unsigned n, __m256d z)
{
    __m256d p = _mm256_set1_pd(c[n - 1]);
    for (unsigned i = n - 1; i-- > 0;)
        p = _mm256_add_pd(_mm256_mul_pd(p, z), _mm256_set1_pd(c[i]));
    return p;
}

/* colibri_exp_real of 4 doubles, |x| <= 20. */
X86_INLINE X86_EXACT __m256d exp_real4(__m256d x)
{
    const __m256d t = _mm256_mul_pd(x, _mm256_set1_pd(COLIBRI_INV_LN2));
    const __m256d half = _mm256_set1_pd(0.5);
    const __m256d neg = _mm256_cmp_pd(t, _mm256_setzero_pd(), _CMP_LT_OQ);
    const __m128i n = _mm256_cvttpd_epi32(_mm256_blendv_pd(_mm256_add_pd(t, half), _mm256_sub_pd(t, half), neg));
    const __m256d nd = _mm256_cvtepi32_pd(n);
    const __m256d r = _mm256_sub_pd(_mm256_sub_pd(x, _mm256_mul_pd(nd, _mm256_set1_pd(COLIBRI_LN2_HI))),
                                    _mm256_mul_pd(nd, _mm256_set1_pd(COLIBRI_LN2_LO)));
    const __m256d p = _mm256_add_pd(
        _mm256_set1_pd(1.0), _mm256_mul_pd(r, poly4(colibri_exp_taylor, COLIBRI_MATH_COUNT(colibri_exp_taylor), r)));
    const __m256i k64 = _mm256_add_epi64(_mm256_cvtepi32_epi64(n), _mm256_set1_epi64x(1023));
    return _mm256_mul_pd(p, _mm256_castsi256_pd(_mm256_slli_epi64(k64, 52)));
}

/* colibri_tanhf's two branches for 4 finite floats of |x| < 9.1; picks by |x| < 0.55. */
X86_INLINE X86_EXACT __m128 tanh4(__m128 x)
{
    const __m128 sign = _mm_set1_ps(-0.0f);
    const __m128 ax = _mm_andnot_ps(sign, x);
    const __m256d xd = _mm256_cvtps_pd(x);
    const __m256d z = _mm256_mul_pd(xd, xd);
    const __m128 small = _mm256_cvtpd_ps(_mm256_add_pd(
        xd, _mm256_mul_pd(xd, _mm256_mul_pd(z, poly4(colibri_tanh_c, COLIBRI_MATH_COUNT(colibri_tanh_c), z)))));
    const __m256d e = exp_real4(_mm256_cvtps_pd(_mm_mul_ps(_mm_set1_ps(2.0f), ax)));
    const __m256d one = _mm256_set1_pd(1.0);
    const __m128 t = _mm256_cvtpd_ps(_mm256_sub_pd(one, _mm256_div_pd(_mm256_set1_pd(2.0), _mm256_add_pd(e, one))));
    const __m128 large = _mm_or_ps(_mm_andnot_ps(sign, t), _mm_and_ps(sign, x)); /* copysignf */
    return _mm_blendv_ps(large, small, _mm_cmplt_ps(ax, _mm_set1_ps(0.55f)));
}

/* colibri_erff's three branches for 4 finite floats of |x| < 4. */
X86_INLINE X86_EXACT __m128 erf4(__m128 x)
{
    const __m128 sign = _mm_set1_ps(-0.0f);
    const __m128 ax = _mm_andnot_ps(sign, x);
    const __m256d xd = _mm256_cvtps_pd(x);
    const __m256d z = _mm256_mul_pd(xd, xd);
    const __m128 small = _mm256_cvtpd_ps(
        _mm256_add_pd(xd, _mm256_mul_pd(xd, poly4(colibri_erf_q, COLIBRI_MATH_COUNT(colibri_erf_q), z))));
    const __m256d a = _mm256_cvtps_pd(ax);
    const __m256d r_low = poly4(colibri_erfc_r_low, COLIBRI_MATH_COUNT(colibri_erfc_r_low),
                                _mm256_sub_pd(a, _mm256_set1_pd(1.75)));
    const __m256d r_high = poly4(colibri_erfc_r_high, COLIBRI_MATH_COUNT(colibri_erfc_r_high),
                                 _mm256_sub_pd(a, _mm256_set1_pd(3.25)));
    const __m128 below = _mm_cmplt_ps(ax, _mm_set1_ps(2.5f));
    const __m256d below_d = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm_castps_si128(below)));
    const __m256d r = _mm256_blendv_pd(r_high, r_low, below_d);
    const __m256d na = _mm256_xor_pd(a, _mm256_set1_pd(-0.0));
    const __m256d erfc = _mm256_mul_pd(exp_real4(_mm256_mul_pd(na, a)), r);
    const __m128 big = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_set1_pd(1.0), erfc));
    const __m128 large = _mm_or_ps(_mm_andnot_ps(sign, big), _mm_and_ps(sign, x));
    return _mm_blendv_ps(large, small, _mm_cmplt_ps(ax, _mm_set1_ps(1.0f)));
}

/* f (tanh4 or erf4) of 8 floats with colibri_tanhf's / colibri_erff's NaN
 * and saturation: NaN -> x + x, |x| >= limit -> ±1. */
X86_INLINE X86_EXACT __m256 saturating8(__m256 x, float limit, int erf)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 sat = _mm256_cmp_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(limit), _CMP_GE_OQ);
    /* Lanes NaN or saturated compute on 0, and are replaced below. */
    const __m256 xc = _mm256_andnot_ps(_mm256_or_ps(nan, sat), x);
    const __m128 lo = _mm256_castps256_ps128(xc), hi = _mm256_extractf128_ps(xc, 1);
    __m256 y = erf ? _mm256_set_m128(erf4(hi), erf4(lo)) : _mm256_set_m128(tanh4(hi), tanh4(lo));
    y = _mm256_blendv_ps(y, _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(sign, x)), sat);
    return _mm256_blendv_ps(y, _mm256_add_ps(x, x), nan);
}

X86_INLINE X86_EXACT __m256 act8(__m256 v, uint32_t kind)
{
    switch (kind) {
    case COLIBRI_ACT_RELU: /* v < 0 ? 0 : v: NaN and -0 stay */
        return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    case COLIBRI_ACT_SILU:
        return _mm256_mul_ps(v, sigmoid8(v));
    case COLIBRI_ACT_TANH:
        return saturating8(v, COLIBRI_TANHF_SATURATE, 0);
    case COLIBRI_ACT_GELU_TANH: { /* 0.5 v (1 + tanh(√(2/π) (v + 0.044715 v³))), the reference's order */
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), v), v), v);
        const __m256 t = saturating8(_mm256_mul_ps(_mm256_set1_ps(0.79788456080286536f), _mm256_add_ps(v, cube)),
                                     COLIBRI_TANHF_SATURATE, 0);
        return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
    }
    case COLIBRI_ACT_GELU_ERF: { /* 0.5 v (1 + erf(v / √2)) */
        const __m256 e = saturating8(_mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752f)), COLIBRI_ERFF_SATURATE, 1);
        return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    }
    default: /* COLIBRI_ACT_SIGMOID */
        return sigmoid8(v);
    }
}

static X86_EXACT void activation_x86(float *x, size_t n, uint32_t kind)
{
    if (kind != COLIBRI_ACT_RELU && kind != COLIBRI_ACT_SILU && kind != COLIBRI_ACT_SIGMOID &&
        kind != COLIBRI_ACT_TANH && kind != COLIBRI_ACT_GELU_TANH && kind != COLIBRI_ACT_GELU_ERF) {
        colibri_activation_ref(x, n, kind); /* unreachable: activation kinds are validated */
        return;
    }
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, act8(_mm256_loadu_ps(x + i), kind));
    if (i < n) {
        float buf[8] = {0};
        for (size_t j = i; j < n; j++)
            buf[j - i] = x[j];
        _mm256_storeu_ps(buf, act8(_mm256_loadu_ps(buf), kind));
        for (size_t j = i; j < n; j++)
            x[j] = buf[j - i];
    }
}

/* Without optimisation GCC's headers make the _round intrinsics macros whose
 * all-ones mask trips -Wsign-conversion in this file. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion"
/* expf8 with 8 double lanes (AVX-512F): the same operations. */
X86_INLINE X86_EXACT512 __m256 expf8_512(__m256 x)
{
    const __m256 hi = _mm256_set1_ps(COLIBRI_EXPF_MAX_FINITE), lo = _mm256_set1_ps(COLIBRI_EXPF_MIN_NONZERO);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 big = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    const __m256 small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(_mm256_andnot_ps(nan, x), lo), hi);

    const __m512d xd = _mm512_cvtps_pd(xc);
    const __m512d t = _mm512_mul_round_pd(xd, _mm512_set1_pd(COLIBRI_INV_LN2), X86_RN);
    const __m512d half = _mm512_set1_pd(0.5);
    const __mmask8 neg = _mm512_cmp_pd_mask(t, _mm512_setzero_pd(), _CMP_LT_OQ);
    const __m512d rounded = _mm512_mask_blend_pd(neg, _mm512_add_round_pd(t, half, X86_RN),
                                                 _mm512_sub_round_pd(t, half, X86_RN));
    const __m256i n = _mm512_cvttpd_epi32(rounded);
    const __m512d nd = _mm512_cvtepi32_pd(n);
    const __m512d r = _mm512_sub_round_pd(
        _mm512_sub_round_pd(xd, _mm512_mul_round_pd(nd, _mm512_set1_pd(COLIBRI_LN2_HI), X86_RN), X86_RN),
        _mm512_mul_round_pd(nd, _mm512_set1_pd(COLIBRI_LN2_LO), X86_RN), X86_RN);
    const unsigned terms = COLIBRI_MATH_COUNT(colibri_exp_taylor);
    __m512d p = _mm512_set1_pd(colibri_exp_taylor[terms - 1]);
    for (unsigned i = terms - 1; i-- > 0;)
        p = _mm512_add_round_pd(_mm512_mul_round_pd(p, r, X86_RN), _mm512_set1_pd(colibri_exp_taylor[i]), X86_RN);
    p = _mm512_add_round_pd(_mm512_set1_pd(1.0), _mm512_mul_round_pd(r, p, X86_RN), X86_RN);
    const __m512i k64 = _mm512_add_epi64(_mm512_cvtepi32_epi64(n), _mm512_set1_epi64(1023));
    const __m512d scale = _mm512_castsi512_pd(_mm512_slli_epi64(k64, 52));
    __m256 e = _mm512_cvtpd_ps(_mm512_mul_round_pd(p, scale, X86_RN));

    e = _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), big);
    e = _mm256_blendv_ps(e, _mm256_setzero_ps(), small);
    return _mm256_blendv_ps(e, _mm256_add_ps(x, x), nan);
}

#pragma GCC diagnostic pop

X86_INLINE X86_EXACT512 __m256 act8_512(__m256 v, uint32_t kind)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    switch (kind) {
    case COLIBRI_ACT_RELU:
        return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    case COLIBRI_ACT_SILU:
        return _mm256_mul_ps(v, _mm256_div_ps(one, _mm256_add_ps(one, expf8_512(_mm256_xor_ps(v, _mm256_set1_ps(-0.0f))))));
    default: /* COLIBRI_ACT_SIGMOID */
        return _mm256_div_ps(one, _mm256_add_ps(one, expf8_512(_mm256_xor_ps(v, _mm256_set1_ps(-0.0f)))));
    }
}

static X86_EXACT512 void activation_x86_512(float *x, size_t n, uint32_t kind)
{
    if (kind != COLIBRI_ACT_RELU && kind != COLIBRI_ACT_SILU && kind != COLIBRI_ACT_SIGMOID) {
        activation_x86(x, n, kind); /* GELU, tanh: AVX2's */
        return;
    }
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, act8_512(_mm256_loadu_ps(x + i), kind));
    if (i < n) {
        float buf[8] = {0};
        for (size_t j = i; j < n; j++)
            buf[j - i] = x[j];
        _mm256_storeu_ps(buf, act8_512(_mm256_loadu_ps(buf), kind));
        for (size_t j = i; j < n; j++)
            x[j] = buf[j - i];
    }
}

static X86_EXACT void mul_x86(float *x, const float *y, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        x[i] *= y[i];
}

static X86_EXACT void add_x86(float *x, const float *y, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        x[i] += y[i];
}

/* roundf (half away from zero) of 8 floats, exactly: v - trunc(v) is exact. */
X86_INLINE X86_EXACT __m256 round_away8(__m256 v)
{
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
    const __m256 frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(v, t));
    const __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    return _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(sign, _mm256_set1_ps(1.0f))));
}

static X86_EXACT void quantize_rows_x86(const float *x, const uint16_t *rows, size_t n, size_t in,
                                        int8_t *restrict q, float *restrict a)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 inf = _mm256_set1_ps(__builtin_inff());
    for (size_t i = 0; i < n; i++, q += in) {
        const size_t r = rows ? rows[i] : i;
        const float *xi = x + r * in;
        /* max |x| (exact in any order) and whether any |x| is NaN or inf
         * (!(|x| < inf)); such rows and all-zero rows go to the reference. */
        __m256 m8 = _mm256_setzero_ps(), bad8 = _mm256_setzero_ps();
        size_t k = 0;
        for (; k + 8 <= in; k += 8) {
            const __m256 v = _mm256_and_ps(_mm256_loadu_ps(xi + k), absmask);
            bad8 = _mm256_or_ps(bad8, _mm256_cmp_ps(v, inf, _CMP_NLT_UQ));
            m8 = _mm256_max_ps(m8, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m8);
        float m = 0.0f;
        int bad = _mm256_movemask_ps(bad8) != 0;
        for (int j = 0; j < 8; j++)
            m = lanes[j] > m ? lanes[j] : m;
        for (; k < in; k++) {
            const float v = fabsf(xi[k]);
            bad |= !(v < __builtin_inff());
            m = v > m ? v : m;
        }
        if (bad || m == 0.0f) {
            colibri_quantize_rows_ref(xi, NULL, 1, in, q, a + i);
            continue;
        }
        const float s = m < 0x1p-100f ? 0x1p100f : 1.0f;
        const float inv = 127.0f / (m * s);
        const __m256 s8 = _mm256_set1_ps(s), inv8 = _mm256_set1_ps(inv);
        const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
        for (k = 0; k + 8 <= in; k += 8) {
            __m256 v = round_away8(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xi + k), s8), inv8));
            v = _mm256_max_ps(_mm256_min_ps(v, lim), nlim);
            const __m256i i32 = _mm256_cvtps_epi32(v);
            const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(i16, i16));
        }
        for (; k < in; k++) {
            q[k] = colibri_quantize_one(xi[k], s, inv);
        }
        a[i] = m / 127.0f;
    }
}

/* ---- CPU detection: at every colibri_init, nothing cached ---- */

/* 0: neither; 1: AVX2, FMA and F16C with the YMM state saved by the OS;
 * 2: AVX-512F as well, with the ZMM state saved; 3: and AVX-512 VNNI + BW. */
static int x86_level(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d))
        return 0;
    const unsigned need1 = bit_FMA | bit_OSXSAVE | bit_AVX | bit_F16C;
    if ((c & need1) != need1)
        return 0;
    /* XCR0: bits 1, 2 the XMM and YMM state; 5, 6, 7 the opmask and ZMM. */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if ((lo & 6u) != 6u)
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & bit_AVX2))
        return 0;
    if (!(b & bit_AVX512F) || (lo & 0xE6u) != 0xE6u)
        return 1;
    return (c & bit_AVX512VNNI) && (b & bit_AVX512BW) ? 3 : 2;
}

/* The block form's instruction set (colibri_x86_blocks): 2 AVX-512 VNNI
 * with BW and VL (level 3 and VL), 1 AVX-VNNI (CPUID.(7,1):EAX bit 4, the
 * YMM state saved), 0 AVX2. */
static int x86_blocks_isa(int level, int allow_avx_vnni)
{
    unsigned a, b, c, d;
    if (level >= 3 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_AVX512VL))
        return 2;
    if (allow_avx_vnni && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4)))
        return 1;
    return 0;
}

void colibri_kernels_x86_level(colibri_kernels *k, int max_level)
{
    colibri_kernels_x86_caps(k, max_level, 1);
}

void colibri_kernels_x86_caps(colibri_kernels *k, int max_level, int allow_avx_vnni)
{
    const int cpu = x86_level(), level = cpu < max_level ? cpu : max_level;
    if (level < 1)
        return; /* the reference kernels stand */
    colibri_x86_blocks(k, x86_blocks_isa(level, allow_avx_vnni));
    colibri_x86_lm(k);
    if (level >= 3) {
        k->name = "x86-64 avx512f+vnni+avx2+fma+f16c";
        k->linear = linear_vnni;
        k->linear_acc = linear_acc_vnni;
    } else if (level == 2) {
        k->name = "x86-64 avx512f+avx2+fma+f16c";
        k->linear = linear_avx512;
        k->linear_acc = linear_acc_avx512;
    } else {
        k->name = "x86-64 avx2+fma+f16c";
        k->linear = linear_avx2;
        k->linear_acc = linear_acc_avx2;
    }
    k->quantize_rows = quantize_rows_x86;
    k->activation = level >= 2 ? activation_x86_512 : activation_x86;
    k->mul = mul_x86;
    k->add = add_x86;
}

void colibri_kernels_x86(colibri_kernels *k)
{
    colibri_kernels_x86_level(k, 3);
}

#endif /* COLIBRI_BACKEND_X86 */
