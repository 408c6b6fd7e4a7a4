/* Generated from host_tools/colibri/model/format.py by `colibri gen-header`. Do not edit. */
#ifndef COLIBRI_FORMAT_H
#define COLIBRI_FORMAT_H

#define COLIBRI_MAGIC 0x52424C43u
#define COLIBRI_FORMAT_VERSION 2u
#define COLIBRI_FORMAT_VERSION_MIN 1u
#define COLIBRI_FORMAT_VERSION_MAX 7u
#define COLIBRI_NONE 0xFFFFFFFFu
#define COLIBRI_PAYLOAD_ALIGN 32u
#define COLIBRI_PAGE_SIZE 4096u
#define COLIBRI_MAX_BATCH_LIMIT 65535u
#define COLIBRI_MAX_ROUTES 65535u
#define COLIBRI_MAX_SHARED 16u
#define COLIBRI_MAX_RESIDUAL_DEPTH 16u
#define COLIBRI_HEADER_CRC_OFFSET 8u
#define COLIBRI_CRC_START 12u
#define COLIBRI_TENSOR_CRC_VERSION 3u
#define COLIBRI_LM_VERSION 4u
#define COLIBRI_Q8_PARAMS_HEADER 8u
#define COLIBRI_Q8_FLAG_BIAS 1u
#define COLIBRI_Q4_VERSION 5u
#define COLIBRI_Q4_PARAMS_HEADER 8u
#define COLIBRI_Q4_FLAG_BIAS 1u
#define COLIBRI_Q4_GROUP_LOG2_MIN 3u
#define COLIBRI_Q4_GROUP_LOG2_MAX 8u
#define COLIBRI_MAX_SEQ_LEN 1048576u
#define COLIBRI_ATTENTION_FLAGS_OFFSET 65u
#define COLIBRI_ATTENTION_RESERVED 66u
#define COLIBRI_TOKENIZER_VERSION 6u
#define COLIBRI_TOKENIZER_MAGIC 0x4B544C43u
#define COLIBRI_TOKENIZER_SECTION_VERSION 2u
#define COLIBRI_TOKENIZER_SECTION_VERSION_MIN 1u
#define COLIBRI_TOKENIZER_INDEX_VERSION 2u
#define COLIBRI_SPLIT_PATTERN_QWEN2 "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define COLIBRI_SPLIT_PATTERN_LLAMA3 "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define COLIBRI_TOKENIZER_HEADER_SIZE 80u
#define COLIBRI_TOKENIZER_BYTE_IDS 256u
#define COLIBRI_WIDE_VERSION 7u
#define COLIBRI_WIDE_HEADER_SIZE 96u
#define COLIBRI_WIDE_FIELDS_OFFSET 80u
#define COLIBRI_NARROW_LIMIT 0xFFFFFFFFu
#define COLIBRI_MAX_TENSOR_ELEMENTS 0xFFFFFFFFu

#define COLIBRI_HEADER_SIZE 80u
#define COLIBRI_TENSOR_SIZE 24u
#define COLIBRI_TENSOR_WIDE_SIZE 32u
#define COLIBRI_LAYER_SIZE 32u
#define COLIBRI_MOE_SIZE 48u
#define COLIBRI_EXPERT_SIZE 32u
#define COLIBRI_ATTENTION_SIZE 80u

#define COLIBRI_FLAG_PAGE_ALIGNED 1u

#define COLIBRI_LAYER_FLAG_INT8_ACT 1u
#define COLIBRI_LAYER_FLAG_INT8_BLOCKS 2u

#define COLIBRI_EXPERT_FLAG_INT8_ACT 1u
#define COLIBRI_EXPERT_FLAG_INT8_BLOCKS 2u

#define COLIBRI_ATTENTION_FLAG_INT8_BLOCKS 2u

