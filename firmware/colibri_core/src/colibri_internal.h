/*
 * Internals shared by the engine's source files: little-endian field readers,
 * the parsed form of each image record, the validator's summary of a model,
 * and the router table. docs/model-format.md is the layout these follow.
 */
#ifndef COLIBRI_INTERNAL_H
#define COLIBRI_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"
#include "colibri_kernels.h"

/* ---- Little-endian reads by byte loads: any alignment, any host. ---- */

static inline uint16_t colibri_rd_u16(const uint8_t *p)
{
    return (uint16_t)((unsigned)p[0] | (unsigned)p[1] << 8);
}

static inline uint32_t colibri_rd_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t colibri_rd_u64(const uint8_t *p)
{
    return (uint64_t)colibri_rd_u32(p) | (uint64_t)colibri_rd_u32(p + 4) << 32;
}

static inline float colibri_rd_f32(const uint8_t *p)
{
    uint32_t bits = colibri_rd_u32(p);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- Records, parsed. Field meanings: docs/model-format.md. ---- */

typedef struct colibri_header {
    uint32_t magic;
    uint16_t version, header_size;
    uint32_t crc32, image_size, flags;
    uint32_t input_size, output_size, max_batch;
    uint32_t tensor_count, tensor_offset;
    uint32_t layer_count, layer_offset;
    uint32_t moe_count, moe_offset;
    uint32_t expert_count, expert_offset;
    /* Version 3: the metadata the header CRC covers ends at meta_size; the
     * CRC table (one u32 per tensor) is at crc_offset. Both 0 before v3. */
    uint32_t meta_size, crc_offset;
    /* Version 4 (token models, docs/lm.md): the attention table. Both 0
     * before v4. */
    uint32_t attention_count, attention_offset;
    /* The image's bytes: image_size, in version 7 the u64 at 80 (image_size
     * then holds min(image_bytes, 0xFFFFFFFF)). Every bounds check uses it. */
    uint64_t image_bytes;
    int reserved_set;   /* nonzero if any reserved byte is nonzero */
} colibri_header;

/* A token model (docs/lm.md): every version 4 image, and a version 5 one
 * whose attention table is not empty (v5 = v4 + int4 weights, for feature
 * models too, whose attention table is empty). */
static inline int colibri_token_model(const colibri_header *h)
{
    return h->version == COLIBRI_LM_VERSION || (h->version >= COLIBRI_Q4_VERSION && h->attention_count != 0);
}

typedef struct colibri_tensor {
    uint64_t offset, nbytes; /* u32 in the record before version 7 */
    uint32_t rows, cols;
    uint8_t dtype, ndim;
    uint16_t reserved;
    uint32_t aux;
} colibri_tensor;

typedef struct colibri_layer {
    uint8_t op, kind;
    uint16_t flags;     /* COLIBRI_LAYER_FLAG_* */
    uint32_t in_features, out_features;
    uint32_t t0, t1;
    float eps;
    int reserved_set;   /* the 8 trailing reserved bytes */
} colibri_layer;

typedef struct colibri_moe {
    uint32_t d_model, route_count, expert_count, top_k;
    uint8_t routing, flags;
    uint16_t shared_count;
    uint32_t router_weight, router_bias, expert_map, first_expert, shared_gate;
    int reserved_set;
} colibri_moe;

typedef struct colibri_expert {
    uint8_t kind, activation;
    uint16_t flags;     /* COLIBRI_EXPERT_FLAG_* */
    uint32_t hidden;
    uint32_t w1, b1, w2, b2, w3, b3;
} colibri_expert;

/* An attention record (docs/lm.md "Attention record"). */
typedef struct colibri_attention {
    uint32_t d_model;
    uint16_t n_heads, n_kv_heads;
    uint32_t head_dim;
    uint32_t q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, q_norm, k_norm;
    float rope_theta, qk_norm_eps;
    uint32_t max_seq_len;
    uint8_t kv_dtype;   /* COLIBRI_DTYPE_F32 or _F16 */
    uint8_t flags;      /* COLIBRI_ATTENTION_FLAG_* */
    int reserved_set;   /* the 14 trailing reserved bytes */
} colibri_attention;

/* Record readers. The table they read must have passed its bounds check
 * (colibri_check) first. */
void colibri_read_header(const uint8_t *image, colibri_header *h);
void colibri_read_tensor(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_tensor *t);
void colibri_read_layer(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_layer *l);
void colibri_read_moe(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_moe *m);
void colibri_read_expert(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_expert *e);
void colibri_read_attention(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_attention *a);

/* Payload of tensor `index` of a validated, 4-byte aligned image; NULL for
 * COLIBRI_NONE. Payloads are 32-byte aligned within the image, so every dtype
 * (and every Q8_PARAMS field) is read in place. */
static inline const void *colibri_payload(const uint8_t *image, const colibri_header *h, uint32_t index)
{
    if (index == COLIBRI_NONE)
        return NULL;
    if (h->version >= COLIBRI_WIDE_VERSION) /* v7: a u64 offset, inside the validated image (fits size_t) */
        return image + (size_t)colibri_rd_u64(image + h->tensor_offset + (size_t)index * COLIBRI_TENSOR_WIDE_SIZE);
    return image + colibri_rd_u32(image + h->tensor_offset + (size_t)index * COLIBRI_TENSOR_SIZE);
}

/* ---- What validation learns about a model. ---- */

typedef struct colibri_model {
    colibri_header hdr;
    /* Arena dimensions, docs/model-format.md "Arena", over the MoE layers of
     * the program (MoE and expert records no layer uses are not read). */
    uint32_t width;          /* W: widest activation */
    uint32_t hidden;         /* H: largest expert hidden size */
    uint32_t routes;         /* R: largest router */
    uint32_t select;         /* K: largest selection of one token */
    uint32_t experts;        /* N: most routed experts of one MoE layer */
    uint32_t depth;          /* deepest residual stack */
    uint32_t qwidth;         /* Q: widest input row of an INT8_ACT or INT8_BLOCKS matrix, 0 if none */
    uint32_t qblocks;        /* the most activation blocks of an INT8_BLOCKS row, 0 if none */
    /* For colibri_get_info(), summed over MoE layers. */
    uint32_t moe_layers;
    uint32_t routed_experts;
    uint32_t shared_experts;
    uint64_t parameters;     /* elements of all F32, F16 and I8 tensors */
    /* Token models (docs/lm.md), all 0 for a feature model. */
    uint32_t vocab;          /* the EMBED layer's rows: token ids are below it */
    uint32_t max_seq_len;    /* positions the KV cache holds (every attention record's) */
    uint32_t attn_layers;    /* ATTENTION layers of the program */
    uint32_t q_width;        /* widest H·hd: q rows, and the attention output rows */
    uint32_t kv_width;       /* widest KVH·hd: k and v rows */
    uint32_t head_dim;       /* largest hd: one position's cos and sin */
    uint64_t kv_bytes;       /* the KV cache, every attention layer's K and V */
    /* Format v6 (docs/lm.md "Tokenizer section"): the TOKENIZER tensor's
     * index + 1, 0 without one. */
    uint32_t tokenizer;
} colibri_model;

/* The tokenizer section (docs/lm.md "Tokenizer section") of `size` bytes
 * at p against a model of `vocab` tokens: COLIBRI_OK or BAD_TOKENIZER for
 * the first fault, in the order of colibri.image.tokenizer_section.parse;
 * *work grows by the entries scanned. In colibri_image.c, so validation is
 * the same in a build without the tokenizer (COLIBRI_NO_TOKENIZER). */
colibri_status colibri_tokenizer_check(const uint8_t *p, uint32_t size, uint32_t vocab, uint64_t *work);

/* UTF-8 as Unicode Table 3-7 defines it (no overlong forms, surrogates or
 * code points past U+10FFFF), shared by the section validator, the decoder's
 * stream and the encoder. colibri_utf8_lead: the bytes a sequence starting
 * with `lead` has (1 for ASCII, 0 for a byte that starts none), *lo..*hi the
 * second byte's range. colibri_utf8_sequence: the length of the well-formed
 * sequence at p of at most n bytes, 0 if none starts there. */
uint32_t colibri_utf8_lead(uint8_t lead, uint8_t *lo, uint8_t *hi);
uint32_t colibri_utf8_sequence(const uint8_t *p, size_t n);

/* Byte strings in the token index's order: unsigned bytes, a prefix first
 * (<0, 0, >0 as memcmp; the section's index and the encoder's searches). */
static inline int colibri_bytes_compare(const uint8_t *a, uint32_t a_len, const uint8_t *b, uint32_t b_len)
{
    const uint32_t n = a_len < b_len ? a_len : b_len;
    for (uint32_t i = 0; i < n; i++)
        if (a[i] != b[i])
            return a[i] < b[i] ? -1 : 1;
    return a_len < b_len ? -1 : a_len > b_len ? 1 : 0;
}

/* Full validation (colibri_validate); fills *m on success. Reads the image
 * with byte loads only, so any image alignment is accepted here. */
colibri_status colibri_check(const void *image, size_t image_len, colibri_model *m);

/* colibri_check, also reporting in *work the table records it read and the
 * payload entries it scanned: tests bound it to show validation is linear
 * in the image size (tests/c/colibri_work.c). */
colibri_status colibri_check_work(const void *image, size_t image_len, colibri_model *m, uint64_t *work);

/* colibri_check_work with a COLIBRI_CHECK_* level: FULL is colibri_check;
 * STRUCTURE skips the per-tensor payload CRCs of a version-3 image (every
 * other check, the header CRC over the metadata included, stays). */
colibri_status colibri_check_level(const void *image, size_t image_len, colibri_model *m, uint64_t *work,
                                   uint32_t level);

/* CRC-32 (IEEE 802.3, as zlib) of n bytes. */
uint32_t colibri_crc32(const uint8_t *p, size_t n);

/* ---- Routing (colibri_router.c). ---- */

/* One MoE layer's routing parameters. */
typedef struct colibri_routing {
    const int32_t *map;  /* [R] router output -> routed expert slot, -1 if pruned */
    size_t routes;       /* R */
    size_t top_k;        /* k */
    uint32_t flags;      /* COLIBRI_MOE_FLAG_* */
} colibri_routing;

/* Routes one token: z [R] holds its router logits and may be overwritten.
 * Writes the chosen experts' slots and gate weights ([K] each) and returns
 * how many were chosen. */
typedef size_t (*colibri_route_fn)(float *z, const colibri_routing *r, float *weight, uint32_t *slot);

/* How a routing mode uses top_k, for validation and for K. */
typedef enum colibri_k_rule {
    COLIBRI_K_ONE = 1, /* top_k must be 1; one expert per token */
    COLIBRI_K_ANY,     /* top_k in 1 .. N; top_k experts per token */
    COLIBRI_K_ALL      /* top_k must be 0; every kept expert, N per token */
} colibri_k_rule;

typedef struct colibri_router {
    colibri_route_fn route;
    colibri_k_rule k_rule;
    uint32_t flags;      /* COLIBRI_MOE_FLAG_* bits this mode accepts */
} colibri_router;

/* Looks up routing mode `mode`; returns 0 if there is none. */
int colibri_router_find(uint32_t mode, colibri_router *out);

/* ---- The plan: the layer program, resolved by colibri_init() ----
 *
 * It lives in the arena after the context (colibri_engine.c), one entry per
 * layer, per MoE layer and per expert, so colibri_forward() reads no record
 * of the image. docs/model-format.md "Arena" gives each entry's bytes. */

/* How a layer's or expert's activations reach its integer weights: f32
 * (0), int8 rows with one scale per token (INT8_ACT), or int8 with one scale
 * per COLIBRI_ACT_BLOCK columns (INT8_BLOCKS). */
enum { COLIBRI_INT8_ROWS = 1, COLIBRI_INT8_BLOCKS = 2 };

/* One expert: x [n, d] -> act(x W1ᵀ + b1) (⊙ (x W3ᵀ + b3) if GLU) W2ᵀ + b2. */
typedef struct colibri_plan_expert {
    colibri_matrix w1;        /* [hidden, d] */
    colibri_matrix w2;        /* [d, hidden] */
    colibri_matrix w3;        /* [hidden, d] GLU gate path; MLP: zero, unused */
    const float *b1, *b2, *b3; /* [hidden], [d], [hidden], each or NULL */
    uint32_t hidden;
    uint8_t glu;              /* COLIBRI_EXPERT_GLU */
    uint8_t activation;       /* COLIBRI_ACT_* after w1 */
    uint8_t int8_act;         /* 0 f32 activations, COLIBRI_INT8_ROWS (INT8_ACT) or COLIBRI_INT8_BLOCKS */
} colibri_plan_expert;

/* One MOE layer: router, dispatch, its routed then shared experts. */
typedef struct colibri_plan_moe {
    colibri_matrix router;         /* [R, d] */
    colibri_matrix shared_gate;    /* [1, d]; data NULL: shared experts ungated */
    const float *router_bias;      /* [R] or NULL */
    colibri_route_fn route;        /* the routing mode's selector */
    colibri_routing routing;       /* expert map [R], R, top_k, flags */
    const colibri_plan_expert *expert; /* [n_experts routed, then shared_count shared] */
    uint32_t d;
    uint32_t first_expert;         /* image expert record of routed slot 0 (colibri_route) */
    uint16_t n_experts;            /* <= COLIBRI_MAX_ROUTES */
    uint16_t shared_count;         /* <= COLIBRI_MAX_SHARED */
} colibri_plan_moe;

/* One ATTENTION layer (docs/lm.md): projections, norms, RoPE and its
 * KV cache in the arena. */
typedef struct colibri_plan_attention {
    colibri_matrix q, k, v, o;     /* [H·hd, d], [KVH·hd, d], [KVH·hd, d], [d, H·hd] */
    const float *q_bias, *k_bias, *v_bias, *o_bias; /* each or NULL */
    const float *q_norm, *k_norm;  /* [hd] (per head) or [heads·hd], or NULL */
    void *k_cache, *v_cache;       /* [max_seq_len, KVH·hd], f32 or f16 bits */
    float rope_theta;
    float scale;                   /* hd^-0.5, as the reference rounds it */
    float eps;                     /* the q/k norms' */
    uint32_t heads, kv_heads, head_dim;
    uint8_t q_norm_per_head, k_norm_per_head; /* the norm's weight is [hd] */
    uint8_t kv_f16;                /* the cache holds f16 */
    uint8_t int8_act;              /* the projections' activations: 0 or COLIBRI_INT8_BLOCKS */
} colibri_plan_attention;

/* One layer of the program. */
typedef struct colibri_plan_layer {
    uint8_t op;               /* COLIBRI_OP_* */
    uint8_t act;              /* ACTIVATION: COLIBRI_ACT_* */
    uint8_t int8_act;         /* LINEAR: 0, COLIBRI_INT8_ROWS or COLIBRI_INT8_BLOCKS */
    uint32_t in;              /* in_features (the activation width) */
    float eps;                /* LAYERNORM, RMSNORM */
    uint32_t entry;           /* MOE: index into the plan's MoE layers; ATTENTION: into its attention layers */
    colibri_matrix w;         /* LINEAR [out, in]; EMBED the table [vocab, d] */
    const float *t0, *t1;     /* LINEAR bias [out], -; LAYERNORM gamma, beta [in]; RMSNORM gamma [in] */
} colibri_plan_layer;

#endif /* COLIBRI_INTERNAL_H */
