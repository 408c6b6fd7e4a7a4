/*
 * Routing modes (docs/model-format.md "MoE record"): each picks, for one
 * token, which routed experts run and with what gate weight. Only experts
 * whose expert_map entry is not -1 can be chosen; among equal values the
 * lower router index wins. A new mode is one function here and one entry in
 * colibri_router_find()'s table.
 */
#include "colibri_internal.h"
#include "colibri_kernels.h"

/* a ranks above b: the larger, with NaN above every number, as torch.sort
 * and torch.topk order them (docs/model-format.md "Numerics: non-finite
 * values"). Two NaN are equal. */
static int above(float a, float b)
{
    return a > b || (a != a && b == b);
}

/* The k largest v[r] over kept router outputs r, in descending order, ties
 * to the lower r (r is visited in ascending order and only a value ranking
 * strictly above moves ahead). Writes their values and expert slots;
 * returns k. The caller guarantees k <= kept outputs (validated: k <= N and
 * all N slots are in the map). */
static size_t select_top_k(const float *v, const colibri_routing *r, float *weight, uint32_t *slot)
{
    const size_t k = r->top_k;
    size_t n = 0;
    for (size_t i = 0; i < r->routes; i++) {
        if (r->map[i] < 0)
            continue;
        size_t pos;
        if (n < k)
            pos = n++;
        else if (above(v[i], weight[k - 1]))
            pos = k - 1; /* replaces the smallest */
        else
            continue;
        for (; pos > 0 && above(v[i], weight[pos - 1]); pos--) {
            weight[pos] = weight[pos - 1];
            slot[pos] = slot[pos - 1];
        }
        weight[pos] = v[i];
        slot[pos] = (uint32_t)r->map[i];
    }
    return n;
}

/* Switch: p = softmax(z); the largest p, weighted by p itself. top_k is 1
 * (validated): select_top_k's choice without its insertion steps, the first
 * kept output that no later one ranks above. */
static size_t route_top1(float *z, const colibri_routing *r, float *weight, uint32_t *slot)
{
    colibri_softmax_f32(z, r->routes);
    size_t best = 0;
    /* Validated: some output is kept. Bounded all the same: an image changed
     * in place after validation may have none left (then nothing is chosen). */
    while (best < r->routes && r->map[best] < 0)
        best++;
    if (best == r->routes)
        return 0;
    for (size_t i = best + 1; i < r->routes; i++)
        if (r->map[i] >= 0 && above(z[i], z[best]))
            best = i;
    weight[0] = z[best];
    slot[0] = (uint32_t)r->map[best];
    return 1;
}

/* Mixtral: the k largest logits, weighted by the softmax of those k. */
static size_t route_topk_softmax(float *z, const colibri_routing *r, float *weight, uint32_t *slot)
{
    const size_t n = select_top_k(z, r, weight, slot);
    colibri_softmax_f32(weight, n);
    return n;
}

/* GShard, Qwen-MoE: p = softmax(z); the k largest p, weighted by p, or by
 * p / sum(chosen p) with RENORMALIZE. */
static size_t route_softmax_topk(float *z, const colibri_routing *r, float *weight, uint32_t *slot)
{
    colibri_softmax_f32(z, r->routes);
    const size_t n = select_top_k(z, r, weight, slot);
    if (r->flags & COLIBRI_MOE_FLAG_RENORMALIZE) {
        float sum = 0.0f;
        for (size_t i = 0; i < n; i++)
            sum += weight[i];
        for (size_t i = 0; i < n; i++)
            weight[i] /= sum;
    }
    return n;
}

/* Soft mixture: p = softmax(z); every kept expert, weighted by p. A valid
 * map keeps exactly N = top_k (the plan sets it so for this mode); the map
 * is read in place, so at most N are chosen (the selection holds N). */
static size_t route_dense(float *z, const colibri_routing *r, float *weight, uint32_t *slot)
{
    colibri_softmax_f32(z, r->routes);
    size_t n = 0;
    for (size_t i = 0; i < r->routes && n < r->top_k; i++) {
        if (r->map[i] < 0)
            continue;
        weight[n] = z[i];
        slot[n] = (uint32_t)r->map[i];
        n++;
    }
    return n;
}

int colibri_router_find(uint32_t mode, colibri_router *out)
{
    /* Indexed by COLIBRI_ROUTING_*. An automatic rather than a static table:
     * static function pointers would need load-time relocation (a
     * .data.rel.ro section) in position-independent builds; this way the
     * library has no data but .rodata. */
    const colibri_router routers[] = {
        [COLIBRI_ROUTING_TOP1] = {route_top1, COLIBRI_K_ONE, 0},
        [COLIBRI_ROUTING_TOPK_SOFTMAX] = {route_topk_softmax, COLIBRI_K_ANY, 0},
        [COLIBRI_ROUTING_SOFTMAX_TOPK] = {route_softmax_topk, COLIBRI_K_ANY, COLIBRI_MOE_FLAG_RENORMALIZE},
        [COLIBRI_ROUTING_DENSE] = {route_dense, COLIBRI_K_ALL, 0},
    };
    if (mode >= sizeof routers / sizeof routers[0] || !routers[mode].route)
        return 0;
    *out = routers[mode];
    return 1;
}
