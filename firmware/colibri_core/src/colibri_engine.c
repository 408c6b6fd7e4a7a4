/*
 * The engine: arena layout, context, the plan, and the forward pass.
 *
 * The context, the plan and every buffer live in the caller's arena; the
 * weights are read in place from the image. colibri_init() validates the
 * image and resolves its layer program once into the plan: each layer's op,
 * dims and weight views, each MoE layer's router and experts. colibri_forward()
 * then runs the plan top to bottom on an activation x [batch, width] and reads
 * no record of the image, only weight payloads.
 */
#include "colibri_internal.h"
#include "colibri_kernels.h"
#include "colibri_math.h"

#define CTX_MAGIC 0x58424C43u /* "CLBX" */
#define COLIBRI_MAX_WORKERS 65535u

struct colibri_ctx {
    uint32_t magic;          /* CTX_MAGIC while initialised, 0 once freed */
    uint32_t workers;        /* workers the arena has scratch for (colibri_forward_ex); in magic's padding */
    uint32_t last_producer;  /* the last LINEAR or MOE layer (it may write the caller's output), or
                              * UINT32_MAX; beside magic, in what was padding before the model */
    colibri_model model;     /* header and arena dimensions (B, W, H, R, K, N) */
    colibri_kernels k;       /* the kernels the forward pass calls (colibri_kernels.h) */
    colibri_plan_layer *layer;   /* [layer_count] the program, resolved */
    colibri_plan_moe *moe;       /* [MoE layers] */
    colibri_plan_expert *expert; /* [routed + shared experts of all MoE layers] */
    float *act[2];           /* [B, W] ping-pong activations */
    float *moe_acc;          /* [B, W] MoE layer output */
    float *hidden[2];        /* [B, H] expert hidden rows: W1 path, W3 (GLU gate) path */
    float *scores;           /* [B, R] router logits -> probabilities; then the shared gate [B] */
    float *sel_weight;       /* [K] one token's chosen gate weights */
    uint32_t *sel_slot;      /* [K] and their routed expert slots */
    uint16_t *ring_token;    /* [N, B] tokens dispatched to each routed expert */
    float *ring_weight;      /* [N, B] and their gate weights */
    uint32_t *ring_count;    /* [N] entries in each ring */
    float *stack;            /* [depth, B, W] residual stack */
    int8_t *qrows;           /* [B, Q] int8 activation rows (INT8_ACT only) */
    float *qscale;           /* [B] and their dequantisation scales */
    /* Token models (docs/lm.md); unused (NULL, 0) by a feature model. */
    colibri_plan_attention *attention; /* [ATTENTION layers] */
    float *att_q;            /* [B, H·hd] queries, then each head's output in place */
    float *att_k, *att_v;    /* [B, KVH·hd] the new keys and values */
    float *att_scores;       /* [max_seq_len] one head's scores */
    float *rope;             /* [B, hd] cos (first hd/2) and sin of each row's position */
    uint32_t *sample_order;  /* [vocab] the sampler's ranking */
    uint32_t position;       /* positions in the KV cache */
};

_Static_assert(_Alignof(struct colibri_ctx) <= COLIBRI_ARENA_ALIGN, "context alignment exceeds the arena's");
_Static_assert(_Alignof(colibri_plan_layer) <= 8 && _Alignof(colibri_plan_moe) <= 8 &&
                   _Alignof(colibri_plan_expert) <= 8 && _Alignof(colibri_plan_attention) <= 8,
               "plan alignment exceeds the arena pieces' 8 bytes");

/* ---- Arena ---- */

/* Arena pieces, in address order (docs/model-format.md "Arena"). */
enum {
    P_CTX, P_PLAN_LAYERS, P_PLAN_MOES, P_PLAN_EXPERTS, P_ACT0, P_ACT1, P_MOE_ACC, P_HIDDEN0, P_HIDDEN1, P_SCORES, P_SELECT,
    P_RING_TOKEN, P_RING_WEIGHT, P_RING_COUNT, P_STACK, P_QROWS, P_QSCALE,
    /* Token models only (0 bytes otherwise): docs/lm.md "Memory". */
    P_PLAN_ATTENTION, P_KV_CACHE, P_ATT_Q, P_ATT_K, P_ATT_V, P_ATT_SCORES, P_ROPE, P_SAMPLE, P_COUNT
};

/* Byte offset of every piece, each rounded up to 8 bytes; off[P_COUNT] is
 * the total. The one computation behind colibri_model_size() and
 * colibri_init(). 64-bit: an absurd (but valid) model cannot wrap. */
static void arena_layout(const colibri_model *m, uint64_t off[P_COUNT + 1])
{
    const uint64_t B = m->hdr.max_batch, W = m->width, H = m->hidden, R = m->routes;
    const uint64_t K = m->select, N = m->experts, Q = m->qwidth, f32 = sizeof(float);
    uint64_t size[P_COUNT];

    size[P_CTX] = sizeof(struct colibri_ctx);
    /* The plan: one entry per layer, per MoE layer of the program, and per
     * expert (routed and shared) those MoE layers use. */
    size[P_PLAN_LAYERS] = (uint64_t)m->hdr.layer_count * sizeof(colibri_plan_layer);
    size[P_PLAN_MOES] = (uint64_t)m->moe_layers * sizeof(colibri_plan_moe);
    size[P_PLAN_EXPERTS] = ((uint64_t)m->routed_experts + m->shared_experts) * sizeof(colibri_plan_expert);
    size[P_ACT0] = B * W * f32;
    size[P_ACT1] = B * W * f32;
    size[P_MOE_ACC] = m->moe_layers ? B * W * f32 : 0;
    size[P_HIDDEN0] = B * H * f32;
    size[P_HIDDEN1] = B * H * f32;
    size[P_SCORES] = B * R * f32;
    size[P_SELECT] = K * (sizeof(float) + sizeof(uint32_t));
    size[P_RING_TOKEN] = N * B * sizeof(uint16_t);
    size[P_RING_WEIGHT] = N * B * f32;
    size[P_RING_COUNT] = N * sizeof(uint32_t);
    size[P_STACK] = m->depth * B * W * f32;
    /* Only with INT8_ACT (Q > 0): Q is the widest row quantised at once, a
     * LINEAR's in_features or an expert's d_model and hidden. */
    size[P_QROWS] = B * Q * sizeof(int8_t);
    size[P_QSCALE] = Q ? B * (m->qblocks > 1u ? m->qblocks : 1u) * f32 : 0; /* a scale per row, or per block */
    size[P_PLAN_ATTENTION] = (uint64_t)m->attn_layers * sizeof(colibri_plan_attention);
    size[P_KV_CACHE] = m->kv_bytes;
    size[P_ATT_Q] = B * m->q_width * f32;
    size[P_ATT_K] = B * m->kv_width * f32;
    size[P_ATT_V] = B * m->kv_width * f32;
    size[P_ATT_SCORES] = (m->attn_layers ? (uint64_t)m->max_seq_len : 0u) * f32;
    size[P_ROPE] = B * m->head_dim * f32;
    size[P_SAMPLE] = m->vocab ? (uint64_t)m->hdr.output_size * sizeof(uint32_t) : 0u;

    off[0] = 0;
    for (int i = 0; i < P_COUNT; i++)
        off[i + 1] = off[i] + ((size[i] + 7u) & ~(uint64_t)7u);
}

/* Validates the image at a level (COLIBRI_CHECK_*) and sizes its arena. */
static colibri_status size_model(const void *image, size_t image_len, colibri_model *m, uint64_t off[P_COUNT + 1],
                                 uint32_t level)
{
    uint64_t work;
    colibri_status st = colibri_check_level(image, image_len, m, &work, level);
    if (st != COLIBRI_OK)
        return st;
    arena_layout(m, off);
    /* Only reachable on 32-bit targets: no arena could hold this model. */
    if (off[P_COUNT] > SIZE_MAX)
        return COLIBRI_E_UNSUPPORTED;
    return COLIBRI_OK;
}

colibri_status colibri_model_size(const void *image, size_t image_len, size_t *arena_size)
{
    colibri_model m;
    uint64_t off[P_COUNT + 1];
    if (!image || !arena_size)
        return COLIBRI_E_NULL_ARG;
    colibri_status st = size_model(image, image_len, &m, off, COLIBRI_CHECK_STRUCTURE);
    if (st != COLIBRI_OK)
        return st;
    *arena_size = (size_t)off[P_COUNT];
    return COLIBRI_OK;
}

/* ---- The parallel region: what workers > 1 add (colibri_model_size_ex) ----
 *
 * After the arena of colibri_model_size(): the staging rows every expert of a
 * MoE layer writes its gated output to before the ordered merge ([B (K + S), W]
 * f32, S the shared experts of all MoE layers: a bound on one layer's), the task
 * table (slot, first staging row, status for each of N + S tasks), then, for
 * each worker from 1 on, its own expert scratch: two hidden buffers [B, H] and,
 * with INT8_ACT, int8 rows [B, Q] and their scales [B]. Worker 0 uses the
 * context's own. */
static uint64_t round8(uint64_t n)
{
    return (n + 7u) & ~(uint64_t)7u;
}

/* Rows per block when a token model's decode splits a matrix across the
 * workers: a multiple of every backend's row blocking (8 at most), so each
 * block's rows are computed as in one call over the whole matrix. */
#define LM_ROWS 64u

static uint64_t lm_blocks(uint64_t rows)
{
    return (rows + LM_ROWS - 1u) / LM_ROWS;
}

/* A token model's share of the parallel region, after the feature path's:
 * the hidden rows [K + S, H] of one token's active experts (decode), then a
 * status per task of its parallel loops (the most any loop has: expert row
 * blocks, attention heads); each worker from 1 on also keeps one head's
 * attention scores [max_seq_len]. All 0 for a feature model. */
static void lm_exec_layout(const colibri_model *m, uint64_t *hidden, uint64_t *status, uint64_t *scores)
{
    *hidden = *status = *scores = 0;
    if (!m->vocab)
        return;
    const uint64_t active = (uint64_t)m->select + m->shared_experts;
    const uint64_t widest = m->hidden > m->width ? m->hidden : m->width;
    uint64_t tasks = active * lm_blocks(widest);
    if (tasks < m->q_width) /* heads <= q_width */
        tasks = m->q_width;
    *hidden = round8(active * m->hidden * sizeof(float));
    *status = round8(tasks * sizeof(int32_t));
    *scores = m->attn_layers ? round8((uint64_t)m->max_seq_len * sizeof(float)) : 0u;
}

static void exec_layout(const colibri_model *m, uint64_t *fixed, uint64_t *per_worker)
{
    const uint64_t B = m->hdr.max_batch, W = m->width, H = m->hidden, Q = m->qwidth;
    const uint64_t K = m->select, S = m->shared_experts, tasks = (uint64_t)m->experts + S;
    uint64_t lm_hidden, lm_status, lm_scores;
    lm_exec_layout(m, &lm_hidden, &lm_status, &lm_scores);
    const uint64_t scales = m->qblocks > 1u ? m->qblocks : 1u; /* INT8_BLOCKS: a scale per block of a row */
    *fixed = round8(B * (K + S) * W * sizeof(float)) + round8(tasks * 3u * sizeof(uint32_t)) + lm_hidden + lm_status;
    *per_worker = 2u * round8(B * H * sizeof(float)) + round8(B * Q) + (Q ? round8(B * scales * sizeof(float)) : 0u) +
                  lm_scores;
}

