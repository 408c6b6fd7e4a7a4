/*
 * The five math functions the engine calls, for the native module, which
 * cannot link libm (newlib's and glibc's pull in errno and .data, and a
 * native .mpy carries neither): expf, erff, tanhf, sqrtf, roundf.
 *
 * Accuracy is what matters: the module's outputs are compared with the
 * CPython build of the same engine (glibc libm) to 1e-6 relative. Every
 * function works in `real_t`: double where the FPU has double precision
 * (x86-64, Cortex-M7 with FPv5-D16), which leaves only the final rounding
 * to float (max error about 0.5 ulp, as glibc's); float on single-precision
 * FPUs (armv7emsp, where double would be software-emulated and the engine
 * must not use it), with max errors of one or two ulp. Build with
 * -DCOLIBRI_LIBM_FLOAT_ONLY to get the float variant on any host (that is how
 * it is measured: micropython_module/natmod/libm_sweep.c).
 *
 * Algorithms: exp by reduction to e^r, |r| <= ln2/2, and its Taylor series;
 * tanh by its Taylor series below 0.55 and 1 - 2/(e^2x + 1) above; erf by
 * its Taylor series below 1 and 1 - e^-x² R(x) above, with R(x) = e^x² erfc(x)
 * fitted by a polynomial (libm_coefficients.py derives every coefficient).
 * Polynomials near zero are written as x + x·(small correction) so that the
 * correction's rounding error is scaled down by its size.
 *
 * Compiled with -fno-builtin (so GCC does not treat these definitions as the
 * library functions) and -fno-math-errno (so __builtin_sqrtf is the FPU
 * instruction, not a call back to sqrtf).
 */
#include <stdint.h>

#if defined(COLIBRI_LIBM_FLOAT_ONLY)
#define REAL_IS_DOUBLE 0
#elif defined(__x86_64__) || defined(__i386__) || defined(__aarch64__) || (defined(__ARM_FP) && (__ARM_FP & 8))
#define REAL_IS_DOUBLE 1
#else
#define REAL_IS_DOUBLE 0
#endif

#if REAL_IS_DOUBLE
typedef double real_t;
#else
typedef float real_t;
#endif

float expf(float x);
float erff(float x);
float tanhf(float x);
float sqrtf(float x);
float roundf(float x);

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* Horner: c[0] + z·(c[1] + z·(... c[n-1])). */
static real_t poly(const real_t *c, unsigned n, real_t z)
{
    real_t p = c[n - 1];
    for (unsigned i = n - 1; i-- > 0;)
        p = p * z + c[i];
    return p;
}

static float float_from_bits(uint32_t bits)
{
    union {
        uint32_t u;
        float f;
    } v = {bits};
    return v.f;
}

static uint32_t bits_from_float(float f)
{
    union {
        float f;
        uint32_t u;
    } v = {f};
    return v.u;
}

/* 2^k as real_t, for k within the normal exponent range of real_t. */
static real_t pow2(int k)
{
#if REAL_IS_DOUBLE
    union {
        uint64_t u;
        double d;
    } v = {(uint64_t)(k + 1023) << 52};
    return v.d;
#else
    return float_from_bits((uint32_t)(k + 127) << 23);
#endif
}

/* ---- exp ---- */

/* ln 2 in two parts: LN2_HI has 16 significant bits, so n · LN2_HI is exact
 * in float (and double) for |n| < 256, and x - n · LN2_HI loses nothing. */
#define LN2_HI ((real_t)0.693145751953125)
#define LN2_LO ((real_t)1.42860682030941723212e-6)
#define INV_LN2 ((real_t)1.44269504088896340736)

/* 1/n!, n = 0..11: the series' remainder is below 1e-14 for |r| <= 0.35. */
static const real_t exp_taylor[] = {
    (real_t)1.0, (real_t)1.0, (real_t)(1.0 / 2), (real_t)(1.0 / 6), (real_t)(1.0 / 24),
    (real_t)(1.0 / 120), (real_t)(1.0 / 720), (real_t)(1.0 / 5040), (real_t)(1.0 / 40320),
    (real_t)(1.0 / 362880), (real_t)(1.0 / 3628800), (real_t)(1.0 / 39916800),
};

