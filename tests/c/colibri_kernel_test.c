/*
 * colibri_kernel_test [EXPECTED_NAME]
 *
 * Every kernel of the build's optimised table (colibri_kernels_optimised)
 * against its reference kernel (colibri_kernels_reference) on random shapes:
 * in and out from 1 (odd sizes, every vector tail) to a few hundred (and
 * edge-sized 256 -> 1024 -> 256 layers), n = 1..9
 * tokens with and without the rows index list, linear and linear_acc (with
 * and without gate scales), with and without bias, f32 / f16 / int8 weights
 * (with and without the compensation term E) with f32 and int8 activations,
 * and inputs holding NaN and ±inf. Written for the NEON backend (run under
 * qemu-aarch64 by tests/kernels/test_kernels_aarch64.py), valid for any backend.
 *
 * Tolerance (the reordering bound of a dot product of length `in`, with and
 * without FMA): |opt - ref| <= 2 (in + 4) eps (|s| M + |y|) + tiny, where
 * M = Σ|w_k x_k| + |E·x| + |b| is the magnitude the output is a sum of and
 * eps = 2^-23 (M is computed in double from the dequantised weights).
 * Exactly equal (bit for bit): int8 × int8 linear kernels, the quantiser,
 * mul/add, ReLU; the other activations are the reference's in this backend
 * and are held to equality too. NaN where the reference has NaN (and only
 * there), ±inf exactly where it has ±inf.
 *
 * Prints the optimised table's name; with EXPECTED_NAME, fails unless the
 * name is that. Every buffer ends at an inaccessible page (gmalloc), so a
 * read or write past any row or tail faults. Exit 0 when every case passes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "colibri.h"
#include "colibri_format.h"
#include "colibri_kernels.h"
#include "colibri_rng.h"

/* ---- Deterministic random numbers (splitmix64) ---- */

static uint64_t rng_state = 0x243F6A8885A308D3u;

static uint64_t rnd(void)
{
    return colibri_splitmix64(&rng_state);
}

static size_t rnd_below(size_t n)
{
    return (size_t)(rnd() % n);
}

static float rnd_unit(void) /* [-1, 1) */
{
    return (float)((double)(rnd() >> 40) / (double)(1u << 23) - 1.0);
}

/* A size in 1..hi, log-uniform-ish, so small odd sizes come up often. */
static size_t rnd_size(size_t hi)
{
    size_t s = 1;
    const size_t bits = 1 + rnd_below(9);
    s = 1 + rnd_below((size_t)1 << bits);
    return s > hi ? 1 + rnd_below(hi) : s;
}

/* f32 -> f16 bits (round to nearest even), for finite |v| within f16 range. */
static uint16_t to_f16(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const float a = fabsf(v);
    if (a < 0x1p-24f)
        return sign;
    if (a < 0x1p-14f) { /* subnormal */
        const long m = lrintf(a * 0x1p24f);
        return (uint16_t)(sign | (uint16_t)m);
    }
    int e;
    const float f = frexpf(a, &e); /* a = f · 2^e, f in [0.5, 1) */
    long m = lrintf(f * 2048.0f);  /* 11 bits: 1024 .. 2048 */
    if (m == 2048) {
        m = 1024;
        e++;
    }
    return (uint16_t)(sign | (uint16_t)((e + 14) << 10) | (uint16_t)(m - 1024));
}

/* The limits of colibri_expf (colibri_math.h), the last finite and first zero results. */
#define COLIBRI_EXPF_EDGE_HI 88.72283172607421875f
#define COLIBRI_EXPF_EDGE_LO -103.972076416015625f

/* ---- Guarded buffers: every buffer a kernel reads or writes ends right at
 * an inaccessible page, so a vector load or store past the end of a row or
 * of a tail faults, under qemu-aarch64 too (where no sanitizer runs). ---- */

