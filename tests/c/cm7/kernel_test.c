/*
 * The Cortex-M7 kernels (src/kernels/cmsis) against the reference kernels,
 * on the emulated Cortex-M7 (QEMU mps2-an500): a bare-metal image that runs
 * random cases, prints a summary through semihosting and exits with the
 * number of failures (0: all passed). tests/kernels/test_kernels_cmsis.py builds and
 * runs it (make -C tests/c/cm7).
 *
 * Cases: weight dtype f32, f16, I8 with f32 activations, I8 with int8
 * activations (with and without the compensation E); linear and linear_acc;
 * shapes with odd sizes and tails (in 1..75, a third of them multiples of 8; out
 * 1..21); n = 1..9 tokens (pairs of tokens share weight loads), with
 * and without a row list, with and without bias, with and without gate
 * scales; inputs with NaN and ±inf at random places in a third of the cases.
 *
 * Tolerance (stated here and in the kernels' header comment):
 *   - I8 with int8 activations: bit for bit (the integer sums are exact and
 *     the float steps are the reference's).
 *   - f32, f16 and I8 with f32 activations (fused multiply-adds, another
 *     summation order): |opt - ref| <= (in + 4) · 2^-23 · M, where
 *     M = |b| + Σ_k |w_k · x_k| (W the dequantised weights, E included), and
 *     for linear_acc s · that plus one rounding of y (2^-23 · |y|).
 *   - NaN exactly where the reference has NaN; the same infinity where the
 *     reference has one.
 * Exit status: the number of failed outputs (capped at 255).
 *
 * I4 weights (format v5; colibri_q4_cases.h builds them): every group size
 * 2^3..2^8, odd columns and partial last groups (in 1..300, out 1..21), E
 * and the companion bias present or absent, the same token, bias, gate and
 * NaN/inf variations; int8 activations bit for bit, f32 activations within
 * the tolerance above with |w| = |Q|·s_g (E and the companion bias in M).
 *
 * A second part counts instructions (QEMU -icount, not cycles) of each
 * kernel on the meter model's shapes (bench/models.py) and prints them per
 * multiply-accumulate, optimised and reference; then q4 (group 32) against
 * q8 and f32 on one wide layer (256 x 256).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "board.h"
#include "colibri.h"
#include "colibri_format.h"
#include "colibri_kernels.h"
#include "../colibri_q4_cases.h"
#include "../colibri_rng.h"

/* ---- output through semihosting (QEMU -semihosting-config enable=on) ---- */

static void write0(const char *text)
{
    register uint32_t r0 __asm__("r0") = 0x04u; /* SYS_WRITE0 */
    register const char *r1 __asm__("r1") = text;
    __asm__ volatile("bkpt 0xAB" : "+r"(r0) : "r"(r1) : "memory");
}

static char line[160];
static size_t line_len;

static void put_str(const char *s)
{
    while (*s && line_len + 1 < sizeof line)
        line[line_len++] = *s++;
}

static void put_u(uint32_t v)
{
    char d[12];
    size_t n = 0;
    do {
        d[n++] = (char)('0' + v % 10u);
        v /= 10u;
    } while (v);
    while (n && line_len + 1 < sizeof line)
        line[line_len++] = d[--n];
}

/* v with 3 decimals, v >= 0 and not huge. */
static void put_fix3(float v)
{
    const uint32_t m = (uint32_t)(v * 1000.0f + 0.5f);
    put_u(m / 1000u);
    put_str(".");
    const uint32_t f = m % 1000u;
    if (f < 100u)
        put_str("0");
    if (f < 10u)
        put_str("0");
    put_u(f);
}

static void flush(void)
{
    line[line_len++] = '\n';
    line[line_len] = '\0';
    write0(line);
    line_len = 0;
}

/* ---- random numbers: xorshift32 ---- */

static uint32_t rng_state = 0x12345678u;

static uint32_t rnd(void)
{
    return colibri_xorshift32(&rng_state);
}

static uint32_t rnd_below(uint32_t n)
{
    return rnd() % n;
}

static float rnd_unit(void) /* uniform in [-1, 1) */
{
    return (float)(int32_t)(rnd() >> 8 & 0xFFFFFFu) / 8388608.0f - 1.0f;
}

/* ---- buffers ---- */

#define MAX_IN 75u
#define MAX_OUT 64u
#define MAX_N 9u
#define MAX_Y_ROWS 12u
#define MAX_NNZ 64u

static float w_f32[MAX_OUT * MAX_IN];
static uint16_t w_f16[MAX_OUT * MAX_IN];
static int8_t w_i8[MAX_OUT * MAX_IN + 4];
static float scale_q8[MAX_OUT];
static uint32_t row_ptr[MAX_OUT + 1];
static uint16_t e_col[MAX_NNZ], e_val[MAX_NNZ];
static float bias[MAX_OUT];
/* The format v2 companion (docs/model-format.md "Quantised weights"): f16
 * or f32 parameters (scales, then the bias when it holds one) at a 2-byte
 * offset that breaks word alignment, u8 / u16 row pointers. */
