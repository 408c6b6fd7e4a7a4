/*
 * colibri_kernels_x86 [TRIALS [SEED]]
 *
 * Every kernel of the build's optimised table (colibri_kernels_optimised: the
 * x86-64 backend on this host) against its reference kernel, on random shapes
 * with odd sizes and tails, n = 1..9 tokens with and without the rows index
 * list, linear and linear_acc, bias or none, gate scales or none, and inputs
 * with NaN, ±inf, 1e38 and subnormals (sprinkled, or every value); int8
 * weights in both Q8_PARAMS layouts (v1; v2 with f16 or f32 scales, a
 * companion bias or none, 1-, 2- or 4-byte row pointers). The tolerances checked are the ones
 * docs/model-format.md "Numerics" states:
 *
 * - linear, linear_acc (f32, f16, and int8 weights with f32 activations):
 *   |y - y_ref| <= (in + 16) · (2^-23 · (Σ_k |w_ok x_k| + |b_o|) · max(1, |s|)
 *                             + 2^-149) + 2^-23 · |y_ref|
 *   with w the weights as the kernel reads them (I8: |Q_ok| s_o, plus the
 *   |e| |x| of the compensation entries); the same non-finite values where
 *   the reference has one (NaN where it has NaN, the same infinity).
 * - int8 weights with int8 activations, quantize_rows, activation, mul,
 *   add: bit for bit (a NaN where the reference has a NaN).
 *
 * Every level of the x86-64 backend this CPU has is tested (AVX2+FMA+F16C,
 * AVX-512F, AVX-512 VNNI), then the table colibri_init picks. When that
 * is the reference (a CPU without AVX2/FMA/F16C, or another backend's build)
 * it says so and checks the table against itself.
 * Prints "kernels ok" and exits 0 when every check passes.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri_kernels.h"
#include "colibri_format.h"
#include "colibri_rng.h"
#include "colibri_changed_tables.h"
#include "kernels/colibri_backend.h"

#define MAX_IN 300
#define MAX_OUT 40
#define MAX_N 9
#define MAX_NNZ 64

static uint64_t rng_state = 0x9E3779B97F4A7C15u;
static long failures, checks, differing;
static double worst; /* the largest |y - y_ref| / tolerance seen */

static uint32_t rnd(void)
{
    return (uint32_t)(colibri_xorshift64(&rng_state) >> 16);
}

static size_t rnd_below(size_t n) { return n ? rnd() % n : 0; }

static float uniform(float lo, float hi)
{
    return lo + (hi - lo) * (float)(rnd() & 0xFFFFFF) / (float)0x1000000;
}

/* One value of a row of activations; special (0: no specials, else the kind
 * of value sprinkled in: 1 NaN, 2 inf, 3 1e38, 4 subnormals; 5: every value
 * subnormal). */
static float activation_value(int special)
{
    if (special == 5)
        return uniform(-1.0f, 1.0f) * 1e-39f;
    if (special && rnd_below(23) == 0) {
        switch (special) {
        case 1:
            return NAN;
        case 2:
            return rnd() & 1 ? INFINITY : -INFINITY;
        case 3:
            return rnd() & 1 ? 1e38f : -1e38f;
        default:
            return uniform(-1.0f, 1.0f) * 1e-40f;
        }
    }
    return uniform(-2.0f, 2.0f);
}

static uint16_t f16_bits(void)
{
    const uint32_t sign = (rnd() & 1u) << 15;
    const uint32_t exp = rnd_below(8) == 0 ? 0 : 8 + (uint32_t)rnd_below(8); /* subnormals, |w| < 2 */
    return (uint16_t)(sign | exp << 10 | (rnd() & 0x3FFu));
}

/* A random matrix of dtype (and, for I8, scales and compensation entries).
 * The I8 metadata is built in the fields colibri_kernels.h declares. */
typedef struct matrix_store {
    float f32[MAX_OUT * MAX_IN];
    uint16_t f16[MAX_OUT * MAX_IN];
    int8_t i8[MAX_OUT * MAX_IN];
    float scale[2 * MAX_OUT];      /* f32 scales, then the companion bias if any */
    uint16_t scale16[2 * MAX_OUT]; /* the same as f16 bits (format v2) */
    uint32_t row_ptr[MAX_OUT + 1];
    uint16_t row_ptr16[MAX_OUT + 1];
    uint8_t row_ptr8[MAX_OUT + 1];
    uint16_t col[MAX_NNZ], val[MAX_NNZ];
} matrix_store;

