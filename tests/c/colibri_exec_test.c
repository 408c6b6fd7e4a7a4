/*
 * colibri_exec_test IMAGE...
 *
 * colibri_forward_ex() and colibri_model_size_ex() (include/colibri.h) against
 * colibri_forward() on each image, for batch 1, 8 (if allowed) and max_batch,
 * with the optimised and the reference kernels:
 *   - exec NULL, all callbacks NULL: the same bits;
 *   - on_route: called once per MoE layer in order, the rings it shows
 *     consistent (tokens < batch, nonzero gates, at most batch · K entries),
 *     a negative return stops the pass with that status;
 *   - parallel_for over colibri_pool with 2 and 3 workers: the same bits as
 *     single-threaded; more workers than the arena holds, a broken or failing
 *     parallel_for: their statuses;
 *   - the expert hook: declining every expert gives the same bits (also in
 *     parallel), failing on one returns its status;
 *   - struct_size versioning.
 * Prints "exec ok" and exits 0, or reports and exits 1.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "colibri_check.h"
#include "colibri_common.h"
#include "colibri_pool.h"

typedef struct route_log {
    size_t calls, batch, entries;
    uint32_t next_layer;
    int bad;
    int fail_layer;              /* >= 0: return COLIBRI_E_UNSUPPORTED at this layer */
} route_log;

static colibri_status on_route(void *user, const colibri_route *r)
{
    route_log *log = user;
    log->calls++;
    if (r->layer != log->next_layer++ || r->batch != log->batch || !r->tokens || !r->token || !r->gate)
        log->bad = 1;
    for (uint32_t s = 0; s < r->experts; s++) {
        if (r->tokens[s] > r->batch)
            log->bad = 1;
        for (uint32_t i = 0; i < r->tokens[s]; i++) {
            if (r->token[s * r->batch + i] >= r->batch || r->gate[s * r->batch + i] == 0.0f)
                log->bad = 1;
            if (i && r->token[s * r->batch + i] <= r->token[s * r->batch + i - 1])
                log->bad = 1; /* a ring lists its tokens in order, once each */
        }
        log->entries += r->tokens[s];
    }
    if (log->fail_layer >= 0 && r->layer == (uint32_t)log->fail_layer)
        return COLIBRI_E_UNSUPPORTED;
    return COLIBRI_OK;
}

typedef struct hook_log {
    size_t calls;
    uint32_t workers;            /* the exec's: every call's worker must be below it */
    size_t fail_at;              /* nonzero: fail the fail_at-th call */
    int bad;
} hook_log;

/* Declines every expert (checking what it is shown); calls may come from
 * several workers at once: only the counter is shared, so it is atomic. */
static colibri_status hook(void *user, const colibri_expert_call *c)
{
    hook_log *log = user;
    const size_t n = __atomic_add_fetch(&log->calls, 1, __ATOMIC_RELAXED);
    if (c->struct_size != sizeof *c || !c->x || !c->y || !c->w1 || !c->w2 || c->n == 0 || c->d == 0 ||
        (c->kind != COLIBRI_EXPERT_MLP && c->kind != COLIBRI_EXPERT_GLU) || (c->kind == COLIBRI_EXPERT_GLU) != !!c->w3 ||
        c->worker >= (log->workers ? log->workers : 1))
        log->bad = 1;
    if (log->fail_at && n == log->fail_at)
        return COLIBRI_E_BAD_MOE;
    return COLIBRI_EXPERT_DECLINED;
}

static colibri_status bad_worker_for(void *user, colibri_task_fn fn, void *arg, size_t n)
{
    (void)user;
    for (size_t t = 0; t < n; t++)
        fn(arg, t, 7); /* beyond the workers it announced */
    return COLIBRI_OK;
}

static colibri_status failing_for(void *user, colibri_task_fn fn, void *arg, size_t n)
{
    (void)user, (void)fn, (void)arg, (void)n;
    return COLIBRI_E_UNSUPPORTED;
}

static int same(const float *a, const float *b, size_t n)
{
    return memcmp(a, b, n * sizeof *a) == 0;
}