/* e^x = 2^k · e^r: returns e^r (in [0.7, 1.42]) and k. |x| < 110. */
static real_t exp_reduced(real_t x, int *k)
{
    const real_t t = x * INV_LN2;
    const int n = (int)(t < 0 ? t - (real_t)0.5 : t + (real_t)0.5);
    const real_t r = (x - (real_t)n * LN2_HI) - (real_t)n * LN2_LO;
    *k = n;
    /* 1 + r·(1 + r/2 + ...): the leading 1 added last, exactly once. */
    return (real_t)1.0 + r * poly(exp_taylor + 1, COUNT(exp_taylor) - 1, r);
}

/* e^x for |x| <= 20 (tanh and erf use it), no overflow or underflow. */
static real_t exp_real(real_t x)
{
    int k;
    const real_t p = exp_reduced(x, &k);
    return p * pow2(k);
}

/* exp(x) rounds to +inf above this float, to 0 below the next one. */
#define EXPF_MAX_FINITE 88.72283172607421875f
#define EXPF_MIN_NONZERO -103.972076416015625f

float expf(float x)
{
    if (x != x)
        return x + x; /* NaN */
    if (x > EXPF_MAX_FINITE)
        return __builtin_inff();
    if (x < EXPF_MIN_NONZERO)
        return 0.0f;
    int k;
    const real_t p = exp_reduced((real_t)x, &k);
#if REAL_IS_DOUBLE
    return (float)(p * pow2(k)); /* exact product; one rounding, subnormals included */
#else
    if (k > 127) /* 2^128 is not a float: p · 2 is exact */
        return (p * 2.0f) * pow2(k - 1);
    if (k < -126) /* subnormal result: scale in two steps, the first exact */
        return (p * pow2(k + 24)) * float_from_bits(0x33800000u); /* 2^-24 */
    return p * pow2(k);
#endif
}

/* ---- tanh ---- */

/* (tanh x - x) / x³ = Σ c_n x^(2n): 16 terms leave < 1e-14 for |x| < 0.55. */
static const real_t tanh_c[] = {
    (real_t)-3.3333333333333333333e-1, (real_t)1.3333333333333333333e-1,
    (real_t)-5.3968253968253968254e-2, (real_t)2.1869488536155202822e-2,
    (real_t)-8.8632355299021965689e-3, (real_t)3.5921280365724810169e-3,
    (real_t)-1.4558343870513182682e-3, (real_t)5.9002744094558598138e-4,
    (real_t)-2.3912911424355248149e-4, (real_t)9.6915379569294503256e-5,
    (real_t)-3.9278323883316834053e-5, (real_t)1.5918905069328964741e-5,
    (real_t)-6.4516892156554307632e-6, (real_t)2.6147711512907545543e-6,
    (real_t)-1.0597268320104654351e-6, (real_t)4.2949110782738058548e-7,
};

/* tanh(x) is ±1 in float beyond this (1 - tanh x < 2^-25 from 9.01 on). */
#define TANHF_SATURATE 9.1f

float tanhf(float x)
{
    if (x != x)
        return x + x;
    const float ax = __builtin_fabsf(x);
    if (ax >= TANHF_SATURATE)
        return __builtin_copysignf(1.0f, x);
    if (ax < 0.55f) {
        const real_t z = (real_t)x * (real_t)x;
        return (float)((real_t)x + (real_t)x * (z * poly(tanh_c, COUNT(tanh_c), z)));
    }
    /* 1 - 2/(e^2|x| + 1): e^2|x| >= 3, so the subtracted term is at most 1/2. */
    const real_t e = exp_real((real_t)(2.0f * ax));
    const real_t t = (real_t)1.0 - (real_t)2.0 / (e + (real_t)1.0);
    return __builtin_copysignf((float)t, x);
}

/* ---- erf ---- */