colibri_status colibri_model_size_ex(const void *image, size_t image_len, size_t workers, size_t *arena_size)
{
    colibri_model m;
    uint64_t off[P_COUNT + 1], fixed, per;
    if (!image || !arena_size)
        return COLIBRI_E_NULL_ARG;
    colibri_status st = size_model(image, image_len, &m, off, COLIBRI_CHECK_STRUCTURE);
    if (st != COLIBRI_OK)
        return st;
    /* size_model checked the base fits size_t. Divisions in size_t: a
     * 32-bit target has no 64-bit divide instruction (and a MicroPython
     * native module no libgcc to supply one). */
    size_t total = (size_t)off[P_COUNT];
    if (workers > 1) {
        exec_layout(&m, &fixed, &per);
        /* No arena could hold absurd worker counts: nothing wraps. */
        if (fixed > SIZE_MAX - total || per > SIZE_MAX)
            return COLIBRI_E_UNSUPPORTED;
        total += (size_t)fixed;
        if (per && workers - 1 > (SIZE_MAX - total) / (size_t)per)
            return COLIBRI_E_UNSUPPORTED;
        total += (workers - 1) * (size_t)per;
    }
    *arena_size = total;
    return COLIBRI_OK;
}

/* Workers an arena of arena_size bytes holds scratch for (>= 1). */
static uint32_t arena_workers(const colibri_model *m, uint64_t base, size_t arena_size)
{
    uint64_t fixed, per;
    exec_layout(m, &fixed, &per);
    if (arena_size < base + fixed + per)
        return 1;
    if (per == 0)
        return COLIBRI_MAX_WORKERS;
    /* All below arena_size: size_t division (no 64-bit divide on 32-bit targets). */
    const size_t w = 1u + (arena_size - (size_t)base - (size_t)fixed) / (size_t)per;
    return w > COLIBRI_MAX_WORKERS ? COLIBRI_MAX_WORKERS : (uint32_t)w;
}

/* ---- Building the plan (init only: the records are read here, once) ---- */

static const float *f32_tensor(const uint8_t *image, const colibri_header *hdr, uint32_t index)
{
    return colibri_payload(image, hdr, index);
}

#if defined(__GNUC__)
#define NOINLINE __attribute__((noinline))
#else
#define NOINLINE
#endif

/* Fills *w, the kernel's view of weight tensor `index` (F32, F16, I8 or I4,
 * validated), an I8 one with its Q8_PARAMS scales and compensation term, an
 * I4 one with its Q4_PARAMS group scales, bias and compensation term;
 * all zero for COLIBRI_NONE. The plan entries are written in place, field
 * by field, so init needs no struct-sized temporaries on a small stack;
 * not inlined, so its record buffer sits in one frame, not in plan_expert's
 * once for each of w1, w2 and w3. */
static NOINLINE void weight(colibri_matrix *w, const uint8_t *image, const colibri_header *hdr, uint32_t index)
{
    memset(w, 0, sizeof *w);
    if (index == COLIBRI_NONE)
        return;
    colibri_tensor t;
    colibri_read_tensor(image, hdr, index, &t);
    w->dtype = t.dtype;
    w->rows = t.rows;
    w->cols = t.cols;
    w->data = image + t.offset;
    if (t.dtype == COLIBRI_DTYPE_I8) {
        /* docs/model-format.md "Quantised weights": the header, scale [rows]
         * (f32, or f16 in v2), the bias [rows] (v2 with BIAS), then (nnz > 0)
         * row_ptr [rows + 1], col [nnz], value [nnz], each field at a multiple
         * of its element size. The offsets colibri_q8_layout_of() validated,
         * here in size_t (they lie inside the image) and without its
         * 64-bit struct, which would sit on init's stack. */
        colibri_read_tensor(image, hdr, t.aux, &t);
        const uint8_t *p = image + t.offset;
        const size_t rows = w->rows, nnz = colibri_rd_u32(p);
        const int v2 = hdr->version >= 2u;
        const size_t param = v2 && p[4] == COLIBRI_DTYPE_F16 ? 2u : 4u;
        w->q8_f16 = param == 2u;
        w->q8_bias = v2 && (p[5] & COLIBRI_Q8_FLAG_BIAS);
        w->q8_ptr = nnz == 0 ? 0u : (!v2 || nnz > 0xFFFFu) ? 4u : nnz > 0xFFu ? 2u : 1u;
        w->q8_nnz = (uint32_t)nnz;
        w->scale = p + COLIBRI_Q8_PARAMS_HEADER;
        if (nnz) {
            const size_t ptr = w->q8_ptr;
            size_t pos = COLIBRI_Q8_PARAMS_HEADER + param * rows * (w->q8_bias ? 2u : 1u);
            pos = (pos + ptr - 1u) & ~(ptr - 1u);
            w->row_ptr = p + pos;
            pos = (pos + ptr * (rows + 1u) + 1u) & ~(size_t)1u;
            w->col = (const uint16_t *)(const void *)(p + pos);
            pos += 2u * nnz;
            if (!v2) /* v1 pads the columns to 4 bytes */
                pos = (pos + 3u) & ~(size_t)3u;
            w->val = (const uint16_t *)(const void *)(p + pos);
        }
    } else if (t.dtype == COLIBRI_DTYPE_I4) {
        /* docs/model-format.md "Quantised weights: I4 with Q4_PARAMS": the
         * header, f16 scales [rows · G], the f16 bias [rows] (BIAS), then E
         * laid out as a v2 Q8_PARAMS's; the offsets colibri_q4_layout_of()
         * validated. The bias goes through q4_bias, so q8_bias stays 0 and
         * colibri_q8_compensate() adds E only. */
        colibri_read_tensor(image, hdr, t.aux, &t);
        const uint8_t *p = image + t.offset;
        const size_t rows = w->rows, nnz = colibri_rd_u32(p);
        const uint32_t g_log2 = p[4];
        const size_t groups = ((size_t)w->cols + ((size_t)1 << g_log2) - 1u) >> g_log2;
        w->q8_f16 = 1;
        w->q8_ptr = nnz == 0 ? 0u : nnz > 0xFFFFu ? 4u : nnz > 0xFFu ? 2u : 1u;
        w->q8_nnz = (uint32_t)nnz;
        w->q4_group_log2 = g_log2;
        w->q4_groups = (uint32_t)groups;
        w->scale = p + COLIBRI_Q4_PARAMS_HEADER;
        size_t pos = COLIBRI_Q4_PARAMS_HEADER + 2u * rows * groups;
        if (p[5] & COLIBRI_Q4_FLAG_BIAS) {
            w->q4_bias = (const uint16_t *)(const void *)(p + pos);
            pos += 2u * rows;
        }
        if (nnz) {
            const size_t ptr = w->q8_ptr;
            pos = (pos + ptr - 1u) & ~(ptr - 1u);
            w->row_ptr = p + pos;
            pos = (pos + ptr * (rows + 1u) + 1u) & ~(size_t)1u;
            w->col = (const uint16_t *)(const void *)(p + pos);
            pos += 2u * nnz;
            w->val = (const uint16_t *)(const void *)(p + pos);
        }
    }
}

static void plan_expert(colibri_plan_expert *p, const uint8_t *image, const colibri_header *hdr, uint32_t index)
{
    colibri_expert e;
    colibri_read_expert(image, hdr, index, &e);
    const int glu = e.kind == COLIBRI_EXPERT_GLU;
    weight(&p->w1, image, hdr, e.w1);
    weight(&p->w2, image, hdr, e.w2);
    weight(&p->w3, image, hdr, glu ? e.w3 : COLIBRI_NONE);
    p->b1 = f32_tensor(image, hdr, e.b1);
    p->b2 = f32_tensor(image, hdr, e.b2);
    p->b3 = glu ? f32_tensor(image, hdr, e.b3) : NULL;
    p->hidden = e.hidden;
    p->glu = (uint8_t)glu;
    p->activation = e.activation;
    p->int8_act = (e.flags & COLIBRI_EXPERT_FLAG_INT8_BLOCKS) ? COLIBRI_INT8_BLOCKS
                  : (e.flags & COLIBRI_EXPERT_FLAG_INT8_ACT)  ? COLIBRI_INT8_ROWS
                                                              : 0;
}

/* MOE layer record `index`: its entry, and its routed then shared experts
 * from *expert on. */
static void plan_moe(colibri_plan_moe *p, colibri_plan_expert *expert, const uint8_t *image,
                     const colibri_header *hdr, uint32_t index)
{
    colibri_moe r;
    colibri_router router;
    colibri_read_moe(image, hdr, index, &r);
    (void)colibri_router_find(r.routing, &router); /* validated: always found */
    weight(&p->router, image, hdr, r.router_weight);
    weight(&p->shared_gate, image, hdr, r.shared_gate);
    p->router_bias = f32_tensor(image, hdr, r.router_bias);
    p->route = router.route;
    p->routing.map = colibri_payload(image, hdr, r.expert_map);
    p->routing.routes = r.route_count;
    /* Every kept expert (top_k 0, validated) is at most the layer's N: the
     * bound route_dense keeps to if the map changes in place after init. */
    p->routing.top_k = router.k_rule == COLIBRI_K_ALL ? r.expert_count : r.top_k;
    p->routing.flags = r.flags;
    p->expert = expert;
    p->d = r.d_model;
    p->first_expert = r.first_expert;
    p->n_experts = (uint16_t)r.expert_count;    /* validated <= COLIBRI_MAX_ROUTES */
    p->shared_count = (uint16_t)r.shared_count; /* validated <= COLIBRI_MAX_SHARED */
    for (uint32_t j = 0; j < r.expert_count + r.shared_count; j++)
        plan_expert(&expert[j], image, hdr, r.first_expert + j);
}

/* ATTENTION layer record `index`: its entry, its K and V caches from
 * *cache on (advanced past them). */
static void plan_attention(colibri_plan_attention *p, uint8_t **cache, const uint8_t *image,
                           const colibri_header *hdr, uint32_t index)
{
    colibri_attention a;
    colibri_read_attention(image, hdr, index, &a);
    weight(&p->q, image, hdr, a.q_w);
    weight(&p->k, image, hdr, a.k_w);
    weight(&p->v, image, hdr, a.v_w);
    weight(&p->o, image, hdr, a.o_w);
    p->q_bias = f32_tensor(image, hdr, a.q_b);
    p->k_bias = f32_tensor(image, hdr, a.k_b);
    p->v_bias = f32_tensor(image, hdr, a.v_b);
    p->o_bias = f32_tensor(image, hdr, a.o_b);
    p->q_norm = f32_tensor(image, hdr, a.q_norm);
    p->k_norm = f32_tensor(image, hdr, a.k_norm);
    p->heads = a.n_heads;
    p->kv_heads = a.n_kv_heads;
    p->head_dim = a.head_dim;
    /* A norm weight is [hd] or [heads · hd] (validated); heads = 1 makes both the same. */
    p->q_norm_per_head = 0;
    p->k_norm_per_head = 0;
    if (a.q_norm != COLIBRI_NONE) {
        colibri_tensor t;
        colibri_read_tensor(image, hdr, a.q_norm, &t);
        p->q_norm_per_head = t.rows == a.head_dim;
    }
    if (a.k_norm != COLIBRI_NONE) {
        colibri_tensor t;
        colibri_read_tensor(image, hdr, a.k_norm, &t);
        p->k_norm_per_head = t.rows == a.head_dim;
    }
    p->rope_theta = a.rope_theta;
    /* hd^-0.5 in double, rounded once to float: numpy's and PyTorch's
     * (a Python float scalar) scaling. The double square root is one Newton
     * step from the FPU's float one, so no libm sqrt is linked where double
     * is emulated; it gives the same float as 1/sqrt(hd) for every hd up to
     * 2^20 (checked exhaustively). */
    const double root_f = (double)__builtin_sqrtf((float)a.head_dim);
    const double root = 0.5 * (root_f + (double)a.head_dim / root_f);
    p->scale = (float)(1.0 / root);
    p->eps = a.qk_norm_eps;
    p->kv_f16 = a.kv_dtype == COLIBRI_DTYPE_F16;
    p->int8_act = (a.flags & COLIBRI_ATTENTION_FLAG_INT8_BLOCKS) ? COLIBRI_INT8_BLOCKS : 0;
    const size_t rows = (size_t)a.max_seq_len * a.n_kv_heads * a.head_dim * (p->kv_f16 ? 2u : 4u);
    p->k_cache = *cache;
    p->v_cache = *cache + rows;
    *cache += 2u * rows;
}

