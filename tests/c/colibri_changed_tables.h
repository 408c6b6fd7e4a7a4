/* E's tables changed after validation, for the host kernel drivers (colibri_kernels_x86.c,
 * colibri_blocks_test.c).
 *
 * The row pointers, columns and values of a compensation term E are read in place from the image,
 * so one changed under a live context may hold anything there (the matrix's shape, nnz and
 * pointer width are the plan's, in the arena). colibri_change_tables() gives a matrix with E
 * copies of its tables, changed: columns past cols (just past, where a padded x holds NaN, or
 * near 0xFFFF), row pointers past nnz (into the NaN values after the tables), at the width's
 * maximum, or below the row before. Each copy is a heap block of its exact size plus the NaN
 * padding after nnz, so the sanitizer build catches a read past it and the plain build sees a
 * NaN output. A kernel given it must give wrong numbers at worst: with finite weights and inputs,
 * a NaN output means a read outside the tables or x. */
#ifndef COLIBRI_CHANGED_TABLES_H
#define COLIBRI_CHANGED_TABLES_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri_kernels.h"
#include "colibri_rng.h"

#define COLIBRI_TABLE_PAD 64u

typedef struct colibri_changed {
    uint16_t *col, *val;
    void *row_ptr;
} colibri_changed;

static inline void *colibri_alloc_exact(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        printf("out of memory\n");
        exit(2);
    }
    return p;
}

static inline uint32_t colibri_table_below(uint64_t *state, uint64_t n)
{
    return (uint32_t)((colibri_xorshift64(state) >> 16) % n);
}

static inline uint32_t colibri_row_ptr_at(const colibri_matrix *w, size_t o)
{
    if (w->q8_ptr == 1)
        return ((const uint8_t *)w->row_ptr)[o];
    if (w->q8_ptr == 2)
        return ((const uint16_t *)w->row_ptr)[o];
    return ((const uint32_t *)w->row_ptr)[o];
}

/* w (with E: q8_nnz > 0) now reads changed copies of its tables; free them with
 * colibri_changed_free(). */
static inline colibri_changed colibri_change_tables(colibri_matrix *w, uint64_t *state)
{
    const uint32_t nnz = w->q8_nnz, width = w->q8_ptr, in = w->cols;
    const size_t out = w->rows;
    colibri_changed c;
    c.col = colibri_alloc_exact((nnz + COLIBRI_TABLE_PAD) * sizeof *c.col);
    c.val = colibri_alloc_exact((nnz + COLIBRI_TABLE_PAD) * sizeof *c.val);
    c.row_ptr = colibri_alloc_exact((out + 1) * width);
    for (uint32_t e = 0; e < nnz + COLIBRI_TABLE_PAD; e++) {
        c.col[e] = e < nnz ? w->col[e] : 0u;
        c.val[e] = e < nnz ? w->val[e] : 0x7E00u; /* f16 NaN */
    }
    for (uint32_t e = 0; e < nnz; e++)
        if (colibri_table_below(state, 4) == 0)
            c.col[e] = (uint16_t)(colibri_table_below(state, 2) ? in + colibri_table_below(state, COLIBRI_TABLE_PAD)
                                                                : 0xFFFFu - colibri_table_below(state, 16));
    const uint32_t top = width == 1 ? 0xFFu : width == 2 ? 0xFFFFu : 0xFFFFFFFFu;
    for (size_t o = 0; o <= out; o++) {
        uint32_t p = colibri_row_ptr_at(w, o);
        const uint32_t pick = colibri_table_below(state, 8);
        if (pick < 3)
            p = colibri_table_below(state, (uint64_t)nnz + COLIBRI_TABLE_PAD + 1); /* past nnz, or decreasing */
        else if (pick == 3)
            p = top - colibri_table_below(state, 4);
        p = p > top ? top : p;
        if (width == 1)
            ((uint8_t *)c.row_ptr)[o] = (uint8_t)p;
        else if (width == 2)
            ((uint16_t *)c.row_ptr)[o] = (uint16_t)p;
        else
            ((uint32_t *)c.row_ptr)[o] = p;
    }
    w->col = c.col;
    w->val = c.val;
    w->row_ptr = c.row_ptr;
    return c;
}

static inline void colibri_changed_free(colibri_changed *c)
{
    free(c->col);
    free(c->val);
    free(c->row_ptr);
}

#endif /* COLIBRI_CHANGED_TABLES_H */
