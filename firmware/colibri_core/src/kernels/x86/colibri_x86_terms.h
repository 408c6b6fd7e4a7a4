/*
 * The x86-64 kernels' compensation terms E (the I8 and I4 epilogues of
 * colibri_kernels_x86.c, colibri_kernels_x86_blocks.c and
 * colibri_kernels_x86_q4.c), every index read in place bounded where it is
 * used. Included by those files only, after immintrin.h.
 */
#ifndef COLIBRI_X86_TERMS_H
#define COLIBRI_X86_TERMS_H

#include <immintrin.h>

#include "../../colibri_kernels.h"

/* ---- The compensation terms E of a row block, bounded where they are read ----
 *
 * Rows o .. o + R - 1 (R <= 8) of one token: v[r] += Σ e · x[col] over row
 * o + r's entries in storage order, the reference's operations in its order
 * (each product e · x rounded to f32, then added), so its bits. The row
 * pointers, columns and values are read in place from the image; one
 * changed after colibri_init may hold anything there, and these bounds keep
 * every read inside col, val and x (wrong numbers, never a read outside):
 *
 * - the block's entries are k in [p_o, p_{o+R}), that end bounded by nnz
 *   once per block; the rows' inner ends only say which row an entry is
 *   added to, never where to read, and the last row ends at the bounded
 *   end, so every entry lands in a row of the block whatever they hold;
 * - the products are formed eight entries at a time from a window read at
 *   min(k, nnz - 8), inside the tables: eight f16 values widened by F16C,
 *   eight columns bounded by cols - 1 in one vpminud, x gathered by them.
 *
 * So the bounds cost one compare per block and one instruction per eight
 * entries (docs/threading.md). Matrices with fewer than eight entries take
 * the scalar accessors (colibri_q8_terms, colibri_q8_term_col). Out of line,
 * called once per block with entries: inlined, its code changed the
 * register allocation of the GEMM loops around it (a spill in the q8 x int8
 * dot loop cost more than the bounds). Static, one copy per file that calls
 * it (the GEMMs, the block form, the q4 kernels): the compiler then tailors
 * its calling convention, which an extern function's fixes (about 5,000
 * instructions per forward of the edge model in q8). */
static __attribute__((target("avx2,fma,f16c"), noinline, unused)) void
colibri_x86_e_terms(const colibri_matrix *w, size_t o, int R, const float *xi, float *v)
{
    const uint32_t nnz = w->q8_nnz;
    if (nnz < 8) {
        for (int r = 0; r < R; r++) {
            uint32_t k, end;
            colibri_q8_terms(w, o + (size_t)r, &k, &end);
            float acc = v[r];
            for (; k < end; k++)
                acc += _cvtsh_ss(colibri_q8_term_bits(w, k)) * xi[colibri_q8_term_col(w, k)];
            v[r] = acc;
        }
        return;
    }
    uint32_t lo, ends[8]; /* row o + r's entries end at ends[r] */
    switch (w->q8_ptr) {  /* R = 8 (one token) in one vector load */
    case 1: {
        const uint8_t *rp = (const uint8_t *)w->row_ptr + o;
        lo = rp[0];
        if (R == 8)
            _mm256_storeu_si256((__m256i *)ends, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rp + 1))));
        else
            for (int r = 0; r < R; r++)
                ends[r] = rp[r + 1];
        break;
    }
    case 2: {
        const uint16_t *rp = (const uint16_t *)w->row_ptr + o;
        lo = rp[0];
        if (R == 8)
            _mm256_storeu_si256((__m256i *)ends, _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rp + 1))));
        else
            for (int r = 0; r < R; r++)
                ends[r] = rp[r + 1];
        break;
    }
    default: {
        const uint32_t *rp = (const uint32_t *)w->row_ptr + o;
        lo = rp[0];
        for (int r = 0; r < R; r++)
            ends[r] = rp[r + 1];
        break;
    }
    }
    const uint32_t hi = colibri_q8_bound(ends[R - 1], nnz);
    ends[R - 1] = hi;
    if (lo >= hi)
        return;
    const __m256i last = _mm256_set1_epi32((int)(w->cols - 1u));
    uint32_t k = lo;
    int r = 0;
    float acc = v[0];
    do {
        const uint32_t s = k < nnz - 8u ? k : nnz - 8u, stop = s + 8u < hi ? s + 8u : hi;
        __m256i col = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w->col + s)));
        col = COLIBRI_BOUNDED(_mm256_min_epu32(col, last), ((void)last, col));
        float prod[8];
        _mm256_storeu_ps(prod, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->val + s))),
                                             _mm256_i32gather_ps(xi, col, 4)));
        /* Entries k .. stop - 1, row by row: a row ends at ends[r] (one
         * before k: none left), the last at hi >= stop, so r stays < R. */
        for (;;) {
            const uint32_t lim = ends[r] < stop ? ends[r] : stop;
            for (; k < lim; k++)
                acc += prod[k - s];
            if (k >= stop)
                break;
            v[r] = acc;
            acc = v[++r];
        }
    } while (k < hi);
    v[r] = acc;
}

#endif /* COLIBRI_X86_TERMS_H */
