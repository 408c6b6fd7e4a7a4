/*
 * The numeric kernels the graph code calls, and nothing else. Inputs are
 * const; the one non-const pointer is the output (or the data transformed in
 * place). Matrices are row-major; a weight matrix is [out, in], as
 * torch.nn.Linear.weight.
 *
 * Weight matrices come in several dtypes (docs/model-format.md "Quantised
 * weights"); the graph code only ever sees a colibri_matrix and calls the
 * linear kernels of its kernel table, which dispatch on the dtype.
 *
 *   kernels/colibri_kernels_ref.c     reference: the linear dispatch, f32
 *                                     weights, every element-wise kernel
 *   kernels/colibri_kernels_f16.c     reference: f16 weights, f32 activations
 *   kernels/colibri_kernels_q8.c      reference: int8 weights with f32 or
 *                                     int8 activations (per row or in blocks
 *                                     of 32), both quantisers
 *   kernels/colibri_kernels_q4.c      reference: int4 weights in groups, f32
 *                                     or int8 activations (per row or blocks)
 *   kernels/colibri_kernels_select.c  the table: reference, then the backend
 *   kernels/<backend>/                an optimised backend (x86, neon, cmsis),
 *                                     compiled to nothing unless selected
 *
 * The backend is chosen at build time: by default the one for the target's
 * architecture, or one named with -DCOLIBRI_KERNELS_<REF|X86|NEON|CMSIS>
 * (make KERNELS=...). Within it, colibri_init() picks by the CPU's features.
 */
#ifndef COLIBRI_KERNELS_H
#define COLIBRI_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* A weight matrix [rows = out, cols = in], read in place from the image.
 * The pointers are naturally aligned (payloads are 32-byte aligned in a
 * 4-byte aligned image, and every Q8_PARAMS field starts at a multiple of
 * its element size).
 *
 * The I8 fields describe the Q8_PARAMS companion (docs/model-format.md
 * "Quantised weights", format v1 or v2); kernels read them only through
 * colibri_q8_scale(), colibri_q8_compensate() and colibri_q8_has_terms()
 * below (or their four-row forms colibri_q8_scale4(), colibri_q8_compensate4()). */
typedef struct colibri_matrix {
    uint8_t dtype;             /* COLIBRI_DTYPE_F32, _F16, _I8 or _I4 */
    /* I8 only, else 0; beside dtype so no padding sits inside the plan's copies. */
    uint8_t q8_f16;            /* 1: scale (and bias) are f16 bits, 0: f32 */
    uint8_t q8_bias;           /* 1: a bias [rows] follows the scales (v2) */
    uint8_t q8_ptr;            /* bytes per row pointer: 0 (no E), 1, 2 or 4 */
    uint32_t rows, cols;
    uint32_t q8_nnz;           /* I8: entries of the compensation term E; 0: none.
                                * Kernels ask colibri_q8_has_terms(), not this: a
                                * companion without E may still hold a bias. */
    const void *data;          /* float, uint16_t (f16 bits) or int8_t [rows, cols] */
    /* I8 only (from the Q8_PARAMS companion); otherwise NULL. */
    const void *scale;         /* [rows] per-output-channel scale s (f32 or f16), then
                                * the bias [rows] of the same type if q8_bias */
    const void *row_ptr;       /* [rows + 1] of q8_ptr bytes: E entries of row i are
                                * row_ptr[i] .. row_ptr[i+1]-1 */
    const uint16_t *col;       /* [nnz] input column of each entry, < cols */
    const uint16_t *val;       /* [nnz] f16 bits of each entry */
    /* I4 only (from the Q4_PARAMS companion, format v5), else NULL / 0. At
     * the end, so the I8 fields and their offsets stay as they were. For I4,
     * data is the packed nibbles (colibri_q4_row), scale the f16 group scales
     * [rows · q4_groups] (colibri_q4_scales), q8_f16 = 1, q8_bias = 0, and
     * q8_ptr, q8_nnz, row_ptr, col, val describe E exactly as for I8, so
     * colibri_q8_terms() and colibri_q8_compensate() serve both. */
    const uint16_t *q4_bias;   /* [rows] f16 companion bias, or NULL */
    uint32_t q4_group_log2;    /* columns per scale = 1 << this (3..8) */
    uint32_t q4_groups;        /* G = ceil(cols / group) */
} colibri_matrix;

/* Int8 activations of the n rows one call reads (colibri_quantize_rows):
 * q [n, cols] and the per-row dequantisation scales a [n]. In the block form
 * (INT8_BLOCKS, colibri_quantize_blocks) a holds one scale per block of
 * COLIBRI_ACT_BLOCK columns: a [n, colibri_act_blocks(cols)]. */
typedef struct colibri_qrows {
    const int8_t *q;
    const float *a;
} colibri_qrows;

