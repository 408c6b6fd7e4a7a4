/*
 * Colibri: a static-allocation Mixture-of-Experts inference engine.
 *
 * The caller owns all memory. colibri_init() places the context and every
 * activation buffer in the caller's arena; weights are read in place from the
 * model image (XIP flash, a const array, an mmap'd file). The engine has no
 * mutable globals, calls no malloc/free and does no I/O.
 *
 * Threads: a context is single-threaded. One thread at a time may call
 * colibri_forward() or colibri_free() on it (forward writes the context's
 * buffers in the arena); share a context between threads only behind a lock.
 * Distinct contexts are independent: each in its own arena, they may run at
 * once in different threads, even over the same image. The image-only calls
 * (validate, model_size, get_info, get_num_experts) only read the image and
 * may run from any thread at any time.
 *
 *   size_t need;
 *   colibri_model_size(image, image_len, &need);          // exact arena bytes
 *   colibri_ctx *ctx;
 *   colibri_init(&ctx, arena, need, image, image_len);   // validates fully
 *   colibri_forward(ctx, batch, in, batch * in_size, out, batch * out_size);
 *   colibri_free(ctx);                                    // arena reusable
 *
 * Every function returns a colibri_status; negative values are failures,
 * described by colibri_strerror(). The image format is docs/model-format.md.
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

#include "colibri_format.h"

#ifdef __cplusplus
extern "C" {
#endif

#define COLIBRI_VERSION_MAJOR 0
#define COLIBRI_VERSION_MINOR 1
#define COLIBRI_VERSION_PATCH 0
#define COLIBRI_VERSION_STRING "0.1.0"

/* The arena must be aligned to this many bytes. */
#define COLIBRI_ARENA_ALIGN 8u

typedef struct colibri_ctx colibri_ctx;

typedef struct colibri_model_info {
    uint32_t format_version;
    uint32_t image_size;       /* bytes */
    uint32_t flags;            /* COLIBRI_FLAG_* */
    uint32_t input_size;       /* features per token in */
    uint32_t output_size;      /* features per token out */
    uint32_t max_batch;        /* tokens per forward */
    uint32_t num_layers;
    uint32_t num_tensors;
    uint32_t num_moe_layers;
    uint32_t num_experts;      /* routed experts kept in the image, all MoE layers */
    uint32_t num_shared_experts;
    uint64_t num_parameters;   /* elements of all F32, F16 and I8 tensors (not Q8_PARAMS, not I32) */
    size_t arena_size;         /* bytes, as colibri_model_size() */
} colibri_model_info;

/* Full validation: header, CRC, every table, tensor and reference. Reads the
 * image byte by byte, so (like model_size and the info calls) it accepts any
 * image alignment; colibri_init() also requires a 4-byte aligned image. */
colibri_status colibri_validate(const void *image, size_t image_len);

/* Validation levels (colibri_validate_ex, colibri_init_ex; docs/model-format.md
 * "Integrity"). FULL checks everything colibri_validate() does. STRUCTURE
 * checks the header, the metadata CRC, every table, record, offset and
 * reference, the q8 companions and expert maps, but not the per-tensor
 * payload CRCs of a version-3 image, so it does not read the weights
 * (a version 1 or 2 image has one CRC over everything: it is checked). */
#define COLIBRI_CHECK_FULL 0u
#define COLIBRI_CHECK_STRUCTURE 1u

/* colibri_validate at a level; COLIBRI_E_UNSUPPORTED for an unknown one. */
colibri_status colibri_validate_ex(const void *image, size_t image_len, uint32_t level);

/* Exact arena bytes colibri_init() needs for this image at its max_batch.
 * Checks the image's structure (COLIBRI_CHECK_STRUCTURE), as the info calls do. */
colibri_status colibri_model_size(const void *image, size_t image_len, size_t *arena_size);

/* Validates the image and builds a context inside the arena (8-byte aligned).
 * The image must stay readable, unchanged, until colibri_free(). */
colibri_status colibri_init(colibri_ctx **ctx, void *arena, size_t arena_size,
                            const void *image, size_t image_len);

/* colibri_init at a validation level: COLIBRI_CHECK_STRUCTURE for an image
 * whose payloads are verified elsewhere (a mapped file: per expert on first
 * use, posix/colibri_file.h), COLIBRI_CHECK_FULL as colibri_init. */
colibri_status colibri_init_ex(colibri_ctx **ctx, void *arena, size_t arena_size,
                               const void *image, size_t image_len, uint32_t level);

/* Runs batch tokens: input [batch, input_size] -> output [batch, output_size],
 * row-major f32. input_count and output_count are element counts and must
 * equal batch * input_size and batch * output_size. */
colibri_status colibri_forward(colibri_ctx *ctx, size_t batch,
                               const float *input, size_t input_count,
                               float *output, size_t output_count);

/* Which kernels a context's forward pass runs (colibri_init() picks
 * COLIBRI_KERNELS_OPTIMISED). The reference kernels are the specification:
 * plain C in index order, the same bits on every target, what
 * docs/model-format.md "Numerics" describes. The optimised kernels are the
 * build's backend (KERNELS=x86|neon|cmsis, or the target's default) at the
 * best level this CPU supports; they agree with the reference within the
 * tolerance their tests state and propagate NaN/inf the same way. */
typedef enum colibri_kernel_set {
    COLIBRI_KERNELS_OPTIMISED = 0,
    COLIBRI_KERNELS_REFERENCE = 1,
} colibri_kernel_set;

/* Switches a context's kernels; COLIBRI_E_UNSUPPORTED for an unknown set. */
colibri_status colibri_set_kernels(colibri_ctx *ctx, colibri_kernel_set set);

/* The kernels a context runs: "reference", or the backend and the CPU level
 * chosen (e.g. "x86-64 avx2+fma+f16c"); "none" for no valid context. */
const char *colibri_kernels_name(const colibri_ctx *ctx);

/* Invalidates the context; the arena may then be reused. */
colibri_status colibri_free(colibri_ctx *ctx);

/* Routed experts kept in the image, summed over MoE layers. */
colibri_status colibri_get_num_experts(const void *image, size_t image_len, uint32_t *num_experts);

colibri_status colibri_get_info(const void *image, size_t image_len, colibri_model_info *info);

/* Static text for a status code; never NULL. */
const char *colibri_strerror(int status);

const char *colibri_version(void);

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_H */
