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

/* Marks the public API. The Linux libraries build with -fvisibility=hidden,
 * so libcolibri.so exports these and nothing else. */
#if defined(__GNUC__) || defined(__clang__)
#define COLIBRI_API __attribute__((visibility("default")))
#else
#define COLIBRI_API
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
    uint32_t image_size;       /* bytes; 0xFFFFFFFF for a format v7 image of 4 GiB or more (its header's u32) */
    uint32_t flags;            /* COLIBRI_FLAG_* */
    uint32_t input_size;       /* features per token in */
    uint32_t output_size;      /* features per token out */
    uint32_t max_batch;        /* tokens per forward */
    uint32_t num_layers;
    uint32_t num_tensors;
    uint32_t num_moe_layers;
    uint32_t num_experts;      /* routed experts kept in the image, all MoE layers */
    uint32_t num_shared_experts;
    uint64_t num_parameters;   /* elements of all F32, F16, I8 and I4 tensors (not I32), plus the biases
                                  Q8_PARAMS / Q4_PARAMS companions hold: the same whatever the dtype */
    size_t arena_size;         /* bytes, as colibri_model_size() */
    /* Token models (docs/lm.md); 0 for a feature model. */
    uint32_t vocab_size;       /* token ids are below it; logits rows are output_size (= vocab_size) */
    uint32_t max_seq_len;      /* positions the KV cache holds (0: no attention layer, no cache) */
    size_t kv_cache_bytes;     /* the KV cache's share of arena_size */
} colibri_model_info;

/* Full validation: header, CRC, every table, tensor and reference. Reads the
 * image byte by byte, so (like model_size and the info calls) it accepts any
 * image alignment; colibri_init() also requires a 4-byte aligned image. */
COLIBRI_API colibri_status colibri_validate(const void *image, size_t image_len);

/* Validation levels (colibri_validate_ex, colibri_init_ex; docs/model-format.md
 * "Integrity"). FULL checks everything colibri_validate() does. STRUCTURE
 * checks the header, the metadata CRC, every table, record, offset and
 * reference, the q8 companions and expert maps, but not the per-tensor
 * payload CRCs of a version-3 image, so it does not read the weights
 * (a version 1 or 2 image has one CRC over everything: it is checked). */
#define COLIBRI_CHECK_FULL 0u
#define COLIBRI_CHECK_STRUCTURE 1u

/* colibri_validate at a level; COLIBRI_E_UNSUPPORTED for an unknown one. */
COLIBRI_API colibri_status colibri_validate_ex(const void *image, size_t image_len, uint32_t level);

/* Exact arena bytes colibri_init() needs for this image at its max_batch.
 * Checks the image's structure (COLIBRI_CHECK_STRUCTURE), as the info calls do. */
COLIBRI_API colibri_status colibri_model_size(const void *image, size_t image_len, size_t *arena_size);

/* Validates the image and builds a context inside the arena (8-byte aligned).
 * The image must stay readable, unchanged, until colibri_free(). */
COLIBRI_API colibri_status colibri_init(colibri_ctx **ctx, void *arena, size_t arena_size,
                            const void *image, size_t image_len);

/* colibri_init at a validation level: COLIBRI_CHECK_STRUCTURE for an image
 * whose payloads are verified elsewhere (a mapped file: per expert on first
 * use, posix/colibri_file.h), COLIBRI_CHECK_FULL as colibri_init. */
COLIBRI_API colibri_status colibri_init_ex(colibri_ctx **ctx, void *arena, size_t arena_size,
                                           const void *image, size_t image_len, uint32_t level);

/* Runs batch tokens: input [batch, input_size] -> output [batch, output_size],
 * row-major f32. input_count and output_count are element counts and must
 * equal batch * input_size and batch * output_size. */
COLIBRI_API colibri_status colibri_forward(colibri_ctx *ctx, size_t batch,
                               const float *input, size_t input_count,
                               float *output, size_t output_count);

