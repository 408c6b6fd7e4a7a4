/*
 * lm_gemm [SECONDS]
 *
 * The linear kernels at prefill batch sizes on the layers of the 100 M-class
 * Mixtral token model (bench/lm_threads.py: experts 512 -> 1408 and
 * 1408 -> 512, attention 512 -> 512 (q, o) and 512 -> 128 (k, v: GQA 8/2),
 * LM head 512 -> 4096), per weight dtype
 * (f32, f16, q8, q4 group 32) with f32 activations and, for q8 and q4, with
 * INT8_BLOCKS (quantize_blocks + linear_blocks), at 1, 16 and 64 tokens, for
 * the AVX2 level and the best one this CPU has (colibri_kernels_x86_caps):
 * `make bench-lm-gemm`. Each figure is multiply-accumulates per nanosecond of
 * the thread's CPU time (CLOCK_THREAD_CPUTIME_ID, so a shared machine's other
 * processes cost little but cache), the median of repeated calls over about
 * SECONDS / 40 (default 8). One weight copy: at 16 and 64 tokens it is read
 * once per call and the work is arithmetic. Then the attention kernel, one
 * head (hd 64) over 16, 64 and 256 cached positions, f32 and f16 caches,
 * reference and optimised, in ns per call. Timings, not pinned.
 * `lm_gemm --stream` (make bench-lm-stream) instead reads one token's weights
 * from memory (stream_mode below).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri_format.h"
#include "colibri_kernels.h"
#include "kernels/colibri_backend.h"

static double cpu_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t state = 0x9E3779B97F4A7C15u;
static uint32_t rnd(void)
{
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
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

static void make_matrix(colibri_matrix *m, uint8_t dtype, size_t rows, size_t cols)
{
    memset(m, 0, sizeof *m);
    m->dtype = dtype;
    m->rows = (uint32_t)rows;
    m->cols = (uint32_t)cols;
    const size_t G = cols / 32;
    if (dtype == COLIBRI_DTYPE_F32) {
        float *d = alloc(rows * cols * sizeof *d);
        for (size_t i = 0; i < rows * cols; i++)
            d[i] = (float)((int)(rnd() % 2001) - 1000) * 2e-5f;
        m->data = d;
        return;
    }
    if (dtype == COLIBRI_DTYPE_F16) {
        uint16_t *d = alloc(rows * cols * sizeof *d);
        for (size_t i = 0; i < rows * cols; i++)
            d[i] = (uint16_t)(0x2000u | (rnd() & 0x83FFu));
        m->data = d;
        return;
    }
    const size_t payload = dtype == COLIBRI_DTYPE_I8 ? rows * cols : rows * cols / 2;
    const size_t scales = dtype == COLIBRI_DTYPE_I8 ? rows : rows * G;
    uint8_t *d = alloc(payload);
    uint16_t *s = alloc(scales * sizeof *s);
    for (size_t i = 0; i < payload; i++)
        d[i] = (uint8_t)rnd();
    for (size_t i = 0; i < scales; i++)
        s[i] = 0x2000u;
    m->data = d;
    m->scale = s;
    m->q8_f16 = 1;
    if (dtype == COLIBRI_DTYPE_I4) {
        m->q4_group_log2 = 5;
        m->q4_groups = (uint32_t)G;
    }
}

static double macs_per_ns(const colibri_kernels *k, const colibri_matrix *w, int blocks, const float *x, size_t n,
                          int8_t *xq, float *xa, float *y, double budget)
{
    double t[301];
    size_t reps = 0;
    const colibri_qrows q = {xq, xa};
    const double stop = cpu_now() + budget;
    while (reps < 301 && (reps < 7 || cpu_now() < stop)) {
        const double t0 = cpu_now();
        if (blocks) {
            k->quantize_blocks(x, NULL, n, w->cols, xq, xa);
            k->linear_blocks(x, NULL, n, w, NULL, &q, y);
        } else {
            k->linear(x, NULL, n, w, NULL, NULL, y);
        }
        t[reps++] = cpu_now() - t0;
    }
    qsort(t, reps, sizeof t[0], cmp);
    return (double)w->rows * w->cols * (double)n / (t[reps / 2] * 1e9);
}

/* lm_gemm --stream: one token through NM expert-sized matrices (1408 x 512), 96 of each dtype, so
 * that each call reads its weights from memory, not a cache (f16: 132 MiB); the best of 7 passes, as
 * GB/s of weights read per second of thread CPU time. Then a plain read of 256 MiB (16 floats summed
 * at a time) for the core's own read rate beside it. */
