/*
 * colibri_blocks_test
 *
 * The block form of int8 activations (INT8_BLOCKS: one scale per 32
 * columns), kernel by kernel, on I8 and I4 matrices built directly
 * (colibri_q4_cases.h): random shapes with tails (odd columns, a partial
 * last block, rows not a multiple of 8), every I4 group size (2^3..2^8), I8
 * scales in f16 or f32, a compensation term E or none, a companion bias or
 * none, a layer bias or none, 1..9 tokens with and without the rows list,
 * linear and linear_acc with and without gates, one token (decode) in
 * every fifth case, activations whose blocks
 * differ in scale by up to 2^40 (some all zero, some subnormal, some holding
 * NaN or ±inf), wide layers (512 -> 1408 and 1408 -> 512, the expert
 * shape of the benchmark's model) and one decode layer of 2149 columns.
 *
 * 1. The reference quantiser against the definition: per block, a = m / 127
 *    for m = max |x| (0 for a zero block, NaN for a non-finite one), every
 *    |q| <= 127 and |q · a - x| <= a / 2 (ulps aside).
 * 2. The reference linear kernels against a double-precision evaluation of
 *    W (Q dequantised) times the dequantised activations (xq · a_b), plus
 *    E · x and the biases: |ref - exact| <= (terms + 8) · (2^-23 · (M + |y0| +
 *    |y|) + 2^15 · 2^-149) with M the sum of the terms' magnitudes (the
 *    second term: a scale product that underflows into f32's subnormals).
 * 3. Every x86-64 configuration the CPU has (AVX2, AVX-VNNI, AVX-512 VNNI,
 *    forced through colibri_kernels_x86_caps), on AArch64 the ARMv8.0 NEON
 *    kernels and, where the CPU has SDOT, the dotprod ones
 *    (colibri_kernels_neon_caps), or the build's backend,
 *    against the reference: quantiser and linear kernels bit for bit (NaN
 *    for NaN).
 *
 * Exit 0 when every check passes.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri_format.h"
#include "colibri_kernels.h"
#include "colibri_q4_cases.h"
#include "colibri_changed_tables.h"
#include "kernels/colibri_backend.h"

static void *live[64];
static size_t nlive;

static void *case_alloc(size_t bytes)
{
    if (nlive == sizeof live / sizeof live[0]) {
        fprintf(stderr, "too many buffers\n");
        exit(2);
    }
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return live[nlive++] = p;
}

static void case_free(void)
{
    while (nlive)
        free(live[--nlive]);
}

static unsigned long checks, failures;

static void fail(const char *what, const char *ctx, size_t idx, double want, double got)
{
    if (failures < 20)
        fprintf(stderr, "FAIL %s (%s) [%zu]: want %.9g got %.9g\n", what, ctx, idx, want, got);
    failures++;
}

/* Bit for bit, NaN matching any NaN. */
static int same_float(float a, float b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b);
    return memcmp(&a, &b, sizeof a) == 0;
}

typedef struct tcase {
    q4_shape sh;
    int i8, f32_scales, acc, use_rows, use_b, use_gate, nonfinite;
    size_t n;
} tcase;

typedef struct tdata {
    colibri_matrix w;
    float *x, *b, *gate, *xa, *y_init;
    int8_t *xq;
    uint16_t rows[48];
    size_t xrows, yrows;
} tdata;

/* An I8 matrix of the shape: E from q4_build (its row pointers, columns and
 * values are the I8 layout's), int8 weights over the full range, scales f16
 * or f32, a companion bias after the scales or none. */
