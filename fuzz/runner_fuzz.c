/*
 * libFuzzer harness over the runner's frame handler (firmware/runner/runner.c:
 * COBS framing, packet length and CRC, request dispatch, LOAD_* and UPDATE_*
 * sequencing, flash slots, FORWARD), built for the host on the fuzz board
 * (fuzz/board: boards/board.h over memory). runner.c is compiled unchanged,
 * included here so each input starts from the runner's initial state.
 *
 * The input is a script the harness turns into bytes on the runner's UART:
 * raw bytes (to fuzz COBS and framing), well-formed packets of any type and
 * payload (correct CRC, or deliberately wrong), whole model uploads through
 * LOAD_* or UPDATE_* of a seed model with a few mutated bytes (image CRC
 * fixed up, so the engine's validator sees them), FORWARD requests, and
 * GENERATE_TEXT requests (protocol v5) with a well-formed header and a text
 * or id prompt, valid or broken as the script says. Two seed models: a
 * feature model, and a token model with a byte-level BPE tokenizer section
 * (what GENERATE_TEXT needs). Its first byte says whether flash slot A (and
 * B) hold a seed model at boot, and which.
 *
 * Properties beyond "no crash": every response decodes (COBS, length, CRC).
 * At exit it prints how many GENERATE_TEXT requests it sent and how many the
 * runner answered with ids and text (fuzz/Makefile requires some).
 */
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_board.h"

#define main runner_main
#include "runner.c"
#undef main

/* The seed models (fuzz/make_seeds.py: runner-model.clb, runner-lm.clb), linked in. */
__asm__(".pushsection .rodata\n"
        ".balign 8\n"
        "fuzz_model:\n"
        ".incbin \"" FUZZ_RUNNER_MODEL "\"\n"
        "fuzz_model_end:\n"
        ".balign 8\n"
        "fuzz_lm:\n"
        ".incbin \"" FUZZ_RUNNER_LM "\"\n"
        "fuzz_lm_end:\n"
        ".popsection\n");
extern const uint8_t fuzz_model[], fuzz_model_end[], fuzz_lm[], fuzz_lm_end[];

typedef struct {
    const uint8_t *data;
    uint32_t size;
} seed_model;

/* The feature model, or (lm) the token model with its tokenizer. */
static seed_model seed_of(int lm)
{
    seed_model m = {lm ? fuzz_lm : fuzz_model, (uint32_t)(lm ? fuzz_lm_end - fuzz_lm : fuzz_model_end - fuzz_model)};
    return m;
}

/* ---- The UART byte stream built from one input ---- */

static uint8_t stream[1u << 18];
static size_t stream_len;

static void emit(const uint8_t *piece, size_t len)
{
    if (len > sizeof stream - stream_len)
        len = sizeof stream - stream_len;
    memcpy(stream + stream_len, piece, len);
    stream_len += len;
}

static void emit_byte(uint8_t b)
{
    emit(&b, 1);
}

/* One packet: header, payload, CRC-32 (corrupted if asked), COBS, delimiter. */
static void emit_packet(uint8_t type, uint16_t seq, const uint8_t *payload, uint32_t len, int bad_crc,
                        int bad_len)
{
    static uint8_t pkt[PROTO_OVERHEAD + PROTO_MAX_PAYLOAD + 64];
    if (len > PROTO_MAX_PAYLOAD + 64u)
        len = PROTO_MAX_PAYLOAD + 64u;
    pkt[0] = type;
    pkt[1] = 0;
    put_u16(pkt + 2, seq);
    put_u32(pkt + 4, bad_len ? len + 1u : len);
    memcpy(pkt + PROTO_HEADER_SIZE, payload, len);
    const uint32_t crc = crc32_update(0u, pkt, PROTO_HEADER_SIZE + len);
    put_u32(pkt + PROTO_HEADER_SIZE + len, bad_crc ? crc ^ 1u : crc);
    cobs_encode_stream(pkt, PROTO_OVERHEAD + len, emit);
    emit_byte(0);
}

/* ---- Reading the script ---- */

typedef struct {
    const uint8_t *p;
    size_t n;
} script;

static uint8_t take8(script *s)
{
    if (s->n == 0)
        return 0;
    s->n--;
    return *s->p++;
}

static uint16_t take16(script *s)
{
    const uint16_t lo = take8(s);
    return (uint16_t)(lo | (uint16_t)take8(s) << 8);
}

/* Up to n bytes of the script (fewer at its end). */
static const uint8_t *take(script *s, size_t *n)
{
    if (*n > s->n)
        *n = s->n;
    const uint8_t *p = s->p;
    s->p += *n;
    s->n -= *n;
    return p;
}

