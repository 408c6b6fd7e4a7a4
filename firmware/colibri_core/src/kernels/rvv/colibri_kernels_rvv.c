/*
 * Optimised backend: the RISC-V Vector extension, RVV 1.0 (-march=rv64gcv),
 * written with the standard __riscv_ intrinsics and vector-length agnostic:
 * every loop asks vsetvl how many elements it gets, so one binary runs on
 * any VLEN (tested under qemu-riscv64 at 128 and 256 bits) and the last,
 * shorter chunk of a row is one more trip through the same loop instead of a
 * scalar tail. Compiled to nothing unless colibri_backend.h selects it.
 *
 * Linear kernels: tokens go in pairs and outputs in tiles of 4, so each
 * weight vector loaded serves both tokens and each activation vector the 4
 * outputs; the 8 accumulators are e32 LMUL=2 register groups (16 of the 32
 * vector registers), added into with tail-undisturbed operations so a short
 * last chunk leaves the other lanes' partial sums alone, and summed at the
 * end of the row (vfredusum / vredsum).
 *
 *   f32 weights    vfmacc over VL lanes
 *   f16 weights    widened to f32 bit by bit in integer lanes (exact, as
 *                  colibri_f16_to_f32: normals and subnormals by a multiply
 *                  by 2^112, inf and NaN with their payload), then as f32;
 *                  rv64gcv has no half-precision vector arithmetic (Zvfh)
 *   int8, f32 act  sign-extended to int32 and converted to f32 (exact), then
 *                  as f32, times the row's scale, the compensation E, the bias
 *   int8, int8 act vwmul (int16 products, exact: |q · xq| <= 128²) and vwadd
 *                  into int32 lanes, reduced with vredsum: integer sums that
 *                  wrap modulo 2^32 like the reference's, so these outputs
 *                  are the reference's bits
 *   other dtypes   the reference kernels (colibri_linear_ref)
 *
 * Tolerance (tests/c/colibri_kernel_test.c): f32 sums in another order and
 * with FMA (the reordering bound, about in · 2^-24 · Σ|w·x|); NaN and ±inf
 * propagate as in the reference. The quantiser, mul, add, ReLU and the
 * int8 × int8 linear kernels are bit-exact, and so are SiLU and sigmoid (the
 * engine's exp in f64 lanes); the norms sum their statistics in VL lanes.
 * tanh and the GELUs stay the reference's.
 *
 * No vfcvt.rtz / vfncvt.rtz: QEMU 7.2 (Debian 12's qemu-user) aborts
 * translating them (decode_save_opc assertion, QEMU issue 1441); the
 * quantiser rounds with the dynamic rounding mode, round-to-nearest-even
 * (the C default, which the engine never changes), and fixes up ties.
 *
 * q8 metadata is read only through colibri_q8_scale / colibri_q8_compensate.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_RVV)

#include <float.h>
#include <math.h>
#include <riscv_vector.h>

#include "colibri_format.h"
#include "../../colibri_math.h"

#define RVV_INLINE static inline __attribute__((always_inline))

/* The up to 2 tokens of one block: activation rows (f32, and int8 with its
 * scale for int8 activations), output rows and gate scales. */
typedef struct rvv_tokens {
    const float *x[2];
    const int8_t *q[2];
    float a[2];
    float *y[2];
    float s[2];
} rvv_tokens;

/* ---- Weights of one chunk as f32 lanes, for each weight dtype ---- */

/* IEEE binary16 bits (zero-extended into 32-bit lanes) -> f32, exactly. The
 * half's sign, exponent and mantissa moved to their f32 places (<< 13) read
 * as an f32 that is the half's value times 2^-112, exactly, subnormals
 * included; multiplying by 2^112 restores it. Exponent 31 (inf, NaN) gets
 * the f32's all-ones exponent instead, keeping the NaN payload. */
RVV_INLINE vfloat32m2_t rvv_f16_to_f32(vuint32m2_t h, size_t vl)
{
    const vuint32m2_t sign = __riscv_vsll_vx_u32m2(__riscv_vand_vx_u32m2(h, 0x8000u, vl), 16, vl);
    const vuint32m2_t em = __riscv_vsll_vx_u32m2(__riscv_vand_vx_u32m2(h, 0x7FFFu, vl), 13, vl);
    const vuint32m2_t bits = __riscv_vor_vv_u32m2(sign, em, vl);
    const vbool16_t special = __riscv_vmsgeu_vx_u32m2_b16(em, 0x1Fu << 23, vl);
    const vfloat32m2_t finite = __riscv_vfmul_vf_f32m2(__riscv_vreinterpret_v_u32m2_f32m2(bits), 0x1p112f, vl);
    const vuint32m2_t infnan = __riscv_vor_vx_u32m2(bits, 0x70000000u, vl);
    return __riscv_vmerge_vvm_f32m2(finite, __riscv_vreinterpret_v_u32m2_f32m2(infnan), special, vl);
}

/* Weights [k, k + vl) of a row as f32; dtype is a constant at every call. */
RVV_INLINE vfloat32m2_t rvv_load_w(const void *row, size_t k, size_t vl, uint8_t dtype)
{
    switch (dtype) {
    case COLIBRI_DTYPE_F16:
        return rvv_f16_to_f32(__riscv_vzext_vf2_u32m2(__riscv_vle16_v_u16m1((const uint16_t *)row + k, vl), vl), vl);
    case COLIBRI_DTYPE_I8: /* int8 -> int32 -> f32, exact for |q| <= 128 */
        return __riscv_vfcvt_f_x_v_f32m2(__riscv_vsext_vf4_i32m2(__riscv_vle8_v_i8mf2((const int8_t *)row + k, vl), vl),
                                         vl);
    default:
        return __riscv_vle32_v_f32m2((const float *)row + k, vl);
    }
}