static void build_i8(q4_rng *r, const tcase *c, colibri_matrix *w)
{
    q4_shape sh = c->sh;
    sh.with_bias = 0;
    q4_build(r, case_alloc, &sh, w);
    const size_t rows = sh.rows, cols = sh.cols, params = c->sh.with_bias ? 2 * rows : rows;
    int8_t *q = case_alloc(rows * cols);
    for (size_t i = 0; i < rows * cols; i++)
        q[i] = (int8_t)(q4_next(r) & 0xFFu);
    w->dtype = COLIBRI_DTYPE_I8;
    w->data = q;
    w->q4_group_log2 = 0;
    w->q4_groups = 0;
    w->q4_bias = NULL;
    w->q8_bias = (uint8_t)c->sh.with_bias;
    if (c->f32_scales) {
        float *s = case_alloc(params * sizeof *s);
        for (size_t i = 0; i < params; i++)
            s[i] = (float)q4_f16_value(q4_f16_normal(r, i >= rows && q4_below(r, 2), 5, 14));
        w->scale = s;
        w->q8_f16 = 0;
    } else {
        uint16_t *s = case_alloc(params * sizeof *s);
        for (size_t i = 0; i < params; i++)
            s[i] = q4_f16_normal(r, i >= rows && q4_below(r, 2), 5, 14);
        w->scale = s;
        w->q8_f16 = 1;
    }
}

static void make_data(q4_rng *r, const tcase *c, tdata *d)
{
    const size_t in = c->sh.cols, out = c->sh.rows, nb = colibri_act_blocks(in);
    if (c->i8)
        build_i8(r, c, &d->w);
    else
        q4_build(r, case_alloc, &c->sh, &d->w);
    d->xrows = d->yrows = c->n + 3;
    d->x = case_alloc(d->xrows * in * sizeof *d->x);
    for (size_t row = 0; row < d->xrows; row++)
        for (size_t blk = 0; blk < nb; blk++) {
            /* each block its own magnitude: blocks differing by up to 2^40,
             * now and then zero or subnormal */
            const size_t pick = q4_below(r, 24);
            const float mag = pick == 0 ? 0.0f : pick == 1 ? 0x1p-140f : ldexpf(1.0f, (int)q4_below(r, 41) - 20);
            for (size_t k = blk * 32; k < in && k < blk * 32 + 32; k++)
                d->x[row * in + k] = q4_unit(r) * mag;
        }
    if (c->nonfinite) {
        const float specials[3] = {NAN, INFINITY, -INFINITY};
        for (int j = 0; j < 3; j++)
            d->x[q4_below(r, d->xrows * in)] = specials[q4_below(r, 3)];
    }
    d->b = case_alloc(out * sizeof *d->b);
    for (size_t o = 0; o < out; o++)
        d->b[o] = q4_unit(r);
    d->gate = case_alloc(c->n * sizeof *d->gate);
    for (size_t i = 0; i < c->n; i++) {
        d->gate[i] = q4_unit(r) * 2.0f;
        d->rows[i] = (uint16_t)q4_below(r, d->xrows);
    }
    d->xq = case_alloc(c->n * in);
    d->xa = case_alloc(c->n * nb * sizeof *d->xa);
    d->y_init = case_alloc(d->yrows * out * sizeof *d->y_init);
    for (size_t i = 0; i < d->yrows * out; i++)
        d->y_init[i] = c->acc ? q4_unit(r) : 12345.0f;
}

static const uint16_t *xrow_list(const tcase *c, const tdata *d)
{
    return c->acc ? NULL : (c->use_rows ? d->rows : NULL);
}

static void run(const colibri_kernels *k, const tcase *c, const tdata *d, float *y)
{
    const uint16_t *rl = c->use_rows ? d->rows : NULL;
    const colibri_qrows qr = {d->xq, d->xa};
    memcpy(y, d->y_init, d->yrows * c->sh.rows * sizeof *y);
    if (c->acc)
        k->linear_acc_blocks(d->x, c->n, &d->w, c->use_b ? d->b : NULL, rl, c->use_gate ? d->gate : NULL, &qr, y);
    else
        k->linear_blocks(d->x, rl, c->n, &d->w, c->use_b ? d->b : NULL, &qr, y);
}

