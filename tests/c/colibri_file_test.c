/*
 * colibri_file_test: the POSIX file layer (posix/colibri_file.h) from C, as a
 * libcolibri user runs it, plain and under ASan + UBSan (tests/edge/test_edge_mapped.py).
 *
 *   colibri_file_test GOOD.clb BAD.clb LAYER EXPERT DIR
 *
 * GOOD is a page-aligned (format v3) model; BAD the same with one byte of
 * expert (LAYER, EXPERT) flipped; DIR a folder. Checks: the open statuses
 * (missing, a folder, not a model), a structure-level context over the
 * mapping run through colibri_forward_ex with colibri_file_on_route gives
 * colibri_init's (full check) bits; the expert ranges are page-aligned; the
 * corrupted expert opens, is refused on use (on_route, verify_expert, verify,
 * a lock of it at open) and the others verify; NO_SUCH_EXPERT; a copy
 * truncated in place under a context stops forward_ex with FILE_CHANGED
 * (no SIGBUS: the first MoE layer's experts sit past the new end). Prints "ok".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "colibri.h"
#include "colibri_file.h"

#define CHECK(cond)                                                             \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "colibri_file_test:%d: %s\n", __LINE__, #cond);     \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

typedef struct {
    colibri_file *file;
    unsigned calls;
} route_log;

static colibri_status on_route(void *user, const colibri_route *route)
{
    route_log *log = user;
    log->calls++;
    return colibri_file_on_route(log->file, route);
}

/* Runs batch tokens through a context over the file's mapping with the
 * on_route callback; returns the status, outputs in out. */