/* Resolves the validated program of c->model into the plan arrays the
 * context points at, which arena_layout sized from the same counts. Kept
 * out of colibri_init: inlined, its record buffers would sit in the same
 * frame as init's model summary and offsets, and raise the stack
 * high-water mark a device reserves for init. */
static NOINLINE void build_plan(colibri_ctx *c, const uint8_t *image, uint8_t *kv_cache)
{
    const colibri_header *hdr = &c->model.hdr;
    uint32_t n_moe = 0, n_expert = 0, n_attention = 0;
    uint8_t *cache = kv_cache;

    c->last_producer = UINT32_MAX;
    for (uint32_t i = 0; i < hdr->layer_count; i++) {
        colibri_layer l;
        colibri_read_layer(image, hdr, i, &l);
        colibri_plan_layer *p = &c->layer[i];
        const int linear = l.op == COLIBRI_OP_LINEAR, moe = l.op == COLIBRI_OP_MOE;
        const int embed = l.op == COLIBRI_OP_EMBED, attention = l.op == COLIBRI_OP_ATTENTION;
        p->op = l.op;
        p->act = l.op == COLIBRI_OP_ACTIVATION ? l.kind : 0;
        p->int8_act = (l.flags & COLIBRI_LAYER_FLAG_INT8_BLOCKS) ? COLIBRI_INT8_BLOCKS
                      : (l.flags & COLIBRI_LAYER_FLAG_INT8_ACT)  ? COLIBRI_INT8_ROWS
                                                                 : 0;
        p->in = l.in_features;
        p->eps = l.eps;
        p->entry = 0;
        if (linear || moe)
            c->last_producer = i;
        weight(&p->w, image, hdr, linear || embed ? l.t0 : COLIBRI_NONE);
        p->t0 = linear || moe || embed || attention ? NULL : f32_tensor(image, hdr, l.t0);
        p->t1 = f32_tensor(image, hdr, l.t1);
        if (moe) {
            p->entry = n_moe;
            plan_moe(&c->moe[n_moe++], &c->expert[n_expert], image, hdr, l.t0);
            n_expert += c->moe[p->entry].n_experts + c->moe[p->entry].shared_count;
        }
        if (attention) {
            p->entry = n_attention;
            plan_attention(&c->attention[n_attention++], &cache, image, hdr, l.t0);
        }
    }
}

colibri_status colibri_init(colibri_ctx **out, void *arena, size_t arena_size,
                            const void *image, size_t image_len)
{
    return colibri_init_ex(out, arena, arena_size, image, image_len, COLIBRI_CHECK_FULL);
}

colibri_status colibri_init_ex(colibri_ctx **out, void *arena, size_t arena_size,
                               const void *image, size_t image_len, uint32_t level)
{
    if (!out)
        return COLIBRI_E_NULL_ARG;
    *out = NULL;
    if (!arena || !image)
        return COLIBRI_E_NULL_ARG;
    if ((uintptr_t)image % 4u != 0)
        return COLIBRI_E_IMAGE_ALIGN;
    if ((uintptr_t)arena % COLIBRI_ARENA_ALIGN != 0)
        return COLIBRI_E_ARENA_ALIGN;

    if (level != COLIBRI_CHECK_FULL && level != COLIBRI_CHECK_STRUCTURE)
        return COLIBRI_E_UNSUPPORTED;

    colibri_model m;
    uint64_t off[P_COUNT + 1];
    colibri_status st = size_model(image, image_len, &m, off, level);
    if (st != COLIBRI_OK)
        return st;
    if (off[P_COUNT] > arena_size)
        return COLIBRI_E_ARENA_TOO_SMALL;

    uint8_t *base = arena;
    colibri_ctx *c = arena;
    c->model = m;
    c->layer = (colibri_plan_layer *)(void *)(base + off[P_PLAN_LAYERS]);
    c->moe = (colibri_plan_moe *)(void *)(base + off[P_PLAN_MOES]);
    c->expert = (colibri_plan_expert *)(void *)(base + off[P_PLAN_EXPERTS]);
    c->act[0] = (float *)(void *)(base + off[P_ACT0]);
    c->act[1] = (float *)(void *)(base + off[P_ACT1]);
    c->moe_acc = (float *)(void *)(base + off[P_MOE_ACC]);
    c->hidden[0] = (float *)(void *)(base + off[P_HIDDEN0]);
    c->hidden[1] = (float *)(void *)(base + off[P_HIDDEN1]);
    c->scores = (float *)(void *)(base + off[P_SCORES]);
    c->sel_weight = (float *)(void *)(base + off[P_SELECT]);
    c->sel_slot = (uint32_t *)(void *)(c->sel_weight + m.select);
    c->ring_token = (uint16_t *)(void *)(base + off[P_RING_TOKEN]);
    c->ring_weight = (float *)(void *)(base + off[P_RING_WEIGHT]);
    c->ring_count = (uint32_t *)(void *)(base + off[P_RING_COUNT]);
    c->stack = (float *)(void *)(base + off[P_STACK]);
    c->qrows = (int8_t *)(void *)(base + off[P_QROWS]);
    c->qscale = (float *)(void *)(base + off[P_QSCALE]);
    c->attention = (colibri_plan_attention *)(void *)(base + off[P_PLAN_ATTENTION]);
    c->att_q = (float *)(void *)(base + off[P_ATT_Q]);
    c->att_k = (float *)(void *)(base + off[P_ATT_K]);
    c->att_v = (float *)(void *)(base + off[P_ATT_V]);
    c->att_scores = (float *)(void *)(base + off[P_ATT_SCORES]);
    c->rope = (float *)(void *)(base + off[P_ROPE]);
    c->sample_order = (uint32_t *)(void *)(base + off[P_SAMPLE]);
    c->position = 0;
    c->workers = arena_workers(&m, off[P_COUNT], arena_size);
    build_plan(c, image, base + off[P_KV_CACHE]);
    colibri_kernels_optimised(&c->k);
    c->magic = CTX_MAGIC;
    *out = c;
    return COLIBRI_OK;
}

colibri_status colibri_set_kernels(colibri_ctx *ctx, colibri_kernel_set set)
{
    if (!ctx)
        return COLIBRI_E_NULL_ARG;
    if (ctx->magic != CTX_MAGIC)
        return COLIBRI_E_BAD_CONTEXT;
    switch (set) {
    case COLIBRI_KERNELS_OPTIMISED:
        colibri_kernels_optimised(&ctx->k);
        return COLIBRI_OK;
    case COLIBRI_KERNELS_REFERENCE:
        colibri_kernels_reference(&ctx->k);
        return COLIBRI_OK;
    default:
        return COLIBRI_E_UNSUPPORTED;
    }
}

const char *colibri_kernels_name(const colibri_ctx *ctx)
{
    if (!ctx || ctx->magic != CTX_MAGIC)
        return "none";
    return ctx->k.name;
}

colibri_status colibri_free(colibri_ctx *ctx)
{
    if (!ctx)
        return COLIBRI_E_NULL_ARG;
    if (ctx->magic != CTX_MAGIC)
        return COLIBRI_E_BAD_CONTEXT;
    ctx->magic = 0;
    return COLIBRI_OK;
}

/* ---- Forward pass ---- */

/* One worker's expert scratch: hidden rows [B, H] (W1 path, W3 path) and,
 * with INT8_ACT, int8 rows [B, Q] and their scales [B]. */
typedef struct scratch {
    float *h0, *h1;
    int8_t *q;
    float *qa;
    float *scores;           /* token models: one head's attention scores [max_seq_len] */
} scratch;

/* The options of one forward pass, as colibri_forward_ex() read them; NULL
 * in colibri_forward(). */
typedef struct run_opts {
    colibri_exec exec;
    uint8_t *region;         /* the parallel region (workers > 1), else NULL */
    uint64_t fixed, per;     /* its layout (exec_layout) */
} run_opts;

static scratch worker_scratch(const colibri_ctx *c, const run_opts *o, size_t worker)
{
    if (worker == 0 || !o || !o->region)
        return (scratch){c->hidden[0], c->hidden[1], c->qrows, c->qscale, c->att_scores};
    const colibri_model *m = &c->model;
    const uint64_t B = m->hdr.max_batch, H = m->hidden, Q = m->qwidth;
    uint8_t *p = o->region + o->fixed + (worker - 1u) * o->per;
    scratch s;
    s.h0 = (float *)(void *)p;
    p += round8(B * H * sizeof(float));
    s.h1 = (float *)(void *)p;
    p += round8(B * H * sizeof(float));
    s.q = (int8_t *)(void *)p;
    p += round8(B * Q);
    s.qa = (float *)(void *)p;
    p += Q ? round8(B * (m->qblocks > 1u ? m->qblocks : 1u) * sizeof(float)) : 0u; /* as exec_layout */
    s.scores = (float *)(void *)p;
    return s;
}

/* The parallel region's task table (exec_layout): after the staging rows. */
static uint32_t *region_tasks(const colibri_ctx *c, const run_opts *o)
{
    const colibri_model *m = &c->model;
    return (uint32_t *)(void *)(o->region + round8((uint64_t)m->hdr.max_batch * (m->select + m->shared_experts) *
                                                   m->width * sizeof(float)));
}

/* A token model's part of the region (lm_exec_layout): the active experts'
 * hidden rows and the task statuses, after the task table. */
static void lm_region(const colibri_ctx *c, const run_opts *o, float **hidden, int32_t **status)
{
    const colibri_model *m = &c->model;
    uint64_t lm_hidden, lm_status, lm_scores;
    lm_exec_layout(m, &lm_hidden, &lm_status, &lm_scores);
    uint8_t *p = (uint8_t *)region_tasks(c, o) + round8(((uint64_t)m->experts + m->shared_experts) * 3u * sizeof(uint32_t));
    *hidden = (float *)(void *)p;
    *status = (int32_t *)(void *)(p + lm_hidden);
}

/* GCC would turn moe_forward's clearing loops back into memset calls; the
 * buffers they clear are small (a MoE layer's output rows, its ring
 * counts), where newlib's memset costs more than the stores. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_MEMSET_LOOP __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define NO_MEMSET_LOOP
#endif

/* Quantises n rows of x (through the index list rows, or 0 .. n-1) into the
 * scratch's int8 rows; returns the view the linear kernels take. */
static colibri_qrows quantize(const colibri_ctx *c, const scratch *sc, uint8_t mode, const float *x,
                              const uint16_t *rows, size_t n, size_t in)
{
    if (mode == COLIBRI_INT8_BLOCKS)
        c->k.quantize_blocks(x, rows, n, in, sc->q, sc->qa);
    else
        c->k.quantize_rows(x, rows, n, in, sc->q, sc->qa);
    return (colibri_qrows){sc->q, sc->qa};
}