/* Columns per activation scale of the block form: the q4 default group, so
 * a q4 group of 32 and a block coincide and one scale product serves both. */
#define COLIBRI_ACT_BLOCK 32u

/* Blocks of a row of `cols` activations (the last one maybe partial). */
static inline size_t colibri_act_blocks(size_t cols)
{
    return (cols + COLIBRI_ACT_BLOCK - 1u) / COLIBRI_ACT_BLOCK;
}

/* ---- The kernel table: the seam between the graph and the arithmetic ----
 *
 * The graph code (colibri_engine.c) calls kernels only through this table,
 * which colibri_init() fills into the context: with the reference kernels,
 * then with whatever the build's backend (below) offers for this CPU. Each
 * entry's contract is that of its reference kernel; an optimised kernel
 * agrees with it within the tolerance its tests state, and keeps its NaN/inf
 * behaviour (docs/model-format.md "Numerics"). */

/* y[i, :] = x[r, :] Wᵀ + b with r = rows ? rows[i] : i, for i < n.
 * x [*, in], b [out] or NULL, y [n, out] with in = w->cols, out = w->rows;
 * y must not overlap x. xq: NULL for f32 activations, or the int8 rows of
 * x[r] (i < n) for an I8 or I4 matrix with INT8_ACT; ignored for other dtypes.
 * The n rows are one small GEMM: a backend reuses each weight load across them. */
typedef void (*colibri_linear_fn)(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w,
                                  const float *b, const colibri_qrows *xq, float *restrict y);

/* y[r, :] += s · (x[i, :] Wᵀ + b) with r = rows ? rows[i] : i and
 * s = scale ? scale[i] : 1, for i < n: the gated scatter-add of expert outputs.
 * x [n, in], b [out] or NULL, y [*, out]; y must not overlap x. xq as for
 * the linear kernel, here the int8 rows of x[i]. */
typedef void (*colibri_linear_acc_fn)(const float *x, size_t n, const colibri_matrix *w, const float *b,
                                      const uint16_t *rows, const float *scale, const colibri_qrows *xq,
                                      float *restrict y);

/* Per-token int8 quantisation (docs/model-format.md "Quantised weights"):
 * for i < n, row x[r, :] with r = rows ? rows[i] : i becomes q[i, :] [in]
 * and a[i]: m = max |x|; m = 0 gives q = 0, a = 0; a NaN or inf in the row
 * gives q = 0, a = NaN; otherwise q = clamp(roundf(x · (127 / m)), ±127)
 * (x and m scaled by 2^100 first when m < 2^-100) and a = m / 127.
 * Exact: every backend gives the reference's bits. */
typedef void (*colibri_quantize_fn)(const float *x, const uint16_t *rows, size_t n, size_t in,
                                    int8_t *restrict q, float *restrict a);

/* The block form of the quantiser (INT8_BLOCKS, docs/model-format.md):
 * each block of COLIBRI_ACT_BLOCK columns of row r (the last maybe shorter)
 * is quantised exactly as colibri_quantize_fn quantises a whole row, its
 * scale going to a[i · colibri_act_blocks(in) + block]. Exact: every backend
 * gives the reference's bits. */
typedef colibri_quantize_fn colibri_quantize_blocks_fn;

/* The block form of a row quantiser: each block of COLIBRI_ACT_BLOCK columns
 * of each row is quantised as `quantize_rows` quantises a row, so the block
 * form of a bit-exact row quantiser is bit-exact too. Inline, so that each
 * backend's call compiles to a direct call of its own row quantiser. */
static inline void colibri_quantize_blocks_with(colibri_quantize_fn quantize_rows, const float *x,
                                                const uint16_t *rows, size_t n, size_t in, int8_t *restrict q,
                                                float *restrict a)
{
    const size_t nb = colibri_act_blocks(in);
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + (rows ? rows[i] : i) * in;
        for (size_t blk = 0; blk < nb; blk++) {
            const size_t c = blk * COLIBRI_ACT_BLOCK, len = in - c < COLIBRI_ACT_BLOCK ? in - c : COLIBRI_ACT_BLOCK;
            quantize_rows(xi + c, NULL, 1, len, q + i * in + c, a + i * nb + blk);
        }
    }
}

/* x[i] = act(x[i]) for i < n; kind is a COLIBRI_ACT_* code. */
typedef void (*colibri_activation_fn)(float *x, size_t n, uint32_t kind);

/* x[i] = x[i] op y[i] for i < n (op: × or +). Exact in every backend. */
typedef void (*colibri_binary_fn)(float *x, const float *y, size_t n);

/* Each of the rows of x [rows, n]: (x - mean) / sqrt(var + eps) · gamma + beta,
 * biased variance; gamma and beta [n] or NULL. */
typedef void (*colibri_layernorm_fn)(float *x, size_t rows, size_t n,
                                     const float *gamma, const float *beta, float eps);

