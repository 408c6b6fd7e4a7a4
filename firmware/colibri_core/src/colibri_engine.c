/*
 * The engine: arena layout, context, and the forward pass.
 *
 * The context and every buffer live in the caller's arena; the weights are
 * read in place from the image. colibri_forward() runs the layer program top
 * to bottom on an activation x [batch, width], parsing each small record as
 * it goes with the same readers the validator used.
 */
#include "colibri_internal.h"
#include "colibri_kernels.h"

#define CTX_MAGIC 0x58424C43u /* "CLBX" */

struct colibri_ctx {
    uint32_t magic;          /* CTX_MAGIC while initialised, 0 once freed */
    const uint8_t *image;    /* the model image, weights read in place */
    colibri_model model;     /* header and arena dimensions (B, W, H, R, K, N) */
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
};

_Static_assert(_Alignof(struct colibri_ctx) <= COLIBRI_ARENA_ALIGN, "context alignment exceeds the arena's");

/* ---- Arena ---- */

/* Arena pieces, in address order (docs/model-format.md "Arena"). */
enum {
    P_CTX, P_ACT0, P_ACT1, P_MOE_ACC, P_HIDDEN0, P_HIDDEN1, P_SCORES, P_SELECT,
    P_RING_TOKEN, P_RING_WEIGHT, P_RING_COUNT, P_STACK, P_QROWS, P_QSCALE, P_COUNT
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
    size[P_QSCALE] = Q ? B * f32 : 0;

    off[0] = 0;
    for (int i = 0; i < P_COUNT; i++)
        off[i + 1] = off[i] + ((size[i] + 7u) & ~(uint64_t)7u);
}

/* Validates the image and sizes its arena. */
static colibri_status plan(const void *image, size_t image_len, colibri_model *m, uint64_t off[P_COUNT + 1])
{
    colibri_status st = colibri_check(image, image_len, m);
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
    colibri_status st = plan(image, image_len, &m, off);
    if (st != COLIBRI_OK)
        return st;
    *arena_size = (size_t)off[P_COUNT];
    return COLIBRI_OK;
}

colibri_status colibri_init(colibri_ctx **out, void *arena, size_t arena_size,
                            const void *image, size_t image_len)
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

    colibri_model m;
    uint64_t off[P_COUNT + 1];
    colibri_status st = plan(image, image_len, &m, off);
    if (st != COLIBRI_OK)
        return st;
    if (off[P_COUNT] > arena_size)
        return COLIBRI_E_ARENA_TOO_SMALL;

    uint8_t *base = arena;
    colibri_ctx *c = arena;
    c->image = image;
    c->model = m;
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
    c->magic = CTX_MAGIC;
    *out = c;
    return COLIBRI_OK;
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

static const float *f32_tensor(const colibri_ctx *c, uint32_t index)
{
    return colibri_payload(c->image, &c->model.hdr, index);
}

/* The kernel's view of weight tensor `index` (F32, F16 or I8, validated),
 * an I8 one with its Q8_PARAMS scales and compensation term. */
static colibri_matrix weight(const colibri_ctx *c, uint32_t index)
{
    const colibri_header *hdr = &c->model.hdr;
    colibri_tensor t;
    colibri_read_tensor(c->image, hdr, index, &t);
    colibri_matrix w = {
        .dtype = t.dtype, .rows = t.rows, .cols = t.cols, .data = c->image + t.offset,
        .scale = NULL, .nnz = 0, .row_ptr = NULL, .col = NULL, .val = NULL,
    };
    if (t.dtype == COLIBRI_DTYPE_I8) {
        colibri_tensor q;
        colibri_read_tensor(c->image, hdr, t.aux, &q);
        /* docs/model-format.md "Quantised weights": nnz, reserved, scale
         * [rows], then (nnz > 0) row_ptr [rows + 1], col [nnz], pad, value [nnz]. */
        const uint8_t *p = c->image + q.offset;
        const size_t rows = t.rows;
        w.nnz = colibri_rd_u32(p);
        w.scale = (const float *)(const void *)(p + COLIBRI_Q8_PARAMS_HEADER);
        if (w.nnz) {
            w.row_ptr = (const uint32_t *)(const void *)(w.scale + rows);
            w.col = (const uint16_t *)(const void *)(w.row_ptr + rows + 1);
            w.val = w.col + ((2u * (size_t)w.nnz + 3u) & ~(size_t)3u) / 2u;
        }
    }
    return w;
}

/* Quantises n rows of x (through the index list rows, or 0 .. n-1) into the
 * context's int8 scratch; returns the view the linear kernels take. */