static void *gmalloc(size_t size)
{
    const size_t ps = (size_t)sysconf(_SC_PAGESIZE), head = 2 * sizeof(size_t);
    const size_t pages = (size + head + ps - 1) / ps, total = (pages + 1) * ps;
    void *base;
    if (posix_memalign(&base, ps, total) != 0) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    unsigned char *end = (unsigned char *)base + pages * ps, *p = end - size;
    memset(base, 0, pages * ps);
    if (mprotect(end, ps, PROT_NONE) != 0) {
        perror("mprotect");
        exit(2);
    }
    const size_t info[2] = {(size_t)((unsigned char *)p - (unsigned char *)base), total};
    memcpy(p - head, info, sizeof info);
    return p;
}

static void gfree(void *ptr)
{
    if (!ptr)
        return;
    const size_t ps = (size_t)sysconf(_SC_PAGESIZE), head = 2 * sizeof(size_t);
    size_t info[2];
    memcpy(info, (unsigned char *)ptr - head, sizeof info);
    unsigned char *base = (unsigned char *)ptr - info[0];
    if (mprotect(base + info[1] - ps, ps, PROT_READ | PROT_WRITE) != 0) {
        perror("mprotect");
        exit(2);
    }
    free(base);
}

/* ---- Checking ---- */

static unsigned long failures, checks;

static int same_bits(float a, float b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b);
    return memcmp(&a, &b, sizeof a) == 0;
}

static void check(const char *what, size_t idx, float ref, float opt, double tol, int exact)
{
    checks++;
    int ok;
    if (isnan(ref) || isnan(opt) || isinf(ref) || isinf(opt) || exact)
        ok = same_bits(ref, opt);
    else
        ok = fabs((double)ref - (double)opt) <= tol;
    if (!ok) {
        if (failures < 20)
            fprintf(stderr, "FAIL %s [%zu]: ref %.9g opt %.9g (tolerance %.3g)\n", what, idx, (double)ref,
                    (double)opt, tol);
        failures++;
    }
}

/* ---- One linear case ---- */

typedef struct lcase {
    uint8_t dtype;
    int int8_act, acc, use_rows, use_bias, use_scale, nonfinite, comp;
    size_t in, out, n;
} lcase;

static void describe(const lcase *c, char *buf, size_t len)
{
    snprintf(buf, len, "%s%s dtype %u in %zu out %zu n %zu rows %d bias %d scale %d nonfinite %d E %d",
             c->acc ? "linear_acc" : "linear", c->int8_act ? " int8-act" : "", (unsigned)c->dtype, c->in, c->out,
             c->n, c->use_rows, c->use_bias, c->use_scale, c->nonfinite, c->comp);
}