RVV_INLINE float rvv_sum_f32(vfloat32m2_t acc, size_t vlmax)
{
    return __riscv_vfmv_f_s_f32m1_f32(__riscv_vfredusum_vs_f32m2_f32m1(acc, __riscv_vfmv_s_f_f32m1(0.0f, 1), vlmax));
}

RVV_INLINE int32_t rvv_sum_i32(vint32m2_t acc, size_t vlmax)
{
    return __riscv_vmv_x_s_i32m1_i32(__riscv_vredsum_vs_i32m2_i32m1(acc, __riscv_vmv_s_x_i32m1(0, 1), vlmax));
}

/* acc + w · x; tail-undisturbed only on a row's last, partial chunk: the
 * full chunks before it have no tail, and one policy throughout their loop
 * spares a vsetvli per policy switch. */
RVV_INLINE vfloat32m2_t rvv_fma(vfloat32m2_t acc, vfloat32m2_t w, vfloat32m2_t x, size_t vl, int tail)
{
    return tail ? __riscv_vfmacc_vv_f32m2_tu(acc, w, x, vl) : __riscv_vfmacc_vv_f32m2(acc, w, x, vl);
}

/* acc + w · x over int8 lanes: int16 products (vwmul, exact) added into
 * int32 lanes (vwadd.wv), wrapping like the reference. */
RVV_INLINE vint32m2_t rvv_mac_i8(vint32m2_t acc, vint8mf2_t w, vint8mf2_t x, size_t vl, int tail)
{
    const vint16m1_t p = __riscv_vwmul_vv_i16m1(w, x, vl);
    return tail ? __riscv_vwadd_wv_i32m2_tu(acc, acc, p, vl) : __riscv_vwadd_wv_i32m2(acc, p, vl);
}

/* One chunk [k, k + VL) of a tile's dot products, into the accumulators
 * aJT (output j < 4, token t < 2) of the enclosing tile function: a macro,
 * since RVV vector types can form neither arrays nor struct members. T, O
 * and dtype are constants at every use, so the unused accumulators and
 * branches compile away. */
#define RVV_CHUNK_F(VL, TAIL)                                                  \
    do {                                                                       \
        const size_t vl_ = (VL);                                               \
        const vfloat32m2_t x0 = __riscv_vle32_v_f32m2(x0p + k, vl_);           \
        const vfloat32m2_t x1 = T > 1 ? __riscv_vle32_v_f32m2(x1p + k, vl_) : x0; \
        vfloat32m2_t wv = rvv_load_w(w0, k, vl_, dtype);                       \
        a00 = rvv_fma(a00, wv, x0, vl_, TAIL);                                 \
        if (T > 1)                                                             \
            a01 = rvv_fma(a01, wv, x1, vl_, TAIL);                             \
        if (O > 1) {                                                           \
            wv = rvv_load_w(w0 + stride, k, vl_, dtype);                       \
            a10 = rvv_fma(a10, wv, x0, vl_, TAIL);                             \
            if (T > 1)                                                         \
                a11 = rvv_fma(a11, wv, x1, vl_, TAIL);                         \
            wv = rvv_load_w(w0 + 2 * stride, k, vl_, dtype);                   \
            a20 = rvv_fma(a20, wv, x0, vl_, TAIL);                             \
            if (T > 1)                                                         \
                a21 = rvv_fma(a21, wv, x1, vl_, TAIL);                         \
            wv = rvv_load_w(w0 + 3 * stride, k, vl_, dtype);                   \
            a30 = rvv_fma(a30, wv, x0, vl_, TAIL);                             \
            if (T > 1)                                                         \
                a31 = rvv_fma(a31, wv, x1, vl_, TAIL);                         \
        }                                                                      \
    } while (0)

#define RVV_CHUNK_I(VL, TAIL)                                                  \
    do {                                                                       \
        const size_t vl_ = (VL);                                               \
        const vint8mf2_t x0 = __riscv_vle8_v_i8mf2(x0p + k, vl_);              \
        const vint8mf2_t x1 = T > 1 ? __riscv_vle8_v_i8mf2(x1p + k, vl_) : x0; \
        vint8mf2_t wv = __riscv_vle8_v_i8mf2(w0 + k, vl_);                     \
        a00 = rvv_mac_i8(a00, wv, x0, vl_, TAIL);                              \
        if (T > 1)                                                             \
            a01 = rvv_mac_i8(a01, wv, x1, vl_, TAIL);                          \
        if (O > 1) {                                                           \
            wv = __riscv_vle8_v_i8mf2(w0 + in + k, vl_);                       \
            a10 = rvv_mac_i8(a10, wv, x0, vl_, TAIL);                          \
            if (T > 1)                                                         \
                a11 = rvv_mac_i8(a11, wv, x1, vl_, TAIL);                      \
            wv = __riscv_vle8_v_i8mf2(w0 + 2 * in + k, vl_);                   \
            a20 = rvv_mac_i8(a20, wv, x0, vl_, TAIL);                          \
            if (T > 1)                                                         \
                a21 = rvv_mac_i8(a21, wv, x1, vl_, TAIL);                      \
            wv = __riscv_vle8_v_i8mf2(w0 + 3 * in + k, vl_);                   \
            a30 = rvv_mac_i8(a30, wv, x0, vl_, TAIL);                          \
            if (T > 1)                                                         \
                a31 = rvv_mac_i8(a31, wv, x1, vl_, TAIL);                      \
        }                                                                      \
    } while (0)

