/*
 * The engine's own exp, erf and tanh (float in, float out), used by every
 * build instead of the C library's expf, erff and tanhf:
 *
 * - Every libm has its own approximations (glibc, newlib and a MicroPython
 *   port's differ in the last bit), so with libm the device could only
 *   approximate the host. These functions are IEEE arithmetic alone: with
 *   -ffp-contract=off, an x86-64 host, a Cortex-M7 (FPv5-D16) and the
 *   MicroPython module compute the same bits.
 * - newlib's expf, erff and tanhf report overflow through the global errno
 *   (and pull in its reentrancy struct, a mutable global in .data): the
 *   engine promises no mutable state outside the caller's arena.
 *
 * Accuracy is glibc's: every function works in `real_t`, double where the
 * FPU has double precision (x86-64, AArch64, RISC-V with the D extension,
 * Cortex-M7 with FPv5-D16), so
 * only the final rounding to float is left (max error about 0.5 ulp,
 * test_engine_math_accuracy in tests/engine/test_engine_nonfinite.py); float on single-precision FPUs (Cortex-M4F),
 * where double would be emulated in software, with errors of one or two ulp.
 * NaN in gives NaN out; ±inf and overflow give the limits.
 *
 * Algorithms: exp by reduction to e^r, |r| <= ln2/2, and its Taylor series;
 * tanh by its Taylor series below 0.55 and 1 - 2/(e^2x + 1) above; erf by
 * its Taylor series below 1 and 1 - e^-x² R(x) above, with R(x) = e^x²
 * erfc(x) fitted by a polynomial (scripts/
 * math_coefficients.py derives every coefficient). Polynomials near zero are
 * written as x + x·(small correction) so that the correction's rounding
 * error is scaled down by its size.
 *
 * Static functions in a header: only the kernels include it, and the
 * compiler can inline them into their loops.
 */
#ifndef COLIBRI_MATH_H
#define COLIBRI_MATH_H

#include <stdint.h>
#include <string.h>

#if defined(COLIBRI_MATH_FLOAT_ONLY)
#define COLIBRI_REAL_IS_DOUBLE 0
#elif defined(__x86_64__) || defined(__aarch64__) || (defined(__ARM_FP) && (__ARM_FP & 8)) || \
    (defined(__riscv_flen) && __riscv_flen >= 64)
#define COLIBRI_REAL_IS_DOUBLE 1
#else
#define COLIBRI_REAL_IS_DOUBLE 0
#endif

#if COLIBRI_REAL_IS_DOUBLE
typedef double colibri_real;
#else
typedef float colibri_real;
#endif

#define COLIBRI_MATH_COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* Horner: c[0] + z·(c[1] + z·(... c[n-1])). */
static inline colibri_real colibri_poly(const colibri_real *c, unsigned n, colibri_real z)
{
    colibri_real p = c[n - 1];
    for (unsigned i = n - 1; i-- > 0;)
        p = p * z + c[i];
    return p;
}

/* The same, unrolled where GCC can (n is a constant wherever it is
 * inlined): the same operations in the same order, without a loop counter
 * and a constant pointer per term. For the router's softmax; the element-wise
 * functions keep the loop (code size). */
#if defined(__GNUC__) && !defined(__clang__)
#define COLIBRI_MATH_UNROLL _Pragma("GCC unroll 16")
#else
#define COLIBRI_MATH_UNROLL
#endif
static inline colibri_real colibri_poly_unrolled(const colibri_real *c, unsigned n, colibri_real z)
{
    colibri_real p = c[n - 1];
    COLIBRI_MATH_UNROLL
    for (unsigned i = n - 1; i-- > 0;)
        p = p * z + c[i];
    return p;
}

