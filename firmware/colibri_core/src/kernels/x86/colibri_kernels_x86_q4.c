/*
 * Optimised backend, x86-64: I4 weights (format v5), AVX2 + FMA + F16C.
 * A file of its own so colibri_kernels_x86.c's long compile (its forced
 * specialisation) does not grow; compiled to nothing unless colibri_backend.h
 * selects the x86 backend, and called from its linear kernels
 * (colibri_x86_q4_gemm) at every level (AVX-512 CPUs run these AVX2 kernels
 * for I4, but for a 16-lane form of the f32-activation one).
 *
 * Nibbles are unpacked 32 columns (16 bytes) at a time: the low and high
 * nibbles split by a mask and a shift.
 *
 * - int8 activations, bit for bit the reference's: 8 output rows at once,
 *   one token at a time. The nibbles stay in their packed order (the 16
 *   even columns, then the 16 odd) as u = Q + 8, and xq is reordered the
 *   same way once for the 8 rows; Σ Q·xq = Σ u·xq - 8·Σ xq in int32
 *   (maddubs, u unsigned: pairs at most 2·15·128, never saturating), exact;
 *   the 8 rows' sums are transposed into the 8
 *   lanes of one vector (lanes = rows), converted, multiplied by the rows'
 *   group scales and added to the running value, group after group in
 *   order: per row the reference's f32 operations (v += (float)sum · s_g;
 *   v · a) in its order, unfused. E, the companion bias and the emit are
 *   colibri_q4_epilogue and colibri_emit themselves.
 * - f32 activations, within the tolerance of the q8 f32-activation kernels
 *   (reordering bound with |w| = |Q|·s_g, tests/c/colibri_q4_test.c): 4
 *   rows by up to 2 tokens at once; the nibbles interleaved back into
 *   column order (unpacklo/hi) and made signed by one PSHUFB lookup, each
 *   decoded weight is multiplied by its
 *   group's scale once and fused-multiply-added into 8-lane accumulators for
 *   each token, so a row's groups need no separate sums.
 *
 * A group narrower than 32 columns, and a row's last partial 32 columns,
 * are copied into zero-padded buffers first (zero nibbles and zero
 * activations add nothing, so the sums are unchanged and nothing is read
 * past a row or an activation vector).
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_X86)

#include <immintrin.h>
#include "colibri_x86_terms.h"

#define Q4_AVX2 __attribute__((target("avx2,fma,f16c")))
#define Q4_INLINE static inline __attribute__((always_inline))

/* The 32 signed columns of 16 packed bytes, in column order. */
Q4_INLINE Q4_AVX2 __m256i q4_decode32(__m128i packed)
{
    const __m128i mask = _mm_set1_epi8(0x0F);
    /* nibble 0..15 -> its int4 value -8..7 */
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    const __m128i c0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi)); /* columns 0..15 */
    const __m128i c1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi)); /* columns 16..31 */
    return _mm256_set_m128i(c1, c0);
}

/* Columns [c, c + n) of a row (c even, n <= 32) as 16 packed bytes, zero
 * beyond n (so they decode to 0). */
Q4_INLINE Q4_AVX2 __m128i q4_packed_at(const uint8_t *row, size_t c, size_t n)
{
    if (n == 32)
        return _mm_loadu_si128((const __m128i *)(row + (c >> 1)));
    uint8_t buf[16] = {0};
    memcpy(buf, row + (c >> 1), (n + 1) >> 1);
    if (n & 1u)
        buf[n >> 1] &= 0x0Fu; /* a column past n shares the last byte */
    return _mm_loadu_si128((const __m128i *)buf);
}

/* xq [c, c + n), zero beyond n, reordered as the nibbles come out of 16
 * packed bytes without interleaving: the 16 even columns, then the 16 odd. */
Q4_INLINE Q4_AVX2 __m256i q4_xq_split(const int8_t *xq, size_t c, size_t n)
{
    __m256i v;
    if (n == 32) {
        v = _mm256_loadu_si256((const __m256i *)(xq + c));
    } else {
        int8_t buf[32] = {0};
        memcpy(buf, xq + c, n);
        v = _mm256_loadu_si256((const __m256i *)buf);
    }
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    /* per 128-bit lane [evens, odds]; then the two lanes' evens low, odds high */
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, evens_odds), 0xD8);
}