/* erf(x)/x - 1 = Σ q_n x^(2n): 18 terms leave < 1e-15 for |x| < 1. */
static const real_t erf_q[] = {
    (real_t)1.283791670955125739e-1, (real_t)-3.7612638903183752463e-1,
    (real_t)1.1283791670955125739e-1, (real_t)-2.6866170645131251759e-2,
    (real_t)5.2239776254421878421e-3, (real_t)-8.5483270234508528325e-4,
    (real_t)1.2055332981789664251e-4, (real_t)-1.4925650358406250977e-5,
    (real_t)1.6462114365889247402e-6, (real_t)-1.6365844691234924317e-7,
    (real_t)1.480719281587921724e-8, (real_t)-1.2290555301717927353e-9,
    (real_t)9.4227590646504109706e-11, (real_t)-6.7113668551641103779e-12,
    (real_t)4.4632242632864773449e-13, (real_t)-2.7835162072109213549e-14,
    (real_t)1.6342614095367151894e-15, (real_t)-9.0639708428086724792e-17,
};

/* R(x) = e^x² erfc(x) on [1, 2.5] in u = x - 1.75 (relative error 5.6e-12). */
static const real_t erfc_r_low[] = {
    (real_t)2.8497223473708349393e-1, (real_t)-1.3097634549006657553e-1,
    (real_t)5.5763630126265330193e-2, (real_t)-2.2259996478008187917e-2,
    (real_t)8.4043185818652204897e-3, (real_t)-3.0209568784560877867e-3,
    (real_t)1.0392070690061157815e-3, (real_t)-3.4364215694537610412e-4,
    (real_t)1.0950923725363244456e-4, (real_t)-3.3434058877272615134e-5,
    (real_t)1.0040617852824909127e-5, (real_t)-3.3765575816117591621e-6,
    (real_t)9.235703526386276336e-7,
};

/* R(x) on [2.5, 4] in u = x - 3.25 (relative error 9.8e-12). */
static const real_t erfc_r_high[] = {
    (real_t)1.6633534842701963883e-1, (real_t)-4.7199402342955961482e-2,
    (real_t)1.2937290870044425795e-2, (real_t)-3.4354705215585072079e-3,
    (real_t)8.8600466172661595749e-4, (real_t)-2.2239034390589851961e-4,
    (real_t)5.4420826160514136333e-5, (real_t)-1.2973133611860339709e-5,
    (real_t)3.0346012635011301711e-6, (real_t)-7.5058686304193738142e-7,
    (real_t)1.6600071622271245947e-7,
};

/* erf(x) is ±1 in float from here on (erfc(4) = 1.5e-8 < 2^-25). */
#define ERFF_SATURATE 4.0f

float erff(float x)
{
    if (x != x)
        return x + x;
    const float ax = __builtin_fabsf(x);
    if (ax >= ERFF_SATURATE)
        return __builtin_copysignf(1.0f, x);
    if (ax < 1.0f) {
        const real_t z = (real_t)x * (real_t)x;
        return (float)((real_t)x + (real_t)x * poly(erf_q, COUNT(erf_q), z));
    }
    const real_t a = (real_t)ax;
    const real_t r = ax < 2.5f ? poly(erfc_r_low, COUNT(erfc_r_low), a - (real_t)1.75)
                               : poly(erfc_r_high, COUNT(erfc_r_high), a - (real_t)3.25);
    /* erfc <= 0.16 here: its rounding errors shrink by that much in 1 - erfc. */
    const real_t erfc = exp_real(-a * a) * r;
    return __builtin_copysignf((float)((real_t)1.0 - erfc), x);
}

/* ---- sqrt, round ---- */

float sqrtf(float x)
{
    return __builtin_sqrtf(x); /* sqrtss / vsqrt.f32 with -fno-math-errno: correctly rounded */
}

/* Half away from zero, as C's roundf, by bit manipulation. */
float roundf(float x)
{
    uint32_t bits = bits_from_float(x);
    const int exponent = (int)((bits >> 23) & 0xFFu) - 127;
    if (exponent >= 23) /* already an integer, or inf or NaN */
        return x;
    if (exponent < -1) /* |x| < 0.5 */
        return float_from_bits(bits & 0x80000000u);
    if (exponent == -1) /* 0.5 <= |x| < 1 */
        return __builtin_copysignf(1.0f, x);
    /* 1 <= |x| < 2^23: add half a unit of the last integer bit to the
     * magnitude (a carry rolls into the exponent), then clear the fraction. */
    const uint32_t fraction_bits = 23u - (uint32_t)exponent;
    bits += 1u << (fraction_bits - 1);
    bits &= ~((1u << fraction_bits) - 1);
    return float_from_bits(bits);
}
