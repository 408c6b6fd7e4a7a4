/*
 * Optimised backend, x86-64: the block form of int8 activations
 * (INT8_BLOCKS: one f32 scale per COLIBRI_ACT_BLOCK = 32 columns of a token's
 * row) with I8 and I4 weights, and the block quantiser. Three instruction
 * sets, picked by colibri_kernels_x86_caps():
 *
 *   AVX2         vpmaddubsw + vpmaddwd: 32 products of u8 x s8 into 8 int32
 *   AVX-VNNI     vpdpbusd on ymm (VEX), the same 32 products in one step
 *   AVX-512 VNNI vpdpbusd on zmm: two blocks (64 columns) a step; a lone
 *                block or the row's partial last one on ymm (AVX-512VL)
 *
 * Every kernel gives the reference's bits (colibri_matvec_q8b,
 * colibri_matvec_q4b): the integer sums of a block are exact in any order,
 * and per output row the f32 operations are the reference's, in its order,
 * unfused. The kernels compute 8 output rows at once for one token: each
 * row's block sum is reduced to one int32 (q4_hsum8's transpose: lanes =
 * rows), then the 8 rows' running values take (float)sum · a_b (I8) or
 * (float)sum · (s_g · a_b) (I4) in one vector each. Tokens run inside a row
 * block, so a block's 8 rows stay in L1 across the call's tokens.
 *
 * - I8, sign trick (AVX2, AVX-VNNI): |Q| as u8 times xq with Q's sign as s8.
 *   |Q| <= 128 and |xq| <= 127, so vpmaddubsw's pairs stay below 2^15.
 *   zmm: (xq + 128) as u8 times Q, less 128 · Σ Q of the row's block (a
 *   second vpdpbusd), exact in wrapping int32 (AVX-512 has no vpsignb).
 * - I4: u = Q + 8 (0..15) as u8 in the nibbles' packed order (the 16 even
 *   columns, then the 16 odd), xq reordered the same way; Σ Q·xq =
 *   Σ u·xq - 8 · Σ xq, the correction once per token and block for 8 rows.
 *   Groups of 32 columns or more (a block lies in one group); smaller
 *   groups (8, 16) run the reference kernel.
 * - E, the companion bias and the layer bias: the operations of
 *   colibri_q8_compensate, colibri_q4_epilogue and colibri_emit in their
 *   order, f16 widened by F16C, so E costs a few instructions an entry.
 *
 * A row's partial last block is copied into zero-padded buffers (zero
 * weights and zero activations add nothing, nothing is read past a row).
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_X86)

#include <immintrin.h>
#include "colibri_format.h"

#define BLK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define BLK_AVXVNNI __attribute__((target("avxvnni,avx2,fma,f16c")))
#define BLK_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define BLK_INLINE static inline __attribute__((always_inline))

/* ---- Helpers shared by the three (AVX2 code, inlined into each) ---- */

/* Lane r of the result = the sum of a[r]'s 8 int32 lanes (exact). */
BLK_INLINE BLK_AVX2 __m256i hsum8(const __m256i a[8])
{
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

/* 32 int8 from p, or the n < 32 there and zeros. */
BLK_INLINE BLK_AVX2 __m256i load_i8(const int8_t *p, size_t n)
{
    if (n == 32)
        return _mm256_loadu_si256((const __m256i *)p);
    int8_t buf[32] = {0};
    memcpy(buf, p, n);
    return _mm256_loadu_si256((const __m256i *)buf);
}

/* Columns [c, c + n) of an I4 row (c even, n <= 32) as 16 packed bytes,
 * zero beyond n. */
BLK_INLINE BLK_AVX2 __m128i q4_packed(const uint8_t *row, size_t c, size_t n)
{
    if (n == 32)
        return _mm_loadu_si128((const __m128i *)(row + (c >> 1)));
    uint8_t buf[16] = {0};
    memcpy(buf, row + (c >> 1), (n + 1) >> 1);
    if (n & 1u)
        buf[n >> 1] &= 0x0Fu; /* a column past n shares the last byte */
    return _mm_loadu_si128((const __m128i *)buf);
}

/* u = Q + 8 of 32 columns: the low nibbles of the 16 bytes, then the high. */
BLK_INLINE BLK_AVX2 __m256i q4_unsigned(__m128i packed)
{
    const __m128i flipped = _mm_xor_si128(packed, _mm_set1_epi8((char)0x88));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(flipped, 4), flipped), _mm256_set1_epi8(0x0F));
}

/* 32 activations in q4_unsigned's order: per 16, the evens then the odds. */
BLK_INLINE BLK_AVX2 __m256i q4_split(__m256i v)
{
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, evens_odds), 0xD8);
}

/* 8 · Σ of 32 int8 activations (exact). */
BLK_INLINE BLK_AVX2 int32_t eight_sum(__m256i x)
{
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), x), _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* The 8 rows from o (rows past the matrix repeat its last one; their
 * results are never stored). */
static void rows8_q8(const colibri_matrix *w, size_t o, const int8_t *row[8])
{
    for (size_t r = 0; r < 8; r++)
        row[r] = (const int8_t *)w->data + (o + r < w->rows ? o + r : w->rows - 1) * (size_t)w->cols;
}

static void rows8_q4(const colibri_matrix *w, size_t o, const uint8_t *row[8], const uint16_t *sc[8])
{
    for (size_t r = 0; r < 8; r++) {
        const size_t orow = o + r < w->rows ? o + r : w->rows - 1;
        row[r] = colibri_q4_row(w, orow);
        sc[r] = colibri_q4_scales(w, orow);
    }
}

/* The 8 rows' f16 scales of group g, widened (exact). */
BLK_INLINE BLK_AVX2 __m256 q4_scales8(const uint16_t *const sc[8], size_t g)
{
    return _mm256_cvtph_ps(_mm_setr_epi16((short)sc[0][g], (short)sc[1][g], (short)sc[2][g], (short)sc[3][g],
                                          (short)sc[4][g], (short)sc[5][g], (short)sc[6][g], (short)sc[7][g]));
}

/* ---- The per-block products, one per instruction set ---- */

/* Σ over 32 columns into 8 int32 lanes of |Q| (u8) times xq with Q's sign
 * (s8), I8; or of u = Q + 8 (u8, 0..15) times xq (s8), I4. vpmaddubsw's
 * pairs stay below 2^15: 2·128·127 and 2·15·128. */
BLK_INLINE BLK_AVX2 __m256i dot_avx2(__m256i u, __m256i xs)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), _mm256_set1_epi16(1));
}

BLK_INLINE BLK_AVXVNNI __m256i dot_avxvnni(__m256i u, __m256i xs)
{
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, xs);
}

BLK_INLINE BLK_VNNI512 __m256i dot_vl(__m256i u, __m256i xs)
{
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xs);
}

/* ---- One block of 8 rows for T <= 4 tokens: each token's running values
 * take block b; each row's weights are loaded (and decoded) once for the T
 * tokens. T is a constant at every call (the functions are inlined). ---- */