/* u = Q + 8 (0..15) of 32 columns, in q4_xq_split's order: the low nibbles
 * of the 16 bytes, then the high ones. */
Q4_INLINE Q4_AVX2 __m256i q4_unsigned32(__m128i packed)
{
    const __m128i flipped = _mm_xor_si128(packed, _mm_set1_epi8((char)0x88));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(flipped, 4), flipped), _mm256_set1_epi8(0x0F));
}

/* Lane r of the result = the sum of a[r]'s 8 lanes. */
Q4_INLINE Q4_AVX2 __m256i q4_hsum8(const __m256i a[8])
{
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

/* One token, rows o .. o + 7 (rows past the matrix repeat its last one and
 * are not stored): v[r] = (Σ_g (float)Σ_{c in g} Q·xq · s_g) · a. Per 32
 * columns Σ u·xq by maddubs (u unsigned 0..15, xq signed: pairs at most
 * 2·15·128, never saturating), less 8·Σ xq (the same maddubs with u = 8,
 * once for the 8 rows): exact int32. */
static Q4_AVX2 void q4q8_rows8(const colibri_matrix *w, size_t o, const int8_t *xq, float a, float v[8])
{
    const size_t in = w->cols, group = (size_t)1 << w->q4_group_log2, G = w->q4_groups;
    const __m256i ones = _mm256_set1_epi16(1), eights = _mm256_set1_epi8(8);
    const uint8_t *row[8];
    const uint16_t *sc[8];
#pragma GCC unroll 8
    for (size_t r = 0; r < 8; r++) {
        const size_t orow = o + r < w->rows ? o + r : w->rows - 1;
        row[r] = colibri_q4_row(w, orow);
        sc[r] = colibri_q4_scales(w, orow);
    }
    __m256 acc = _mm256_setzero_ps();
    for (size_t g = 0; g < G; g++) {
        const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in;
        __m256i sum[8], corr = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (size_t r = 0; r < 8; r++)
            sum[r] = _mm256_setzero_si256();
        size_t c = c0;
        for (; c + 32 <= end; c += 32) {
            const __m256i x = q4_xq_split(xq, c, 32);
            corr = _mm256_add_epi32(corr, _mm256_madd_epi16(_mm256_maddubs_epi16(eights, x), ones));
#pragma GCC unroll 8
            for (size_t r = 0; r < 8; r++)
                sum[r] = _mm256_add_epi32(
                    sum[r], _mm256_madd_epi16(
                                _mm256_maddubs_epi16(
                                    q4_unsigned32(_mm_loadu_si128((const __m128i *)(row[r] + (c >> 1)))), x),
                                ones));
        }
        if (c < end) { /* a group narrower than 32 columns, or the row's last partial 32 */
            const size_t n = end - c;
            const __m256i x = q4_xq_split(xq, c, n);
            corr = _mm256_add_epi32(corr, _mm256_madd_epi16(_mm256_maddubs_epi16(eights, x), ones));
            for (size_t r = 0; r < 8; r++)
                sum[r] = _mm256_add_epi32(
                    sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q4_unsigned32(q4_packed_at(row[r], c, n)), x), ones));
        }
#pragma GCC unroll 8
        for (size_t r = 0; r < 8; r++)
            sum[r] = _mm256_sub_epi32(sum[r], corr);
        const __m128i s16 = _mm_setr_epi16((short)sc[0][g], (short)sc[1][g], (short)sc[2][g], (short)sc[3][g],
                                           (short)sc[4][g], (short)sc[5][g], (short)sc[6][g], (short)sc[7][g]);
        /* v += (float)sum · s_g: two roundings, as the reference */
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(q4_hsum8(sum)), _mm256_cvtph_ps(s16)));
    }
    _mm256_storeu_ps(v, _mm256_mul_ps(acc, _mm256_set1_ps(a)));
}

