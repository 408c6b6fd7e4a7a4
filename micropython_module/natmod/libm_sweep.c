/*
 * Measures natmod_libm.c against glibc on the host: for every float x in a
 * range (or every stride-th one), the error of our f(x) in ulps of the exact
 * value (glibc's double exp/erf/tanh, exact to far below a float ulp) and how
 * often it differs from glibc's own float function (what the CPython engine
 * uses).
 *
 *   gcc -O2 -fno-math-errno -fno-builtin [-DCOLIBRI_LIBM_FLOAT_ONLY] \
 *       -Dexpf=natmod_expf -Derff=natmod_erff -Dtanhf=natmod_tanhf \
 *       -Dsqrtf=natmod_sqrtf -Droundf=natmod_roundf \
 *       -c micropython_module/natmod/natmod_libm.c -o /tmp/natmod_libm.o
 *   gcc -O2 micropython_module/natmod/libm_sweep.c /tmp/natmod_libm.o -lm -o /tmp/libm_sweep
 *   /tmp/libm_sweep [stride]        (stride 1: every float, a few minutes)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

float natmod_expf(float x);
float natmod_erff(float x);
float natmod_tanhf(float x);
float natmod_sqrtf(float x);
float natmod_roundf(float x);

typedef struct {
    const char *name;
    float (*ours)(float);
    float (*libm)(float);
    double (*exact)(double);
    float lo, hi; /* range swept (both signs are covered by lo < 0) */
} function;

static double ulp_of(double y)
{
    y = fabs(y);
    if (y < 0x1p-126)
        return 0x1p-149;
    int e;
    frexp(y, &e); /* y = m 2^e, m in [0.5, 1) */
    return ldexp(1.0, e - 24);
}

static double exact_sqrt(double x) { return sqrt(x); }
static double exact_round(double x) { return round(x); }

static void sweep(const function *f, uint32_t stride)
{
    double worst = 0.0;
    float worst_x = 0.0f;
    uint64_t n = 0, differ = 0;
    double worst_vs_libm = 0.0;
    /* walk the bit patterns of [lo, hi]: negatives from lo up to -0, then +0 up to hi */
    for (int sign = 0; sign < 2; sign++) {
        const float a = sign ? fmaxf(f->lo, 0.0f) : 0.0f, b = sign ? f->hi : -fminf(f->lo, 0.0f);
        if (!sign && f->lo >= 0.0f)
            continue;
        uint32_t ua, ub;
        memcpy(&ua, &a, 4);
        memcpy(&ub, &b, 4);
        for (uint64_t u = ua; u <= ub; u += stride) {
            uint32_t bits = (uint32_t)u | (sign ? 0u : 0x80000000u);
            float x;
            memcpy(&x, &bits, 4);
            const float got = f->ours(x), lib = f->libm(x);
            const double want = f->exact((double)x);
            /* beyond FLT_MAX the float answer is inf: exact if ours is inf too */
            const double err = fabs(want) > 0x1.fffffep127 ? (isinf(got) ? 0.0 : INFINITY)
                                                             : fabs((double)got - want) / ulp_of(want);
            if (err > worst) {
                worst = err;
                worst_x = x;
            }
            if (got != lib && !(got != got && lib != lib)) {
                differ++;
                const double d = fabs((double)got - (double)lib) / ulp_of(lib);
                if (d > worst_vs_libm)
                    worst_vs_libm = d;
            }
            n++;
        }
    }
    printf("%-6s max error %.3f ulp (at x = %.9g); differs from glibc on %llu of %llu inputs (%.4f%%), by at most %.3g ulp\n",
           f->name, worst, (double)worst_x, (unsigned long long)differ, (unsigned long long)n,
           100.0 * (double)differ / (double)n, worst_vs_libm);
}

int main(int argc, char **argv)
{
    const uint32_t stride = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 0) : 7;
    const function functions[] = {
        {"expf", natmod_expf, expf, exp, -104.0f, 89.0f},
        {"tanhf", natmod_tanhf, tanhf, tanh, -10.0f, 10.0f},
        {"erff", natmod_erff, erff, erf, -4.5f, 4.5f},
        {"sqrtf", natmod_sqrtf, sqrtf, exact_sqrt, 0.0f, 3.0e38f},
        {"roundf", natmod_roundf, roundf, exact_round, -1.0e8f, 1.0e8f},
    };
    for (size_t i = 0; i < sizeof functions / sizeof functions[0]; i++) {
        if (argc > 2 && strcmp(argv[2], functions[i].name) != 0)
            continue;
        sweep(&functions[i], stride);
    }
    return 0;
}