/* ---- Tiles: dot products of O (1 or 4) weight rows from w with T (1 or 2)
 * tokens, into d[j * 2 + t]: full chunks of VLMAX lanes, then the partial
 * one (e32 LMUL=2 and e8 LMUL=1/2 have the same VLMAX). ---- */

RVV_INLINE void tile_f(const void *w, size_t in, uint8_t dtype, const rvv_tokens *tk, size_t T, size_t O, float *d)
{
    const size_t stride = in * (dtype == COLIBRI_DTYPE_F16 ? 2 : dtype == COLIBRI_DTYPE_I8 ? 1 : 4);
    const float *x0p = tk->x[0], *x1p = T > 1 ? tk->x[1] : tk->x[0];
    const size_t vlmax = __riscv_vsetvlmax_e32m2();
    const unsigned char *w0 = w;
    const vfloat32m2_t z = __riscv_vfmv_v_f_f32m2(0.0f, vlmax);
    vfloat32m2_t a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
    size_t k = 0;
    for (; k + vlmax <= in; k += vlmax)
        RVV_CHUNK_F(vlmax, 0);
    if (k < in)
        RVV_CHUNK_F(__riscv_vsetvl_e32m2(in - k), 1);
    d[0] = rvv_sum_f32(a00, vlmax);
    if (T > 1)
        d[1] = rvv_sum_f32(a01, vlmax);
    if (O > 1) {
        d[2] = rvv_sum_f32(a10, vlmax);
        d[4] = rvv_sum_f32(a20, vlmax);
        d[6] = rvv_sum_f32(a30, vlmax);
        if (T > 1) {
            d[3] = rvv_sum_f32(a11, vlmax);
            d[5] = rvv_sum_f32(a21, vlmax);
            d[7] = rvv_sum_f32(a31, vlmax);
        }
    }
}

RVV_INLINE void tile_q8q8(const int8_t *w, size_t in, const rvv_tokens *tk, size_t T, size_t O, int32_t *d)
{
    const int8_t *x0p = tk->q[0], *x1p = T > 1 ? tk->q[1] : tk->q[0];
    const size_t vlmax = __riscv_vsetvlmax_e32m2();
    const int8_t *w0 = w;
    const vint32m2_t z = __riscv_vmv_v_x_i32m2(0, vlmax);
    vint32m2_t a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
    size_t k = 0;
    for (; k + vlmax <= in; k += vlmax)
        RVV_CHUNK_I(vlmax, 0);
    if (k < in)
        RVV_CHUNK_I(__riscv_vsetvl_e32m2(in - k), 1);
    d[0] = rvv_sum_i32(a00, vlmax);
    if (T > 1)
        d[1] = rvv_sum_i32(a01, vlmax);
    if (O > 1) {
        d[2] = rvv_sum_i32(a10, vlmax);
        d[4] = rvv_sum_i32(a20, vlmax);
        d[6] = rvv_sum_i32(a30, vlmax);
        if (T > 1) {
            d[3] = rvv_sum_i32(a11, vlmax);
            d[5] = rvv_sum_i32(a21, vlmax);
            d[7] = rvv_sum_i32(a31, vlmax);
        }
    }
}

/* ---- Finishing outputs o .. o + O - 1 as the reference's colibri_emit ---- */

RVV_INLINE void emit_f(const colibri_matrix *w, const rvv_tokens *tk, size_t T, size_t O, size_t o, const float *d,
                       const float *b, int acc)
{
    for (size_t j = 0; j < O; j++)
        for (size_t t = 0; t < T; t++) {
            float v = d[j * 2 + t];
            if (w->dtype == COLIBRI_DTYPE_I8)
                v = colibri_q8_compensate(w, o + j, tk->x[t], v * colibri_q8_scale(w, o + j));
            colibri_emit(tk->y[t], o + j, v, b, acc, tk->s[t]);
        }
}

RVV_INLINE void emit_q8q8(const colibri_matrix *w, const rvv_tokens *tk, size_t T, size_t O, size_t o,
                          const int32_t *d, const float *b, int acc)
{
    for (size_t j = 0; j < O; j++)
        for (size_t t = 0; t < T; t++)
            colibri_emit(tk->y[t], o + j,
                         colibri_q8_compensate(w, o + j, tk->x[t],
                                               (float)d[j * 2 + t] * (colibri_q8_scale(w, o + j) * tk->a[t])),
                         b, acc, tk->s[t]);
}

/* ---- Row drivers: every output of one token block ---- */

RVV_INLINE void rows_f_t(const colibri_matrix *w, uint8_t dtype, const float *b, const rvv_tokens *tk, size_t T,
                         int acc)
{
    const size_t in = w->cols, out = w->rows;
    const size_t es = dtype == COLIBRI_DTYPE_F16 ? 2 : dtype == COLIBRI_DTYPE_I8 ? 1 : 4;
    const unsigned char *wd = w->data;
    float d[8];
    size_t o = 0;
    for (; o + 4 <= out; o += 4) {
        tile_f(wd + o * in * es, in, dtype, tk, T, 4, d);
        emit_f(w, tk, T, 4, o, d, b, acc);
    }
    for (; o < out; o++) {
        tile_f(wd + o * in * es, in, dtype, tk, T, 1, d);
        emit_f(w, tk, T, 1, o, d, b, acc);
    }
}