/* T (1 or 2) tokens, rows o .. o + 3 (rows past the matrix repeat the last
 * one): v[t·4 + r] = Σ_c (Q·s_g) · x_t, fused, 8 lanes then summed. */
Q4_INLINE Q4_AVX2 void q4f_rows4(const colibri_matrix *w, size_t o, int T, const float *const *xr, float v[8])
{
    const size_t in = w->cols, group = (size_t)1 << w->q4_group_log2, G = w->q4_groups;
    const uint8_t *row[4];
    const uint16_t *sc[4];
#pragma GCC unroll 4
    for (size_t r = 0; r < 4; r++) {
        const size_t orow = o + r < w->rows ? o + r : w->rows - 1;
        row[r] = colibri_q4_row(w, orow);
        sc[r] = colibri_q4_scales(w, orow);
    }
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        acc[i] = _mm256_setzero_ps();
    for (size_t g = 0; g < G; g++) {
        const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in;
        const __m128 s4 = _mm_cvtph_ps(_mm_setr_epi16((short)sc[0][g], (short)sc[1][g], (short)sc[2][g],
                                                      (short)sc[3][g], 0, 0, 0, 0));
        __m256 s[4];
        s[0] = _mm256_broadcastss_ps(s4);
        s[1] = _mm256_broadcastss_ps(_mm_shuffle_ps(s4, s4, 0x55));
        s[2] = _mm256_broadcastss_ps(_mm_shuffle_ps(s4, s4, 0xAA));
        s[3] = _mm256_broadcastss_ps(_mm_shuffle_ps(s4, s4, 0xFF));
        size_t c = c0;
        for (; c + 32 <= end; c += 32) {
#pragma GCC unroll 4
            for (size_t r = 0; r < 4; r++) {
                const __m256i q = q4_decode32(_mm_loadu_si128((const __m128i *)(row[r] + (c >> 1))));
                const __m128i qlo = _mm256_castsi256_si128(q), qhi = _mm256_extracti128_si256(q, 1);
                const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qlo)), s[r]);
                const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qlo, 8))), s[r]);
                const __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qhi)), s[r]);
                const __m256 w3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qhi, 8))), s[r]);
#pragma GCC unroll 2
                for (int t = 0; t < T; t++) {
                    __m256 a0 = acc[t * 4 + (int)r];
                    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr[t] + c), a0);
                    a0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr[t] + c + 8), a0);
                    a0 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr[t] + c + 16), a0);
                    acc[t * 4 + (int)r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr[t] + c + 24), a0);
                }
            }
        }
        if (c < end) { /* a group narrower than 32 columns, or the row's last partial 32 */
            const size_t n = end - c;
            float xb[2][32];
            for (int t = 0; t < T; t++) {
                memset(xb[t], 0, sizeof xb[t]);
                memcpy(xb[t], xr[t] + c, n * sizeof(float));
            }
            for (size_t r = 0; r < 4; r++) {
                const __m256i q = q4_decode32(q4_packed_at(row[r], c, n));
                const __m128i qlo = _mm256_castsi256_si128(q), qhi = _mm256_extracti128_si256(q, 1);
                const __m128i q8[4] = {qlo, _mm_srli_si128(qlo, 8), qhi, _mm_srli_si128(qhi, 8)};
                for (size_t k = 0; k < (n + 7) / 8; k++) {
                    const __m256 wk = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8[k])), s[r]);
                    for (int t = 0; t < T; t++)
                        acc[t * 4 + (int)r] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(xb[t] + 8 * k), acc[t * 4 + (int)r]);
                }
            }
        }
    }
    /* Each sum ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), as the f32 GEMM's
     * reduction (colibri_kernels_x86.c, hsum4), so a token's outputs have
     * the same bits here as through the widened rows at the AVX2 level. */
    for (int i = 0; i < T * 4; i += 4) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i], acc[i + 1]), _mm256_hadd_ps(acc[i + 2], acc[i + 3]));
        _mm_storeu_ps(v + i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

#define Q4_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

/* 16 columns' weights Q · s from 8 packed bytes (the low half of packed),
 * s holding each column's group scale: exact, as colibri_x86_q4_widen's. */
Q4_INLINE Q4_AVX512 __m512 q4_weights16(__m128i packed, __m512 s)
{
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    const __m128i q = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s);
}