#define BLK_DEFINE_BLOCK(SFX, TGT)                                                                            \
    /* I8: acc[t][r] += (float)Σ_{j in b} Q·xq_t · a_tb. */                                                   \
    BLK_INLINE TGT void q8_block_##SFX(int T, const int8_t *const row[8], const int8_t *const *xq, size_t c,  \
                                       size_t n, const float *ab, __m256 *acc)                                \
    {                                                                                                         \
        __m256i xv[4], s[4][8];                                                                               \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                           \
            xv[t] = load_i8(xq[t] + c, n);                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++)                                                   \
        {                                                                                                     \
            const __m256i wv = load_i8(row[r] + c, n), wa = _mm256_abs_epi8(wv);                              \
            _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                       \
                s[t][r] = dot_##SFX(wa, _mm256_sign_epi8(xv[t], wv));                                         \
        }                                                                                                     \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                           \
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(hsum8(s[t])), _mm256_set1_ps(ab[t]))); \
    }                                                                                                         \
    /* I4: acc[t][r] += (float)Σ_{c in b} Q·xq_t · (s_g[r] · a_tb). */                                        \
    BLK_INLINE TGT void q4_block_##SFX(int T, const uint8_t *const row[8], __m256 sg, const int8_t *const *xq, \
                                       size_t c, size_t n, const float *ab, __m256 *acc)                      \
    {                                                                                                         \
        __m256i xv[4], s[4][8];                                                                               \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                           \
            xv[t] = q4_split(load_i8(xq[t] + c, n));                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++)                                                   \
        {                                                                                                     \
            const __m256i u = q4_unsigned(q4_packed(row[r], c, n));                                           \
            _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                       \
                s[t][r] = dot_##SFX(u, xv[t]);                                                                \
        }                                                                                                     \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) {                                                                         \
            const __m256i d = _mm256_sub_epi32(hsum8(s[t]), _mm256_set1_epi32(eight_sum(xv[t])));            \
            acc[t] = _mm256_add_ps(acc[t],                                                                    \
                                   _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sg, _mm256_set1_ps(ab[t])))); \
        }                                                                                                     \
    }

BLK_DEFINE_BLOCK(avx2, BLK_AVX2)
BLK_DEFINE_BLOCK(avxvnni, BLK_AVXVNNI)
BLK_DEFINE_BLOCK(vl, BLK_VNNI512)

/* ---- AVX-512 VNNI: two full blocks (64 columns) a step ---- */

/* The 8 rows' two block sums from s[r] (lanes 0-7 block A, 8-15 block B):
 * *a lane r = row r's A, *b its B. Pairs of rows interleaved and added
 * (unpack 32, then 64), so each 128-bit lane k holds 4 rows' partial sums
 * of lane group k; groups 0, 1 are A's and 2, 3 B's: 23 operations for the
 * 16 sums. */
BLK_INLINE BLK_VNNI512 void hsum8x2(const __m512i s[8], __m256i *a, __m256i *b)
{
    __m512i p[4], q[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        p[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * i], s[2 * i + 1]),
                                _mm512_unpackhi_epi32(s[2 * i], s[2 * i + 1]));
    /* p[i]: per 128-bit lane [r0, r1, r0, r1] partials of rows 2i, 2i+1 */
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        q[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(p[2 * i], p[2 * i + 1]),
                                _mm512_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
    /* q[0]: per 128-bit lane k, rows 0-3's sums over that lane's group; q[1] rows 4-7 */
    const __m512i even = _mm512_shuffle_i32x4(q[0], q[1], 0x88); /* lanes q0.0, q0.2, q1.0, q1.2 */
    const __m512i odd = _mm512_shuffle_i32x4(q[0], q[1], 0xDD);  /* lanes q0.1, q0.3, q1.1, q1.3 */
    const __m512i sum = _mm512_add_epi32(even, odd);             /* [A r0-3, B r0-3, A r4-7, B r4-7] */
    const __m512i ordered = _mm512_shuffle_i32x4(sum, sum, 0xD8); /* [A r0-3, A r4-7, B r0-3, B r4-7] */
    *a = _mm512_castsi512_si256(ordered);
    *b = _mm512_extracti64x4_epi64(ordered, 1);
}

/* I8, T tokens: (xq + 128) as u8 times Q, less 128 · Σ Q of each row's
 * blocks (once for the T tokens): exact in wrapping int32. */
BLK_INLINE BLK_VNNI512 void q8_pair_vnni(int T, const int8_t *const row[8], const int8_t *const *xq, size_t c,
                                         const float *a0, const float *a1, __m256 *acc)
{
    const __m512i c128 = _mm512_set1_epi8(-128); /* 0x80: 128 as u8 */
    __m512i xf[4], s[4][8], corr[8];
    #pragma GCC unroll 4
    for (int t = 0; t < T; t++)
        xf[t] = _mm512_xor_si512(_mm512_loadu_si512(xq[t] + c), c128);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        const __m512i wv = _mm512_loadu_si512(row[r] + c);
        corr[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv);
        #pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            s[t][r] = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xf[t], wv), corr[r]);
    }
    #pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        __m256i d0, d1;
        hsum8x2(s[t], &d0, &d1);
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(a0[t])));
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(a1[t])));
    }
}

/* I4, 64 columns: u of the 32 bytes as [low nibbles, high nibbles], xq as
 * [evens of A, evens of B, odds of A, odds of B]; so lanes 0-3 and 8-11 of
 * a row's sum are block A, 4-7 and 12-15 block B; the halves added first
 * ([A in 0-3, B in 4-7]), then reduced as hsum8 does, keeping A and B in
 * their 128-bit halves. */
BLK_INLINE BLK_VNNI512 void q4_pair_vnni(int T, const uint8_t *const row[8], __m256 sg0, __m256 sg1,
                                         const int8_t *const *xq, size_t c, const float *a0, const float *a1,
                                         __m256 *acc)
{
    __m512i xv[4], s[4][8];
    int32_t ea[4], eb[4];
    #pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        const __m256i xa = q4_split(_mm256_loadu_si256((const __m256i *)(xq[t] + c)));
        const __m256i xb = q4_split(_mm256_loadu_si256((const __m256i *)(xq[t] + c + 32)));
        /* xa = [A's 16 evens | A's 16 odds] by 128-bit lane, xb the same for B */
        xv[t] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(xa, xb, 0x20)),
                                   _mm256_permute2x128_si256(xa, xb, 0x31), 1);
        ea[t] = eight_sum(xa);
        eb[t] = eight_sum(xb);
    }
    const __m256i mask = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        const __m256i p = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row[r] + (c >> 1))),
                                           _mm256_set1_epi8((char)0x88));
        const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(p, mask)),
                                             _mm256_and_si256(_mm256_srli_epi16(p, 4), mask), 1);
        #pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            s[t][r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv[t]);
    }
    #pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        __m256i f[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++)
            f[r] = _mm256_add_epi32(_mm512_castsi512_si256(s[t][r]), _mm512_extracti64x4_epi64(s[t][r], 1));
        const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(f[0], f[1]), _mm256_hadd_epi32(f[2], f[3]));
        const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(f[4], f[5]), _mm256_hadd_epi32(f[6], f[7]));
        /* h0 = [rows 0-3 of A | rows 0-3 of B], h1 the same for rows 4-7 */
        const __m256i d0 = _mm256_sub_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_set1_epi32(ea[t]));
        const __m256i d1 = _mm256_sub_epi32(_mm256_permute2x128_si256(h0, h1, 0x31), _mm256_set1_epi32(eb[t]));
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(sg0, _mm256_set1_ps(a0[t]))));
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(sg1, _mm256_set1_ps(a1[t]))));
    }
}