RVV_INLINE void rows_q8q8_t(const colibri_matrix *w, const float *b, const rvv_tokens *tk, size_t T, int acc)
{
    const size_t in = w->cols, out = w->rows;
    const int8_t *wd = w->data;
    int32_t d[8];
    size_t o = 0;
    for (; o + 4 <= out; o += 4) {
        tile_q8q8(wd + o * in, in, tk, T, 4, d);
        emit_q8q8(w, tk, T, 4, o, d, b, acc);
    }
    for (; o < out; o++) {
        tile_q8q8(wd + o * in, in, tk, T, 1, d);
        emit_q8q8(w, tk, T, 1, o, d, b, acc);
    }
}

/* One function per dtype and int8-activation path with T made a constant. */
#define RVV_ROWS(name, call)                                                                              \
    static void name(const colibri_matrix *w, const float *b, const rvv_tokens *tk, size_t T, int acc) \
    {                                                                                                     \
        if (T == 1)                                                                                       \
            call(1);                                                                                      \
        else                                                                                              \
            call(2);                                                                                      \
    }
#define RVV_CALL_F32(T_) rows_f_t(w, COLIBRI_DTYPE_F32, b, tk, T_, acc)
#define RVV_CALL_F16(T_) rows_f_t(w, COLIBRI_DTYPE_F16, b, tk, T_, acc)
#define RVV_CALL_Q8(T_) rows_f_t(w, COLIBRI_DTYPE_I8, b, tk, T_, acc)
#define RVV_CALL_Q8Q8(T_) rows_q8q8_t(w, b, tk, T_, acc)
RVV_ROWS(rows_f32, RVV_CALL_F32)
RVV_ROWS(rows_f16, RVV_CALL_F16)
RVV_ROWS(rows_q8, RVV_CALL_Q8)
RVV_ROWS(rows_q8q8, RVV_CALL_Q8Q8)

/* Whether this backend computes linear layers of these weights. */
static int rvv_handles(const colibri_matrix *w)
{
    return w->dtype == COLIBRI_DTYPE_F32 || w->dtype == COLIBRI_DTYPE_F16 || w->dtype == COLIBRI_DTYPE_I8;
}

static void rows_any(const colibri_matrix *w, const float *b, const rvv_tokens *tk, size_t T, int acc, int int8_act)
{
    switch (w->dtype) {
    case COLIBRI_DTYPE_F16:
        rows_f16(w, b, tk, T, acc);
        break;
    case COLIBRI_DTYPE_I8:
        if (int8_act)
            rows_q8q8(w, b, tk, T, acc);
        else
            rows_q8(w, b, tk, T, acc);
        break;
    default: /* F32 (rvv_handles) */
        rows_f32(w, b, tk, T, acc);
        break;
    }
}

/* ---- The linear kernels (colibri_linear_fn, colibri_linear_acc_fn) ---- */

static void linear_rvv(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w, const float *b,
                       const colibri_qrows *xq, float *restrict y)
{
    if (!rvv_handles(w)) {
        colibri_linear_ref(x, rows, n, w, b, xq, y);
        return;
    }
    const size_t in = w->cols, out = w->rows;
    for (size_t i = 0; i < n; i += 2) {
        const size_t T = n - i < 2 ? n - i : 2;
        rvv_tokens tk;
        for (size_t t = 0; t < T; t++) {
            tk.x[t] = x + (rows ? rows[i + t] : i + t) * in;
            tk.q[t] = xq ? xq->q + (i + t) * in : NULL;
            tk.a[t] = xq ? xq->a[i + t] : 0.0f;
            tk.y[t] = y + (i + t) * out;
            tk.s[t] = 1.0f;
        }
        rows_any(w, b, &tk, T, 0, xq != NULL);
    }
}

static void linear_acc_rvv(const float *x, size_t n, const colibri_matrix *w, const float *b, const uint16_t *rows,
                           const float *scale, const colibri_qrows *xq, float *restrict y)
{
    if (!rvv_handles(w)) {
        colibri_linear_acc_ref(x, n, w, b, rows, scale, xq, y);
        return;
    }
    const size_t in = w->cols, out = w->rows;
    for (size_t i = 0; i < n; i += 2) {
        const size_t T = n - i < 2 ? n - i : 2;
        rvv_tokens tk;
        for (size_t t = 0; t < T; t++) {
            tk.x[t] = x + (i + t) * in;
            tk.q[t] = xq ? xq->q + (i + t) * in : NULL;
            tk.a[t] = xq ? xq->a[i + t] : 0.0f;
            tk.y[t] = y + (rows ? rows[i + t] : i + t) * out;
            tk.s[t] = scale ? scale[i + t] : 1.0f;
        }
        rows_any(w, b, &tk, T, 1, xq != NULL);
    }
}

/* ---- Per-token int8 quantisation, bit-exact to colibri_quantize_rows_ref.
 * The maximum of finite values is order-independent; per element, the same
 * (x · s) · inv, then the clamp to ±127 (before rounding: the same result,
 * ±127 being integers and rounding monotonic), then round half away from
 * zero: the conversion rounds to nearest even, and where the value was
 * exactly halfway (v - r = ±0.5, exact for |v| <= 127) and the even
 * neighbour is the one nearer zero, one step away from zero is added. ---- */

