/*
 * colibri_q4_test [EXPECTED_NAME]
 *
 * I4 weights (format v5), kernel by kernel, on matrices built directly
 * (colibri_q4_cases.h): random nibbles, odd column counts and a partial last
 * group, every group size (group_log2 3..8), a compensation term E or none
 * (1-, 2- and 4-byte row pointers), a companion bias or none, a layer bias
 * or none, 1..9 tokens with and without the rows list, linear and
 * linear_acc with and without gates, f32 and int8 activations, inputs with
 * NaN and ±inf, and wide layers (1024 and 2048 columns) for the vector paths.
 *
 * 1. The reference kernels (colibri_kernels_reference: colibri_matvec_q4 and
 *    colibri_matvec_q4q8 through the linear dispatch) against an independent
 *    double-precision evaluation of the format's definition (nibbles and
 *    f16 decoded by their own arithmetic): |ref - exact| <= (terms + 8) ·
 *    2^-23 · (|s| M + |y0| + |y|), where M is the sum of the magnitudes of
 *    the output's terms (Q·s·x, e·x, the biases) and terms their count (the
 *    f32 roundings of group sums, the group total, E, the biases and the
 *    emit); non-finite exactly where the definition is (NaN for NaN, the
 *    same infinity).
 * 2. Every level of the build's optimised backend (for x86-64 every level
 *    the CPU has) against the reference: int8 activations bit for bit;
 *    f32 activations within the tolerance the q8 f32-activation kernels
 *    have (tests/c/colibri_kernel_test.c): 2 (in + 4) 2^-23 (|s| M + |y|),
 *    with |w| = |q|·s_g in M; NaN and ±inf where the reference has them.
 * 3. colibri_q4_nibble for every byte and both halves against the format.
 *
 * Prints a summary line per part; exit 0 when every check passes.
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

/* Allocations of one case, freed together. */
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

static int same_class(double want, float got)
{
    if (isnan(want) || isnan(got))
        return isnan(want) && isnan(got);
    if (isinf(want) || isinf(got))
        return isinf(want) && isinf(got) && (want > 0) == (got > 0);
    return 1;
}

static void fail(const char *what, size_t idx, double want, float got, double tol)
{
    if (failures < 20)
        fprintf(stderr, "FAIL %s [%zu]: want %.9g got %.9g (tolerance %.3g)\n", what, idx, want, (double)got, tol);
    failures++;
}

typedef struct tcase {
    q4_shape sh;
    size_t n;
    int int8_act, acc, use_rows, use_b, use_gate, nonfinite;
} tcase;

typedef struct tdata {
    colibri_matrix w;
    float *x, *b, *gate, *xa, *y_init;
    int8_t *xq;
    uint16_t rows[16];
    size_t xrows, yrows;
} tdata;

static void make_data(q4_rng *r, const tcase *c, tdata *d)
{
    const size_t in = c->sh.cols, out = c->sh.rows;
    q4_build(r, case_alloc, &c->sh, &d->w);
    d->xrows = d->yrows = c->n + 3;
    d->x = case_alloc(d->xrows * in * sizeof *d->x);
    for (size_t i = 0; i < d->xrows * in; i++)
        d->x[i] = q4_unit(r) * 4.0f;
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
    d->xa = case_alloc(c->n * sizeof *d->xa);
    d->y_init = case_alloc(d->yrows * out * sizeof *d->y_init);
    for (size_t i = 0; i < d->yrows * out; i++)
        d->y_init[i] = c->acc ? q4_unit(r) : 12345.0f;
}

static void run(const colibri_kernels *k, const tcase *c, const tdata *d, float *y)
{
    const size_t in = c->sh.cols, out = c->sh.rows;
    const uint16_t *rl = c->use_rows ? d->rows : NULL;
    const colibri_qrows qr = {d->xq, d->xa};
    memcpy(y, d->y_init, d->yrows * out * sizeof *y);
    (void)in;
    if (c->acc)
        k->linear_acc(d->x, c->n, &d->w, c->use_b ? d->b : NULL, rl, c->use_gate ? d->gate : NULL,
                      c->int8_act ? &qr : NULL, y);
    else
        k->linear(d->x, rl, c->n, &d->w, c->use_b ? d->b : NULL, c->int8_act ? &qr : NULL, y);
}