/* A normal f16 of magnitude in [2^lo, 2^(hi+1)), random sign if sign. */
static uint16_t f16_normal(int lo, int hi, int sign)
{
    const uint32_t exp = (uint32_t)(15 + lo + (int)rnd_below((size_t)(hi - lo + 1)));
    return (uint16_t)((sign ? (rnd() & 1u) << 15 : 0u) | exp << 10 | (rnd() & 0x3FFu));
}

/* I8 matrices come in both Q8_PARAMS layouts (docs/model-format.md
 * "Quantised weights"): format v1 (f32 scales, 32-bit row pointers) and v2
 * (f32 or f16 scales, a companion bias or none, row pointers of 1, 2 or 4
 * bytes, none without E). *companion: whether it holds a bias (the layer's
 * own bias is then NONE: the kernels get b = NULL). */
static void make_matrix(colibri_matrix *w, matrix_store *s, uint8_t dtype, size_t out, size_t in, int *companion)
{
    memset(w, 0, sizeof *w);
    *companion = 0;
    w->dtype = dtype;
    w->rows = (uint32_t)out;
    w->cols = (uint32_t)in;
    for (size_t i = 0; i < out * in; i++) {
        s->f32[i] = uniform(-1.0f, 1.0f);
        s->f16[i] = f16_bits();
        s->i8[i] = (int8_t)(int)(rnd() % 256u - 128u);
    }
    if (dtype == COLIBRI_DTYPE_F32) {
        w->data = s->f32;
    } else if (dtype == COLIBRI_DTYPE_F16) {
        w->data = s->f16;
    } else {
        w->data = s->i8;
        const int with_e = rnd() & 1, v2 = rnd() & 1;
        uint32_t nnz = 0;
        for (size_t o = 0; o < out; o++) {
            s->scale16[o] = f16_normal(-10, -6, 0);
            s->scale[o] = uniform(0.001f, 0.02f);
            s->row_ptr[o] = nnz;
            if (with_e)
                for (int e = (int)rnd_below(3); e > 0 && nnz < MAX_NNZ; e--) {
                    s->col[nnz] = (uint16_t)rnd_below(in);
                    s->val[nnz++] = f16_bits();
                }
        }
        s->row_ptr[out] = nnz;
        for (size_t o = 0; o <= out; o++) {
            s->row_ptr16[o] = (uint16_t)s->row_ptr[o];
            s->row_ptr8[o] = (uint8_t)s->row_ptr[o];
        }
        w->q8_nnz = nnz;
        w->q8_ptr = nnz ? 4 : 0; /* format v1's Q8_PARAMS view: f32 scales, 32-bit row pointers */
        w->row_ptr = nnz ? s->row_ptr : NULL;
        w->col = nnz ? s->col : NULL;
        w->val = nnz ? s->val : NULL;
        w->scale = s->scale;
        if (v2) {
            w->q8_f16 = (uint8_t)(rnd() & 1);
            w->q8_bias = (uint8_t)(rnd() & 1);
            *companion = w->q8_bias;
            for (size_t o = 0; o < out; o++) {
                s->scale16[out + o] = rnd_below(8) == 0 ? (uint16_t)((rnd() & 1u) << 15) : f16_normal(-4, 0, 1);
                s->scale[out + o] = uniform(-1.0f, 1.0f);
            }
            if (w->q8_f16)
                w->scale = s->scale16;
            const int width = rnd_below(3) == 0 ? 4 : nnz <= 255 && rnd() & 1 ? 1 : 2;
            w->q8_ptr = nnz ? (uint8_t)width : 0;
            if (nnz && width == 1)
                w->row_ptr = s->row_ptr8;
            else if (nnz && width == 2)
                w->row_ptr = s->row_ptr16;
        }
    }
}

