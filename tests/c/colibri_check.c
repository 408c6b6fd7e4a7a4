/*
 * colibri_check: runs every engine entry point over a stream of images and
 * prints one line per image, for the Python tests (fuzzing, corruption).
 *
 * stdin: records of { u32 little-endian length L, L bytes of image };
 * L = 0xFFFFFFFF (or end of input) ends the stream. Each image is copied into a fresh buffer
 * of exactly L bytes so AddressSanitizer catches any read past its end.
 *
 * stdout, one line per record (statuses are the integer codes; "-" for a
 * step not reached):
 *   validate=S size=S:BYTES init=S fwd1=S fwdN=S sum=SUM short=S
 * size: colibri_model_size; short: colibri_init with one byte less than that;
 * init: colibri_init with exactly that; fwd1 / fwdN: forward with batch 1
 * and batch max_batch on input[i] = sinf(0.37f * i); sum: the sum of every
 * output of both forwards (%.9g, "nan" if NaN). A token model (docs/lm.md)
 * runs colibri_lm_forward instead, from position 0 each time, on tokens
 * (7 i + 3) mod vocab, batch max_batch capped at max_seq_len, and draws a
 * token from the last row's logits, greedy and at temperature 0.8 with
 * top-k 5 and top-p 0.9 (a failed draw is the forward's status). Exit status 0; 2 on bad
 * input, 3 if colibri_get_info() disagrees with colibri_model_size().
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "colibri.h"

/* Arenas above this are reported as "nomem" rather than allocated. */
#define ARENA_LIMIT ((size_t)1 << 30)

static int read_exact(void *buf, size_t n)
{
    return fread(buf, 1, n, stdin) == n;
}