static void describe(const tcase *c, char *buf, size_t len)
{
    snprintf(buf, len, "%s%s out %zu in %zu group 2^%u E %d cbias %d n %zu rows %d b %d gate %d nonfinite %d",
             c->acc ? "linear_acc" : "linear", c->int8_act ? " int8-act" : "", c->sh.rows, c->sh.cols,
             c->sh.group_log2, c->sh.with_e, c->sh.with_bias, c->n, c->use_rows, c->use_b, c->use_gate,
             c->nonfinite);
}

/* Expected y (double) and per-output magnitudes for the case, from the
 * definition; tokens that write no row keep y_init (mag 0). */
static void expect(const tcase *c, const tdata *d, double *want, double *mag, double *terms)
{
    const size_t in = c->sh.cols, out = c->sh.rows;
    for (size_t i = 0; i < d->yrows * out; i++) {
        want[i] = d->y_init[i];
        mag[i] = 0.0;
        terms[i] = 0.0;
    }
    for (size_t i = 0; i < c->n; i++) {
        const size_t xr = c->acc ? i : (c->use_rows ? d->rows[i] : i);
        const size_t yr = c->acc ? (c->use_rows ? d->rows[i] : i) : i;
        const double g = c->acc && c->use_gate ? (double)d->gate[i] : 1.0;
        for (size_t o = 0; o < out; o++) {
            double m;
            size_t t;
            double v = q4_expect(&d->w, o, d->x + xr * in, c->int8_act ? d->xq + i * in : NULL,
                                 c->int8_act ? d->xa[i] : 0.0f, &m, &t);
            if (c->use_b) {
                v += (double)d->b[o];
                m += fabs((double)d->b[o]);
            }
            double *dst = want + yr * out + o;
            if (c->acc)
                *dst += g * v;
            else
                *dst = v;
            mag[yr * out + o] += fabs(g) * m;
            terms[yr * out + o] += (double)t + 8.0;
        }
    }
}