/* ---- T tokens, 8 rows: v[t·8 + r] the running value after every block ---- */

/* One token (GEMV, the decode step): the 8 rows two row blocks ahead
 * (`ahead` bytes on), the cache line at byte `at` of each; beyond the
 * matrix a prefetch is a no-op (it never faults). From memory the hardware
 * prefetcher alone does not follow 8 interleaved row streams. */
BLK_INLINE void prefetch8(const int8_t *const row[8], size_t ahead, size_t at)
{
    for (int r = 0; r < 8; r++)
        __builtin_prefetch(row[r] + ahead + at);
}

/* Block b's scale of each of the T tokens (token t's scales at a[t] + b). */
BLK_INLINE void block_scales(int T, const float *const *a, size_t b, float *ab)
{
    #pragma GCC unroll 4
    for (int t = 0; t < T; t++)
        ab[t] = a[t][b];
}

#define BLK_DEFINE_ROWS(SFX, TGT, PAIRS)                                                                       \
    BLK_INLINE TGT void q8_rows8_##SFX(int T, const colibri_matrix *w, size_t o, const int8_t *const *xq,     \
                                       const float *const *a, float *v)                                       \
    {                                                                                                          \
        const size_t in = w->cols;                                                                             \
        const int8_t *row[8];                                                                                  \
        rows8_q8(w, o, row);                                                                                   \
        __m256 acc[4];                                                                                         \
        float a0[4], a1[4];                                                                                    \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                            \
            acc[t] = _mm256_setzero_ps();                                                                      \
        size_t c = 0;                                                                                          \
        if (PAIRS)                                                                                             \
            for (; c + 64 <= in; c += 64) {                                                                    \
                if (T == 1)                                                                                    \
                    prefetch8(row, 16 * in, c);                                                                \
                block_scales(T, a, c / 32, a0);                                                                \
                block_scales(T, a, c / 32 + 1, a1);                                                            \
                q8_pair_vnni(T, row, xq, c, a0, a1, acc);                                                      \
            }                                                                                                  \
        for (; c < in; c += 32) {                                                                              \
            if (T == 1 && !(c & 63))                                                                           \
                prefetch8(row, 16 * in, c);                                                                    \
            block_scales(T, a, c / 32, a0);                                                                    \
            q8_block_##SFX(T, row, xq, c, in - c < 32 ? in - c : 32, a0, acc);                                 \
        }                                                                                                      \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                            \
            _mm256_storeu_ps(v + 8 * t, acc[t]);                                                               \
    }                                                                                                          \
    BLK_INLINE TGT void q4_rows8_##SFX(int T, const colibri_matrix *w, size_t o, const int8_t *const *xq,     \
                                       const float *const *a, float *v)                                       \
    {                                                                                                          \
        const size_t in = w->cols, log2 = w->q4_group_log2;                                                    \
        const uint8_t *row[8];                                                                                 \
        const uint16_t *sc[8];                                                                                 \
        rows8_q4(w, o, row, sc);                                                                               \
        __m256 acc[4];                                                                                         \
        float a0[4], a1[4];                                                                                    \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                            \
            acc[t] = _mm256_setzero_ps();                                                                      \
        size_t c = 0;                                                                                          \
        const size_t ahead = 16 * ((in + 1) / 2);                                                              \
        if (PAIRS)                                                                                             \
            for (; c + 64 <= in; c += 64) {                                                                    \
                if (T == 1 && !(c & 127))                                                                      \
                    prefetch8((const int8_t *const *)(const void *)row, ahead, c / 2);                         \
                block_scales(T, a, c / 32, a0);                                                                \
                block_scales(T, a, c / 32 + 1, a1);                                                            \
                q4_pair_vnni(T, row, q4_scales8(sc, c >> log2), q4_scales8(sc, (c + 32) >> log2), xq, c, a0,   \
                             a1, acc);                                                                         \
            }                                                                                                  \
        for (; c < in; c += 32) {                                                                              \
            if (T == 1 && !(c & 127))                                                                          \
                prefetch8((const int8_t *const *)(const void *)row, ahead, c / 2);                             \
            block_scales(T, a, c / 32, a0);                                                                    \
            q4_block_##SFX(T, row, q4_scales8(sc, c >> log2), xq, c, in - c < 32 ? in - c : 32, a0, acc);      \
        }                                                                                                      \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++)                                                                            \
            _mm256_storeu_ps(v + 8 * t, acc[t]);                                                               \
    }                                                                                                          \
    /* One row block for T = 1, 2, 3 or 4 tokens (each specialised). */                                       \
    static TGT void rows8_##SFX(int i4, int T, const colibri_matrix *w, size_t o, const int8_t *const *xq,     \
                                const float *const *a, float *v)                                               \
    {                                                                                                          \
        switch (T * 2 + i4) {                                                                                  \
        case 2: q8_rows8_##SFX(1, w, o, xq, a, v); break;                                                      \
        case 3: q4_rows8_##SFX(1, w, o, xq, a, v); break;                                                      \
        case 4: q8_rows8_##SFX(2, w, o, xq, a, v); break;                                                      \
        case 5: q4_rows8_##SFX(2, w, o, xq, a, v); break;                                                      \
        case 6: q8_rows8_##SFX(3, w, o, xq, a, v); break;                                                      \
        case 7: q4_rows8_##SFX(3, w, o, xq, a, v); break;                                                      \
        case 8: q8_rows8_##SFX(4, w, o, xq, a, v); break;                                                      \
        default: q4_rows8_##SFX(4, w, o, xq, a, v); break;                                                     \
        }                                                                                                      \
    }

BLK_DEFINE_ROWS(avx2, BLK_AVX2, 0)
BLK_DEFINE_ROWS(avxvnni, BLK_AVXVNNI, 0)
BLK_DEFINE_ROWS(vl, BLK_VNNI512, 1)

typedef void (*rows8_fn)(int i4, int T, const colibri_matrix *w, size_t o, const int8_t *const *xq,
                         const float *const *a, float *v);

/* ---- One token (the decode step, a matrix times one row) ----
 *
 * The kernels above prepare the token's activations inside every 8-row
 * block (the I4 reorder, the corrections' sums); for one token that is a
 * fixed cost per block as large as the weights' own work. Here it is done
 * once per call: the token's int8 row in the I4 nibbles' order (per 64
 * columns: the evens of block A, the evens of B, the odds of A, the odds of
 * B: a 64-byte vector and two 32-byte halves alike) and per block the
 * correction of the unsigned operand's offset (I4: 8 · Σ xq; I8 on zmm,
 * weights u = Q + 128 times xq: 128 · Σ xq). Then per 8 rows and 64
 * columns each row is one load, its decode and one or two dot products, and
 * the 8 rows' two block sums come out of one transpose-and-add (lanes =
 * rows). The integer sums are exact and the f32 steps per row are those of
 * the kernels above, block after block: the reference's bits. The columns
 * after the last full 64 take the per-block kernels above. */