/* The linear kernels for an activation mode: the block form's, or those
 * taking f32 or per-row int8 activations. */
static colibri_linear_fn linear_for(const colibri_ctx *c, uint8_t mode)
{
    return mode == COLIBRI_INT8_BLOCKS ? c->k.linear_blocks : c->k.linear;
}

static colibri_linear_acc_fn linear_acc_for(const colibri_ctx *c, uint8_t mode)
{
    return mode == COLIBRI_INT8_BLOCKS ? c->k.linear_acc_blocks : c->k.linear_acc;
}

/* y[yrows[i]] += scale[i] · expert(x[xrows[i]]) for i < n (an index list
 * NULL: 0 .. n-1; scale NULL: 1). The n input rows are read in place through
 * the index list; the hidden rows [n, H] are compact. With INT8_ACT the x
 * rows are quantised once for w1 and w3, the hidden rows again for w2. */
static void expert_forward(const colibri_ctx *c, const scratch *sc, const colibri_plan_expert *e, const float *x,
                           size_t d, const uint16_t *xrows, size_t n, const float *scale, const uint16_t *yrows,
                           float *y)
{
    const size_t hid = e->hidden;
    float *h = sc->h0;
    colibri_qrows q = {NULL, NULL};

    const colibri_linear_fn linear = linear_for(c, e->int8_act);
    if (e->int8_act)
        q = quantize(c, sc, e->int8_act, x, xrows, n, d);
    linear(x, xrows, n, &e->w1, e->b1, e->int8_act ? &q : NULL, h);
    c->k.activation(h, n * hid, e->activation);
    if (e->glu) {
        float *g = sc->h1;
        linear(x, xrows, n, &e->w3, e->b3, e->int8_act ? &q : NULL, g);
        c->k.mul(h, g, n * hid);
    }
    if (e->int8_act)
        q = quantize(c, sc, e->int8_act, h, NULL, n, hid);
    linear_acc_for(c, e->int8_act)(h, n, &e->w2, e->b2, yrows, scale, e->int8_act ? &q : NULL, y);
}

/* expert_forward, offered first to the caller's expert hook (if any). */
static colibri_status run_expert(const colibri_ctx *c, const run_opts *o, size_t worker, uint32_t layer,
                                 const colibri_plan_moe *moe, size_t slot, const float *x, const uint16_t *xrows,
                                 size_t n, const float *scale, const uint16_t *yrows, float *y)
{
    const colibri_plan_expert *e = &moe->expert[slot];
    if (o && o->exec.expert) {
        colibri_expert_call call;
        call.struct_size = (uint32_t)sizeof call;
        call.layer = layer;
        call.expert = moe->first_expert + (uint32_t)slot;
        call.d = moe->d;
        call.hidden = e->hidden;
        call.kind = e->glu ? COLIBRI_EXPERT_GLU : COLIBRI_EXPERT_MLP;
        call.activation = e->activation;
        call.worker = (uint32_t)worker;
        call.w1 = e->w1.data;
        call.w2 = e->w2.data;
        call.w3 = e->w3.data;
        call.b1 = e->b1;
        call.b2 = e->b2;
        call.b3 = e->b3;
        call.n = n;
        call.x = x;
        call.x_rows = xrows;
        call.gate = scale;
        call.y = y;
        call.y_rows = yrows;
        const colibri_status st = o->exec.expert(o->exec.expert_user, &call);
        if (st == COLIBRI_OK || st < 0)
            return st;
        if (st != COLIBRI_EXPERT_DECLINED)
            return COLIBRI_E_BAD_EXEC;
    }
    const scratch sc = worker_scratch(c, o, worker);
    expert_forward(c, &sc, e, x, moe->d, xrows, n, scale, yrows, y);
    return COLIBRI_OK;
}

/* The parallel experts of one MoE layer: task t runs expert slot task[t]
 * (routed slots, then n_experts + i for shared expert i) into staging rows
 * from row[t] on; status[t] is its outcome. */
typedef struct par_layer {
    const colibri_ctx *c;
    const run_opts *o;
    const colibri_plan_moe *moe;
    uint32_t layer;
    const float *x;
    const float *gate;       /* shared experts' gate [batch], or NULL */
    size_t batch;
    float *stage;
    uint32_t *task, *row;
    int32_t *status;
} par_layer;

static void expert_task(void *arg, size_t t, size_t worker)
{
    const par_layer *a = arg;
    const colibri_ctx *c = a->c;
    const size_t slot = a->task[t], d = a->moe->d, batch = a->batch;
    const int routed = slot < a->moe->n_experts;
    const size_t n = routed ? c->ring_count[slot] : batch;
    float *y = a->stage + (size_t)a->row[t] * d;

    if (worker >= a->o->exec.workers) { /* the parallel_for broke its contract */
        a->status[t] = COLIBRI_E_BAD_EXEC;
        return;
    }
    /* -0 + v is v for every v (and -0 + +0 = +0): a staging row holds each
     * gated output exactly as the single-threaded accumulation adds it. */
    for (size_t i = 0; i < n * d; i++)
        y[i] = -0.0f;
    a->status[t] = run_expert(c, a->o, worker, a->layer, a->moe, slot, a->x,
                              routed ? c->ring_token + slot * batch : NULL, n,
                              routed ? c->ring_weight + slot * batch : a->gate, NULL, y);
}

/* ---- Token models on workers (colibri_lm_forward_ex) ----
 *
 * At one token (decode) the work is matrix-vector products: a large matrix
 * is cut into blocks of LM_ROWS rows, each block a matrix of its own read in
 * place (matrix_rows), and the blocks are the parallel tasks. Every output
 * element is computed by the same kernel over the same inputs as in one call
 * over the whole matrix, so the bits do not depend on the split. */

/* A parallel loop at decode is worth its hand-off (a wake-up of the pool's
 * threads, some microseconds) from this many MACs on: a matrix of 128K
 * weights, about 10-40 us of one core's kernels. The heads' loop, whose
 * tasks touch the KV cache rather than weights, from a quarter of it. */
#define LM_PAR_MIN_MACS (1u << 17)
#define LM_PAR_MIN_HEAD_MACS (LM_PAR_MIN_MACS / 4u)

/* Whether this pass runs a token model on several workers. */
static int lm_parallel(const colibri_ctx *c, const run_opts *o)
{
    return o && o->region && c->model.vocab;
}

/* Whether some rows of w make a matrix of their own: every dtype but I8
 * with the bias in its companion (read at parameter rows + o, past all the
 * scales: a view of fewer rows would misplace it). Such a matrix runs whole. */
static int rows_splittable(const colibri_matrix *w)
{
    return !(w->dtype == COLIBRI_DTYPE_I8 && w->q8_bias);
}

static size_t row_blocks(const colibri_matrix *w)
{
    return rows_splittable(w) ? (size_t)lm_blocks(w->rows) : 1u;
}

/* Block b of `blocks` over `rows` rows: its first row (*r0) and row count. */
static size_t block_rows(size_t rows, size_t blocks, size_t b, size_t *r0)
{
    if (blocks == 1) {
        *r0 = 0;
        return rows;
    }
    *r0 = b * LM_ROWS;
    return rows - *r0 < LM_ROWS ? rows - *r0 : LM_ROWS;
}

/* Rows [r0, r0 + n) of w (rows_splittable) as a matrix, read in place: the
 * payload, scales, companion bias and E's row pointers from row r0 on (E's
 * entries are indexed from the pointers, so col and val stay). */
static colibri_matrix matrix_rows(const colibri_matrix *w, size_t r0, size_t n)
{
    colibri_matrix v = *w;
    const size_t cols = w->cols;
    if (n == w->rows)
        return v;
    v.rows = (uint32_t)n;
    switch (w->dtype) {
    case COLIBRI_DTYPE_F16:
        v.data = (const uint16_t *)w->data + r0 * cols;
        break;
    case COLIBRI_DTYPE_I8:
        v.data = (const int8_t *)w->data + r0 * cols;
        v.scale = w->q8_f16 ? (const void *)((const uint16_t *)w->scale + r0) : (const void *)((const float *)w->scale + r0);
        break;
    case COLIBRI_DTYPE_I4:
        v.data = (const uint8_t *)w->data + r0 * ((cols + 1u) >> 1);
        v.scale = (const uint16_t *)w->scale + r0 * w->q4_groups;
        if (w->q4_bias)
            v.q4_bias = w->q4_bias + r0;
        break;
    default: /* F32 */
        v.data = (const float *)w->data + r0 * cols;
        break;
    }
    if (w->q8_ptr)
        v.row_ptr = (const uint8_t *)w->row_ptr + r0 * w->q8_ptr;
    return v;
}

/* y = x Wᵀ + b for one row x, in row blocks. */
typedef struct row_piece {
    const colibri_matrix *w;
    const float *b, *x;      /* b [rows] or NULL */
    const colibri_qrows *xq; /* x's int8 row, or NULL */
    float *y;                /* [rows] */
    size_t blocks;
    uint8_t mode;            /* xq's activation mode (INT8_ACT or INT8_BLOCKS) */
} row_piece;

/* Up to three matrices over one loop (q, k and v). */
typedef struct row_job {
    const colibri_ctx *c;
    row_piece piece[3];
    size_t pieces;
} row_job;

static void row_task(void *arg, size_t t, size_t worker)
{
    const row_job *j = arg;
    size_t p = 0, r0;
    (void)worker; /* no scratch: a block writes its own rows of y */
    while (t >= j->piece[p].blocks)
        t -= j->piece[p++].blocks;
    const row_piece *pc = &j->piece[p];
    const size_t n = block_rows(pc->w->rows, pc->blocks, t, &r0);
    const colibri_matrix w = matrix_rows(pc->w, r0, n);
    linear_for(j->c, pc->mode)(pc->x, NULL, 1, &w, pc->b ? pc->b + r0 : NULL, pc->xq, pc->y + r0);
}

static NOINLINE colibri_status run_rows(const run_opts *o, row_job *j)
{
    size_t tasks = 0;
    for (size_t p = 0; p < j->pieces; p++)
        tasks += j->piece[p].blocks = row_blocks(j->piece[p].w);
    return o->exec.parallel_for(o->exec.parallel_for_user, row_task, j, tasks);
}

/* The first failure among n task statuses, or COLIBRI_OK. */
static colibri_status first_failure(const int32_t *status, size_t n)
{
    for (size_t t = 0; t < n; t++)
        if (status[t] < 0)
            return (colibri_status)status[t];
    return COLIBRI_OK;
}

/* One token's experts in row blocks: W1 and W3 (the hidden row), then W2
 * (the gated output row, staged per expert and added in the order of
 * moe_forward's step 3, which gives its bits as in step 3'). */
typedef struct expert_job {
    const colibri_ctx *c;
    const run_opts *o;
    const colibri_plan_moe *moe;
    const float *x;          /* the token's row [d] */
    const float *gate;       /* the shared experts' gate [1], or NULL */
    const uint32_t *slot;    /* [active] the experts running: routed slots, then shared */
    size_t active;
    float *hidden;           /* [active, H] */
    float *stage;            /* [active, d] */
    int32_t *status;
    /* When every active expert takes the same int8 activation form: x's int8
     * row, and then each expert's hidden row a at hq + a · hq_stride (scales
     * at hq_a + a · hq_scales), quantised once by the caller rather than by
     * every row block's task. Else NULL: each task quantises its own. */
    const colibri_qrows *xq;
    const int8_t *hq;
    const float *hq_a;
    size_t hq_stride, hq_scales;
} expert_job;