static void run_linear(const colibri_kernels *ref, const colibri_kernels *opt, const lcase *c)
{
    const size_t in = c->in, out = c->out, n = c->n;
    const size_t xrows = n + 3, yrows = n + 3; /* rows lists index beyond n */
    float *x = gmalloc(xrows * in * sizeof *x);
    float *wf = gmalloc(out * in * sizeof *wf);       /* f32 weights, or the dequantised view */
    uint16_t *wh = gmalloc(out * in * sizeof *wh);
    int8_t *wq = gmalloc(out * in * sizeof *wq);
    float *scale_w = gmalloc(out * sizeof *scale_w);
    uint32_t *row_ptr = gmalloc((out + 1) * sizeof *row_ptr);
    uint16_t *col = gmalloc(out * 4 * sizeof *col), *val = gmalloc(out * 4 * sizeof *val);
    float *bias = gmalloc(out * sizeof *bias);
    float *gate = gmalloc(n * sizeof *gate);
    uint16_t rows[16];
    int8_t *xq = gmalloc(n * in * sizeof *xq);
    float *xa = gmalloc(n * sizeof *xa);
    float *y0 = gmalloc(yrows * out * sizeof *y0), *y1 = gmalloc(yrows * out * sizeof *y1);
    if (!x || !wf || !wh || !wq || !scale_w || !row_ptr || !col || !val || !bias || !gate || !xq || !xa || !y0 ||
        !y1) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }

    for (size_t i = 0; i < xrows * in; i++)
        x[i] = rnd_unit() * 2.0f;
    if (c->nonfinite) {
        const float specials[3] = {NAN, INFINITY, -INFINITY};
        for (int j = 0; j < 3; j++)
            x[rnd_below(xrows * in)] = specials[rnd_below(3)];
    }
    for (size_t o = 0; o < out; o++) {
        scale_w[o] = (0.5f + (float)rnd_below(1000) / 1000.0f) / 127.0f;
        bias[o] = rnd_unit();
    }
    for (size_t i = 0; i < out * in; i++) {
        switch (c->dtype) {
        case COLIBRI_DTYPE_F16:
            /* Mostly normal values, some subnormals and zeros. */
            wh[i] = rnd_below(16) == 0 ? (uint16_t)(rnd() & 0x83FFu) : to_f16(rnd_unit());
            wf[i] = colibri_f16_to_f32(wh[i]);
            break;
        case COLIBRI_DTYPE_I8:
            /* -128 too: the image allows it, and the int8 sums must still be exact. */
            wq[i] = (int8_t)((int)rnd_below(256) - 128);
            wf[i] = (float)wq[i] * scale_w[i / in];
            break;
        default:
            wf[i] = rnd_unit();
            break;
        }
    }
    /* E: up to 3 entries per row in increasing columns, f16 values. */
    uint32_t nnz = 0;
    for (size_t o = 0; o < out; o++) {
        row_ptr[o] = nnz;
        if (c->comp) {
            const size_t cnt = rnd_below(4);
            size_t at = 0;
            for (size_t e = 0; e < cnt && at < in; e++) {
                at += rnd_below(in - at);
                col[nnz] = (uint16_t)at;
                val[nnz] = to_f16(rnd_unit() * 0.01f);
                nnz++;
                at++;
            }
        }
    }
    row_ptr[out] = nnz;
    for (size_t i = 0; i < n; i++) {
        rows[i] = (uint16_t)rnd_below(xrows);
        gate[i] = rnd_unit();
    }

    colibri_matrix w = {0};
    w.dtype = c->dtype;
    w.rows = (uint32_t)out;
    w.cols = (uint32_t)in;
    w.data = c->dtype == COLIBRI_DTYPE_F16 ? (const void *)wh : c->dtype == COLIBRI_DTYPE_I8 ? (const void *)wq
                                                                                              : (const void *)wf;
    if (c->dtype == COLIBRI_DTYPE_I8) {
        /* The Q8_PARAMS view of format v1: f32 scales, 32-bit row pointers
         * (kernels read it only through colibri_q8_scale/_compensate). */
        w.q8_nnz = nnz;
        w.q8_ptr = nnz ? 4 : 0;
        w.scale = scale_w;
        w.row_ptr = row_ptr;
        w.col = col;
        w.val = val;
    }
    const uint16_t *rl = c->use_rows ? rows : NULL;
    const float *b = c->use_bias ? bias : NULL;
    const float *sc = c->use_scale ? gate : NULL;
    colibri_qrows qr = {xq, xa};
    if (c->int8_act) /* the rows the kernel reads: x[rows[i]] (linear) or x[i] (linear_acc) */
        ref->quantize_rows(x, c->acc ? NULL : rl, n, in, xq, xa);

    for (size_t i = 0; i < yrows * out; i++)
        y0[i] = y1[i] = c->acc ? rnd_unit() : 12345.0f;
    if (c->acc) {
        ref->linear_acc(x, n, &w, b, rl, sc, c->int8_act ? &qr : NULL, y0);
        opt->linear_acc(x, n, &w, b, rl, sc, c->int8_act ? &qr : NULL, y1);
    } else {
        ref->linear(x, rl, n, &w, b, c->int8_act ? &qr : NULL, y0);
        opt->linear(x, rl, n, &w, b, c->int8_act ? &qr : NULL, y1);
    }

    char what[200];
    describe(c, what, sizeof what);
    const int exact = c->dtype == COLIBRI_DTYPE_I8 && c->int8_act;
    /* Tolerance per output element: the magnitude each output sums. */
    double *mag = gmalloc(yrows * out * sizeof *mag);
    double *sabs = gmalloc(yrows * out * sizeof *sabs);
    for (size_t i = 0; i < n; i++) {
        const size_t xr = c->acc ? i : (rl ? rl[i] : i), yr = c->acc ? (rl ? rl[i] : i) : i;
        const double s = c->acc ? fabs(sc ? (double)sc[i] : 1.0) : 1.0;
        for (size_t o = 0; o < out; o++) {
            double m = b ? fabs((double)b[o]) : 0.0;
            for (size_t k = 0; k < in; k++)
                m += fabs((double)wf[o * in + k] * (double)x[xr * in + k]);
            for (uint32_t e = row_ptr[o]; e < row_ptr[o + 1]; e++)
                m += fabs((double)colibri_f16_to_f32(val[e]) * (double)x[xr * in + col[e]]);
            mag[yr * out + o] += s * m;
            sabs[yr * out + o] += s;
        }
    }
    for (size_t i = 0; i < yrows * out; i++) {
        const double tol = 2.0 * (double)(in + 4) * 0x1p-23 * (mag[i] + fabs((double)y0[i])) + 1e-30;
        check(what, i, y0[i], y1[i], tol, exact);
    }
    gfree(mag);
    gfree(sabs);
    gfree(x);
    gfree(wf);
    gfree(wh);
    gfree(wq);
    gfree(scale_w);
    gfree(row_ptr);
    gfree(col);
    gfree(val);
    gfree(bias);
    gfree(gate);
    gfree(xq);
    gfree(xa);
    gfree(y0);
    gfree(y1);
}

