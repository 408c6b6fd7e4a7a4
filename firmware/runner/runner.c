/*
 * Colibri runner: serves the wire protocol of docs/protocol.md on the board's
 * console UART. It receives a model image into a static RAM buffer, builds an
 * engine context in a static arena and runs forward passes for the host,
 * measuring colibri_forward() alone with the board's work counter.
 *
 * It also keeps two model slots in flash (slots.c): at boot it runs the valid
 * slot with the highest sequence in place (weights read from flash, no
 * copy), and UPDATE_* writes a new model into the other slot, committing it
 * with one header word only once its CRC checks in flash, so a power loss at
 * any point leaves either the old or the new model, never neither.
 *
 * Everything is static: no heap, no malloc. The capacities come from the
 * board's board.mk (RUNNER_MODEL_CAPACITY, RUNNER_ARENA_CAPACITY). The model
 * buffer and the arena are the objects runner_model and runner_arena; built
 * with -fdata-sections they live in the sections .bss.runner_model and
 * .bss.runner_arena, which a board's linker script may place in a particular
 * RAM (otherwise they go with the rest of .bss).
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "board.h"
#include "cobs.h"
#include "colibri.h"
#include "colibri_tokenizer.h"
#include "crc32.h"
#include "protocol.h"
#ifdef RUNNER_BUILTIN_MODEL
#include "model.h" /* colibri pack --c-array: colibri_model_image[] in .rodata.colibri_model */
#endif
#include "slots.h"

#ifndef RUNNER_MODEL_CAPACITY
#error "RUNNER_MODEL_CAPACITY (bytes) must come from the board's board.mk"
#endif
#ifndef RUNNER_ARENA_CAPACITY
#error "RUNNER_ARENA_CAPACITY (bytes) must come from the board's board.mk"
#endif
/* Logits of one token-model call, [max_batch, vocab] f32: colibri_lm_forward
 * writes every row of a call, so a token model runs here only if
 * max_batch x vocab fits (the board may set it larger). */
#ifndef RUNNER_LOGITS_CAPACITY
#define RUNNER_LOGITS_CAPACITY 4096u /* floats */
#endif
#ifndef RUNNER_BUILD_FLAGS
#define RUNNER_BUILD_FLAGS ""
#endif

#define STR_(x) #x
#define STR(x) STR_(x)

#ifdef COLIBRI_QEMU_ICOUNT_SHIFT
#define RUNNER_ICOUNT_FLAG " icount_shift=" STR(COLIBRI_QEMU_ICOUNT_SHIFT)
#else
#define RUNNER_ICOUNT_FLAG ""
#endif

/* The HELLO build-flags string: space-separated tokens. */
static const char build_flags[] = RUNNER_BUILD_FLAGS " gcc=" STR(__GNUC__) "." STR(__GNUC_MINOR__) "." STR(
    __GNUC_PATCHLEVEL__) RUNNER_ICOUNT_FLAG;

/* The model image format versions this firmware's engine reads: in HELLO, and
 * findable by the host in the firmware file (ELF, .bin or .hex) by its tag, so
 * `colibri pack --firmware` and `colibri flash --probe` can refuse an image
 * this firmware would not run before anything is written. The volatile read
 * in HELLO keeps it through --gc-sections. */
typedef struct runner_formats {
    char tag[8];          /* "CLBRFMTS" */
    uint16_t min_version; /* COLIBRI_FORMAT_VERSION_MIN */
    uint16_t max_version; /* COLIBRI_FORMAT_VERSION_MAX */
} runner_formats;

const runner_formats colibri_runner_formats = {
    {'C', 'L', 'B', 'R', 'F', 'M', 'T', 'S'}, COLIBRI_FORMAT_VERSION_MIN, COLIBRI_FORMAT_VERSION_MAX};

/* Largest packet the runner accepts into its receive buffer. A little slack
 * beyond MAX_PAYLOAD lets a slightly oversized request still be decoded and
 * refused with its own seq (BAD_PAYLOAD); anything longer is FRAME_TOO_LONG. */
#define RX_SLACK 32u
#define RX_PACKET_MAX (PROTO_OVERHEAD + PROTO_MAX_PAYLOAD + RX_SLACK)
#define RX_FRAME_MAX COBS_MAX_ENCODED(RX_PACKET_MAX)
#define TX_PACKET_MAX (PROTO_OVERHEAD + PROTO_MAX_PAYLOAD)

_Static_assert(RUNNER_MODEL_CAPACITY % 8u == 0u, "model capacity must be a multiple of 8");
_Static_assert(RUNNER_ARENA_CAPACITY % 8u == 0u, "arena capacity must be a multiple of 8");

static uint8_t rx_frame[RX_FRAME_MAX] __attribute__((aligned(8)));  /* encoded frame, decoded in place */
static uint8_t tx_packet[TX_PACKET_MAX] __attribute__((aligned(8))); /* response packet before COBS */
static uint8_t runner_model[RUNNER_MODEL_CAPACITY] __attribute__((aligned(8)));
static uint8_t runner_arena[RUNNER_ARENA_CAPACITY] __attribute__((aligned(8)));
static float input_buf[PROTO_MAX_PAYLOAD / sizeof(float)] __attribute__((aligned(8)));
static float output_buf[PROTO_MAX_PAYLOAD / sizeof(float)] __attribute__((aligned(8)));
static float lm_logits[RUNNER_LOGITS_CAPACITY] __attribute__((aligned(8)));
static int32_t lm_tokens[PROTO_MAX_PAYLOAD / sizeof(int32_t)]; /* a request's ids, copied out aligned */
static int32_t lm_new[PROTO_MAX_PAYLOAD / sizeof(int32_t)];    /* GENERATE's drawn ids */

static struct {
    colibri_ctx *ctx; /* NULL: no model */
    const uint8_t *image; /* what ctx runs: runner_model or a slot's image in flash */
    uint8_t running;      /* slot index, PROTO_RUNNING_RAM or PROTO_RUNNING_NONE */
    uint32_t image_size;
    uint32_t input_size, output_size, max_batch;
    uint32_t vocab_size, max_seq_len, kv_cache_bytes; /* 0: a feature model */
    uint32_t arena_used;
    uint32_t kernels; /* PROTO_KERNELS_*: applied to every model started */

    bool loading; /* between an accepted LOAD_BEGIN and LOAD_END */
    uint32_t load_size;
    uint32_t load_crc;      /* announced */
    uint32_t load_received; /* bytes so far, = next expected offset */
    uint32_t load_running;  /* CRC-32 of the bytes so far */

    bool updating; /* between an accepted UPDATE_BEGIN and UPDATE_COMMIT */
    unsigned update_slot;
    uint32_t update_size, update_crc, update_sequence;
    uint32_t update_received; /* bytes so far, = next expected offset */
    uint32_t update_running;  /* CRC-32 of the bytes received */
    uint32_t word_fill;       /* bytes buffered in word[] */
    uint8_t word[SLOT_HEADER_SIZE] __attribute__((aligned(4))); /* one flash word being assembled */
} state = {.running = PROTO_RUNNING_NONE};

/* -- little-endian helpers ------------------------------------------------ */

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

static uint8_t *put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    return p + 2;
}

static uint8_t *put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
    return p + 4;
}

