/*
 * The numeric kernels the graph code calls, and nothing else: the portable
 * reference is kernels/colibri_kernels_ref.c; an optimised backend (AVX2,
 * NEON, CMSIS-DSP) replaces that file at compile time with the same
 * signatures. Inputs are const; the one non-const pointer is the output
 * (or the data transformed in place). Matrices are row-major; a weight
 * matrix is [out, in], as torch.nn.Linear.weight.
 */
#ifndef COLIBRI_KERNELS_H
#define COLIBRI_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* y[i, :] = x[r, :] Wᵀ + b with r = rows ? rows[i] : i, for i < n.
 * x [*, in], w [out, in], b [out] or NULL, y [n, out]; y must not overlap x. */
void colibri_linear_f32(const float *x, const uint16_t *rows, size_t n, size_t in,
                        const float *w, const float *b, size_t out, float *restrict y);

/* y[r, :] += s · (x[i, :] Wᵀ + b) with r = rows ? rows[i] : i and
 * s = scale ? scale[i] : 1, for i < n: the gated scatter-add of expert outputs.
 * x [n, in], w [out, in], b [out] or NULL, y [*, out]; y must not overlap x. */
void colibri_linear_acc_f32(const float *x, size_t n, size_t in,
                            const float *w, const float *b, size_t out,
                            const uint16_t *rows, const float *scale, float *restrict y);

/* x[i] = act(x[i]) for i < n; kind is a COLIBRI_ACT_* code. */
void colibri_activation_f32(float *x, size_t n, uint32_t kind);

/* x[i] *= y[i] for i < n. */
void colibri_mul_f32(float *x, const float *y, size_t n);

/* x[i] += y[i] for i < n. */
void colibri_add_f32(float *x, const float *y, size_t n);

/* Each of the rows of x [rows, n]: (x - mean) / sqrt(var + eps) · gamma + beta,
 * biased variance; gamma and beta [n] or NULL. */
void colibri_layernorm_f32(float *x, size_t rows, size_t n,
                           const float *gamma, const float *beta, float eps);

/* Each of the rows of x [rows, n]: x / sqrt(mean(x²) + eps) · gamma; gamma [n] or NULL. */
void colibri_rmsnorm_f32(float *x, size_t rows, size_t n, const float *gamma, float eps);

/* x [n] = softmax(x), n >= 1, stable (the maximum is subtracted first). */
void colibri_softmax_f32(float *x, size_t n);

#endif /* COLIBRI_KERNELS_H */
