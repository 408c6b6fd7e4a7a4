/*
 * libFuzzer harness over the engine's public API: colibri_validate,
 * colibri_model_size, colibri_get_info, colibri_init (with one byte too few,
 * then exactly enough) and colibri_forward (batch 1 and the image's
 * max_batch), under AddressSanitizer and UndefinedBehaviorSanitizer.
 *
 * The input is a model image. The harness rewrites the header CRC over the
 * mutated bytes first (when image_size lies within the input), otherwise
 * nearly every mutation would stop at BAD_CRC and never reach the table and
 * record checks. The image is copied into a 4-byte aligned buffer of exactly
 * its length, so ASan catches any read past its end.
 *
 * Properties beyond "no crash": model_size and get_info agree; init refuses
 * an arena one byte short with ARENA_TOO_SMALL and accepts the exact size;
 * validate, model_size and init give the same status.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "crc32.h"

/* Arenas above this are not allocated (an absurd but valid max_batch). */
#define ARENA_LIMIT ((size_t)64 << 20)

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void fix_crc(uint8_t *image, size_t len)
{
    if (len < COLIBRI_HEADER_SIZE)
        return;
    const uint32_t size = rd32(image + 12);
    if (size < COLIBRI_CRC_START || size > len)
        return;
    const uint32_t crc = crc32_update(0u, image + COLIBRI_CRC_START, size - COLIBRI_CRC_START);
    for (int i = 0; i < 4; i++)
        image[8 + i] = (uint8_t)(crc >> (8 * i));
}

static void forward(colibri_ctx *ctx, const colibri_model_info *info, size_t batch)
{
    const size_t n_in = batch * info->input_size, n_out = batch * info->output_size;
    float *in = malloc(n_in * sizeof *in + 1), *out = malloc(n_out * sizeof *out + 1);
    if (!in || !out)
        abort();
    for (size_t i = 0; i < n_in; i++)
        in[i] = sinf(0.37f * (float)i) * 3.0f;
    if (colibri_forward(ctx, batch, in, n_in, out, n_out) != COLIBRI_OK)
        abort(); /* a validated image with the right counts must run */
    free(in);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *image = malloc(size ? size : 1);
    if (!image)
        abort();
    memcpy(image, data, size);
    fix_crc(image, size);

    const colibri_status v = colibri_validate(image, size);
    size_t need = 0;
    const colibri_status sz = colibri_model_size(image, size, &need);
    if (sz != v)
        abort();
    if (sz == COLIBRI_OK) {
        colibri_model_info info;
        if (colibri_get_info(image, size, &info) != COLIBRI_OK || info.arena_size != need)
            abort();
        if (need <= ARENA_LIMIT) {
            /* malloc is 8-byte aligned (COLIBRI_ARENA_ALIGN). */
            void *arena = malloc(need);
            colibri_ctx *ctx = NULL;
            if (!arena)
                abort();
            if (colibri_init(&ctx, arena, need - 1, image, size) != COLIBRI_E_ARENA_TOO_SMALL || ctx != NULL)
                abort();
            if (colibri_init(&ctx, arena, need, image, size) != COLIBRI_OK)
                abort();
            forward(ctx, &info, 1);
            if (info.max_batch <= 16)
                forward(ctx, &info, info.max_batch);
            colibri_free(ctx);
            free(arena);
        }
    }
    free(image);
    return 0;
}