#define COLIBRI_DTYPE_F32 1u
#define COLIBRI_DTYPE_F16 2u
#define COLIBRI_DTYPE_I8 3u
#define COLIBRI_DTYPE_I32 4u
#define COLIBRI_DTYPE_Q8_PARAMS 5u
#define COLIBRI_DTYPE_I4 6u
#define COLIBRI_DTYPE_Q4_PARAMS 7u
#define COLIBRI_DTYPE_TOKENIZER 8u

#define COLIBRI_OP_LINEAR 1u
#define COLIBRI_OP_ACTIVATION 2u
#define COLIBRI_OP_LAYERNORM 3u
#define COLIBRI_OP_RMSNORM 4u
#define COLIBRI_OP_RESIDUAL_PUSH 5u
#define COLIBRI_OP_RESIDUAL_ADD 6u
#define COLIBRI_OP_MOE 7u
#define COLIBRI_OP_EMBED 8u
#define COLIBRI_OP_ATTENTION 9u

#define COLIBRI_ACT_RELU 1u
#define COLIBRI_ACT_GELU_ERF 2u
#define COLIBRI_ACT_GELU_TANH 3u
#define COLIBRI_ACT_SILU 4u
#define COLIBRI_ACT_TANH 5u
#define COLIBRI_ACT_SIGMOID 6u

#define COLIBRI_ROUTING_TOP1 1u
#define COLIBRI_ROUTING_TOPK_SOFTMAX 2u
#define COLIBRI_ROUTING_SOFTMAX_TOPK 3u
#define COLIBRI_ROUTING_DENSE 4u

#define COLIBRI_MOE_FLAG_RENORMALIZE 1u

#define COLIBRI_EXPERT_MLP 1u
#define COLIBRI_EXPERT_GLU 2u

#define COLIBRI_TOKENIZER_BYTE_BPE 1u
#define COLIBRI_TOKENIZER_SENTENCEPIECE_BPE 2u
#define COLIBRI_TOKENIZER_SENTENCEPIECE_UNIGRAM 3u

#define COLIBRI_TOKENIZER_FLAG_ADD_DUMMY_PREFIX 1u
#define COLIBRI_TOKENIZER_FLAG_BYTE_FALLBACK 2u
#define COLIBRI_TOKENIZER_FLAG_REMOVE_EXTRA_WHITESPACES 4u
#define COLIBRI_TOKENIZER_FLAG_ADD_PREFIX_SPACE 8u
#define COLIBRI_TOKENIZER_FLAG_IGNORE_MERGES 16u

#define COLIBRI_TOKEN_NORMAL 1u
#define COLIBRI_TOKEN_BYTE 2u
#define COLIBRI_TOKEN_CONTROL 3u
#define COLIBRI_TOKEN_UNKNOWN 4u
#define COLIBRI_TOKEN_USER_DEFINED 5u
#define COLIBRI_TOKEN_UNUSED 6u

#define COLIBRI_NORMALIZER_NONE 0u
#define COLIBRI_NORMALIZER_NFC 1u

#define COLIBRI_PRE_TOKENIZER_NONE 0u
#define COLIBRI_PRE_TOKENIZER_BYTE_LEVEL 1u
#define COLIBRI_PRE_TOKENIZER_SPLIT_BYTE_LEVEL 2u

