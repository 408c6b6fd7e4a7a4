/*
 * Decoding token ids to text from the tokenizer section (docs/lm.md
 * "Tokenizer section" and "Decoding"), read in place: colibri_tokenizer.h.
 *
 * The section was validated by colibri_tokenizer_check (colibri_image.c) at
 * open, so every offset read here is inside it.
 */
#include "colibri_tokenizer.h"

#include "colibri_internal.h"

#ifdef COLIBRI_NO_TOKENIZER

colibri_status colibri_tokenizer_open(colibri_tokenizer *tok, const void *image, size_t image_len)
{
    (void)tok, (void)image, (void)image_len;
    return COLIBRI_E_NO_TOKENIZER;
}

colibri_status colibri_tokenizer_piece(const colibri_tokenizer *tok, int32_t id, const uint8_t **bytes, size_t *len)
{
    (void)tok, (void)id, (void)bytes, (void)len;
    return COLIBRI_E_NO_TOKENIZER;
}

void colibri_text_stream_init(colibri_text_stream *s)
{
    (void)s;
}

colibri_status colibri_tokenizer_decode(const colibri_tokenizer *tok, colibri_text_stream *s, int32_t id,
                                        uint8_t *out, size_t out_cap, size_t *out_len)
{
    (void)tok, (void)s, (void)id, (void)out, (void)out_cap, (void)out_len;
    return COLIBRI_E_NO_TOKENIZER;
}

colibri_status colibri_tokenizer_flush(colibri_text_stream *s, uint8_t *out, size_t out_cap, size_t *out_len)
{
    (void)s, (void)out, (void)out_cap, (void)out_len;
    return COLIBRI_E_NO_TOKENIZER;
}

#else

/* Section header fields (docs/lm.md "Tokenizer section"). */
enum {
    AT_OFFSETS = 36,
    AT_BYTES = 40,
    AT_TYPES = 48,
};

static const uint8_t unknown_surface[] = {0x20, 0xE2, 0x81, 0x87, 0x20}; /* " \u2047 " */
static const uint8_t replacement[] = {0xEF, 0xBF, 0xBD};                 /* U+FFFD */

static int32_t special(const uint8_t *p)
{
    const uint32_t id = colibri_rd_u32(p);
    return id == COLIBRI_NONE ? -1 : (int32_t)id;
}

colibri_status colibri_tokenizer_open(colibri_tokenizer *tok, const void *image, size_t image_len)
{
    if (tok == NULL || image == NULL)
        return COLIBRI_E_NULL_ARG;
    colibri_model m;
    uint64_t work;
    colibri_status st = colibri_check_level(image, image_len, &m, &work, COLIBRI_CHECK_STRUCTURE);
    if (st != COLIBRI_OK)
        return st;
    if (m.tokenizer == 0)
        return COLIBRI_E_NO_TOKENIZER;
    colibri_tensor t;
    colibri_read_tensor(image, &m.hdr, m.tokenizer - 1u, &t);
    const uint8_t *p = (const uint8_t *)image + t.offset;
    tok->section = p;
    tok->size = (uint32_t)t.nbytes; /* == rows, a u32: checked by the validator */
    tok->kind = p[6];
    tok->flags = p[7];
    tok->vocab = colibri_rd_u32(p + 8);
    tok->bos = special(p + 16);
    tok->eos = special(p + 20);
    tok->pad = special(p + 24);
    tok->unk = special(p + 28);
    const uint8_t *offsets = p + colibri_rd_u32(p + AT_OFFSETS);
    uint32_t longest = 0;
    for (uint32_t i = 0; i < tok->vocab; i++) {
        const uint32_t len = colibri_rd_u32(offsets + 4u * (size_t)i + 4u) - colibri_rd_u32(offsets + 4u * (size_t)i);
        if (len > longest)
            longest = len;
    }
    tok->max_piece = longest > sizeof unknown_surface ? longest : (uint32_t)sizeof unknown_surface;
    return COLIBRI_OK;
}

static int sentencepiece(const colibri_tokenizer *tok)
{
    return tok->kind != COLIBRI_TOKENIZER_BYTE_BPE;
}

colibri_status colibri_tokenizer_piece(const colibri_tokenizer *tok, int32_t id, const uint8_t **bytes, size_t *len)
{
    if (tok == NULL || bytes == NULL || len == NULL)
        return COLIBRI_E_NULL_ARG;
    if (id < 0 || (uint32_t)id >= tok->vocab)
        return COLIBRI_E_BAD_TOKEN;
    const uint8_t *p = tok->section;
    const uint8_t type = p[colibri_rd_u32(p + AT_TYPES) + (uint32_t)id];
    const uint8_t *offsets = p + colibri_rd_u32(p + AT_OFFSETS) + 4u * (size_t)id;
    const uint32_t start = colibri_rd_u32(offsets), end = colibri_rd_u32(offsets + 4);
    *bytes = p + colibri_rd_u32(p + AT_BYTES) + start;
    *len = end - start;
    if (type == COLIBRI_TOKEN_CONTROL || type == COLIBRI_TOKEN_UNUSED)
        *len = 0;
    else if (type == COLIBRI_TOKEN_UNKNOWN && sentencepiece(tok)) {
        *bytes = unknown_surface;
        *len = sizeof unknown_surface;
    }
    return COLIBRI_OK;
}