#define GEMV_COLS 8192

typedef struct gemv_act {
    int8_t x[GEMV_COLS];         /* I4: the reordered row (I8 reads xq in place) */
    int32_t corr[GEMV_COLS / 32]; /* per block of the full 64-column pairs */
} gemv_act;

/* Σ of 32 int8 (exact). */
BLK_INLINE BLK_AVX2 int32_t sum32_i8(__m256i x)
{
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* The full 64-column pairs of xq [in] into g: I4 reordered with 8 · Σ per
 * block, I8 128 · Σ per block (only the zmm kernel uses it). */
static BLK_AVX2 void gemv_prepare(int i4, const int8_t *xq, size_t in, gemv_act *g)
{
    for (size_t c = 0; c + 64 <= in; c += 64) {
        const __m256i ra = _mm256_loadu_si256((const __m256i *)(xq + c));
        const __m256i rb = _mm256_loadu_si256((const __m256i *)(xq + c + 32));
        const int32_t sa = sum32_i8(ra), sb = sum32_i8(rb);
        if (i4) {
            const __m256i xa = q4_split(ra), xb = q4_split(rb); /* [evens | odds] of each block */
            _mm256_storeu_si256((__m256i *)(g->x + c), _mm256_permute2x128_si256(xa, xb, 0x20));
            _mm256_storeu_si256((__m256i *)(g->x + c + 32), _mm256_permute2x128_si256(xa, xb, 0x31));
            g->corr[c / 32] = 8 * sa;
            g->corr[c / 32 + 1] = 8 * sb;
        } else {
            g->corr[c / 32] = 128 * sa;
            g->corr[c / 32 + 1] = 128 * sb;
        }
    }
}

/* s[r] (r < 8) with lanes 0-3 block A, 4-7 block B: *a lane r = row r's
 * sum of A, *b of B (exact). */
BLK_INLINE BLK_AVX2 void hsum8_ab(const __m256i s[8], __m256i *a, __m256i *b)
{
    __m256i p[4], q[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        p[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(s[2 * i], s[2 * i + 1]),
                                _mm256_unpackhi_epi32(s[2 * i], s[2 * i + 1]));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        q[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(p[2 * i], p[2 * i + 1]),
                                _mm256_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
    /* q[0] = [A rows 0-3 | B rows 0-3], q[1] the same for rows 4-7 */
    *a = _mm256_permute2x128_si256(q[0], q[1], 0x20);
    *b = _mm256_permute2x128_si256(q[0], q[1], 0x31);
}

/* acc += (float)(sa - ca) · ka, then acc += (float)(sb - cb) · kb: the two
 * blocks' steps in order. */
BLK_INLINE BLK_AVX2 __m256 gemv_steps(__m256 acc, __m256i sa, __m256i sb, int32_t ca, int32_t cb, __m256 ka,
                                      __m256 kb)
{
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sa, _mm256_set1_epi32(ca))), ka));
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sb, _mm256_set1_epi32(cb))), kb));
}

/* I4 AVX2 / AVX-VNNI: 64 columns of 8 rows, the low nibbles times the
 * evens, the high times the odds, summed per row (AVX2 in int16: a pair of
 * vpmaddubsw lanes stays below 2 · 2 · 15 · 127 < 2^15). */
#define BLK_DEFINE_GEMV_Q4(SFX, TGT, DOT2, TAIL)                                                               \
    static TGT void q4_gemv8_##SFX(const colibri_matrix *w, size_t o, const gemv_act *g, const int8_t *xq,    \
                                   const float *a, float *v)                                                  \
    {                                                                                                         \
        const size_t in = w->cols, log2 = w->q4_group_log2, ahead = 16 * ((in + 1) / 2);                     \
        const uint8_t *row[8];                                                                                \
        const uint16_t *sc[8];                                                                                \
        rows8_q4(w, o, row, sc);                                                                              \
        const __m256i mask = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x88);                     \
        __m256 acc = _mm256_setzero_ps();                                                                     \
        size_t c = 0;                                                                                         \
        for (; c + 64 <= in; c += 64) {                                                                       \
            if (!(c & 127))                                                                                   \
                prefetch8((const int8_t *const *)(const void *)row, ahead, c / 2);                            \
            const __m256i xe = _mm256_loadu_si256((const __m256i *)(g->x + c));                               \
            const __m256i xo = _mm256_loadu_si256((const __m256i *)(g->x + c + 32));                          \
            __m256i s[8];                                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++)                                               \
            {                                                                                                 \
                const __m256i p = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row[r] + c / 2)), flip); \
                s[r] = DOT2(_mm256_and_si256(p, mask), xe, _mm256_and_si256(_mm256_srli_epi16(p, 4), mask), xo); \
            }                                                                                                 \
            __m256i sa, sb;                                                                                   \
            hsum8_ab(s, &sa, &sb);                                                                            \
            const size_t blk = c / 32;                                                                        \
            acc = gemv_steps(acc, sa, sb, g->corr[blk], g->corr[blk + 1],                                     \
                             _mm256_mul_ps(q4_scales8(sc, c >> log2), _mm256_set1_ps(a[blk])),                \
                             _mm256_mul_ps(q4_scales8(sc, (c + 32) >> log2), _mm256_set1_ps(a[blk + 1])));    \
        }                                                                                                     \
        for (; c < in; c += 32)                                                                               \
            q4_block_##TAIL(1, row, q4_scales8(sc, c >> log2), &xq, c, in - c < 32 ? in - c : 32, a + c / 32,   \
                            &acc);                                                                            \
        _mm256_storeu_ps(v, acc);                                                                             \
    }

BLK_INLINE BLK_AVX2 __m256i dot2_avx2(__m256i u0, __m256i x0, __m256i u1, __m256i x1)
{
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, x0), _mm256_maddubs_epi16(u1, x1)),
                             _mm256_set1_epi16(1));
}

BLK_INLINE BLK_AVXVNNI __m256i dot2_avxvnni(__m256i u0, __m256i x0, __m256i u1, __m256i x1)
{
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, x0), u1, x1);
}

BLK_DEFINE_GEMV_Q4(avx2, BLK_AVX2, dot2_avx2, avx2)
BLK_DEFINE_GEMV_Q4(avxvnni, BLK_AVXVNNI, dot2_avxvnni, avxvnni)

/* I4 AVX-512 VNNI: the AVX-VNNI kernel's ymm steps with the EVEX
 * vpdpbusd, the decode (n ^ 8) & 15 = Q + 8 one vpternlogd a half. (A zmm
 * form, the packed bytes broadcast and the upper half shifted a nibble,
 * measured slower: its variable shift and vpdpbusd share one port.) */
