/*
 * Optimised backend, x86-64: token models' attention over the KV cache
 * (colibri_attend_fn), AVX2 + FMA + F16C at every level. A file of its own
 * so colibri_kernels_x86.c's long compile does not grow; compiled to nothing
 * unless colibri_backend.h selects the x86 backend.
 *
 * One head of one query row, as colibri_attend_ref, in three passes:
 *
 * - scores: eight cached keys at a time, each key's q · k_t in 8 lanes
 *   along hd (FMA), the eight sums reduced together (lanes = positions),
 *   times scale. A key alone (the last len % 8) is reduced by the same
 *   tree, so a position's score does not depend on len.
 * - softmax: the maximum (exact in any order), e_t = exp(s_t - max) by an
 *   f32 polynomial (below), the sum in 8 lanes, then e_t / sum per element
 *   as the reference divides.
 * - out = Σ_t p_t · v_t in t order, 64 outputs (8 vectors, 8 independent FMA
 *   chains) per pass over the positions.
 *
 * f16 caches are widened by F16C (exact, as colibri_f16_to_f32). Only
 * positions t < len are read, and within a row only its hd values (the tail
 * of hd % 8 through masked loads or a copy): the causal rule of docs/lm.md
 * holds, a NaN in a later position or the next head never enters.
 *
 * The exp: e^x = 2^n · e^r, n = round(x · log2 e), r = x - n·ln2 (two
 * parts, fused), e^r by its Taylor series to r^7 (remainder below 2^-27 for
 * |r| <= ln2/2): within 2 ulp of e^x, where the reference's colibri_expf is
 * correctly rounded. Its arguments are s_t - max <= 0; exactly where
 * colibri_expf gives 0 (below COLIBRI_EXPF_MIN_NONZERO) so does this, and
 * it is at least the smallest subnormal elsewhere, so a probability is 0
 * exactly where the reference's is and 0 · inf in the values gives NaN in the
 * same places. exp(0) is exactly 1 (the maximum's term). NaN stays NaN, so a
 * NaN score makes every output NaN, as +inf (inf - inf) and an all -inf row
 * (-inf + inf) do, as the reference.
 *
 * Tolerance (tests/c/colibri_kernels_x86.c): reordered sums of hd products,
 * of len exponentials and of len weighted values, and the exp's 2 ulp.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_X86)

#include <immintrin.h>

#include "../../colibri_math.h"

#define LM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LM_INLINE static inline __attribute__((always_inline))

/* Eight cached values of a row from element j (f16 widened exactly). */
LM_INLINE LM_AVX2 __m256 load8(const void *row, size_t j, int f16)
{
    if (f16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + j)));
    return _mm256_loadu_ps((const float *)row + j);
}

/* Lanes below n set: the mask of a row's last n < 8 values. */
LM_INLINE LM_AVX2 __m256i lanes_below(size_t n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The n < 8 values of a row from element j, zero beyond; nothing past them is read. */
LM_INLINE LM_AVX2 __m256 load_part(const void *row, size_t j, size_t n, int f16)
{
    if (f16) {
        uint16_t buf[8] = {0};
        memcpy(buf, (const uint16_t *)row + j, n * sizeof *buf);
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)buf));
    }
    return _mm256_maskload_ps((const float *)row + j, lanes_below(n));
}

/* Lane r = the sum of a[r]'s 8 lanes, ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) for every r. */
LM_INLINE LM_AVX2 __m256 hsum8(const __m256 a[8])
{
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* scores[t .. t + T) = (q · k_t) · scale for T (1 or 8) keys from position t. */
LM_INLINE LM_AVX2 void scores_of(int T, const float *q, const uint8_t *k, size_t row_bytes, size_t hd, int f16,
                                 float scale, size_t t, float *scores)
{
    __m256 acc[8];
    const uint8_t *kt[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        acc[i] = _mm256_setzero_ps();
        kt[i] = k + (t + (size_t)(i < T ? i : 0)) * row_bytes;
    }
    size_t j = 0;
    for (; j + 8 <= hd; j += 8) {
        const __m256 qv = _mm256_loadu_ps(q + j);
#pragma GCC unroll 8
        for (int i = 0; i < T; i++)
            acc[i] = _mm256_fmadd_ps(qv, load8(kt[i], j, f16), acc[i]);
    }
    if (j < hd) {
        const __m256 qv = _mm256_maskload_ps(q + j, lanes_below(hd - j));
        for (int i = 0; i < T; i++)
            acc[i] = _mm256_fmadd_ps(qv, load_part(kt[i], j, hd - j, f16), acc[i]);
    }
    const __m256 s = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
    if (T == 8)
        _mm256_storeu_ps(scores + t, s);
    else
        scores[t] = _mm256_cvtss_f32(s);
}

/* e^x for 8 lanes x <= 0 or NaN (see the file's comment). */
LM_INLINE LM_AVX2 __m256 exp_nonpositive8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(COLIBRI_EXPF_MIN_NONZERO);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 zero = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_setzero_ps()); /* NaN -> lo, fixed below */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n for n in -150 .. 0 as 2^(n + 64) · 2^-64: the first product exact, one rounding in all */
    const __m256i e64 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127 + 64)), 23);
    __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e64)), _mm256_set1_ps(0x1p-64f));
    e = _mm256_max_ps(e, _mm256_set1_ps(0x1p-149f));
    e = _mm256_andnot_ps(zero, e);
    return _mm256_blendv_ps(e, _mm256_add_ps(x, x), nan);
}

