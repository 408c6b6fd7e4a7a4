/*
 * colibri_lm_exec_test IMAGE...
 *
 * colibri_lm_forward_ex() (include/colibri.h) against colibri_lm_forward() on
 * each token-model image, over one sequence: a prefill of max_batch tokens,
 * one of 3, then single tokens (decode) to max_seq_len, with the optimised
 * and the reference kernels:
 *   - exec NULL, an empty exec: the same logits, bit for bit;
 *   - parallel_for over colibri_pool with 2 and 3 workers, and over a
 *     caller's own (reversed_for: tasks last to first, workers shuffled), with
 *     on_route and without, with an expert hook declining every expert and
 *     without: the same logits at every step, the same position;
 *   - colibri_model_size_ex(N) is exact: an arena one byte smaller serves
 *     N - 1 workers (N workers: COLIBRI_E_BAD_EXEC);
 *   - a parallel_for handing out a worker index beyond the exec's, one
 *     failing, an on_route or hook failing: their statuses, the position
 *     unchanged;
 *   - the checks of colibri_lm_forward() before the exec's;
 *   - logits_len = vocab (the last token's logits only) on every call of the
 *     sequence, plain and on 1, 2 and 3 workers, with on_route and without:
 *     each call's row is the last row of the whole call's logits, bit for bit,
 *     and the later calls' too (the cache ended the same); any other length
 *     is BUFFER_SIZE.
 * Prints "lm exec ok: N images" and exits 0, or reports and exits 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "colibri_check.h"
#include "colibri_common.h"
#include "colibri_pool.h"

static colibri_status on_route(void *user, const colibri_route *r)
{
    size_t *calls = user;
    (void)r;
    ++*calls;
    return COLIBRI_OK;
}

static colibri_status fail_route(void *user, const colibri_route *r)
{
    (void)user, (void)r;
    return COLIBRI_E_UNSUPPORTED;
}

/* Declines every expert; calls may come from several workers at once. */
static colibri_status decline(void *user, const colibri_expert_call *c)
{
    (void)c;
    __atomic_add_fetch((size_t *)user, 1, __ATOMIC_RELAXED);
    return COLIBRI_EXPERT_DECLINED;
}

static colibri_status fail_expert(void *user, const colibri_expert_call *c)
{
    (void)user, (void)c;
    return COLIBRI_E_BAD_MOE;
}

static colibri_status bad_worker_for(void *user, colibri_task_fn fn, void *arg, size_t n)
{
    (void)user;
    for (size_t t = 0; t < n; t++)
        fn(arg, t, 7); /* beyond the workers it announced */
    return COLIBRI_OK;
}

/* A caller's own parallel_for unlike colibri_pool: one thread, the tasks
 * last to first, each on another of the 3 workers it announces. The engine
 * must not depend on the order or on which worker runs a task. */
static colibri_status reversed_for(void *user, colibri_task_fn fn, void *arg, size_t n)
{
    (void)user;
    for (size_t t = n; t-- > 0;)
        fn(arg, t, (n - 1u - t + 2u) % 3u);
    return COLIBRI_OK;
}

static colibri_status failing_for(void *user, colibri_task_fn fn, void *arg, size_t n)
{
    (void)user, (void)fn, (void)arg, (void)n;
    return COLIBRI_E_UNSUPPORTED;
}

/* The sequence's calls: token counts, then the ids (a deterministic walk below vocab). */
typedef struct sequence {
    size_t calls, total;
    uint32_t count[1024];
    int32_t *ids;
} sequence;

static void make_sequence(sequence *s, const colibri_model_info *info)
{
    const size_t B = info->max_batch, L = info->max_seq_len;
    s->calls = 0;
    s->total = 0;
    for (size_t used = 0; used < L && s->calls < 1024;) {
        const size_t n = s->calls == 0 ? (B < L ? B : L) : s->calls == 1 ? (L - used < 3 ? L - used : 3) : 1;
        const size_t m = n < B ? n : B;
        s->count[s->calls++] = (uint32_t)m;
        used += m;
        s->total += m;
    }
    s->ids = malloc(s->total * sizeof *s->ids);
    for (size_t i = 0; i < s->total; i++)
        s->ids[i] = (int32_t)((i * 2654435761u + 17u) % info->vocab_size);
}

/* Runs the sequence through colibri_lm_forward_ex(exec) (exec NULL and
 * plain: colibri_lm_forward()), all logits into out [total, vocab]. */