static float weight(const colibri_matrix *w, size_t o, size_t k)
{
    const size_t i = o * w->cols + k;
    if (w->dtype == COLIBRI_DTYPE_F16)
        return colibri_f16_to_f32(((const uint16_t *)w->data)[i]);
    if (w->dtype == COLIBRI_DTYPE_I8)
        return (float)((const int8_t *)w->data)[i] * colibri_q8_scale(w, o);
    return ((const float *)w->data)[i];
}

/* Σ_k |w_ok x_k| (+ |E| |x| and the companion bias for I8), in double. */
static double magnitude(const colibri_matrix *w, size_t o, const float *x)
{
    double m = 0.0;
    for (size_t k = 0; k < w->cols; k++)
        m += fabs((double)weight(w, o, k) * (double)x[k]);
    if (w->dtype == COLIBRI_DTYPE_I8) {
        uint32_t e, end;
        colibri_q8_terms(w, o, &e, &end);
        for (; e < end; e++)
            m += fabs((double)colibri_f16_to_f32(colibri_q8_term_bits(w, e)) * (double)x[colibri_q8_term_col(w, e)]);
        const colibri_q8_block p = colibri_q8_params_at(w, o);
        if (p.bias_f16)
            m += fabs((double)colibri_f16_to_f32(p.bias_f16[0]));
        else if (p.bias_f32)
            m += fabs((double)p.bias_f32[0]);
    }
    return m;
}

static int same_bits_or_nan(float a, float b)
{
    return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0;
}

static void fail(const char *what, size_t at, float got, float want, double tol)
{
    failures++;
    if (failures <= 20)
        printf("FAIL %s at %zu: got %.9g want %.9g (tolerance %.3g)\n", what, at, (double)got, (double)want, tol);
}

/* got against want with the linear tolerance (tol < 0: exact). */
static void check_value(const char *what, size_t at, float got, float want, double tol)
{
    checks++;
    if (tol < 0.0 || !isfinite(want)) {
        if (!same_bits_or_nan(got, want))
            fail(what, at, got, want, tol);
        return;
    }
    const double d = fabs((double)got - (double)want);
    differing += d != 0.0;
    if (tol > 0.0 && d / tol > worst)
        worst = d / tol;
    if (!isfinite(got) || d > tol)
        fail(what, at, got, want, tol);
}