/* The group scales of columns k .. k + 15 (k a multiple of 16) of a row of
 * in columns: one group, or two of 8 columns (group_log2 3; a second one
 * past the row takes the first's, its columns being padding). */
Q4_INLINE Q4_AVX512 __m512 q4_scales16(const uint16_t *sc, size_t k, unsigned log2, size_t in)
{
    const float s0 = _cvtsh_ss(sc[k >> log2]);
    if (log2 >= 4)
        return _mm512_set1_ps(s0);
    const __m256 s1 = _mm256_set1_ps(k + 8 < in ? _cvtsh_ss(sc[(k + 8) >> log2]) : s0);
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(s0))), _mm256_castps_pd(s1), 1));
}

/* q4f_rows4 with 16 lanes, for the AVX-512 levels: each output the bits the
 * f32 GEMM's AVX-512 micro-kernel (colibri_kernels_x86.c dot_block512) gives
 * on the rows widened by colibri_x86_q4_widen, which the GEMM runs from 4
 * tokens on; so a token's outputs have the same bits whatever the call's
 * token count at these levels too. The same operations per output in the
 * same order: 16-lane FMAs over the columns' multiples of 16, folded to 8
 * lanes, 8 more columns, the zero-padded rest (+0 weights and activations),
 * then hsum4's reduction. */
Q4_INLINE Q4_AVX512 void q4f_rows4_512(const colibri_matrix *w, size_t o, int T, const float *const *xr, float v[8])
{
    const size_t in = w->cols;
    const unsigned log2 = w->q4_group_log2;
    const uint8_t *row[4];
    const uint16_t *sc[4];
#pragma GCC unroll 4
    for (size_t r = 0; r < 4; r++) {
        const size_t orow = o + r < w->rows ? o + r : w->rows - 1;
        row[r] = colibri_q4_row(w, orow);
        sc[r] = colibri_q4_scales(w, orow);
    }
    __m512 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        acc[i] = _mm512_setzero_ps();
    /* The columns' multiples of 16, a span of one group at a time (two
     * groups of 8 per span at group_log2 3), its scales widened once. */
    const size_t full = in & ~(size_t)15, span = log2 >= 4 ? (size_t)1 << log2 : 16;
    size_t k = 0;
    while (k < full) {
        const size_t stop = k + span < full ? k + span : full;
        __m512 s[4];
#pragma GCC unroll 4
        for (size_t r = 0; r < 4; r++)
            s[r] = q4_scales16(sc[r], k, log2, in);
        for (; k < stop; k += 16) {
            __m512 xv[2];
#pragma GCC unroll 2
            for (int t = 0; t < T; t++)
                xv[t] = _mm512_loadu_ps(xr[t] + k);
#pragma GCC unroll 4
            for (size_t r = 0; r < 4; r++) {
                const __m512 wv = q4_weights16(_mm_loadl_epi64((const __m128i *)(row[r] + (k >> 1))), s[r]);
#pragma GCC unroll 2
                for (int t = 0; t < T; t++)
                    acc[t * 4 + (int)r] = _mm512_fmadd_ps(wv, xv[t], acc[t * 4 + (int)r]);
            }
        }
    }
    __m256 a8[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        a8[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)));
    if (k < in) {
        const size_t n = in - k; /* 1 .. 15 */
        float xb[2][16];
        for (int t = 0; t < T; t++) {
            memset(xb[t], 0, sizeof xb[t]);
            memcpy(xb[t], xr[t] + k, n * sizeof(float));
        }
        for (size_t r = 0; r < 4; r++) {
            const __m512 wv = _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1u),
                                                  q4_weights16(q4_packed_at(row[r], k, n), q4_scales16(sc[r], k, log2, in)));
            const __m256 lo = _mm512_castps512_ps256(wv),
                         hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wv), 1));
            for (int t = 0; t < T; t++) {
                __m256 a = a8[t * 4 + (int)r];
                a = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xb[t]), a);
                if (n > 8)
                    a = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xb[t] + 8), a);
                a8[t * 4 + (int)r] = a;
            }
        }
    }
    for (int i = 0; i < T * 4; i += 4) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a8[i], a8[i + 1]), _mm256_hadd_ps(a8[i + 2], a8[i + 3]));
        _mm_storeu_ps(v + i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

/* Rows [o, o + R) of an I4 matrix as f32 weights Q · s_g into wide [R, cols]:
 * exact (a 4-bit integer times an f16 scale fits f32's significand), so a
 * kernel running on them computes the products q4f_rows4 computes. */
void Q4_AVX2 colibri_x86_q4_widen(const colibri_matrix *w, size_t o, size_t R, float *wide)
{
    const size_t in = w->cols, group = (size_t)1 << w->q4_group_log2, G = w->q4_groups;
    for (size_t r = 0; r < R; r++, wide += in) {
        const uint8_t *row = colibri_q4_row(w, o + r);
        const uint16_t *sc = colibri_q4_scales(w, o + r);
        for (size_t g = 0; g < G; g++) {
            const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in;
            const __m256 s = _mm256_set1_ps(_cvtsh_ss(sc[g]));
            size_t c = c0;
            for (; c + 32 <= end; c += 32) {
                const __m256i q = q4_decode32(_mm_loadu_si128((const __m128i *)(row + (c >> 1))));
                const __m128i qlo = _mm256_castsi256_si128(q), qhi = _mm256_extracti128_si256(q, 1);
                _mm256_storeu_ps(wide + c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qlo)), s));
                _mm256_storeu_ps(wide + c + 8,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qlo, 8))), s));
                _mm256_storeu_ps(wide + c + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qhi)), s));
                _mm256_storeu_ps(wide + c + 24,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qhi, 8))), s));
            }
            if (c < end) { /* a group narrower than 32 columns, or the row's last partial 32 */
                const size_t n = end - c;
                const __m256i q = q4_decode32(q4_packed_at(row, c, n));
                const __m128i qlo = _mm256_castsi256_si128(q), qhi = _mm256_extracti128_si256(q, 1);
                float buf[32];
                _mm256_storeu_ps(buf, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qlo)), s));
                _mm256_storeu_ps(buf + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qlo, 8))), s));
                _mm256_storeu_ps(buf + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qhi)), s));
                _mm256_storeu_ps(buf + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qhi, 8))), s));
                memcpy(wide + c, buf, n * sizeof *buf);
            }
        }
    }
}

