/*
 * q4_kernels [SECONDS]
 *
 * Microseconds per linear call of one wide layer in f32, q8 and q4 (group 32),
 * with f32 and with int8 activations, through the build's optimised kernel
 * table (colibri_kernels_optimised: on x86-64 the AVX2/AVX-512 kernels this
 * CPU has) and the reference table, at batch 1 and 8: `make bench-q4`.
 * Shapes: 1024 x 1024 (the weights fit a large L2/L3) and 4096 x 4096 (64 MB
 * of f32 weights: memory-bound). Random weights and inputs; each figure the
 * median of repeated timed calls over about SECONDS / 20 (default 10).
 * Prints one line per case: shape, batch, dtype, activations, µs, and MAC/ns.
 * Timings, not pinned: they depend on the machine.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri_format.h"
#include "colibri_kernels.h"

#include "../tests/c/colibri_rng.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t state = 0x9E3779B97F4A7C15u;
static uint32_t rnd(void)
{
    return (uint32_t)(colibri_xorshift64(&state) >> 32);
}

static void *alloc(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 1) != 0) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double time_us(const colibri_kernels *k, const colibri_matrix *w, const float *x, size_t n,
                      const colibri_qrows *xq, float *y, double budget)
{
    double t[201];
    size_t reps = 0;
    k->linear(x, NULL, n, w, NULL, xq, y); /* warm */
    const double stop = now() + budget;
    while (reps < 201 && (reps < 5 || now() < stop)) {
        const double t0 = now();
        k->linear(x, NULL, n, w, NULL, xq, y);
        t[reps++] = (now() - t0) * 1e6;
    }
    qsort(t, reps, sizeof t[0], cmp);
    return t[reps / 2];
}

int main(int argc, char **argv)
{
    const double seconds = argc > 1 ? atof(argv[1]) : 10.0;
    colibri_kernels opt, ref;
    colibri_kernels_optimised(&opt);
    colibri_kernels_reference(&ref);
    printf("kernels: %s\n", opt.name);
    static const size_t dims[2] = {1024, 4096};
    static const size_t batches[2] = {1, 8};
    for (size_t d = 0; d < 2; d++) {
        const size_t rows = dims[d], cols = dims[d], G = cols / 32;
        float *wf = alloc(rows * cols * sizeof *wf);
        int8_t *wq = alloc(rows * cols);
        uint8_t *w4 = alloc(rows * cols / 2);
        float *s8 = alloc(rows * sizeof *s8);
        uint16_t *s4 = alloc(rows * G * sizeof *s4);
        float *x = alloc(8 * cols * sizeof *x), *y = alloc(8 * rows * sizeof *y), *xa = alloc(8 * sizeof *xa);
        int8_t *xq = alloc(8 * cols);
        for (size_t i = 0; i < rows * cols; i++) {
            wf[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
            wq[i] = (int8_t)((int)(rnd() % 255) - 127);
        }
        for (size_t i = 0; i < rows * cols / 2; i++)
            w4[i] = (uint8_t)rnd();
        for (size_t i = 0; i < rows; i++)
            s8[i] = 0.01f;
        for (size_t i = 0; i < rows * G; i++)
            s4[i] = 0x2000u; /* 2^-7 */
        for (size_t i = 0; i < 8 * cols; i++)
            x[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
        ref.quantize_rows(x, NULL, 8, cols, xq, xa);
        const colibri_qrows q = {xq, xa};
        colibri_matrix m[3];
        memset(m, 0, sizeof m);
        for (int i = 0; i < 3; i++) {
            m[i].rows = (uint32_t)rows;
            m[i].cols = (uint32_t)cols;
        }
        m[0].dtype = COLIBRI_DTYPE_F32;
        m[0].data = wf;
        m[1].dtype = COLIBRI_DTYPE_I8;
        m[1].data = wq;
        m[1].scale = s8;
        m[2].dtype = COLIBRI_DTYPE_I4;
        m[2].data = w4;
        m[2].scale = s4;
        m[2].q8_f16 = 1;
        m[2].q4_group_log2 = 5;
        m[2].q4_groups = (uint32_t)G;
        static const char *const names[3] = {"f32", "q8", "q4"};
        for (size_t bi = 0; bi < 2; bi++)
            for (int i = 0; i < 3; i++)
                for (int i8 = 0; i8 <= (i > 0); i8++)
                    for (int r = 0; r < 2; r++) {
                        if (r && (d == 1 || bi == 1))
                            continue; /* the reference only on the smaller layer at batch 1 */
                        const size_t n = batches[bi];
                        const double us = time_us(r ? &ref : &opt, &m[i], x, n, i8 ? &q : NULL, y, seconds / 20.0);
                        printf("%zux%zu batch %zu %s %s-act%s: %.1f us, %.2f MAC/ns\n", rows, cols, n, names[i],
                               i8 ? "int8" : "f32", r ? " (reference kernels)" : "", us,
                               (double)(rows * cols * n) / (us * 1e3));
                    }
        free(wf);
        free(wq);
        free(w4);
        free(s8);
        free(s4);
        free(x);
        free(y);
        free(xa);
        free(xq);
    }
    return 0;
}