/* ---- Extended forward: what the caller supplies (threads, devices, hooks) ----
 *
 * colibri_forward_ex() is colibri_forward() with a set of caller-supplied
 * options; exec == NULL, or every callback NULL and workers <= 1, is exactly
 * colibri_forward(). The core still starts no thread and calls no OS: threads
 * come from parallel_for (the POSIX layer's colibri_pool implements it), page
 * advice from on_route (the POSIX file layer issues MADV_WILLNEED there).
 *
 * Versioning: the caller sets struct_size = sizeof(colibri_exec) of the
 * header it compiled against (COLIBRI_EXEC_INIT does). Fields past a smaller
 * struct_size read as zero, so older callers keep working as fields are
 * added at the end; a larger struct_size (a newer caller) is accepted only if
 * the bytes this library does not know are all zero. Anything else, a
 * struct_size below COLIBRI_EXEC_SIZE_V1 or more workers than the arena holds,
 * is COLIBRI_E_BAD_EXEC. Callbacks run on the thread that called
 * colibri_forward_ex(), except expert, which may run on any worker. */

/* One MoE layer's routing, passed to on_route after the router ran and
 * before any expert of the layer runs: the union of what the batch selected.
 * Expert numbering is the image's expert table (docs/model-format.md):
 * routed slot s of this layer is expert record first_expert + s, and its
 * shared experts, which run for every token, are records
 * first_expert + experts .. first_expert + experts + shared - 1. */
typedef struct colibri_route {
    uint32_t layer;          /* MoE layer, 0-based in program order */
    uint32_t first_expert;   /* expert record of routed slot 0 */
    uint32_t experts;        /* routed slots of this layer */
    uint32_t shared;         /* shared experts of this layer */
    size_t batch;            /* tokens of this forward pass */
    const uint32_t *tokens;  /* [experts] tokens routed to slot s; 0: slot s will not run */
    const uint16_t *token;   /* slot s's token indices: token[s * batch + i], i < tokens[s] */
    const float *gate;       /* and their gate weights: gate[s * batch + i] */
} colibri_route;

/* Returns COLIBRI_OK to go on; a negative status stops the forward pass,
 * which returns it (e.g. a per-expert integrity check failing). */
typedef colibri_status (*colibri_on_route_fn)(void *user, const colibri_route *route);

/* One task of a parallel loop: worker < the exec's workers, and no two
 * tasks run at once with the same worker index (it selects the scratch). */
typedef void (*colibri_task_fn)(void *arg, size_t task, size_t worker);

/* Runs fn(arg, task, worker) for every task in [0, n_tasks), spread over at
 * most `workers` workers, each task exactly once, and returns when all have
 * finished (with their writes visible to the caller). Returns COLIBRI_OK, or
 * a negative status if it could not run them (the forward pass returns it). */
typedef colibri_status (*colibri_parallel_for_fn)(void *user, colibri_task_fn fn, void *arg, size_t n_tasks);

/* The accelerator hook (issue 13): one expert over a ring of tokens, run on
 * the caller's device while the engine keeps routing and aggregation. The
 * weights are the image's payloads in place (w* as the expert's tensors store
 * them: F32, F16 or I8; for I8 the caller reads the Q8_PARAMS companion of
 * expert record `expert` from the image, docs/model-format.md). No rows are
 * copied: the hook computes, for i < n,
 *     y[y_row(i), :] += gate[i] * expert(x[x_row(i), :])
 * with x_row(i) = x_rows ? x_rows[i] : i, y_row(i) = y_rows ? y_rows[i] : i,
 * gate NULL meaning 1, x and y [*, d] row-major f32, and
 * expert(v) = act(v W1ᵀ + b1) (⊙ (v W3ᵀ + b3) if GLU) W2ᵀ + b2. */
typedef struct colibri_expert_call {
    uint32_t struct_size;    /* sizeof(colibri_expert_call) of the library */
    uint32_t layer;          /* MoE layer, as colibri_route */
    uint32_t expert;         /* expert record index in the image */
    uint32_t d;              /* features per row in and out */
    uint32_t hidden;         /* the expert's hidden size */
    uint8_t kind;            /* COLIBRI_EXPERT_MLP or COLIBRI_EXPERT_GLU */
    uint8_t activation;      /* COLIBRI_ACT_* after W1 */
    uint16_t reserved;
    uint32_t worker;         /* the worker running this call (0 without parallel_for) */
    const void *w1, *w2, *w3; /* [hidden, d], [d, hidden], [hidden, d] (GLU) payloads, or NULL */
    const float *b1, *b2, *b3; /* [hidden], [d], [hidden] biases, each or NULL */
    size_t n;                /* rows */
    const float *x;
    const uint16_t *x_rows;
    const float *gate;
    float *y;
    const uint16_t *y_rows;
} colibri_expert_call;