static uint8_t *put_u64(uint8_t *p, uint64_t v)
{
    p = put_u32(p, (uint32_t)v);
    return put_u32(p, (uint32_t)(v >> 32));
}

/* -- STATUS messages -------------------------------------------------------- */

typedef struct {
    char text[PROTO_MESSAGE_MAX];
    size_t len;
} message;

static void msg_str(message *m, const char *s)
{
    while (*s != '\0' && m->len < sizeof m->text) {
        m->text[m->len++] = *s++;
    }
}

static void msg_hex(message *m, uint32_t v)
{
    char text[10] = "0x";
    for (int i = 0; i < 8; i++) {
        const uint32_t nibble = (v >> (28 - 4 * i)) & 15u;
        text[2 + i] = (char)(nibble < 10u ? '0' + nibble : 'a' + nibble - 10u);
    }
    for (size_t i = 0; i < sizeof text && m->len < sizeof m->text; i++) {
        m->text[m->len++] = text[i];
    }
}

static void msg_u32(message *m, uint32_t v)
{
    char digits[10];
    size_t n = 0;
    do {
        digits[n++] = (char)('0' + v % 10u);
        v /= 10u;
    } while (v != 0u);
    while (n > 0u && m->len < sizeof m->text) {
        m->text[m->len++] = digits[--n];
    }
}

/* -- sending ------------------------------------------------------------------ */

static void uart_emit(const uint8_t *piece, size_t len)
{
    board_uart_write(piece, len);
}

/* Sends tx_packet with its payload of len bytes already in place. */
static void send_packet(uint8_t type, uint16_t seq, uint32_t len)
{
    static const uint8_t delimiter = 0u;
    tx_packet[0] = type;
    tx_packet[1] = 0u;
    put_u16(tx_packet + 2, seq);
    put_u32(tx_packet + 4, len);
    const size_t body = PROTO_HEADER_SIZE + len;
    put_u32(tx_packet + body, crc32_update(0u, tx_packet, body));
    cobs_encode_stream(tx_packet, body + PROTO_CRC_SIZE, uart_emit);
    board_uart_write(&delimiter, 1);
}

static uint8_t *payload_out(void)
{
    return tx_packet + PROTO_HEADER_SIZE;
}

static void send_response(uint8_t request, uint16_t seq, const uint8_t *end)
{
    send_packet((uint8_t)(request | PROTO_RESPONSE), seq, (uint32_t)(end - payload_out()));
}

static void send_status_msg(uint16_t seq, int32_t code, const message *m)
{
    uint8_t *p = put_u32(payload_out(), (uint32_t)code);
    memcpy(p, m->text, m->len);
    send_packet(PROTO_STATUS, seq, (uint32_t)(4u + m->len));
}

static void send_status(uint16_t seq, int32_t code, const char *text)
{
    message m = {.len = 0};
    msg_str(&m, text);
    send_status_msg(seq, code, &m);
}

static void send_ok(uint16_t seq)
{
    send_status(seq, PROTO_OK, "ok");
}

/* An engine status as the STATUS code, with the engine's own text. */
static void send_engine_status(uint16_t seq, colibri_status status)
{
    send_status(seq, (int32_t)status, colibri_strerror((int)status));
}

static void send_bad_payload(uint16_t seq, uint32_t got, uint32_t want)
{
    message m = {.len = 0};
    msg_str(&m, "payload of ");
    msg_u32(&m, got);
    msg_str(&m, " bytes, expected ");
    msg_u32(&m, want);
    send_status_msg(seq, PROTO_BAD_PAYLOAD, &m);
}

/* -- requests ----------------------------------------------------------------- */

static void drop_model(void)
{
    if (state.ctx != NULL) {
        (void)colibri_free(state.ctx);
    }
    state.ctx = NULL;
    state.image = NULL;
    state.running = PROTO_RUNNING_NONE;
    state.image_size = 0u;
    state.arena_used = 0u;
}

/* Builds the engine over an image (RAM buffer or flash slot, read in place)
 * and makes it the running model; on failure nothing runs. */
static colibri_status start_model(const uint8_t *image, uint32_t size, uint8_t running)
{
    drop_model();
    colibri_ctx *ctx = NULL;
    colibri_status st = colibri_init(&ctx, runner_arena, sizeof runner_arena, image, size);
    colibri_model_info info;
    if (st == COLIBRI_OK) {
        st = colibri_get_info(image, size, &info);
        if (st != COLIBRI_OK) {
            (void)colibri_free(ctx);
        }
    }
    if (st != COLIBRI_OK) {
        return st;
    }
    state.ctx = ctx;
    state.image = image;
    state.running = running;
    state.image_size = size;
    state.input_size = info.input_size;
    state.output_size = info.output_size;
    state.max_batch = info.max_batch;
    state.vocab_size = info.vocab_size;
    state.max_seq_len = info.max_seq_len;
    state.kv_cache_bytes = (uint32_t)info.kv_cache_bytes;
    state.arena_used = (uint32_t)info.arena_size;
    if (state.kernels == PROTO_KERNELS_REFERENCE) {
        (void)colibri_set_kernels(ctx, COLIBRI_KERNELS_REFERENCE);
    }
    return COLIBRI_OK;
}

/* At reset: the valid slot with the highest sequence; if the engine refuses
 * it (say, a larger arena than this firmware has), the other valid one. */
static void boot_from_slots(void)
{
    slot_status st[SLOT_COUNT];
    for (unsigned i = 0; i < SLOT_COUNT; i++) {
        slot_scan(i, &st[i]);
    }
    const unsigned first = slot_active(st);
    if (first == SLOT_NONE) {
        return;
    }
    if (start_model(slot_image(first), st[first].image_size, (uint8_t)first) == COLIBRI_OK) {
        return;
    }
    const unsigned other = 1u - first;
    if (st[other].state == SLOT_VALID) {
        (void)start_model(slot_image(other), st[other].image_size, (uint8_t)other);
    }
}

static void handle_hello(uint16_t seq, uint32_t len)
{
    if (len != 0u) {
        send_bad_payload(seq, len, 0u);
        return;
    }
    uint8_t *p = payload_out();
    p = put_u16(p, (uint16_t)PROTO_VERSION);
    p = put_u16(p, (uint16_t)PROTO_MAX_PAYLOAD);
    p = put_u32(p, (uint32_t)RUNNER_MODEL_CAPACITY);
    p = put_u32(p, (uint32_t)RUNNER_ARENA_CAPACITY);
    *p++ = (uint8_t)board_work_kind();
    const volatile runner_formats *formats = &colibri_runner_formats;
    p = put_u16(p, formats->min_version);
    p = put_u16(p, formats->max_version);
    const char *strings[3] = {board_name(), colibri_version(), build_flags};
    for (size_t i = 0; i < 3u; i++) {
        const size_t n = strlen(strings[i]);
        const size_t room = (size_t)(tx_packet + PROTO_HEADER_SIZE + PROTO_MAX_PAYLOAD - p) - 1u;
        memcpy(p, strings[i], n < room ? n : room);
        p += n < room ? n : room;
        if (i < 2u) {
            *p++ = 0u;
        }
    }
    send_response(PROTO_HELLO, seq, p);
}