static BLK_VNNI512 void q4_gemv8_vl(const colibri_matrix *w, size_t o, const gemv_act *g, const int8_t *xq,
                                    const float *a, float *v)
{
    const size_t in = w->cols, log2 = w->q4_group_log2, ahead = 16 * ((in + 1) / 2);
    const uint8_t *row[8];
    const uint16_t *sc[8];
    rows8_q4(w, o, row, sc);
    const __m256i eight = _mm256_set1_epi8(0x08), mask = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    size_t c = 0;
    for (; c + 64 <= in; c += 64) {
        if (!(c & 127))
            prefetch8((const int8_t *const *)(const void *)row, ahead, c / 2);
        const __m256i xe = _mm256_loadu_si256((const __m256i *)(g->x + c));
        const __m256i xo = _mm256_loadu_si256((const __m256i *)(g->x + c + 32));
        __m256i s[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            const __m256i p = _mm256_loadu_si256((const __m256i *)(row[r] + c / 2));
            /* (A ^ B) & C, A the bytes, B = 0x08, C = 0x0F: (0xF0 ^ 0xCC) & 0xAA = 0x28 */
            const __m256i lo = _mm256_ternarylogic_epi32(p, eight, mask, 0x28);
            const __m256i hi = _mm256_ternarylogic_epi32(_mm256_srli_epi16(p, 4), eight, mask, 0x28);
            s[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xe), hi, xo);
        }
        __m256i sa, sb;
        hsum8_ab(s, &sa, &sb);
        const size_t blk = c / 32;
        acc = gemv_steps(acc, sa, sb, g->corr[blk], g->corr[blk + 1],
                         _mm256_mul_ps(q4_scales8(sc, c >> log2), _mm256_set1_ps(a[blk])),
                         _mm256_mul_ps(q4_scales8(sc, (c + 32) >> log2), _mm256_set1_ps(a[blk + 1])));
    }
    for (; c < in; c += 32)
        q4_block_vl(1, row, q4_scales8(sc, c >> log2), &xq, c, in - c < 32 ? in - c : 32, a + c / 32, &acc);
    _mm256_storeu_ps(v, acc);
}

/* I8 AVX-512 VNNI: u = Q + 128 (one xor) times xq in place, less the
 * token's 128 · Σ xq of the block: one vpdpbusd a row and 64 columns. The
 * 8 rows are read one after another (GEMV_STRIP columns of each at a time),
 * their integer sums kept, then the blocks' f32 steps taken in block order
 * with lanes = rows: the same operations and bits as reading them in step,
 * but one memory stream instead of 8 a row apart, which some prefetchers do
 * not follow (AMD EPYC, Zen 4, make bench-lm-stream: q8-blocks 9.7 -> 11.5 GB/s). The I4
 * kernel keeps reading in step: row after row measured slower there. */
#define GEMV_STRIP 2048

static BLK_VNNI512 void q8_gemv8_vl(const colibri_matrix *w, size_t o, const gemv_act *g, const int8_t *xq,
                                    const float *a, float *v)
{
    const size_t in = w->cols, full = in / 64 * 64;
    const int8_t *row[8];
    rows8_q8(w, o, row);
    const __m512i c128 = _mm512_set1_epi8(-128);
    __m512i s[GEMV_STRIP / 64][8];
    __m256 acc = _mm256_setzero_ps();
    for (size_t c0 = 0; c0 < full; c0 += GEMV_STRIP) {
        const size_t n = (full - c0 < GEMV_STRIP ? full - c0 : GEMV_STRIP) / 64;
        for (int r = 0; r < 8; r++)
            for (size_t j = 0; j < n; j++) {
                const size_t c = c0 + 64 * j;
                s[j][r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                              _mm512_xor_si512(_mm512_loadu_si512(row[r] + c), c128),
                                              _mm512_loadu_si512(xq + c));
            }
        for (size_t j = 0; j < n; j++) {
            const size_t blk = (c0 + 64 * j) / 32;
            __m256i sa, sb;
            hsum8x2(s[j], &sa, &sb);
            acc = gemv_steps(acc, sa, sb, g->corr[blk], g->corr[blk + 1], _mm256_set1_ps(a[blk]),
                             _mm256_set1_ps(a[blk + 1]));
        }
    }
    for (size_t c = full; c < in; c += 32)
        q8_block_vl(1, row, &xq, c, in - c < 32 ? in - c : 32, a + c / 32, &acc);
    _mm256_storeu_ps(v, acc);
}

typedef void (*gemv8_fn)(const colibri_matrix *w, size_t o, const gemv_act *g, const int8_t *xq, const float *a,
                         float *v);

/* The one-token kernel for an instruction set and dtype, or NULL (I8 below
 * AVX-512 VNNI: the sign trick has no per-token work to hoist). */
static gemv8_fn gemv8_for(int isa, int i4)
{
    if (i4)
        return isa == 2 ? q4_gemv8_vl : isa == 1 ? q4_gemv8_avxvnni : q4_gemv8_avx2;
    return isa == 2 ? q8_gemv8_vl : NULL;
}

/* ---- The driver: rows in blocks of 8, the call's tokens inside in groups
 * of up to 4 (a group's weights decoded once) ---- */

/* The end of rows o .. o + R - 1 of one token from their running values v
 * (scaled: the I8 scale and E already applied, as panel_terms does):
 * the reference's operations in its order (colibri_q8_compensate,
 * colibri_q4_epilogue, colibri_emit) with the f16 values widened by F16C
 * (exact, as the portable conversion). A full block of 8 rows runs in one
 * vector a step; its E entries (contiguous in storage, the rows' pointers
 * never decreasing) have their products e · x[col] formed 8 at a time
 * (gathered, unfused: the reference's products), then each row's chain of
 * adds runs in storage order in its lane, the 8 chains side by side. */
#define EPI_TERMS 16 /* E products formed per chunk */

static BLK_AVX2 void epilogue_row(const colibri_matrix *w, int i4, size_t row, float vr, const float *xi, float *yi,
                                  const float *b, int acc, float s, int scaled)
{
    if (w->q8_ptr && !scaled) {
        uint32_t k, end;
        colibri_q8_terms(w, row, &k, &end);
        for (; k < end; k++)
            vr += _cvtsh_ss(colibri_q8_term_bits(w, k)) * xi[colibri_q8_term_col(w, k)];
    }
    if (i4 && w->q4_bias)
        vr += _cvtsh_ss(w->q4_bias[row]);
    else if (!i4 && w->q8_bias)
        vr += colibri_q8_param(w, (size_t)w->rows + row);
    colibri_emit(yi, row, vr, b, acc, s);
}

/* p[k - lo] = e_k · x[col_k] for k in [lo, hi), hi - lo <= EPI_TERMS (a
 * column past the row reads x[0], as colibri_q8_term_col bounds it). */
static BLK_AVX2 void term_products(const colibri_matrix *w, const float *xi, uint32_t lo, uint32_t hi, float *p)
{
    const __m256i cols = _mm256_set1_epi32((int)w->cols);
    uint32_t k = lo;
    for (; k + 8 <= hi; k += 8) {
        __m256i c = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w->col + k)));
        c = _mm256_and_si256(c, _mm256_cmpgt_epi32(cols, c));
        const __m256 e = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->val + k)));
        _mm256_storeu_ps(p + (k - lo), _mm256_mul_ps(e, _mm256_i32gather_ps(xi, c, 4)));
    }
    for (; k < hi; k++)
        p[k - lo] = _cvtsh_ss(colibri_q8_term_bits(w, k)) * xi[colibri_q8_term_col(w, k)];
}