/* ---- The quantiser and the element-wise kernels ---- */

static float special_value(void)
{
    switch (rnd_below(8)) {
    case 0:
        return NAN;
    case 1:
        return INFINITY;
    case 2:
        return -INFINITY;
    case 3:
        return 0.0f;
    case 4:
        return -0.0f;
    case 5:
        return rnd_unit() * 0x1p-110f; /* the 2^100 pre-scaling path */
    case 6:
        return rnd_unit() * 1e30f;
    default:
        return 0x1p-149f; /* the smallest subnormal */
    }
}

static void fill_values(float *x, size_t count, int mode)
{
    /* mode 0: ordinary, 1: with specials sprinkled, 2: all tiny, 3: all zero,
     * 4: ties at .5 after scaling (quarters, and a maximum of 63.5 makes 127/m = 2),
     * 5: log-uniform magnitudes 2^-30 .. 2^8 of either sign (every branch of exp, tanh, erf),
     * 6: near the branch points of tanh (0.55, 9.1) and erf (1, 2.5, 4; also times √2 for GELU). */
    for (size_t i = 0; i < count; i++) {
        switch (mode) {
        case 1:
            x[i] = rnd_below(8) == 0 ? special_value() : rnd_unit() * 8.0f;
            break;
        case 2:
            x[i] = rnd_unit() * 0x1p-120f;
            break;
        case 3:
            x[i] = rnd_below(2) ? 0.0f : -0.0f;
            break;
        case 4:
            x[i] = (float)((int)rnd_below(255) - 127) * 0.25f;
            break;
        case 5:
            x[i] = ldexpf(1.0f + 0.5f * rnd_unit(), (int)rnd_below(39) - 30) * (rnd_below(2) ? 1.0f : -1.0f);
            break;
        case 6: {
            static const float at[6] = {0.55f, 9.1f, 1.0f, 2.5f, 4.0f, 1.0f};
            const float c = at[rnd_below(6)] * (rnd_below(2) ? 1.4142135f : 1.0f);
            x[i] = c * (1.0f + 0.1f * rnd_unit()) * (rnd_below(2) ? 1.0f : -1.0f);
            break;
        }
        default:
            x[i] = rnd_unit() * 8.0f;
            break;
        }
    }
    if (mode == 4 && count)
        x[rnd_below(count)] = 63.5f; /* m = 63.5 → 127/m = 2: every half is a tie */
}