static void handle_load_begin(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len != 8u) {
        send_bad_payload(seq, len, 8u);
        return;
    }
    const uint32_t size = get_u32(payload);
    if (size > (uint32_t)RUNNER_MODEL_CAPACITY) {
        message m = {.len = 0};
        msg_str(&m, "image of ");
        msg_u32(&m, size);
        msg_str(&m, " bytes exceeds the model buffer of ");
        msg_u32(&m, (uint32_t)RUNNER_MODEL_CAPACITY);
        send_status_msg(seq, PROTO_TOO_LARGE, &m);
        return;
    }
    drop_model(); /* the buffer is about to be overwritten */
    state.loading = true;
    state.load_size = size;
    state.load_crc = get_u32(payload + 4);
    state.load_received = 0u;
    state.load_running = 0u;
    send_ok(seq);
}

static void handle_load_chunk(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len < 4u) {
        send_bad_payload(seq, len, 4u);
        return;
    }
    if (!state.loading) {
        send_status(seq, PROTO_LOAD_SEQUENCE, "LOAD_CHUNK without LOAD_BEGIN");
        return;
    }
    const uint32_t offset = get_u32(payload);
    const uint32_t n = len - 4u;
    if (offset != state.load_received) {
        message m = {.len = 0};
        msg_str(&m, "chunk at offset ");
        msg_u32(&m, offset);
        msg_str(&m, ", expected ");
        msg_u32(&m, state.load_received);
        send_status_msg(seq, PROTO_LOAD_SEQUENCE, &m);
        return;
    }
    if (n > state.load_size - state.load_received) {
        message m = {.len = 0};
        msg_str(&m, "chunk runs past the announced image of ");
        msg_u32(&m, state.load_size);
        msg_str(&m, " bytes");
        send_status_msg(seq, PROTO_LOAD_SEQUENCE, &m);
        return;
    }
    memcpy(runner_model + offset, payload + 4, n);
    state.load_running = crc32_update(state.load_running, payload + 4, n);
    state.load_received += n;
    send_ok(seq);
}

static void handle_load_end(uint16_t seq, uint32_t len)
{
    if (len != 0u) {
        send_bad_payload(seq, len, 0u);
        return;
    }
    if (!state.loading) {
        send_status(seq, PROTO_LOAD_SEQUENCE, "LOAD_END without LOAD_BEGIN");
        return;
    }
    if (state.load_received != state.load_size) {
        message m = {.len = 0};
        msg_str(&m, "LOAD_END after ");
        msg_u32(&m, state.load_received);
        msg_str(&m, " of ");
        msg_u32(&m, state.load_size);
        msg_str(&m, " bytes");
        send_status_msg(seq, PROTO_LOAD_SEQUENCE, &m);
        return;
    }
    state.loading = false;
    if (state.load_running != state.load_crc) {
        send_status(seq, PROTO_LOAD_CRC, "image CRC-32 differs from the one announced");
        return;
    }
    const colibri_status st = start_model(runner_model, state.load_size, PROTO_RUNNING_RAM);
    if (st != COLIBRI_OK) {
        send_engine_status(seq, st);
        return;
    }
    send_ok(seq);
}

static void handle_info(uint16_t seq, uint32_t len)
{
    if (len != 0u) {
        send_bad_payload(seq, len, 0u);
        return;
    }
    if (state.ctx == NULL) {
        send_status(seq, PROTO_NO_MODEL, "no model loaded");
        return;
    }
    colibri_model_info info;
    const colibri_status st = colibri_get_info(state.image, state.image_size, &info);
    if (st != COLIBRI_OK) {
        send_engine_status(seq, st);
        return;
    }
    uint8_t *p = payload_out();
    p = put_u32(p, info.input_size);
    p = put_u32(p, info.output_size);
    p = put_u32(p, info.max_batch);
    p = put_u32(p, info.num_layers);
    p = put_u32(p, info.num_experts);
    p = put_u32(p, info.image_size);
    p = put_u32(p, (uint32_t)info.arena_size);
    p = put_u32(p, info.vocab_size);
    p = put_u32(p, info.max_seq_len);
    p = put_u32(p, (uint32_t)info.kv_cache_bytes);
    send_response(PROTO_INFO, seq, p);
}

/* KERNELS([u32 which]): with a payload, selects the kernels (0 the build's
 * optimised ones, 1 the reference ones) for the running model and every model
 * started after it, until reset; without, only asks. Answers the selection and
 * the kernel table's name (colibri_kernels_name; "" with no model running). */
static void handle_kernels(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len != 0u && len != 4u) {
        send_bad_payload(seq, len, 4u);
        return;
    }
    if (len == 4u) {
        const uint32_t which = get_u32(payload);
        if (which != PROTO_KERNELS_OPTIMISED && which != PROTO_KERNELS_REFERENCE) {
            send_status(seq, PROTO_BAD_PAYLOAD, "KERNELS takes u32 0 (optimised) or 1 (reference)");
            return;
        }
        state.kernels = which;
        if (state.ctx != NULL) {
            const colibri_status st = colibri_set_kernels(
                state.ctx, which == PROTO_KERNELS_REFERENCE ? COLIBRI_KERNELS_REFERENCE : COLIBRI_KERNELS_OPTIMISED);
            if (st != COLIBRI_OK) {
                send_engine_status(seq, st);
                return;
            }
        }
    }
    uint8_t *p = put_u32(payload_out(), state.kernels);
    const char *name = state.ctx != NULL ? colibri_kernels_name(state.ctx) : "";
    const size_t n = strlen(name);
    const size_t room = PROTO_MAX_PAYLOAD - 4u;
    memcpy(p, name, n < room ? n : room);
    p += n < room ? n : room;
    send_response(PROTO_KERNELS, seq, p);
}

/* The measured region: the work counter around colibri_forward alone. noipa
 * keeps the compiler from moving work into or out of it. */
static __attribute__((noipa, noinline)) colibri_status timed_forward(colibri_ctx *ctx, size_t batch,
                                                                     size_t in_count, size_t out_count,
                                                                     uint64_t *work)
{
    board_work_start();
    const colibri_status st = colibri_forward(ctx, batch, input_buf, in_count, output_buf, out_count);
    *work = board_work_stop();
    return st;
}

static void handle_forward(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len < 4u) {
        send_bad_payload(seq, len, 4u);
        return;
    }
    if (state.ctx == NULL) {
        send_status(seq, PROTO_NO_MODEL, "no model loaded");
        return;
    }
    const uint32_t batch = get_u32(payload);
    const uint64_t in_count = (uint64_t)batch * state.input_size;
    const uint64_t want = 4u + in_count * sizeof(float);
    if (want != len) {
        send_bad_payload(seq, len, want > UINT32_MAX ? UINT32_MAX : (uint32_t)want);
        return;
    }
    if (batch == 0u || batch > state.max_batch) {
        send_engine_status(seq, COLIBRI_E_BAD_BATCH);
        return;
    }
    const uint64_t out_count = (uint64_t)batch * state.output_size;
    if (PROTO_FORWARD_HEADER + out_count * sizeof(float) > PROTO_MAX_PAYLOAD) {
        message m = {.len = 0};
        msg_str(&m, "output of ");
        msg_u32(&m, (uint32_t)(out_count * sizeof(float)));
        msg_str(&m, " bytes does not fit a response; use a smaller batch");
        send_status_msg(seq, PROTO_TOO_LARGE, &m);
        return;
    }
    /* The payload's floats may sit at any alignment: copy them out. */
    memcpy(input_buf, payload + 4, (size_t)in_count * sizeof(float));
    uint64_t work = 0u;
    const colibri_status st = timed_forward(state.ctx, batch, (size_t)in_count, (size_t)out_count, &work);
    if (st != COLIBRI_OK) {
        send_engine_status(seq, st);
        return;
    }
    uint8_t *p = payload_out();
    p = put_u32(p, batch);
    p = put_u32(p, (uint32_t)board_work_kind());
    p = put_u64(p, work);
    memcpy(p, output_buf, (size_t)out_count * sizeof(float)); /* little-endian target */
    p += out_count * sizeof(float);
    send_response(PROTO_FORWARD, seq, p);
}