static void test_linear(const colibri_kernels *opt, const colibri_kernels *ref, int trial)
{
    static matrix_store ms;
    static float x[MAX_N * MAX_IN], b[MAX_OUT], scale[MAX_N];
    static float y_ref[MAX_N * MAX_OUT], y_opt[MAX_N * MAX_OUT], y0[MAX_N * MAX_OUT];
    static int8_t q[MAX_N * MAX_IN];
    static float qa[MAX_N];
    static uint16_t rows[MAX_N];
    static const size_t common_in[] = {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 256, 257, 300};
    static const uint8_t dtypes[] = {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_I8};

    const uint8_t dtype = dtypes[trial % 3];
    const int int8_act = dtype == COLIBRI_DTYPE_I8 && (trial / 3) % 2;
    const size_t in = rnd() & 1 ? common_in[rnd_below(sizeof common_in / sizeof *common_in)] : 1 + rnd_below(MAX_IN);
    const size_t out = 1 + rnd_below(MAX_OUT);
    const size_t n = 1 + (size_t)(trial / 6) % MAX_N;
    const int use_rows = rnd() & 1, use_scale = rnd() & 1, acc = rnd() & 1;
    int use_bias = rnd() & 1, companion;
    const int special = (int)rnd_below(6);
    const size_t xrows = MAX_N; /* the x rows the index list picks from */

    colibri_matrix w;
    make_matrix(&w, &ms, dtype, out, in, &companion);
    if (companion) /* the bias is the Q8_PARAMS companion's: the layer has none */
        use_bias = 0;
    for (size_t i = 0; i < xrows * in; i++)
        x[i] = activation_value(special == 3 ? 0 : special);
    if (special == 3) /* one ±1e38 per row: large, but no sum can overflow */
        for (size_t r = 0; r < xrows; r++)
            x[r * in + rnd_below(in)] = rnd() & 1 ? 1e38f : -1e38f;
    for (size_t o = 0; o < out; o++)
        b[o] = uniform(-1.0f, 1.0f);
    for (size_t i = 0; i < n; i++) {
        rows[i] = (uint16_t)rnd_below(xrows);
        scale[i] = uniform(-1.5f, 1.5f);
    }
    if (acc && use_rows) /* an expert's ring: distinct tokens */
        for (size_t i = 0; i < n; i++)
            rows[i] = (uint16_t)((rows[0] + i) % xrows);
    for (size_t i = 0; i < MAX_N * out; i++)
        y0[i] = uniform(-1.0f, 1.0f);

    /* The rows each token reads and writes (as the kernels index them). */
    const uint16_t *rl = use_rows ? rows : NULL;
    colibri_qrows xq = {q, qa};
    if (int8_act) {
        if (acc)
            ref->quantize_rows(x, NULL, n, in, q, qa);
        else
            ref->quantize_rows(x, rl, n, in, q, qa);
    }
    memcpy(y_ref, y0, sizeof y0);
    memcpy(y_opt, y0, sizeof y0);
    const float *bias = use_bias ? b : NULL;
    const float *sc = use_scale ? scale : NULL;
    if (acc) {
        ref->linear_acc(x, n, &w, bias, rl, sc, int8_act ? &xq : NULL, y_ref);
        opt->linear_acc(x, n, &w, bias, rl, sc, int8_act ? &xq : NULL, y_opt);
    } else {
        ref->linear(x, rl, n, &w, bias, int8_act ? &xq : NULL, y_ref);
        opt->linear(x, rl, n, &w, bias, int8_act ? &xq : NULL, y_opt);
    }

    char what[160];
    snprintf(what, sizeof what, "%s dtype %u%s q8 f16 %u bias %u ptr %u in %zu out %zu n %zu rows %d bias %d scale %d special %d",
             acc ? "linear_acc" : "linear", dtype, int8_act ? " int8-act" : "", w.q8_f16, w.q8_bias, w.q8_ptr, in, out,
             n, use_rows, use_bias, use_scale, special);
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + (acc ? i : (rl ? rl[i] : i)) * in;
        const size_t yr = acc ? (rl ? rl[i] : i) : i;
        const double s = acc ? fabs(sc ? (double)sc[i] : 1.0) : 1.0;
        for (size_t o = 0; o < out; o++) {
            const size_t at = yr * out + o;
            double tol = -1.0; /* int8 x int8: exact */
            if (!int8_act)
                tol = (double)(in + 16) *
                          (0x1p-23 * (magnitude(&w, o, xi) + (bias ? fabs((double)bias[o]) : 0.0)) *
                               (s > 1.0 ? s : 1.0) +
                           0x1p-149) +
                      0x1p-23 * fabs((double)y_ref[at]);
            check_value(what, at, y_opt[at], y_ref[at], tol);
        }
    }
    /* Rows no token writes stay untouched. */
    for (size_t r = 0; r < MAX_N; r++) {
        int written = 0;
        for (size_t i = 0; i < n; i++)
            written |= (acc && rl ? rl[i] : i) == r;
        for (size_t o = 0; !written && o < out; o++)
            check_value("untouched row", r * out + o, y_opt[r * out + o], y0[r * out + o], -1.0);
    }
}