static uint32_t params_words[2 * MAX_OUT + 2];
static uint8_t row_ptr8[MAX_OUT + 1];
static uint16_t row_ptr16[MAX_OUT + 1];
static float cbias[MAX_OUT]; /* the companion's bias as floats, 0 without one (the tolerance) */
static float x[MAX_Y_ROWS * MAX_IN];
static int8_t xq[MAX_N * MAX_IN + 4];
static float xa[MAX_N];
static uint16_t rows[MAX_N];
static float gates[MAX_N];
static float y_ref[MAX_Y_ROWS * MAX_OUT], y_opt[MAX_Y_ROWS * MAX_OUT], y_init[MAX_Y_ROWS * MAX_OUT];

static uint16_t f16_bits(float f)
{
    const __fp16 h = (__fp16)f;
    uint16_t b;
    memcpy(&b, &h, sizeof b);
    return b;
}

static float f16_value(uint16_t b)
{
    __fp16 h;
    memcpy(&h, &b, sizeof h);
    return (float)h;
}

enum { K_F32, K_F16, K_Q8, K_Q8Q8, K_COUNT };
static const char *const kind_name[K_COUNT] = {"f32", "f16", "q8 f32-act", "q8 int8-act"};

/* The weight of row o, column k as a float (W = Q·s + E for I8). */
static float weight(const colibri_matrix *w, size_t o, size_t k)
{
    const size_t in = w->cols;
    switch (w->dtype) {
    case COLIBRI_DTYPE_F16:
        return f16_value(w_f16[o * in + k]);
    case COLIBRI_DTYPE_I8: {
        float v = (float)((const int8_t *)w->data)[o * in + k] * scale_q8[o];
        if (w->q8_nnz)
            for (uint32_t e = row_ptr[o]; e < row_ptr[o + 1]; e++)
                if (e_col[e] == k)
                    v += f16_value(e_val[e]);
        return v;
    }
    default:
        return w_f32[o * in + k];
    }
}

/* Fills a random matrix of `kind`. */
static void make_matrix(colibri_matrix *w, int kind, size_t out, size_t in)
{
    memset(w, 0, sizeof *w);
    w->rows = (uint32_t)out;
    w->cols = (uint32_t)in;
    switch (kind) {
    case K_F32:
        w->dtype = COLIBRI_DTYPE_F32;
        for (size_t i = 0; i < out * in; i++)
            w_f32[i] = rnd_unit();
        w->data = w_f32;
        break;
    case K_F16:
        w->dtype = COLIBRI_DTYPE_F16;
        for (size_t i = 0; i < out * in; i++)
            w_f16[i] = f16_bits(rnd_unit());
        w->data = w_f16;
        break;
    default: {
        w->dtype = COLIBRI_DTYPE_I8;
        /* Odd offsets too: an I8 matrix's rows need not be word aligned. */
        int8_t *q = w_i8 + rnd_below(4);
        for (size_t i = 0; i < out * in; i++)
            q[i] = (int8_t)((int32_t)rnd_below(255) - 127);
        if (rnd_below(4) == 0) /* extremes: every product at its largest */
            for (size_t i = 0; i < out * in; i++)
                q[i] = (int8_t)(rnd() & 1u ? 127 : -127);
        w->data = q;
        for (size_t o = 0; o < out; o++)
            scale_q8[o] = (0.5f + 0.5f * rnd_unit()) / 127.0f;
        w->scale = scale_q8;
        /* The compensation E (the matrix layout of today's Q8_PARAMS: the
         * kernels themselves read it only through colibri_q8_*). */
        uint32_t nnz = 0;
        row_ptr[0] = 0;
        const int with_e = rnd_below(2) == 0;
        for (size_t o = 0; o < out; o++) {
            if (with_e)
                for (size_t k = 0; k < in && nnz < MAX_NNZ; k++)
                    if (rnd_below(16) == 0) {
                        e_col[nnz] = (uint16_t)k;
                        e_val[nnz] = f16_bits(0.01f * rnd_unit());
                        nnz++;
                    }
            row_ptr[o + 1] = nnz;
        }
        w->q8_nnz = nnz;
        w->q8_ptr = nnz ? 4 : 0;
        if (nnz) {
            w->row_ptr = row_ptr;
            w->col = e_col;
            w->val = e_val;
        }
        for (size_t o = 0; o < out; o++)
            cbias[o] = 0.0f;
        if (rnd_below(2)) { /* format v2: compact metadata */
            const int f16 = rnd_below(3) != 0;
            w->q8_f16 = (uint8_t)f16;
            w->q8_bias = (uint8_t)rnd_below(2);
            for (size_t o = 0; o < out; o++)
                cbias[o] = w->q8_bias && rnd_below(8) != 0 ? 0.25f + 0.5f * rnd_unit() : 0.0f; /* f16 normal or 0 */
            if (f16) {
                uint16_t *h = (uint16_t *)(void *)params_words + 1; /* 2 mod 4 */
                for (size_t o = 0; o < out; o++) {
                    h[o] = f16_bits(scale_q8[o]);
                    scale_q8[o] = f16_value(h[o]);
                    h[out + o] = f16_bits(cbias[o]);
                    cbias[o] = f16_value(h[out + o]);
                }
                w->scale = h;
            } else {
                float *f = (float *)(void *)params_words;
                for (size_t o = 0; o < out; o++) {
                    f[o] = scale_q8[o];
                    f[out + o] = cbias[o];
                }
                w->scale = f;
            }
            if (nnz && nnz <= 0xFFu && rnd_below(2)) {
                for (size_t o = 0; o <= out; o++)
                    row_ptr8[o] = (uint8_t)row_ptr[o];
                w->q8_ptr = 1;
                w->row_ptr = row_ptr8;
            } else if (nnz) {
                for (size_t o = 0; o <= out; o++)
                    row_ptr16[o] = (uint16_t)row_ptr[o];
                w->q8_ptr = 2;
                w->row_ptr = row_ptr16;
            }
        }
        break;
    }
    }
}