/* -- token models (docs/lm.md) ------------------------------------------------ */

/* The checks every LM request shares after its payload size: a model runs, it
 * is a token model, and one call's logits fit lm_logits. */
static bool lm_ready(uint16_t seq)
{
    if (state.ctx == NULL) {
        send_status(seq, PROTO_NO_MODEL, "no model loaded");
        return false;
    }
    if (state.vocab_size == 0u) {
        send_status(seq, (int32_t)COLIBRI_E_MODEL_KIND,
                    "a feature model: LM requests need a token model (use FORWARD)");
        return false;
    }
    if ((uint64_t)state.max_batch * state.vocab_size > RUNNER_LOGITS_CAPACITY) {
        message m = {.len = 0};
        msg_str(&m, "max_batch x vocab = ");
        msg_u32(&m, state.max_batch * state.vocab_size);
        msg_str(&m, " logits exceed the runner's buffer of ");
        msg_u32(&m, (uint32_t)RUNNER_LOGITS_CAPACITY);
        send_status_msg(seq, PROTO_TOO_LARGE, &m);
        return false;
    }
    return true;
}

/* Copies n ids out of the payload (any alignment) into lm_tokens and checks
 * them all before anything runs, as colibri.LM does: BAD_TOKEN names the first. */
static bool lm_take_tokens(uint16_t seq, const uint8_t *ids, uint32_t n)
{
    memcpy(lm_tokens, ids, (size_t)n * sizeof(int32_t));
    for (uint32_t i = 0; i < n; i++) {
        if (lm_tokens[i] < 0 || (uint32_t)lm_tokens[i] >= state.vocab_size) {
            message m = {.len = 0};
            msg_str(&m, "token ");
            msg_u32(&m, i);
            msg_str(&m, " is outside the vocabulary 0..");
            msg_u32(&m, state.vocab_size - 1u);
            send_status_msg(seq, (int32_t)COLIBRI_E_BAD_TOKEN, &m);
            return false;
        }
    }
    return true;
}

static void send_cache_full(uint16_t seq, uint32_t position, uint32_t needed)
{
    message m = {.len = 0};
    msg_u32(&m, position);
    msg_str(&m, " positions cached + ");
    msg_u32(&m, needed);
    msg_str(&m, " > max_seq_len ");
    msg_u32(&m, state.max_seq_len);
    send_status_msg(seq, (int32_t)COLIBRI_E_CACHE_FULL, &m);
}

static void handle_lm_reset(uint16_t seq, uint32_t len)
{
    if (len != 0u) {
        send_bad_payload(seq, len, 0u);
        return;
    }
    if (!lm_ready(seq)) {
        return;
    }
    const colibri_status st = colibri_lm_reset(state.ctx);
    if (st != COLIBRI_OK) {
        send_engine_status(seq, st);
        return;
    }
    send_ok(seq);
}

static __attribute__((noipa, noinline)) colibri_status timed_lm_forward(const int32_t *tokens, uint32_t n,
                                                                        uint64_t *work)
{
    board_work_start();
    const colibri_status st =
        colibri_lm_forward(state.ctx, tokens, n, lm_logits, (size_t)n * state.vocab_size);
    *work += board_work_stop();
    return st;
}

static __attribute__((noipa, noinline)) colibri_status timed_lm_sample(const colibri_sampler *sampler,
                                                                       const float *logits, colibri_rng *rng,
                                                                       int32_t *token, uint64_t *work)
{
    board_work_start();
    const colibri_status st = colibri_lm_sample(state.ctx, sampler, logits, state.vocab_size, rng, token);
    *work += board_work_stop();
    return st;
}

/* FORWARD_TOKENS(n, rows, ids): one colibri_lm_forward call of n <= max_batch
 * tokens at the cache's position. Everything is checked before the cache
 * changes, in colibri_lm_forward's order: payload, model, ids (BAD_TOKEN), n
 * (BAD_BATCH), the response's size (TOO_LARGE), room in the cache (CACHE_FULL). */
static void handle_forward_tokens(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len < PROTO_FORWARD_TOKENS_REQUEST_HEADER) {
        send_bad_payload(seq, len, PROTO_FORWARD_TOKENS_REQUEST_HEADER);
        return;
    }
    const uint32_t n = get_u32(payload);
    const uint32_t rows_mode = get_u32(payload + 4);
    const uint64_t want = PROTO_FORWARD_TOKENS_REQUEST_HEADER + (uint64_t)n * sizeof(int32_t);
    if (want != len) {
        send_bad_payload(seq, len, want > UINT32_MAX ? UINT32_MAX : (uint32_t)want);
        return;
    }
    if (rows_mode != PROTO_ROWS_ALL && rows_mode != PROTO_ROWS_LAST) {
        send_status(seq, PROTO_BAD_PAYLOAD, "rows must be 0 (all) or 1 (the last row only)");
        return;
    }
    if (!lm_ready(seq)) {
        return;
    }
    if (!lm_take_tokens(seq, payload + PROTO_FORWARD_TOKENS_REQUEST_HEADER, n)) {
        return;
    }
    if (n == 0u || n > state.max_batch) {
        message m = {.len = 0};
        msg_u32(&m, n);
        msg_str(&m, " tokens in one call; max_batch is ");
        msg_u32(&m, state.max_batch);
        send_status_msg(seq, (int32_t)COLIBRI_E_BAD_BATCH, &m);
        return;
    }
    const uint32_t rows = rows_mode == PROTO_ROWS_ALL ? n : 1u;
    const uint64_t out_bytes = (uint64_t)rows * state.vocab_size * sizeof(float);
    if (PROTO_FORWARD_TOKENS_HEADER + out_bytes > PROTO_MAX_PAYLOAD) {
        message m = {.len = 0};
        msg_str(&m, "logits of ");
        msg_u32(&m, (uint32_t)out_bytes);
        msg_str(&m, " bytes do not fit a response; fewer tokens or rows=last");
        send_status_msg(seq, PROTO_TOO_LARGE, &m);
        return;
    }
    uint32_t position = 0u;
    (void)colibri_lm_position(state.ctx, &position);
    if ((uint64_t)position + n > state.max_seq_len) {
        send_cache_full(seq, position, n);
        return;
    }
    uint64_t work = 0u;
    colibri_status st = timed_lm_forward(lm_tokens, n, &work);
    if (st == COLIBRI_OK) {
        st = colibri_lm_position(state.ctx, &position);
    }
    if (st != COLIBRI_OK) {
        send_engine_status(seq, st);
        return;
    }
    uint8_t *p = payload_out();
    p = put_u32(p, n);
    p = put_u32(p, rows);
    p = put_u32(p, position);
    p = put_u32(p, (uint32_t)board_work_kind());
    p = put_u64(p, work);
    memcpy(p, lm_logits + (size_t)(n - rows) * state.vocab_size, (size_t)out_bytes); /* little-endian target */
    p += out_bytes;
    send_response(PROTO_FORWARD_TOKENS, seq, p);
}