int main(int argc, char **argv)
{
    colibri_kernels ref;
    colibri_kernels_reference(&ref);

    /* 3. The nibble accessor. */
    for (unsigned byte = 0; byte < 256; byte++)
        for (size_t half = 0; half < 2; half++) {
            const uint8_t row[1] = {(uint8_t)byte};
            checks++;
            if (colibri_q4_nibble(row, half) != q4_nibble_def(row, half))
                fail("colibri_q4_nibble", byte * 2 + half, q4_nibble_def(row, half), (float)colibri_q4_nibble(row, half), 0);
        }

    /* The optimised tables to compare: every x86 level the CPU has, else the build's one. */
    colibri_kernels opts[4];
    size_t nopt = 0;
#if defined(COLIBRI_BACKEND_X86)
    for (int level = 1; level <= 3; level++) {
        colibri_kernels_reference(&opts[nopt]);
        colibri_kernels_x86_level(&opts[nopt], level);
        if (strcmp(opts[nopt].name, "reference") == 0)
            break;
        if (nopt && strcmp(opts[nopt].name, opts[nopt - 1].name) == 0)
            break;
        nopt++;
    }
#endif
    if (nopt == 0)
        colibri_kernels_optimised(&opts[nopt++]);
    printf("kernels: %s\n", opts[nopt - 1].name);
    if (argc > 1 && strcmp(argv[1], opts[nopt - 1].name) != 0) {
        fprintf(stderr, "FAIL: expected kernels '%s', got '%s'\n", argv[1], opts[nopt - 1].name);
        return 1;
    }

    q4_rng r = {0x5DEECE66Du};
    unsigned long cases = 0, ref_checks = 0;
    double worst_ref = 0.0, worst_f32[4] = {0}, worst_i8[4] = {0};
    for (unsigned gl = 3; gl <= 8; gl++)
        for (int int8_act = 0; int8_act < 2; int8_act++)
            for (int rep = 0; rep < 40; rep++) {
                tcase c;
                memset(&c, 0, sizeof c);
                c.sh.group_log2 = gl;
                c.sh.with_e = rep % 2;
                c.sh.with_bias = (rep / 2) % 2;
                c.int8_act = int8_act;
                c.acc = (rep / 4) % 2;
                c.use_rows = (int)q4_below(&r, 2);
                c.use_b = (int)q4_below(&r, 2);
                c.use_gate = (int)q4_below(&r, 2);
                c.nonfinite = rep % 8 == 7;
                c.n = 1 + q4_below(&r, 9);
                const size_t group = (size_t)1 << gl;
                /* Odd and even counts, partial last groups, one group or many; a few wide. */
                if (rep == 38)
                    c.sh.cols = 1024 + q4_below(&r, 2), c.sh.rows = 64 + q4_below(&r, 5), c.n = 1 + q4_below(&r, 5);
                else if (rep == 39)
                    c.sh.cols = 2048, c.sh.rows = 32, c.n = 1;
                else
                    c.sh.cols = 1 + q4_below(&r, rep < 20 ? 2 * group + 3 : 600), c.sh.rows = 1 + q4_below(&r, 40);
                cases++;
                tdata d;
                make_data(&r, &c, &d);
                const size_t count = d.yrows * c.sh.rows;
                if (c.int8_act)
                    ref.quantize_rows(d.x, c.acc ? NULL : (c.use_rows ? d.rows : NULL), c.n, c.sh.cols, d.xq, d.xa);
                float *y_ref = case_alloc(count * sizeof *y_ref), *y_opt = case_alloc(count * sizeof *y_opt);
                double *want = case_alloc(count * sizeof *want), *mag = case_alloc(count * sizeof *mag);
                double *terms = case_alloc(count * sizeof *terms);
                char what[200];
                describe(&c, what, sizeof what);

                /* 1. The reference against the definition. */
                run(&ref, &c, &d, y_ref);
                expect(&c, &d, want, mag, terms);
                for (size_t i = 0; i < count; i++) {
                    const double tol = terms[i] * 0x1p-23 * (mag[i] + fabs((double)d.y_init[i]) + fabs(want[i])) + 1e-30;
                    checks++;
                    ref_checks++;
                    if (!isfinite(want[i]) || !isfinite(y_ref[i])) {
                        if (!same_class(want[i], y_ref[i]))
                            fail(what, i, want[i], y_ref[i], tol);
                        continue;
                    }
                    const double err = fabs((double)y_ref[i] - want[i]);
                    if (err > tol)
                        fail(what, i, want[i], y_ref[i], tol);
                    else if (err / tol > worst_ref)
                        worst_ref = err / tol;
                }

                /* 2. Each optimised table against the reference. */
                for (size_t t = 0; t < nopt; t++) {
                    run(&opts[t], &c, &d, y_opt);
                    for (size_t i = 0; i < count; i++) {
                        checks++;
                        const double tol = 2.0 * (double)(c.sh.cols + 4) * 0x1p-23 *
                                               (mag[i] + fabs((double)y_ref[i])) + 1e-30;
                        if (c.int8_act || !isfinite(y_ref[i]) || !isfinite(y_opt[i])) {
                            if (memcmp(&y_ref[i], &y_opt[i], sizeof(float)) != 0 &&
                                !(isnan(y_ref[i]) && isnan(y_opt[i])))
                                fail(what, i, y_ref[i], y_opt[i], 0.0);
                            continue;
                        }
                        const double err = fabs((double)y_opt[i] - (double)y_ref[i]);
                        if (err > tol)
                            fail(what, i, y_ref[i], y_opt[i], tol);
                        else if (err / tol > worst_f32[t])
                            worst_f32[t] = err / tol;
                    }
                    (void)worst_i8;
                    /* A token's outputs have the same bits alone as in the batch (prefill and
                     * decode agree, and a prompt's last-token logits are its row of the whole
                     * call's), at every level: the AVX-512 levels' fused kernel below 4 tokens
                     * sums in 16 lanes as their GEMM on widened rows does from 4 on. */
                    if (!c.acc) {
                        float *y_one = case_alloc(c.sh.rows * sizeof *y_one);
                        for (size_t i = 0; i < c.n; i++) {
                            const uint16_t row = c.use_rows ? d.rows[i] : (uint16_t)i;
                            const colibri_qrows qi = {d.xq + i * c.sh.cols, d.xa + i};
                            opts[t].linear(d.x, &row, 1, &d.w, c.use_b ? d.b : NULL, c.int8_act ? &qi : NULL, y_one);
                            for (size_t o = 0; o < c.sh.rows; o++) {
                                checks++;
                                if (memcmp(&y_one[o], &y_opt[i * c.sh.rows + o], sizeof(float)) != 0 &&
                                    !(isnan(y_one[o]) && isnan(y_opt[i * c.sh.rows + o])))
                                    fail("alone vs batch", i * c.sh.rows + o, y_opt[i * c.sh.rows + o], y_one[o], 0.0);
                            }
                        }
                    }
                }
                case_free();
            }
    /* 4. E's tables changed after validation (colibri_changed_tables.h): f32 and int8 activations,
     * 1 to 9 tokens (the f32 tiles from 4 on), every table and the reference give finite numbers,
     * wrong ones allowed, and read nothing outside the tables or x (NaN after x's last row, which
     * linear reads for half the cases). */
    unsigned long table_cases = 0, table_bad = 0;
    uint64_t table_state = 0x9A4u;
    for (int rep = 0; rep < 240; rep++) {
        tcase c;
        memset(&c, 0, sizeof c);
        c.sh.group_log2 = 3u + (unsigned)q4_below(&r, 6);
        c.sh.with_e = 1;
        c.sh.with_bias = rep % 2;
        c.int8_act = (rep / 2) % 2;
        c.acc = (rep / 4) % 2;
        c.use_rows = !c.acc;
        c.n = 1 + q4_below(&r, 9);
        c.sh.cols = 1 + q4_below(&r, 600);
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
        if (c.int8_act)
            ref.quantize_rows(d.x, c.acc ? NULL : d.rows, c.n, in, d.xq, d.xa);
        float *y = case_alloc(count * sizeof *y);
        for (size_t t = 0; t <= nopt; t++) {
            run(t < nopt ? &opts[t] : &ref, &c, &d, y);
            for (size_t i = 0; i < count; i++) {
                checks++;
                if (isnan(y[i])) {
                    table_bad++;
                    char what[200], ctx[300];
                    describe(&c, what, sizeof what);
                    snprintf(ctx, sizeof ctx, "changed tables, %s: a read outside E's tables or x: %s",
                             t < nopt ? opts[t].name : "reference", what);
                    fail(ctx, i, 0.0, y[i], 0.0);
                }
            }
        }
        table_cases++;
        colibri_changed_free(&changed);
        free(x);
        case_free();
    }
    printf("changed tables: %lu cases, %lu reads outside\n", table_cases, table_bad);
    printf("reference vs definition: %lu cases, %lu outputs, worst err/tol %.3f\n", cases, ref_checks, worst_ref);
    for (size_t t = 0; t < nopt; t++)
        printf("%s vs reference: f32-act worst err/tol %.3f, int8-act bit for bit\n", opts[t].name, worst_f32[t]);
    printf("%lu values checked, %lu failures\n", checks, failures);
    return failures ? 1 : 0;
}