/* Each of the rows of x [rows, n]: x / sqrt(mean(x²) + eps) · gamma; gamma [n] or NULL. */
typedef void (*colibri_rmsnorm_fn)(float *x, size_t rows, size_t n, const float *gamma, float eps);

/* ---- Token models (docs/lm.md) ---- */

/* y[i, :] = row tokens[i] of the table [vocab, d] (F32, F16 or I8 with its
 * Q8_PARAMS: Q·s + E, read in place) for i < n; the ids are validated < vocab. */
typedef void (*colibri_embed_fn)(const colibri_matrix *table, const int32_t *tokens, size_t n, float *restrict y);

/* RoPE, Hugging Face's rotate_half layout, on the heads [heads, hd] of one
 * row at one position: for j < hd/2, (x_j, x_{j+hd/2}) becomes
 * (x_j·cos_j - x_{j+hd/2}·sin_j, x_{j+hd/2}·cos_j + x_j·sin_j). */
typedef void (*colibri_rope_fn)(float *x, size_t heads, size_t hd, const float *cos, const float *sin);

/* One head of one query row over len cached positions: scores
 * s_t = (q · k_t) · scale for t < len, softmax (the maximum subtracted, the
 * engine's exp), then out = Σ_t softmax_t · v_t, summed in t order. k_t and
 * v_t are rows [hd] at k + t·stride, v + t·stride, f32 or (f16 set) f16
 * bits. scores [len] is scratch. out may be q itself: q is read only
 * before out is written. */
typedef void (*colibri_attend_fn)(const float *q, const void *k, const void *v, size_t stride, size_t len,
                                  size_t hd, int f16, float scale, float *scores, float *out);

typedef struct colibri_kernels {
    const char *name;                 /* "reference", or the backend and CPU level chosen */
    colibri_linear_fn linear;
    colibri_linear_acc_fn linear_acc;
    colibri_quantize_fn quantize_rows;
    /* The block form of int8 activations (INT8_BLOCKS): xq's scales per
     * block (colibri_qrows), for I8 and I4 weights only. Contracts: the
     * reference kernels colibri_quantize_blocks_ref, colibri_linear_blocks_ref
     * and colibri_linear_acc_blocks_ref; every backend gives their bits. A
     * backend without its own keeps these. */
    colibri_quantize_blocks_fn quantize_blocks;
    colibri_linear_fn linear_blocks;
    colibri_linear_acc_fn linear_acc_blocks;
    colibri_activation_fn activation;
    colibri_binary_fn mul, add;
    colibri_layernorm_fn layernorm;
    colibri_rmsnorm_fn rmsnorm;
    colibri_embed_fn embed;
    colibri_rope_fn rope;
    colibri_attend_fn attend;
} colibri_kernels;

/* Fills *k with the reference kernels (kernels/colibri_kernels_*.c). */
void colibri_kernels_reference(colibri_kernels *k);

/* Fills *k with the best kernels of the build's backend for the CPU it runs
 * on (kernels/colibri_kernels_select.c): the reference kernels, then any the
 * backend overrides after checking the CPU's features. No static state: the
 * caller keeps the table (the context does). */
void colibri_kernels_optimised(colibri_kernels *k);

/* ---- The reference kernels: the specification every backend is tested
 * against. Plain C loops in index order, f32 accumulation, no FMA. ---- */

void colibri_linear_ref(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w,
                        const float *b, const colibri_qrows *xq, float *restrict y);
void colibri_linear_acc_ref(const float *x, size_t n, const colibri_matrix *w, const float *b,
                            const uint16_t *rows, const float *scale, const colibri_qrows *xq,
                            float *restrict y);
void colibri_quantize_rows_ref(const float *x, const uint16_t *rows, size_t n, size_t in,
                               int8_t *restrict q, float *restrict a);
void colibri_quantize_blocks_ref(const float *x, const uint16_t *rows, size_t n, size_t in,
                                 int8_t *restrict q, float *restrict a);
void colibri_linear_blocks_ref(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w,
                               const float *b, const colibri_qrows *xq, float *restrict y);
void colibri_linear_acc_blocks_ref(const float *x, size_t n, const colibri_matrix *w, const float *b,
                                   const uint16_t *rows, const float *scale, const colibri_qrows *xq,
                                   float *restrict y);
void colibri_activation_ref(float *x, size_t n, uint32_t kind);
void colibri_mul_ref(float *x, const float *y, size_t n);
void colibri_add_ref(float *x, const float *y, size_t n);
void colibri_layernorm_ref(float *x, size_t rows, size_t n, const float *gamma, const float *beta, float eps);
void colibri_rmsnorm_ref(float *x, size_t rows, size_t n, const float *gamma, float eps);