static BLK_AVX2 void epilogue(const colibri_matrix *w, int i4, size_t o, size_t R, const float *v, const float *xi,
                              float *yi, const float *b, int acc, float s, int scaled)
{
    if (R < 8) {
        for (size_t r = 0; r < R; r++)
            epilogue_row(w, i4, o + r, i4 || scaled ? v[r] : v[r] * colibri_q8_scale(w, o + r), xi, yi, b, acc, s,
                         scaled);
        return;
    }
    const colibri_q8_block par = colibri_q8_params_at(w, o);
    __m256 v8 = _mm256_loadu_ps(v);
    if (!i4 && !scaled)
        v8 = _mm256_mul_ps(v8, par.scale_f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)par.scale_f16))
                                             : _mm256_loadu_ps(par.scale_f32));
    if (w->q8_ptr && !scaled) {
        uint32_t begin[8], end[8], lo = UINT32_MAX, hi = 0;
        for (int r = 0; r < 8; r++) {
            colibri_q8_terms(w, o + (size_t)r, &begin[r], &end[r]);
            if (begin[r] < end[r]) {
                lo = begin[r] < lo ? begin[r] : lo;
                hi = end[r] > hi ? end[r] : hi;
            }
        }
        float p[EPI_TERMS];
        for (uint32_t c0 = lo; c0 < hi; c0 += EPI_TERMS) { /* chunks in storage order */
            const uint32_t c1 = hi - c0 < EPI_TERMS ? hi : c0 + EPI_TERMS;
            term_products(w, xi, c0, c1, p);
            /* lane r: row r's entries in the chunk, as offsets into p (0..EPI_TERMS) */
            int32_t kb[8], ke[8], most = 0;
            for (int r = 0; r < 8; r++) {
                kb[r] = (int32_t)((begin[r] > c0 ? begin[r] : c0) - c0);
                ke[r] = (int32_t)((end[r] < c1 ? end[r] : c1) - c0);
                ke[r] = ke[r] > kb[r] ? ke[r] : kb[r];
                most = ke[r] - kb[r] > most ? ke[r] - kb[r] : most;
            }
            const __m256i kend = _mm256_loadu_si256((const __m256i *)ke);
            __m256i k = _mm256_loadu_si256((const __m256i *)kb);
            /* each row's chain one add a step, the 8 rows at once; a lane past its row's
             * entries keeps its value (a blend: adding 0 would turn -0 into +0) */
            for (int32_t j = 0; j < most; j++, k = _mm256_add_epi32(k, _mm256_set1_epi32(1))) {
                const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(kend, k));
                const __m256 t = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), p, k, live, 4);
                v8 = _mm256_blendv_ps(v8, _mm256_add_ps(v8, t), live);
            }
        }
    }
    if (i4 && w->q4_bias)
        v8 = _mm256_add_ps(v8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->q4_bias + o))));
    else if (!i4 && (par.bias_f16 || par.bias_f32))
        v8 = _mm256_add_ps(v8, par.bias_f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)par.bias_f16))
                                            : _mm256_loadu_ps(par.bias_f32));
    if (b)
        v8 = _mm256_add_ps(v8, _mm256_loadu_ps(b + o));
    if (acc)
        v8 = _mm256_add_ps(_mm256_loadu_ps(yi + o), _mm256_mul_ps(_mm256_set1_ps(s), v8));
    _mm256_storeu_ps(yi + o, v8);
}

/* ---- Prefill with AVX-512 VNNI: a GEMM with the tokens in the lanes ----
 *
 * From PANEL_MIN_TOKENS tokens on, a call's tokens go in chunks of 16: the
 * chunk's int8 rows are interleaved once into a panel (column quad k of the
 * 16 tokens: 64 bytes, token t's 4 bytes at 4t), with each token's block
 * corrections 128 · Σ xq and block scales a_tb laid out the same way. Then
 * for each block of 8 weight rows, each row turned into u = Q + 128 (u8,
 * I4 nibbles decoded), one vpdpbusd per row and column quad multiplies its
 * 4 weights (broadcast) by the quad of all 16 tokens: the lanes are the
 * tokens, so a block's sums come out per token without a horizontal sum,
 * and every weight load serves 16 tokens. Σ u·xq - 128 · Σ xq = Σ Q·xq,
 * exact in wrapping int32; per lane the f32 steps are the reference's:
 * v += (float)sum · a_tb (I8), v += (float)sum · (s_g · a_tb) (I4), block
 * after block. So these give the reference's bits, as the kernels above.
 * The panel and a block's rows live on the stack (about 36 KiB): rows of
 * up to PANEL_COLS columns; wider ones take the kernels above. */
#define PANEL_TOKENS 16
#define PANEL_ROWS 8
#define PANEL_COLS 1536
#define PANEL_MIN_TOKENS 8
#define PANEL_BLOCKS (PANEL_COLS / 32)

typedef struct blk_panel {
    int8_t x[PANEL_COLS / 4][PANEL_TOKENS * 4]; /* [quad][token · 4 + byte] */
    int32_t corr[PANEL_BLOCKS][PANEL_TOKENS];   /* 128 · Σ xq of the block */
    float a[PANEL_BLOCKS][PANEL_TOKENS];        /* the block's scale */
} blk_panel;

/* Tokens [i0, i0 + T) of xq (T <= 16) into the panel; lanes from T on and
 * columns from `in` on are zero (their products add nothing). */
static BLK_VNNI512 void panel_tokens(blk_panel *p, const colibri_qrows *xq, size_t in, size_t i0, size_t T)
{
    const size_t nb = colibri_act_blocks(in), quads = nb * 8;
    memset(p->x, 0, quads * sizeof p->x[0]);
    for (size_t t = 0; t < PANEL_TOKENS; t++) {
        const int8_t *q = t < T ? xq->q + (i0 + t) * in : NULL;
        for (size_t b = 0; b < nb; b++) {
            int32_t sum = 0;
            if (q) {
                const size_t c0 = b * 32, len = in - c0 < 32 ? in - c0 : 32;
                for (size_t c = 0; c < len; c++) {
                    p->x[(c0 + c) >> 2][t * 4 + (c & 3)] = q[c0 + c];
                    sum += q[c0 + c];
                }
            }
            p->corr[b][t] = 128 * sum;
            p->a[b][t] = q ? xq->a[(i0 + t) * nb + b] : 0.0f;
        }
    }
}

/* Rows [o, o + 8) as u = Q + 128 [8][cols rounded up to 32], rows past the
 * matrix repeating its last (never stored), columns past it 128 (Q = 0). */
