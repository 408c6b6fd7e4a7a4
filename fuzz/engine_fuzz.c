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
 * validate, model_size and init give the same status, except that
 * model_size (and init at COLIBRI_CHECK_STRUCTURE) do not check format v3's
 * payload CRCs, where validate and init may say BAD_PAYLOAD_CRC.
 *
 * Then the image changes under the live context, as a file rewritten in
 * place or a caller's buffer overwritten would change it (docs/threading.md):
 * bytes flipped anywhere, then the tables the engine reads in place (every
 * I32 tensor: the expert maps; every Q8_PARAMS and Q4_PARAMS body: scales,
 * row pointers, columns) filled with a pattern, each followed by forward
 * passes that must not crash or trip a sanitizer, whatever they answer. The
 * mutations come from a generator seeded by the input's CRC, so a crash
 * replays from its input alone.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "colibri_tokenizer.h"
#include "crc32.h"

/* Arenas above this are not allocated (an absurd but valid max_batch). */
#define ARENA_LIMIT ((size_t)64 << 20)

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Format v3: each tensor's CRC table entry made right where the record, the
 * entry and the payload lie inside the input, so mutations reach the checks
 * after the payload CRCs (the full and the structure level both). */
static void fix_tensor_crcs(uint8_t *image, size_t len, uint32_t meta)
{
    const uint32_t n = rd32(image + 32), t_off = rd32(image + 36), crc_off = rd32(image + 68);
    const int wide = image[4] >= COLIBRI_WIDE_VERSION; /* v7: 32-byte records, u64 offset and nbytes */
    const uint64_t record = wide ? COLIBRI_TENSOR_WIDE_SIZE : COLIBRI_TENSOR_SIZE;
    for (uint64_t i = 0; i < n && i < 4096u; i++) {
        const uint64_t rec = (uint64_t)t_off + i * record, slot = (uint64_t)crc_off + 4u * i;
        if (rec + record > len || slot + 4u > meta || slot < COLIBRI_HEADER_SIZE)
            return;
        const uint64_t off = wide ? rd32(image + rec) | (uint64_t)rd32(image + rec + 4) << 32 : rd32(image + rec);
        const uint64_t nbytes = wide ? rd32(image + rec + 8) | (uint64_t)rd32(image + rec + 12) << 32
                                     : rd32(image + rec + 4);
        if (off > len || nbytes > len - off || off < meta)
            continue;
        wr32(image + slot, crc32_update(0u, image + off, (size_t)nbytes));
    }
}

static void fix_crc(uint8_t *image, size_t len)
{
    if (len < COLIBRI_HEADER_SIZE)
        return;
    uint32_t size = rd32(image + 12);
    if (image[4] >= COLIBRI_TENSOR_CRC_VERSION && image[4] <= COLIBRI_FORMAT_VERSION_MAX && image[5] == 0) {
        size = rd32(image + 64); /* meta_size: the header CRC covers the metadata */
        if (size >= COLIBRI_CRC_START && size <= len)
            fix_tensor_crcs(image, len, size);
    }
    if (size < COLIBRI_CRC_START || size > len)
        return;
    wr32(image + 8, crc32_update(0u, image + COLIBRI_CRC_START, size - COLIBRI_CRC_START));
}

/* A token model (docs/lm.md): batch token ids from position 0 (capped at
 * max_seq_len), then a greedy and a sampled draw from the last row. */