static void quantize_rows_rvv(const float *x, const uint16_t *rows, size_t n, size_t in, int8_t *restrict q,
                              float *restrict a)
{
    const size_t vlmax = __riscv_vsetvlmax_e32m2();
    for (size_t i = 0; i < n; i++, q += in) {
        const float *xi = x + (rows ? rows[i] : i) * in;
        vfloat32m2_t vm = __riscv_vfmv_v_f_f32m2(0.0f, vlmax), vnf = vm;
        for (size_t k = 0; k < in;) {
            const size_t vl = __riscv_vsetvl_e32m2(in - k);
            const vfloat32m2_t v = __riscv_vfabs_v_f32m2(__riscv_vle32_v_f32m2(xi + k, vl), vl);
            vm = __riscv_vfmax_vv_f32m2_tu(vm, vm, v, vl);
            /* stays 0 unless some v is NaN or inf */
            vnf = __riscv_vfadd_vv_f32m2_tu(vnf, vnf, __riscv_vfmul_vf_f32m2(v, 0.0f, vl), vl);
            k += vl;
        }
        const vfloat32m1_t zero1 = __riscv_vfmv_s_f_f32m1(0.0f, 1);
        const float m = __riscv_vfmv_f_s_f32m1_f32(__riscv_vfredmax_vs_f32m2_f32m1(vm, zero1, vlmax));
        const float nonfinite = __riscv_vfmv_f_s_f32m1_f32(__riscv_vfredusum_vs_f32m2_f32m1(vnf, zero1, vlmax));
        if (nonfinite != 0.0f || m == 0.0f) {
            /* As the reference: zeros, a = 0 (all zeros) or NaN (NaN or inf). */
            for (size_t k = 0; k < in; k++)
                q[k] = 0;
            a[i] = nonfinite;
            continue;
        }
        const float s = m < 0x1p-100f ? 0x1p100f : 1.0f;
        const float inv = 127.0f / (m * s);
        for (size_t k = 0; k < in;) {
            const size_t vl = __riscv_vsetvl_e32m2(in - k);
            vfloat32m2_t v = __riscv_vfmul_vf_f32m2(__riscv_vfmul_vf_f32m2(__riscv_vle32_v_f32m2(xi + k, vl), s, vl),
                                                    inv, vl);
            v = __riscv_vfmax_vf_f32m2(__riscv_vfmin_vf_f32m2(v, 127.0f, vl), -127.0f, vl);
            vint32m2_t r = __riscv_vfcvt_x_f_v_i32m2(v, vl); /* to nearest, ties to even */
            const vfloat32m2_t diff = __riscv_vfsub_vv_f32m2(v, __riscv_vfcvt_f_x_v_f32m2(r, vl), vl);
            const vbool16_t up = __riscv_vmfeq_vf_f32m2_b16(diff, 0.5f, vl);    /* v = r + 0.5, v > 0 */
            const vbool16_t down = __riscv_vmfeq_vf_f32m2_b16(diff, -0.5f, vl); /* v = r - 0.5 */
            const vbool16_t pos = __riscv_vmfgt_vf_f32m2_b16(v, 0.0f, vl);
            r = __riscv_vadd_vx_i32m2_mu(__riscv_vmand_mm_b16(up, pos, vl), r, r, 1, vl);
            r = __riscv_vsub_vx_i32m2_mu(__riscv_vmandn_mm_b16(down, pos, vl), r, r, 1, vl);
            const vint16m1_t r16 = __riscv_vncvt_x_x_w_i16m1(r, vl);
            __riscv_vse8_v_i8mf2(q + k, __riscv_vncvt_x_x_w_i8mf2(r16, vl), vl);
            k += vl;
        }
        a[i] = m / 127.0f;
    }
}

/* ---- Activations, bit-exact. ReLU: v < 0 selects 0, so NaN fails the
 * comparison and stays, -0 stays -0. SiLU and sigmoid: colibri_expf with
 * colibri_exp_real's double arithmetic operation by operation in f64 lanes
 * (colibri_real is double on RISC-V with the D extension; nothing is fused),
 * then the reference's float operations around it. tanh and the GELUs (tanh
 * and erf, more branches) stay the reference's. ---- */

/* (double)(int)h: truncation toward zero without vfcvt.rtz (see the top of
 * this file): rounded to nearest, then moved one step toward zero where that
 * went past h. Exact for the |h| <= 151 colibri_exp_reduced sees. */
RVV_INLINE vint64m2_t rvv_trunc_i64(vfloat64m2_t h, size_t vl)
{
    vint64m2_t n = __riscv_vfcvt_x_f_v_i64m2(h, vl);
    const vfloat64m2_t back = __riscv_vfcvt_f_x_v_f64m2(n, vl);
    const vbool32_t pos = __riscv_vmfge_vf_f64m2_b32(h, 0.0, vl);
    const vbool32_t above = __riscv_vmand_mm_b32(pos, __riscv_vmfgt_vv_f64m2_b32(back, h, vl), vl);
    const vbool32_t below = __riscv_vmandn_mm_b32(__riscv_vmflt_vv_f64m2_b32(back, h, vl), pos, vl);
    n = __riscv_vsub_vx_i64m2_mu(above, n, n, 1, vl);
    return __riscv_vadd_vx_i64m2_mu(below, n, n, 1, vl);
}