static void test_elementwise(const colibri_kernels *opt, const colibri_kernels *ref, int trial)
{
    static float a_ref[1100], a_opt[1100], other[1100], big[MAX_N * 1100];
    static int8_t q_ref[MAX_N * 1100], q_opt[MAX_N * 1100];
    static float s_ref[MAX_N], s_opt[MAX_N];
    static uint16_t rows[MAX_N];
    static const uint32_t kinds[] = {COLIBRI_ACT_RELU, COLIBRI_ACT_GELU_ERF, COLIBRI_ACT_GELU_TANH,
                                     COLIBRI_ACT_SILU, COLIBRI_ACT_TANH, COLIBRI_ACT_SIGMOID};
    const size_t n = 1 + rnd_below(1099);
    const int special = (int)rnd_below(5);
    const float range = rnd() & 1 ? 4.0f : 120.0f;

    for (size_t i = 0; i < n; i++) {
        a_ref[i] = special ? activation_value(special) : uniform(-range, range);
        other[i] = activation_value(special);
    }
    if (trial == 0) { /* every edge of exp's range */
        static const float edges[] = {88.72283172607421875f, 88.7228393554688f, -103.972076416015625f,
                                      -103.97206115722656f, -87.3f, 87.3f, 0.0f, -0.0f, 1e-45f, -1e-45f,
                                      INFINITY, -INFINITY, NAN, 0.5f, -0.5f, 9.1f, -9.1f, 4.0f, -4.0f};
        for (size_t i = 0; i < sizeof edges / sizeof *edges && i < n; i++)
            a_ref[i] = edges[i];
    }
    if (trial % 50 == 1) { /* a sweep over every branch of tanh and erf, and around their edges */
        static const float edges[] = {0.55f, 1.0f, 2.5f, 4.0f, 9.1f};
        for (size_t i = 0; i < n; i++)
            a_ref[i] = -12.0f + 24.0f * (float)i / (float)n;
        for (size_t e = 0; e < 5 && 8 * e + 8 <= n; e++)
            for (size_t j = 0; j < 8; j++) {
                float v = j & 4 ? edges[e] * 1.41421356f : edges[e]; /* GELU (erf) scales by 1/sqrt 2 */
                v = j & 1 ? nextafterf(v, 0.0f) : v;
                a_ref[8 * e + j] = j & 2 ? -v : v;
            }
    }
    char what[64];
    for (size_t kk = 0; kk < sizeof kinds / sizeof *kinds; kk++) {
        memcpy(a_opt, a_ref, n * sizeof *a_ref);
        float *want = big; /* the reference's results */
        memcpy(want, a_ref, n * sizeof *a_ref);
        ref->activation(want, n, kinds[kk]);
        opt->activation(a_opt, n, kinds[kk]);
        snprintf(what, sizeof what, "activation %u n %zu", kinds[kk], n);
        for (size_t i = 0; i < n; i++)
            check_value(what, i, a_opt[i], want[i], -1.0);
    }
    for (int op = 0; op < 2; op++) {
        memcpy(a_opt, a_ref, n * sizeof *a_ref);
        memcpy(big, a_ref, n * sizeof *a_ref);
        (op ? ref->add : ref->mul)(big, other, n);
        (op ? opt->add : opt->mul)(a_opt, other, n);
        for (size_t i = 0; i < n; i++)
            check_value(op ? "add" : "mul", i, a_opt[i], big[i], -1.0);
    }

    /* quantize_rows: rows of width `in` out of MAX_N rows of x. */
    const size_t in = 1 + rnd_below(1099), nq = 1 + rnd_below(MAX_N);
    const int use_rows = rnd() & 1;
    const float mag = rnd_below(4) == 0 ? 1e-33f : rnd_below(4) == 0 ? 1e37f : 1.0f;
    for (size_t i = 0; i < MAX_N * in; i++)
        big[i] = rnd_below(50) == 0 ? 0.0f : activation_value(special) * mag;
    if (rnd_below(5) == 0) /* an all-zero row */
        memset(big, 0, in * sizeof *big);
    if (rnd_below(5) == 0) /* a row of halves: ties round away from zero */
        for (size_t k = 0; k < in; k++)
            big[k] = (float)((int)rnd_below(255) - 127) * 0.5f;
    for (size_t i = 0; i < nq; i++)
        rows[i] = (uint16_t)rnd_below(MAX_N);
    ref->quantize_rows(big, use_rows ? rows : NULL, nq, in, q_ref, s_ref);
    opt->quantize_rows(big, use_rows ? rows : NULL, nq, in, q_opt, s_opt);
    for (size_t i = 0; i < nq; i++) {
        check_value("quantize_rows scale", i, s_opt[i], s_ref[i], -1.0);
        for (size_t k = 0; k < in; k++) {
            checks++;
            if (q_opt[i * in + k] != q_ref[i * in + k])
                fail("quantize_rows q", i * in + k, q_opt[i * in + k], q_ref[i * in + k], -1.0);
        }
    }
}