void colibri_embed_ref(const colibri_matrix *table, const int32_t *tokens, size_t n, float *restrict y);
void colibri_rope_ref(float *x, size_t heads, size_t hd, const float *cos, const float *sin);
void colibri_attend_ref(const float *q, const void *k, const void *v, size_t stride, size_t len, size_t hd,
                        int f16, float scale, float *scores, float *out);

/* x [n] = softmax(x), n >= 1, stable (the maximum is subtracted first). The
 * router's (colibri_router.c), reference only: it runs over R <= a few
 * hundred logits per token, never a hot loop. */
void colibri_softmax_f32(float *x, size_t n);

/* ---- Per-dtype matrix-times-row reference kernels, called by the
 * reference linear kernels only ----
 *
 * Each computes, for one token row x [w->cols] and every output o < w->rows,
 * v_o = (row o of W) · x + b_o (b NULL: no bias), and stores it:
 * y[o] = v_o when acc is 0, y[o] += s · v_o otherwise. */

void colibri_matvec_f32(const colibri_matrix *w, const float *x, const float *b,
                        int acc, float s, float *restrict y);

void colibri_matvec_f16(const colibri_matrix *w, const float *x, const float *b,
                        int acc, float s, float *restrict y);

/* I8, f32 activations: v_o = (Σ_j (float)Q_oj · x_j) · s_o + Σ_E e · x_j + b_o. */
void colibri_matvec_q8(const colibri_matrix *w, const float *x, const float *b,
                       int acc, float s, float *restrict y);

/* I8, int8 activations xq [w->cols] with scale a:
 * v_o = (float)(Σ_j Q_oj · xq_j in int32) · (s_o · a) + Σ_E e · x_j + b_o,
 * E applied to the unquantised x. */
void colibri_matvec_q8q8(const colibri_matrix *w, const float *x, const int8_t *xq, float a,
                         const float *b, int acc, float s, float *restrict y);

/* I4 (format v5), f32 activations: with s_g the f16 scale of row o's
 * group g (1 << q4_group_log2 columns, the last maybe partial),
 * v_o = Σ_g (Σ_{c in g} (float)Q_oc · x_c) · s_g, each group's sum in column
 * order and the groups in order, + Σ_E e · x_c + bias_o (the companion's,
 * f16), then colibri_emit. */
void colibri_matvec_q4(const colibri_matrix *w, const float *x, const float *b,
                       int acc, float s, float *restrict y);

/* I4, int8 activations xq [w->cols] with scale a:
 * v_o = (Σ_g (float)(Σ_{c in g} Q_oc · xq_c in int32) · s_g) · a
 *       + Σ_E e · x_c + bias_o, E applied to the unquantised x. */
void colibri_matvec_q4q8(const colibri_matrix *w, const float *x, const int8_t *xq, float a,
                         const float *b, int acc, float s, float *restrict y);

/* I8, int8 activations in blocks (INT8_BLOCKS): xq [w->cols], a [blocks]
 * one scale per COLIBRI_ACT_BLOCK columns:
 * v_o = (Σ_b (float)(Σ_{j in b} Q_oj · xq_j in int32) · a_b) · s_o
 *       + Σ_E e · x_j + b_o, the blocks in order, E on the unquantised x. */
void colibri_matvec_q8b(const colibri_matrix *w, const float *x, const int8_t *xq, const float *a,
                        const float *b, int acc, float s, float *restrict y);

/* I4, int8 activations in blocks: the columns split where a group or a
 * block ends (units of min(group, 32) columns, group and block both powers
 * of two), in column order:
 * v_o = Σ_u (float)(Σ_{c in u} Q_oc · xq_c in int32) · (s_g(u) · a_b(u))
 *       + Σ_E e · x_c + bias_o, E on the unquantised x. */
void colibri_matvec_q4b(const colibri_matrix *w, const float *x, const int8_t *xq, const float *a,
                        const float *b, int acc, float s, float *restrict y);

/* The end of every matvec kernel for output o: add the bias, then either
 * store (acc 0) or add the gated value s · v into y (acc 1). */
static inline void colibri_emit(float *y, size_t o, float v, const float *b, int acc, float s)
{
    if (b)
        v += b[o];
    if (acc)
        y[o] += s * v;
    else
        y[o] = v;
}

/* One element of the int8 quantiser (colibri_quantize_fn): round half away
 * from zero of (x · s) · inv, clamped to ±127. Shared by the reference and
 * every backend's scalar tail, so all give the same bits. */
static inline int8_t colibri_quantize_one(float x, float s, float inv)
{
    float v = roundf((x * s) * inv);
    if (v > 127.0f)
        v = 127.0f;
    else if (v < -127.0f)
        v = -127.0f;
    return (int8_t)v;
}

/* IEEE binary16 bits -> f32, exactly, by bit manipulation (no compiler
 * __fp16 needed): normals, subnormals (renormalised), ±0, ±inf, NaN (the
 * payload is kept, so a NaN stays a NaN). */
