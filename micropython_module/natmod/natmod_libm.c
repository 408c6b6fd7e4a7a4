/*
 * The two C library functions the engine still calls, for the native
 * module, which cannot link libm (newlib's and glibc's pull in errno and
 * .data, and a native .mpy carries neither): sqrtf and roundf. exp, erf and
 * tanh are the engine's own (firmware/colibri_core/src/colibri_math.h) in
 * every build, so they need nothing here.
 *
 * Compiled with -fno-builtin (so GCC does not treat these definitions as the
 * library functions) and -fno-math-errno (so __builtin_sqrtf is the FPU
 * instruction, not a call back to sqrtf).
 */
#include <stdint.h>

float sqrtf(float x);
float roundf(float x);

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