static colibri_qrows quantize(const colibri_ctx *c, const float *x, const uint16_t *rows, size_t n, size_t in)
{
    colibri_quantize_rows(x, rows, n, in, c->qrows, c->qscale);
    return (colibri_qrows){c->qrows, c->qscale};
}

/* y[rows[i]] += scale[i] · expert(x[rows[i]]) for i < n (rows NULL: tokens
 * 0 .. n-1; scale NULL: 1). The n input rows are read in place through the
 * index list; the hidden rows [n, H] are compact. With INT8_ACT the x rows
 * are quantised once for w1 and w3, the hidden rows again for w2. */
static void expert_forward(const colibri_ctx *c, uint32_t index, const float *x, size_t d,
                           const uint16_t *rows, size_t n, const float *scale, float *y)
{
    colibri_expert e;
    colibri_read_expert(c->image, &c->model.hdr, index, &e);
    const size_t hid = e.hidden;
    const int int8_act = (e.flags & COLIBRI_EXPERT_FLAG_INT8_ACT) != 0;
    float *h = c->hidden[0];
    colibri_qrows q = {NULL, NULL};

    if (int8_act)
        q = quantize(c, x, rows, n, d);
    const colibri_matrix w1 = weight(c, e.w1);
    colibri_linear(x, rows, n, &w1, f32_tensor(c, e.b1), int8_act ? &q : NULL, h);
    colibri_activation_f32(h, n * hid, e.activation);
    if (e.kind == COLIBRI_EXPERT_GLU) {
        float *g = c->hidden[1];
        const colibri_matrix w3 = weight(c, e.w3);
        colibri_linear(x, rows, n, &w3, f32_tensor(c, e.b3), int8_act ? &q : NULL, g);
        colibri_mul_f32(h, g, n * hid);
    }
    if (int8_act)
        q = quantize(c, h, NULL, n, hid);
    const colibri_matrix w2 = weight(c, e.w2);
    colibri_linear_acc(h, n, &w2, f32_tensor(c, e.b2), rows, scale, int8_act ? &q : NULL, y);
}

/* y [batch, d] = Σ w_e · expert_e(x) + g · Σ shared_s(x) for MoE record
 * `index`, x [batch, d] (docs/model-format.md "MoE record"). */
static void moe_forward(const colibri_ctx *c, uint32_t index, const float *x, float *y, size_t batch)
{
    const colibri_header *hdr = &c->model.hdr;
    colibri_moe moe;
    colibri_router router;
    colibri_read_moe(c->image, hdr, index, &moe);
    (void)colibri_router_find(moe.routing, &router); /* validated: always found */

    const size_t d = moe.d_model, routes = moe.route_count, n_experts = moe.expert_count;
    const colibri_routing routing = {
        .map = colibri_payload(c->image, hdr, moe.expert_map),
        .routes = routes,
        .top_k = moe.top_k,
        .flags = moe.flags,
    };

    /* 1. Router logits of the whole batch: scores [batch, R]. */
    const colibri_matrix router_weight = weight(c, moe.router_weight);
    colibri_linear(x, NULL, batch, &router_weight, f32_tensor(c, moe.router_bias), NULL, c->scores);

    /* 2. Dispatch: each token's chosen experts get (token, gate weight)
     *    appended to their ring [batch]. No activation row is copied. */
    memset(c->ring_count, 0, n_experts * sizeof *c->ring_count);
    for (size_t t = 0; t < batch; t++) {
        const size_t n = router.route(c->scores + t * routes, &routing, c->sel_weight, c->sel_slot);
        for (size_t j = 0; j < n; j++) {
            /* A gate weight of exactly 0 adds nothing: the expert does not
             * run for the token, so an output it would overflow cannot turn
             * 0 · inf into NaN (docs/model-format.md "Numerics: non-finite
             * values"). A NaN weight runs, and the token's output is NaN. */
            if (c->sel_weight[j] == 0.0f)
                continue;
            const size_t s = c->sel_slot[j], at = s * batch + c->ring_count[s]++;
            c->ring_token[at] = (uint16_t)t; /* t < max_batch <= 65535 */
            c->ring_weight[at] = c->sel_weight[j];
        }
    }

    /* 3. Each routed expert with tokens runs once over its ring,
     *    accumulating straight into the tokens' output rows. */
    memset(y, 0, batch * d * sizeof *y);
    for (size_t s = 0; s < n_experts; s++)
        if (c->ring_count[s])
            expert_forward(c, moe.first_expert + (uint32_t)s, x, d, c->ring_token + s * batch,
                           c->ring_count[s], c->ring_weight + s * batch, y);

    /* 4. Shared experts over every token, scaled by g = sigmoid(x · gate)
     *    when there is a gate. The router scores are dead by now, so they
     *    hold g [batch]. */
    if (moe.shared_count) {
        const float *gate = NULL;
        if (moe.shared_gate != COLIBRI_NONE) {
            const colibri_matrix shared_gate = weight(c, moe.shared_gate);
            colibri_linear(x, NULL, batch, &shared_gate, NULL, NULL, c->scores);
            colibri_activation_f32(c->scores, batch, COLIBRI_ACT_SIGMOID);
            gate = c->scores;
        }
        for (uint32_t i = 0; i < moe.shared_count; i++)
            expert_forward(c, moe.first_expert + moe.expert_count + i, x, d, NULL, batch, gate, y);
    }
}