static const uint8_t request_types[] = {
    PROTO_HELLO,     PROTO_LOAD_BEGIN,  PROTO_LOAD_CHUNK,     PROTO_LOAD_END,      PROTO_INFO,
    PROTO_KERNELS,   PROTO_FORWARD,     PROTO_STATS,          PROTO_RESET,         PROTO_SLOT_INFO,
    PROTO_UPDATE_BEGIN, PROTO_UPDATE_CHUNK, PROTO_UPDATE_COMMIT, PROTO_LM_RESET,   PROTO_FORWARD_TOKENS,
    PROTO_GENERATE,  PROTO_GENERATE_TEXT,
};

static uint8_t model_copy[RUNNER_MODEL_CAPACITY];

/* Uploads a seed model, a few bytes mutated and its header CRC made right,
 * through LOAD_* (RAM) or UPDATE_* (the other flash slot). */
static void emit_upload(script *s, int update, int lm)
{
    const seed_model m = seed_of(lm);
    const uint32_t size = m.size;
    memcpy(model_copy, m.data, size);
    for (unsigned k = take8(s) % 8u; k > 0; k--) {
        const uint32_t at = take16(s) % size;
        model_copy[at] ^= take8(s);
    }
    put_u32(model_copy + 8, crc32_update(0u, model_copy + COLIBRI_CRC_START, size - COLIBRI_CRC_START));
    /* At least 256 bytes a chunk: 1-byte chunks would cost thousands of frames
     * an input and exercise nothing more than a few. */
    const uint32_t chunk = 256u + (uint32_t)take8(s) * 16u % (PROTO_MAX_PAYLOAD - 4u - 256u);
    const uint16_t seq = take16(s);
    uint8_t p[PROTO_MAX_PAYLOAD];
    put_u32(p, size);
    put_u32(p + 4, crc32_update(0u, model_copy, size));
    emit_packet(update ? PROTO_UPDATE_BEGIN : PROTO_LOAD_BEGIN, seq, p, 8, 0, 0);
    for (uint32_t off = 0; off < size; off += chunk) {
        const uint32_t n = size - off < chunk ? size - off : chunk;
        put_u32(p, off);
        memcpy(p + 4, model_copy + off, n);
        emit_packet(update ? PROTO_UPDATE_CHUNK : PROTO_LOAD_CHUNK, seq, p, 4 + n, 0, 0);
    }
    emit_packet(update ? PROTO_UPDATE_COMMIT : PROTO_LOAD_END, seq, p, 0, 0, 0);
}

/* A FORWARD of `batch` tokens of the seed model's input width, values from the script. */
static void emit_forward(script *s)
{
    const uint32_t batch = take8(s) % 5u, width = get_u32(fuzz_model + 20);
    uint8_t p[PROTO_MAX_PAYLOAD];
    uint32_t len = 4u + batch * width * 4u;
    if (len > sizeof p)
        len = sizeof p;
    put_u32(p, batch);
    size_t n = len - 4u;
    const uint8_t *v = take(s, &n);
    memcpy(p + 4, v, n);
    memset(p + 4 + n, 0, len - 4u - n);
    emit_packet(PROTO_FORWARD, take16(s), p, len, 0, 0);
}

/* Pieces of well-formed prompt text for the token model's byte-level BPE:
 * its merges (t h, th e, " " the), two- and four-byte characters, its special
 * token, and bytes no merge joins. */
static const char *const text_pieces[] = {
    "t", "h", "e", "th", "the", " the", "\xC3\xA9", "\xF0\x9F\x8E\x89", "<|endoftext|>", " ", "x", "\n",
};

static unsigned long generate_text_sent;

/* A GENERATE_TEXT request: the sampler (greedy or sampled, or fields out of
 * range), flags (text or ids, stop at EOS, an unknown bit), and a prompt of
 * text pieces (one byte flipped, or raw script bytes) or of ids (in the
 * vocabulary and its padding, or any 32-bit value); its n_prompt right, or
 * one off. */