static inline float colibri_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (uint32_t)(h >> 10) & 0x1Fu;
    uint32_t man = (uint32_t)h & 0x3FFu;
    uint32_t bits;

    if (exp == 0x1Fu) {              /* inf, NaN */
        bits = sign | 0x7F800000u | man << 13;
    } else if (exp != 0) {           /* normal: rebias 15 -> 127 */
        bits = sign | (exp + 112u) << 23 | man << 13;
    } else if (man == 0) {           /* ±0 */
        bits = sign;
    } else {                         /* subnormal man · 2^-24: normalise */
        exp = 113u;                  /* 127 - 14, less one per shift */
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        bits = sign | exp << 23 | (man & 0x3FFu) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* f32 -> IEEE binary16 bits, rounded to nearest even as numpy's astype
 * (float16): beyond the largest half (65504) is ±inf once past the rounding
 * boundary 65520, below 2^-14 a subnormal or ±0, NaN stays NaN (quiet, its
 * top payload bits kept). The KV cache's f16 rows (docs/lm.md). */
static inline uint16_t colibri_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) /* NaN */
        return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x477FF000u) /* >= 65520 (inf included): ±inf */
        return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) { /* a normal half: rebias 127 -> 15, round the 13 dropped bits */
        uint32_t h = (ax >> 13) - (112u << 10);
        const uint32_t rem = ax & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
            h++; /* a carry into the exponent is still the right number */
        return (uint16_t)(sign | h);
    }
    if (ax < 0x33000000u) /* below 2^-25: rounds to ±0 */
        return sign;
    /* A subnormal half: the significand shifted to units of 2^-24. */
    const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u, shift = 126u - (ax >> 23);
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

/* ---- I8 metadata, read through colibri_q8_scale(), colibri_q8_compensate()
 * and colibri_q8_has_terms() (or their block variants colibri_q8_params_at(),
 * colibri_q8_terms(), colibri_q8_term_col() and colibri_q8_term_bits()) only,
 * so every backend stays independent of how Q8_PARAMS lays out its scales,
 * bias and compensation (format v1 or v2). ---- */

/* Where the FPU converts half precision (32-bit Arm with FPv5, the
 * Cortex-M7): one VCVTB widens a finite f16 exactly, subnormals included
 * (flush-to-zero and FPSCR.AHP, the alternative half format, are never
 * enabled). Every f16 these accessors read is validated finite, so it gives
 * the same bits as the portable code. */
#if defined(__arm__) && defined(__ARM_FP) && (__ARM_FP & 2) && defined(__GNUC__)
#define COLIBRI_Q8_VCVTB 1
static inline float colibri_q8_vcvtb(uint16_t h)
{
    float f;
    __asm__("vmov %0, %1\n\tvcvtb.f32.f16 %0, %0" : "=t"(f) : "r"((uint32_t)h));
    return f;
}
#endif

#if defined(__GNUC__)
#define COLIBRI_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define COLIBRI_ALWAYS_INLINE inline
#endif

/* An f16 Q8_PARAMS parameter -> f32, exactly. Validation admits only ±0
 * and normal numbers there (docs/model-format.md "Quantised weights"), so
 * rebiasing the exponent is the whole conversion. */