static void lm_forward(colibri_ctx *ctx, const colibri_model_info *info, size_t batch, int must_run)
{
    if (batch > info->max_seq_len)
        batch = info->max_seq_len;
    const size_t n_out = batch * info->output_size;
    int32_t *tok = malloc(batch * sizeof *tok + 1);
    float *out = malloc(n_out * sizeof *out + 1);
    if (!tok || !out)
        abort();
    for (size_t i = 0; i < batch; i++)
        tok[i] = (int32_t)((7u * i + 3u) % info->vocab_size);
    if (colibri_lm_reset(ctx) != COLIBRI_OK ||
        colibri_lm_forward(ctx, tok, (uint32_t)batch, out, n_out) != COLIBRI_OK) {
        if (must_run)
            abort(); /* a validated token model with ids below vocab must run */
        free(tok);
        free(out);
        return;
    }
    const colibri_sampler greedy = {sizeof greedy, 0.0f, 0u, 1.0f}, sampled = {sizeof sampled, 0.8f, 5u, 0.9f};
    colibri_rng rng;
    colibri_rng_seed(&rng, 1u);
    int32_t t = -1;
    const float *last = out + (batch - 1) * info->output_size;
    colibri_status st = colibri_lm_sample(ctx, &greedy, last, info->output_size, &rng, &t);
    if (st != COLIBRI_OK && st != COLIBRI_E_NAN_LOGITS)
        abort();
    st = colibri_lm_sample(ctx, &sampled, last, info->output_size, &rng, &t);
    if ((st != COLIBRI_OK && st != COLIBRI_E_NAN_LOGITS) || (st == COLIBRI_OK && (uint32_t)t >= info->vocab_size))
        abort(); /* the sampler reads only the logits: these hold for a changed image too */
    free(tok);
    free(out);
}

static void forward(colibri_ctx *ctx, const colibri_model_info *info, size_t batch)
{
    if (info->vocab_size) {
        lm_forward(ctx, info, batch, 1);
        return;
    }
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

/* A feature model's pass over a changed image: any status, never a crash. */
static void forward_changed(colibri_ctx *ctx, const colibri_model_info *info, size_t batch)
{
    if (info->vocab_size) {
        lm_forward(ctx, info, batch, 0);
        return;
    }
    const size_t n_in = batch * info->input_size, n_out = batch * info->output_size;
    float *in = malloc(n_in * sizeof *in + 1), *out = malloc(n_out * sizeof *out + 1);
    if (!in || !out)
        abort();
    for (size_t i = 0; i < n_in; i++)
        in[i] = cosf(0.29f * (float)i) * 2.0f;
    (void)colibri_forward(ctx, batch, in, n_in, out, n_out);
    free(in);
    free(out);
}

/* xorshift64*: the post-init mutations, from a seed the input determines. */
static uint64_t next_random(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1DULL;
}

/* The image changes under the live context (see the top of this file):
 * flipped bytes, then the in-place tables filled, each followed by passes.
 * The tensor table is read before any change: the image validated. */
static void change_under_context(colibri_ctx *ctx, const colibri_model_info *info, uint8_t *image, size_t size)
{
    uint64_t seed = crc32_update(0u, image, size) | 1u;
    const uint32_t n_t = rd32(image + 32), t_off = rd32(image + 36);
    uint32_t *where = malloc(((size_t)n_t + 1u) * 3u * sizeof *where);
    if (!where)
        abort();
    size_t tables = 0;
    for (uint32_t i = 0; i < n_t; i++) {
        const uint8_t *rec = image + t_off + (size_t)i * COLIBRI_TENSOR_SIZE;
        const uint8_t dtype = rec[16];
        const uint32_t skip = dtype == COLIBRI_DTYPE_I32 ? 0u : dtype == COLIBRI_DTYPE_Q8_PARAMS ? COLIBRI_Q8_PARAMS_HEADER
                              : dtype == COLIBRI_DTYPE_Q4_PARAMS ? COLIBRI_Q4_PARAMS_HEADER : UINT32_MAX;
        if (skip == UINT32_MAX || rd32(rec + 4) <= skip)
            continue;
        where[3 * tables] = rd32(rec) + skip;
        where[3 * tables + 1] = rd32(rec + 4) - skip;
        where[3 * tables + 2] = dtype;
        tables++;
    }
    const size_t flips = 1u + next_random(&seed) % 16u;
    for (size_t i = 0; i < flips; i++)
        image[next_random(&seed) % size] ^= (uint8_t)(1u + next_random(&seed) % 255u);
    forward_changed(ctx, info, 1);
    /* A pattern per table: all ones (past every bound), 0x7F.., zero, or random bytes. */
    for (size_t t = 0; t < tables; t++) {
        uint8_t *p = image + where[3 * t];
        const uint32_t n = where[3 * t + 1];
        const unsigned kind = (unsigned)(next_random(&seed) % 4u);
        for (uint32_t i = 0; i < n; i++)
            p[i] = kind == 0 ? 0xFFu : kind == 1 ? (i % 4u == 3u ? 0x7Fu : 0xFFu) : kind == 2 ? 0u
                   : (uint8_t)next_random(&seed);
    }
    forward_changed(ctx, info, 1);
    if (info->max_batch <= 16)
        forward_changed(ctx, info, info->max_batch);
    free(where);
}

/* Encodes `text` through buffers of the documented bounds: ids within
 * COLIBRI_TOKENIZER_ENCODE_MAX_IDS and in the vocabulary, only the statuses
 * the header names, and one id less of room is BUFFER_SIZE with the same
 * count. */
static void encode_checked(const colibri_tokenizer *tok, const uint8_t *text, size_t len)
{
    static int32_t ids[COLIBRI_TOKENIZER_ENCODE_MAX_IDS(1024)];
    static uint8_t work[COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(1024)];
    if (len > 1024)
        len = 1024;
    const size_t cap = COLIBRI_TOKENIZER_ENCODE_MAX_IDS(len), work_bytes = COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(len);
    size_t n = 0;
    const colibri_status st = colibri_tokenizer_encode(tok, text, len, ids, cap, &n, work, work_bytes);
    if (st != COLIBRI_OK) {
        if (st != COLIBRI_E_BAD_TEXT && st != COLIBRI_E_TEXT_NOT_NORMALIZED && st != COLIBRI_E_UNSUPPORTED)
            abort();
        return;
    }
    if (n > cap)
        abort();
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= tok->vocab)
            abort();
    if (n > 0) {
        size_t again = 0;
        if (colibri_tokenizer_encode(tok, text, len, ids, n - 1u, &again, work, work_bytes) != COLIBRI_E_BUFFER_SIZE ||
            again != n)
            abort();
    }
}