static void describe(const tcase *c, char *buf, size_t len)
{
    snprintf(buf, len, "%s %s out %zu in %zu group 2^%u%s E %d cbias %d n %zu rows %d b %d gate %d nonfinite %d",
             c->acc ? "linear_acc" : "linear", c->i8 ? "I8" : "I4", c->sh.rows, c->sh.cols, c->sh.group_log2,
             c->i8 ? (c->f32_scales ? " f32-scales" : " f16-scales") : "", c->sh.with_e, c->sh.with_bias, c->n,
             c->use_rows, c->use_b, c->use_gate, c->nonfinite);
}

/* Parameter i of an I8 matrix (scale below rows, companion bias after). */
static double i8_param(const colibri_matrix *w, size_t i)
{
    return w->q8_f16 ? q4_f16_value(((const uint16_t *)w->scale)[i]) : (double)((const float *)w->scale)[i];
}

/* Output o of one token in double: Σ_c W_oc · xq_c · a_(c/32) + Σ_E e · x + bias. */
static double expect_row(const colibri_matrix *w, size_t o, const float *x, const int8_t *xq, const float *a,
                         double *mag, size_t *terms)
{
    const size_t cols = w->cols;
    double v = 0.0, m = 0.0;
    for (size_t c = 0; c < cols; c++) {
        double wq;
        if (w->dtype == COLIBRI_DTYPE_I8) {
            wq = (double)((const int8_t *)w->data)[o * cols + c] * i8_param(w, o);
        } else {
            const size_t group = (size_t)1 << w->q4_group_log2;
            const uint8_t *row = (const uint8_t *)w->data + o * ((cols + 1) / 2);
            wq = (double)q4_nibble_def(row, c) * q4_f16_value(((const uint16_t *)w->scale)[o * w->q4_groups + c / group]);
        }
        const double t = wq * (double)xq[c] * (double)a[c / 32];
        v += t;
        m += fabs(t);
    }
    uint32_t k, end;
    q4_terms_def(w, o, &k, &end);
    const size_t nnz = end - k;
    for (; k < end; k++) {
        const double t = q4_f16_value(w->val[k]) * (double)x[w->col[k]];
        v += t;
        m += fabs(t);
    }
    double bias = 0.0;
    if (w->dtype == COLIBRI_DTYPE_I8 && w->q8_bias)
        bias = i8_param(w, w->rows + o);
    else if (w->dtype == COLIBRI_DTYPE_I4 && w->q4_bias)
        bias = q4_f16_value(w->q4_bias[o]);
    v += bias;
    m += fabs(bias);
    *mag = m;
    *terms = 2 * colibri_act_blocks(cols) + cols / 8 + nnz + 4;
    return v;
}

/* Part 1: the block quantiser's output for token rows of x. */
static void check_quantiser(const tcase *c, const tdata *d, const char *ctx)
{
    const size_t in = c->sh.cols, nb = colibri_act_blocks(in);
    const uint16_t *rl = xrow_list(c, d);
    for (size_t i = 0; i < c->n; i++) {
        const float *xi = d->x + (rl ? rl[i] : i) * in;
        for (size_t blk = 0; blk < nb; blk++) {
            double m = 0.0;
            int bad = 0;
            for (size_t k = blk * 32; k < in && k < blk * 32 + 32; k++) {
                bad |= !isfinite(xi[k]);
                m = fabs((double)xi[k]) > m ? fabs((double)xi[k]) : m;
            }
            const float a = d->xa[i * nb + blk];
            checks++;
            if (bad ? !isnan(a) : a != (float)m / 127.0f)
                fail("block scale", ctx, i * nb + blk, bad ? NAN : (double)((float)m / 127.0f), a);
            for (size_t k = blk * 32; k < in && k < blk * 32 + 32; k++) {
                const int q = d->xq[i * in + k];
                checks++;
                /* a is m / 127 rounded to f32 (maybe subnormal): its own error times |q|; and
                 * x · (127 / m) is rounded twice in f32 before roundf (the quotient, the
                 * product): up to 2^-23 · |x| further, so a value a hair below a half step
                 * can round up */
                const double a_err = 127.0 * fabs((double)a - m / 127.0);
                const double err = bad ? (double)q : fabs((double)q * (double)a - (double)xi[k]);
                if (q < -127 || q > 127 ||
                    err > (double)a * (0.5 + 0x1p-20) + a_err + (bad ? 0.0 : 0x1p-22 * fabs((double)xi[k]) + 1e-300))
                    fail("block quantised value", ctx, i * in + k, xi[k], (double)q * (double)a);
            }
        }
    }
}