static size_t up_blocks(const colibri_plan_expert *e)
{
    return rows_splittable(&e->w1) && (!e->glu || rows_splittable(&e->w3)) ? (size_t)lm_blocks(e->hidden) : 1u;
}

/* Blocks of one phase (up: W1/W3, else W2) over the active experts:
 * the expert (*a) and block of task t, or the total for t = SIZE_MAX. */
static size_t expert_block(const expert_job *j, size_t t, int up, size_t *a)
{
    size_t total = 0;
    for (*a = 0; *a < j->active; (*a)++) {
        const colibri_plan_expert *e = &j->moe->expert[j->slot[*a]];
        const size_t n = up ? up_blocks(e) : row_blocks(&e->w2);
        if (t - total < n)
            return t - total;
        total += n;
    }
    return total;
}

static void expert_up_task(void *arg, size_t t, size_t worker)
{
    const expert_job *j = arg;
    const colibri_ctx *c = j->c;
    size_t a, r0;
    if (worker >= j->o->exec.workers) { /* the parallel_for broke its contract */
        j->status[t] = COLIBRI_E_BAD_EXEC;
        return;
    }
    const size_t b = expert_block(j, t, 1, &a);
    const colibri_plan_expert *e = &j->moe->expert[j->slot[a]];
    const scratch sc = worker_scratch(c, j->o, worker);
    const size_t n = block_rows(e->hidden, up_blocks(e), b, &r0);
    float *h = j->hidden + a * c->model.hidden + r0;
    colibri_qrows q = {NULL, NULL};
    if (e->int8_act)
        q = j->xq ? *j->xq : quantize(c, &sc, e->int8_act, j->x, NULL, 1, j->moe->d);
    const colibri_matrix w1 = matrix_rows(&e->w1, r0, n);
    linear_for(c, e->int8_act)(j->x, NULL, 1, &w1, e->b1 ? e->b1 + r0 : NULL, e->int8_act ? &q : NULL, h);
    c->k.activation(h, n, e->activation);
    if (e->glu) {
        const colibri_matrix w3 = matrix_rows(&e->w3, r0, n);
        linear_for(c, e->int8_act)(j->x, NULL, 1, &w3, e->b3 ? e->b3 + r0 : NULL, e->int8_act ? &q : NULL, sc.h1);
        c->k.mul(h, sc.h1, n);
    }
    j->status[t] = COLIBRI_OK;
}

static void expert_down_task(void *arg, size_t t, size_t worker)
{
    const expert_job *j = arg;
    const colibri_ctx *c = j->c;
    size_t a, r0;
    if (worker >= j->o->exec.workers) {
        j->status[t] = COLIBRI_E_BAD_EXEC;
        return;
    }
    const size_t b = expert_block(j, t, 0, &a), d = j->moe->d, s = j->slot[a];
    const colibri_plan_expert *e = &j->moe->expert[s];
    const scratch sc = worker_scratch(c, j->o, worker);
    const size_t n = block_rows(d, row_blocks(&e->w2), b, &r0);
    const float *h = j->hidden + a * c->model.hidden;
    float *y = j->stage + a * d + r0;
    for (size_t i = 0; i < n; i++)
        y[i] = -0.0f; /* as expert_task's staging rows */
    colibri_qrows q = {NULL, NULL};
    if (e->int8_act)
        q = j->hq ? (colibri_qrows){j->hq + a * j->hq_stride, j->hq_a + a * j->hq_scales}
                  : quantize(c, &sc, e->int8_act, h, NULL, 1, e->hidden);
    const colibri_matrix w2 = matrix_rows(&e->w2, r0, n);
    const float *scale = s < j->moe->n_experts ? c->ring_weight + s : j->gate; /* batch 1: ring s starts at s */
    linear_acc_for(c, e->int8_act)(h, 1, &w2, e->b2 ? e->b2 + r0 : NULL, NULL, scale, e->int8_act ? &q : NULL, y);
    j->status[t] = COLIBRI_OK;
}

/* MACs of one token's active experts (batch 1, after dispatch). */
static uint64_t lm_experts_macs(const colibri_ctx *c, const colibri_plan_moe *moe)
{
    uint64_t macs = 0;
    for (size_t s = 0; s < (size_t)moe->n_experts + moe->shared_count; s++)
        if (s >= moe->n_experts || c->ring_count[s])
            macs += (uint64_t)moe->expert[s].hidden * moe->d * (moe->expert[s].glu ? 3u : 2u);
    return macs;
}

/* y [1, d] of one MoE layer at decode, after dispatch (moe_forward). Not
 * inlined, as the row-block helpers below: their jobs stay off the frames
 * of the single-threaded path, whose stack a device budgets. */
static NOINLINE colibri_status moe_decode_rows(const colibri_ctx *c, const run_opts *o, const colibri_plan_moe *moe,
                                      const float *x, const float *gate, float *y)
{
    const size_t d = moe->d;
    uint32_t *slot = region_tasks(c, o);
    expert_job j = {c, o, moe, x, gate, slot, 0, NULL, (float *)(void *)o->region, NULL, NULL, NULL, NULL, 0, 0};
    lm_region(c, o, &j.hidden, &j.status);
    for (size_t s = 0; s < (size_t)moe->n_experts + moe->shared_count; s++)
        if (s >= moe->n_experts || c->ring_count[s])
            slot[j.active++] = (uint32_t)s;
    /* One int8 form for all (and room for their hidden rows in worker 0's
     * int8 rows [B, Q]): quantise x here, once, and each hidden row below. */
    uint8_t mode = j.active ? moe->expert[slot[0]].int8_act : 0u;
    for (size_t i = 1; i < j.active; i++)
        if (moe->expert[slot[i]].int8_act != mode)
            mode = 0u;
    const scratch sc0 = worker_scratch(c, NULL, 0);
    colibri_qrows xq;
    if (mode) {
        xq = quantize(c, &sc0, mode, x, NULL, 1, d);
        j.xq = &xq;
    }
    size_t a;
    colibri_status st;
    const size_t up = expert_block(&j, SIZE_MAX, 1, &a);
    if ((st = o->exec.parallel_for(o->exec.parallel_for_user, expert_up_task, &j, up)) < 0 ||
        (st = first_failure(j.status, up)) < 0)
        return st;
    if (mode && j.active <= c->model.hdr.max_batch) {
        const colibri_model *m = &c->model;
        j.hq = sc0.q;
        j.hq_a = sc0.qa;
        j.hq_stride = m->qwidth;
        j.hq_scales = mode == COLIBRI_INT8_BLOCKS ? m->qblocks : 1u;
        for (size_t i = 0; i < j.active; i++) {
            const scratch row = {NULL, NULL, sc0.q + i * j.hq_stride, sc0.qa + i * j.hq_scales, NULL};
            quantize(c, &row, mode, j.hidden + i * m->hidden, NULL, 1, moe->expert[slot[i]].hidden);
        }
    }
    const size_t down = expert_block(&j, SIZE_MAX, 0, &a);
    if ((st = o->exec.parallel_for(o->exec.parallel_for_user, expert_down_task, &j, down)) < 0 ||
        (st = first_failure(j.status, down)) < 0)
        return st;
    memset(y, 0, d * sizeof *y);
    for (size_t i = 0; i < j.active; i++)
        c->k.add(y, j.stage + i * d, d);
    return COLIBRI_OK;
}

/* y [batch, d] = Σ w_e · expert_e(x) + g · Σ shared_s(x) for one MoE layer,
 * x [batch, d] (docs/model-format.md "MoE record"). */
static NOINLINE NO_MEMSET_LOOP colibri_status moe_forward(const colibri_ctx *c, const run_opts *o, uint32_t layer,
                                                          const colibri_plan_moe *moe, const float *x, float *y,
                                                          size_t batch)
{
    const size_t d = moe->d, routes = moe->routing.routes, n_experts = moe->n_experts;
    colibri_status st;

    /* 1. Router logits of the whole batch: scores [batch, R]. */
    c->k.linear(x, NULL, batch, &moe->router, moe->router_bias, NULL, c->scores);

    /* 2. Dispatch: each token's chosen experts get (token, gate weight)
     *    appended to their ring [batch]. No activation row is copied. */
    for (size_t s = 0; s < n_experts; s++)
        c->ring_count[s] = 0u;
    for (size_t t = 0; t < batch; t++) {
        const size_t n = moe->route(c->scores + t * routes, &moe->routing, c->sel_weight, c->sel_slot);
        for (size_t j = 0; j < n; j++) {
            /* A gate weight of exactly 0 adds nothing: the expert does not
             * run for the token, so an output it would overflow cannot turn
             * 0 · inf into NaN (docs/model-format.md "Numerics: non-finite
             * values"). A NaN weight runs, and the token's output is NaN. */
            if (c->sel_weight[j] == 0.0f)
                continue;
            /* The slot comes from the expert map, read in place: validated a
             * permutation at init, bounded here at its use, so an image
             * rewritten under a live context (a file changed in place, a
             * caller's buffer overwritten) gives wrong numbers, never a write
             * outside the rings (docs/threading.md). */
            const size_t s = c->sel_slot[j];
            if (s >= n_experts || c->ring_count[s] >= batch)
                continue;
            const size_t at = s * batch + c->ring_count[s]++;
            c->ring_token[at] = (uint16_t)t; /* t < max_batch <= 65535 */
            c->ring_weight[at] = c->sel_weight[j];
        }
    }

    /* 2b. The caller hears which experts are about to run (colibri_route). */
    if (o && o->exec.on_route) {
        const colibri_route r = {layer, moe->first_expert, moe->n_experts, moe->shared_count, batch,
                                 c->ring_count, c->ring_token, c->ring_weight};
        if ((st = o->exec.on_route(o->exec.on_route_user, &r)) < 0)
            return st;
    }

    /* The shared experts' gate g = sigmoid(x · gate), when there is one: the
     * router scores are dead after dispatch, so they hold g [batch]. */
    const float *gate = NULL;
    if (moe->shared_count && moe->shared_gate.data) {
        c->k.linear(x, NULL, batch, &moe->shared_gate, NULL, NULL, c->scores);
        c->k.activation(c->scores, batch, COLIBRI_ACT_SIGMOID);
        gate = c->scores;
    }

    /* 3''. A token model's decode: the active experts' row blocks on the
     *      workers; a small layer runs on one (step 3). */
    if (lm_parallel(c, o) && batch == 1 && !o->exec.expert) {
        if (lm_experts_macs(c, moe) >= LM_PAR_MIN_MACS)
            return moe_decode_rows(c, o, moe, x, gate, y);
    } else if (o && o->region) {
        /* 3'. Parallel: every expert with tokens is a task writing its gated
         *     rows to its own staging rows; then the rows are added into y
         *     in the single-threaded order, so y gets the same bits. */
        par_layer a = {c, o, moe, layer, x, gate, batch, (float *)(void *)o->region, NULL, NULL, NULL};
        const colibri_model *m = &c->model;
        const size_t max_tasks = (size_t)m->experts + m->shared_experts;
        a.task = region_tasks(c, o);
        a.row = a.task + max_tasks;
        a.status = (int32_t *)(void *)(a.row + max_tasks);
        uint32_t tasks = 0, rows = 0;
        for (size_t s = 0; s < n_experts + moe->shared_count; s++) {
            const uint32_t n = s < n_experts ? c->ring_count[s] : (uint32_t)batch;
            if (n == 0)
                continue;
            a.task[tasks] = (uint32_t)s;
            a.row[tasks++] = rows;
            rows += n;
        }
        if ((st = o->exec.parallel_for(o->exec.parallel_for_user, expert_task, &a, tasks)) < 0)
            return st;
        memset(y, 0, batch * d * sizeof *y);
        for (uint32_t t = 0; t < tasks; t++) {
            if (a.status[t] < 0)
                return (colibri_status)a.status[t];
            const size_t s = a.task[t];
            const uint16_t *ring = s < n_experts ? c->ring_token + s * batch : NULL;
            const size_t n = s < n_experts ? c->ring_count[s] : batch;
            for (size_t i = 0; i < n; i++)
                c->k.add(y + (ring ? ring[i] : i) * d, a.stage + ((size_t)a.row[t] + i) * d, d);
        }
        return COLIBRI_OK;
    }

    /* 3. Each routed expert with tokens runs once over its ring,
     *    accumulating straight into the tokens' output rows. */
    {
        const size_t n = batch * d;
        size_t i = 0;
        for (; i + 8u <= n; i += 8u) {
            y[i] = 0.0f;
            y[i + 1u] = 0.0f;
            y[i + 2u] = 0.0f;
            y[i + 3u] = 0.0f;
            y[i + 4u] = 0.0f;
            y[i + 5u] = 0.0f;
            y[i + 6u] = 0.0f;
            y[i + 7u] = 0.0f;
        }
        for (; i < n; i++)
            y[i] = 0.0f;
    }
    for (size_t s = 0; s < n_experts; s++)
        if (c->ring_count[s]) {
            const uint16_t *ring = c->ring_token + s * batch;
            st = run_expert(c, o, 0, layer, moe, s, x, ring, c->ring_count[s], c->ring_weight + s * batch, ring, y);
            if (st < 0)
                return st;
        }

    /* 4. Shared experts over every token, scaled by the gate if any. */
    for (uint32_t i = 0; i < moe->shared_count; i++)
        if ((st = run_expert(c, o, 0, layer, moe, n_experts + i, x, NULL, batch, gate, NULL, y)) < 0)
            return st;
    return COLIBRI_OK;
}