static BLK_VNNI512 void panel_rows(const colibri_matrix *w, size_t o, uint8_t (*u)[PANEL_COLS])
{
    const size_t in = w->cols, padded = colibri_act_blocks(in) * 32;
    const int i4 = w->dtype == COLIBRI_DTYPE_I4;
    /* nibble n (two's complement Q) -> Q + 128 */
    const __m128i lut = _mm_setr_epi8((char)128, (char)129, (char)130, (char)131, (char)132, (char)133, (char)134,
                                      (char)135, 120, 121, 122, 123, 124, 125, 126, 127);
    for (size_t r = 0; r < PANEL_ROWS; r++) {
        const size_t row = o + r < w->rows ? o + r : w->rows - 1;
        uint8_t *dst = u[r];
        size_t c = 0;
        if (i4) {
            const uint8_t *src = colibri_q4_row(w, row);
            for (; c + 32 <= in; c += 32) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(src + c / 2));
                const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
                _mm_storeu_si128((__m128i *)(dst + c), _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi)));
                _mm_storeu_si128((__m128i *)(dst + c + 16), _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi)));
            }
            for (; c < in; c++)
                dst[c] = (uint8_t)(colibri_q4_nibble(src, c) + 128);
        } else {
            const int8_t *src = (const int8_t *)w->data + row * in;
            for (; c + 64 <= in; c += 64)
                _mm512_storeu_si512(dst + c, _mm512_xor_si512(_mm512_loadu_si512(src + c), _mm512_set1_epi8(-128)));
            for (; c < in; c++)
                dst[c] = (uint8_t)(src[c] ^ -128);
        }
        for (; c < padded; c++)
            dst[c] = 128;
    }
}

/* v[r][t] = the running value of row o + r for token t after every block. */
static BLK_VNNI512 void panel_dot(const colibri_matrix *w, size_t o, const blk_panel *p,
                                  const uint8_t (*u)[PANEL_COLS], float v[PANEL_ROWS][PANEL_TOKENS])
{
    const size_t nb = colibri_act_blocks(w->cols);
    const int i4 = w->dtype == COLIBRI_DTYPE_I4;
    const uint16_t *sc[PANEL_ROWS];
    __m512 acc[PANEL_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < PANEL_ROWS; r++) {
        acc[r] = _mm512_setzero_ps();
        sc[r] = i4 ? colibri_q4_scales(w, o + (size_t)r < w->rows ? o + (size_t)r : w->rows - 1) : NULL;
    }
    const size_t log2 = i4 ? w->q4_group_log2 : 0;
    for (size_t b = 0; b < nb; b++) {
        __m512i s[PANEL_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < PANEL_ROWS; r++)
            s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (size_t j = 0; j < 8; j++) {
            const size_t quad = b * 8 + j;
            const __m512i xv = _mm512_loadu_si512(p->x[quad]);
#pragma GCC unroll 8
            for (int r = 0; r < PANEL_ROWS; r++) {
                int32_t w4;
                memcpy(&w4, u[r] + quad * 4, sizeof w4);
                s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(w4), xv);
            }
        }
        const __m512i corr = _mm512_loadu_si512(p->corr[b]);
        const __m512 a = _mm512_loadu_ps(p->a[b]);
        if (i4) {
#pragma GCC unroll 8
            for (int r = 0; r < PANEL_ROWS; r++) {
                const __m512 sa = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(sc[r][(b * 32) >> log2])), a);
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], corr)), sa));
            }
        } else {
#pragma GCC unroll 8
            for (int r = 0; r < PANEL_ROWS; r++)
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], corr)), a));
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < PANEL_ROWS; r++)
        _mm512_storeu_ps(v[r], acc[r]);
}

/* The I8 scale and E of rows o .. o + R - 1 for the panel's T tokens, the
 * tokens in the lanes: per lane (token) the reference's operations in its
 * order (colibri_q8_scale's product, then each row's entries in storage
 * order: e · x[col] rounded, then added), so epilogue's; each entry's
 * value and column read once for the 16 tokens, x gathered at
 * xrow(t) · in + col (below 2^31: at most 65535 rows of PANEL_COLS). Lanes
 * from T on read token i0's row; they are never stored. */
static BLK_VNNI512 void panel_terms(const colibri_matrix *w, int i4, size_t o, size_t R, const float *x,
                                    const uint16_t *xrows, size_t i0, size_t T, float v[PANEL_ROWS][PANEL_TOKENS])
{
    if (!i4)
        for (size_t r = 0; r < R; r++)
            _mm512_storeu_ps(v[r], _mm512_mul_ps(_mm512_loadu_ps(v[r]), _mm512_set1_ps(colibri_q8_scale(w, o + r))));
    if (!w->q8_ptr)
        return;
    const size_t in = w->cols;
    int32_t base[PANEL_TOKENS];
    for (size_t t = 0; t < PANEL_TOKENS; t++) {
        const size_t ti = i0 + (t < T ? t : 0);
        base[t] = (int32_t)((xrows ? xrows[ti] : ti) * in);
    }
    const __m512i vbase = _mm512_loadu_si512(base);
    for (size_t r = 0; r < R; r++) {
        uint32_t k, end;
        colibri_q8_terms(w, o + r, &k, &end);
        if (k >= end)
            continue;
        __m512 vr = _mm512_loadu_ps(v[r]);
        for (; k < end; k++) {
            const __m512i at = _mm512_add_epi32(vbase, _mm512_set1_epi32((int32_t)colibri_q8_term_col(w, k)));
            const __m512 e = _mm512_set1_ps(_cvtsh_ss(colibri_q8_term_bits(w, k)));
            vr = _mm512_add_ps(vr, _mm512_mul_ps(e, _mm512_i32gather_ps(at, x, 4)));
        }
        _mm512_storeu_ps(v[r], vr);
    }
}

static BLK_VNNI512 void gemm_panel(const float *x, const uint16_t *xrows, const uint16_t *yrows, const float *scale,
                                   const colibri_qrows *xq, const colibri_matrix *w, const float *b, float *y,
                                   size_t n, int acc)
{
    const int i4 = w->dtype == COLIBRI_DTYPE_I4;
    const size_t in = w->cols, out = w->rows;
    blk_panel p;
    uint8_t u[PANEL_ROWS][PANEL_COLS];
    float v[PANEL_ROWS][PANEL_TOKENS];
    for (size_t i0 = 0; i0 < n; i0 += PANEL_TOKENS) {
        const size_t T = n - i0 < PANEL_TOKENS ? n - i0 : PANEL_TOKENS;
        panel_tokens(&p, xq, in, i0, T);
        for (size_t o = 0; o < out; o += PANEL_ROWS) {
            const size_t R = out - o < PANEL_ROWS ? out - o : PANEL_ROWS;
            panel_rows(w, o, u);
            panel_dot(w, o, &p, (const uint8_t(*)[PANEL_COLS])u, v);
            panel_terms(w, i4, o, R, x, xrows, i0, T, v);
            for (size_t t = 0; t < T; t++) {
                const size_t ti = i0 + t;
                float vt[PANEL_ROWS];
                for (size_t r = 0; r < R; r++)
                    vt[r] = v[r][t];
                epilogue(w, i4, o, R, vt, x + (xrows ? xrows[ti] : ti) * in, y + (yrows ? yrows[ti] : ti) * out, b,
                         acc, scale ? scale[ti] : 1.0f, 1);
            }
        }
    }
}

/* Token i reads x row xrows ? xrows[i] : i (for E) and block rows i of xq;
 * writes y row yrows ? yrows[i] : i, stored (acc 0) or added with gate s_i. */