/* 2^k, for k within the normal exponent range of colibri_real. */
static inline colibri_real colibri_pow2(int k)
{
#if COLIBRI_REAL_IS_DOUBLE
    const uint64_t bits = (uint64_t)(k + 1023) << 52;
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
#else
    const uint32_t bits = (uint32_t)(k + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* ---- exp ---- */

/* ln 2 in two parts: the high part has 16 significant bits, so n · high is
 * exact for |n| < 256, and x - n · high loses nothing. */
#define COLIBRI_LN2_HI ((colibri_real)0.693145751953125)
#define COLIBRI_LN2_LO ((colibri_real)1.42860682030941723212e-6)
#define COLIBRI_INV_LN2 ((colibri_real)1.44269504088896340736)

/* 1/n!, n = 1..11: the series' remainder is below 1e-14 for |r| <= 0.35. */
static const colibri_real colibri_exp_taylor[] = {
    (colibri_real)1.0, (colibri_real)(1.0 / 2), (colibri_real)(1.0 / 6), (colibri_real)(1.0 / 24),
    (colibri_real)(1.0 / 120), (colibri_real)(1.0 / 720), (colibri_real)(1.0 / 5040),
    (colibri_real)(1.0 / 40320), (colibri_real)(1.0 / 362880), (colibri_real)(1.0 / 3628800),
    (colibri_real)(1.0 / 39916800),
};

/* e^x = 2^k · e^r: returns e^r (in [0.7, 1.42]) and k. |x| < 110.
 * unrolled (a constant): the series by colibri_poly_unrolled, same bits. */
static inline colibri_real colibri_exp_reduced_as(colibri_real x, int *k, int unrolled)
{
    const colibri_real t = x * COLIBRI_INV_LN2;
    const int n = (int)(t < 0 ? t - (colibri_real)0.5 : t + (colibri_real)0.5);
    const colibri_real r = (x - (colibri_real)n * COLIBRI_LN2_HI) - (colibri_real)n * COLIBRI_LN2_LO;
    *k = n;
    /* 1 + r·(1 + r/2 + ...): the leading 1 added last, exactly once. */
    const unsigned terms = COLIBRI_MATH_COUNT(colibri_exp_taylor);
    return (colibri_real)1.0 + r * (unrolled ? colibri_poly_unrolled(colibri_exp_taylor, terms, r)
                                             : colibri_poly(colibri_exp_taylor, terms, r));
}

static inline colibri_real colibri_exp_reduced(colibri_real x, int *k)
{
    return colibri_exp_reduced_as(x, k, 0);
}

/* e^x for |x| <= 20 (tanh and erf use it): no overflow or underflow. */
static inline colibri_real colibri_exp_real(colibri_real x)
{
    int k;
    const colibri_real p = colibri_exp_reduced(x, &k);
    return p * colibri_pow2(k);
}

/* expf(x) rounds to +inf above this float, to 0 below the next one. */
#define COLIBRI_EXPF_MAX_FINITE 88.72283172607421875f
#define COLIBRI_EXPF_MIN_NONZERO -103.972076416015625f

/* expf; unrolled (a constant) as colibri_exp_reduced_as. */
static inline float colibri_expf_as(float x, int unrolled)
{
    if (x != x)
        return x + x; /* NaN */
    if (x > COLIBRI_EXPF_MAX_FINITE)
        return __builtin_inff();
    if (x < COLIBRI_EXPF_MIN_NONZERO)
        return 0.0f;
    int k;
    const colibri_real p = colibri_exp_reduced_as((colibri_real)x, &k, unrolled);
#if COLIBRI_REAL_IS_DOUBLE
    return (float)(p * colibri_pow2(k)); /* exact product; one rounding, subnormals included */
#else
    if (k > 127) /* 2^128 is not a float: p · 2 is exact */
        return (p * 2.0f) * colibri_pow2(k - 1);
    if (k < -126) /* subnormal result: scale in two steps, the first exact */
        return (p * colibri_pow2(k + 24)) * 0x1p-24f;
    return p * colibri_pow2(k);
#endif
}

static inline float colibri_expf(float x)
{
    return colibri_expf_as(x, 0);
}

/* ---- tanh ---- */

/* (tanh x - x) / x³ = Σ c_n x^(2n): 16 terms leave < 1e-14 for |x| < 0.55. */
static const colibri_real colibri_tanh_c[] = {
    (colibri_real)-3.3333333333333333333e-1, (colibri_real)1.3333333333333333333e-1,
    (colibri_real)-5.3968253968253968254e-2, (colibri_real)2.1869488536155202822e-2,
    (colibri_real)-8.8632355299021965689e-3, (colibri_real)3.5921280365724810169e-3,
    (colibri_real)-1.4558343870513182682e-3, (colibri_real)5.9002744094558598138e-4,
    (colibri_real)-2.3912911424355248149e-4, (colibri_real)9.6915379569294503256e-5,
    (colibri_real)-3.9278323883316834053e-5, (colibri_real)1.5918905069328964741e-5,
    (colibri_real)-6.4516892156554307632e-6, (colibri_real)2.6147711512907545543e-6,
    (colibri_real)-1.0597268320104654351e-6, (colibri_real)4.2949110782738058548e-7,
};

/* tanh(x) is ±1 in float beyond this (1 - tanh x < 2^-25 from 9.01 on). */
#define COLIBRI_TANHF_SATURATE 9.1f

static inline float colibri_tanhf(float x)
{
    if (x != x)
        return x + x;
    const float ax = __builtin_fabsf(x);
    if (ax >= COLIBRI_TANHF_SATURATE)
        return __builtin_copysignf(1.0f, x);
    if (ax < 0.55f) {
        const colibri_real z = (colibri_real)x * (colibri_real)x;
        return (float)((colibri_real)x +
                       (colibri_real)x * (z * colibri_poly(colibri_tanh_c, COLIBRI_MATH_COUNT(colibri_tanh_c), z)));
    }
    /* 1 - 2/(e^2|x| + 1): e^2|x| >= 3, so the subtracted term is at most 1/2. */
    const colibri_real e = colibri_exp_real((colibri_real)(2.0f * ax));
    const colibri_real t = (colibri_real)1.0 - (colibri_real)2.0 / (e + (colibri_real)1.0);
    return __builtin_copysignf((float)t, x);
}

/* ---- erf ---- */

/* erf(x)/x - 1 = Σ q_n x^(2n): 18 terms leave < 1e-15 for |x| < 1. */
static const colibri_real colibri_erf_q[] = {
    (colibri_real)1.283791670955125739e-1, (colibri_real)-3.7612638903183752463e-1,
    (colibri_real)1.1283791670955125739e-1, (colibri_real)-2.6866170645131251759e-2,
    (colibri_real)5.2239776254421878421e-3, (colibri_real)-8.5483270234508528325e-4,
    (colibri_real)1.2055332981789664251e-4, (colibri_real)-1.4925650358406250977e-5,
    (colibri_real)1.6462114365889247402e-6, (colibri_real)-1.6365844691234924317e-7,
    (colibri_real)1.480719281587921724e-8, (colibri_real)-1.2290555301717927353e-9,
    (colibri_real)9.4227590646504109706e-11, (colibri_real)-6.7113668551641103779e-12,
    (colibri_real)4.4632242632864773449e-13, (colibri_real)-2.7835162072109213549e-14,
    (colibri_real)1.6342614095367151894e-15, (colibri_real)-9.0639708428086724792e-17,
};

/* R(x) = e^x² erfc(x) on [1, 2.5] in u = x - 1.75 (relative error 5.6e-12). */
static const colibri_real colibri_erfc_r_low[] = {
    (colibri_real)2.8497223473708349393e-1, (colibri_real)-1.3097634549006657553e-1,
    (colibri_real)5.5763630126265330193e-2, (colibri_real)-2.2259996478008187917e-2,
    (colibri_real)8.4043185818652204897e-3, (colibri_real)-3.0209568784560877867e-3,
    (colibri_real)1.0392070690061157815e-3, (colibri_real)-3.4364215694537610412e-4,
    (colibri_real)1.0950923725363244456e-4, (colibri_real)-3.3434058877272615134e-5,
    (colibri_real)1.0040617852824909127e-5, (colibri_real)-3.3765575816117591621e-6,
    (colibri_real)9.235703526386276336e-7,
};

/* R(x) on [2.5, 4] in u = x - 3.25 (relative error 9.8e-12). */
static const colibri_real colibri_erfc_r_high[] = {
    (colibri_real)1.6633534842701963883e-1, (colibri_real)-4.7199402342955961482e-2,
    (colibri_real)1.2937290870044425795e-2, (colibri_real)-3.4354705215585072079e-3,
    (colibri_real)8.8600466172661595749e-4, (colibri_real)-2.2239034390589851961e-4,
    (colibri_real)5.4420826160514136333e-5, (colibri_real)-1.2973133611860339709e-5,
    (colibri_real)3.0346012635011301711e-6, (colibri_real)-7.5058686304193738142e-7,
    (colibri_real)1.6600071622271245947e-7,
};

/* erf(x) is ±1 in float from here on (erfc(4) = 1.5e-8 < 2^-25). */
#define COLIBRI_ERFF_SATURATE 4.0f

static inline float colibri_erff(float x)
{
    if (x != x)
        return x + x;
    const float ax = __builtin_fabsf(x);
    if (ax >= COLIBRI_ERFF_SATURATE)
        return __builtin_copysignf(1.0f, x);
    if (ax < 1.0f) {
        const colibri_real z = (colibri_real)x * (colibri_real)x;
        return (float)((colibri_real)x + (colibri_real)x * colibri_poly(colibri_erf_q, COLIBRI_MATH_COUNT(colibri_erf_q), z));
    }
    const colibri_real a = (colibri_real)ax;
    const colibri_real r = ax < 2.5f
        ? colibri_poly(colibri_erfc_r_low, COLIBRI_MATH_COUNT(colibri_erfc_r_low), a - (colibri_real)1.75)
        : colibri_poly(colibri_erfc_r_high, COLIBRI_MATH_COUNT(colibri_erfc_r_high), a - (colibri_real)3.25);
    /* erfc <= 0.16 here: its rounding errors shrink by that much in 1 - erfc. */
    const colibri_real erfc = colibri_exp_real(-a * a) * r;
    return __builtin_copysignf((float)((colibri_real)1.0 - erfc), x);
}


/* ---- Rotary position embedding: log, exp, cos and sin in double ----
 *
 * RoPE's angles are pos · theta^(-2j/hd), computed in double and rounded to
 * float only as cos and sin (docs/lm.md "Semantics"), as the float64 numpy
 * reference computes them. These are always double (emulated on a
 * single-precision FPU: a few per position and frequency, never an inner
 * loop), within an ulp or two of double, so the floats they round to are
 * numpy's unless the exact value lies within about 2^-50 (relative) of a
 * float rounding boundary. */

/* 2^k as a double, k within the normal range. */
static inline double colibri_pow2_d(int k)
{
    const uint64_t bits = (uint64_t)(k + 1023) << 52;
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* ln 2 in two parts: the high one has 32 significant bits, so k times it is
 * exact for |k| < 2^21. */
#define COLIBRI_LN2_HI_D 6.93147180369123816490e-01
#define COLIBRI_LN2_LO_D 1.90821492927058770002e-10

/* 1/(2n+1), n = 1..12: 2 atanh(s) = 2s + 2s·Σ z^n/(2n+1), z = s². */
static const double colibri_atanh_c[] = {
    1.0 / 3, 1.0 / 5, 1.0 / 7, 1.0 / 9, 1.0 / 11, 1.0 / 13, 1.0 / 15, 1.0 / 17, 1.0 / 19, 1.0 / 21, 1.0 / 23, 1.0 / 25,
};

/* ln x for a finite, normal x > 0: x = 2^k · m with m in [√½, √2), and
 * ln m = 2 atanh(s), s = (m - 1)/(m + 1), |s| < 0.172 (the series' remainder
 * is below 1e-19). */
static inline double colibri_log_d(double x)
{
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int k = (int)((bits >> 52) & 0x7FFu) - 1023;
    bits = (bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull; /* m in [1, 2) */
    double m;
    memcpy(&m, &bits, sizeof m);
    if (m > 1.41421356237309504880) {
        m *= 0.5;
        k++;
    }
    const double s = (m - 1.0) / (m + 1.0), z = s * s;
    double p = colibri_atanh_c[COLIBRI_MATH_COUNT(colibri_atanh_c) - 1];
    for (unsigned i = COLIBRI_MATH_COUNT(colibri_atanh_c) - 1; i-- > 0;)
        p = p * z + colibri_atanh_c[i];
    const double ln_m = 2.0 * s + 2.0 * s * (z * p);
    return (double)k * COLIBRI_LN2_HI_D + ((double)k * COLIBRI_LN2_LO_D + ln_m);
}

/* 1/n!, n = 2..14: e^r = 1 + r + r²·Σ, remainder below 1e-17 for |r| <= 0.35. */
static const double colibri_exp_d_c[] = {
    1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040, 1.0 / 40320, 1.0 / 362880,
    1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800.0, 1.0 / 87178291200.0,
};

/* e^x for |x| < 700: x = k·ln2 + r, |r| <= ln2/2. */
static inline double colibri_exp_d(double x)
{
    const double t = x * 1.44269504088896340736;
    const int k = (int)(t < 0 ? t - 0.5 : t + 0.5);
    const double r = (x - (double)k * COLIBRI_LN2_HI_D) - (double)k * COLIBRI_LN2_LO_D;
    double p = colibri_exp_d_c[COLIBRI_MATH_COUNT(colibri_exp_d_c) - 1];
    for (unsigned i = COLIBRI_MATH_COUNT(colibri_exp_d_c) - 1; i-- > 0;)
        p = p * r + colibri_exp_d_c[i];
    return (1.0 + (r + r * (r * p))) * colibri_pow2_d(k);
}

/* sin r = r + r·z·Σ, z = r²: -1/3!, 1/5!, ... (remainder < 1e-18 for |r| <= π/4). */
static const double colibri_sin_d_c[] = {
    -1.0 / 6, 1.0 / 120, -1.0 / 5040, 1.0 / 362880, -1.0 / 39916800, 1.0 / 6227020800.0,
    -1.0 / 1307674368000.0, 1.0 / 355687428096000.0,
};

/* cos r = 1 - z/2 + z²·Σ: 1/4!, -1/6!, ... */
static const double colibri_cos_d_c[] = {
    1.0 / 24, -1.0 / 720, 1.0 / 40320, -1.0 / 3628800, 1.0 / 479001600, -1.0 / 87178291200.0,
    1.0 / 20922789888000.0, -1.0 / 6402373705728000.0,
};

/* cos x and sin x for a finite x with |x| < 2^20 · π/2 (beyond, the
 * reduction loses bits): x = n·π/2 + r, π/2 in three parts, the first two of
 * 33 bits so that n times them is exact, |r| <= π/4. */
/* x rounded to the nearest integer (ties to even), |x| < 2^51, by adding and
 * subtracting 1.5 · 2^52: no conversion to a 64-bit integer, which a 32-bit
 * target would take from libgcc (a MicroPython native module has none). */
static inline double colibri_round_d(double x)
{
    /* Without -ffast-math the compiler keeps both roundings (no reassociation). */
    return (x + 0x1.8p52) - 0x1.8p52;
}

static inline void colibri_cos_sin_d(double x, double *c, double *s)
{
    const double dn = colibri_round_d(x * 0.636619772367581382433);
    /* The quadrant, n mod 4, from n - 4 · round(n / 4) in -2 .. 2: a small int. */
    const int n = (int)(dn - 4.0 * colibri_round_d(dn * 0.25));
    const double r = ((x - dn * 1.57079632673412561417e+00) - dn * 6.07710050630396597660e-11) -
                     dn * 2.02226624879595063154e-21;
    const double z = r * r;
    double ps = colibri_sin_d_c[COLIBRI_MATH_COUNT(colibri_sin_d_c) - 1];
    for (unsigned i = COLIBRI_MATH_COUNT(colibri_sin_d_c) - 1; i-- > 0;)
        ps = ps * z + colibri_sin_d_c[i];
    double pc = colibri_cos_d_c[COLIBRI_MATH_COUNT(colibri_cos_d_c) - 1];
    for (unsigned i = COLIBRI_MATH_COUNT(colibri_cos_d_c) - 1; i-- > 0;)
        pc = pc * z + colibri_cos_d_c[i];
    const double sin_r = r + r * (z * ps);
    /* 1 - z/2 with its rounding error recovered (as fdlibm's __kernel_cos). */
    const double hz = 0.5 * z, w = 1.0 - hz;
    const double cos_r = w + (((1.0 - w) - hz) + z * (z * pc));
    switch ((unsigned)(n + 4) & 3u) {
    case 0:
        *c = cos_r, *s = sin_r;
        break;
    case 1:
        *c = -sin_r, *s = cos_r;
        break;
    case 2:
        *c = -cos_r, *s = -sin_r;
        break;
    default:
        *c = sin_r, *s = -cos_r;
        break;
    }
}

#endif /* COLIBRI_MATH_H */