static void swap(float **a, float **b)
{
    float *t = *a;
    *a = *b;
    *b = t;
}

colibri_status colibri_forward(colibri_ctx *ctx, size_t batch,
                               const float *input, size_t input_count,
                               float *output, size_t output_count)
{
    if (!ctx)
        return COLIBRI_E_NULL_ARG;
    if (ctx->magic != CTX_MAGIC)
        return COLIBRI_E_BAD_CONTEXT;
    if (!input || !output)
        return COLIBRI_E_NULL_ARG;
    const colibri_header *hdr = &ctx->model.hdr;
    if (batch == 0 || batch > hdr->max_batch)
        return COLIBRI_E_BAD_BATCH;
    /* No overflow: batch * width fits, the arena holds max_batch * W floats. */
    if (input_count != batch * hdr->input_size || output_count != batch * hdr->output_size)
        return COLIBRI_E_BUFFER_SIZE;

    /* x is the current activation [batch, width]; spare receives LINEAR
     * outputs, moe_acc MoE outputs, and pointers swap instead of copying. */
    float *x = ctx->act[0], *spare = ctx->act[1], *moe_acc = ctx->moe_acc;
    const size_t stack_slot = batch * ctx->model.width;
    size_t depth = 0;

    memcpy(x, input, input_count * sizeof *x);
    for (uint32_t i = 0; i < hdr->layer_count; i++) {
        colibri_layer l;
        colibri_read_layer(ctx->image, hdr, i, &l);
        const size_t in = l.in_features;

        switch (l.op) {
        case COLIBRI_OP_LINEAR: {
            const colibri_matrix w = weight(ctx, l.t0);
            colibri_qrows q = {NULL, NULL};
            if (l.flags & COLIBRI_LAYER_FLAG_INT8_ACT)
                q = quantize(ctx, x, NULL, batch, in);
            colibri_linear(x, NULL, batch, &w, f32_tensor(ctx, l.t1),
                           (l.flags & COLIBRI_LAYER_FLAG_INT8_ACT) ? &q : NULL, spare);
            swap(&x, &spare);
            break;
        }
        case COLIBRI_OP_ACTIVATION:
            colibri_activation_f32(x, batch * in, l.kind);
            break;
        case COLIBRI_OP_LAYERNORM:
            colibri_layernorm_f32(x, batch, in, f32_tensor(ctx, l.t0), f32_tensor(ctx, l.t1), l.eps);
            break;
        case COLIBRI_OP_RMSNORM:
            colibri_rmsnorm_f32(x, batch, in, f32_tensor(ctx, l.t0), l.eps);
            break;
        case COLIBRI_OP_RESIDUAL_PUSH:
            memcpy(ctx->stack + depth++ * stack_slot, x, batch * in * sizeof *x);
            break;
        case COLIBRI_OP_RESIDUAL_ADD:
            colibri_add_f32(x, ctx->stack + --depth * stack_slot, batch * in);
            break;
        case COLIBRI_OP_MOE:
            moe_forward(ctx, l.t0, x, moe_acc, batch);
            swap(&x, &moe_acc);
            break;
        default: /* unreachable: ops are validated */
            break;
        }
    }
    memcpy(output, x, output_count * sizeof *x);
    return COLIBRI_OK;
}

/* ---- Model information ---- */

colibri_status colibri_get_num_experts(const void *image, size_t image_len, uint32_t *num_experts)
{
    colibri_model m;
    if (!image || !num_experts)
        return COLIBRI_E_NULL_ARG;
    colibri_status st = colibri_check(image, image_len, &m);
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
    colibri_status st = plan(image, image_len, &m, off);
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
