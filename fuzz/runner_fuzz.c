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
 * LOAD_* or UPDATE_* of the seed model with a few mutated bytes (image CRC
 * fixed up, so the engine's validator sees them), and FORWARD requests. Its
 * first byte says whether flash slot A (and B) hold the seed model at boot.
 *
 * Properties beyond "no crash": every response decodes (COBS, length, CRC).
 */
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_board.h"

#define main runner_main
#include "runner.c"
#undef main

/* The seed model (fuzz/make_seeds.py: runner-model.clb), linked in. */
__asm__(".pushsection .rodata\n"
        ".balign 8\n"
        "fuzz_model:\n"
        ".incbin \"" FUZZ_RUNNER_MODEL "\"\n"
        "fuzz_model_end:\n"
        ".popsection\n");
extern const uint8_t fuzz_model[], fuzz_model_end[];

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
    PROTO_HELLO, PROTO_LOAD_BEGIN, PROTO_LOAD_CHUNK, PROTO_LOAD_END, PROTO_INFO, PROTO_KERNELS, PROTO_FORWARD,
    PROTO_STATS, PROTO_RESET, PROTO_SLOT_INFO, PROTO_UPDATE_BEGIN, PROTO_UPDATE_CHUNK, PROTO_UPDATE_COMMIT,
};

static uint8_t model_copy[RUNNER_MODEL_CAPACITY];

/* Uploads the seed model, a few bytes mutated and its header CRC made right,
 * through LOAD_* (RAM) or UPDATE_* (the other flash slot). */
static void emit_upload(script *s, int update)
{
    const uint32_t size = (uint32_t)(fuzz_model_end - fuzz_model);
    memcpy(model_copy, fuzz_model, size);
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

/* Puts the seed model in flash slot `slot` with this sequence, as UPDATE would. */
static void flash_seed(unsigned slot, uint32_t sequence)
{
    const uint32_t size = (uint32_t)(fuzz_model_end - fuzz_model);
    uintptr_t failed = 0;
    if (slot_erase_for(slot, size, &failed) != BOARD_FLASH_OK)
        abort();
    for (uint32_t off = 0; off < size; off += SLOT_HEADER_SIZE) {
        uint8_t word[SLOT_HEADER_SIZE];
        memset(word, 0xFF, sizeof word);
        memcpy(word, fuzz_model + off, size - off < sizeof word ? size - off : sizeof word);
        if (board_flash_program((uintptr_t)slot_image(slot) + off, word) != BOARD_FLASH_OK)
            abort();
    }
    if (slot_write_header(slot, sequence, size, crc32_update(0u, fuzz_model, size)) != BOARD_FLASH_OK)
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
                emit_upload(&s, op % 6u == 4);
            break;
        default:
            emit_forward(&s);
            break;
        }
    }

    /* The runner's initial state, then boot it over the script. */
    fuzz_board_begin(stream, stream_len);
    memset(&state, 0, sizeof state);
    state.running = PROTO_RUNNING_NONE;
    if (boot & 1u)
        flash_seed(0, 1u + (boot >> 2));
    if (boot & 2u)
        flash_seed(1, 1u + (boot >> 4));
    if (setjmp(fuzz_board_done) == 0)
        runner_main();
    if (!fuzz_board_responses_ok())
        abort();
    return 0;
}