/* ---- attend: one head over the KV cache ----
 *
 * Random hd (odd ones too), len 1..MAX_LEN, a row stride wider than hd
 * (other heads beside it), f32 or f16 cache; a NaN fills every value the
 * kernel must not read (the rest of the stride, the positions from len on:
 * docs/lm.md's causal rule), so a read of one shows as a NaN output. Score
 * ranges from flat to peaked (exponents down to the subnormal and zero range
 * of exp); some trials sprinkle NaN or ±inf into q, k or v. Tolerance per
 * output j, with u = 2^-23, S = max_t scale · Σ_i |q_i k_ti| (finite ones) and
 * V_j = Σ_t p_t |v_tj| (p the reference's probabilities):
 *   |out_j - ref_j| <= 4u · V_j · ((hd + 4) · S + len + 16) + 2^-140
 * (each score moves by at most (hd + 2)u·S, each probability by twice that
 * plus the exp's and the sum's roundings relative to it, the weighted sum
 * by (len + 2)u·V_j); non-finite outputs where the reference has them. */
#define MAX_HD 200
#define MAX_LEN 150

static float cache_value(const void *c, size_t i, int f16)
{
    return f16 ? colibri_f16_to_f32(((const uint16_t *)c)[i]) : ((const float *)c)[i];
}

static void test_attend(const colibri_kernels *opt, const colibri_kernels *ref, int trial)
{
    static float kf[(MAX_LEN + 2) * (MAX_HD + 16)], vf[(MAX_LEN + 2) * (MAX_HD + 16)];
    static uint16_t kh[(MAX_LEN + 2) * (MAX_HD + 16)], vh[(MAX_LEN + 2) * (MAX_HD + 16)];
    static float q[MAX_HD], out_ref[MAX_HD], out_opt[MAX_HD], sc_ref[MAX_LEN], sc_opt[MAX_LEN];
    const size_t hd = trial % 5 == 0 ? 1 + rnd_below(MAX_HD) : 8 * (1 + rnd_below(MAX_HD / 8));
    const size_t stride = hd + (rnd() & 1 ? 0 : 1 + rnd_below(16));
    const size_t len = trial % 3 == 0 ? 1 + rnd_below(9) : 1 + rnd_below(MAX_LEN);
    const int f16 = (int)(rnd() & 1);
    const int special = rnd_below(4) == 0 ? 1 + (int)rnd_below(2) : 0; /* NaN or inf sprinkled */
    const float spread = (float[]){0.1f, 1.0f, 4.0f, 12.0f}[rnd_below(4)]; /* how peaked the scores are */
    const float scale = 1.0f / sqrtf((float)hd);

    for (size_t i = 0; i < hd; i++)
        q[i] = special && rnd_below(40) == 0 ? activation_value(special) : uniform(-spread, spread);
    for (size_t t = 0; t < len + 2; t++)
        for (size_t i = 0; i < stride; i++) {
            const size_t at = t * stride + i;
            float kv = uniform(-spread, spread), vv = uniform(-2.0f, 2.0f);
            if (special && rnd_below(60) == 0)
                kv = activation_value(special);
            if (special && rnd_below(60) == 0)
                vv = activation_value(special);
            if (t >= len || i >= hd)
                kv = vv = NAN; /* never read */
            kf[at] = kv, vf[at] = vv;
            kh[at] = colibri_f32_to_f16(kv), vh[at] = colibri_f32_to_f16(vv);
        }
    const void *k = f16 ? (const void *)kh : (const void *)kf, *v = f16 ? (const void *)vh : (const void *)vf;
    ref->attend(q, k, v, stride, len, hd, f16, scale, sc_ref, out_ref);
    opt->attend(q, k, v, stride, len, hd, f16, scale, sc_opt, out_opt);

    double S = 0.0;
    for (size_t t = 0; t < len; t++) {
        double m = 0.0;
        for (size_t i = 0; i < hd; i++)
            m += fabs((double)q[i] * cache_value(k, t * stride + i, f16));
        if (isfinite(m) && m * scale > S) /* an infinite score is -inf (p_t = 0 on both sides) or NaN everywhere */
            S = m * scale;
    }
    for (size_t j = 0; j < hd; j++) {
        double V = 0.0;
        for (size_t t = 0; t < len; t++)
            V += fabs((double)sc_ref[t] * cache_value(v, t * stride + j, f16));
        const double tol = 4.0 * 0x1p-23 * V * ((double)(hd + 4) * S + (double)len + 16.0) + 0x1p-140;
        check_value(f16 ? "attend f16" : "attend f32", j, out_opt[j], out_ref[j], isfinite(tol) ? tol : 0.0);
    }
}

