/*
 * block_kernels [SECONDS]
 *
 * The block form of int8 activations (INT8_BLOCKS, one scale per 32 columns)
 * against the older forms on the expert layers of the 100 M-class Mixtral
 * token model (512 -> 1408 and 1408 -> 512), q8 and q4 (group 32), batch 1
 * and 8: `make bench-blocks`. Per call, in microseconds and in weight bytes
 * read per second:
 *
 *   f32-act     the default linear kernel (f32 activations)
 *   int8-rows   quantize_rows + linear (INT8_ACT, one scale per token)
 *   int8-blocks quantize_blocks + linear_blocks (INT8_BLOCKS)
 *
 * for every x86-64 level this CPU has (AVX2, AVX-VNNI, AVX-512 VNNI: the
 * block form's instruction sets, colibri_kernels_x86_caps), else the
 * build's optimised table. The weights cycle through copies of the layer
 * totalling at least 768 MiB (beyond this Xeon's 480 MiB L3), so each call
 * streams its weights from memory as a decode step does. First
 * line: this machine's single-core read rate (a 1 GiB buffer summed with
 * AVX2 loads, the best of 5), the bound a weight stream can reach.
 * Then, at the best level and batch 1, the same layers with a compensation
 * term E of 0.5% of the weights. Each figure the median of the timed calls.
 * Timings, not pinned.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri_format.h"
#include "colibri_kernels.h"
#include "kernels/colibri_backend.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t state = 0x9E3779B97F4A7C15u;
static uint32_t rnd(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 32);
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

#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t read_sum(const uint8_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, s);
    return out[0] + out[1] + out[2] + out[3];
}
#else
static uint64_t read_sum(const uint8_t *p, size_t n)
{
    uint64_t s = 0;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s += v;
    }
    return s;
}
#endif

/* One layer in `copies` copies (each the same random weights), cycled. */
typedef struct layer {
    colibri_matrix m[4096];
    size_t copies, bytes; /* weight bytes of one copy (payload and scales) */
} layer;

static void make_layer(layer *l, uint8_t dtype, size_t rows, size_t cols)
{
    const size_t G = cols / 32, payload = dtype == COLIBRI_DTYPE_I8 ? rows * cols : rows * cols / 2;
    const size_t scales = dtype == COLIBRI_DTYPE_I8 ? rows * 2 : rows * G * 2;
    l->bytes = payload + scales;
    l->copies = ((size_t)768 << 20) / l->bytes + 1;
    if (l->copies > 4096)
        l->copies = 4096;
    for (size_t c = 0; c < l->copies; c++) {
        colibri_matrix *m = &l->m[c];
        memset(m, 0, sizeof *m);
        m->dtype = dtype;
        m->rows = (uint32_t)rows;
        m->cols = (uint32_t)cols;
        uint8_t *data = alloc(payload);
        uint16_t *s = alloc(scales);
        if (c == 0) {
            for (size_t i = 0; i < payload; i++)
                data[i] = (uint8_t)rnd();
            for (size_t i = 0; i < scales / 2; i++)
                s[i] = 0x2000u; /* 2^-7 */
        } else {
            memcpy(data, l->m[0].data, payload);
            memcpy(s, l->m[0].scale, scales);
        }
        m->data = data;
        m->scale = s;
        m->q8_f16 = 1;
        if (dtype == COLIBRI_DTYPE_I4) {
            m->q4_group_log2 = 5;
            m->q4_groups = (uint32_t)G;
        }
    }
}

/* A compensation term E of 0.5% of the weights (quantize's default share) on
 * every copy: entries spread evenly along each row, u32 row pointers. */
static void add_e(layer *l)
{
    const size_t rows = l->m[0].rows, cols = l->m[0].cols, per = cols / 200;
    uint32_t *ptr = alloc((rows + 1) * sizeof *ptr);
    uint16_t *col = alloc(rows * per * sizeof *col + 2), *val = alloc(rows * per * sizeof *val + 2);
    for (size_t o = 0; o <= rows; o++)
        ptr[o] = (uint32_t)(o * per);
    for (size_t k = 0; k < rows * per; k++) {
        col[k] = (uint16_t)((k % per) * 200 + (size_t)(rnd() % 200));
        val[k] = 0x2400u; /* 2^-6 */
    }
    for (size_t c = 0; c < l->copies; c++) {
        l->m[c].q8_nnz = (uint32_t)(rows * per);
        l->m[c].q8_ptr = 4;
        l->m[c].row_ptr = ptr;
        l->m[c].col = col;
        l->m[c].val = val;
    }
}

enum { F32_ACT, INT8_ROWS, INT8_BLOCKS };