/* Returns COLIBRI_OK once y holds the expert's contribution,
 * COLIBRI_EXPERT_DECLINED (y untouched) for the engine to run it itself, or a
 * negative status, which the forward pass returns (any other value:
 * COLIBRI_E_BAD_EXEC). With parallel_for it runs on the workers, several
 * experts at once. */
typedef colibri_status (*colibri_expert_fn)(void *user, const colibri_expert_call *call);
#define COLIBRI_EXPERT_DECLINED ((colibri_status)1)

typedef struct colibri_exec {
    uint32_t struct_size;                 /* sizeof(colibri_exec); COLIBRI_EXEC_INIT */
    uint32_t workers;                     /* parallel_for's workers; 0 or 1: none */
    /* Each callback with its own user pointer, so that independent layers
     * (a thread pool, a file mapping, a device) plug in side by side. */
    colibri_on_route_fn on_route;         /* NULL: not called */
    void *on_route_user;
    colibri_parallel_for_fn parallel_for; /* NULL: single-threaded */
    void *parallel_for_user;
    colibri_expert_fn expert;             /* NULL: the engine runs every expert */
    void *expert_user;
} colibri_exec;

/* The size of the first version of colibri_exec (every field above; when fields
 * are added, this stays that size: offsetof the first added field). */
#define COLIBRI_EXEC_SIZE_V1 ((uint32_t)sizeof(colibri_exec))
#define COLIBRI_EXEC_INIT {(uint32_t)sizeof(colibri_exec), 0u, NULL, NULL, NULL, NULL, NULL, NULL}

/* Exact arena bytes for this image run with up to `workers` workers
 * (parallel_for): colibri_model_size() plus, for workers > 1, the shared
 * expert staging rows and each extra worker's scratch. workers 0 or 1 gives
 * colibri_model_size(). colibri_init() takes any arena at least
 * colibri_model_size(); a context then serves as many workers as its arena holds. */
COLIBRI_API colibri_status colibri_model_size_ex(const void *image, size_t image_len, size_t workers, size_t *arena_size);

/* colibri_forward() with the caller's options (above). With parallel_for
 * and workers > 1, the experts of each MoE layer run as parallel tasks and
 * the results are bit for bit those of colibri_forward() with the same
 * kernels. Workers beyond what the context's arena holds: COLIBRI_E_BAD_EXEC. */