/* ---- E's tables changed after validation (colibri_changed_tables.h) ----
 *
 * 1 to 9 tokens (every row block shape), f32 and int8 activations, linear
 * and linear_acc, every pointer width, fewer and more than eight entries:
 * the kernels tested and the reference must give finite numbers (wrong ones
 * allowed) and never read outside the tables, x or the row pointers. x
 * lives in a heap block of its exact size plus NaN padding after the last
 * row; linear reads that row for half the cases. */
static long table_cases;

static void changed_tables(const colibri_kernels *k, int trial)
{
    static matrix_store ms;
    const size_t in = 1 + rnd_below(MAX_IN), out = 1 + rnd_below(MAX_OUT), n = 1 + (size_t)trial % MAX_N;
    const int int8_act = (trial / MAX_N) % 2, acc = (trial / (2 * MAX_N)) % 2, last_row = (int)(rnd() & 1);
    colibri_matrix w;
    int companion;
    do
        make_matrix(&w, &ms, COLIBRI_DTYPE_I8, out, in, &companion);
    while (w.q8_nnz == 0);
    colibri_changed changed = colibri_change_tables(&w, &rng_state);

    const size_t xrows = MAX_N;
    float *x = colibri_alloc_exact((xrows * in + COLIBRI_TABLE_PAD) * sizeof *x);
    for (size_t i = 0; i < xrows * in + COLIBRI_TABLE_PAD; i++)
        x[i] = i < xrows * in ? uniform(-1.0f, 1.0f) : NAN;
    uint16_t rows[MAX_N];
    for (size_t i = 0; i < n; i++) /* linear: the last x row (NaN after it) or any; linear_acc: y rows */
        rows[i] = (uint16_t)(acc ? (i + 2) % xrows : last_row ? xrows - 1 : rnd_below(xrows));
    int8_t *q = colibri_alloc_exact(n * in);
    float qa[MAX_N], gate[MAX_N], y[MAX_N * MAX_OUT];
    for (size_t i = 0; i < n; i++)
        gate[i] = 0.5f;
    colibri_qrows xq = {q, qa};
    if (int8_act)
        colibri_quantize_rows_ref(x, acc ? NULL : rows, n, in, q, qa);
    colibri_kernels ref;
    colibri_kernels_reference(&ref);
    for (int impl = 0; impl < 2; impl++) { /* the kernels tested, then the reference */
        const colibri_kernels *t = impl ? &ref : k;
        memset(y, 0, sizeof y);
        if (acc)
            t->linear_acc(x, n, &w, NULL, rows, gate, int8_act ? &xq : NULL, y);
        else
            t->linear(x, rows, n, &w, NULL, int8_act ? &xq : NULL, y);
        for (size_t i = 0; i < MAX_N * out; i++) {
            checks++;
            if (isnan(y[i])) {
                failures++;
                if (failures <= 20)
                    printf("FAIL %s: a read outside E's tables or x (ptr %u, nnz %u, in %zu, out %zu, n %zu, %s%s) "
                           "at %zu\n",
                           t->name, w.q8_ptr, w.q8_nnz, in, out, n, acc ? "linear_acc" : "linear",
                           int8_act ? ", int8-act" : "", i);
            }
        }
    }
    table_cases++;
    colibri_changed_free(&changed);
    free(x);
    free(q);
}

/* One token through an f32 and an f16 matrix of 512 K weights or more, which the x86 driver reads row
 * after row (colibri_kernels_x86.c, streamed()): each output against the reference's within the
 * tolerance, and bit for bit what the first rows give as a matrix of their own (fewer weights: rows
 * side by side). */
