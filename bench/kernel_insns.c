/*
 * kernel_insns SET DTYPE IN OUT N REPS
 *
 * Runs one linear layer (the kernel table's `linear`, colibri_kernels.h) of
 * IN inputs and OUT outputs over N token rows REPS times, with the reference
 * kernels (SET = ref) or the build's optimised ones (SET = opt). DTYPE: f32,
 * f16, q8 (int8 weights, f32 activations) or q8q8 (int8 weights and int8
 * activations, quantised once before the repetitions), q4 (int4 weights in
 * groups of 32 with f16 scales, f32 activations); q8b and q4b (int8 or
 * int4 weights, q4 in groups of 32 with f16 scales, and the block form of
 * int8 activations, INT8_BLOCKS: quantize_blocks once, then the table's
 * `linear_blocks` REPS times). For counting executed
 * instructions with a QEMU plugin (bench/riscv_insns.py, bench/aarch64_insns.py): everything but the
 * REPS calls is the same for every REPS, so the difference between two
 * counts divided by the difference in REPS is one call's instructions.
 * Prints the kernel set's name and a checksum of the outputs (so the calls
 * cannot be optimised away and a broken kernel shows).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "colibri_format.h"
#include "colibri_kernels.h"

#include "../tests/c/colibri_rng.h"

static uint64_t state = 0x9E3779B97F4A7C15u;

static uint32_t rnd(void)
{
    return (uint32_t)(colibri_xorshift64(&state) >> 32);
}

static float unit(void) /* [-1, 1) */
{
    return (float)rnd() / 2147483648.0f - 1.0f;
}

int main(int argc, char **argv)
{
    if (argc != 7) {
        fprintf(stderr, "usage: kernel_insns ref|opt f32|f16|q8|q8q8|q4|q8b|q4b IN OUT N REPS\n");
        return 2;
    }
    const char *set = argv[1], *dt = argv[2];
    const size_t in = strtoul(argv[3], NULL, 10), out = strtoul(argv[4], NULL, 10), n = strtoul(argv[5], NULL, 10);
    const long reps = strtol(argv[6], NULL, 10);
    const int blocks = strcmp(dt, "q8b") == 0 || strcmp(dt, "q4b") == 0;
    const int q4 = strcmp(dt, "q4") == 0 || strcmp(dt, "q4b") == 0;
    const int q8 = strcmp(dt, "q8") == 0 || strcmp(dt, "q8q8") == 0 || strcmp(dt, "q8b") == 0;
    const int f16 = strcmp(dt, "f16") == 0;
    if ((strcmp(set, "ref") != 0 && strcmp(set, "opt") != 0) || (!q8 && !q4 && !f16 && strcmp(dt, "f32") != 0) || !in ||
        !out || !n || reps < 0) {
        fprintf(stderr, "kernel_insns: bad arguments\n");
        return 2;
    }
    colibri_kernels k;
    if (strcmp(set, "ref") == 0)
        colibri_kernels_reference(&k);
    else
        colibri_kernels_optimised(&k);

    float *x = malloc(n * in * sizeof *x), *y = malloc(n * out * sizeof *y), *bias = malloc(out * sizeof *bias);
    const size_t nb = colibri_act_blocks(in), groups = (in + 31) / 32;
    float *scale = malloc(out * sizeof *scale), *a = malloc(n * nb * sizeof *a);
    uint16_t *q4_scales = malloc(out * groups * sizeof *q4_scales);
    int8_t *xq = malloc(n * in);
    void *wd = malloc(in * out * sizeof(float));
    if (!x || !y || !bias || !scale || !a || !xq || !wd || !q4_scales) {
        fprintf(stderr, "out of memory\n");
        return 2;
    }
    for (size_t i = 0; i < n * in; i++)
        x[i] = unit();
    for (size_t o = 0; o < out; o++) {
        bias[o] = unit();
        scale[o] = (1.0f + unit()) / 254.0f + 1e-4f;
    }
    for (size_t i = 0; q4 && i < out * groups; i++) /* a normal half in [2^-9, 2^-7) */
        q4_scales[i] = (uint16_t)((6u + rnd() % 2u) << 10 | (rnd() & 0x3FFu));
    for (size_t i = 0; i < in * out; i++) {
        if (q4)
            ((uint8_t *)wd)[i] = (uint8_t)(rnd() & 0xFFu); /* more than the packed rows need */
        else if (q8)
            ((int8_t *)wd)[i] = (int8_t)((int)(rnd() % 255u) - 127); /* -127 .. 127 */
        else if (f16) /* a normal half in (-2, 2): sign, exponent 1..15, any mantissa */
            ((uint16_t *)wd)[i] = (uint16_t)((rnd() & 0x8000u) | (1u + rnd() % 15u) << 10 | (rnd() & 0x3FFu));
        else
            ((float *)wd)[i] = unit();
    }
    colibri_matrix w = {0};
    w.dtype = q4 ? COLIBRI_DTYPE_I4 : q8 ? COLIBRI_DTYPE_I8 : f16 ? COLIBRI_DTYPE_F16 : COLIBRI_DTYPE_F32;
    w.rows = (uint32_t)out;
    w.cols = (uint32_t)in;
    w.data = wd;
    if (q8)
        w.scale = scale; /* f32 scales, no compensation term, no companion bias */
    if (q4) { /* groups of 32 (the block), f16 scales, no E, no companion bias */
        w.scale = q4_scales;
        w.q8_f16 = 1;
        w.q4_group_log2 = 5;
        w.q4_groups = (uint32_t)groups;
    }
    colibri_qrows qr = {xq, a};
    const int int8_act = strcmp(dt, "q8q8") == 0;
    if (int8_act)
        k.quantize_rows(x, NULL, n, in, xq, a);
    if (blocks)
        k.quantize_blocks(x, NULL, n, in, xq, a);

    for (long r = 0; r < reps; r++) {
        if (blocks)
            k.linear_blocks(x, NULL, n, &w, bias, &qr, y);
        else
            k.linear(x, NULL, n, &w, bias, int8_act ? &qr : NULL, y);
    }

    double sum = 0.0;
    for (size_t i = 0; reps && i < n * out; i++)
        sum += (double)y[i];
    printf("kernels: %s checksum %.9g\n", k.name, sum);
    free(x);
    free(y);
    free(bias);
    free(scale);
    free(a);
    free(xq);
    free(wd);
    free(q4_scales);
    return 0;
}