static void gemm_blocks(int isa, const float *x, const uint16_t *xrows, const uint16_t *yrows, const float *scale,
                        const colibri_qrows *xq, const colibri_matrix *w, const float *b, float *y, size_t n, int acc)
{
    const int i4 = w->dtype == COLIBRI_DTYPE_I4;
    if (isa == 2 && n >= PANEL_MIN_TOKENS && w->cols <= PANEL_COLS) {
        gemm_panel(x, xrows, yrows, scale, xq, w, b, y, n, acc);
        return;
    }
    const rows8_fn rows8 = isa == 2 ? rows8_vl : isa == 1 ? rows8_avxvnni : rows8_avx2;
    const size_t in = w->cols, out = w->rows, nb = colibri_act_blocks(in);
    const gemv8_fn gemv8 = gemv8_for(isa, i4);
    if (n == 1 && gemv8 && in >= 64 && in <= GEMV_COLS) {
        gemv_act g;
        gemv_prepare(i4, xq->q, in, &g);
        const float *xi = x + (xrows ? xrows[0] : 0) * in;
        float *yi = y + (yrows ? yrows[0] : 0) * out;
        for (size_t o = 0; o < out; o += 8) {
            float v[8];
            gemv8(w, o, &g, xq->q, xq->a, v);
            epilogue(w, i4, o, out - o < 8 ? out - o : 8, v, xi, yi, b, acc, scale ? scale[0] : 1.0f, 0);
        }
        return;
    }
    for (size_t o = 0; o < out; o += 8) {
        const size_t R = out - o < 8 ? out - o : 8;
        for (size_t i = 0; i < n; i += 4) {
            const int T = n - i < 4 ? (int)(n - i) : 4;
            const int8_t *q[4];
            const float *a[4];
            float v[32];
            #pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                q[t] = xq->q + (i + (size_t)t) * in;
                a[t] = xq->a + (i + (size_t)t) * nb;
            }
            rows8(i4, T, w, o, q, a, v);
            #pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const size_t ti = i + (size_t)t;
                epilogue(w, i4, o, R, v + 8 * t, x + (xrows ? xrows[ti] : ti) * in, y + (yrows ? yrows[ti] : ti) * out,
                         b, acc, scale ? scale[ti] : 1.0f, 0);
            }
        }
    }
}

/* I4 groups below a block's 32 columns take the reference kernel. */
static int reference_only(const colibri_matrix *w)
{
    return w->dtype == COLIBRI_DTYPE_I4 && w->q4_group_log2 < 5;
}

#define BLK_DEFINE_LINEAR(SFX, ISA)                                                                         \
    static void linear_blocks_##SFX(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w, \
                                    const float *b, const colibri_qrows *xq, float *restrict y)              \
    {                                                                                                        \
        if (reference_only(w))                                                                               \
            colibri_linear_blocks_ref(x, rows, n, w, b, xq, y);                                              \
        else if (w->rows && n)                                                                               \
            gemm_blocks(ISA, x, rows, NULL, NULL, xq, w, b, y, n, 0);                                        \
    }                                                                                                        \
    static void linear_acc_blocks_##SFX(const float *x, size_t n, const colibri_matrix *w, const float *b,  \
                                        const uint16_t *rows, const float *scale, const colibri_qrows *xq,   \
                                        float *restrict y)                                                   \
    {                                                                                                        \
        if (reference_only(w))                                                                               \
            colibri_linear_acc_blocks_ref(x, n, w, b, rows, scale, xq, y);                                   \
        else if (w->rows && n)                                                                               \
            gemm_blocks(ISA, x, NULL, rows, scale, xq, w, b, y, n, 1);                                       \
    }

BLK_DEFINE_LINEAR(avx2, 0)
BLK_DEFINE_LINEAR(avxvnni, 1)
BLK_DEFINE_LINEAR(vl, 2)

/* ---- The block quantiser, bit for bit colibri_quantize_blocks_ref ---- */

/* roundf (half away from zero) of 8 floats, exactly: v - trunc(v) is exact. */
BLK_INLINE BLK_AVX2 __m256 round_away8(__m256 v)
{
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
    const __m256 frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(v, t));
    const __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    return _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(sign, _mm256_set1_ps(1.0f))));
}

/* One full block of 32: max |x| and non-finiteness by vectors; rows the
 * reference treats specially (zero, NaN or inf, tiny) go to it. */
static BLK_AVX2 void quantize_block32(const float *x, int8_t *q, float *a)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                    _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
    /* NaN lanes: max_ps returns its second operand for NaN, so test every input */
    const __m256 inf = _mm256_set1_ps(__builtin_inff());
    const __m256 bad = _mm256_or_ps(
        _mm256_or_ps(_mm256_cmp_ps(_mm256_and_ps(v0, absmask), inf, _CMP_NLT_UQ),
                     _mm256_cmp_ps(_mm256_and_ps(v1, absmask), inf, _CMP_NLT_UQ)),
        _mm256_or_ps(_mm256_cmp_ps(_mm256_and_ps(v2, absmask), inf, _CMP_NLT_UQ),
                     _mm256_cmp_ps(_mm256_and_ps(v3, absmask), inf, _CMP_NLT_UQ)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float m = _mm_cvtss_f32(m4);
    if (_mm256_movemask_ps(bad) || m == 0.0f || m < 0x1p-100f) {
        colibri_quantize_rows_ref(x, NULL, 1, 32, q, a);
        return;
    }
    const float inv = 127.0f / m;
    const __m256 inv8 = _mm256_set1_ps(inv), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    const __m256 vs[4] = {v0, v1, v2, v3};
    __m256i i32[4];
    for (int j = 0; j < 4; j++) /* (x · 1) · inv, as the reference with s = 1: x · 1 is x */
        i32[j] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(round_away8(_mm256_mul_ps(vs[j], inv8)), lim), nlim));
    const __m256i p16 = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_packs_epi16(p16, p16b);
    /* packs work per 128-bit lane: undo the interleave */
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *a = m / 127.0f;
}

static BLK_AVX2 void quantize_blocks_x86(const float *x, const uint16_t *rows, size_t n, size_t in,
                                         int8_t *restrict q, float *restrict a)
{
    const size_t nb = colibri_act_blocks(in), full = in / 32;
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + (rows ? rows[i] : i) * in;
        for (size_t blk = 0; blk < full; blk++)
            quantize_block32(xi + blk * 32, q + i * in + blk * 32, a + i * nb + blk);
        if (full < nb)
            colibri_quantize_rows_ref(xi + full * 32, NULL, 1, in - full * 32, q + i * in + full * 32, a + i * nb + full);
    }
}

/* isa: 0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI (with BW and VL). */
void colibri_x86_blocks(colibri_kernels *k, int isa)
{
    k->quantize_blocks = quantize_blocks_x86;
    if (isa == 2) {
        k->linear_blocks = linear_blocks_vl;
        k->linear_acc_blocks = linear_acc_blocks_vl;
    } else if (isa == 1) {
        k->linear_blocks = linear_blocks_avxvnni;
        k->linear_acc_blocks = linear_acc_blocks_avxvnni;
    } else {
        k->linear_blocks = linear_blocks_avx2;
        k->linear_acc_blocks = linear_acc_blocks_avx2;
    }
}

#endif /* COLIBRI_BACKEND_X86 */