static uint32_t failures;
static float worst[K_COUNT][2]; /* max |err| / tol per kind, linear and acc */
static uint32_t cases[K_COUNT][2];

static int same_bits(float a, float b)
{
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    return ua == ub || (isnan(a) && isnan(b));
}

static void report_failure(int kind, int acc, size_t out, size_t in, size_t n, size_t i, size_t o, float got,
                           float want, float tol)
{
    failures++;
    if (failures > 8u)
        return;
    put_str("FAIL ");
    put_str(kind_name[kind]);
    put_str(acc ? " linear_acc" : " linear");
    put_str(" out=");
    put_u((uint32_t)out);
    put_str(" in=");
    put_u((uint32_t)in);
    put_str(" n=");
    put_u((uint32_t)n);
    put_str(" token ");
    put_u((uint32_t)i);
    put_str(" output ");
    put_u((uint32_t)o);
    put_str(got == got ? (isinf(got) ? " got inf" : " got finite") : " got NaN");
    put_str(want == want ? (isinf(want) ? " want inf" : " want finite") : " want NaN");
    put_str(" err/tol ");
    put_fix3(tol > 0.0f ? fabsf(got - want) / tol : 9999.0f);
    flush();
}

static void one_case(const colibri_kernels *opt, int kind, int acc, int nonfinite)
{
    size_t in = 1u + rnd_below(MAX_IN);
    size_t out = 1u + rnd_below(21u), n = 1u + rnd_below(MAX_N);
    if (rnd_below(3) == 0) /* whole 8-column chunks: the blocked paths without column tails */
        in = 8u * (1u + rnd_below(MAX_IN / 8u));
    if (rnd_below(3) == 0) { /* one token: the F32 fast paths (whole 8 x 8 blocks, a 3-row router) */
        static const size_t outs[] = {3u, 8u, 16u, 24u};
        n = 1u;
        out = outs[rnd_below(4)];
    }
    colibri_matrix w;
    make_matrix(&w, kind, out, in);
    const int with_bias = rnd_below(2), with_rows = rnd_below(2), with_scale = rnd_below(2);
    for (size_t o = 0; o < out; o++)
        bias[o] = rnd_unit();
    const size_t xrows = MAX_Y_ROWS;
    for (size_t i = 0; i < xrows * in; i++)
        x[i] = rnd_unit() * (rnd_below(8) == 0 ? 100.0f : 1.0f);
    if (nonfinite) {
        const float specials[3] = {NAN, INFINITY, -INFINITY};
        const size_t count = 1u + rnd_below(3);
        for (size_t c = 0; c < count; c++)
            x[rnd_below((uint32_t)(xrows * in))] = specials[rnd_below(3)];
    }
    /* Distinct rows (linear_acc scatters into them), in random order. */
    uint16_t perm[MAX_Y_ROWS];
    for (size_t i = 0; i < MAX_Y_ROWS; i++)
        perm[i] = (uint16_t)i;
    for (size_t i = MAX_Y_ROWS - 1; i > 0; i--) {
        const size_t j = rnd_below((uint32_t)i + 1u);
        const uint16_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (size_t i = 0; i < n; i++) {
        rows[i] = perm[i];
        gates[i] = 0.25f + 0.75f * (rnd_unit() + 1.0f) / 2.0f;
    }
    const uint16_t *rp = with_rows ? rows : NULL;
    const float *bp = with_bias ? bias : NULL;
    const float *sp = with_scale ? gates : NULL;

    /* int8 activations of the rows the call reads, by the reference quantiser. */
    colibri_qrows q = {xq, xa};
    const colibri_qrows *qp = NULL;
    if (kind == K_Q8Q8) {
        if (acc)
            colibri_quantize_rows_ref(x, NULL, n, in, xq, xa);
        else
            colibri_quantize_rows_ref(x, rp, n, in, xq, xa);
        qp = &q;
    }

    const size_t yrows = MAX_Y_ROWS;
    for (size_t i = 0; i < yrows * out; i++)
        y_init[i] = rnd_unit();
    memcpy(y_ref, y_init, sizeof(float) * yrows * out);
    memcpy(y_opt, y_init, sizeof(float) * yrows * out);
    if (acc) {
        colibri_linear_acc_ref(x, n, &w, bp, rp, sp, qp, y_ref);
        opt->linear_acc(x, n, &w, bp, rp, sp, qp, y_opt);
    } else {
        colibri_linear_ref(x, rp, n, &w, bp, qp, y_ref);
        opt->linear(x, rp, n, &w, bp, qp, y_opt);
    }
    cases[kind][acc]++;

    for (size_t i = 0; i < (acc ? yrows : n); i++) {
        /* Which token wrote output row i (acc), or the token i (linear). */
        size_t token = i, yrow = i;
        int written = 1;
        if (acc) {
            written = 0;
            for (size_t t = 0; t < n; t++)
                if ((rp ? rp[t] : t) == i) {
                    token = t;
                    written = 1;
                }
        }
        const float *xi = acc ? x + token * in : x + (rp ? rp[token] : token) * in;
        for (size_t o = 0; o < out; o++) {
            const float got = y_opt[yrow * out + o], want = y_ref[yrow * out + o];
            if (!written) {
                if (!same_bits(got, want))
                    report_failure(kind, acc, out, in, n, i, o, got, want, 0.0f);
                continue;
            }
            if (kind == K_Q8Q8) {
                if (!same_bits(got, want))
                    report_failure(kind, acc, out, in, n, token, o, got, want, 0.0f);
                continue;
            }
            if (isnan(want) || isinf(want)) {
                if (!same_bits(got, want) && !(isnan(want) && isnan(got)))
                    report_failure(kind, acc, out, in, n, token, o, got, want, 0.0f);
                continue;
            }
            if (!isfinite(got)) {
                report_failure(kind, acc, out, in, n, token, o, got, want, 0.0f);
                continue;
            }
            float m = (bp ? fabsf(bp[o]) : 0.0f) + (kind >= K_Q8 ? fabsf(cbias[o]) : 0.0f);
            for (size_t k = 0; k < in; k++)
                m += fabsf(weight(&w, o, k) * xi[k]);
            float tol = (float)(in + 4u) * 0x1p-23f * m;
            if (acc)
                tol = tol * (sp ? sp[token] : 1.0f) + 0x1p-23f * fabsf(want) + 0x1p-23f * fabsf(y_init[yrow * out + o]);
            const float err = fabsf(got - want);
            if (!(err <= tol))
                report_failure(kind, acc, out, in, n, token, o, got, want, tol);
            else if (tol > 0.0f && err / tol > worst[kind][acc])
                worst[kind][acc] = err / tol;
        }
    }
}

/* ---- Tables changed after validation ----
 * The row pointers and columns of E are read in place from the image, so an
 * image changed under a live context may hold any values there. Row pointers
 * past nnz, decreasing ones, and columns past cols must give wrong numbers,
 * never a read outside col, val and the token's x: every entry past nnz here
 * holds NaN, and so does x past cols, so a read outside the tables shows as
 * a NaN output (every weight, input and parameter is finite). */
#define TABLE_PAD 64u
static uint16_t bad_col[MAX_NNZ + TABLE_PAD], bad_val[MAX_NNZ + TABLE_PAD];
static float x_pad[MAX_IN + TABLE_PAD];
static uint32_t table_cases, table_nan;

static void changed_table_case(const colibri_kernels *opt, int kind, int acc)
{
    const size_t in = 1u + rnd_below(MAX_IN), out = 1u + rnd_below(MAX_OUT);
    colibri_matrix w;
    do
        make_matrix(&w, kind, out, in);
    while (w.q8_nnz == 0u);
    const uint32_t nnz = w.q8_nnz;
    for (uint32_t k = 0; k < MAX_NNZ + TABLE_PAD; k++) {
        bad_col[k] = k < nnz ? e_col[k] : 0u;
        bad_val[k] = k < nnz ? e_val[k] : 0x7E00u; /* f16 NaN */
    }
    for (uint32_t k = 0; k < nnz; k++)
        if (rnd_below(4) == 0)
            bad_col[k] = (uint16_t)(in + rnd_below(TABLE_PAD)); /* past cols */
    w.col = bad_col;
    w.val = bad_val;
    /* Row pointers: some past nnz (up to nnz + TABLE_PAD, so a read past nnz
     * meets a NaN), some decreasing, the rest as they were. */
    const uint32_t limit = w.q8_ptr == 1u ? 0xFFu : nnz + TABLE_PAD;
    for (size_t o = 0; o <= out; o++) {
        uint32_t k = row_ptr[o];
        if (rnd_below(3) == 0)
            k = rnd_below(nnz + TABLE_PAD + 1u);
        if (k > limit)
            k = limit;
        row_ptr[o] = k;
        row_ptr8[o] = (uint8_t)k;
        row_ptr16[o] = (uint16_t)k;
    }
    for (size_t k = 0; k < MAX_IN + TABLE_PAD; k++)
        x_pad[k] = k < in ? rnd_unit() : NAN;
    colibri_qrows q = {xq, xa};
    const colibri_qrows *qp = NULL;
    if (kind == K_Q8Q8) {
        colibri_quantize_rows_ref(x_pad, NULL, 1, in, xq, xa);
        qp = &q;
    }
    const float gate = 0.5f;
    for (int impl = 0; impl < 2; impl++) { /* the optimised kernels, then the reference */
        for (size_t o = 0; o < out; o++)
            y_opt[o] = 0.0f;
        if (acc)
            (impl ? colibri_linear_acc_ref : opt->linear_acc)(x_pad, 1, &w, NULL, NULL, &gate, qp, y_opt);
        else
            (impl ? colibri_linear_ref : opt->linear)(x_pad, NULL, 1, &w, NULL, qp, y_opt);
        for (size_t o = 0; o < out; o++)
            if (isnan(y_opt[o])) {
                table_nan++;
                if (table_nan <= 8u) {
                    put_str(impl ? "FAIL reference" : "FAIL optimised");
                    put_str(": a read outside E's tables, out ");
                    put_u((uint32_t)out);
                    put_str(" in ");
                    put_u((uint32_t)in);
                    put_str(" row ");
                    put_u((uint32_t)o);
                    flush();
                }
            }
    }
    table_cases++;
}

/* ---- I4 weights ---- */

#define Q4_MAX_IN 300u
#define Q4_MAX_OUT 21u
static float x4[MAX_Y_ROWS * Q4_MAX_IN];
static int8_t xq4[MAX_N * Q4_MAX_IN];
static uint8_t q4_arena[64 * 1024] __attribute__((aligned(8)));
static size_t q4_used;

static void *q4_alloc(size_t bytes)
{
    void *p = q4_arena + q4_used;
    q4_used += (bytes + 7u) & ~(size_t)7u;
    if (q4_used > sizeof q4_arena) {
        put_str("q4 arena too small");
        flush();
        board_exit(254);
    }
    memset(p, 0, bytes);
    return p;
}

static q4_rng q4r = {0xC0FFEE11u};
static uint32_t q4_cases[2];
static float q4_worst;

static void q4_case(const colibri_kernels *opt, int int8_act, int acc, int nonfinite)
{
    q4_used = 0;
    q4_shape sh;
    sh.group_log2 = 3u + rnd_below(6);
    sh.cols = 1u + rnd_below(rnd_below(2) ? 2u * (1u << sh.group_log2) + 3u : Q4_MAX_IN);
    if (sh.cols > Q4_MAX_IN)
        sh.cols = Q4_MAX_IN;
    sh.rows = 1u + rnd_below(Q4_MAX_OUT);
    sh.with_e = (int)rnd_below(2);
    sh.with_bias = (int)rnd_below(2);
    colibri_matrix w;
    q4_build(&q4r, q4_alloc, &sh, &w);
    const size_t in = sh.cols, out = sh.rows, n = 1u + rnd_below(MAX_N);
    const int with_bias = rnd_below(2), with_rows = rnd_below(2), with_scale = rnd_below(2);
    for (size_t o = 0; o < out; o++)
        bias[o] = rnd_unit();
    for (size_t i = 0; i < MAX_Y_ROWS * in; i++)
        x4[i] = rnd_unit() * 4.0f;
    if (nonfinite) {
        const float specials[3] = {NAN, INFINITY, -INFINITY};
        for (size_t c = 0; c < 3; c++)
            x4[rnd_below((uint32_t)(MAX_Y_ROWS * in))] = specials[rnd_below(3)];
    }
    uint16_t perm[MAX_Y_ROWS];
    for (size_t i = 0; i < MAX_Y_ROWS; i++)
        perm[i] = (uint16_t)i;
    for (size_t i = MAX_Y_ROWS - 1; i > 0; i--) {
        const size_t j = rnd_below((uint32_t)i + 1u);
        const uint16_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (size_t i = 0; i < n; i++) {
        rows[i] = perm[i];
        gates[i] = 0.25f + 0.75f * (rnd_unit() + 1.0f) / 2.0f;
    }
    const uint16_t *rp = with_rows ? rows : NULL;
    const float *bp = with_bias ? bias : NULL;
    const float *sp = with_scale ? gates : NULL;
    colibri_qrows q = {xq4, xa};
    const colibri_qrows *qp = NULL;
    if (int8_act) {
        colibri_quantize_rows_ref(x4, acc ? NULL : rp, n, in, xq4, xa);
        qp = &q;
    }
    for (size_t i = 0; i < MAX_Y_ROWS * out; i++)
        y_init[i] = rnd_unit();
    memcpy(y_ref, y_init, sizeof(float) * MAX_Y_ROWS * out);
    memcpy(y_opt, y_init, sizeof(float) * MAX_Y_ROWS * out);
    if (acc) {
        colibri_linear_acc_ref(x4, n, &w, bp, rp, sp, qp, y_ref);
        opt->linear_acc(x4, n, &w, bp, rp, sp, qp, y_opt);
    } else {
        colibri_linear_ref(x4, rp, n, &w, bp, qp, y_ref);
        opt->linear(x4, rp, n, &w, bp, qp, y_opt);
    }
    q4_cases[int8_act]++;
    const int kind = int8_act ? K_Q8Q8 : K_Q8; /* for the failure message's name */
    for (size_t i = 0; i < (acc ? MAX_Y_ROWS : n); i++) {
        size_t token = i;
        int written = 1;
        if (acc) {
            written = 0;
            for (size_t t = 0; t < n; t++)
                if ((rp ? rp[t] : t) == i) {
                    token = t;
                    written = 1;
                }
        }
        const float *xi = acc ? x4 + token * in : x4 + (rp ? rp[token] : token) * in;
        for (size_t o = 0; o < out; o++) {
            const float got = y_opt[i * out + o], want = y_ref[i * out + o];
            if (!written || int8_act || isnan(want) || isinf(want) || !isfinite(got)) {
                if (!same_bits(got, want))
                    report_failure(kind, acc, out, in, n, token, o, got, want, 0.0f);
                continue;
            }
            double m;
            size_t terms;
            (void)q4_expect(&w, o, xi, NULL, 0.0f, &m, &terms);
            float tol = (float)(in + 4u) * 0x1p-23f * ((float)m + (bp ? fabsf(bp[o]) : 0.0f));
            if (acc)
                tol = tol * (sp ? sp[token] : 1.0f) + 0x1p-23f * fabsf(want) + 0x1p-23f * fabsf(y_init[i * out + o]);
            const float err = fabsf(got - want);
            if (!(err <= tol))
                report_failure(kind, acc, out, in, n, token, o, got, want, tol);
            else if (tol > 0.0f && err / tol > q4_worst)
                q4_worst = err / tol;
        }
    }
}

/* Activations: the backend's against the reference, every kind, over random
 * values (to ±100), ±0, ±inf, NaN and lengths 0..40 (tails of 8). ReLU, the
 * GELUs and tanh bit for bit (exact or the reference's); SiLU and sigmoid
 * (a single-precision e^x) within 2^-20 |ref| + 2^-140, NaN exactly where
 * the reference has NaN and the same infinities. */
static void activation_cases(const colibri_kernels *opt)
{
    static const uint32_t act_kinds[] = {COLIBRI_ACT_RELU, COLIBRI_ACT_GELU_ERF, COLIBRI_ACT_GELU_TANH,
                                         COLIBRI_ACT_SILU, COLIBRI_ACT_TANH, COLIBRI_ACT_SIGMOID};
    static float a[48], b[48];
    const float specials[6] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN};
    float worst_rel = 0.0f;
    for (uint32_t c = 0; c < 240; c++) {
        const uint32_t kind = act_kinds[c % 6u];
        const size_t n = rnd_below(41);
        const float range = c % 4u == 0 ? 100.0f : 8.0f;
        for (size_t i = 0; i < n; i++)
            a[i] = rnd_below(6) == 0 ? specials[rnd_below(6)] : rnd_unit() * range;
        memcpy(b, a, sizeof a);
        colibri_activation_ref(a, n, kind);
        opt->activation(b, n, kind);
        const int approx = kind == COLIBRI_ACT_SILU || kind == COLIBRI_ACT_SIGMOID;
        for (size_t i = 0; i < n; i++) {
            int ok;
            if (!approx || isnan(a[i]) || isinf(a[i])) {
                ok = same_bits(a[i], b[i]) && isnan(a[i]) == isnan(b[i]);
            } else {
                const float err = fabsf(a[i] - b[i]), tol = 0x1p-20f * fabsf(a[i]) + 0x1p-140f;
                ok = err <= tol;
                if (ok && fabsf(a[i]) > 0x1p-100f && err / fabsf(a[i]) > worst_rel)
                    worst_rel = err / fabsf(a[i]);
            }
            if (!ok) {
                failures++;
                put_str("FAIL activation kind ");
                put_u(kind);
                put_str(" n=");
                put_u((uint32_t)n);
                put_str(" at ");
                put_u((uint32_t)i);
                flush();
                break;
            }
        }
    }
    put_str("activations: 240 cases; SiLU/sigmoid worst relative error 2^-23 x ");
    put_fix3(worst_rel * 0x1p23f);
    flush();
}

/* The quantiser: the backend's against the reference, bit for bit (q and
 * a; a NaN a as NaN), rows of random, huge, tiny (below 2^-100, subnormal),
 * all-zero and non-finite values, lengths 1..75, with and without a row list. */
static void quantize_cases(const colibri_kernels *opt)
{
    static int8_t q_ref[MAX_N * MAX_IN], q_opt[MAX_N * MAX_IN];
    static float a_ref[MAX_N], a_opt[MAX_N];
    const float specials[5] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f};
    for (uint32_t c = 0; c < 200; c++) {
        const size_t in = 1u + rnd_below(MAX_IN), n = 1u + rnd_below(MAX_N);
        for (size_t r = 0; r < MAX_Y_ROWS; r++) {
            const uint32_t style = rnd_below(8);
            const float mag = style == 0 ? 0x1p-110f : style == 1 ? 0x1p-130f : style == 2 ? 1e30f : 1.0f;
            for (size_t k = 0; k < in; k++)
                x[r * in + k] = style == 3 ? 0.0f : rnd_unit() * mag;
            if (style == 4 || style == 5)
                x[r * in + rnd_below((uint32_t)in)] = specials[rnd_below(5)];
            if (style == 6) { /* m = 127, so x · 127 / m = x: exact halves, rounded away from zero */
                for (size_t k = 0; k < in; k++)
                    x[r * in + k] = (float)((int32_t)rnd_below(255) - 127) * 0.5f;
                x[r * in + rnd_below((uint32_t)in)] = 127.0f;
            }
        }
        for (size_t i = 0; i < n; i++)
            rows[i] = (uint16_t)rnd_below(MAX_Y_ROWS);
        const uint16_t *rp = rnd_below(2) ? rows : NULL;
        colibri_quantize_rows_ref(x, rp, n, in, q_ref, a_ref);
        opt->quantize_rows(x, rp, n, in, q_opt, a_opt);
        int bad = memcmp(q_ref, q_opt, n * in) != 0;
        for (size_t i = 0; i < n; i++)
            bad |= !same_bits(a_ref[i], a_opt[i]);
        if (bad) {
            failures++;
            put_str("FAIL quantize_rows in=");
            put_u((uint32_t)in);
            put_str(" n=");
            put_u((uint32_t)n);
            flush();
        }
    }
    put_str("quantize_rows: 200 cases, bit for bit");
    flush();
}