static void test_streamed(const colibri_kernels *opt, const colibri_kernels *ref)
{
    static const struct {
        uint8_t dtype;
        size_t out, in;
    } shapes[] = {{COLIBRI_DTYPE_F32, 2053, 257}, {COLIBRI_DTYPE_F16, 2053, 257}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const size_t out = shapes[s].out, in = shapes[s].in, esize = shapes[s].dtype == COLIBRI_DTYPE_F32 ? 4 : 2;
        void *data = malloc(out * in * esize);
        float *x = malloc(in * sizeof *x), *y = malloc(out * sizeof *y), *y_ref = malloc(out * sizeof *y_ref);
        float *y_head = malloc(16 * sizeof *y_head);
        if (!data || !x || !y || !y_ref || !y_head) {
            fprintf(stderr, "out of memory\n");
            exit(2);
        }
        for (size_t i = 0; i < out * in; i++) {
            if (esize == 4)
                ((float *)data)[i] = uniform(-1.0f, 1.0f);
            else
                ((uint16_t *)data)[i] = f16_normal(-8, 1, (int)(rnd() & 1));
        }
        for (size_t k = 0; k < in; k++)
            x[k] = uniform(-1.0f, 1.0f);
        colibri_matrix w;
        memset(&w, 0, sizeof w);
        w.dtype = shapes[s].dtype;
        w.rows = (uint32_t)out;
        w.cols = (uint32_t)in;
        w.data = data;
        opt->linear(x, NULL, 1, &w, NULL, NULL, y);
        ref->linear(x, NULL, 1, &w, NULL, NULL, y_ref);
        for (size_t o = 0; o < out; o++)
            check_value("streamed linear", o, y[o], y_ref[o],
                        (double)(in + 16) * (0x1p-23 * magnitude(&w, o, x) + 0x1p-149) + 0x1p-23 * fabs((double)y_ref[o]));
        w.rows = 16;
        opt->linear(x, NULL, 1, &w, NULL, NULL, y_head);
        for (size_t o = 0; o < 16; o++) {
            checks++;
            if (!same_bits_or_nan(y[o], y_head[o]))
                fail("streamed linear vs the same rows side by side", o, y[o], y_head[o], 0.0);
        }
        free(data), free(x), free(y), free(y_ref), free(y_head);
    }
}

static void test_table(const colibri_kernels *opt, const colibri_kernels *ref, int trials)
{
    const long before = failures, cases = table_cases;
    printf("kernels: %s\n", opt->name);
    for (int t = 0; t < trials; t++)
        test_linear(opt, ref, t);
    test_streamed(opt, ref);
    for (int t = 0; t < trials / 10 + 1; t++)
        test_elementwise(opt, ref, t);
    for (int t = 0; t < trials / 4 + 1; t++)
        test_attend(opt, ref, t);
    const long table_before = failures;
    for (int t = 0; t < trials / 4 + 4 * MAX_N; t++)
        changed_tables(opt, t);
    printf("  %ld failures\n", failures - before);
    printf("  changed tables: %ld cases, %ld reads outside\n", table_cases - cases, failures - table_before);
}

int main(int argc, char **argv)
{
    const int trials = argc > 1 ? atoi(argv[1]) : 3000;
    if (argc > 2)
        rng_state ^= strtoull(argv[2], NULL, 0) * 0x2545F4914F6CDD1Du;
    colibri_kernels opt, ref;
    colibri_kernels_reference(&ref);
#if defined(COLIBRI_BACKEND_X86)
    for (int level = 1; level <= 3; level++) {
        colibri_kernels_reference(&opt);
        colibri_kernels_x86_level(&opt, level);
        if (strcmp(opt.name, "reference") != 0 &&
            (level == 1 || (level == 2 && strstr(opt.name, "avx512")) || strstr(opt.name, "vnni")))
            test_table(&opt, &ref, trials);
    }
#endif
    colibri_kernels_optimised(&opt);
    printf("optimised kernels: %s\n", opt.name);
    if (strcmp(opt.name, "reference") == 0)
        printf("no optimised backend on this build or CPU: checking the reference against itself\n");
    test_table(&opt, &ref, trials);

    printf("%ld checks, %ld failures; %ld linear outputs differ from the reference, the largest by %.3g of "
           "the tolerance\n", checks, failures, differing, worst);
    if (failures)
        return 1;
    printf("kernels ok\n");
    return 0;
}