/* colibri_x86_q4_widen with 16-lane conversions, for the AVX-512 levels:
 * the same values (each an exact product), fewer instructions a weight. */
void Q4_AVX512 colibri_x86_q4_widen512(const colibri_matrix *w, size_t o, size_t R, float *wide)
{
    const size_t in = w->cols, group = (size_t)1 << w->q4_group_log2, G = w->q4_groups;
    for (size_t r = 0; r < R; r++, wide += in) {
        const uint8_t *row = colibri_q4_row(w, o + r);
        const uint16_t *sc = colibri_q4_scales(w, o + r);
        for (size_t g = 0; g < G; g++) {
            const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in;
            const __m512 s = _mm512_set1_ps(_cvtsh_ss(sc[g]));
            size_t c = c0;
            for (; c + 32 <= end; c += 32) {
                const __m256i q = q4_decode32(_mm_loadu_si128((const __m128i *)(row + (c >> 1))));
                _mm512_storeu_ps(wide + c,
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), s));
                _mm512_storeu_ps(wide + c + 16, _mm512_mul_ps(
                                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), s));
            }
            if (c < end) { /* a group narrower than 32 columns, or the row's last partial 32 */
                const size_t n = end - c;
                const __m256i q = q4_decode32(q4_packed_at(row, c, n));
                float buf[32];
                _mm512_storeu_ps(buf, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), s));
                _mm512_storeu_ps(buf + 16, _mm512_mul_ps(
                                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), s));
                memcpy(wide + c, buf, n * sizeof *buf);
            }
        }
    }
}

