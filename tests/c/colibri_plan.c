/*
 * colibri_plan IMAGE...: shows that colibri_forward() parses no record of
 * the image: colibri_init() resolves the layer program into the plan once.
 *
 * For each image: a private copy is initialised and run (batch 1 and
 * max_batch), then every record byte the forward pass could parse is
 * overwritten (XOR 0x5A) in that copy: the header, the tensor, layer, MoE and
 * expert tables, and the 8-byte header that opens each Q8_PARAMS payload
 * (nnz, then v1's reserved word or v2's parameter dtype, flags, reserved). Weights, scales, compensation terms, biases and expert maps are
 * payloads read in place, so they stay. The same context then runs again
 * and its outputs must equal the first run's bit for bit; the corrupted copy
 * must also fail validation, so the corruption is not a no-op.
 *
 * Prints "plan OK <path>: <bytes> record bytes corrupted" per image, or
 * "FAIL ..." and exits 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "colibri_common.h"

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static size_t flip(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] ^= 0x5Au;
    return n;
}

/* Overwrites every record byte of the image; returns how many. Offsets
 * come from the image itself, which init has already validated. */
static size_t corrupt_records(uint8_t *img)
{
    const uint32_t tensor_count = rd32(img + 32), tensor_offset = rd32(img + 36);
    const uint32_t tables[3][3] = {
        {rd32(img + 40), rd32(img + 44), COLIBRI_LAYER_SIZE},
        {rd32(img + 48), rd32(img + 52), COLIBRI_MOE_SIZE},
        {rd32(img + 56), rd32(img + 60), COLIBRI_EXPERT_SIZE},
    };
    size_t n = 0;
    for (uint32_t i = 0; i < tensor_count; i++) {
        const uint8_t *t = img + tensor_offset + (size_t)i * COLIBRI_TENSOR_SIZE;
        if (t[16] == COLIBRI_DTYPE_Q8_PARAMS)
            n += flip(img + rd32(t), COLIBRI_Q8_PARAMS_HEADER);
    }
    n += flip(img + tensor_offset, (size_t)tensor_count * COLIBRI_TENSOR_SIZE);
    for (int k = 0; k < 3; k++)
        n += flip(img + tables[k][1], (size_t)tables[k][0] * tables[k][2]);
    n += flip(img, COLIBRI_HEADER_SIZE);
    return n;
}

/* Runs batch 1 then max_batch; the outputs of both, concatenated, in out. */
static int run(colibri_ctx *ctx, const colibri_model_info *info, float *out)
{
    const size_t batches[2] = {1, info->max_batch};
    for (int k = 0; k < 2; k++) {
        const size_t b = batches[k], n_in = b * info->input_size, n_out = b * info->output_size;
        float *in = malloc(n_in * sizeof *in);
        if (!in)
            return -1;
        for (size_t i = 0; i < n_in; i++)
            in[i] = sinf(0.37f * (float)i + (float)k);
        const colibri_status st = colibri_forward(ctx, b, in, n_in, out, n_out);
        free(in);
        if (st != COLIBRI_OK)
            return st;
        out += n_out;
    }
    return 0;
}

static int check(const char *path)
{
    size_t len = 0;
    uint8_t *img = read_file(path, &len);
    colibri_model_info info;
    if (!img || colibri_get_info(img, len, &info) != COLIBRI_OK) {
        printf("FAIL %s: cannot read or validate\n", path);
        free(img);
        return 1;
    }
    const size_t n_out = (1 + (size_t)info.max_batch) * info.output_size;
    void *arena = malloc(info.arena_size);
    float *before = malloc(n_out * sizeof *before), *after = malloc(n_out * sizeof *after);
    colibri_ctx *ctx = NULL;
    int bad = 1;
    if (!arena || !before || !after || colibri_init(&ctx, arena, info.arena_size, img, len) != COLIBRI_OK) {
        printf("FAIL %s: cannot initialise\n", path);
    } else if (run(ctx, &info, before) != 0) {
        printf("FAIL %s: forward failed on the intact image\n", path);
    } else {
        const size_t corrupted = corrupt_records(img);
        if (colibri_validate(img, len) == COLIBRI_OK)
            printf("FAIL %s: the corrupted copy still validates\n", path);
        else if (run(ctx, &info, after) != 0)
            printf("FAIL %s: forward failed after the records were corrupted\n", path);
        else if (memcmp(before, after, n_out * sizeof *before) != 0)
            printf("FAIL %s: outputs changed after the records were corrupted\n", path);
        else {
            printf("plan OK %s: %zu record bytes corrupted\n", path, corrupted);
            bad = 0;
        }
    }
    if (ctx)
        colibri_free(ctx);
    free(before);
    free(after);
    free(arena);
    free(img);
    return bad;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: colibri_plan IMAGE...\n");
        return 2;
    }
    int failed = 0;
    for (int i = 1; i < argc; i++)
        failed |= check(argv[i]);
    return failed;
}
