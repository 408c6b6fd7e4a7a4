/*
 * colibri_api_test IMAGE: every public call with NULLs, misaligned pointers,
 * a short arena, bad batches and buffer lengths, use after free and arena
 * reuse, each expected to return its specific status. Prints "API OK" and
 * exits 0, or one FAIL line per wrong status. Run under the ASan build too.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include "colibri.h"
#include "colibri_common.h"
#define EXPECT(e, want) do { int got_ = (int)(e); if (got_ != (int)(want)) { printf("FAIL %s:%d %s = %d want %d\n", __FILE__, __LINE__, #e, got_, (int)(want)); fails++; } } while (0)
int main(int argc, char **argv) {
    int fails = 0;
    size_t len = 0, need = 0;
    if (argc != 2) {
        fprintf(stderr, "usage: colibri_api_test IMAGE\n");
        return 2;
    }
    unsigned char *img = read_file(argv[1], &len);
    if (img == NULL) {
        fprintf(stderr, "cannot read %s\n", argv[1]);
        return 2;
    }
    EXPECT(colibri_validate(NULL, 100), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_validate(img, len), COLIBRI_OK);
    EXPECT(colibri_model_size(img, len, NULL), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_model_size(img, len, &need), COLIBRI_OK);
    unsigned char *mis = malloc(len + 1); memcpy(mis + 1, img, len);
    EXPECT(colibri_validate(mis + 1, len), COLIBRI_OK);
    size_t need2; EXPECT(colibri_model_size(mis + 1, len, &need2), COLIBRI_OK); EXPECT(need2, need);
    unsigned char *arena = malloc(need + 8);
    colibri_ctx *ctx = (colibri_ctx *)1;
    EXPECT(colibri_init(NULL, arena, need, img, len), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_init(&ctx, NULL, need, img, len), COLIBRI_E_NULL_ARG); EXPECT(ctx == NULL, 1);
    EXPECT(colibri_init(&ctx, arena, need, NULL, len), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_init(&ctx, arena, need, mis + 1, len), COLIBRI_E_IMAGE_ALIGN);
    EXPECT(colibri_init(&ctx, arena + 4, need, img, len), COLIBRI_E_ARENA_ALIGN);
    EXPECT(colibri_init(&ctx, arena, need - 1, img, len), COLIBRI_E_ARENA_TOO_SMALL);
    EXPECT(colibri_init(&ctx, arena, 0, img, len), COLIBRI_E_ARENA_TOO_SMALL);
    EXPECT(colibri_init(&ctx, arena, need, img, 50), COLIBRI_E_TRUNCATED);
    memset(arena, 0, need);
    EXPECT(colibri_forward((colibri_ctx *)(void *)arena, 1, NULL, 0, NULL, 0), COLIBRI_E_BAD_CONTEXT);
    EXPECT(colibri_free((colibri_ctx *)(void *)arena), COLIBRI_E_BAD_CONTEXT);
    EXPECT(colibri_init(&ctx, arena, need, img, len), COLIBRI_OK);
    EXPECT((void *)ctx == (void *)arena, 1);
    colibri_model_info info; memset(&info, 0xAB, sizeof info);
    EXPECT(colibri_get_info(img, len, NULL), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_get_info(img, len, &info), COLIBRI_OK);
    printf("info: v%u size %u flags %u in %u out %u mb %u layers %u tensors %u moe %u experts %u shared %u params %llu arena %zu\n",
        info.format_version, info.image_size, info.flags, info.input_size, info.output_size, info.max_batch, info.num_layers,
        info.num_tensors, info.num_moe_layers, info.num_experts, info.num_shared_experts, (unsigned long long)info.num_parameters, info.arena_size);
    uint32_t ne; EXPECT(colibri_get_num_experts(img, len, &ne), COLIBRI_OK); EXPECT(ne, info.num_experts);
    EXPECT(colibri_get_num_experts(img, len, NULL), COLIBRI_E_NULL_ARG);
    size_t B = info.max_batch, I = info.input_size, O = info.output_size;
    float *in = calloc(B * I + 1, 4), *out = calloc(B * O + 1, 4);
    EXPECT(colibri_forward(NULL, 1, in, I, out, O), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_forward(ctx, 1, NULL, I, out, O), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_forward(ctx, 1, in, I, NULL, O), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_forward(ctx, 0, in, 0, out, 0), COLIBRI_E_BAD_BATCH);
    EXPECT(colibri_forward(ctx, B + 1, in, (B + 1) * I, out, (B + 1) * O), COLIBRI_E_BAD_BATCH);
    EXPECT(colibri_forward(ctx, 1, in, I + 1, out, O), COLIBRI_E_BUFFER_SIZE);
    EXPECT(colibri_forward(ctx, 1, in, I, out, O - 1), COLIBRI_E_BUFFER_SIZE);
    EXPECT(colibri_forward(ctx, (size_t)-1, in, I, out, O), COLIBRI_E_BAD_BATCH);
    EXPECT(colibri_forward(ctx, B, in, B * I, out, B * O), COLIBRI_OK);
    EXPECT(colibri_forward(ctx, 1, in, I, out, O), COLIBRI_OK);
    EXPECT(colibri_free(NULL), COLIBRI_E_NULL_ARG);
    EXPECT(colibri_free(ctx), COLIBRI_OK);
    EXPECT(colibri_free(ctx), COLIBRI_E_BAD_CONTEXT);
    EXPECT(colibri_forward(ctx, 1, in, I, out, O), COLIBRI_E_BAD_CONTEXT);
    /* arena reuse */
    EXPECT(colibri_init(&ctx, arena, need, img, len), COLIBRI_OK);
    EXPECT(colibri_forward(ctx, 1, in, I, out, O), COLIBRI_OK);
    /* The output may overlap the input (the engine reads the input in place
     * and may write its last layer straight into the output): the same
     * result, for the output at the input and one float past it. */
    for (size_t shift = 0; shift < 2; shift++) {
        float *io = calloc(I + O + 1, sizeof *io);
        memcpy(io, in, I * sizeof *io);
        EXPECT(colibri_forward(ctx, 1, io, I, io + shift, O), COLIBRI_OK);
        EXPECT(memcmp(io + shift, out, O * sizeof *io), 0);
        free(io);
    }
    colibri_free(ctx);
    for (int s = 0; s >= -19; s--) {
        const char *text = colibri_strerror(s);
        if (text == NULL || strcmp(text, "unknown status") == 0) {
            printf("FAIL no text for status %d\n", s);
            fails++;
        }
    }
    if (strcmp(colibri_strerror(1), "unknown status") != 0 || strcmp(colibri_strerror(INT_MIN), "unknown status") != 0) {
        printf("FAIL unknown codes\n");
        fails++;
    }
    free(in); free(out); free(arena); free(mis); free(img);
    printf(fails ? "API FAIL\n" : "API OK\n");
    return fails != 0;
}
