/*
 * The runner wire protocol, version 5 (docs/protocol.md): packet layout,
 * request types and STATUS codes.
 */
#ifndef RUNNER_PROTOCOL_H
#define RUNNER_PROTOCOL_H

#define PROTO_VERSION 5u /* 2: HELLO reports the model image format versions read; 3: KERNELS;
                            4: token models (LM_RESET, FORWARD_TOKENS, GENERATE; INFO grows);
                            5: GENERATE_TEXT (the image's tokenizer on the target) */
#define PROTO_MAX_PAYLOAD 4096u
#define PROTO_HEADER_SIZE 8u  /* u8 type, u8 flags, u16 seq, u32 length */
#define PROTO_CRC_SIZE 4u     /* CRC-32 (zlib) of header + payload */
#define PROTO_OVERHEAD (PROTO_HEADER_SIZE + PROTO_CRC_SIZE)
#define PROTO_RESPONSE 0x80u
#define PROTO_UNKNOWN_SEQ 0xFFFFu
#define PROTO_MESSAGE_MAX 96u /* bytes of text after a STATUS code */

/* Request types; a response has type | PROTO_RESPONSE, or is STATUS. */
#define PROTO_HELLO 0x01u
#define PROTO_LOAD_BEGIN 0x10u
#define PROTO_LOAD_CHUNK 0x11u
#define PROTO_LOAD_END 0x12u
#define PROTO_INFO 0x20u
#define PROTO_KERNELS 0x21u
#define PROTO_FORWARD 0x30u
#define PROTO_LM_RESET 0x31u
#define PROTO_FORWARD_TOKENS 0x32u
#define PROTO_GENERATE 0x33u
#define PROTO_GENERATE_TEXT 0x34u
#define PROTO_STATS 0x40u
#define PROTO_RESET 0x50u
#define PROTO_SLOT_INFO 0x60u
#define PROTO_UPDATE_BEGIN 0x61u
#define PROTO_UPDATE_CHUNK 0x62u
#define PROTO_UPDATE_COMMIT 0x63u
#define PROTO_POWER_CUT_AFTER 0x6Fu /* debug, emulated boards only (BOARD_HAS_POWER_CUT) */
#define PROTO_FAULT 0x6Eu           /* debug, emulated boards only: fault on purpose */
#define PROTO_STATUS 0x7Fu

/* STATUS codes beyond the engine's own (0 and -1 ... -99, colibri.h). */
#define PROTO_OK 0
#define PROTO_FRAME_CRC (-100)
#define PROTO_FRAME_DECODE (-101)
#define PROTO_FRAME_TOO_LONG (-102)
#define PROTO_FRAME_LENGTH (-103)
#define PROTO_UNKNOWN_TYPE (-104)
#define PROTO_BAD_PAYLOAD (-105)
#define PROTO_NO_MODEL (-106)
#define PROTO_LOAD_SEQUENCE (-107)
#define PROTO_LOAD_CRC (-108)
#define PROTO_TOO_LARGE (-109)
#define PROTO_FLASH_ERROR (-110)

/* KERNELS: which kernels the engine runs (colibri_set_kernels). */
#define PROTO_KERNELS_OPTIMISED 0u
#define PROTO_KERNELS_REFERENCE 1u

/* FORWARD response header: u32 batch, u32 work_kind, u64 work. */
#define PROTO_FORWARD_HEADER 16u

/* FORWARD_TOKENS request: u32 n, u32 rows (PROTO_ROWS_*), then n i32 token ids.
 * Response header: u32 n, u32 rows sent, u32 position (after the call),
 * u32 work_kind, u64 work; then rows x vocab f32. */
#define PROTO_FORWARD_TOKENS_REQUEST_HEADER 8u
#define PROTO_FORWARD_TOKENS_HEADER 24u
#define PROTO_ROWS_ALL 0u  /* every row's logits [n, vocab] */
#define PROTO_ROWS_LAST 1u /* the last row's only [1, vocab]: what decoding needs */
/* GENERATE request: u32 max_new_tokens, f32 temperature, u32 top_k, f32 top_p,
 * u64 seed, u32 n_prompt, then n_prompt i32 token ids. Response header:
 * u32 count, u32 work_kind, u64 prefill_work, u64 decode_work, u64 sample_work;
 * then count i32 token ids. */
#define PROTO_GENERATE_REQUEST_HEADER 28u
#define PROTO_GENERATE_HEADER 32u
/* GENERATE_TEXT request: GENERATE's first 24 bytes, u32 flags, u32 n_prompt,
 * then n_prompt i32 ids, or n_prompt bytes of UTF-8 text with PROMPT_TEXT.
 * Response header: GENERATE's 32 bytes, u32 prompt ids (what the prompt
 * encoded to), u32 text bytes; then count i32 ids, then the text. */
#define PROTO_GENERATE_TEXT_REQUEST_HEADER 32u
#define PROTO_GENERATE_TEXT_HEADER 40u
#define PROTO_GENERATE_TEXT_PROMPT_TEXT 1u /* the prompt is text, encoded on the target */
#define PROTO_GENERATE_TEXT_STOP_AT_EOS 2u /* the tokenizer's EOS ends the run (the last id) */

/* SLOT_INFO: which slot runs (a slot index, or these). */
#define PROTO_RUNNING_BUILTIN 0xFDu /* the model linked into the firmware (MODEL_C=) */
#define PROTO_RUNNING_RAM 0xFEu  /* a model uploaded with LOAD_* into RAM */
#define PROTO_RUNNING_NONE 0xFFu /* no model */

#endif /* RUNNER_PROTOCOL_H */