typedef enum colibri_status {
    COLIBRI_OK = 0, /* ok */
    COLIBRI_E_NULL_ARG = -1, /* a required pointer argument is NULL */
    COLIBRI_E_TRUNCATED = -2, /* image is truncated: buffer shorter than the header or image_size */
    COLIBRI_E_BAD_MAGIC = -3, /* not a Colibri model image (bad magic) */
    COLIBRI_E_BAD_VERSION = -4, /* invalid model image version field (0 or 0xFFFF: corrupt or erased) */
    COLIBRI_E_BAD_HEADER = -5, /* invalid model image header field */
    COLIBRI_E_BAD_CRC = -6, /* model image CRC-32 mismatch (corrupted image) */
    COLIBRI_E_TABLE_BOUNDS = -7, /* a table lies outside the image or is misaligned */
    COLIBRI_E_TENSOR_BOUNDS = -8, /* a tensor payload lies outside the image or is misaligned */
    COLIBRI_E_BAD_TENSOR = -9, /* invalid tensor record (dtype, rank or size) */
    COLIBRI_E_BAD_REF = -10, /* a layer refers to a missing or wrongly shaped tensor */
    COLIBRI_E_BAD_LAYER = -11, /* invalid layer (unknown op, activation, eps, widths or residual nesting) */
    COLIBRI_E_BAD_MOE = -12, /* invalid MoE or expert record */
    COLIBRI_E_UNSUPPORTED = -13, /* feature not supported by this engine build */
    COLIBRI_E_ARENA_TOO_SMALL = -14, /* arena too small for this model (see colibri_model_size) */
    COLIBRI_E_ARENA_ALIGN = -15, /* arena must be 8-byte aligned */
    COLIBRI_E_IMAGE_ALIGN = -16, /* model image must be 4-byte aligned */
    COLIBRI_E_BAD_BATCH = -17, /* batch must be between 1 and the model's max_batch */
    COLIBRI_E_BUFFER_SIZE = -18, /* input or output buffer length does not match batch x features */
    COLIBRI_E_BAD_CONTEXT = -19, /* context is not initialised or was freed */
    COLIBRI_E_BAD_QUANT = -20, /* invalid int8 or int4 quantisation parameters (companion, parameter dtype, group or flags, NaN or negative scale, padding nibble) */
    COLIBRI_E_BAD_COMPENSATION = -21, /* invalid sparse compensation term (row pointers, column indices out of range or unsorted, non-finite values) */
    COLIBRI_E_UNSUPPORTED_VERSION = -22, /* unsupported model image format version (not in COLIBRI_FORMAT_VERSION_MIN..MAX) */
    COLIBRI_E_BAD_EXEC = -23, /* invalid execution options (colibri_exec: struct_size, unknown fields or more workers than the arena holds) */
    COLIBRI_E_BAD_PAYLOAD_CRC = -24, /* a tensor payload's CRC-32 does not match its entry in the CRC table (corrupted weights) */
    COLIBRI_E_FILE_NOT_FOUND = -25, /* model file not found */
    COLIBRI_E_FILE_OPEN = -26, /* model file could not be opened or read (permission, not a regular file, I/O error) */
    COLIBRI_E_MMAP_FAILED = -27, /* mmap of the model file failed */
    COLIBRI_E_MLOCK_FAILED = -28, /* mlock refused (see RLIMIT_MEMLOCK) */
    COLIBRI_E_FILE_CHANGED = -29, /* the model file changed size under its mapping (truncated or rewritten in place; replace it by rename) */
    COLIBRI_E_NO_SUCH_EXPERT = -30, /* no such MoE layer or expert in this model */
    COLIBRI_E_BAD_ATTENTION = -31, /* invalid attention record (heads, head_dim, norms, rope_theta, max_seq_len or KV dtype) */
    COLIBRI_E_CACHE_FULL = -32, /* the KV cache is full: the sequence would pass max_seq_len (reset it) */
    COLIBRI_E_BAD_TOKEN = -33, /* a token id is outside the model's vocabulary */
    COLIBRI_E_MODEL_KIND = -34, /* wrong call for this model: colibri_lm_* on a feature model or colibri_forward on a token model */
    COLIBRI_E_BAD_SAMPLER = -35, /* invalid sampler settings (struct_size, temperature, top_k or top_p) */
    COLIBRI_E_NAN_LOGITS = -36, /* the logits contain NaN (or Inf when sampling): no token can be drawn */
    COLIBRI_E_IMAGE_TOO_LARGE = -37, /* the image is larger than this engine build addresses (SIZE_MAX, COLIBRI_MAX_IMAGE_BYTES) */
    COLIBRI_E_BAD_TOKENIZER = -38, /* invalid tokenizer section (header, kind, flags, special ids, array bounds, token offsets, types, scores, merges or byte ids) */
    COLIBRI_E_NO_TOKENIZER = -39, /* the model image holds no tokenizer section (or this engine was built without the tokenizer) */
    COLIBRI_E_BAD_TEXT = -40, /* the text to encode is not well-formed UTF-8 */
    COLIBRI_E_TEXT_NOT_NORMALIZED = -41, /* an NFC tokenizer and text NFC may change: the device cannot encode it (the host can) */
} colibri_status;