static void test_image(const char *path, colibri_pool *pool2, colibri_pool *pool3)
{
    size_t len;
    void *image = read_file(path, &len);
    colibri_model_info info;
    CHECK(image && colibri_get_info(image, len, &info) == COLIBRI_OK, "%s: unreadable", path);
    if (!image)
        return;

    size_t base, s0, s1, s2, s3;
    CHECK(colibri_model_size(image, len, &base) == COLIBRI_OK, "%s", path);
    CHECK(colibri_model_size_ex(image, len, 0, &s0) == COLIBRI_OK && s0 == base, "%s: workers 0", path);
    CHECK(colibri_model_size_ex(image, len, 1, &s1) == COLIBRI_OK && s1 == base, "%s: workers 1", path);
    CHECK(colibri_model_size_ex(image, len, 2, &s2) == COLIBRI_OK && s2 >= base, "%s: workers 2", path);
    CHECK(colibri_model_size_ex(image, len, 3, &s3) == COLIBRI_OK && s3 >= s2 && s2 - base >= s3 - s2,
          "%s: workers 3", path);
    CHECK(colibri_model_size_ex(image, len, (size_t)-1, &s0) == COLIBRI_E_UNSUPPORTED || info.num_moe_layers == 0,
          "%s: absurd workers", path);
    CHECK(colibri_model_size_ex(NULL, len, 2, &s0) == COLIBRI_E_NULL_ARG, "%s", path);

    const size_t B = info.max_batch, ni = B * info.input_size, no = B * info.output_size;
    float *in = malloc(ni * sizeof *in), *ref = malloc(no * sizeof *ref), *out = malloc(no * sizeof *out);
    void *arena = aligned_alloc(8, (s3 + 7) & ~(size_t)7), *small = aligned_alloc(8, (base + 7) & ~(size_t)7);
    for (size_t i = 0; i < ni; i++)
        in[i] = sinf(0.37f * (float)i) * 2.0f;

    colibri_ctx *ctx, *ctx_small;
    CHECK(colibri_init(&ctx, arena, s3, image, len) == COLIBRI_OK, "%s: init", path);
    CHECK(colibri_init(&ctx_small, small, base, image, len) == COLIBRI_OK, "%s: init small", path);

    const size_t batches[3] = {1, B < 8 ? B : 8, B};
    for (int kset = 0; kset < 2; kset++) {
        colibri_set_kernels(ctx, kset ? COLIBRI_KERNELS_REFERENCE : COLIBRI_KERNELS_OPTIMISED);
        colibri_set_kernels(ctx_small, kset ? COLIBRI_KERNELS_REFERENCE : COLIBRI_KERNELS_OPTIMISED);
        for (int bi = 0; bi < 3; bi++) {
            const size_t b = batches[bi], bi_n = b * info.input_size, bo_n = b * info.output_size;
            const char *ks = kset ? "reference" : "optimised";
            CHECK(colibri_forward(ctx, b, in, bi_n, ref, bo_n) == COLIBRI_OK, "%s", path);

            colibri_exec ex = COLIBRI_EXEC_INIT;
            memset(out, 0xA5, no * sizeof *out);
            CHECK(colibri_forward_ex(ctx, NULL, b, in, bi_n, out, bo_n) == COLIBRI_OK && same(out, ref, bo_n),
                  "%s %s b%zu: exec NULL", path, ks, b);
            memset(out, 0xA5, no * sizeof *out);
            CHECK(colibri_forward_ex(ctx, &ex, b, in, bi_n, out, bo_n) == COLIBRI_OK && same(out, ref, bo_n),
                  "%s %s b%zu: empty exec", path, ks, b);

            /* on_route, single-threaded and over each pool. */
            colibri_pool *pools[3] = {NULL, pool2, pool3};
            for (int pi = 0; pi < 3; pi++) {
                route_log rl = {0, b, 0, 0, 0, -1};
                hook_log hl = {0, 0, 0, 0};
                colibri_exec e = COLIBRI_EXEC_INIT;
                e.on_route = on_route;
                e.on_route_user = &rl;
                e.expert = hook;
                e.expert_user = &hl;
                colibri_pool_attach(pools[pi], &e);
                hl.workers = e.workers;
                memset(out, 0xA5, no * sizeof *out);
                const colibri_status st = colibri_forward_ex(ctx, &e, b, in, bi_n, out, bo_n);
                CHECK(st == COLIBRI_OK && same(out, ref, bo_n), "%s %s b%zu workers %u: %s, %s", path, ks, b,
                      e.workers, colibri_strerror(st), same(out, ref, bo_n) ? "same" : "differs");
                CHECK(rl.calls == info.num_moe_layers && !rl.bad, "%s b%zu: on_route %zu calls, bad %d", path, b,
                      rl.calls, rl.bad);
                CHECK(!hl.bad && (hl.calls > 0) == (info.num_moe_layers > 0), "%s b%zu: hook %zu calls", path, b,
                      hl.calls);
                /* the same without the hook: the plain parallel path */
                e.expert = NULL;
                memset(out, 0xA5, no * sizeof *out);
                CHECK(colibri_forward_ex(ctx, &e, b, in, bi_n, out, bo_n) == COLIBRI_OK && same(out, ref, bo_n),
                      "%s %s b%zu workers %u: no hook", path, ks, b, e.workers);
                if (info.num_moe_layers) {
                    rl = (route_log){0, b, 0, 0, 0, (int)info.num_moe_layers - 1};
                    CHECK(colibri_forward_ex(ctx, &e, b, in, bi_n, out, bo_n) == COLIBRI_E_UNSUPPORTED &&
                              rl.calls == info.num_moe_layers,
                          "%s: on_route failure", path);
                    e.on_route = NULL;
                    e.expert = hook;
                    hl = (hook_log){0, e.workers, 2, 0};
                    CHECK(colibri_forward_ex(ctx, &e, b, in, bi_n, out, bo_n) == (hl.calls >= 2 ? COLIBRI_E_BAD_MOE
                                                                                                : COLIBRI_OK),
                          "%s: hook failure (%zu calls)", path, hl.calls);
                }
            }
        }
    }

    /* Options the context cannot take. */
    const size_t b = 1, bi_n = info.input_size, bo_n = info.output_size;
    colibri_exec e = COLIBRI_EXEC_INIT;
    colibri_pool_attach(pool2, &e);
    if (info.num_moe_layers) {
        CHECK(colibri_forward_ex(ctx_small, &e, b, in, bi_n, out, bo_n) == COLIBRI_E_BAD_EXEC,
              "%s: 2 workers in a 1-worker arena", path);
        e.workers = 4;
        CHECK(colibri_forward_ex(ctx, &e, b, in, bi_n, out, bo_n) == COLIBRI_E_BAD_EXEC, "%s: 4 workers", path);
        e.workers = 2;
        e.parallel_for = bad_worker_for;
        CHECK(colibri_forward_ex(ctx, &e, b, in, bi_n, out, bo_n) == COLIBRI_E_BAD_EXEC, "%s: bad worker", path);
        e.parallel_for = failing_for;
        CHECK(colibri_forward_ex(ctx, &e, b, in, bi_n, out, bo_n) == COLIBRI_E_UNSUPPORTED, "%s: failing for", path);
    }
    e = (colibri_exec)COLIBRI_EXEC_INIT;
    e.workers = 9; /* no parallel_for: ignored */
    CHECK(colibri_forward_ex(ctx_small, &e, b, in, bi_n, out, bo_n) == COLIBRI_OK, "%s: workers alone", path);
    /* Versioning: smaller is invalid; larger is accepted with a zero tail only. */
    struct {
        colibri_exec e;
        uint64_t tail;
    } big = {COLIBRI_EXEC_INIT, 0};
    big.e.struct_size = (uint32_t)sizeof big;
    CHECK(colibri_forward_ex(ctx, &big.e, b, in, bi_n, out, bo_n) == COLIBRI_OK, "%s: larger struct", path);
    big.tail = 1;
    CHECK(colibri_forward_ex(ctx, &big.e, b, in, bi_n, out, bo_n) == COLIBRI_E_BAD_EXEC, "%s: unknown field", path);
    e = (colibri_exec)COLIBRI_EXEC_INIT;
    e.struct_size = 4;
    CHECK(colibri_forward_ex(ctx, &e, b, in, bi_n, out, bo_n) == COLIBRI_E_BAD_EXEC, "%s: struct_size 4", path);
    e.struct_size = sizeof e;
    CHECK(colibri_forward_ex(ctx, &e, 0, in, bi_n, out, bo_n) == COLIBRI_E_BAD_BATCH, "%s: batch 0", path);
    CHECK(colibri_forward_ex(NULL, &e, b, in, bi_n, out, bo_n) == COLIBRI_E_NULL_ARG, "%s: NULL ctx", path);
    CHECK(strcmp(colibri_strerror(COLIBRI_E_BAD_EXEC), "unknown status") != 0, "strerror");

    colibri_free(ctx);
    CHECK(colibri_forward_ex(ctx, NULL, b, in, bi_n, out, bo_n) == COLIBRI_E_BAD_CONTEXT, "%s: freed", path);
    free(in);
    free(ref);
    free(out);
    free(arena);
    free(small);
    free(image);
}

int main(int argc, char **argv)
{
    colibri_pool *pool2, *pool3, *p;
    if (colibri_pool_create(&pool2, 2) != COLIBRI_OK || colibri_pool_create(&pool3, 3) != COLIBRI_OK) {
        fprintf(stderr, "no pool\n");
        return 1;
    }
    CHECK(colibri_pool_create(&p, 0) == COLIBRI_E_BAD_EXEC && !p, "pool of 0");
    CHECK(colibri_pool_create(NULL, 2) == COLIBRI_E_NULL_ARG, "pool NULL");
    CHECK(colibri_pool_workers(pool3) == 3 && colibri_pool_workers(NULL) == 0, "pool workers");
    for (int i = 1; i < argc; i++)
        test_image(argv[i], pool2, pool3);
    colibri_pool_destroy(pool2);
    colibri_pool_destroy(pool3);
    colibri_pool_destroy(NULL);
    if (failures) {
        fprintf(stderr, "%d failures\n", failures);
        return 1;
    }
    printf("exec ok: %d images\n", argc - 1);
    return 0;
}