static colibri_status run(colibri_ctx *ctx, const colibri_exec *exec, int plain, const sequence *s, size_t vocab,
                          float *out)
{
    colibri_status st = colibri_lm_reset(ctx);
    size_t at = 0;
    for (size_t c = 0; st == COLIBRI_OK && c < s->calls; c++) {
        const uint32_t n = s->count[c];
        st = plain ? colibri_lm_forward(ctx, s->ids + at, n, out + at * vocab, n * vocab)
                   : colibri_lm_forward_ex(ctx, exec, s->ids + at, n, out + at * vocab, n * vocab);
        at += n;
    }
    uint32_t pos = 0;
    if (st == COLIBRI_OK && (colibri_lm_position(ctx, &pos) != COLIBRI_OK || pos != at))
        st = COLIBRI_E_CACHE_FULL;
    return st;
}

/* The sequence with logits_len = vocab on every call: out gets each call's
 * last row where the whole call's logits would put it (the other rows are
 * left as they were). */
static colibri_status run_last(colibri_ctx *ctx, const colibri_exec *exec, int plain, const sequence *s, size_t vocab,
                               float *out)
{
    colibri_status st = colibri_lm_reset(ctx);
    size_t at = 0;
    for (size_t c = 0; st == COLIBRI_OK && c < s->calls; c++) {
        const uint32_t n = s->count[c];
        float *row = out + (at + n - 1) * vocab;
        st = plain ? colibri_lm_forward(ctx, s->ids + at, n, row, vocab)
                   : colibri_lm_forward_ex(ctx, exec, s->ids + at, n, row, vocab);
        at += n;
    }
    uint32_t pos = 0;
    if (st == COLIBRI_OK && (colibri_lm_position(ctx, &pos) != COLIBRI_OK || pos != at))
        st = COLIBRI_E_CACHE_FULL;
    return st;
}

/* Whether each call's last row of a and b agree, bit for bit; the first call
 * that differs in *call. */
static int same_last_rows(const float *a, const float *b, const sequence *s, size_t vocab, size_t *call)
{
    size_t at = 0;
    for (size_t c = 0; c < s->calls; c++) {
        at += s->count[c];
        if (memcmp(a + (at - 1) * vocab, b + (at - 1) * vocab, vocab * sizeof *a) != 0) {
            *call = c;
            return 0;
        }
    }
    return 1;
}

static int same(const float *a, const float *b, size_t n)
{
    return memcmp(a, b, n * sizeof *a) == 0;
}

/* The first differing logit, for the report. */
static size_t first_diff(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, sizeof *a) != 0)
            return i;
    return n;
}

/* One step from position 0: a failure leaves the position where it was. */
static void check_failure(const char *path, const char *what, colibri_ctx *ctx, const colibri_exec *e,
                          const int32_t *ids, uint32_t n, float *out, size_t vocab, colibri_status want)
{
    uint32_t before = 0, after = 1;
    colibri_lm_reset(ctx);
    colibri_lm_position(ctx, &before);
    const colibri_status st = colibri_lm_forward_ex(ctx, e, ids, n, out, n * vocab);
    colibri_lm_position(ctx, &after);
    const uint32_t moved = want == COLIBRI_OK ? n : 0u;
    CHECK(st == want && after == before + moved, "%s: %s (n %u): %s, want %s; position %u -> %u", path, what, n,
          colibri_strerror(st), colibri_strerror(want), before, after);
}