/* What one generation drew and measured. */
typedef struct generation {
    uint32_t made;
    uint64_t prefill, decode, sample;
} generation;

/* GENERATE's run over the n_prompt ids in lm_tokens, after the request's own
 * checks: the empty prompt, the cache and the response's room (`header`
 * bytes before the ids), then reset, the prompt in chunks of max_batch, and
 * max_new draws by colibri_lm_sample with the caller's seed, each token fed
 * back but the last; a drawn `stop` id (>= 0) ends it. Sends the failure's
 * STATUS itself and returns false. */
static bool run_generation(uint16_t seq, const colibri_sampler *sampler, uint64_t seed, uint32_t n_prompt,
                           uint32_t max_new, int32_t stop, uint32_t header, generation *g)
{
    if (n_prompt == 0u) {
        send_status(seq, (int32_t)COLIBRI_E_BAD_BATCH, "an empty prompt: give at least one token");
        return false;
    }
    const uint64_t positions = (uint64_t)n_prompt + (max_new > 0u ? max_new - 1u : 0u);
    if (positions > state.max_seq_len) {
        send_cache_full(seq, 0u, (uint32_t)(positions > UINT32_MAX ? UINT32_MAX : positions));
        return false;
    }
    if (header + (uint64_t)max_new * sizeof(int32_t) > PROTO_MAX_PAYLOAD) {
        send_status(seq, PROTO_TOO_LARGE, "max_new_tokens ids do not fit a response");
        return false;
    }
    colibri_status st = colibri_lm_reset(state.ctx);
    g->made = 0u;
    g->prefill = g->decode = g->sample = 0u;
    if (max_new > 0u) {
        colibri_rng rng;
        colibri_rng_seed(&rng, seed);
        uint32_t last = 0u; /* the row of the latest token's logits */
        for (uint32_t at = 0u; st == COLIBRI_OK && at < n_prompt; at += state.max_batch) {
            const uint32_t n = n_prompt - at < state.max_batch ? n_prompt - at : state.max_batch;
            st = timed_lm_forward(lm_tokens + at, n, &g->prefill);
            last = n - 1u;
        }
        while (st == COLIBRI_OK && g->made < max_new) {
            st = timed_lm_sample(sampler, lm_logits + (size_t)last * state.vocab_size, &rng, &lm_new[g->made],
                                 &g->sample);
            if (st != COLIBRI_OK || (stop >= 0 && lm_new[g->made] == stop)) {
                g->made += st == COLIBRI_OK ? 1u : 0u;
                break;
            }
            /* The last new token needs no forward: nothing reads its logits. */
            if (++g->made < max_new) {
                st = timed_lm_forward(&lm_new[g->made - 1u], 1u, &g->decode);
                last = 0u;
            }
        }
    }
    if (st != COLIBRI_OK) {
        send_engine_status(seq, st);
        return false;
    }
    return true;
}

/* The sampler of a GENERATE or GENERATE_TEXT request (its first 16 bytes),
 * checked by the sampler's rules (docs/lm.md); the comparisons are false for
 * NaN, so NaN is refused too. */
static bool take_sampler(uint16_t seq, const uint8_t *payload, colibri_sampler *sampler)
{
    const uint32_t temperature_bits = get_u32(payload + 4);
    const uint32_t top_p_bits = get_u32(payload + 12);
    memcpy(&sampler->temperature, &temperature_bits, sizeof(float));
    sampler->top_k = get_u32(payload + 8);
    memcpy(&sampler->top_p, &top_p_bits, sizeof(float));
    const float t = sampler->temperature;
    if (!(t >= 0.0f && t <= 3.402823466e38f) || !(sampler->top_p > 0.0f && sampler->top_p <= 1.0f)) {
        send_status(seq, (int32_t)COLIBRI_E_BAD_SAMPLER, "temperature must be finite and >= 0, top_p in (0, 1]");
        return false;
    }
    return true;
}

/* GENERATE: colibri.LM.generate on the target (engine.py, _engine.c): the same
 * checks in the same order, then the run above, to max_new_tokens. */
static void handle_generate(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len < PROTO_GENERATE_REQUEST_HEADER) {
        send_bad_payload(seq, len, PROTO_GENERATE_REQUEST_HEADER);
        return;
    }
    const uint32_t max_new = get_u32(payload);
    colibri_sampler sampler = {.struct_size = (uint32_t)sizeof(colibri_sampler)};
    const uint64_t seed = (uint64_t)get_u32(payload + 16) | (uint64_t)get_u32(payload + 20) << 32;
    const uint32_t n_prompt = get_u32(payload + 24);
    const uint64_t want = PROTO_GENERATE_REQUEST_HEADER + (uint64_t)n_prompt * sizeof(int32_t);
    if (want != len) {
        send_bad_payload(seq, len, want > UINT32_MAX ? UINT32_MAX : (uint32_t)want);
        return;
    }
    if (!lm_ready(seq) || !take_sampler(seq, payload, &sampler) ||
        !lm_take_tokens(seq, payload + PROTO_GENERATE_REQUEST_HEADER, n_prompt)) {
        return;
    }
    generation g;
    if (!run_generation(seq, &sampler, seed, n_prompt, max_new, -1, PROTO_GENERATE_HEADER, &g)) {
        return;
    }
    uint8_t *p = payload_out();
    p = put_u32(p, g.made);
    p = put_u32(p, (uint32_t)board_work_kind());
    p = put_u64(p, g.prefill);
    p = put_u64(p, g.decode);
    p = put_u64(p, g.sample);
    memcpy(p, lm_new, (size_t)g.made * sizeof(int32_t)); /* little-endian target */
    p += g.made * sizeof(int32_t);
    send_response(PROTO_GENERATE, seq, p);
}

#ifndef RUNNER_TEXT_PROMPT_MAX
#define RUNNER_TEXT_PROMPT_MAX 1024u /* bytes of prompt text GENERATE_TEXT encodes on the target */
#endif
static uint8_t encode_work[COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(RUNNER_TEXT_PROMPT_MAX)];

/* GENERATE_TEXT (protocol v5): GENERATE with the image's own tokenizer on the
 * target. The prompt is ids, or UTF-8 text (GENERATE_TEXT_PROMPT_TEXT) that
 * colibri_tokenizer_encode turns into ids; GENERATE_TEXT_STOP_AT_EOS ends the
 * run at the tokenizer's EOS (the last id sent); the new ids are decoded by
 * the streaming decoder (whole characters only, the end flushed) into the
 * response after them. */