/* Rows o .. o + R - 1 (R <= 8) of one token from their group sums v (in
 * place): colibri_q4_epilogue's E (bounded where it is read,
 * colibri_x86_e_terms) and companion bias, then colibri_emit. */
static Q4_AVX2 void q4_emit(const colibri_matrix *w, size_t o, size_t R, const float *xi, float *v, float *yi,
                            const float *b, int acc, float s)
{
    if (w->q8_ptr)
        colibri_x86_e_terms(w, o, (int)R, xi, v);
    for (size_t r = 0; r < R; r++)
        colibri_emit(yi, o + r, w->q4_bias ? v[r] + _cvtsh_ss(w->q4_bias[o + r]) : v[r], b, acc, s);
}

/* colibri_x86_q4_gemm's f32-activation loop at the AVX-512 levels. */
static Q4_AVX512 __attribute__((noinline)) void q4f_gemm512(const float *x, const uint16_t *xrows,
                                                            const uint16_t *yrows, const float *scale,
                                                            const colibri_matrix *w, const float *b, float *y,
                                                            size_t n, int acc)
{
    const size_t in = w->cols, out = w->rows;
    for (size_t o = 0; o < out; o += 4) {
        const size_t R = out - o < 4 ? out - o : 4;
        for (size_t i = 0; i < n; i += 2) {
            const int T = n - i >= 2 ? 2 : 1;
            const float *xr[2];
            for (int t = 0; t < T; t++)
                xr[t] = x + (xrows ? xrows[i + (size_t)t] : i + (size_t)t) * in;
            float v[8];
            if (T == 2)
                q4f_rows4_512(w, o, 2, xr, v);
            else
                q4f_rows4_512(w, o, 1, xr, v);
            for (int t = 0; t < T; t++) {
                const size_t ti = i + (size_t)t;
                float *yi = y + (yrows ? yrows[ti] : ti) * out;
                const float s = scale ? scale[ti] : 1.0f;
                q4_emit(w, o, R, xr[t], v + t * 4, yi, b, acc, s);
            }
        }
    }
}

void Q4_AVX2 colibri_x86_q4_gemm(const float *x, const uint16_t *xrows, const uint16_t *yrows, const float *scale,
                                 const colibri_qrows *xq, const colibri_matrix *w, const float *b, float *y, size_t n,
                                 int acc, int avx512)
{
    if (!xq && avx512) {
        q4f_gemm512(x, xrows, yrows, scale, w, b, y, n, acc);
        return;
    }
    const size_t in = w->cols, out = w->rows;
    if (xq) {
        /* Row blocks outermost: a block's rows stay in L1 across the tokens. */
        for (size_t o = 0; o < out; o += 8) {
            const size_t R = out - o < 8 ? out - o : 8;
            for (size_t i = 0; i < n; i++) {
                const float *xi = x + (xrows ? xrows[i] : i) * in;
                float *yi = y + (yrows ? yrows[i] : i) * out;
                const float s = scale ? scale[i] : 1.0f;
                float v[8];
                q4q8_rows8(w, o, xq->q + i * in, xq->a[i], v);
                q4_emit(w, o, R, xi, v, yi, b, acc, s);
            }
        }
        return;
    }
    for (size_t o = 0; o < out; o += 4) {
        const size_t R = out - o < 4 ? out - o : 4;
        for (size_t i = 0; i < n; i += 2) {
            const int T = n - i >= 2 ? 2 : 1;
            const float *xr[2];
            for (int t = 0; t < T; t++)
                xr[t] = x + (xrows ? xrows[i + (size_t)t] : i + (size_t)t) * in;
            float v[8];
            if (T == 2)
                q4f_rows4(w, o, 2, xr, v);
            else
                q4f_rows4(w, o, 1, xr, v);
            for (int t = 0; t < T; t++) {
                const size_t ti = i + (size_t)t;
                float *yi = y + (yrows ? yrows[ti] : ti) * out;
                const float s = scale ? scale[ti] : 1.0f;
                q4_emit(w, o, R, xr[t], v + t * 4, yi, b, acc, s);
            }
        }
    }
}

#endif /* COLIBRI_BACKEND_X86 */