static void emit_generate_text(script *s)
{
    static const float temperatures[] = {0.0f, 0.7f, 1.0f, 2.5f};
    static const float top_ps[] = {1.0f, 0.9f, 0.5f, 0.05f};
    const uint8_t how = take8(s);
    uint8_t p[PROTO_MAX_PAYLOAD];
    const uint8_t pick = take8(s);
    put_u32(p, how & 0x80u ? take16(s) : take8(s) % 8u);
    float t = temperatures[pick & 3u], top_p = top_ps[pick >> 2 & 3u];
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    put_u32(p + 4, how & 0x08u ? (uint32_t)take16(s) << 16 : bits); /* any f32 exponent: NaN, Inf, < 0 */
    put_u32(p + 8, pick >> 4);
    memcpy(&bits, &top_p, sizeof bits);
    put_u32(p + 12, how & 0x08u ? (uint32_t)take16(s) << 16 : bits);
    put_u32(p + 16, take16(s));
    put_u32(p + 20, 0u);
    const int text = how & PROTO_GENERATE_TEXT_PROMPT_TEXT;
    put_u32(p + 24, (how & (PROTO_GENERATE_TEXT_PROMPT_TEXT | PROTO_GENERATE_TEXT_STOP_AT_EOS)) |
                        (how & 0x10u ? 4u : 0u));
    uint32_t n = 0;
    uint8_t *prompt = p + PROTO_GENERATE_TEXT_REQUEST_HEADER;
    const uint32_t room = PROTO_MAX_PAYLOAD - PROTO_GENERATE_TEXT_REQUEST_HEADER;
    if (text && (how & 0x40u)) { /* raw bytes: any UTF-8, or none */
        size_t k = take8(s) % 48u;
        memcpy(prompt, take(s, &k), k);
        n = (uint32_t)k;
    } else if (text) {
        for (unsigned k = take8(s) % 6u; k > 0; k--) {
            const char *piece = text_pieces[take8(s) % (sizeof text_pieces / sizeof text_pieces[0])];
            const size_t len = strlen(piece);
            if (n + len > room)
                break;
            memcpy(prompt + n, piece, len);
            n += (uint32_t)len;
        }
        if ((how & 0x20u) && n > 0u)
            prompt[take8(s) % n] ^= take8(s);
    } else {
        for (unsigned k = take8(s) % 6u; k > 0; k--, n++) {
            const uint32_t id = how & 0x40u ? (uint32_t)take16(s) << 16 | take16(s) : take16(s) % 300u;
            put_u32(prompt + 4u * n, id);
        }
    }
    put_u32(p + 28, how & 0x20u && !text ? n ^ 1u : n);
    emit_packet(PROTO_GENERATE_TEXT, take16(s), p, PROTO_GENERATE_TEXT_REQUEST_HEADER + n * (text ? 1u : 4u), 0, 0);
    generate_text_sent++;
}

static void report(void)
{
    fprintf(stderr, "runner_fuzz: GENERATE_TEXT: %lu requests sent, %lu answered with ids and text\n",
            generate_text_sent, fuzz_board_responses_of(PROTO_GENERATE_TEXT | PROTO_RESPONSE));
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    atexit(report);
    return 0;
}

/* Puts a seed model in flash slot `slot` with this sequence, as UPDATE would. */
static void flash_seed(unsigned slot, uint32_t sequence, int lm)
{
    const seed_model m = seed_of(lm);
    const uint32_t size = m.size;
    uintptr_t failed = 0;
    if (slot_erase_for(slot, size, &failed) != BOARD_FLASH_OK)
        abort();
    for (uint32_t off = 0; off < size; off += SLOT_HEADER_SIZE) {
        uint8_t word[SLOT_HEADER_SIZE];
        memset(word, 0xFF, sizeof word);
        memcpy(word, m.data + off, size - off < sizeof word ? size - off : sizeof word);
        if (board_flash_program((uintptr_t)slot_image(slot) + off, word) != BOARD_FLASH_OK)
            abort();
    }
    if (slot_write_header(slot, sequence, size, crc32_update(0u, m.data, size)) != BOARD_FLASH_OK)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    script s = {data, size};
    const uint8_t boot = take8(&s);
    unsigned uploads = 0;
    stream_len = 0;
    while (s.n > 0) {
        const uint8_t op = take8(&s);
        switch (op % 6u) {
        case 0: { /* raw bytes, delimiters included */
            size_t n = take8(&s);
            emit(take(&s, &n), n);
            break;
        }
        case 1:   /* a packet of a known request type */
        case 2: { /* a packet of any type */
            const uint8_t t = take8(&s);
            const uint8_t type = op % 6u == 1 ? request_types[t % sizeof request_types] : t;
            const uint16_t seq = take16(&s);
            size_t n = take16(&s) % (PROTO_MAX_PAYLOAD + 48u);
            const uint8_t *payload = take(&s, &n);
            emit_packet(type, seq, payload, (uint32_t)n, (op & 0x40) != 0, (op & 0x80) != 0);
            break;
        }
        case 3:
        case 4:
            if (uploads++ < 3) /* more only repeat what the first ones did */
                emit_upload(&s, op % 6u == 4, (op & 0x20) != 0);
            break;
        default: /* a request the seed models answer: FORWARD (feature), GENERATE_TEXT (token) */
            if (op & 0x20)
                emit_generate_text(&s);
            else
                emit_forward(&s);
            break;
        }
    }

    /* The runner's initial state, then boot it over the script. */
    fuzz_board_begin(stream, stream_len);
    memset(&state, 0, sizeof state);
    state.running = PROTO_RUNNING_NONE;
    if (boot & 1u) /* bit 7: the token model in A (and bit 6 in B) */
        flash_seed(0, 1u + (boot >> 2), (boot & 0x80u) != 0);
    if (boot & 2u)
        flash_seed(1, 1u + (boot >> 4), (boot & 0x40u) != 0);
    if (setjmp(fuzz_board_done) == 0)
        runner_main();
    if (!fuzz_board_responses_ok())
        abort();
    return 0;
}