/* colibri_expf on f32 lanes. */
RVV_INLINE vfloat32m1_t rvv_expf(vfloat32m1_t x, size_t vl)
{
    const vbool32_t nan = __riscv_vmfne_vv_f32m1_b32(x, x, vl);
    const vbool32_t over = __riscv_vmfgt_vf_f32m1_b32(x, COLIBRI_EXPF_MAX_FINITE, vl);
    const vbool32_t under = __riscv_vmflt_vf_f32m1_b32(x, COLIBRI_EXPF_MIN_NONZERO, vl);
    const vbool32_t special = __riscv_vmor_mm_b32(nan, __riscv_vmor_mm_b32(over, under, vl), vl);
    const vfloat64m2_t xd = __riscv_vfwcvt_f_f_v_f64m2(__riscv_vfmerge_vfm_f32m1(x, 0.0f, special, vl), vl);
    /* colibri_exp_reduced_as: n = (int)(t ± 0.5), r = (x - n·ln2_hi) - n·ln2_lo */
    const vfloat64m2_t t = __riscv_vfmul_vf_f64m2(xd, COLIBRI_INV_LN2, vl);
    const vbool32_t neg = __riscv_vmflt_vf_f64m2_b32(t, 0.0, vl);
    const vfloat64m2_t h = __riscv_vmerge_vvm_f64m2(__riscv_vfadd_vf_f64m2(t, 0.5, vl),
                                                    __riscv_vfsub_vf_f64m2(t, 0.5, vl), neg, vl);
    const vint64m2_t n = rvv_trunc_i64(h, vl);
    const vfloat64m2_t nf = __riscv_vfcvt_f_x_v_f64m2(n, vl);
    const vfloat64m2_t r = __riscv_vfsub_vv_f64m2(
        __riscv_vfsub_vv_f64m2(xd, __riscv_vfmul_vf_f64m2(nf, COLIBRI_LN2_HI, vl), vl),
        __riscv_vfmul_vf_f64m2(nf, COLIBRI_LN2_LO, vl), vl);
    const unsigned terms = COLIBRI_MATH_COUNT(colibri_exp_taylor);
    vfloat64m2_t p = __riscv_vfmv_v_f_f64m2(colibri_exp_taylor[terms - 1], vl);
    for (unsigned i = terms - 1; i-- > 0;)
        p = __riscv_vfadd_vf_f64m2(__riscv_vfmul_vv_f64m2(p, r, vl), colibri_exp_taylor[i], vl);
    p = __riscv_vfadd_vf_f64m2(__riscv_vfmul_vv_f64m2(r, p, vl), 1.0, vl);
    /* · 2^n (exact), then one rounding to float, as (float)(p * colibri_pow2(n)) */
    const vint64m2_t bits = __riscv_vsll_vx_i64m2(__riscv_vadd_vx_i64m2(n, 1023, vl), 52, vl);
    vfloat32m1_t e = __riscv_vfncvt_f_f_w_f32m1(__riscv_vfmul_vv_f64m2(p, __riscv_vreinterpret_v_i64m2_f64m2(bits), vl),
                                                vl);
    e = __riscv_vfmerge_vfm_f32m1(e, __builtin_inff(), over, vl);
    e = __riscv_vfmerge_vfm_f32m1(e, 0.0f, under, vl);
    return __riscv_vmerge_vvm_f32m1(e, __riscv_vfadd_vv_f32m1(x, x, vl), nan, vl);
}

/* 1 / (1 + e^-v), as the reference's sigmoid. */
RVV_INLINE vfloat32m1_t rvv_sigmoid(vfloat32m1_t v, size_t vl)
{
    const vfloat32m1_t e = rvv_expf(__riscv_vfneg_v_f32m1(v, vl), vl);
    return __riscv_vfrdiv_vf_f32m1(__riscv_vfadd_vf_f32m1(e, 1.0f, vl), 1.0f, vl);
}

static void activation_rvv(float *x, size_t n, uint32_t kind)
{
    switch (kind) {
    case COLIBRI_ACT_RELU:
        for (size_t i = 0; i < n;) {
            const size_t vl = __riscv_vsetvl_e32m4(n - i);
            const vfloat32m4_t v = __riscv_vle32_v_f32m4(x + i, vl);
            const vbool8_t neg = __riscv_vmflt_vf_f32m4_b8(v, 0.0f, vl);
            __riscv_vse32_v_f32m4(x + i, __riscv_vfmerge_vfm_f32m4(v, 0.0f, neg, vl), vl);
            i += vl;
        }
        break;
    case COLIBRI_ACT_SILU:
    case COLIBRI_ACT_SIGMOID:
        for (size_t i = 0; i < n;) {
            const size_t vl = __riscv_vsetvl_e32m1(n - i);
            const vfloat32m1_t v = __riscv_vle32_v_f32m1(x + i, vl);
            const vfloat32m1_t sg = rvv_sigmoid(v, vl);
            __riscv_vse32_v_f32m1(x + i, kind == COLIBRI_ACT_SILU ? __riscv_vfmul_vv_f32m1(v, sg, vl) : sg, vl);
            i += vl;
        }
        break;
    default:
        colibri_activation_ref(x, n, kind);
        break;
    }
}

static void mul_rvv(float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n;) {
        const size_t vl = __riscv_vsetvl_e32m4(n - i);
        __riscv_vse32_v_f32m4(x + i, __riscv_vfmul_vv_f32m4(__riscv_vle32_v_f32m4(x + i, vl),
                                                            __riscv_vle32_v_f32m4(y + i, vl), vl), vl);
        i += vl;
    }
}

static void add_rvv(float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n;) {
        const size_t vl = __riscv_vsetvl_e32m4(n - i);
        __riscv_vse32_v_f32m4(x + i, __riscv_vfadd_vv_f32m4(__riscv_vle32_v_f32m4(x + i, vl),
                                                            __riscv_vle32_v_f32m4(y + i, vl), vl), vl);
        i += vl;
    }
}

/* ---- Norms: the row sums (Σx, Σ(x - mean)², Σx²) in VL lanes, then the
 * reference's per-element operations one by one (the same division by the
 * same denominator, the same products). Only the sums' order differs. ---- */

