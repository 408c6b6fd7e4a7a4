/*
 * Colibri tokenizer: token ids to text from the tokenizer section of a
 * format-6 model image (docs/lm.md "Tokenizer section"), read in place.
 *
 * Nothing is allocated: a colibri_tokenizer is a few pointers into the
 * image, a colibri_text_stream a few bytes of state, and the caller owns
 * every output buffer.
 *
 *   colibri_tokenizer tok;
 *   colibri_tokenizer_open(&tok, image, image_len);  // NO_TOKENIZER if none
 *   colibri_text_stream s;
 *   colibri_text_stream_init(&s);
 *   uint8_t text[COLIBRI_TOKENIZER_DECODE_BYTES(COLIBRI_TOKENIZER_MAX_PIECE)];
 *   for each new token id:
 *       colibri_tokenizer_decode(&tok, &s, id, text, sizeof text, &n);  // print text[0..n)
 *       if (id == tok.eos) break;
 *   colibri_tokenizer_flush(&s, text, sizeof text, &n);
 *
 * The stream only ever gives whole UTF-8 characters: a character whose bytes
 * are split across tokens (byte-level BPE, SentencePiece byte fallback) is
 * held back until complete; an ill-formed sequence becomes U+FFFD, one per
 * maximal ill-formed subpart (as Python's errors="replace" and Rust's
 * from_utf8_lossy). SentencePiece's leading-space rule is applied: the first
 * piece that is not CONTROL loses its leading space (its U+2581).
 *
 * Encoding (docs/lm.md "Encoding") takes the caller's id buffer and work
 * buffer, sized for the text by the two macros below:
 *
 *   int32_t ids[COLIBRI_TOKENIZER_ENCODE_MAX_IDS(TEXT_MAX)];
 *   uint8_t work[COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(TEXT_MAX)];
 *   colibri_tokenizer_encode(&tok, text, len, ids, 64, &n, work, sizeof work);
 *
 * Built with COLIBRI_NO_TOKENIZER, every function here returns
 * COLIBRI_E_NO_TOKENIZER (the validator still checks the section); with
 * COLIBRI_NO_TOKENIZER_ENCODE, decoding stays and encoding is UNSUPPORTED.
 */
#ifndef COLIBRI_TOKENIZER_H
#define COLIBRI_TOKENIZER_H

#include "colibri.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct colibri_tokenizer {
    const uint8_t *section; /* the section's bytes, inside the image */
    uint32_t size;          /* its bytes */
    uint32_t vocab;         /* tokens: ids 0 .. vocab-1 */
    uint32_t kind;          /* COLIBRI_TOKENIZER_BYTE_BPE, _SENTENCEPIECE_BPE, _SENTENCEPIECE_UNIGRAM */
    uint32_t flags;         /* COLIBRI_TOKENIZER_FLAG_* */
    uint32_t max_piece;     /* the longest token's bytes */
    int32_t bos, eos, pad, unk; /* special ids, -1 when the section has none */
} colibri_tokenizer;

typedef struct colibri_text_stream {
    uint8_t held[4];  /* an incomplete UTF-8 sequence */
    uint8_t held_len; /* 0..3 */
    uint8_t started;  /* a piece other than CONTROL came: SentencePiece's leading space is done */
    uint8_t reserved[2];
} colibri_text_stream;

/* The largest piece (token bytes) a section may hold for the fixed buffer
 * of a device: colibri_tokenizer_open refuses nothing, but a piece longer
 * than the caller's buffer allows is BUFFER_SIZE at decode. */
#define COLIBRI_TOKENIZER_MAX_PIECE 256u
/* Output bytes that always suffice for one colibri_tokenizer_decode of a
 * tokenizer whose longest piece is `max_piece` bytes (each byte may become
 * a 3-byte U+FFFD, and a held sequence is given or replaced first). */
#define COLIBRI_TOKENIZER_DECODE_BYTES(max_piece) (3u * ((size_t)(max_piece) + 4u))

/* Finds the image's tokenizer section and checks the image at
 * COLIBRI_CHECK_STRUCTURE (the section included): the validator's status,
 * or NO_TOKENIZER for an image without a section. */
COLIBRI_API colibri_status colibri_tokenizer_open(colibri_tokenizer *tok, const void *image, size_t image_len);

/* Token `id`'s bytes as it decodes on its own (before the leading-space rule
 * and UTF-8 assembly), pointing into the image: nothing for CONTROL and
 * UNUSED tokens, the unknown surface " \u2047 " for a SentencePiece UNKNOWN.
 * BAD_TOKEN for an id outside the vocabulary. */
COLIBRI_API colibri_status colibri_tokenizer_piece(const colibri_tokenizer *tok, int32_t id, const uint8_t **bytes,
                                                   size_t *len);

COLIBRI_API void colibri_text_stream_init(colibri_text_stream *s);

/* Appends token `id` to the stream and writes the text it completes to
 * out[0 .. *out_len). BAD_TOKEN for an id outside the vocabulary, BUFFER_SIZE
 * when out_cap is too small for this token's text (the stream is then as
 * before the call), NULL_ARG for a NULL pointer. */
COLIBRI_API colibri_status colibri_tokenizer_decode(const colibri_tokenizer *tok, colibri_text_stream *s, int32_t id,
                                                    uint8_t *out, size_t out_cap, size_t *out_len);

/* Ends the stream: an incomplete sequence still held becomes U+FFFD (at
 * most 3 bytes); the stream is then as new. */
COLIBRI_API colibri_status colibri_tokenizer_flush(colibri_text_stream *s, uint8_t *out, size_t out_cap,
                                                   size_t *out_len);

/* Ids colibri_tokenizer_encode gives at most for `text_len` bytes of text,
 * whatever the tokenizer (a SentencePiece space may fall back to the three
 * bytes of U+2581; a byte-level pre-token may gain a space). */
#define COLIBRI_TOKENIZER_ENCODE_MAX_IDS(text_len) (3u * (size_t)(text_len) + 3u)
/* Work bytes colibri_tokenizer_encode needs for `text_len` bytes of text
 * (any alignment). */
#define COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(text_len) (16u * (size_t)(text_len) + 64u)

/* Text (UTF-8, no BOS or EOS added) to ids, as the library the tokenizer came
 * from encodes it: `tokenizers` for byte-level BPE, `sentencepiece` for the
 * SentencePiece kinds. *n_ids is the count the text encodes to; the ids are
 * in ids[0 .. *n_ids) when it is at most ids_cap, else BUFFER_SIZE (ids then
 * holds the first ids_cap). BAD_TEXT for ill-formed UTF-8;
 * TEXT_NOT_NORMALIZED when the tokenizer normalises to NFC and the text
 * holds a character NFC may change (the host encodes it); ARENA_TOO_SMALL
 * when work_bytes is below COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(text_len);
 * UNSUPPORTED for a section written before encoding (section version 1) or
 * a pre-tokenizer pattern the device does not implement; NULL_ARG. */
COLIBRI_API colibri_status colibri_tokenizer_encode(const colibri_tokenizer *tok, const uint8_t *text,
                                                    size_t text_len, int32_t *ids, size_t ids_cap, size_t *n_ids,
                                                    void *work, size_t work_bytes);

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_TOKENIZER_H */