static void stream_mode(const colibri_kernels *k)
{
    enum { NM = 96 };
    const size_t rows = 1408, cols = 512;
    static const struct {
        uint8_t dtype;
        int blocks;
        const char *name;
        double bytes;
    } forms[] = {{COLIBRI_DTYPE_F32, 0, "f32", 4},      {COLIBRI_DTYPE_F16, 0, "f16", 2},
                 {COLIBRI_DTYPE_I8, 0, "q8", 1},        {COLIBRI_DTYPE_I8, 1, "q8-blocks", 1},
                 {COLIBRI_DTYPE_I4, 1, "q4-blocks", 0.5}};
    float *x = alloc(cols * sizeof *x), *y = alloc(rows * sizeof *y);
    float *xa = alloc(colibri_act_blocks(cols) * sizeof *xa);
    int8_t *xq = alloc(cols);
    for (size_t i = 0; i < cols; i++)
        x[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
    const colibri_qrows q = {xq, xa};
    printf("one token from memory, %s: GB/s of weights (thread CPU time, best of 7)\n", k->name);
    for (size_t f = 0; f < sizeof forms / sizeof forms[0]; f++) {
        colibri_matrix *w = alloc(NM * sizeof *w);
        for (size_t m = 0; m < NM; m++)
            make_matrix(&w[m], forms[f].dtype, rows, cols);
        double best = 1e30;
        for (int rep = 0; rep < 7; rep++) {
            const double t0 = cpu_now();
            for (size_t m = 0; m < NM; m++) {
                if (forms[f].blocks) {
                    k->quantize_blocks(x, NULL, 1, cols, xq, xa);
                    k->linear_blocks(x, NULL, 1, &w[m], NULL, &q, y);
                } else {
                    k->linear(x, NULL, 1, &w[m], NULL, NULL, y);
                }
            }
            const double t = cpu_now() - t0;
            best = t < best ? t : best;
        }
        printf("  %-10s %6.2f GB/s\n", forms[f].name, (double)(rows * cols * NM) * forms[f].bytes / (best * 1e9));
        for (size_t m = 0; m < NM; m++) {
            free((void *)w[m].data);
            free((void *)w[m].scale);
        }
        free(w);
    }
    const size_t n = (256u << 20) / sizeof(float);
    float *a = alloc(n * sizeof *a);
    for (size_t i = 0; i < n; i++)
        a[i] = (float)(i & 1023);
    double best = 1e30, sink = 0.0;
    for (int rep = 0; rep < 5; rep++) {
        const double t0 = cpu_now();
        float s[16] = {0};
        for (size_t i = 0; i < n; i += 16)
            for (int j = 0; j < 16; j++)
                s[j] += a[i + (size_t)j];
        const double t = cpu_now() - t0;
        best = t < best ? t : best;
        for (int j = 0; j < 16; j++)
            sink += s[j];
    }
    printf("  plain read %6.2f GB/s (checksum %.0f)\n", (double)(n * sizeof *a) / (best * 1e9), sink);
    free(a);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--stream")) {
        colibri_kernels k;
        colibri_kernels_optimised(&k);
        stream_mode(&k);
        return 0;
    }
    const double seconds = argc > 1 ? atof(argv[1]) : 8.0;
    colibri_kernels tables[2];
    size_t nt = 0;
#if defined(COLIBRI_BACKEND_X86)
    colibri_kernels_reference(&tables[0]);
    colibri_kernels_x86_caps(&tables[0], 1, 0);
    colibri_kernels_reference(&tables[1]);
    colibri_kernels_x86_caps(&tables[1], 3, 1);
    nt = strcmp(tables[0].name, tables[1].name) ? 2 : 1;
    if (nt == 1)
        tables[0] = tables[1];
#else
    colibri_kernels_optimised(&tables[0]);
    nt = 1;
#endif
    static const size_t shapes[][2] = {{1408, 512}, {512, 1408}, {512, 512}, {128, 512}, {4096, 512}}; /* out, in */
    static const struct {
        uint8_t dtype;
        int blocks;
        const char *name;
    } forms[] = {{COLIBRI_DTYPE_F32, 0, "f32"},      {COLIBRI_DTYPE_F16, 0, "f16"},
                 {COLIBRI_DTYPE_I8, 0, "q8"},        {COLIBRI_DTYPE_I8, 1, "q8-blocks"},
                 {COLIBRI_DTYPE_I4, 0, "q4"},        {COLIBRI_DTYPE_I4, 1, "q4-blocks"}};
    static const size_t batches[] = {1, 16, 64};
    printf("MAC/ns of thread CPU time (median); columns: batch 1, 16, 64\n");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const size_t rows = shapes[s][0], cols = shapes[s][1];
        float *x = alloc(64 * cols * sizeof *x), *y = alloc(64 * rows * sizeof *y);
        float *xa = alloc(64 * colibri_act_blocks(cols) * sizeof *xa);
        int8_t *xq = alloc(64 * cols);
        for (size_t i = 0; i < 64 * cols; i++)
            x[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
        for (size_t f = 0; f < sizeof forms / sizeof forms[0]; f++) {
            colibri_matrix w;
            make_matrix(&w, forms[f].dtype, rows, cols);
            for (size_t t = 0; t < nt; t++) {
                printf("%4zu->%-4zu %-10s %-40s", cols, rows, forms[f].name, tables[t].name);
                for (size_t b = 0; b < 3; b++)
                    printf(" %7.2f", macs_per_ns(&tables[t], &w, forms[f].blocks, x, batches[b], xq, xa, y,
                                                 seconds / 40.0));
                printf("\n");
                fflush(stdout);
            }
        }
    }
    /* Attention: one head of one query row over len cached positions (hd 64, the Mixtral's). */
    printf("attend, hd 64: ns per call of thread CPU time (median), the reference and the optimised table\n");
    const size_t hd = 64, kvw = 128;
    float *q = alloc(hd * sizeof *q), *out = alloc(hd * sizeof *out), *scores = alloc(512 * sizeof *scores);
    float *kf = alloc(512 * kvw * sizeof *kf), *vf = alloc(512 * kvw * sizeof *vf);
    uint16_t *kh = alloc(512 * kvw * sizeof *kh), *vh = alloc(512 * kvw * sizeof *vh);
    for (size_t i = 0; i < hd; i++)
        q[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
    for (size_t i = 0; i < 512 * kvw; i++) {
        kf[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
        vf[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
        kh[i] = colibri_f32_to_f16(kf[i]);
        vh[i] = colibri_f32_to_f16(vf[i]);
    }
    colibri_kernels ref;
    colibri_kernels_reference(&ref);
    const colibri_kernels *pair[2] = {&ref, &tables[nt - 1]};
    for (int f16 = 0; f16 < 2; f16++)
        for (size_t len = 16; len <= 256; len *= 4) {
            printf("  %s cache, len %3zu:", f16 ? "f16" : "f32", len);
            for (int k = 0; k < 2; k++) {
                double t[301];
                size_t reps = 0;
                const double stop = cpu_now() + seconds / 40.0;
                while (reps < 301 && (reps < 7 || cpu_now() < stop)) {
                    const double t0 = cpu_now();
                    for (int i = 0; i < 100; i++)
                        pair[k]->attend(q, f16 ? (const void *)kh : (const void *)kf,
                                        f16 ? (const void *)vh : (const void *)vf, kvw, len, hd, f16, 0.125f, scores,
                                        out);
                    t[reps++] = (cpu_now() - t0) / 100.0;
                }
                qsort(t, reps, sizeof t[0], cmp);
                printf(" %s %8.0f", k ? pair[k]->name : "reference", t[reps / 2] * 1e9);
            }
            printf("\n");
        }
    return 0;
}