enum { RVV_SUM = 0, RVV_SUM_DEV2 = 1, RVV_SUM_SQ = 2 };

RVV_INLINE float rvv_row_sum(const float *x, size_t n, float mean, int mode)
{
    const size_t vlmax = __riscv_vsetvlmax_e32m4();
    vfloat32m4_t acc = __riscv_vfmv_v_f_f32m4(0.0f, vlmax);
    for (size_t k = 0; k < n;) {
        const size_t vl = __riscv_vsetvl_e32m4(n - k);
        vfloat32m4_t v = __riscv_vle32_v_f32m4(x + k, vl);
        if (mode == RVV_SUM_DEV2)
            v = __riscv_vfsub_vf_f32m4(v, mean, vl);
        if (mode != RVV_SUM)
            v = __riscv_vfmul_vv_f32m4(v, v, vl); /* a product then a sum, unfused like the reference */
        acc = __riscv_vfadd_vv_f32m4_tu(acc, acc, v, vl);
        k += vl;
    }
    return __riscv_vfmv_f_s_f32m1_f32(__riscv_vfredusum_vs_f32m4_f32m1(acc, __riscv_vfmv_s_f_f32m1(0.0f, 1), vlmax));
}

static void layernorm_rvv(float *x, size_t rows, size_t n, const float *gamma, const float *beta, float eps)
{
    for (size_t r = 0; r < rows; r++, x += n) {
        const float mean = rvv_row_sum(x, n, 0.0f, RVV_SUM) / (float)n;
        const float var = rvv_row_sum(x, n, mean, RVV_SUM_DEV2) / (float)n;
        /* As the reference: statistics beyond f32 make the row NaN. */
        const float den = var <= FLT_MAX ? sqrtf(var + eps) : NAN;
        for (size_t i = 0; i < n;) {
            const size_t vl = __riscv_vsetvl_e32m4(n - i);
            vfloat32m4_t v = __riscv_vfdiv_vf_f32m4(__riscv_vfsub_vf_f32m4(__riscv_vle32_v_f32m4(x + i, vl), mean, vl),
                                                    den, vl);
            if (gamma)
                v = __riscv_vfmul_vv_f32m4(v, __riscv_vle32_v_f32m4(gamma + i, vl), vl);
            if (beta)
                v = __riscv_vfadd_vv_f32m4(v, __riscv_vle32_v_f32m4(beta + i, vl), vl);
            __riscv_vse32_v_f32m4(x + i, v, vl);
            i += vl;
        }
    }
}

static void rmsnorm_rvv(float *x, size_t rows, size_t n, const float *gamma, float eps)
{
    for (size_t r = 0; r < rows; r++, x += n) {
        const float den = sqrtf(rvv_row_sum(x, n, 0.0f, RVV_SUM_SQ) / (float)n + eps);
        for (size_t i = 0; i < n;) {
            const size_t vl = __riscv_vsetvl_e32m4(n - i);
            vfloat32m4_t v = __riscv_vfdiv_vf_f32m4(__riscv_vle32_v_f32m4(x + i, vl), den, vl);
            if (gamma)
                v = __riscv_vfmul_vv_f32m4(v, __riscv_vle32_v_f32m4(gamma + i, vl), vl);
            __riscv_vse32_v_f32m4(x + i, v, vl);
            i += vl;
        }
    }
}

/* ---- The block form of int8 activations (INT8_BLOCKS), I8 and I4 ----
 * Bit for bit colibri_matvec_q8b / colibri_matvec_q4b: per output row and
 * block of 32 columns, the products Q · xq as int16 (vwmul: |128 · 127|
 * and |8 · 127| fit) summed into int32 by one widening reduction
 * (vwredsum, exact), then v += (float)sum · a_b (I8) or
 * v += (float)sum · (s_g · a_b) (I4) in scalar f32, block after block; the
 * epilogue is the reference's own (colibri_q8_compensate,
 * colibri_q4_epilogue, colibri_emit). A block's vl covers its 32 columns
 * (e8m2 holds 32 at VLEN 128), so a row's partial last block reads nothing
 * past it. I4: the packed bytes' low nibbles (even columns, vsll 4 then
 * vsra 4) times the token's even columns (a stride-2 load), the high
 * nibbles (vsra 4) times the odd ones, the two reductions chained. Tokens
 * run inside each row, so the row stays in L1 across a call's tokens. I4
 * groups below 32 columns take the reference kernel. */

RVV_INLINE int32_t block_dot_q8(const int8_t *w, const int8_t *xq, size_t n)
{
    const size_t vl = __riscv_vsetvl_e8m2(n);
    const vint16m4_t p = __riscv_vwmul_vv_i16m4(__riscv_vle8_v_i8m2(w, vl), __riscv_vle8_v_i8m2(xq, vl), vl);
    return __riscv_vmv_x_s_i32m1_i32(__riscv_vwredsum_vs_i16m4_i32m1(p, __riscv_vmv_s_x_i32m1(0, 1), vl));
}