/* The input's bytes as text twice: raw (mostly ill-formed: BAD_TEXT), and
 * mapped two bytes a character onto well-formed UTF-8 that crosses the
 * pre-tokenizers' class borders. */
static void encode_some(const colibri_tokenizer *tok, const uint8_t *image, size_t size)
{
    static const uint32_t chars[] = {' ', ' ', '\n', '\r', '\t', '\'', 's', 'L', 'e', '1', '.', 0xA0, 0x17F,
                                     0x301, 0x2581, 0x3000, 0x6771, 0xD55C, 0x1F389, 0x1D518};
    static uint8_t text[4096];
    const size_t tail = size < 512 ? size : 512;
    encode_checked(tok, image + size - tail, tail);
    size_t len = 0;
    for (size_t i = 0; i + 1 < size && len + 4 <= 1024; i += 2) {
        uint32_t c = image[i + 1] < 128 ? (image[i + 1] < 32 ? 'a' + image[i + 1] % 26u : image[i + 1])
                                        : chars[image[i] % (sizeof chars / sizeof chars[0])];
        if (c < 0x80u)
            text[len++] = (uint8_t)c;
        else if (c < 0x800u) {
            text[len++] = (uint8_t)(0xC0u | c >> 6);
            text[len++] = (uint8_t)(0x80u | (c & 0x3Fu));
        } else if (c < 0x10000u) {
            text[len++] = (uint8_t)(0xE0u | c >> 12);
            text[len++] = (uint8_t)(0x80u | (c >> 6 & 0x3Fu));
            text[len++] = (uint8_t)(0x80u | (c & 0x3Fu));
        } else {
            text[len++] = (uint8_t)(0xF0u | c >> 18);
            text[len++] = (uint8_t)(0x80u | (c >> 12 & 0x3Fu));
            text[len++] = (uint8_t)(0x80u | (c >> 6 & 0x3Fu));
            text[len++] = (uint8_t)(0x80u | (c & 0x3Fu));
        }
    }
    encode_checked(tok, text, len);
}