/* ---- instruction counts (QEMU -icount) on the meter model's shapes ---- */

static uint64_t time_linear(void (*fn)(const float *, const uint16_t *, size_t, const colibri_matrix *, const float *,
                                        const colibri_qrows *, float *restrict),
                            const colibri_matrix *w, const colibri_qrows *q)
{
    board_work_start();
    fn(x, NULL, 1, w, bias, q, y_opt);
    return board_work_stop();
}

static void count_instructions(const colibri_kernels *opt)
{
    /* The meter model's linear layers (bench/models.py), f32 weights, one token. */
    static const uint16_t shapes[][2] = {{32, 48}, {3, 32}, {64, 32}, {32, 64}, {24, 32}};
    static const int kinds[] = {K_F32, K_F16, K_Q8, K_Q8Q8};
    static float wide[64 * 48];
    static uint16_t wide16[64 * 48];
    static int8_t wide8[64 * 48];
    static float wscale[64];
    for (size_t i = 0; i < 64 * 48; i++) {
        wide[i] = rnd_unit();
        wide16[i] = f16_bits(wide[i]);
        wide8[i] = (int8_t)((int32_t)rnd_below(255) - 127);
    }
    for (size_t i = 0; i < 64; i++)
        wscale[i] = 0.01f;
    for (size_t i = 0; i < 64; i++) {
        x[i] = rnd_unit();
        bias[i] = rnd_unit();
    }
    colibri_quantize_rows_ref(x, NULL, 1, 64, xq, xa);
    colibri_qrows q = {xq, xa};
    for (size_t kk = 0; kk < sizeof kinds / sizeof kinds[0]; kk++) {
        const int kind = kinds[kk];
        uint64_t t_opt = 0, t_ref = 0, macs = 0;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            colibri_matrix w;
            memset(&w, 0, sizeof w);
            w.rows = shapes[s][0];
            w.cols = shapes[s][1];
            w.dtype = kind == K_F32 ? COLIBRI_DTYPE_F32 : kind == K_F16 ? COLIBRI_DTYPE_F16 : COLIBRI_DTYPE_I8;
            w.data = kind == K_F32 ? (const void *)wide : kind == K_F16 ? (const void *)wide16 : (const void *)wide8;
            w.scale = wscale;
            const colibri_qrows *qp = kind == K_Q8Q8 ? &q : NULL;
            t_opt += time_linear(opt->linear, &w, qp);
            t_ref += time_linear(colibri_linear_ref, &w, qp);
            macs += (uint64_t)w.rows * w.cols;
        }
        put_str("instructions per MAC, meter shapes, ");
        put_str(kind_name[kind]);
        put_str(": optimised ");
        put_fix3((float)t_opt / (float)macs);
        put_str(" reference ");
        put_fix3((float)t_ref / (float)macs);
        put_str(" (");
        put_u((uint32_t)t_opt);
        put_str(" / ");
        put_u((uint32_t)macs);
        put_str(")");
        flush();
    }
}