static double time_us(const colibri_kernels *k, const layer *l, int form, const float *x, size_t n, int8_t *xq,
                      float *xa, float *y, double budget)
{
    double t[401];
    size_t reps = 0, c = 0;
    const size_t in = l->m[0].cols;
    const double stop = now() + budget;
    while (reps < 401 && (reps < 9 || now() < stop)) {
        const colibri_matrix *w = &l->m[c];
        c = (c + 1) % l->copies;
        const double t0 = now();
        const colibri_qrows q = {xq, xa};
        if (form == INT8_ROWS) {
            k->quantize_rows(x, NULL, n, in, xq, xa);
            k->linear(x, NULL, n, w, NULL, &q, y);
        } else if (form == INT8_BLOCKS) {
            k->quantize_blocks(x, NULL, n, in, xq, xa);
            k->linear_blocks(x, NULL, n, w, NULL, &q, y);
        } else {
            k->linear(x, NULL, n, w, NULL, NULL, y);
        }
        t[reps++] = (now() - t0) * 1e6;
    }
    qsort(t, reps, sizeof t[0], cmp);
    return t[reps / 2];
}

int main(int argc, char **argv)
{
    const double seconds = argc > 1 ? atof(argv[1]) : 10.0;

    const size_t big = (size_t)1 << 30;
    uint8_t *buf = alloc(big);
    memset(buf, 1, big);
    double best = 1e30;
    uint64_t sink = 0;
    for (int i = 0; i < 5; i++) {
        const double t0 = now();
        sink += read_sum(buf, big);
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    free(buf);
    printf("single-core read rate: %.1f GB/s (1 GiB, best of 5; checksum %llu)\n", (double)big / best / 1e9,
           (unsigned long long)(sink & 0xFF));

    colibri_kernels tables[3];
    const char *labels[3];
    size_t nt = 0;
#if defined(COLIBRI_BACKEND_X86)
    static const struct {
        int level, avx_vnni;
        const char *label;
    } configs[] = {{1, 0, "AVX2"}, {1, 1, "AVX-VNNI"}, {3, 1, "AVX-512 VNNI"}};
    for (size_t i = 0; i < 3; i++) {
        colibri_kernels k;
        colibri_kernels_reference(&k);
        colibri_kernels_x86_caps(&k, configs[i].level, configs[i].avx_vnni);
        int dup = 0;
        for (size_t j = 0; j < nt; j++)
            dup |= tables[j].linear_blocks == k.linear_blocks;
        if (!dup) {
            tables[nt] = k;
            labels[nt++] = configs[i].label;
        }
    }
#else
    colibri_kernels_optimised(&tables[0]);
    labels[nt++] = tables[0].name;
#endif

    static const size_t shapes[2][2] = {{1408, 512}, {512, 1408}}; /* rows (out), cols (in) */
    static const char *const form_names[3] = {"f32-act", "int8-rows", "int8-blocks"};
    for (size_t s = 0; s < 2; s++) {
        const size_t rows = shapes[s][0], cols = shapes[s][1];
        float *x = alloc(8 * cols * sizeof *x), *y = alloc(8 * rows * sizeof *y);
        float *xa = alloc(8 * colibri_act_blocks(cols) * sizeof *xa);
        int8_t *xq = alloc(8 * cols);
        for (size_t i = 0; i < 8 * cols; i++)
            x[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
        for (int dt = 0; dt < 2; dt++) {
            layer *l = alloc(sizeof *l);
            make_layer(l, dt ? COLIBRI_DTYPE_I4 : COLIBRI_DTYPE_I8, rows, cols);
            for (size_t t = 0; t < nt; t++)
                for (size_t n = 1; n <= 8; n += 7)
                    for (int form = 0; form < 3; form++) {
                        const double us = time_us(&tables[t], l, form, x, n, xq, xa, y, seconds / 24.0);
                        printf("%zu->%zu %s batch %zu %-12s %-11s %8.1f us  %5.2f GB/s of weights\n", cols, rows,
                               dt ? "q4" : "q8", n, labels[t], form_names[form], us,
                               (double)l->bytes / (us * 1e3));
                    }
            /* The same with E at the best level, batch 1: what the compensation costs. */
            add_e(l);
            for (int form = 0; form < 3; form++) {
                const double us = time_us(&tables[nt - 1], l, form, x, 1, xq, xa, y, seconds / 24.0);
                printf("%zu->%zu %s batch 1 %-12s %-11s %8.1f us  with E (0.5%% of the weights)\n", cols, rows,
                       dt ? "q4" : "q8", labels[nt - 1], form_names[form], us);
            }
            free((void *)(uintptr_t)l->m[0].row_ptr);
            free((void *)(uintptr_t)l->m[0].col);
            free((void *)(uintptr_t)l->m[0].val);
            for (size_t c = 0; c < l->copies; c++) {
                free((void *)(uintptr_t)l->m[c].data);
                free((void *)(uintptr_t)l->m[c].scale);
            }
            free(l);
        }
        free(x);
        free(y);
        free(xa);
        free(xq);
    }
    return 0;
}