/* A token model's forward: batch tokens from position 0, then two draws. */
static colibri_status lm_forward(colibri_ctx *ctx, const colibri_model_info *info, size_t batch, double *sum)
{
    if (info->max_seq_len && batch > info->max_seq_len)
        batch = info->max_seq_len;
    const size_t n_out = batch * info->output_size;
    int32_t *tok = malloc(batch * sizeof *tok);
    float *out = malloc(n_out * sizeof *out);
    if (!tok || !out) {
        fprintf(stderr, "colibri_check: out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < batch; i++)
        tok[i] = (int32_t)((7u * i + 3u) % info->vocab_size);
    colibri_status st = colibri_lm_reset(ctx);
    if (st == COLIBRI_OK)
        st = colibri_lm_forward(ctx, tok, (uint32_t)batch, out, n_out);
    if (st == COLIBRI_OK)
        for (size_t i = 0; i < n_out; i++)
            *sum += out[i];
    const colibri_sampler greedy = {sizeof greedy, 0.0f, 0u, 1.0f}, sampled = {sizeof sampled, 0.8f, 5u, 0.9f};
    colibri_rng rng;
    colibri_rng_seed(&rng, 7u);
    int32_t drawn = -1;
    const float *last = out + (batch - 1) * info->output_size;
    /* NaN or inf logits are a valid outcome of a valid model: not a failure here. */
    if (st == COLIBRI_OK && (st = colibri_lm_sample(ctx, &greedy, last, info->output_size, &rng, &drawn)) ==
                                COLIBRI_E_NAN_LOGITS)
        st = COLIBRI_OK;
    if (st == COLIBRI_OK && (st = colibri_lm_sample(ctx, &sampled, last, info->output_size, &rng, &drawn)) ==
                                COLIBRI_E_NAN_LOGITS)
        st = COLIBRI_OK;
    free(tok);
    free(out);
    return st;
}

/* Runs one forward of `batch` tokens; adds its outputs to *sum. */
static colibri_status forward(colibri_ctx *ctx, const colibri_model_info *info, size_t batch, double *sum)
{
    if (info->vocab_size)
        return lm_forward(ctx, info, batch, sum);
    const size_t n_in = batch * info->input_size, n_out = batch * info->output_size;
    float *in = malloc(n_in * sizeof *in), *out = malloc(n_out * sizeof *out);
    if (!in || !out) {
        fprintf(stderr, "colibri_check: out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < n_in; i++)
        in[i] = sinf(0.37f * (float)i);
    colibri_status st = colibri_forward(ctx, batch, in, n_in, out, n_out);
    if (st == COLIBRI_OK)
        for (size_t i = 0; i < n_out; i++)
            *sum += out[i];
    free(in);
    free(out);
    return st;
}

static void check(const uint8_t *image, size_t len)
{
    char size_s[48] = "-", init_s[16] = "-", fwd1_s[16] = "-", fwdn_s[16] = "-";
    char sum_s[32] = "-", short_s[16] = "-";
    size_t need = 0;

    const colibri_status v = colibri_validate(image, len);
    const colibri_status sz = colibri_model_size(image, len, &need);
    colibri_model_info info;
    if (sz == COLIBRI_OK && (colibri_get_info(image, len, &info) != COLIBRI_OK || info.arena_size != need)) {
        fprintf(stderr, "colibri_check: colibri_get_info disagrees with colibri_model_size\n");
        exit(3);
    }
    if (sz != COLIBRI_OK) {
        snprintf(size_s, sizeof size_s, "%d:-", (int)sz);
    } else if (need > ARENA_LIMIT) {
        snprintf(size_s, sizeof size_s, "%d:%zu", (int)sz, need);
        snprintf(init_s, sizeof init_s, "nomem");
    } else {
        snprintf(size_s, sizeof size_s, "%d:%zu", (int)sz, need);
        void *arena = malloc(need);
        colibri_ctx *ctx = NULL;
        if (!arena) {
            fprintf(stderr, "colibri_check: out of memory\n");
            exit(2);
        }
        snprintf(short_s, sizeof short_s, "%d", (int)colibri_init(&ctx, arena, need - 1, image, len));
        const colibri_status in = colibri_init(&ctx, arena, need, image, len);
        snprintf(init_s, sizeof init_s, "%d", (int)in);
        if (in == COLIBRI_OK) {
            double sum = 0.0;
            const colibri_status f1 = forward(ctx, &info, 1, &sum);
            const colibri_status fn = forward(ctx, &info, info.max_batch, &sum);
            snprintf(fwd1_s, sizeof fwd1_s, "%d", (int)f1);
            snprintf(fwdn_s, sizeof fwdn_s, "%d", (int)fn);
            if (f1 == COLIBRI_OK && fn == COLIBRI_OK) {
                if (isnan(sum))
                    snprintf(sum_s, sizeof sum_s, "nan");
                else
                    snprintf(sum_s, sizeof sum_s, "%.9g", sum);
            }
            colibri_free(ctx);
        }
        free(arena);
    }
    printf("validate=%d size=%s init=%s fwd1=%s fwdN=%s sum=%s short=%s\n",
           (int)v, size_s, init_s, fwd1_s, fwdn_s, sum_s, short_s);
    fflush(stdout);
}

int main(void)
{
    for (;;) {
        uint8_t hdr[4];
        const size_t got = fread(hdr, 1, sizeof hdr, stdin);
        if (got == 0 && feof(stdin))
            return 0; /* end of input without the terminator: also fine */
        if (got != sizeof hdr) {
            fprintf(stderr, "colibri_check: truncated record length\n");
            return 2;
        }
        const uint32_t len = (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 |
                             (uint32_t)hdr[3] << 24;
        if (len == 0xFFFFFFFFu)
            return 0;
        uint8_t *image = malloc(len ? len : 1);
        if (!image || !read_exact(image, len)) {
            fprintf(stderr, "colibri_check: cannot read a %u-byte image\n", (unsigned)len);
            return 2;
        }
        check(image, len);
        free(image);
    }
}