/* x[0 .. len) = softmax(x), the maximum subtracted (the reference's NaN and inf behaviour). */
LM_INLINE LM_AVX2 void softmax(float *x, size_t len)
{
    __m256 m8 = _mm256_set1_ps(x[0]);
    size_t t = 0;
    for (; t + 8 <= len; t += 8)
        m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float max = _mm_cvtss_f32(m4);
    for (; t < len; t++)
        max = x[t] > max ? x[t] : max;
    /* A NaN max_ps passed over still makes its exp and the sum NaN, as the reference. */
    const __m256 mv = _mm256_set1_ps(max);
    __m256 s8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
        _mm256_storeu_ps(x + t, e);
        s8 = _mm256_add_ps(s8, e);
    }
    if (t < len) {
        const __m256i m = lanes_below(len - t);
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_maskload_ps(x + t, m), mv));
        _mm256_maskstore_ps(x + t, m, e);
        s8 = _mm256_add_ps(s8, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    const __m256 sum = _mm256_set1_ps(_mm_cvtss_f32(s4));
    for (t = 0; t + 8 <= len; t += 8)
        _mm256_storeu_ps(x + t, _mm256_div_ps(_mm256_loadu_ps(x + t), sum));
    for (; t < len; t++)
        x[t] /= _mm_cvtss_f32(s4);
}

/* out[j0 .. j0 + 8V) = Σ_t p_t · v_t[j0 ..], V full vectors of the row. */
LM_INLINE LM_AVX2 void weighted_values(int V, const float *p, const uint8_t *v, size_t row_bytes, size_t len,
                                       int f16, size_t j0, float *out)
{
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < V; i++)
        acc[i] = _mm256_setzero_ps();
    for (size_t t = 0; t < len; t++) {
        const uint8_t *vt = v + t * row_bytes;
        const __m256 pt = _mm256_broadcast_ss(p + t);
#pragma GCC unroll 8
        for (int i = 0; i < V; i++)
            acc[i] = _mm256_fmadd_ps(pt, load8(vt, j0 + 8 * (size_t)i, f16), acc[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < V; i++)
        _mm256_storeu_ps(out + j0 + 8 * (size_t)i, acc[i]);
}

static LM_AVX2 void attend_x86(const float *q, const void *k, const void *v, size_t stride, size_t len, size_t hd,
                               int f16, float scale, float *scores, float *out)
{
    const size_t row_bytes = stride * (f16 ? 2u : 4u);
    size_t t = 0;
    for (; t + 8 <= len; t += 8)
        scores_of(8, q, k, row_bytes, hd, f16, scale, t, scores);
    for (; t < len; t++)
        scores_of(1, q, k, row_bytes, hd, f16, scale, t, scores);
    softmax(scores, len);
    /* q is dead from here on: out may be q. */
    size_t j = 0;
    for (; j + 64 <= hd; j += 64)
        weighted_values(8, scores, v, row_bytes, len, f16, j, out);
    for (; j + 8 <= hd; j += 8)
        weighted_values(1, scores, v, row_bytes, len, f16, j, out);
    if (j < hd) {
        __m256 acc = _mm256_setzero_ps();
        for (t = 0; t < len; t++)
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + t),
                                  load_part((const uint8_t *)v + t * row_bytes, j, hd - j, f16), acc);
        _mm256_maskstore_ps(out + j, lanes_below(hd - j), acc);
    }
}

void colibri_x86_lm(colibri_kernels *k)
{
    k->attend = attend_x86;
}

#endif /* COLIBRI_BACKEND_X86 */