static void run_quantize(const colibri_kernels *ref, const colibri_kernels *opt)
{
    for (int rep = 0; rep < 400; rep++) {
        const size_t in = rnd_size(300), n = 1 + rnd_below(9), xrows = n + 2;
        const int mode = (int)rnd_below(5), use_rows = (int)rnd_below(2);
        float *x = gmalloc(xrows * in * sizeof *x);
        int8_t *q0 = gmalloc(n * in), *q1 = gmalloc(n * in);
        float a0[16], a1[16];
        uint16_t rows[16];
        if (!x || !q0 || !q1)
            exit(2);
        fill_values(x, xrows * in, mode);
        if (mode == 1 && rnd_below(2)) /* some rows entirely finite */
            for (size_t i = 0; i < in; i++)
                x[i] = rnd_unit();
        for (size_t i = 0; i < n; i++)
            rows[i] = (uint16_t)rnd_below(xrows);
        ref->quantize_rows(x, use_rows ? rows : NULL, n, in, q0, a0);
        opt->quantize_rows(x, use_rows ? rows : NULL, n, in, q1, a1);
        char what[96];
        snprintf(what, sizeof what, "quantize_rows in %zu n %zu mode %d rows %d", in, n, mode, use_rows);
        for (size_t i = 0; i < n * in; i++)
            check(what, i, (float)q0[i], (float)q1[i], 0.0, 1);
        for (size_t i = 0; i < n; i++)
            check(what, i, a0[i], a1[i], 0.0, 1);
        gfree(x);
        gfree(q0);
        gfree(q1);
    }
}

static void run_elementwise(const colibri_kernels *ref, const colibri_kernels *opt)
{
    for (int rep = 0; rep < 300; rep++) {
        const size_t count = rnd_size(200);
        float *x0 = gmalloc(count * sizeof *x0), *x1 = gmalloc(count * sizeof *x1), *y = gmalloc(count * sizeof *y);
        if (!x0 || !x1 || !y)
            exit(2);
        const int mode = (int)rnd_below(4);
        fill_values(x0, count, mode >= 2 ? mode + 3 : mode);
        if (mode == 2 && count) /* the branch boundaries of exp, tanh and erf exactly */
            for (size_t j = 0; j < 8; j++) {
                static const float edges[8] = {0.55f, 1.0f, 2.5f, 4.0f, 9.1f, COLIBRI_EXPF_EDGE_HI, COLIBRI_EXPF_EDGE_LO, 1.4142135f};
                x0[rnd_below(count)] = edges[j] * (rnd_below(2) ? 1.0f : -1.0f);
            }
        else
            for (size_t i = 0; i < count; i++)
                x0[i] *= 2.0f;
        fill_values(y, count, (int)rnd_below(2));
        char what[64];
        for (uint32_t kind = COLIBRI_ACT_RELU; kind <= COLIBRI_ACT_SIGMOID; kind++) {
            memcpy(x1, x0, count * sizeof *x1);
            float *r = gmalloc(count * sizeof *r);
            if (!r)
                exit(2);
            memcpy(r, x0, count * sizeof *r);
            ref->activation(r, count, kind);
            opt->activation(x1, count, kind);
            snprintf(what, sizeof what, "activation %u n %zu", (unsigned)kind, count);
            for (size_t i = 0; i < count; i++)
                check(what, i, r[i], x1[i], 0.0, 1);
            gfree(r);
        }
        for (int op = 0; op < 2; op++) {
            float *r = gmalloc(count * sizeof *r);
            if (!r)
                exit(2);
            memcpy(r, x0, count * sizeof *r);
            memcpy(x1, x0, count * sizeof *x1);
            (op ? ref->add : ref->mul)(r, y, count);
            (op ? opt->add : opt->mul)(x1, y, count);
            snprintf(what, sizeof what, "%s n %zu", op ? "add" : "mul", count);
            for (size_t i = 0; i < count; i++)
                check(what, i, r[i], x1[i], 0.0, 1);
            gfree(r);
        }
        gfree(x0);
        gfree(x1);
        gfree(y);
    }
}