/* Columns [c, c + n) of an I4 row, c even, n <= 32. */
RVV_INLINE int32_t block_dot_q4(const uint8_t *row, const int8_t *xq, size_t c, size_t n)
{
    const size_t ne = (n + 1) / 2, no = n / 2;
    size_t vl = __riscv_vsetvl_e8m1(ne);
    const vint8m1_t packed = __riscv_vle8_v_i8m1((const int8_t *)row + c / 2, vl);
    const vint8m1_t lo = __riscv_vsra_vx_i8m1(__riscv_vsll_vx_i8m1(packed, 4, vl), 4, vl);
    const vint16m2_t pe = __riscv_vwmul_vv_i16m2(lo, __riscv_vlse8_v_i8m1(xq + c, 2, vl), vl);
    vint32m1_t sum = __riscv_vwredsum_vs_i16m2_i32m1(pe, __riscv_vmv_s_x_i32m1(0, 1), vl);
    if (no) {
        vl = __riscv_vsetvl_e8m1(no);
        const vint8m1_t hi = __riscv_vsra_vx_i8m1(packed, 4, vl);
        const vint16m2_t po = __riscv_vwmul_vv_i16m2(hi, __riscv_vlse8_v_i8m1(xq + c + 1, 2, vl), vl);
        sum = __riscv_vwredsum_vs_i16m2_i32m1(po, sum, vl);
    }
    return __riscv_vmv_x_s_i32m1_i32(sum);
}

/* Output row o of one token: the reference's v before its epilogue. */
static float block_row(const colibri_matrix *w, int i4, size_t o, const int8_t *xq, const float *a)
{
    const size_t in = w->cols;
    float v = 0.0f;
    if (i4) {
        const uint8_t *row = colibri_q4_row(w, o);
        const uint16_t *scales = colibri_q4_scales(w, o);
        const size_t log2 = w->q4_group_log2;
        for (size_t c = 0; c < in; c += COLIBRI_ACT_BLOCK) {
            const size_t n = in - c < COLIBRI_ACT_BLOCK ? in - c : COLIBRI_ACT_BLOCK;
            v += (float)block_dot_q4(row, xq, c, n) * (colibri_q8_half(scales[c >> log2]) * a[c / COLIBRI_ACT_BLOCK]);
        }
    } else {
        const int8_t *row = (const int8_t *)w->data + o * in;
        for (size_t c = 0; c < in; c += COLIBRI_ACT_BLOCK) {
            const size_t n = in - c < COLIBRI_ACT_BLOCK ? in - c : COLIBRI_ACT_BLOCK;
            v += (float)block_dot_q8(row + c, xq + c, n) * a[c / COLIBRI_ACT_BLOCK];
        }
    }
    return v;
}

/* Token i reads x row xrows ? xrows[i] : i (for E) and block rows i of xq;
 * writes y row yrows ? yrows[i] : i, stored (acc 0) or added with gate s_i. */
static void gemm_blocks_rvv(const float *x, const uint16_t *xrows, const uint16_t *yrows, const float *scale,
                            const colibri_qrows *xq, const colibri_matrix *w, const float *b, float *y, size_t n,
                            int acc)
{
    const int i4 = w->dtype == COLIBRI_DTYPE_I4;
    const size_t in = w->cols, out = w->rows, nb = colibri_act_blocks(in);
    for (size_t o = 0; o < out; o++)
        for (size_t i = 0; i < n; i++) {
            const float *xi = x + (xrows ? xrows[i] : i) * in;
            const float v = block_row(w, i4, o, xq->q + i * in, xq->a + i * nb);
            const float s = scale ? scale[i] : 1.0f;
            float *yi = y + (yrows ? yrows[i] : i) * out;
            if (i4)
                colibri_emit(yi, o, colibri_q4_epilogue(w, o, xi, v), b, acc, s);
            else
                colibri_emit(yi, o, colibri_q8_compensate(w, o, xi, v * colibri_q8_scale(w, o)), b, acc, s);
        }
}

static void linear_blocks_rvv(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w,
                              const float *b, const colibri_qrows *xq, float *restrict y)
{
    if (w->dtype == COLIBRI_DTYPE_I4 && w->q4_group_log2 < 5)
        colibri_linear_blocks_ref(x, rows, n, w, b, xq, y);
    else
        gemm_blocks_rvv(x, rows, NULL, NULL, xq, w, b, y, n, 0);
}

static void linear_acc_blocks_rvv(const float *x, size_t n, const colibri_matrix *w, const float *b,
                                  const uint16_t *rows, const float *scale, const colibri_qrows *xq,
                                  float *restrict y)
{
    if (w->dtype == COLIBRI_DTYPE_I4 && w->q4_group_log2 < 5)
        colibri_linear_acc_blocks_ref(x, n, w, b, rows, scale, xq, y);
    else
        gemm_blocks_rvv(x, NULL, rows, scale, xq, w, b, y, n, 1);
}

/* The block quantiser: each block as quantize_rows_rvv quantises a row (bit-exact). */
static void quantize_blocks_rvv(const float *x, const uint16_t *rows, size_t n, size_t in, int8_t *restrict q,
                                float *restrict a)
{
    colibri_quantize_blocks_with(quantize_rows_rvv, x, rows, n, in, q, a);
}

/* ---- The table: rv64gcv guarantees the vector unit, nothing to detect ---- */

void colibri_kernels_rvv(colibri_kernels *k)
{
    k->name = "riscv rvv";
    k->linear = linear_rvv;
    k->linear_acc = linear_acc_rvv;
    k->quantize_rows = quantize_rows_rvv;
    k->quantize_blocks = quantize_blocks_rvv;
    k->linear_blocks = linear_blocks_rvv;
    k->linear_acc_blocks = linear_acc_blocks_rvv;
    k->activation = activation_rvv;
    k->mul = mul_rvv;
    k->add = add_rvv;
    k->layernorm = layernorm_rvv;
    k->rmsnorm = rmsnorm_rvv;
}

#endif /* COLIBRI_BACKEND_RVV */