/* q4 on the meter shapes (group 32, no E) and one wide layer: q4, q8 and f32. */
static void count_q4_instructions(const colibri_kernels *opt)
{
    static const uint16_t shapes[][2] = {{32, 48}, {3, 32}, {64, 32}, {32, 64}, {24, 32}};
    static uint8_t nib[256 * 128];
    static uint16_t sc16[256 * 8];
    static float wide_f32[256 * 256];
    static int8_t wide_i8[256 * 256];
    static float s8[256];
    for (size_t i = 0; i < sizeof nib; i++)
        nib[i] = (uint8_t)rnd();
    for (size_t i = 0; i < 256 * 8; i++)
        sc16[i] = 0x2000u; /* 2^-7 */
    for (size_t i = 0; i < 256 * 256; i++) {
        wide_f32[i] = rnd_unit();
        wide_i8[i] = (int8_t)((int32_t)rnd_below(255) - 127);
    }
    for (size_t i = 0; i < 256; i++) {
        s8[i] = 0.01f;
        x4[i] = rnd_unit();
        bias[i % MAX_OUT] = rnd_unit();
    }
    colibri_quantize_rows_ref(x4, NULL, 1, 256, xq4, xa);
    colibri_qrows q = {xq4, xa};
    static const char *const names[2] = {"q4 f32-act", "q4 int8-act"};
    for (int i8 = 0; i8 < 2; i8++) {
        uint64_t t_opt = 0, t_ref = 0, macs = 0;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            colibri_matrix w;
            memset(&w, 0, sizeof w);
            w.dtype = COLIBRI_DTYPE_I4;
            w.rows = shapes[s][0];
            w.cols = shapes[s][1];
            w.data = nib;
            w.scale = sc16;
            w.q8_f16 = 1;
            w.q4_group_log2 = 5;
            w.q4_groups = (w.cols + 31u) / 32u;
            board_work_start();
            opt->linear(x4, NULL, 1, &w, NULL, i8 ? &q : NULL, y_opt);
            t_opt += board_work_stop();
            board_work_start();
            colibri_linear_ref(x4, NULL, 1, &w, NULL, i8 ? &q : NULL, y_ref);
            t_ref += board_work_stop();
            macs += (uint64_t)w.rows * w.cols;
        }
        put_str("instructions per MAC, meter shapes, ");
        put_str(names[i8]);
        put_str(": optimised ");
        put_fix3((float)t_opt / (float)macs);
        put_str(" reference ");
        put_fix3((float)t_ref / (float)macs);
        put_str(" (");
        put_u((uint32_t)t_opt);
        put_str(" / ");
        put_u((uint32_t)macs);
        put_str(")");
        flush();
    }
    /* One wide layer, 256 x 256, one token, cmsis kernels: every dtype and activation kind. */
    static const char *const wide_names[5] = {"f32", "q8 f32-act", "q8 int8-act", "q4 f32-act", "q4 int8-act"};
    for (int k = 0; k < 5; k++) {
        colibri_matrix w;
        memset(&w, 0, sizeof w);
        w.rows = 256;
        w.cols = 256;
        if (k == 0) {
            w.dtype = COLIBRI_DTYPE_F32;
            w.data = wide_f32;
        } else if (k < 3) {
            w.dtype = COLIBRI_DTYPE_I8;
            w.data = wide_i8;
            w.scale = s8;
        } else {
            w.dtype = COLIBRI_DTYPE_I4;
            w.data = nib;
            w.scale = sc16;
            w.q8_f16 = 1;
            w.q4_group_log2 = 5;
            w.q4_groups = 8;
        }
        const int i8 = k == 2 || k == 4;
        board_work_start();
        opt->linear(x4, NULL, 1, &w, NULL, i8 ? &q : NULL, y_opt);
        const uint64_t t = board_work_stop();
        put_str("instructions per MAC, wide 256x256, ");
        put_str(wide_names[k]);
        put_str(": ");
        put_fix3((float)t / 65536.0f);
        put_str(" (");
        put_u((uint32_t)t);
        put_str(")");
        flush();
    }
}