static void test_image(const char *path, colibri_pool *pool2, colibri_pool *pool3)
{
    size_t len;
    void *image = read_file(path, &len);
    colibri_model_info info;
    CHECK(image && colibri_get_info(image, len, &info) == COLIBRI_OK && info.vocab_size, "%s: not a token model",
          path);
    if (!image || !info.vocab_size) {
        free(image);
        return;
    }
    size_t base, s2, s3;
    CHECK(colibri_model_size(image, len, &base) == COLIBRI_OK, "%s", path);
    CHECK(colibri_model_size_ex(image, len, 2, &s2) == COLIBRI_OK && s2 > base, "%s: workers 2", path);
    CHECK(colibri_model_size_ex(image, len, 3, &s3) == COLIBRI_OK && s3 > s2, "%s: workers 3", path);

    const size_t vocab = info.vocab_size;
    sequence seq;
    make_sequence(&seq, &info);
    const size_t n_logits = seq.total * vocab;
    float *ref = malloc(n_logits * sizeof *ref), *out = malloc(n_logits * sizeof *out);
    void *arena = aligned_alloc(8, (s3 + 7) & ~(size_t)7), *one = aligned_alloc(8, (base + 7) & ~(size_t)7);
    colibri_ctx *ctx, *ctx1;
    CHECK(colibri_init(&ctx, arena, s3, image, len) == COLIBRI_OK, "%s: init", path);
    CHECK(colibri_init(&ctx1, one, base, image, len) == COLIBRI_OK, "%s: init one worker", path);

    for (int kset = 0; kset < 2; kset++) {
        const char *ks = kset ? "reference" : "optimised";
        colibri_set_kernels(ctx, kset ? COLIBRI_KERNELS_REFERENCE : COLIBRI_KERNELS_OPTIMISED);
        colibri_set_kernels(ctx1, kset ? COLIBRI_KERNELS_REFERENCE : COLIBRI_KERNELS_OPTIMISED);
        CHECK(run(ctx1, NULL, 1, &seq, vocab, ref) == COLIBRI_OK, "%s %s: colibri_lm_forward", path, ks);

        colibri_exec empty = COLIBRI_EXEC_INIT;
        memset(out, 0xA5, n_logits * sizeof *out);
        CHECK(run(ctx, NULL, 0, &seq, vocab, out) == COLIBRI_OK && same(out, ref, n_logits), "%s %s: exec NULL",
              path, ks);
        memset(out, 0xA5, n_logits * sizeof *out);
        CHECK(run(ctx, &empty, 0, &seq, vocab, out) == COLIBRI_OK && same(out, ref, n_logits), "%s %s: empty exec",
              path, ks);

        colibri_pool *pools[4] = {NULL, pool2, pool3, NULL}; /* 3: reversed_for */
        for (int pi = 0; pi < 4; pi++)
            for (int variant = 0; variant < 4; variant++) { /* bit 0: on_route, bit 1: the declining hook */
                size_t routes = 0, hooks = 0;
                colibri_exec e = COLIBRI_EXEC_INIT;
                colibri_pool_attach(pools[pi], &e);
                if (pi == 3) {
                    e.parallel_for = reversed_for;
                    e.workers = 3;
                }
                if (variant & 1) {
                    e.on_route = on_route;
                    e.on_route_user = &routes;
                }
                if (variant & 2) {
                    e.expert = decline;
                    e.expert_user = &hooks;
                }
                memset(out, 0xA5, n_logits * sizeof *out);
                const colibri_status st = run(ctx, &e, 0, &seq, vocab, out);
                const size_t at = first_diff(out, ref, n_logits);
                CHECK(st == COLIBRI_OK && at == n_logits,
                      "%s %s: %u workers, on_route %d, hook %d: %s; logit %zu (position %zu) %.9g != %.9g", path, ks,
                      e.workers, variant & 1, variant >> 1, colibri_strerror(st), at, at / vocab,
                      at < n_logits ? (double)out[at] : 0.0, at < n_logits ? (double)ref[at] : 0.0);
                CHECK(!(variant & 1) || (routes > 0) == (info.num_moe_layers > 0), "%s: on_route %zu calls", path,
                      routes);
                CHECK(!(variant & 2) || (hooks > 0) == (info.num_moe_layers > 0), "%s: hook %zu calls", path, hooks);
            }

        /* The last token's logits only: the whole call's last row, and the cache as after the whole call. */
        for (int pi = -1; pi < 3; pi++) /* -1: colibri_lm_forward */
            for (int variant = 0; variant < 2; variant++) {
                size_t routes = 0, call = 0;
                colibri_exec e = COLIBRI_EXEC_INIT;
                if (pi >= 0)
                    colibri_pool_attach(pools[pi], &e);
                if (variant) {
                    e.on_route = on_route;
                    e.on_route_user = &routes;
                }
                memset(out, 0xA5, n_logits * sizeof *out);
                const colibri_status st = run_last(pi < 0 ? ctx1 : ctx, &e, pi < 0, &seq, vocab, out);
                CHECK(st == COLIBRI_OK && same_last_rows(out, ref, &seq, vocab, &call),
                      "%s %s: last-token logits, %s, on_route %d: %s; call %zu of %u tokens differs", path, ks,
                      pi < 0 ? "colibri_lm_forward" : pi == 0 ? "1 worker" : pi == 1 ? "2 workers" : "3 workers",
                      variant, colibri_strerror(st), call, seq.count[call]);
                CHECK(!variant || pi < 0 || (routes > 0) == (info.num_moe_layers > 0), "%s: on_route %zu calls", path,
                      routes);
            }
    }

    /* Exactness: one byte short of N workers' arena holds N - 1. */
    colibri_ctx *short2, *short3;
    void *a2 = aligned_alloc(8, (s2 + 7) & ~(size_t)7), *a3 = aligned_alloc(8, (s3 + 7) & ~(size_t)7);
    CHECK(colibri_init(&short2, a2, s2 - 1, image, len) == COLIBRI_OK, "%s: init s2 - 1", path);
    CHECK(colibri_init(&short3, a3, s3 - 1, image, len) == COLIBRI_OK, "%s: init s3 - 1", path);
    colibri_exec e2 = COLIBRI_EXEC_INIT, e3 = COLIBRI_EXEC_INIT;
    colibri_pool_attach(pool2, &e2);
    colibri_pool_attach(pool3, &e3);
    const uint32_t n1 = seq.count[0];
    check_failure(path, "2 workers, arena s2 - 1", short2, &e2, seq.ids, n1, out, vocab, COLIBRI_E_BAD_EXEC);
    check_failure(path, "2 workers, arena s2 - 1, decode", short2, &e2, seq.ids, 1, out, vocab, COLIBRI_E_BAD_EXEC);
    check_failure(path, "3 workers, arena s3 - 1", short3, &e3, seq.ids, 1, out, vocab, COLIBRI_E_BAD_EXEC);
    check_failure(path, "2 workers, arena s3 - 1", short3, &e2, seq.ids, 1, out, vocab, COLIBRI_OK);
    check_failure(path, "2 workers, one-worker arena", ctx1, &e2, seq.ids, 1, out, vocab, COLIBRI_E_BAD_EXEC);

    /* Broken or failing callbacks, at prefill and at decode. */
    colibri_exec e = COLIBRI_EXEC_INIT;
    colibri_pool_attach(pool2, &e);
    const uint32_t ns[2] = {n1, 1};
    for (int k = 0; k < 2; k++) {
        const uint32_t n = ns[k];
        e.parallel_for = bad_worker_for;
        check_failure(path, "a worker beyond the exec's", ctx, &e, seq.ids, n, out, vocab, COLIBRI_E_BAD_EXEC);
        e.parallel_for = failing_for;
        check_failure(path, "a failing parallel_for", ctx, &e, seq.ids, n, out, vocab, COLIBRI_E_UNSUPPORTED);
        colibri_pool_attach(pool2, &e);
        if (info.num_moe_layers) {
            e.on_route = fail_route;
            check_failure(path, "on_route failing", ctx, &e, seq.ids, n, out, vocab, COLIBRI_E_UNSUPPORTED);
            e.on_route = NULL;
            e.expert = fail_expert;
            check_failure(path, "the hook failing", ctx, &e, seq.ids, n, out, vocab, COLIBRI_E_BAD_MOE);
            e.expert = NULL;
        }
    }

    /* colibri_lm_forward's checks come first; then the exec's. */
    colibri_exec bad = COLIBRI_EXEC_INIT;
    bad.struct_size = 4;
    int32_t outside = (int32_t)vocab;
    check_failure(path, "struct_size 4", ctx, &bad, seq.ids, 1, out, vocab, COLIBRI_E_BAD_EXEC);
    check_failure(path, "a bad token before a bad exec", ctx, &bad, &outside, 1, out, vocab, COLIBRI_E_BAD_TOKEN);
    CHECK(colibri_lm_forward_ex(ctx, &e, seq.ids, 0, out, 0) == COLIBRI_E_BAD_BATCH, "%s: n 0", path);
    CHECK(colibri_lm_forward_ex(ctx, &e, seq.ids, 1, out, vocab + 1) == COLIBRI_E_BUFFER_SIZE, "%s: logits_len",
          path);
    if (n1 > 1) { /* n tokens take n · vocab or vocab logits, nothing between or beyond */
        const size_t wrong[4] = {vocab - 1, vocab + 1, n1 * vocab - 1, n1 * vocab + 1};
        for (int w = 0; w < 4; w++) {
            uint32_t pos = 1;
            colibri_lm_reset(ctx);
            CHECK(colibri_lm_forward_ex(ctx, &e, seq.ids, n1, out, wrong[w]) == COLIBRI_E_BUFFER_SIZE &&
                      colibri_lm_position(ctx, &pos) == COLIBRI_OK && pos == 0,
                  "%s: %u tokens, logits_len %zu", path, n1, wrong[w]);
        }
    }
    CHECK(colibri_lm_forward_ex(NULL, &e, seq.ids, 1, out, vocab) == COLIBRI_E_NULL_ARG, "%s: NULL ctx", path);

    colibri_free(ctx);
    CHECK(colibri_lm_forward_ex(ctx, &e, seq.ids, 1, out, vocab) == COLIBRI_E_BAD_CONTEXT, "%s: freed", path);
    free(seq.ids);
    free(ref);
    free(out);
    free(arena);
    free(one);
    free(a2);
    free(a3);
    free(image);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s IMAGE...\n", argv[0]);
        return 2;
    }
    colibri_pool *pool2, *pool3;
    if (colibri_pool_create(&pool2, 2) != COLIBRI_OK || colibri_pool_create(&pool3, 3) != COLIBRI_OK) {
        fprintf(stderr, "cannot start the pools\n");
        return 1;
    }
    for (int i = 1; i < argc; i++)
        test_image(argv[i], pool2, pool3);
    colibri_pool_destroy(pool2);
    colibri_pool_destroy(pool3);
    if (failures) {
        printf("lm exec: %d failures\n", failures);
        return 1;
    }
    printf("lm exec ok: %d images\n", argc - 1);
    return 0;
}