/* The tokenizer section (format v6): open agrees with the structure check
 * (NO_TOKENIZER when the image has none), and decoding every id, then a run
 * of ids the input's bytes choose, through a buffer of the documented size
 * stays in bounds (ASan) and gives only BAD_TOKEN for ids past the vocabulary. */
static void decode_all(const uint8_t *image, size_t size, colibri_status structure)
{
    colibri_tokenizer tok;
    const colibri_status st = colibri_tokenizer_open(&tok, image, size);
    if (structure != COLIBRI_OK) {
        if (st != structure)
            abort();
        return;
    }
    if (st == COLIBRI_E_NO_TOKENIZER)
        return;
    if (st != COLIBRI_OK)
        abort();
    static uint8_t out[COLIBRI_TOKENIZER_DECODE_BYTES(1u << 16)];
    const size_t cap = COLIBRI_TOKENIZER_DECODE_BYTES(tok.max_piece);
    if (cap > sizeof out)
        return;
    colibri_text_stream s;
    colibri_text_stream_init(&s);
    size_t n;
    for (uint32_t id = 0; id < tok.vocab && id < 4096u; id++)
        if (colibri_tokenizer_decode(&tok, &s, (int32_t)id, out, cap, &n) != COLIBRI_OK || n > cap)
            abort();
    for (size_t i = 0; i + 1 < size && i < 512; i += 2) {
        const int32_t id = (int32_t)(((uint32_t)image[i] << 8 | image[i + 1]) % (tok.vocab + 2u)) - 1;
        const colibri_status d = colibri_tokenizer_decode(&tok, &s, id, out, cap, &n);
        if (d != ((id < 0 || (uint32_t)id >= tok.vocab) ? COLIBRI_E_BAD_TOKEN : COLIBRI_OK))
            abort();
    }
    if (colibri_tokenizer_flush(&s, out, cap, &n) != COLIBRI_OK || n > 3)
        abort();
    encode_some(&tok, image, size);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *image = malloc(size ? size : 1);
    if (!image)
        abort();
    memcpy(image, data, size);
    fix_crc(image, size);

    const colibri_status v = colibri_validate(image, size);
    const colibri_status vs = colibri_validate_ex(image, size, COLIBRI_CHECK_STRUCTURE);
    size_t need = 0;
    const colibri_status sz = colibri_model_size(image, size, &need);
    /* model_size checks the structure; the full check differs from it only
     * by a payload CRC (format v3). */
    if (sz != vs || (v != vs && v != COLIBRI_E_BAD_PAYLOAD_CRC))
        abort();
    decode_all(image, size, vs);
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
            if (colibri_init_ex(&ctx, arena, need, image, size, COLIBRI_CHECK_STRUCTURE) != COLIBRI_OK)
                abort();
            colibri_free(ctx);
            if (colibri_init(&ctx, arena, need, image, size) != v || (v != COLIBRI_OK && ctx != NULL))
                abort();
            if (v != COLIBRI_OK) /* a payload CRC: the structure-level context runs it, as a mapped file */
                if (colibri_init_ex(&ctx, arena, need, image, size, COLIBRI_CHECK_STRUCTURE) != COLIBRI_OK)
                    abort();
            forward(ctx, &info, 1);
            if (info.max_batch <= 16)
                forward(ctx, &info, info.max_batch);
            change_under_context(ctx, &info, image, size);
            colibri_free(ctx);
            free(arena);
        }
    }
    free(image);
    return 0;
}