COLIBRI_API colibri_status colibri_forward_ex(colibri_ctx *ctx, const colibri_exec *exec, size_t batch,
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
COLIBRI_API colibri_status colibri_set_kernels(colibri_ctx *ctx, colibri_kernel_set set);

/* The kernels a context runs: "reference", or the backend and the CPU level
 * chosen (e.g. "x86-64 avx2+fma+f16c"); "none" for no valid context. */
COLIBRI_API const char *colibri_kernels_name(const colibri_ctx *ctx);

/* Invalidates the context; the arena may then be reused. */
COLIBRI_API colibri_status colibri_free(colibri_ctx *ctx);

/* ---- Token models: MoE language models (docs/lm.md) ----
 *
 * A token model's image (format version 4) starts with an EMBED layer: its
 * input is token ids, its output one row of logits per token, and its
 * arena holds a KV cache of max_seq_len positions. colibri_forward() on it
 * is COLIBRI_E_MODEL_KIND, as every colibri_lm_* call on a feature model.
 *
 *   colibri_lm_reset(ctx);
 *   colibri_lm_forward(ctx, prompt, n, logits, vocab);          // prefill: the last row
 *   colibri_rng rng; colibri_rng_seed(&rng, 42);
 *   colibri_sampler s = {sizeof s, 0.8f, 40, 0.95f};
 *   colibri_lm_sample(ctx, &s, logits, vocab, &rng, &tok);
 *   colibri_lm_forward(ctx, &tok, 1, logits, vocab);              // one decode step
 */

/* Empties the KV cache: the next token is at position 0. */
COLIBRI_API colibri_status colibri_lm_reset(colibri_ctx *ctx);

/* The positions the cache holds: the next token's position. */
COLIBRI_API colibri_status colibri_lm_position(const colibri_ctx *ctx, uint32_t *position);

/* Runs n tokens (1 .. max_batch) at the next n positions, appending them to
 * the cache, and writes their logits [n, vocab] (logits_len = n · vocab),
 * or only the last token's [vocab] (logits_len = vocab: what a prompt needs
 * to sample the next token; the layers after the last attention layer and
 * the LM head then run for the last token alone, and its logits and the
 * cache are bit for bit those of the whole call).
 * Everything is checked before anything changes: BAD_BATCH, BUFFER_SIZE, a
 * token outside [0, vocab) BAD_TOKEN, a cache that would pass max_seq_len
 * CACHE_FULL (the cache is never overwritten: reset it). */
COLIBRI_API colibri_status colibri_lm_forward(colibri_ctx *ctx, const int32_t *tokens, uint32_t n, float *logits,
                                              size_t logits_len);

/* colibri_lm_forward() with the caller's options (colibri_exec, as
 * colibri_forward_ex(); exec NULL is colibri_lm_forward()). With
 * parallel_for and workers > 1: at one token (decode) each large matrix, the
 * experts' (W1 and W3, then W2), the attention projections (q, k and v
 * together, then o) and LINEAR layers such as the LM head, is split into
 * blocks of rows run as parallel tasks, the active experts' blocks side by
 * side; the attention heads run as parallel tasks; at several tokens
 * (prefill) the experts run as parallel tasks and large projections split
 * their tokens, as in colibri_forward_ex(). on_route sees each MoE layer's
 * routing; with an expert hook every expert is offered to it whole (decode
 * then runs experts, not row blocks, in parallel). The logits are bit for
 * bit those of colibri_lm_forward() with the same kernels, and the cache
 * ends the same. colibri_model_size_ex() gives the arena for N workers
 * (each extra worker adds one head's attention scores to its scratch).
 * Checks as colibri_lm_forward(), then the exec's (COLIBRI_E_BAD_EXEC). */
COLIBRI_API colibri_status colibri_lm_forward_ex(colibri_ctx *ctx, const colibri_exec *exec, const int32_t *tokens,
                                                 uint32_t n, float *logits, size_t logits_len);

/* The sampler's random numbers: SplitMix64, seeded by the caller. */
typedef struct colibri_rng {
    uint64_t state;
} colibri_rng;

COLIBRI_API void colibri_rng_seed(colibri_rng *rng, uint64_t seed);

typedef struct colibri_sampler {
    uint32_t struct_size;     /* sizeof(colibri_sampler) */
    float temperature;        /* 0: greedy; else > 0 and finite */
    uint32_t top_k;           /* 0: no limit */
    float top_p;              /* in (0, 1]; 1: no limit */
} colibri_sampler;

/* Draws one token from one row of logits [vocab] (docs/lm.md "Sampling"),
 * with scratch in the context's arena: greedy (temperature 0, no draw from
 * the rng), or temperature, top-k and top-p. BAD_SAMPLER for bad settings,
 * NAN_LOGITS for a NaN (sampling: or ±inf) logit. */
COLIBRI_API colibri_status colibri_lm_sample(colibri_ctx *ctx, const colibri_sampler *sampler, const float *logits,
                                             size_t logits_len, colibri_rng *rng, int32_t *token);

/* Routed experts kept in the image, summed over MoE layers. */
COLIBRI_API colibri_status colibri_get_num_experts(const void *image, size_t image_len, uint32_t *num_experts);

COLIBRI_API colibri_status colibri_get_info(const void *image, size_t image_len, colibri_model_info *info);

/* Static text for a status code; never NULL. */
COLIBRI_API const char *colibri_strerror(int status);

COLIBRI_API const char *colibri_version(void);

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_H */