/* A LINEAR layer's tokens in chunks across the workers, each chunk a
 * multiple of 4 tokens and at least 4 (the last takes the rest, so it is
 * never shorter), so every
 * backend blocks the tokens as in one call (groups of four, then the tail)
 * and each output gets the same bits. Worth it from this many MACs on. */
#define PAR_LINEAR_MIN_MACS (1u << 18)

typedef struct par_linear {
    const colibri_ctx *c;
    const colibri_matrix *w;
    const float *b;
    const float *x;
    float *y;
    size_t batch, chunk, tasks;
    const colibri_qrows *q;  /* the whole batch's int8 rows, or NULL */
    uint8_t mode;            /* q's activation mode (INT8_ACT or INT8_BLOCKS) */
} par_linear;

static void linear_task(void *arg, size_t t, size_t worker)
{
    const par_linear *a = arg;
    const size_t in = a->w->cols, out = a->w->rows, t0 = t * a->chunk;
    const size_t n = t + 1 == a->tasks ? a->batch - t0 : a->chunk; /* the last takes the rest */
    colibri_qrows q = {NULL, NULL};
    (void)worker;
    if (a->q) { /* per-token scales, or colibri_act_blocks(in) of them a token */
        const size_t scales = a->mode == COLIBRI_INT8_BLOCKS ? colibri_act_blocks(in) : 1u;
        q = (colibri_qrows){a->q->q + t0 * in, a->q->a + t0 * scales};
    }
    linear_for(a->c, a->mode)(a->x + t0 * in, NULL, n, a->w, a->b, a->q ? &q : NULL, a->y + t0 * out);
}

/* y = x Wᵀ + b for one row x, in row blocks on the workers. */
static NOINLINE colibri_status linear_rows(const colibri_ctx *c, const run_opts *o, const colibri_matrix *w,
                                           const float *b, const colibri_qrows *q, uint8_t mode, const float *x,
                                           float *y)
{
    row_job j = {c, {{w, b, x, q, y, 0, mode}}, 1};
    return run_rows(o, &j);
}

/* y = x Wᵀ + b over batch tokens (q: their int8 rows in activation mode, or NULL); the tokens
 * split across the workers when there are several and the matrix is large
 * enough, and (a token model) one token's rows split in blocks. */
static colibri_status linear_split(const colibri_ctx *c, const run_opts *o, const colibri_matrix *w, const float *b,
                                   const colibri_qrows *q, uint8_t mode, const float *x, float *y, size_t batch)
{
    const size_t in = w->cols, workers = o && o->region ? o->exec.workers : 1;
    if (lm_parallel(c, o) && batch == 1 && (uint64_t)in * w->rows >= LM_PAR_MIN_MACS)
        return linear_rows(c, o, w, b, q, mode, x, y);
    if (workers > 1 && batch >= 8 && (uint64_t)batch * in * w->rows >= PAR_LINEAR_MIN_MACS) {
        size_t chunk = (batch + workers - 1) / workers;
        chunk = (chunk + 3u) & ~(size_t)3u;
        const par_linear a = {c, w, b, x, y, batch, chunk, batch / chunk, q, mode};
        if (a.tasks > 1)
            return o->exec.parallel_for(o->exec.parallel_for_user, linear_task, (void *)&a, a.tasks);
    }
    linear_for(c, mode)(x, NULL, batch, w, b, q, y);
    return COLIBRI_OK;
}

/* y = x Wᵀ + b for a LINEAR layer over batch tokens. */
static colibri_status linear_layer(const colibri_ctx *c, const run_opts *o, const colibri_plan_layer *l,
                                   const float *x, float *y, size_t batch)
{
    colibri_qrows q = {NULL, NULL};
    if (l->int8_act) {
        const scratch sc0 = worker_scratch(c, NULL, 0);
        q = quantize(c, &sc0, l->int8_act, x, NULL, batch, l->in);
    }
    return linear_split(c, o, &l->w, l->t1, l->int8_act ? &q : NULL, l->int8_act, x, y, batch);
}

/* ---- Attention (token models, docs/lm.md "Semantics") ---- */

/* cos and sin of RoPE's angles for the n rows at positions pos .. pos+n-1:
 * row i of rope [n, hd] holds cos (hd/2) then sin (hd/2) of (pos + i) ·
 * theta^(-2j/hd), the angle in double, each value rounded once to float. */
static void rope_table(float *rope, size_t n, uint32_t pos, float theta, size_t hd)
{
    const size_t half = hd / 2;
    const double ln_theta = colibri_log_d((double)theta);
    for (size_t j = 0; j < half; j++) {
        const double inv_freq = colibri_exp_d(-(double)(2u * j) / (double)hd * ln_theta);
        for (size_t i = 0; i < n; i++) {
            double c, s;
            colibri_cos_sin_d((double)(pos + i) * inv_freq, &c, &s);
            rope[i * hd + j] = (float)c;
            rope[i * hd + half + j] = (float)s;
        }
    }
}

/* y [n, d] = one ATTENTION layer over x [n, d], rows at positions pos ..
 * pos+n-1: their keys and values join the cache, each row attends to every
 * cached position up to its own. *rope_for is the (theta, hd) the context's
 * rope table holds for this call's rows, so layers alike share it. */
/* One row's q, k and v as one loop over the three matrices' row blocks. */
static NOINLINE colibri_status qkv_rows(const colibri_ctx *c, const run_opts *o, const colibri_plan_attention *a,
                                        const float *x, const colibri_qrows *xq)
{
    const uint8_t mode = a->int8_act;
    row_job j = {c,
                 {{&a->q, a->q_bias, x, xq, c->att_q, 0, mode},
                  {&a->k, a->k_bias, x, xq, c->att_k, 0, mode},
                  {&a->v, a->v_bias, x, xq, c->att_v, 0, mode}},
                 3};
    return run_rows(o, &j);
}

/* The n rows x [n, in] of an attention projection in its activation mode:
 * with INT8_BLOCKS quantised once into worker 0's int8 rows (q, k and v
 * share x's), else NULL (f32 activations). */
static const colibri_qrows *attention_act(const colibri_ctx *c, const colibri_plan_attention *a, const float *x,
                                          size_t n, size_t in, colibri_qrows *q)
{
    if (!a->int8_act)
        return NULL;
    const scratch sc0 = worker_scratch(c, NULL, 0);
    *q = quantize(c, &sc0, a->int8_act, x, NULL, n, in);
    return q;
}

/* q, k, v [n, *] = the projections of x [n, d]: at decode on workers as
 * one loop over the three matrices' row blocks. */
static colibri_status attention_qkv(const colibri_ctx *c, const run_opts *o, const colibri_plan_attention *a,
                                    const float *x, size_t n)
{
    colibri_qrows q;
    const colibri_qrows *xq = attention_act(c, a, x, n, a->q.cols, &q);
    const uint8_t mode = a->int8_act;
    colibri_status st;
    if (lm_parallel(c, o) && n == 1 &&
        ((uint64_t)a->q.rows + a->k.rows + a->v.rows) * a->q.cols >= LM_PAR_MIN_MACS)
        return qkv_rows(c, o, a, x, xq);
    if ((st = linear_split(c, o, &a->q, a->q_bias, xq, mode, x, c->att_q, n)) < 0 ||
        (st = linear_split(c, o, &a->k, a->k_bias, xq, mode, x, c->att_k, n)) < 0)
        return st;
    return linear_split(c, o, &a->v, a->v_bias, xq, mode, x, c->att_v, n);
}

/* Each head of each row over positions 0 .. its own (causal); query head h
 * reads kv head h / group; its output replaces its query. A task is one
 * head over every row, with its worker's scores. */
typedef struct head_job {
    const colibri_ctx *c;
    const run_opts *o;
    const colibri_plan_attention *a;
    size_t n;
    uint32_t pos;
    int32_t *status;         /* [heads], NULL on one worker */
} head_job;

static void attend_head(const head_job *j, size_t h, float *scores)
{
    const colibri_plan_attention *a = j->a;
    const size_t hd = a->head_dim, qw = a->heads * hd, kvw = a->kv_heads * hd;
    const size_t g = (h / (a->heads / a->kv_heads)) * hd * (a->kv_f16 ? 2u : 4u);
    for (size_t i = 0; i < j->n; i++) {
        float *qh = j->c->att_q + i * qw + h * hd;
        j->c->k.attend(qh, (const uint8_t *)a->k_cache + g, (const uint8_t *)a->v_cache + g, kvw, j->pos + i + 1u, hd,
                       a->kv_f16, a->scale, scores, qh);
    }
}

static void head_task(void *arg, size_t h, size_t worker)
{
    const head_job *j = arg;
    if (worker >= j->o->exec.workers) {
        j->status[h] = COLIBRI_E_BAD_EXEC;
        return;
    }
    const scratch sc = worker_scratch(j->c, j->o, worker);
    attend_head(j, h, sc.scores);
    j->status[h] = COLIBRI_OK;
}