int main(void)
{
    board_init();
    colibri_kernels opt;
    colibri_kernels_optimised(&opt);
    put_str("kernels: ");
    put_str(opt.name);
    flush();
#ifdef KERNEL_TEST_COUNT_ONLY
    const uint32_t per_kind = 0; /* profiling the counted part alone */
#else
    const uint32_t per_kind = 150;
#endif
    for (int kind = 0; kind < K_COUNT; kind++)
        for (uint32_t c = 0; c < per_kind; c++)
            one_case(&opt, kind, (int)(c & 1u), c % 3u == 2u);
    for (int kind = 0; kind < K_COUNT; kind++) {
        put_str(kind_name[kind]);
        put_str(": ");
        put_u(cases[kind][0]);
        put_str(" linear, ");
        put_u(cases[kind][1]);
        put_str(" linear_acc cases; worst err/tol ");
        put_fix3(worst[kind][0]);
        put_str(", ");
        put_fix3(worst[kind][1]);
        flush();
    }
    for (uint32_t c = 0; c < 2u * per_kind; c++)
        q4_case(&opt, (int)(c & 1u), (int)((c >> 1) & 1u), c % 5u == 4u);
    put_str("q4: ");
    put_u(q4_cases[0]);
    put_str(" f32-act, ");
    put_u(q4_cases[1]);
    put_str(" int8-act cases; f32-act worst err/tol ");
    put_fix3(q4_worst);
    put_str(", int8-act bit for bit");
    flush();
    for (uint32_t c = 0; c < per_kind; c++)
        changed_table_case(&opt, c & 2u ? K_Q8Q8 : K_Q8, (int)(c & 1u));
    put_str("changed tables: ");
    put_u(table_cases);
    put_str(" cases, ");
    put_u(table_nan);
    put_str(" reads outside them");
    flush();
    failures += table_nan;
    activation_cases(&opt);
    quantize_cases(&opt);
    count_instructions(&opt);
    count_q4_instructions(&opt);
    put_str(failures ? "FAILED: " : "passed: ");
    put_u(failures);
    put_str(" outputs out of tolerance");
    flush();
    board_exit(failures > 255u ? 255 : (int)failures);
}