static void handle_generate_text(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len < PROTO_GENERATE_TEXT_REQUEST_HEADER) {
        send_bad_payload(seq, len, PROTO_GENERATE_TEXT_REQUEST_HEADER);
        return;
    }
    const uint32_t max_new = get_u32(payload);
    colibri_sampler sampler = {.struct_size = (uint32_t)sizeof(colibri_sampler)};
    const uint64_t seed = (uint64_t)get_u32(payload + 16) | (uint64_t)get_u32(payload + 20) << 32;
    const uint32_t flags = get_u32(payload + 24), n_prompt = get_u32(payload + 28);
    const int text_prompt = (flags & PROTO_GENERATE_TEXT_PROMPT_TEXT) != 0u;
    const uint64_t want =
        PROTO_GENERATE_TEXT_REQUEST_HEADER + (uint64_t)n_prompt * (text_prompt ? 1u : sizeof(int32_t));
    if ((flags & ~(PROTO_GENERATE_TEXT_PROMPT_TEXT | PROTO_GENERATE_TEXT_STOP_AT_EOS)) != 0u) {
        send_status(seq, PROTO_BAD_PAYLOAD, "unknown GENERATE_TEXT flags");
        return;
    }
    if (want != len) {
        send_bad_payload(seq, len, want > UINT32_MAX ? UINT32_MAX : (uint32_t)want);
        return;
    }
    if (!lm_ready(seq) || !take_sampler(seq, payload, &sampler)) {
        return;
    }
    colibri_tokenizer tok;
    colibri_status st = colibri_tokenizer_open(&tok, state.image, state.image_size);
    if (st != COLIBRI_OK) {
        send_engine_status(seq, st);
        return;
    }
    const uint8_t *prompt = payload + PROTO_GENERATE_TEXT_REQUEST_HEADER;
    uint32_t n_ids = n_prompt;
    if (text_prompt) {
        if (n_prompt > RUNNER_TEXT_PROMPT_MAX) {
            message m = {.len = 0};
            msg_str(&m, "a prompt of more than ");
            msg_u32(&m, (uint32_t)RUNNER_TEXT_PROMPT_MAX);
            msg_str(&m, " bytes of text");
            send_status_msg(seq, PROTO_TOO_LARGE, &m);
            return;
        }
        size_t n = 0;
        st = colibri_tokenizer_encode(&tok, prompt, n_prompt, lm_tokens, sizeof lm_tokens / sizeof lm_tokens[0], &n,
                                      encode_work, sizeof encode_work);
        if (st != COLIBRI_OK) {
            send_engine_status(seq, st);
            return;
        }
        n_ids = (uint32_t)n;
    } else if (!lm_take_tokens(seq, prompt, n_prompt)) {
        return;
    }
    const int32_t stop = (flags & PROTO_GENERATE_TEXT_STOP_AT_EOS) ? tok.eos : -1;
    generation g;
    if (!run_generation(seq, &sampler, seed, n_ids, max_new, stop, PROTO_GENERATE_TEXT_HEADER, &g)) {
        return;
    }
    uint8_t *p = payload_out();
    uint8_t *const out = p;
    p = put_u32(p, g.made);
    p = put_u32(p, (uint32_t)board_work_kind());
    p = put_u64(p, g.prefill);
    p = put_u64(p, g.decode);
    p = put_u64(p, g.sample);
    p = put_u32(p, n_ids);
    uint8_t *const text_len_at = p;
    p = put_u32(p, 0u);
    memcpy(p, lm_new, (size_t)g.made * sizeof(int32_t)); /* little-endian target */
    p += g.made * sizeof(int32_t);
    colibri_text_stream stream;
    colibri_text_stream_init(&stream);
    uint8_t *const text = p;
    for (uint32_t i = 0; i <= g.made && st == COLIBRI_OK; i++) {
        const size_t room = PROTO_MAX_PAYLOAD - (size_t)(p - out);
        size_t n = 0;
        st = i < g.made ? colibri_tokenizer_decode(&tok, &stream, lm_new[i], p, room, &n)
                        : colibri_tokenizer_flush(&stream, p, room, &n);
        p += n;
    }
    if (st == COLIBRI_E_BUFFER_SIZE) {
        send_status(seq, PROTO_TOO_LARGE, "the new ids' text does not fit a response: ask for fewer tokens");
        return;
    }
    if (st != COLIBRI_OK) {
        send_engine_status(seq, st);
        return;
    }
    (void)put_u32(text_len_at, (uint32_t)(p - text));
    send_response(PROTO_GENERATE_TEXT, seq, p);
}

static void handle_stats(uint16_t seq, uint32_t len)
{
    if (len != 0u) {
        send_bad_payload(seq, len, 0u);
        return;
    }
    uint8_t *p = payload_out();
    p = put_u32(p, board_stack_size());
    p = put_u32(p, board_stack_used());
    p = put_u32(p, (uint32_t)RUNNER_MODEL_CAPACITY);
    p = put_u32(p, (uint32_t)RUNNER_ARENA_CAPACITY);
    p = put_u32(p, state.ctx != NULL ? state.arena_used : 0u);
    send_response(PROTO_STATS, seq, p);
}

static void handle_reset(uint16_t seq, uint32_t len)
{
    if (len != 0u) {
        send_bad_payload(seq, len, 0u);
        return;
    }
    send_ok(seq);
    board_reset();
}

/* -- model slots in flash ----------------------------------------------------------- */

static void send_flash_error(uint16_t seq, const char *what, uintptr_t addr, int status)
{
    message m = {.len = 0};
    msg_str(&m, what);
    msg_str(&m, " at ");
    msg_hex(&m, (uint32_t)addr);
    msg_str(&m, " failed: board flash status ");
    if (status < 0) {
        msg_str(&m, "-");
        msg_u32(&m, (uint32_t)-status);
    } else {
        msg_u32(&m, (uint32_t)status);
    }
    send_status_msg(seq, PROTO_FLASH_ERROR, &m);
}

static void handle_slot_info(uint16_t seq, uint32_t len)
{
    if (len != 0u) {
        send_bad_payload(seq, len, 0u);
        return;
    }
    slot_status st[SLOT_COUNT];
    for (unsigned i = 0; i < SLOT_COUNT; i++) {
        slot_scan(i, &st[i]);
    }
    const board_flash_info_t *f = board_flash_info();
    uint8_t *p = payload_out();
    p = put_u32(p, f->slot_size);
    p = put_u32(p, f->sector_size);
    p = put_u32(p, f->program_size);
    *p++ = (uint8_t)slot_active(st);
    *p++ = state.running;
    *p++ = state.updating ? 1u : 0u;
    *p++ = 0u;
    for (unsigned i = 0; i < SLOT_COUNT; i++) {
        p = put_u32(p, (uint32_t)f->slot_base[i]);
        *p++ = st[i].state;
        *p++ = 0u;
        p = put_u16(p, 0u);
        p = put_u32(p, st[i].sequence);
        p = put_u32(p, st[i].image_size);
        p = put_u32(p, st[i].image_crc);
    }
    send_response(PROTO_SLOT_INFO, seq, p);
}

/* UPDATE_BEGIN(size, crc): the slot that does not run (or, if no slot runs,
 * the one that is not active; A if neither is valid) is erased as far as the
 * image needs, header sector first. The running model keeps running. */