/* Norms: a sum of n squares or values in another order: 4 (n + 4) eps relative. */
static void run_norms(const colibri_kernels *ref, const colibri_kernels *opt)
{
    for (int rep = 0; rep < 60; rep++) {
        const size_t n = rnd_size(300), rows = 1 + rnd_below(4);
        float *x0 = gmalloc(rows * n * sizeof *x0), *x1 = gmalloc(rows * n * sizeof *x1);
        float *g = gmalloc(n * sizeof *g), *bt = gmalloc(n * sizeof *bt);
        if (!x0 || !x1 || !g || !bt)
            exit(2);
        const int mode = rnd_below(4) == 0;
        fill_values(x0, rows * n, mode);
        for (size_t i = 0; i < n; i++) {
            g[i] = rnd_unit();
            bt[i] = rnd_unit();
        }
        const int affine = (int)rnd_below(2);
        char what[64];
        for (int which = 0; which < 2; which++) {
            float *r = gmalloc(rows * n * sizeof *r);
            if (!r)
                exit(2);
            memcpy(r, x0, rows * n * sizeof *r);
            memcpy(x1, x0, rows * n * sizeof *x1);
            if (which) {
                ref->rmsnorm(r, rows, n, affine ? g : NULL, 1e-5f);
                opt->rmsnorm(x1, rows, n, affine ? g : NULL, 1e-5f);
            } else {
                ref->layernorm(r, rows, n, affine ? g : NULL, affine ? bt : NULL, 1e-5f);
                opt->layernorm(x1, rows, n, affine ? g : NULL, affine ? bt : NULL, 1e-5f);
            }
            snprintf(what, sizeof what, "%s n %zu", which ? "rmsnorm" : "layernorm", n);
            for (size_t i = 0; i < rows * n; i++)
                check(what, i, r[i], x1[i], 4.0 * (double)(n + 4) * 0x1p-23 * (fabs((double)r[i]) + 1.0), 0);
            gfree(r);
        }
        gfree(x0);
        gfree(x1);
        gfree(g);
        gfree(bt);
    }
}

int main(int argc, char **argv)
{
    colibri_kernels ref, opt;
    colibri_kernels_reference(&ref);
    colibri_kernels_optimised(&opt);
    printf("kernels: %s\n", opt.name);
    if (argc > 1 && strcmp(argv[1], opt.name) != 0) {
        fprintf(stderr, "FAIL: expected kernels '%s', got '%s'\n", argv[1], opt.name);
        return 1;
    }

    static const uint8_t dtypes[3] = {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_I8};
    unsigned long cases = 0;
    for (int d = 0; d < 3; d++)
        for (int int8_act = 0; int8_act <= (dtypes[d] == COLIBRI_DTYPE_I8); int8_act++)
            for (size_t n = 1; n <= 9; n++)
                for (int acc = 0; acc < 2; acc++)
                    for (int use_rows = 0; use_rows < 2; use_rows++)
                        for (int rep = 0; rep < 6; rep++) {
                            lcase c = {0};
                            c.dtype = dtypes[d];
                            c.int8_act = int8_act;
                            c.acc = acc;
                            c.use_rows = use_rows;
                            c.n = n;
                            c.use_bias = (int)rnd_below(2);
                            c.use_scale = (int)rnd_below(2);
                            c.nonfinite = rep == 5;
                            c.comp = c.dtype == COLIBRI_DTYPE_I8 && rnd_below(2);
                            /* Small odd sizes for every tail, a few large. */
                            c.in = rep < 2 ? 1 + rnd_below(40) : rnd_size(300);
                            c.out = rep < 3 ? 1 + rnd_below(20) : rnd_size(96);
                            run_linear(&ref, &opt, &c);
                            cases++;
                        }
    /* Edge-sized layers (256 -> 1024 -> 256) once per dtype and path. */
    for (int d = 0; d < 3; d++)
        for (int int8_act = 0; int8_act <= (dtypes[d] == COLIBRI_DTYPE_I8); int8_act++)
            for (int acc = 0; acc < 2; acc++) {
                lcase c = {0};
                c.dtype = dtypes[d];
                c.int8_act = int8_act;
                c.acc = acc;
                c.use_rows = 1;
                c.use_bias = 1;
                c.use_scale = acc;
                c.comp = c.dtype == COLIBRI_DTYPE_I8;
                c.n = acc ? 5 : 2;
                c.in = acc ? 1024 : 256;
                c.out = acc ? 256 : 1024;
                run_linear(&ref, &opt, &c);
                cases++;
            }
    run_quantize(&ref, &opt);
    run_elementwise(&ref, &opt);
    run_norms(&ref, &opt);
    printf("%lu linear cases, %lu values checked, %lu failures\n", cases, checks, failures);
    return failures ? 1 : 0;
}