int main(void)
{
    colibri_kernels ref;
    colibri_kernels_reference(&ref);

    /* The configurations to compare with the reference. */
    colibri_kernels opts[6];
    const char *labels[6];
    size_t nopt = 0;
#if defined(COLIBRI_BACKEND_X86)
    static const struct {
        int level, avx_vnni;
        const char *label;
    } configs[] = {{1, 0, "x86 AVX2"}, {1, 1, "x86 AVX-VNNI"}, {3, 1, "x86 AVX-512 VNNI"}};
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        colibri_kernels k;
        colibri_kernels_reference(&k);
        colibri_kernels_x86_caps(&k, configs[i].level, configs[i].avx_vnni);
        if (k.linear_blocks == ref.linear_blocks)
            continue; /* the CPU lacks AVX2: reference kernels only */
        int dup = 0;
        for (size_t j = 0; j < nopt; j++)
            dup |= opts[j].linear_blocks == k.linear_blocks;
        if (dup)
            continue; /* the CPU lacks this level's instructions: the one below again */
        opts[nopt] = k;
        labels[nopt++] = configs[i].label;
    }
#elif defined(COLIBRI_BACKEND_NEON)
    /* SDOT where the CPU has it, and the ARMv8.0 kernels on every CPU. */
    static const struct {
        int allow_dotprod;
        const char *label;
    } configs[] = {{0, "aarch64 neon (ARMv8.0)"}, {1, "aarch64 neon+dotprod (SDOT)"}};
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        colibri_kernels k;
        colibri_kernels_reference(&k);
        colibri_kernels_neon_caps(&k, configs[i].allow_dotprod);
        if (nopt && opts[nopt - 1].linear_blocks == k.linear_blocks)
            continue; /* the CPU lacks SDOT: the ARMv8.0 kernels again */
        opts[nopt] = k;
        labels[nopt++] = configs[i].label;
    }