static void handle_update_begin(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len != 8u) {
        send_bad_payload(seq, len, 8u);
        return;
    }
    const uint32_t size = get_u32(payload);
    if (size > slot_capacity()) {
        message m = {.len = 0};
        msg_str(&m, "image of ");
        msg_u32(&m, size);
        msg_str(&m, " bytes exceeds the slot capacity of ");
        msg_u32(&m, slot_capacity());
        send_status_msg(seq, PROTO_TOO_LARGE, &m);
        return;
    }
    if (board_flash_info()->program_size != SLOT_HEADER_SIZE) {
        send_status(seq, PROTO_FLASH_ERROR, "board flash word is not the 32-byte slot header");
        return;
    }
    state.updating = false; /* a new BEGIN abandons an unfinished update */
    slot_status st[SLOT_COUNT];
    uint32_t newest = 0u;
    for (unsigned i = 0; i < SLOT_COUNT; i++) {
        slot_scan(i, &st[i]);
        if (st[i].state == SLOT_VALID && st[i].sequence > newest) {
            newest = st[i].sequence;
        }
    }
    unsigned target;
    if (state.running < SLOT_COUNT) {
        target = 1u - state.running;
    } else {
        const unsigned active = slot_active(st);
        target = active == SLOT_NONE ? 0u : 1u - active;
    }
    uintptr_t failed_at = 0u;
    const int fst = slot_erase_for(target, size, &failed_at);
    if (fst != BOARD_FLASH_OK) {
        send_flash_error(seq, "sector erase", failed_at, fst);
        return;
    }
    state.updating = true;
    state.update_slot = target;
    state.update_size = size;
    state.update_crc = get_u32(payload + 4);
    state.update_sequence = newest + 1u; /* above every valid slot: this one wins once committed */
    state.update_received = 0u;
    state.update_running = 0u;
    state.word_fill = 0u;
    send_ok(seq);
}

/* Programs the assembled flash word (padded with 0xFF, the erased value). */
static int flush_word(uintptr_t *addr)
{
    memset(state.word + state.word_fill, 0xFF, sizeof state.word - state.word_fill);
    const uint32_t word_offset = (state.update_received - 1u) / SLOT_HEADER_SIZE * SLOT_HEADER_SIZE;
    *addr = (uintptr_t)slot_image(state.update_slot) + word_offset;
    state.word_fill = 0u;
    return board_flash_program(*addr, state.word);
}

static void handle_update_chunk(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len < 4u) {
        send_bad_payload(seq, len, 4u);
        return;
    }
    if (!state.updating) {
        send_status(seq, PROTO_LOAD_SEQUENCE, "UPDATE_CHUNK without UPDATE_BEGIN");
        return;
    }
    const uint32_t offset = get_u32(payload);
    const uint32_t n = len - 4u;
    if (offset != state.update_received) {
        message m = {.len = 0};
        msg_str(&m, "chunk at offset ");
        msg_u32(&m, offset);
        msg_str(&m, ", expected ");
        msg_u32(&m, state.update_received);
        send_status_msg(seq, PROTO_LOAD_SEQUENCE, &m);
        return;
    }
    if (n > state.update_size - state.update_received) {
        message m = {.len = 0};
        msg_str(&m, "chunk runs past the announced image of ");
        msg_u32(&m, state.update_size);
        msg_str(&m, " bytes");
        send_status_msg(seq, PROTO_LOAD_SEQUENCE, &m);
        return;
    }
    state.update_running = crc32_update(state.update_running, payload + 4, n);
    for (uint32_t i = 0; i < n;) {
        const uint32_t take = n - i < SLOT_HEADER_SIZE - state.word_fill ? n - i : SLOT_HEADER_SIZE - state.word_fill;
        memcpy(state.word + state.word_fill, payload + 4 + i, take);
        state.word_fill += take;
        state.update_received += take;
        i += take;
        if (state.word_fill == SLOT_HEADER_SIZE) {
            uintptr_t addr;
            const int fst = flush_word(&addr);
            if (fst != BOARD_FLASH_OK) {
                state.updating = false;
                send_flash_error(seq, "program", addr, fst);
                return;
            }
        }
    }
    send_ok(seq);
}

/* UPDATE_COMMIT: last partial word, CRC of the image as it is in flash, the
 * engine's own validation, then the header word: the one operation that
 * switches models. Until then the old model runs and stays the active slot. */
static void handle_update_commit(uint16_t seq, uint32_t len)
{
    if (len != 0u) {
        send_bad_payload(seq, len, 0u);
        return;
    }
    if (!state.updating) {
        send_status(seq, PROTO_LOAD_SEQUENCE, "UPDATE_COMMIT without UPDATE_BEGIN");
        return;
    }
    if (state.update_received != state.update_size) {
        message m = {.len = 0};
        msg_str(&m, "UPDATE_COMMIT after ");
        msg_u32(&m, state.update_received);
        msg_str(&m, " of ");
        msg_u32(&m, state.update_size);
        msg_str(&m, " bytes");
        send_status_msg(seq, PROTO_LOAD_SEQUENCE, &m);
        return;
    }
    state.updating = false; /* whatever happens now, the next update starts with UPDATE_BEGIN */
    const unsigned slot = state.update_slot;
    if (state.word_fill > 0u) {
        uintptr_t addr;
        const int fst = flush_word(&addr);
        if (fst != BOARD_FLASH_OK) {
            send_flash_error(seq, "program", addr, fst);
            return;
        }
    }
    uint32_t crc = 0u;
    const int fst = slot_image_crc(slot, state.update_size, &crc);
    if (fst != BOARD_FLASH_OK) {
        send_flash_error(seq, "read back", (uintptr_t)slot_image(slot), fst);
        return;
    }
    if (crc != state.update_crc) {
        send_status(seq, PROTO_LOAD_CRC,
                    state.update_running != state.update_crc ? "image CRC-32 differs from the one announced"
                                                             : "image CRC-32 in flash differs from the bytes sent");
        return;
    }
    /* Never commit an image this firmware cannot run. */
    const uint8_t *image = slot_image(slot);
    colibri_status est = colibri_validate(image, state.update_size);
    size_t need = 0u;
    if (est == COLIBRI_OK) {
        est = colibri_model_size(image, state.update_size, &need);
    }
    if (est != COLIBRI_OK) {
        send_engine_status(seq, est);
        return;
    }
    if (need > sizeof runner_arena) {
        message m = {.len = 0};
        msg_str(&m, "model needs an arena of ");
        msg_u32(&m, (uint32_t)need);
        msg_str(&m, " bytes, the runner has ");
        msg_u32(&m, (uint32_t)sizeof runner_arena);
        send_status_msg(seq, PROTO_TOO_LARGE, &m);
        return;
    }
    const int hst = slot_write_header(slot, state.update_sequence, state.update_size, crc);
    if (hst != BOARD_FLASH_OK) {
        send_flash_error(seq, "header program", slot_base(slot), hst);
        return;
    }
    /* The new model is committed; read it back as boot would, then run it. */
    slot_status now;
    slot_scan(slot, &now);
    if (now.state != SLOT_VALID || now.sequence != state.update_sequence) {
        send_status(seq, PROTO_FLASH_ERROR, "committed slot does not read back valid");
        return;
    }
    const uint8_t *old_image = state.image;
    const uint32_t old_size = state.image_size;
    const uint8_t old_running = state.running;
    est = start_model(image, state.update_size, (uint8_t)slot);
    if (est != COLIBRI_OK) {
        if (old_image != NULL) {
            (void)start_model(old_image, old_size, old_running);
        }
        send_engine_status(seq, est);
        return;
    }
    send_ok(seq);
}