static COLIBRI_ALWAYS_INLINE float colibri_q8_half(uint16_t h)
{
#ifdef COLIBRI_Q8_VCVTB
    return colibri_q8_vcvtb(h);
#else
    const uint32_t mag = (uint32_t)h & 0x7FFFu;
    const uint32_t bits = ((uint32_t)h & 0x8000u) << 16 | (mag ? (mag << 13) + (112u << 23) : 0u);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* A compensation value (f16, validated finite, maybe subnormal) -> f32. */
static COLIBRI_ALWAYS_INLINE float colibri_q8_value(uint16_t h)
{
#ifdef COLIBRI_Q8_VCVTB
    return colibri_q8_vcvtb(h);
#else
    return colibri_f16_to_f32(h);
#endif
}

/* Parameter i (a scale for i < rows, the bias of row i - rows after them). */
static COLIBRI_ALWAYS_INLINE float colibri_q8_param(const colibri_matrix *w, size_t i)
{
    if (w->q8_f16)
        return colibri_q8_half(((const uint16_t *)w->scale)[i]);
    return ((const float *)w->scale)[i];
}

/* s_o, the dequantisation scale of output row o. */
static COLIBRI_ALWAYS_INLINE float colibri_q8_scale(const colibri_matrix *w, size_t o)
{
    return colibri_q8_param(w, o);
}

/* Whether colibri_q8_compensate() adds anything to this matrix's rows (a
 * compensation term E or a companion bias): a kernel may skip calling it
 * only when this is 0. */
static COLIBRI_ALWAYS_INLINE int colibri_q8_has_terms(const colibri_matrix *w)
{
    return w->q8_ptr != 0 || w->q8_bias != 0;
}

/* COLIBRI_BOUNDED(checked, unchecked): an index read in place from the image,
 * bounded where it is used (checked). Only a build that prices the bounds
 * (bench/host_insns.py: the core Makefile's `nobounds` variant) defines
 * COLIBRI_MEASURE_WITHOUT_BOUNDS and takes the unchecked form, which trusts
 * the image as validated: a library built so can crash on an image changed
 * after colibri_init, and nothing but that measurement may use it. */
#ifdef COLIBRI_MEASURE_WITHOUT_BOUNDS
#define COLIBRI_BOUNDED(checked, unchecked) (unchecked)
#else
#define COLIBRI_BOUNDED(checked, unchecked) (checked)
#endif

/* min(k, nnz): a row pointer or column read in place, bounded where it is used. */
static COLIBRI_ALWAYS_INLINE uint32_t colibri_q8_bound(uint32_t k, uint32_t limit)
{
    return COLIBRI_BOUNDED(k < limit ? k : limit, ((void)limit, k));
}

/* Row o's compensation entries k = *begin .. *end - 1 (none when the
 * matrix has no E: *begin == *end == 0). Read entry k with
 * colibri_q8_term_col() and colibri_q8_term_bits(). */
static COLIBRI_ALWAYS_INLINE void colibri_q8_terms(const colibri_matrix *w, size_t o, uint32_t *begin, uint32_t *end)
{
    switch (w->q8_ptr) { /* bytes per row pointer; 0: no compensation term */
    case 1:
        *begin = ((const uint8_t *)w->row_ptr)[o];
        *end = ((const uint8_t *)w->row_ptr)[o + 1];
        break;
    case 2:
        *begin = ((const uint16_t *)w->row_ptr)[o];
        *end = ((const uint16_t *)w->row_ptr)[o + 1];
        break;
    case 4:
        *begin = ((const uint32_t *)w->row_ptr)[o];
        *end = ((const uint32_t *)w->row_ptr)[o + 1];
        break;
    default:
        *begin = *end = 0;
        break;
    }
    /* Validated nondecreasing and <= nnz at init; bounded at the use too, as
     * the row pointers are read in place (an image changed after validation
     * gives wrong numbers, never a read outside col and val). */
    *end = colibri_q8_bound(*end, w->q8_nnz);
}

/* Entry k's input column (< cols) and the f16 bits of its value e
 * (validated finite, maybe subnormal): colibri_q8_value() widens them, as
 * does any exact f16 -> f32 conversion (F16C's, NEON's). */
static COLIBRI_ALWAYS_INLINE size_t colibri_q8_term_col(const colibri_matrix *w, uint32_t k)
{
    const size_t c = w->col[k];
    return COLIBRI_BOUNDED(c < w->cols ? c : 0u, c); /* validated < cols; bounded at the use (read in place) */
}

static COLIBRI_ALWAYS_INLINE uint16_t colibri_q8_term_bits(const colibri_matrix *w, uint32_t k)
{
    return w->val[k];
}

/* The additive terms of row o, in this order: v + Σ e · x[col] over row o's
 * compensation entries in storage order, then + the companion's bias of row
 * o if it holds one (format v2; the layer's own bias reference is then
 * NONE, so the kernel's b is NULL). Call it once for every output row, or
 * do the same through the block accessors (colibri_q8_terms() gives the same
 * entries as this loop, colibri_q8_params_at() the same bias). */
static COLIBRI_ALWAYS_INLINE float colibri_q8_compensate(const colibri_matrix *w, size_t o, const float *x, float v)
{
    const uint8_t width = w->q8_ptr; /* 0: no compensation term */
    if (width) {
        uint32_t k, end;
        if (width == 1) {
            k = ((const uint8_t *)w->row_ptr)[o];
            end = ((const uint8_t *)w->row_ptr)[o + 1];
        } else if (width == 2) {
            k = ((const uint16_t *)w->row_ptr)[o];
            end = ((const uint16_t *)w->row_ptr)[o + 1];
        } else {
            k = ((const uint32_t *)w->row_ptr)[o];
            end = ((const uint32_t *)w->row_ptr)[o + 1];
        }
        /* validated; read in place: past nnz, the row's terms are left out */
        if (COLIBRI_BOUNDED(k < end && end <= w->q8_nnz, k < end))
            for (; k < end; k++)
                v += colibri_q8_value(w->val[k]) * x[colibri_q8_term_col(w, k)];
    }
    if (w->q8_bias)
        v += colibri_q8_param(w, (size_t)w->rows + o);
    return v;
}

/* ---- Block accessors, for vector backends: the same parameters for rows
 * o, o + 1, ... as stored, so a backend can load (and widen) several at
 * once. For every row r, the scale is the value colibri_q8_scale(w, o + r)
 * returns, and the bias the one colibri_q8_compensate() adds last. A kernel
 * doing its epilogue through these does, per row, exactly what
 * colibri_q8_scale() and colibri_q8_compensate() would: v · s_o (for int8
 * activations (float)sum · (s_o · a)), then the row's entries in the order
 * colibri_q8_terms() gives, then the companion bias. ---- */
typedef struct colibri_q8_block {
    const uint16_t *scale_f16; /* scales of rows o.. as f16 bits (exact to widen), or NULL */
    const float *scale_f32;    /* or as f32 (exactly one of the two is set) */
    const uint16_t *bias_f16;  /* the companion's biases of rows o.. as f16 bits, */
    const float *bias_f32;     /* or as f32; both NULL: the matrix has none */
} colibri_q8_block;

static COLIBRI_ALWAYS_INLINE colibri_q8_block colibri_q8_params_at(const colibri_matrix *w, size_t o)
{
    colibri_q8_block p = {NULL, NULL, NULL, NULL};
    if (w->q8_f16) {
        p.scale_f16 = (const uint16_t *)w->scale + o;
        if (w->q8_bias)
            p.bias_f16 = (const uint16_t *)w->scale + w->rows + o;
    } else {
        p.scale_f32 = (const float *)w->scale + o;
        if (w->q8_bias)
            p.bias_f32 = (const float *)w->scale + w->rows + o;
    }
    return p;
}

/* ---- Four rows at once: colibri_q8_scale4() and colibri_q8_compensate4()
 * give exactly what colibri_q8_scale() and colibri_q8_compensate() give for
 * rows o .. o+3 (o + 4 <= rows), with the format's branches taken once per
 * four rows and, on the Cortex-M7, four f16 parameters widened from two word
 * loads (VCVTB/VCVTT). ---- */

/* Parameters i .. i+3 (colibri_q8_param). */
static COLIBRI_ALWAYS_INLINE void colibri_q8_param4(const colibri_matrix *w, size_t i, float p[4])
{
    if (w->q8_f16) {
        const uint16_t *h = (const uint16_t *)w->scale + i;
#ifdef COLIBRI_Q8_VCVTB
        uint32_t lo, hi; /* the halves i, i+1 and i+2, i+3 (unaligned words: the M7 reads them) */
        memcpy(&lo, h, sizeof lo);
        memcpy(&hi, h + 2, sizeof hi);
        __asm__("vmov %0, %4\n\t"
                "vcvtt.f32.f16 %1, %0\n\t"
                "vcvtb.f32.f16 %0, %0\n\t"
                "vmov %2, %5\n\t"
                "vcvtt.f32.f16 %3, %2\n\t"
                "vcvtb.f32.f16 %2, %2"
                : "=&t"(p[0]), "=&t"(p[1]), "=&t"(p[2]), "=&t"(p[3])
                : "r"(lo), "r"(hi));
#else
        p[0] = colibri_q8_half(h[0]);
        p[1] = colibri_q8_half(h[1]);
        p[2] = colibri_q8_half(h[2]);
        p[3] = colibri_q8_half(h[3]);
#endif
    } else {
        const float *f = (const float *)w->scale + i;
        p[0] = f[0];
        p[1] = f[1];
        p[2] = f[2];
        p[3] = f[3];
    }
}

/* s_o .. s_{o+3}. */
static COLIBRI_ALWAYS_INLINE void colibri_q8_scale4(const colibri_matrix *w, size_t o, float s[4])
{
    colibri_q8_param4(w, o, s);
}

/* v + Σ e · x[col] over the compensation entries k .. end-1 (storage order);
 * end <= nnz, as the callers bound it (colibri_q8_terms, compensate4). */
static COLIBRI_ALWAYS_INLINE float colibri_q8_add_terms(const colibri_matrix *w, uint32_t k, uint32_t end, const float *x,
                                                    float v)
{
    for (; k < end; k++)
        v += colibri_q8_value(w->val[k]) * x[colibri_q8_term_col(w, k)];
    return v;
}

#if defined(__GNUC__)
#define COLIBRI_NOINLINE __attribute__((noinline, unused)) /* unused: a static in a header */
#else
#define COLIBRI_NOINLINE
#endif

/* Four floats: with the hard-float ABI (the Cortex-M7's), passed and
 * returned in s0-s3. */
typedef struct colibri_q8_four {
    float v[4];
} colibri_q8_four;

/* The compensation terms of four rows with row pointers k0 .. k4, added to
 * v0 .. v3 in storage order, as four colibri_q8_add_terms calls. Out of
 * line: only blocks with entries come here, and the kernels' 4-row loops
 * keep their registers. The row pointers are read in place: valid ones
 * never decrease and end at nnz (validated); changed since, the block's
 * terms are left out (wrong numbers, never a read past col and val). */
static COLIBRI_NOINLINE colibri_q8_four colibri_q8_terms4(const colibri_matrix *w, uint32_t k0, uint32_t k1,
                                                                uint32_t k2, uint32_t k3, uint32_t k4, const float *x,
                                                                float v0, float v1, float v2, float v3)
{
    colibri_q8_four t = {{v0, v1, v2, v3}};
    if (k4 <= w->q8_nnz && k1 <= k4 && k2 <= k4 && k3 <= k4) {
        t.v[0] = colibri_q8_add_terms(w, k0, k1, x, v0);
        t.v[1] = colibri_q8_add_terms(w, k1, k2, x, v1);
        t.v[2] = colibri_q8_add_terms(w, k2, k3, x, v2);
        t.v[3] = colibri_q8_add_terms(w, k3, k4, x, v3);
    }
    return t;
}

/* v[r] = colibri_q8_compensate(w, o + r, x, v[r]) for r < 4: each row's
 * compensation entries in storage order, then its companion bias. Written
 * out row by row: GCC at -O2 keeps loops over four-element arrays in memory. */
static COLIBRI_ALWAYS_INLINE void colibri_q8_compensate4(const colibri_matrix *w, size_t o, const float *x, float v[4])
{
    const uint8_t width = w->q8_ptr;
    if (width) {
        uint32_t k0, k1, k2, k3, k4;
        if (width == 1) {
            const uint8_t *rp = (const uint8_t *)w->row_ptr + o;
            k0 = rp[0], k1 = rp[1], k2 = rp[2], k3 = rp[3], k4 = rp[4];
        } else if (width == 2) {
            const uint16_t *rp = (const uint16_t *)w->row_ptr + o;
            k0 = rp[0], k1 = rp[1], k2 = rp[2], k3 = rp[3], k4 = rp[4];
        } else {
            const uint32_t *rp = (const uint32_t *)w->row_ptr + o;
            k0 = rp[0], k1 = rp[1], k2 = rp[2], k3 = rp[3], k4 = rp[4];
        }
        if (k0 != k4) { /* any entry in the four rows */
            const colibri_q8_four t = colibri_q8_terms4(w, k0, k1, k2, k3, k4, x, v[0], v[1], v[2], v[3]);
            v[0] = t.v[0];
            v[1] = t.v[1];
            v[2] = t.v[2];
            v[3] = t.v[3];
        }
    }
    if (w->q8_bias) {
        float b[4];
        colibri_q8_param4(w, (size_t)w->rows + o, b);
        v[0] += b[0];
        v[1] += b[1];
        v[2] += b[2];
        v[3] += b[3];
    }
}

/* ---- I4 (format v5: docs/model-format.md "Quantised weights: I4 with
 * Q4_PARAMS"), read through these accessors, colibri_q8_terms() (E) and
 * colibri_q4_epilogue() only. ---- */

/* Row o's packed nibbles: ceil(cols / 2) bytes, column c in byte c >> 1, the
 * low nibble for even c. When cols is odd the last byte's high nibble is 0. */
static COLIBRI_ALWAYS_INLINE const uint8_t *colibri_q4_row(const colibri_matrix *w, size_t o)
{
    return (const uint8_t *)w->data + o * (((size_t)w->cols + 1u) >> 1);
}

/* Column c of a row: a signed two's-complement int4, -8..7. */
static COLIBRI_ALWAYS_INLINE int colibri_q4_nibble(const uint8_t *row, size_t c)
{
    const unsigned nib = (unsigned)(row[c >> 1] >> ((c & 1u) << 2)) & 0xFu;
    return (int)nib - (int)((nib & 8u) << 1);
}

/* Row o's q4_groups scales as f16 bits (validated ±0 or normal: exact to
 * widen with colibri_q8_half or any f16 conversion). */
static COLIBRI_ALWAYS_INLINE const uint16_t *colibri_q4_scales(const colibri_matrix *w, size_t o)
{
    return (const uint16_t *)w->scale + o * (size_t)w->q4_groups;
}

/* The additive terms of row o after the groups' sum v (and, for int8
 * activations, · a), in this order: + Σ e · x[col] over row o's
 * compensation entries in storage order, then + the companion's f16 bias
 * when the matrix has one. A vector backend may do the same through
 * colibri_q8_terms() and w->q4_bias. */
static COLIBRI_ALWAYS_INLINE float colibri_q4_epilogue(const colibri_matrix *w, size_t o, const float *x, float v)
{
    if (w->q8_ptr) {
        uint32_t k, end;
        colibri_q8_terms(w, o, &k, &end);
        v = colibri_q8_add_terms(w, k, end, x, v);
    }
    if (w->q4_bias)
        v += colibri_q8_half(w->q4_bias[o]);
    return v;
}

#endif /* COLIBRI_KERNELS_H */