void colibri_text_stream_init(colibri_text_stream *s)
{
    if (s != NULL) {
        s->held[0] = s->held[1] = s->held[2] = s->held[3] = 0;
        s->held_len = s->started = 0;
        s->reserved[0] = s->reserved[1] = 0;
    }
}

/* Output with a bound: `put` fails once the caller's buffer is full. */
typedef struct sink {
    uint8_t *out;
    size_t cap, len;
} sink;

static int put(sink *k, const uint8_t *b, size_t n)
{
    if (n > k->cap - k->len)
        return 0;
    for (size_t i = 0; i < n; i++)
        k->out[k->len + i] = b[i];
    k->len += n;
    return 1;
}

/* One byte through the UTF-8 assembler of stream s. */
static int push_byte(colibri_text_stream *s, sink *k, uint8_t b)
{
    for (;;) {
        if (s->held_len == 0) {
            uint8_t lo, hi;
            if (b < 0x80u)
                return put(k, &b, 1);
            if (colibri_utf8_lead(b, &lo, &hi) == 0)
                return put(k, replacement, sizeof replacement);
            s->held[0] = b;
            s->held_len = 1;
            return 1;
        }
        uint8_t lo, hi;
        const uint32_t need = colibri_utf8_lead(s->held[0], &lo, &hi);
        if (s->held_len > 1) { /* past the second byte, any continuation byte */
            lo = 0x80u;
            hi = 0xBFu;
        }
        if (b >= lo && b <= hi) {
            s->held[s->held_len++] = b;
            if (s->held_len < need)
                return 1;
            s->held_len = 0;
            return put(k, s->held, need);
        }
        /* The held bytes are a maximal ill-formed subpart: one U+FFFD, then b
         * starts afresh. */
        s->held_len = 0;
        if (!put(k, replacement, sizeof replacement))
            return 0;
    }
}

colibri_status colibri_tokenizer_decode(const colibri_tokenizer *tok, colibri_text_stream *s, int32_t id,
                                        uint8_t *out, size_t out_cap, size_t *out_len)
{
    if (tok == NULL || s == NULL || out_len == NULL || (out == NULL && out_cap != 0))
        return COLIBRI_E_NULL_ARG;
    const uint8_t *bytes;
    size_t len;
    colibri_status st = colibri_tokenizer_piece(tok, id, &bytes, &len);
    if (st != COLIBRI_OK)
        return st;
    *out_len = 0;
    /* SentencePiece's dummy prefix: the first piece that is not CONTROL
     * (or padding) loses its leading space (its U+2581) if it is a normal
     * or user-defined piece. */
    const uint8_t type = tok->section[colibri_rd_u32(tok->section + AT_TYPES) + (uint32_t)id];
    if (sentencepiece(tok) && !s->started && len > 0 && bytes[0] == 0x20u &&
        (tok->flags & (COLIBRI_TOKENIZER_FLAG_ADD_DUMMY_PREFIX | COLIBRI_TOKENIZER_FLAG_REMOVE_EXTRA_WHITESPACES)) &&
        (type == COLIBRI_TOKEN_NORMAL || type == COLIBRI_TOKEN_USER_DEFINED)) {
        bytes++;
        len--;
    }
    colibri_text_stream next = *s; /* committed only when everything fits */
    sink k = {out, out_cap, 0};
    for (size_t i = 0; i < len; i++)
        if (!push_byte(&next, &k, bytes[i]))
            return COLIBRI_E_BUFFER_SIZE;
    if (type != COLIBRI_TOKEN_CONTROL && type != COLIBRI_TOKEN_UNUSED)
        next.started = 1;
    *s = next;
    *out_len = k.len;
    return COLIBRI_OK;
}

colibri_status colibri_tokenizer_flush(colibri_text_stream *s, uint8_t *out, size_t out_cap, size_t *out_len)
{
    if (s == NULL || out_len == NULL || (out == NULL && out_cap != 0))
        return COLIBRI_E_NULL_ARG;
    *out_len = 0;
    if (s->held_len != 0) {
        if (out_cap < sizeof replacement)
            return COLIBRI_E_BUFFER_SIZE;
        for (size_t i = 0; i < sizeof replacement; i++)
            out[i] = replacement[i];
        *out_len = sizeof replacement;
    }
    colibri_text_stream_init(s);
    return COLIBRI_OK;
}

#endif /* COLIBRI_NO_TOKENIZER */