static colibri_status run(colibri_file *f, const float *in, float *out, size_t batch, unsigned *calls)
{
    const void *img = colibri_file_data(f);
    const size_t len = colibri_file_size(f);
    colibri_model_info info;
    size_t need;
    CHECK(colibri_get_info(img, len, &info) == COLIBRI_OK);
    CHECK(colibri_model_size(img, len, &need) == COLIBRI_OK);
    void *arena = aligned_alloc(8, (need + 7u) & ~(size_t)7u);
    CHECK(arena != NULL);
    colibri_ctx *ctx;
    CHECK(colibri_init_ex(&ctx, arena, need, img, len, COLIBRI_CHECK_STRUCTURE) == COLIBRI_OK);
    route_log log = {f, 0};
    colibri_exec exec = COLIBRI_EXEC_INIT;
    exec.on_route = on_route;
    exec.on_route_user = &log;
    colibri_status st = colibri_forward_ex(ctx, &exec, batch, in, batch * info.input_size, out,
                                           batch * info.output_size);
    colibri_free(ctx);
    free(arena);
    *calls = log.calls;
    return st;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: colibri_file_test GOOD.clb BAD.clb LAYER EXPERT DIR\n");
        return 2;
    }
    const uint32_t bad_layer = (uint32_t)atoi(argv[3]), bad_expert = (uint32_t)atoi(argv[4]);
    colibri_file *f = NULL;
    colibri_file_diag diag;

    /* Open statuses. */
    char missing[4096];
    snprintf(missing, sizeof missing, "%s/no-such-model.clb", argv[5]);
    CHECK(colibri_file_open(&f, missing, NULL, &diag) == COLIBRI_E_FILE_NOT_FOUND && f == NULL);
    CHECK(colibri_file_open(&f, argv[5], NULL, &diag) == COLIBRI_E_FILE_OPEN && f == NULL);
    CHECK(colibri_file_open(&f, argv[0], NULL, &diag) == COLIBRI_E_BAD_MAGIC && f == NULL); /* this ELF */
    CHECK(colibri_file_open(NULL, argv[1], NULL, NULL) == COLIBRI_E_NULL_ARG);

    /* The good model: mapped, run through on_route, the same bits as colibri_init's context. */
    CHECK(colibri_file_open(&f, argv[1], NULL, &diag) == COLIBRI_OK);
    const void *img = colibri_file_data(f);
    const size_t len = colibri_file_size(f);
    colibri_model_info info;
    CHECK(colibri_get_info(img, len, &info) == COLIBRI_OK && info.format_version == 3u);
    const size_t batch = info.max_batch;
    float *in = malloc(batch * info.input_size * sizeof *in);
    float *a = malloc(batch * info.output_size * sizeof *a), *b = malloc(batch * info.output_size * sizeof *b);
    CHECK(in && a && b);
    for (size_t i = 0; i < batch * info.input_size; i++)
        in[i] = (float)((i * 7919u) % 17u) / 4.0f - 2.0f;
    unsigned calls = 0;
    CHECK(run(f, in, a, batch, &calls) == COLIBRI_OK && calls == info.num_moe_layers);
    size_t need;
    CHECK(colibri_model_size(img, len, &need) == COLIBRI_OK);
    void *arena = aligned_alloc(8, (need + 7u) & ~(size_t)7u);
    colibri_ctx *ctx;
    CHECK(arena && colibri_init(&ctx, arena, need, img, len) == COLIBRI_OK);
    CHECK(colibri_forward(ctx, batch, in, batch * info.input_size, b, batch * info.output_size) == COLIBRI_OK);
    colibri_free(ctx);
    free(arena);
    CHECK(memcmp(a, b, batch * info.output_size * sizeof *a) == 0);
    CHECK(colibri_file_moe_layers(f) == info.num_moe_layers);
    for (uint32_t l = 0; l < colibri_file_moe_layers(f); l++)
        for (uint32_t e = 0; e < colibri_file_layer_experts(f, l); e++) {
            size_t off, size;
            CHECK(colibri_file_expert_range(f, l, e, &off, &size) == COLIBRI_OK && off % 4096u == 0 && size > 0);
            CHECK(colibri_file_verify_expert(f, l, e) == COLIBRI_OK);
        }
    const uint32_t none = colibri_file_layer_experts(f, bad_layer);
    CHECK(colibri_file_will_need(f, bad_layer, &none, 1) == COLIBRI_E_NO_SUCH_EXPERT);
    CHECK(colibri_file_will_need(f, colibri_file_moe_layers(f), &bad_expert, 1) == COLIBRI_E_NO_SUCH_EXPERT);
    CHECK(colibri_file_verify(f) == COLIBRI_OK && colibri_file_check(f) == COLIBRI_OK);
    CHECK(colibri_file_replaced(f) == 0 && colibri_file_resident(f) > 0);
    colibri_file_close(f);

    /* The corrupted expert: opens (nothing of it is read), refused on use. */
    CHECK(colibri_file_open(&f, argv[2], NULL, &diag) == COLIBRI_OK);
    for (uint32_t e = 0; e < colibri_file_layer_experts(f, bad_layer); e++)
        CHECK(colibri_file_verify_expert(f, bad_layer, e) == (e == bad_expert ? COLIBRI_E_BAD_PAYLOAD_CRC : COLIBRI_OK));
    CHECK(colibri_file_will_need(f, bad_layer, &bad_expert, 1) == COLIBRI_E_BAD_PAYLOAD_CRC);
    CHECK(colibri_file_verify(f) == COLIBRI_E_BAD_PAYLOAD_CRC);
    CHECK(colibri_validate(colibri_file_data(f), colibri_file_size(f)) == COLIBRI_E_BAD_PAYLOAD_CRC);
    colibri_file_close(f);
    colibri_file_options full = {.verify = COLIBRI_VERIFY_FULL};
    CHECK(colibri_file_open(&f, argv[2], &full, &diag) == COLIBRI_E_BAD_PAYLOAD_CRC && f == NULL);
    colibri_expert_id id = {bad_layer, bad_expert};
    colibri_file_options lock = {.lock = COLIBRI_LOCK_EXPERTS, .lock_experts = &id, .lock_count = 1};
    const colibri_status st = colibri_file_open(&f, argv[2], &lock, &diag);
    CHECK(st == COLIBRI_E_BAD_PAYLOAD_CRC || st == COLIBRI_E_MLOCK_FAILED);
    CHECK(f == NULL);
    if (st == COLIBRI_E_BAD_PAYLOAD_CRC)
        CHECK(diag.expert.layer == bad_layer && diag.expert.expert == bad_expert);
    id.expert = 1000;
    CHECK(colibri_file_open(&f, argv[2], &lock, &diag) == COLIBRI_E_NO_SUCH_EXPERT && f == NULL);

    /* Truncated in place under a context: the route callback stops the forward
     * pass with FILE_CHANGED before any expert touches a page past the end. */
    char trunc[4096];
    snprintf(trunc, sizeof trunc, "%s/truncated.clb", argv[5]);
    FILE *src = fopen(argv[1], "rb"), *dst = fopen(trunc, "wb");
    CHECK(src && dst);
    char buf[65536];
    for (size_t n; (n = fread(buf, 1, sizeof buf, src)) > 0;)
        CHECK(fwrite(buf, 1, n, dst) == n);
    fclose(src);
    CHECK(fclose(dst) == 0);
    CHECK(colibri_file_open(&f, trunc, NULL, &diag) == COLIBRI_OK);
    CHECK(colibri_model_size(colibri_file_data(f), colibri_file_size(f), &need) == COLIBRI_OK);
    arena = aligned_alloc(8, (need + 7u) & ~(size_t)7u);
    CHECK(arena && colibri_init_ex(&ctx, arena, need, colibri_file_data(f), colibri_file_size(f),
                                   COLIBRI_CHECK_STRUCTURE) == COLIBRI_OK);
    size_t first, first_size;
    CHECK(colibri_file_expert_range(f, 0, 0, &first, &first_size) == COLIBRI_OK);
    CHECK(truncate(trunc, (off_t)first) == 0); /* the first layer's experts and all after them are gone */
    CHECK(colibri_file_check(f) == COLIBRI_E_FILE_CHANGED);
    colibri_exec exec = COLIBRI_EXEC_INIT;
    exec.on_route = colibri_file_on_route;
    exec.on_route_user = f;
    CHECK(colibri_forward_ex(ctx, &exec, batch, in, batch * info.input_size, a, batch * info.output_size) ==
          COLIBRI_E_FILE_CHANGED);
    colibri_free(ctx);
    free(arena);
    colibri_file_close(f);
    CHECK(remove(trunc) == 0);

    free(in);
    free(a);
    free(b);
    puts("ok");
    return 0;
}