#ifdef BOARD_HAS_POWER_CUT
/* POWER_CUT_AFTER(n, mode, tear): arms the emulated flash's power cut
 * (board.h); answers with the flash operations done since reset. */
static void handle_power_cut_after(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len != 12u) {
        send_bad_payload(seq, len, 12u);
        return;
    }
    const uint32_t n = get_u32(payload);
    const uint32_t mode = get_u32(payload + 4);
    if (mode > 1u || (mode == 1u && n == 0u)) {
        send_status(seq, PROTO_BAD_PAYLOAD, "mode must be 0 (clean) or 1 (torn, n >= 1)");
        return;
    }
    const uint32_t done = board_flash_op_count();
    board_power_cut_arm(n, mode, get_u32(payload + 8));
    uint8_t *p = put_u32(payload_out(), done);
    send_response(PROTO_POWER_CUT_AFTER, seq, p);
}

/* FAULT(kind): makes the core fault on purpose, so a test can check that the
 * board's fault handler reports over the UART and ends with a non-zero status.
 * Never answers. kind 0: a load from an unmapped address (BusFault);
 * kind 1: an undefined instruction (UsageFault). */
static void handle_fault(uint16_t seq, const uint8_t *payload, uint32_t len)
{
    if (len != 4u || get_u32(payload) > 1u) {
        send_status(seq, PROTO_BAD_PAYLOAD, "FAULT takes u32 kind: 0 bus fault, 1 undefined instruction");
        return;
    }
    if (get_u32(payload) == 0u) {
        volatile const uint32_t *nowhere = (volatile const uint32_t *)0xF0000000u;
        (void)*nowhere;
    } else {
        __asm volatile("udf #0");
    }
}
#endif

/* -- frames --------------------------------------------------------------------- */

static void handle_frame(size_t encoded_len)
{
    const size_t n = cobs_decode(rx_frame, encoded_len, rx_frame, sizeof rx_frame);
    if (n == COBS_ERROR) {
        send_status(PROTO_UNKNOWN_SEQ, PROTO_FRAME_DECODE, "bad COBS encoding");
        return;
    }
    if (n < PROTO_OVERHEAD) {
        send_status(PROTO_UNKNOWN_SEQ, PROTO_FRAME_DECODE, "packet shorter than its header and CRC");
        return;
    }
    const uint8_t *packet = rx_frame;
    const uint32_t len = get_u32(packet + 4);
    if (len != n - PROTO_OVERHEAD) {
        message m = {.len = 0};
        msg_str(&m, "length field ");
        msg_u32(&m, len);
        msg_str(&m, " disagrees with a packet of ");
        msg_u32(&m, (uint32_t)n);
        msg_str(&m, " bytes");
        send_status_msg(PROTO_UNKNOWN_SEQ, PROTO_FRAME_LENGTH, &m);
        return;
    }
    if (crc32_update(0u, packet, PROTO_HEADER_SIZE + len) != get_u32(packet + PROTO_HEADER_SIZE + len)) {
        send_status(PROTO_UNKNOWN_SEQ, PROTO_FRAME_CRC, "frame CRC mismatch");
        return;
    }
    const uint8_t type = packet[0];
    const uint16_t seq = get_u16(packet + 2);
    const uint8_t *payload = packet + PROTO_HEADER_SIZE;
    if (packet[1] != 0u) {
        /* docs/protocol.md: flags is zero. Refused rather than ignored, so a
         * later protocol can give the byte a meaning without an old runner
         * silently misreading it. The frame decoded: its seq is known. */
        send_status(seq, PROTO_FRAME_DECODE, "flags byte is not zero");
        return;
    }
    if (len > PROTO_MAX_PAYLOAD) {
        send_bad_payload(seq, len, PROTO_MAX_PAYLOAD);
        return;
    }
    switch (type) {
    case PROTO_HELLO:
        handle_hello(seq, len);
        break;
    case PROTO_LOAD_BEGIN:
        handle_load_begin(seq, payload, len);
        break;
    case PROTO_LOAD_CHUNK:
        handle_load_chunk(seq, payload, len);
        break;
    case PROTO_LOAD_END:
        handle_load_end(seq, len);
        break;
    case PROTO_INFO:
        handle_info(seq, len);
        break;
    case PROTO_KERNELS:
        handle_kernels(seq, payload, len);
        break;
    case PROTO_FORWARD:
        handle_forward(seq, payload, len);
        break;
    case PROTO_LM_RESET:
        handle_lm_reset(seq, len);
        break;
    case PROTO_FORWARD_TOKENS:
        handle_forward_tokens(seq, payload, len);
        break;
    case PROTO_GENERATE:
        handle_generate(seq, payload, len);
        break;
    case PROTO_GENERATE_TEXT:
        handle_generate_text(seq, payload, len);
        break;
    case PROTO_STATS:
        handle_stats(seq, len);
        break;
    case PROTO_RESET:
        handle_reset(seq, len);
        break;
    case PROTO_SLOT_INFO:
        handle_slot_info(seq, len);
        break;
    case PROTO_UPDATE_BEGIN:
        handle_update_begin(seq, payload, len);
        break;
    case PROTO_UPDATE_CHUNK:
        handle_update_chunk(seq, payload, len);
        break;
    case PROTO_UPDATE_COMMIT:
        handle_update_commit(seq, len);
        break;
#ifdef BOARD_HAS_POWER_CUT
    case PROTO_POWER_CUT_AFTER:
        handle_power_cut_after(seq, payload, len);
        break;
    case PROTO_FAULT:
        handle_fault(seq, payload, len);
        break;
#endif
    default: {
        message m = {.len = 0};
        msg_str(&m, "unknown request type ");
        msg_u32(&m, type);
        send_status_msg(seq, PROTO_UNKNOWN_TYPE, &m);
        break;
    }
    }
}

int main(void)
{
    board_init();
    boot_from_slots();
#ifdef RUNNER_BUILTIN_MODEL
    /* The linked-in model runs in place from .rodata when no slot holds one. */
    if (state.running == PROTO_RUNNING_NONE) {
        (void)start_model(colibri_model_image, (uint32_t)colibri_model_image_len, PROTO_RUNNING_BUILTIN);
    }
#endif
    size_t n = 0;
    bool discarding = false; /* after an overflow: drop bytes up to the next 0x00 */
    for (;;) {
        const uint8_t b = board_uart_getc();
        if (discarding) {
            discarding = b != 0u;
            continue;
        }
        if (b == 0u) {
            if (n > 0u) { /* empty frames are ignored */
                handle_frame(n);
                n = 0;
            }
            continue;
        }
        if (n == sizeof rx_frame) {
            send_status(PROTO_UNKNOWN_SEQ, PROTO_FRAME_TOO_LONG, "frame longer than the receive buffer");
            n = 0;
            discarding = true;
            continue;
        }
        rx_frame[n++] = b;
    }
}