/* X(code, message) for every status, for colibri_strerror(). */
#define COLIBRI_STATUS_LIST(X) \
    X(0, "ok") \
    X(-1, "a required pointer argument is NULL") \
    X(-2, "image is truncated: buffer shorter than the header or image_size") \
    X(-3, "not a Colibri model image (bad magic)") \
    X(-4, "invalid model image version field (0 or 0xFFFF: corrupt or erased)") \
    X(-5, "invalid model image header field") \
    X(-6, "model image CRC-32 mismatch (corrupted image)") \
    X(-7, "a table lies outside the image or is misaligned") \
    X(-8, "a tensor payload lies outside the image or is misaligned") \
    X(-9, "invalid tensor record (dtype, rank or size)") \
    X(-10, "a layer refers to a missing or wrongly shaped tensor") \
    X(-11, "invalid layer (unknown op, activation, eps, widths or residual nesting)") \
    X(-12, "invalid MoE or expert record") \
    X(-13, "feature not supported by this engine build") \
    X(-14, "arena too small for this model (see colibri_model_size)") \
    X(-15, "arena must be 8-byte aligned") \
    X(-16, "model image must be 4-byte aligned") \
    X(-17, "batch must be between 1 and the model's max_batch") \
    X(-18, "input or output buffer length does not match batch x features") \
    X(-19, "context is not initialised or was freed") \
    X(-20, "invalid int8 or int4 quantisation parameters (companion, parameter dtype, group or flags, NaN or negative scale, padding nibble)") \
    X(-21, "invalid sparse compensation term (row pointers, column indices out of range or unsorted, non-finite values)") \
    X(-22, "unsupported model image format version (not in COLIBRI_FORMAT_VERSION_MIN..MAX)") \
    X(-23, "invalid execution options (colibri_exec: struct_size, unknown fields or more workers than the arena holds)") \
    X(-24, "a tensor payload's CRC-32 does not match its entry in the CRC table (corrupted weights)") \
    X(-25, "model file not found") \
    X(-26, "model file could not be opened or read (permission, not a regular file, I/O error)") \
    X(-27, "mmap of the model file failed") \
    X(-28, "mlock refused (see RLIMIT_MEMLOCK)") \
    X(-29, "the model file changed size under its mapping (truncated or rewritten in place; replace it by rename)") \
    X(-30, "no such MoE layer or expert in this model") \
    X(-31, "invalid attention record (heads, head_dim, norms, rope_theta, max_seq_len or KV dtype)") \
    X(-32, "the KV cache is full: the sequence would pass max_seq_len (reset it)") \
    X(-33, "a token id is outside the model's vocabulary") \
    X(-34, "wrong call for this model: colibri_lm_* on a feature model or colibri_forward on a token model") \
    X(-35, "invalid sampler settings (struct_size, temperature, top_k or top_p)") \
    X(-36, "the logits contain NaN (or Inf when sampling): no token can be drawn") \
    X(-37, "the image is larger than this engine build addresses (SIZE_MAX, COLIBRI_MAX_IMAGE_BYTES)") \
    X(-38, "invalid tokenizer section (header, kind, flags, special ids, array bounds, token offsets, types, scores, merges or byte ids)") \
    X(-39, "the model image holds no tokenizer section (or this engine was built without the tokenizer)") \
    X(-40, "the text to encode is not well-formed UTF-8") \
    X(-41, "an NFC tokenizer and text NFC may change: the device cannot encode it (the host can)") \


#endif /* COLIBRI_FORMAT_H */