#endif
    if (nopt == 0) {
        colibri_kernels_optimised(&opts[0]);
        labels[nopt++] = opts[0].name;
    }
    for (size_t j = 0; j < nopt; j++)
        printf("block kernels: %s%s\n", labels[j],
               opts[j].linear_blocks == ref.linear_blocks ? " (the reference's: the backend has none)" : "");

    q4_rng r = {0xB10C5u};
    unsigned long cases = 0;
    double worst_ref = 0.0;
    for (int i8 = 0; i8 < 2; i8++)
        for (unsigned gl = i8 ? 5 : 3; gl <= (i8 ? 5u : 8u); gl++)
            for (int rep = 0; rep < (i8 ? 120 : 40); rep++) {
                tcase c;
                memset(&c, 0, sizeof c);
                c.i8 = i8;
                c.f32_scales = i8 && (rep / 8) % 2;
                c.sh.group_log2 = gl;
                c.sh.with_e = rep % 2;
                c.sh.with_bias = (rep / 2) % 2;
                c.acc = (rep / 4) % 2;
                c.use_rows = (int)q4_below(&r, 2);
                c.use_b = (int)q4_below(&r, 2);
                c.use_gate = (int)q4_below(&r, 2);
                c.nonfinite = rep % 8 == 7;
                /* 1..9 tokens; every fifth case up to 40 (prefill: the AVX-512 VNNI kernel's
                 * chunks of 16 tokens, full and partial). */
                c.n = 1 + q4_below(&r, rep % 5 == 4 ? 40 : 9);
                if (rep % 5 == 1)
                    c.n = 1; /* decode: the one-token kernels (64 columns a step, the rest by blocks) */
                if (rep == 37) /* decode past the one-token kernel's strip of 2048 columns */
                    c.sh.cols = 2048 + 64 + 37, c.sh.rows = 20, c.n = 1;
                else if (rep == 38)
                    c.sh.cols = 512, c.sh.rows = 1408, c.n = 1 + q4_below(&r, 8);
                else if (rep == 39)
                    c.sh.cols = 1408, c.sh.rows = 512, c.n = 17 + q4_below(&r, 24);
                else
                    c.sh.cols = 1 + q4_below(&r, rep < 20 ? 70 : 700), c.sh.rows = 1 + q4_below(&r, 40);
                cases++;
                tdata d;
                make_data(&r, &c, &d);
                char what[200];
                describe(&c, what, sizeof what);
                const size_t in = c.sh.cols, nb = colibri_act_blocks(in), count = d.yrows * c.sh.rows;
                ref.quantize_blocks(d.x, xrow_list(&c, &d), c.n, in, d.xq, d.xa);
                check_quantiser(&c, &d, what);

                /* 2. The reference against the definition. */
                float *y_ref = case_alloc(count * sizeof *y_ref), *y_opt = case_alloc(count * sizeof *y_opt);
                run(&ref, &c, &d, y_ref);
                for (size_t i = 0; i < c.n; i++) {
                    const size_t xr = c.acc ? i : (c.use_rows ? d.rows[i] : i);
                    const size_t yr = c.acc ? (c.use_rows ? d.rows[i] : i) : i;
                    const double g = c.acc && c.use_gate ? (double)d.gate[i] : 1.0;
                    if (c.acc && c.use_rows)
                        continue; /* rows may repeat: several tokens add into one row */
                    for (size_t o = 0; o < c.sh.rows; o++) {
                        double m;
                        size_t t;
                        double v = expect_row(&d.w, o, d.x + xr * in, d.xq + i * in, d.xa + i * nb, &m, &t);
                        if (c.use_b)
                            v += (double)d.b[o], m += fabs((double)d.b[o]);
                        const double y0 = c.acc ? (double)d.y_init[yr * c.sh.rows + o] : 0.0;
                        const double want = y0 + g * v;
                        const float got = y_ref[yr * c.sh.rows + o];
                        checks++;
                        if (isnan(want) || isinf(want) || !isfinite(got)) {
                            if (!(isnan(want) ? isnan(got) : (isinf(want) ? got == (float)want : 0)))
                                fail("reference vs definition", what, yr * c.sh.rows + o, want, got);
                            continue;
                        }
                        /* relative, plus f32's subnormal spacing where a product of a scale and a
                         * block scale underflows (its error then multiplied by up to 32·8·127) */
                        const double tol = ((double)t + 8.0) * (0x1p-23 * (fabs(g) * m + fabs(y0) + fabs(want)) +
                                                                0x1p15 * 0x1p-149);
                        const double err = fabs((double)got - want);
                        if (err / tol > worst_ref)
                            worst_ref = err / tol;
                        if (err > tol)
                            fail("reference vs definition", what, yr * c.sh.rows + o, want, got);
                    }
                }

                /* 3. Every configuration against the reference, bit for bit. */
                int8_t *xq_opt = case_alloc(c.n * in);
                float *xa_opt = case_alloc(c.n * nb * sizeof *xa_opt);
                for (size_t j = 0; j < nopt; j++) {
                    char ctx[260];
                    snprintf(ctx, sizeof ctx, "%s: %s", labels[j], what);
                    opts[j].quantize_blocks(d.x, xrow_list(&c, &d), c.n, in, xq_opt, xa_opt);
                    checks++;
                    if (memcmp(xq_opt, d.xq, c.n * in) != 0)
                        fail("quantize_blocks values", ctx, 0, 0, 0);
                    for (size_t i = 0; i < c.n * nb; i++) {
                        checks++;
                        if (!same_float(xa_opt[i], d.xa[i]))
                            fail("quantize_blocks scale", ctx, i, d.xa[i], xa_opt[i]);
                    }
                    run(&opts[j], &c, &d, y_opt);
                    for (size_t i = 0; i < count; i++) {
                        checks++;
                        if (!same_float(y_opt[i], y_ref[i]))
                            fail("optimised vs reference", ctx, i, y_ref[i], y_opt[i]);
                    }
                }
                case_free();
            }
    /* 4. E's tables changed after validation (colibri_changed_tables.h): I8 and I4, 1 to 40 tokens
     * (the AVX-512 VNNI panel from 8 on), every configuration and the reference give finite
     * numbers, wrong ones allowed, and read nothing outside the tables or x (NaN after x's last
     * row, which linear reads for half the cases). */
    unsigned long table_cases = 0, table_bad = 0;
    uint64_t table_state = 0x7AB1E5u;
    for (int rep = 0; rep < 240; rep++) {
        tcase c;
        memset(&c, 0, sizeof c);
        c.i8 = rep % 2;
        c.f32_scales = c.i8 && (rep / 2) % 2;
        c.sh.group_log2 = c.i8 ? 5u : 5u + (unsigned)q4_below(&r, 4);
        c.sh.with_e = 1;
        c.sh.with_bias = (rep / 4) % 2;
        c.acc = (rep / 8) % 2;
        c.use_rows = !c.acc;
        c.n = 1 + q4_below(&r, rep % 3 == 2 ? 40 : 9);
        c.sh.cols = 1 + q4_below(&r, 700);
        c.sh.rows = 1 + q4_below(&r, 40);
        tdata d;
        make_data(&r, &c, &d);
        if (d.w.q8_nnz == 0) {
            case_free();
            continue;
        }
        const size_t in = c.sh.cols, count = d.yrows * c.sh.rows;
        float *x = colibri_alloc_exact((d.xrows * in + COLIBRI_TABLE_PAD) * sizeof *x);
        for (size_t i = 0; i < d.xrows * in + COLIBRI_TABLE_PAD; i++)
            x[i] = i < d.xrows * in ? d.x[i] : NAN;
        d.x = x;
        for (size_t i = 0; i < c.n && q4_below(&r, 2); i++)
            d.rows[i] = (uint16_t)(d.xrows - 1);
        colibri_changed changed = colibri_change_tables(&d.w, &table_state);
        ref.quantize_blocks(d.x, xrow_list(&c, &d), c.n, in, d.xq, d.xa);
        float *y = case_alloc(count * sizeof *y);
        for (size_t j = 0; j <= nopt; j++) {
            run(j < nopt ? &opts[j] : &ref, &c, &d, y);
            for (size_t i = 0; i < count; i++) {
                checks++;
                if (isnan(y[i])) {
                    table_bad++;
                    char what[200], ctx[260];
                    describe(&c, what, sizeof what);
                    snprintf(ctx, sizeof ctx, "%s: %s", j < nopt ? labels[j] : "reference", what);
                    fail("changed tables: a read outside E's tables or x", ctx, i, 0.0, y[i]);
                }
            }
        }
        table_cases++;
        colibri_changed_free(&changed);
        free(x);
        case_free();
    }
    printf("changed tables: %lu cases, %lu reads outside\n", table_cases, table_bad);
    printf("blocks: %lu cases, %lu checks, %lu failures; reference within %.3f of its tolerance\n", cases, checks,
           failures, worst_ref);
    return failures ? 1 : 0;
}