static colibri_status attention_heads(const colibri_ctx *c, const run_opts *o, const colibri_plan_attention *a,
                                      size_t n, uint32_t pos)
{
    head_job j = {c, o, a, n, pos, NULL};
    const uint64_t macs = 2u * (uint64_t)n * a->heads * a->head_dim * (pos + n);
    if (lm_parallel(c, o) && a->heads > 1 && macs >= LM_PAR_MIN_HEAD_MACS) {
        float *hidden;
        lm_region(c, o, &hidden, &j.status);
        colibri_status st = o->exec.parallel_for(o->exec.parallel_for_user, head_task, &j, a->heads);
        return st < 0 ? st : first_failure(j.status, a->heads);
    }
    for (size_t h = 0; h < a->heads; h++)
        attend_head(&j, h, c->att_scores);
    return COLIBRI_OK;
}

static colibri_status attention_forward(colibri_ctx *c, const run_opts *o, const colibri_plan_attention *a,
                                        const float *x, float *y, size_t n, uint32_t pos, float rope_for[2])
{
    const size_t heads = a->heads, kv_heads = a->kv_heads, hd = a->head_dim;
    const size_t qw = heads * hd, kvw = kv_heads * hd;
    float *q = c->att_q, *k = c->att_k, *v = c->att_v;
    colibri_status st;

    if ((st = attention_qkv(c, o, a, x, n)) < 0)
        return st;
    /* q/k norms: over each head's hd values, or over the whole projection. */
    if (a->q_norm)
        c->k.rmsnorm(q, a->q_norm_per_head ? n * heads : n, a->q_norm_per_head ? hd : qw, a->q_norm, a->eps);
    if (a->k_norm)
        c->k.rmsnorm(k, a->k_norm_per_head ? n * kv_heads : n, a->k_norm_per_head ? hd : kvw, a->k_norm, a->eps);
    if (rope_for[0] != a->rope_theta || rope_for[1] != (float)hd) {
        rope_table(c->rope, n, pos, a->rope_theta, hd);
        rope_for[0] = a->rope_theta;
        rope_for[1] = (float)hd;
    }
    const size_t elem = a->kv_f16 ? 2u : 4u;
    for (size_t i = 0; i < n; i++) {
        const float *cos = c->rope + i * hd, *sin = cos + hd / 2;
        c->k.rope(q + i * qw, heads, hd, cos, sin);
        c->k.rope(k + i * kvw, kv_heads, hd, cos, sin);
        /* The row's key and value join the cache at its position. */
        uint8_t *kc = (uint8_t *)a->k_cache + (pos + i) * kvw * elem, *vc = (uint8_t *)a->v_cache + (pos + i) * kvw * elem;
        if (a->kv_f16) {
            uint16_t *kh = (uint16_t *)(void *)kc, *vh = (uint16_t *)(void *)vc;
            for (size_t j = 0; j < kvw; j++) {
                kh[j] = colibri_f32_to_f16(k[i * kvw + j]);
                vh[j] = colibri_f32_to_f16(v[i * kvw + j]);
            }
        } else {
            memcpy(kc, k + i * kvw, kvw * sizeof(float));
            memcpy(vc, v + i * kvw, kvw * sizeof(float));
        }
    }
    if ((st = attention_heads(c, o, a, n, pos)) < 0)
        return st;
    colibri_qrows oq;
    return linear_split(c, o, &a->o, a->o_bias, attention_act(c, a, q, n, qw, &oq), a->int8_act, q, y, n);
}

/* Whether [a, a + an) and [b, b + bn) (floats) share memory. */
static int overlap(const float *a, size_t an, const float *b, size_t bn)
{
    const uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return pa < pb + bn * sizeof *b && pb < pa + an * sizeof *a;
}

/* Keeps only the last of a call's rows from layer t on: the activation x's
 * last row and each live residual entry's become their row 0. Every layer
 * after the last ATTENTION acts on each row alone (no later layer reads the
 * cache or another row), so the last token's output is the same bits as in
 * the whole batch. */
static NOINLINE void keep_last_row(const colibri_ctx *ctx, uint32_t t, float *x, size_t batch, size_t stack_slot)
{
    uint32_t width[COLIBRI_MAX_RESIDUAL_DEPTH];
    size_t depth = 0;
    for (uint32_t j = 0; j <= t; j++) { /* the entries live after layer t, as forward pushed them */
        if (ctx->layer[j].op == COLIBRI_OP_RESIDUAL_PUSH)
            width[depth++] = ctx->layer[j].in;
        else if (ctx->layer[j].op == COLIBRI_OP_RESIDUAL_ADD)
            depth--;
    }
    const size_t w = ctx->layer[t + 1].in;
    memcpy(x, x + (batch - 1) * w, w * sizeof *x);
    for (size_t d = 0; d < depth; d++) {
        float *entry = ctx->stack + d * stack_slot;
        memcpy(entry, entry + (batch - 1) * width[d], width[d] * sizeof *entry);
    }
}

/* The last ATTENTION layer of a token model, or its EMBED (layer 0) if it
 * has none: from there on only the last row matters to the last logits. */
static uint32_t last_attention(const colibri_ctx *ctx)
{
    for (uint32_t i = ctx->model.hdr.layer_count; i-- > 1;)
        if (ctx->layer[i].op == COLIBRI_OP_ATTENTION)
            return i;
    return 0;
}

/* The forward pass; o NULL: colibri_forward(). A token model's input is
 * tokens [batch] at cache positions ctx->position on (input NULL). After
 * layer trim_after (UINT32_MAX: none) the pass goes on with the last row
 * alone, and output gets that row. */
static colibri_status forward(colibri_ctx *ctx, const run_opts *o, size_t batch, const int32_t *tokens,
                              const float *input, size_t input_count,
                              float *output, size_t output_count, uint32_t trim_after)
{
    float rope_for[2] = {-1.0f, 0.0f}; /* (theta, hd) of the rope table: none yet */
    const colibri_header *hdr = &ctx->model.hdr;

    /* x is the current activation [batch, width]. It starts as the caller's
     * input, read in place until an op would change it in place (then it is
     * copied into act[0] first); a LINEAR or MOE layer writes a buffer other
     * than x: the caller's output for the last such layer (when output
     * overlaps neither x nor the input), else act[0] or act[1] (LINEAR) or
     * moe_acc (MOE). The arena's buffers all hold [max_batch, W]. */
    const float *x = input;
    float *const act0 = ctx->act[0], *const act1 = ctx->act[1];
    const size_t stack_slot = batch * ctx->model.width;
    const uint32_t last = ctx->last_producer;
    const int direct = !overlap(output, output_count, input, input_count);
    size_t depth = 0;
    colibri_status st;

    for (uint32_t i = 0; i < hdr->layer_count; i++) {
        const colibri_plan_layer *l = &ctx->layer[i];
        const size_t in = l->in;
        float *own = (float *)(uintptr_t)x; /* x, writable once it is not the input */

        if (x == input && l->op != COLIBRI_OP_LINEAR && l->op != COLIBRI_OP_MOE && l->op != COLIBRI_OP_RESIDUAL_PUSH &&
            l->op != COLIBRI_OP_EMBED) {
            memcpy(act0, input, input_count * sizeof *x);
            x = own = act0;
        }
        switch (l->op) {
        case COLIBRI_OP_LINEAR: {
            float *y = x == act0 ? act1 : act0;
            if (i == last && direct && !overlap(output, output_count, x, batch * in))
                y = output;
            if ((st = linear_layer(ctx, o, l, x, y, batch)) < 0)
                return st;
            x = y;
            break;
        }
        case COLIBRI_OP_ACTIVATION:
            ctx->k.activation(own, batch * in, l->act);
            break;
        case COLIBRI_OP_LAYERNORM:
            ctx->k.layernorm(own, batch, in, l->t0, l->t1, l->eps);
            break;
        case COLIBRI_OP_RMSNORM:
            ctx->k.rmsnorm(own, batch, in, l->t0, l->eps);
            break;
        case COLIBRI_OP_RESIDUAL_PUSH:
            memcpy(ctx->stack + depth++ * stack_slot, x, batch * in * sizeof *x);
            break;
        case COLIBRI_OP_RESIDUAL_ADD:
            ctx->k.add(own, ctx->stack + --depth * stack_slot, batch * in);
            break;
        case COLIBRI_OP_MOE: {
            float *y = x == ctx->moe_acc ? act0 : ctx->moe_acc;
            if (i == last && direct && !overlap(output, output_count, x, batch * in))
                y = output;
            if ((st = moe_forward(ctx, o, l->entry, &ctx->moe[l->entry], x, y, batch)) < 0)
                return st;
            x = y;
            break;
        }
        case COLIBRI_OP_EMBED: /* layer 0 of a token model: x starts as the tokens' rows */
            ctx->k.embed(&l->w, tokens, batch, act0);
            x = act0;
            if (i == trim_after) { /* no attention layer */
                keep_last_row(ctx, i, act0, batch, stack_slot);
                batch = 1;
            }
            break;
        case COLIBRI_OP_ATTENTION: {
            float *y = x == act0 ? act1 : act0;
            if ((st = attention_forward(ctx, o, &ctx->attention[l->entry], x, y, batch, ctx->position, rope_for)) < 0)
                return st;
            x = y;
            if (i == trim_after) {
                keep_last_row(ctx, i, y, batch, stack_slot);
                batch = 1;
            }
            break;
        }
        default: /* unreachable: ops are validated */
            break;
        }
    }
    if (x == input) { /* no LINEAR or MOE: through act[0], as output may overlap the input */
        memcpy(act0, input, input_count * sizeof *x);
        x = act0;
    }
    if (x != output)
        memcpy(output, x, output_count * sizeof *x);
    return COLIBRI_OK;
}

/* The argument checks colibri_forward() and colibri_forward_ex() share. */
static colibri_status check_call(const colibri_ctx *ctx, size_t batch, const float *input, size_t input_count,
                                 const float *output, size_t output_count)
{
    if (!ctx)
        return COLIBRI_E_NULL_ARG;
    if (ctx->magic != CTX_MAGIC)
        return COLIBRI_E_BAD_CONTEXT;
    if (!input || !output)
        return COLIBRI_E_NULL_ARG;
    const colibri_header *hdr = &ctx->model.hdr;
    if (ctx->model.vocab)
        return COLIBRI_E_MODEL_KIND; /* token ids in: colibri_lm_forward() */
    if (batch == 0 || batch > hdr->max_batch)
        return COLIBRI_E_BAD_BATCH;
    /* No overflow: batch * width fits, the arena holds max_batch * W floats. */
    if (input_count != batch * hdr->input_size || output_count != batch * hdr->output_size)
        return COLIBRI_E_BUFFER_SIZE;
    return COLIBRI_OK;
}

colibri_status colibri_forward(colibri_ctx *ctx, size_t batch,
                               const float *input, size_t input_count,
                               float *output, size_t output_count)
{
    colibri_status st = check_call(ctx, batch, input, input_count, output, output_count);
    if (st != COLIBRI_OK)
        return st;
    return forward(ctx, NULL, batch, NULL, input, input_count, output, output_count, UINT32_MAX);
}

/* The caller's struct, as far as both sides know it (colibri.h: versioning),
 * and the parallel region it uses. */
static colibri_status read_exec(const colibri_ctx *ctx, const colibri_exec *exec, run_opts *o)
{
    memset(o, 0, sizeof *o);
    if (exec->struct_size < COLIBRI_EXEC_SIZE_V1)
        return COLIBRI_E_BAD_EXEC;
    for (size_t i = sizeof o->exec; i < exec->struct_size; i++)
        if (((const uint8_t *)exec)[i] != 0)
            return COLIBRI_E_BAD_EXEC;
    memcpy(&o->exec, exec, sizeof o->exec);
    if (!o->exec.parallel_for || o->exec.workers < 2)
        o->exec.workers = 1;
    else if (o->exec.workers > ctx->workers)
        return COLIBRI_E_BAD_EXEC;
    if (o->exec.workers > 1) {
        uint64_t off[P_COUNT + 1];
        arena_layout(&ctx->model, off);
        exec_layout(&ctx->model, &o->fixed, &o->per);
        o->region = (uint8_t *)(uintptr_t)ctx + off[P_COUNT];
    }
    return COLIBRI_OK;
}

colibri_status colibri_forward_ex(colibri_ctx *ctx, const colibri_exec *exec, size_t batch,
                                  const float *input, size_t input_count,
                                  float *output, size_t output_count)
{
    colibri_status st = check_call(ctx, batch, input, input_count, output, output_count);
    if (st != COLIBRI_OK)
        return st;
    if (!exec)
        return forward(ctx, NULL, batch, NULL, input, input_count, output, output_count, UINT32_MAX);
    run_opts o;
    if ((st = read_exec(ctx, exec, &o)) != COLIBRI_OK)
        return st;
    return forward(ctx, &o, batch, NULL, input, input_count, output, output_count, UINT32_MAX);
}

/* ---- Token models: the sequence, the forward pass, sampling (docs/lm.md) ---- */

/* A valid context of a token model. */
static colibri_status lm_context(const colibri_ctx *ctx)
{
    if (!ctx)
        return COLIBRI_E_NULL_ARG;
    if (ctx->magic != CTX_MAGIC)
        return COLIBRI_E_BAD_CONTEXT;
    return ctx->model.vocab ? COLIBRI_OK : COLIBRI_E_MODEL_KIND;
}

colibri_status colibri_lm_reset(colibri_ctx *ctx)
{
    colibri_status st = lm_context(ctx);
    if (st != COLIBRI_OK)
        return st;
    /* Positions from here on are written before they are read: nothing of
     * the cache needs clearing. */
    ctx->position = 0;
    return COLIBRI_OK;
}

colibri_status colibri_lm_position(const colibri_ctx *ctx, uint32_t *position)
{
    colibri_status st = lm_context(ctx);
    if (st != COLIBRI_OK)
        return st;
    if (!position)
        return COLIBRI_E_NULL_ARG;
    *position = ctx->position;
    return COLIBRI_OK;
}

/* colibri_lm_forward's checks, in docs/lm.md's order (reference.LMState.check's). */
static colibri_status lm_check(const colibri_ctx *ctx, const int32_t *tokens, uint32_t n, const float *logits,
                               size_t logits_len)
{
    colibri_status st = lm_context(ctx);
    if (st != COLIBRI_OK)
        return st;
    if (!tokens || !logits)
        return COLIBRI_E_NULL_ARG;
    const colibri_model *m = &ctx->model;
    /* docs/lm.md's order, reference.LMState.check's. */
    if (n == 0 || n > m->hdr.max_batch)
        return COLIBRI_E_BAD_BATCH;
    for (uint32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= m->vocab)
            return COLIBRI_E_BAD_TOKEN;
    if (logits_len != (size_t)n * m->hdr.output_size && logits_len != m->hdr.output_size)
        return COLIBRI_E_BUFFER_SIZE; /* every token's logits, or the last token's */
    if ((uint64_t)ctx->position + n > m->max_seq_len)
        return COLIBRI_E_CACHE_FULL;
    return COLIBRI_OK;
}

static colibri_status lm_run(colibri_ctx *ctx, const run_opts *o, const int32_t *tokens, uint32_t n, float *logits,
                             size_t logits_len)
{
    const uint32_t trim_after = n > 1 && logits_len == ctx->model.hdr.output_size ? last_attention(ctx) : UINT32_MAX;
    const colibri_status st = forward(ctx, o, n, tokens, NULL, 0, logits, logits_len, trim_after);
    if (st == COLIBRI_OK)
        ctx->position += n;
    return st;
}

colibri_status colibri_lm_forward(colibri_ctx *ctx, const int32_t *tokens, uint32_t n, float *logits,
                                  size_t logits_len)
{
    const colibri_status st = lm_check(ctx, tokens, n, logits, logits_len);
    return st != COLIBRI_OK ? st : lm_run(ctx, NULL, tokens, n, logits, logits_len);
}

colibri_status colibri_lm_forward_ex(colibri_ctx *ctx, const colibri_exec *exec, const int32_t *tokens, uint32_t n,
                                     float *logits, size_t logits_len)
{
    colibri_status st = lm_check(ctx, tokens, n, logits, logits_len);
    if (st != COLIBRI_OK || !exec)
        return st != COLIBRI_OK ? st : lm_run(ctx, NULL, tokens, n, logits, logits_len);
    run_opts o;
    if ((st = read_exec(ctx, exec, &o)) != COLIBRI_OK)
        return st;
    return lm_run(ctx, &o, tokens, n, logits, logits_len);
}

void colibri_rng_seed(colibri_rng *rng, uint64_t seed)
{
    if (rng)
        rng->state = seed;
}

/* SplitMix64 (Steele, Lea, Flood 2014): one step of the state, then the
 * output mix. */
static uint64_t rng_next(colibri_rng *rng)
{
    uint64_t z = (rng->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Whether index a ranks before b: the larger logit first, the lower index on
 * a tie (the logits are finite here). */
static int ranks_before(const float *logits, uint32_t a, uint32_t b)
{
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
}

/* Restores the heap below node i of heap [0, n): every parent ranks before its children. */
static void sift_down(uint32_t *heap, size_t i, size_t n, const float *logits)
{
    for (;;) {
        size_t best = i;
        const size_t l = 2u * i + 1u, r = l + 1u;
        if (l < n && ranks_before(logits, heap[l], heap[best]))
            best = l;
        if (r < n && ranks_before(logits, heap[r], heap[best]))
            best = r;
        if (best == i)
            return;
        const uint32_t t = heap[i];
        heap[i] = heap[best];
        heap[best] = t;
        i = best;
    }
}

colibri_status colibri_lm_sample(colibri_ctx *ctx, const colibri_sampler *sampler, const float *logits,
                                 size_t logits_len, colibri_rng *rng, int32_t *token)
{
    colibri_status st = lm_context(ctx);
    if (st != COLIBRI_OK)
        return st;
    if (!sampler || !logits || !rng || !token)
        return COLIBRI_E_NULL_ARG;
    const float temperature = sampler->temperature, top_p = sampler->top_p;
    if (sampler->struct_size != sizeof(colibri_sampler) || !(temperature >= 0.0f) || temperature > 3.40282347e+38f ||
        !(top_p > 0.0f && top_p <= 1.0f))
        return COLIBRI_E_BAD_SAMPLER;
    const size_t vocab = ctx->model.hdr.output_size;
    if (logits_len != vocab)
        return COLIBRI_E_BUFFER_SIZE;

    if (temperature == 0.0f) { /* greedy: the lowest index among the largest */
        size_t best = 0;
        for (size_t i = 0; i < vocab; i++) {
            if (logits[i] != logits[i])
                return COLIBRI_E_NAN_LOGITS;
            if (logits[i] > logits[best])
                best = i;
        }
        *token = (int32_t)best;
        return COLIBRI_OK;
    }
    for (size_t i = 0; i < vocab; i++)
        if (!(logits[i] - logits[i] == 0.0f)) /* NaN or ±inf */
            return COLIBRI_E_NAN_LOGITS;

    /* Rank the vocabulary: a heap with the best on top; each pop moves the
     * best left to the end, so order[vocab - 1 - r] is rank r. Only the
     * top_k ranks are popped. */
    uint32_t *order = ctx->sample_order;
    for (size_t i = 0; i < vocab; i++)
        order[i] = (uint32_t)i;
    for (size_t i = vocab / 2; i-- > 0;)
        sift_down(order, i, vocab, logits);
    const size_t kept = sampler->top_k && sampler->top_k < vocab ? sampler->top_k : vocab;
    for (size_t r = 0; r < kept; r++) {
        const size_t last = vocab - 1u - r;
        const uint32_t t = order[0];
        order[0] = order[last];
        order[last] = t;
        sift_down(order, 0, last, logits);
    }
#define RANKED(r) order[vocab - 1u - (r)]
    /* e_r = exp((l_r - l_0) / T): subtracting first keeps the quotient <= 0
     * (the logits divided first could overflow to inf). */
    const float top = logits[RANKED(0)];
#define WEIGHT(r) colibri_expf((logits[RANKED(r)] - top) / temperature)
    float total = 0.0f;
    for (size_t r = 0; r < kept; r++)
        total += WEIGHT(r);
    size_t n = kept;
    float mass = total;
    if (top_p < 1.0f) { /* the smallest prefix whose mass reaches top_p of the total */
        const float need = top_p * total;
        float run = 0.0f;
        for (size_t r = 0; r < kept; r++) {
            run += WEIGHT(r);
            if (run >= need) {
                n = r + 1u;
                break;
            }
        }
        mass = run;
    }
    const float u = (float)(rng_next(rng) >> 40) * 0x1p-24f;
    const float target = u * mass;
    float run = 0.0f;
    for (size_t r = 0; r < n; r++) {
        run += WEIGHT(r);
        if (run > target) {
            *token = (int32_t)RANKED(r);
            return COLIBRI_OK;
        }
    }
    *token = (int32_t)RANKED(n - 1u); /* rounding left u · mass at or above the sum */
#undef WEIGHT
#undef RANKED
    return COLIBRI_OK;
}

/* ---- Model information ---- */

colibri_status colibri_get_num_experts(const void *image, size_t image_len, uint32_t *num_experts)
{
    colibri_model m;
    if (!image || !num_experts)
        return COLIBRI_E_NULL_ARG;
    uint64_t work;
    colibri_status st = colibri_check_level(image, image_len, &m, &work, COLIBRI_CHECK_STRUCTURE);
    if (st != COLIBRI_OK)
        return st;
    *num_experts = m.routed_experts;
    return COLIBRI_OK;
}

colibri_status colibri_get_info(const void *image, size_t image_len, colibri_model_info *info)
{
    colibri_model m;
    uint64_t off[P_COUNT + 1];
    if (!image || !info)
        return COLIBRI_E_NULL_ARG;
    colibri_status st = size_model(image, image_len, &m, off, COLIBRI_CHECK_STRUCTURE);
    if (st != COLIBRI_OK)
        return st;
    info->format_version = m.hdr.version;
    info->image_size = m.hdr.image_size;
    info->flags = m.hdr.flags;
    info->input_size = m.hdr.input_size;
    info->output_size = m.hdr.output_size;
    info->max_batch = m.hdr.max_batch;
    info->num_layers = m.hdr.layer_count;
    info->num_tensors = m.hdr.tensor_count;
    info->num_moe_layers = m.moe_layers;
    info->num_experts = m.routed_experts;
    info->num_shared_experts = m.shared_experts;
    info->num_parameters = m.parameters;
    info->arena_size = (size_t)off[P_COUNT];
    info->vocab_size = m.vocab;
    info->max_seq_len = m.max_seq_len;
    info->kv_cache_bytes = (size_t)m.kv_bytes;
    return COLIBRI_OK;
}

const char *colibri_strerror(int status)
{
    switch (status) {
#define COLIBRI_STATUS_CASE(code, text) \
    case code:                          \
        return text;
        COLIBRI_STATUS_LIST(COLIBRI_STATUS_CASE)
#undef COLIBRI_STATUS_CASE
    default:
        return "unknown status";
    }
}

const char *colibri_version(void)
{
    return COLIBRI_VERSION_STRING;
}
