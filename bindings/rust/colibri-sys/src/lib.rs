//! Raw bindings to the Colibri C engine: every declaration of
//! `firmware/colibri_core/include/colibri.h` and `colibri_format.h`, written
//! by hand (no bindgen: the build is offline with no registry) and held to the
//! header by `tests/drift.rs` (sizes, offsets, constants, statuses and every
//! `COLIBRI_API` prototype, checked by the C compiler).
//!
//! `no_std`, no allocation: the engine itself allocates nothing, and neither
//! does anything here. The safe API is the `colibri` crate.
#![no_std]
#![allow(non_camel_case_types)]

use core::ffi::{c_char, c_int, c_void};

/// `enum colibri_status`: an `int` (its values are negative). Kept as an
/// integer, not a Rust enum, since a C function may return a value this
/// declaration does not list; the safe crate maps it.
pub type colibri_status = c_int;

// ---- colibri_format.h ----
pub const COLIBRI_MAGIC: u32 = 0x52424C43;
pub const COLIBRI_FORMAT_VERSION: u32 = 2;
pub const COLIBRI_FORMAT_VERSION_MIN: u32 = 1;
pub const COLIBRI_FORMAT_VERSION_MAX: u32 = 7;
pub const COLIBRI_NONE: u32 = 0xFFFFFFFF;
pub const COLIBRI_PAYLOAD_ALIGN: u32 = 32;
pub const COLIBRI_PAGE_SIZE: u32 = 4096;
pub const COLIBRI_MAX_BATCH_LIMIT: u32 = 65535;
pub const COLIBRI_MAX_ROUTES: u32 = 65535;
pub const COLIBRI_MAX_SHARED: u32 = 16;
pub const COLIBRI_MAX_RESIDUAL_DEPTH: u32 = 16;
pub const COLIBRI_HEADER_CRC_OFFSET: u32 = 8;
pub const COLIBRI_CRC_START: u32 = 12;
pub const COLIBRI_TENSOR_CRC_VERSION: u32 = 3;
pub const COLIBRI_LM_VERSION: u32 = 4;
pub const COLIBRI_Q8_PARAMS_HEADER: u32 = 8;
pub const COLIBRI_Q8_FLAG_BIAS: u32 = 1;
pub const COLIBRI_Q4_VERSION: u32 = 5;
pub const COLIBRI_Q4_PARAMS_HEADER: u32 = 8;
pub const COLIBRI_Q4_FLAG_BIAS: u32 = 1;
pub const COLIBRI_Q4_GROUP_LOG2_MIN: u32 = 3;
pub const COLIBRI_Q4_GROUP_LOG2_MAX: u32 = 8;
pub const COLIBRI_MAX_SEQ_LEN: u32 = 1048576;
pub const COLIBRI_WIDE_VERSION: u32 = 7;
pub const COLIBRI_WIDE_HEADER_SIZE: u32 = 96;
pub const COLIBRI_WIDE_FIELDS_OFFSET: u32 = 80;
pub const COLIBRI_NARROW_LIMIT: u32 = 0xFFFFFFFF;
pub const COLIBRI_MAX_TENSOR_ELEMENTS: u32 = 0xFFFFFFFF;
pub const COLIBRI_HEADER_SIZE: u32 = 80;
pub const COLIBRI_TENSOR_SIZE: u32 = 24;
pub const COLIBRI_TENSOR_WIDE_SIZE: u32 = 32;
pub const COLIBRI_LAYER_SIZE: u32 = 32;
pub const COLIBRI_MOE_SIZE: u32 = 48;
pub const COLIBRI_EXPERT_SIZE: u32 = 32;
pub const COLIBRI_ATTENTION_SIZE: u32 = 80;
pub const COLIBRI_ATTENTION_FLAGS_OFFSET: u32 = 65;
pub const COLIBRI_ATTENTION_RESERVED: u32 = 66;
pub const COLIBRI_FLAG_PAGE_ALIGNED: u32 = 1;
pub const COLIBRI_LAYER_FLAG_INT8_ACT: u32 = 1;
pub const COLIBRI_LAYER_FLAG_INT8_BLOCKS: u32 = 2;
pub const COLIBRI_EXPERT_FLAG_INT8_ACT: u32 = 1;
pub const COLIBRI_EXPERT_FLAG_INT8_BLOCKS: u32 = 2;
pub const COLIBRI_ATTENTION_FLAG_INT8_BLOCKS: u32 = 2;
pub const COLIBRI_DTYPE_F32: u32 = 1;
pub const COLIBRI_DTYPE_F16: u32 = 2;
pub const COLIBRI_DTYPE_I8: u32 = 3;
pub const COLIBRI_DTYPE_I32: u32 = 4;
pub const COLIBRI_DTYPE_Q8_PARAMS: u32 = 5;
pub const COLIBRI_DTYPE_I4: u32 = 6;
pub const COLIBRI_DTYPE_Q4_PARAMS: u32 = 7;
pub const COLIBRI_OP_LINEAR: u32 = 1;
pub const COLIBRI_OP_ACTIVATION: u32 = 2;
pub const COLIBRI_OP_LAYERNORM: u32 = 3;
pub const COLIBRI_OP_RMSNORM: u32 = 4;
pub const COLIBRI_OP_RESIDUAL_PUSH: u32 = 5;
pub const COLIBRI_OP_RESIDUAL_ADD: u32 = 6;
pub const COLIBRI_OP_MOE: u32 = 7;
pub const COLIBRI_OP_EMBED: u32 = 8;
pub const COLIBRI_OP_ATTENTION: u32 = 9;
pub const COLIBRI_ACT_RELU: u32 = 1;
pub const COLIBRI_ACT_GELU_ERF: u32 = 2;
pub const COLIBRI_ACT_GELU_TANH: u32 = 3;
pub const COLIBRI_ACT_SILU: u32 = 4;
pub const COLIBRI_ACT_TANH: u32 = 5;
pub const COLIBRI_ACT_SIGMOID: u32 = 6;
pub const COLIBRI_ROUTING_TOP1: u32 = 1;
pub const COLIBRI_ROUTING_TOPK_SOFTMAX: u32 = 2;
pub const COLIBRI_ROUTING_SOFTMAX_TOPK: u32 = 3;
pub const COLIBRI_ROUTING_DENSE: u32 = 4;
pub const COLIBRI_MOE_FLAG_RENORMALIZE: u32 = 1;
pub const COLIBRI_EXPERT_MLP: u32 = 1;
pub const COLIBRI_EXPERT_GLU: u32 = 2;
// Format v6: the tokenizer section (docs/lm.md).
pub const COLIBRI_TOKENIZER_VERSION: u32 = 6;
pub const COLIBRI_TOKENIZER_MAGIC: u32 = 1263815747;
pub const COLIBRI_TOKENIZER_SECTION_VERSION: u32 = 2;
pub const COLIBRI_TOKENIZER_SECTION_VERSION_MIN: u32 = 1;
pub const COLIBRI_TOKENIZER_INDEX_VERSION: u32 = 2;
pub const COLIBRI_TOKENIZER_HEADER_SIZE: u32 = 80;
pub const COLIBRI_TOKENIZER_BYTE_IDS: u32 = 256;
pub const COLIBRI_DTYPE_TOKENIZER: u32 = 8;
pub const COLIBRI_TOKENIZER_BYTE_BPE: u32 = 1;
pub const COLIBRI_TOKENIZER_SENTENCEPIECE_BPE: u32 = 2;
pub const COLIBRI_TOKENIZER_SENTENCEPIECE_UNIGRAM: u32 = 3;
pub const COLIBRI_TOKENIZER_FLAG_ADD_DUMMY_PREFIX: u32 = 1;
pub const COLIBRI_TOKENIZER_FLAG_BYTE_FALLBACK: u32 = 2;
pub const COLIBRI_TOKENIZER_FLAG_REMOVE_EXTRA_WHITESPACES: u32 = 4;
pub const COLIBRI_TOKENIZER_FLAG_ADD_PREFIX_SPACE: u32 = 8;
pub const COLIBRI_TOKENIZER_FLAG_IGNORE_MERGES: u32 = 16;
pub const COLIBRI_TOKEN_NORMAL: u32 = 1;
pub const COLIBRI_TOKEN_BYTE: u32 = 2;
pub const COLIBRI_TOKEN_CONTROL: u32 = 3;
pub const COLIBRI_TOKEN_UNKNOWN: u32 = 4;
pub const COLIBRI_TOKEN_USER_DEFINED: u32 = 5;
pub const COLIBRI_TOKEN_UNUSED: u32 = 6;
pub const COLIBRI_NORMALIZER_NONE: u32 = 0;
pub const COLIBRI_NORMALIZER_NFC: u32 = 1;
pub const COLIBRI_PRE_TOKENIZER_NONE: u32 = 0;
pub const COLIBRI_PRE_TOKENIZER_BYTE_LEVEL: u32 = 1;
pub const COLIBRI_PRE_TOKENIZER_SPLIT_BYTE_LEVEL: u32 = 2;

// enum colibri_status
pub const COLIBRI_OK: colibri_status = 0;
pub const COLIBRI_E_NULL_ARG: colibri_status = -1;
pub const COLIBRI_E_TRUNCATED: colibri_status = -2;
pub const COLIBRI_E_BAD_MAGIC: colibri_status = -3;
pub const COLIBRI_E_BAD_VERSION: colibri_status = -4;
pub const COLIBRI_E_BAD_HEADER: colibri_status = -5;
pub const COLIBRI_E_BAD_CRC: colibri_status = -6;
pub const COLIBRI_E_TABLE_BOUNDS: colibri_status = -7;
pub const COLIBRI_E_TENSOR_BOUNDS: colibri_status = -8;
pub const COLIBRI_E_BAD_TENSOR: colibri_status = -9;
pub const COLIBRI_E_BAD_REF: colibri_status = -10;
pub const COLIBRI_E_BAD_LAYER: colibri_status = -11;
pub const COLIBRI_E_BAD_MOE: colibri_status = -12;
pub const COLIBRI_E_UNSUPPORTED: colibri_status = -13;
pub const COLIBRI_E_ARENA_TOO_SMALL: colibri_status = -14;
pub const COLIBRI_E_ARENA_ALIGN: colibri_status = -15;
pub const COLIBRI_E_IMAGE_ALIGN: colibri_status = -16;
pub const COLIBRI_E_BAD_BATCH: colibri_status = -17;
pub const COLIBRI_E_BUFFER_SIZE: colibri_status = -18;
pub const COLIBRI_E_BAD_CONTEXT: colibri_status = -19;
pub const COLIBRI_E_BAD_QUANT: colibri_status = -20;
pub const COLIBRI_E_BAD_COMPENSATION: colibri_status = -21;
pub const COLIBRI_E_UNSUPPORTED_VERSION: colibri_status = -22;
pub const COLIBRI_E_BAD_EXEC: colibri_status = -23;
pub const COLIBRI_E_BAD_PAYLOAD_CRC: colibri_status = -24;
pub const COLIBRI_E_FILE_NOT_FOUND: colibri_status = -25;
pub const COLIBRI_E_FILE_OPEN: colibri_status = -26;
pub const COLIBRI_E_MMAP_FAILED: colibri_status = -27;
pub const COLIBRI_E_MLOCK_FAILED: colibri_status = -28;
pub const COLIBRI_E_FILE_CHANGED: colibri_status = -29;
pub const COLIBRI_E_NO_SUCH_EXPERT: colibri_status = -30;
pub const COLIBRI_E_BAD_ATTENTION: colibri_status = -31;
pub const COLIBRI_E_CACHE_FULL: colibri_status = -32;
pub const COLIBRI_E_BAD_TOKEN: colibri_status = -33;
pub const COLIBRI_E_MODEL_KIND: colibri_status = -34;
pub const COLIBRI_E_BAD_SAMPLER: colibri_status = -35;
pub const COLIBRI_E_NAN_LOGITS: colibri_status = -36;
pub const COLIBRI_E_IMAGE_TOO_LARGE: colibri_status = -37;
pub const COLIBRI_E_BAD_TOKENIZER: colibri_status = -38;
pub const COLIBRI_E_NO_TOKENIZER: colibri_status = -39;
pub const COLIBRI_E_BAD_TEXT: colibri_status = -40;
pub const COLIBRI_E_TEXT_NOT_NORMALIZED: colibri_status = -41;

// ---- colibri_tokenizer.h ----
pub const COLIBRI_TOKENIZER_MAX_PIECE: u32 = 256;

/// The tokenizer section of an image, read in place (colibri_tokenizer.h).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct colibri_tokenizer {
    pub section: *const u8,
    pub size: u32,
    pub vocab: u32,
    pub kind: u32,
    pub flags: u32,
    pub max_piece: u32,
    pub bos: i32,
    pub eos: i32,
    pub pad: i32,
    pub unk: i32,
}

/// The streaming decoder's state: an incomplete UTF-8 sequence held back.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct colibri_text_stream {
    pub held: [u8; 4],
    pub held_len: u8,
    pub started: u8,
    pub reserved: [u8; 2],
}

/// COLIBRI_TOKENIZER_DECODE_BYTES: output bytes one decode call may give.
pub const fn colibri_tokenizer_decode_bytes(max_piece: usize) -> usize {
    3 * (max_piece + 4)
}
/// COLIBRI_TOKENIZER_ENCODE_MAX_IDS: ids `text_len` bytes encode to at most.
pub const fn colibri_tokenizer_encode_max_ids(text_len: usize) -> usize {
    3 * text_len + 3
}
/// COLIBRI_TOKENIZER_ENCODE_WORK_BYTES: the encoder's work bytes for `text_len` bytes.
pub const fn colibri_tokenizer_encode_work_bytes(text_len: usize) -> usize {
    16 * text_len + 64
}

// ---- colibri.h ----
pub const COLIBRI_VERSION_MAJOR: u32 = 0;
pub const COLIBRI_VERSION_MINOR: u32 = 1;
pub const COLIBRI_VERSION_PATCH: u32 = 0;
pub const COLIBRI_VERSION_STRING: &str = "0.1.0";
pub const COLIBRI_ARENA_ALIGN: u32 = 8;
pub const COLIBRI_CHECK_FULL: u32 = 0;
pub const COLIBRI_CHECK_STRUCTURE: u32 = 1;
pub const COLIBRI_EXPERT_DECLINED: colibri_status = 1;
pub const COLIBRI_EXEC_SIZE_V1: u32 = core::mem::size_of::<colibri_exec>() as u32;

/// The engine's context: opaque, it lives inside the caller's arena.
#[repr(C)]
pub struct colibri_ctx {
    _opaque: [u8; 0],
    // Not Send/Sync/Unpin: the engine owns its layout and a context is single-threaded.
    _marker: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct colibri_model_info {
    pub format_version: u32,
    pub image_size: u32,
    pub flags: u32,
    pub input_size: u32,
    pub output_size: u32,
    pub max_batch: u32,
    pub num_layers: u32,
    pub num_tensors: u32,
    pub num_moe_layers: u32,
    pub num_experts: u32,
    pub num_shared_experts: u32,
    pub num_parameters: u64,
    pub arena_size: usize,
    pub vocab_size: u32,
    pub max_seq_len: u32,
    pub kv_cache_bytes: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct colibri_route {
    pub layer: u32,
    pub first_expert: u32,
    pub experts: u32,
    pub shared: u32,
    pub batch: usize,
    pub tokens: *const u32,
    pub token: *const u16,
    pub gate: *const f32,
}

pub type colibri_on_route_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, route: *const colibri_route) -> colibri_status>;
pub type colibri_task_fn = Option<unsafe extern "C" fn(arg: *mut c_void, task: usize, worker: usize)>;
pub type colibri_parallel_for_fn = Option<
    unsafe extern "C" fn(user: *mut c_void, f: colibri_task_fn, arg: *mut c_void, n_tasks: usize) -> colibri_status,
>;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct colibri_expert_call {
    pub struct_size: u32,
    pub layer: u32,
    pub expert: u32,
    pub d: u32,
    pub hidden: u32,
    pub kind: u8,
    pub activation: u8,
    pub reserved: u16,
    pub worker: u32,
    pub w1: *const c_void,
    pub w2: *const c_void,
    pub w3: *const c_void,
    pub b1: *const f32,
    pub b2: *const f32,
    pub b3: *const f32,
    pub n: usize,
    pub x: *const f32,
    pub x_rows: *const u16,
    pub gate: *const f32,
    pub y: *mut f32,
    pub y_rows: *const u16,
}

pub type colibri_expert_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, call: *const colibri_expert_call) -> colibri_status>;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct colibri_exec {
    pub struct_size: u32,
    pub workers: u32,
    pub on_route: colibri_on_route_fn,
    pub on_route_user: *mut c_void,
    pub parallel_for: colibri_parallel_for_fn,
    pub parallel_for_user: *mut c_void,
    pub expert: colibri_expert_fn,
    pub expert_user: *mut c_void,
}

impl colibri_exec {
    /// `COLIBRI_EXEC_INIT`: no workers, no callbacks (exactly `colibri_forward`).
    pub const INIT: colibri_exec = colibri_exec {
        struct_size: core::mem::size_of::<colibri_exec>() as u32,
        workers: 0,
        on_route: None,
        on_route_user: core::ptr::null_mut(),
        parallel_for: None,
        parallel_for_user: core::ptr::null_mut(),
        expert: None,
        expert_user: core::ptr::null_mut(),
    };
}

/// `enum colibri_kernel_set`: no negative value, so gcc and clang give it `unsigned int`.
pub type colibri_kernel_set = u32;
pub const COLIBRI_KERNELS_OPTIMISED: colibri_kernel_set = 0;
pub const COLIBRI_KERNELS_REFERENCE: colibri_kernel_set = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct colibri_rng {
    pub state: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct colibri_sampler {
    pub struct_size: u32,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
}

extern "C" {
    pub fn colibri_validate(image: *const c_void, image_len: usize) -> colibri_status;
    pub fn colibri_validate_ex(image: *const c_void, image_len: usize, level: u32) -> colibri_status;
    pub fn colibri_model_size(image: *const c_void, image_len: usize, arena_size: *mut usize) -> colibri_status;
    pub fn colibri_init(
        ctx: *mut *mut colibri_ctx,
        arena: *mut c_void,
        arena_size: usize,
        image: *const c_void,
        image_len: usize,
    ) -> colibri_status;
    pub fn colibri_init_ex(
        ctx: *mut *mut colibri_ctx,
        arena: *mut c_void,
        arena_size: usize,
        image: *const c_void,
        image_len: usize,
        level: u32,
    ) -> colibri_status;
    pub fn colibri_forward(
        ctx: *mut colibri_ctx,
        batch: usize,
        input: *const f32,
        input_count: usize,
        output: *mut f32,
        output_count: usize,
    ) -> colibri_status;
    pub fn colibri_model_size_ex(
        image: *const c_void,
        image_len: usize,
        workers: usize,
        arena_size: *mut usize,
    ) -> colibri_status;
    pub fn colibri_forward_ex(
        ctx: *mut colibri_ctx,
        exec: *const colibri_exec,
        batch: usize,
        input: *const f32,
        input_count: usize,
        output: *mut f32,
        output_count: usize,
    ) -> colibri_status;
    pub fn colibri_set_kernels(ctx: *mut colibri_ctx, set: colibri_kernel_set) -> colibri_status;
    pub fn colibri_kernels_name(ctx: *const colibri_ctx) -> *const c_char;
    pub fn colibri_free(ctx: *mut colibri_ctx) -> colibri_status;
    pub fn colibri_lm_reset(ctx: *mut colibri_ctx) -> colibri_status;
    pub fn colibri_lm_position(ctx: *const colibri_ctx, position: *mut u32) -> colibri_status;
    pub fn colibri_lm_forward(
        ctx: *mut colibri_ctx,
        tokens: *const i32,
        n: u32,
        logits: *mut f32,
        logits_len: usize,
    ) -> colibri_status;
    pub fn colibri_lm_forward_ex(
        ctx: *mut colibri_ctx,
        exec: *const colibri_exec,
        tokens: *const i32,
        n: u32,
        logits: *mut f32,
        logits_len: usize,
    ) -> colibri_status;
    pub fn colibri_rng_seed(rng: *mut colibri_rng, seed: u64);
    pub fn colibri_lm_sample(
        ctx: *mut colibri_ctx,
        sampler: *const colibri_sampler,
        logits: *const f32,
        logits_len: usize,
        rng: *mut colibri_rng,
        token: *mut i32,
    ) -> colibri_status;
    pub fn colibri_get_num_experts(image: *const c_void, image_len: usize, num_experts: *mut u32) -> colibri_status;
    pub fn colibri_get_info(image: *const c_void, image_len: usize, info: *mut colibri_model_info) -> colibri_status;
    pub fn colibri_strerror(status: c_int) -> *const c_char;
    pub fn colibri_version() -> *const c_char;

    // ---- colibri_tokenizer.h ----
    pub fn colibri_tokenizer_open(tok: *mut colibri_tokenizer, image: *const c_void, image_len: usize) -> colibri_status;
    pub fn colibri_tokenizer_piece(
        tok: *const colibri_tokenizer,
        id: i32,
        bytes: *mut *const u8,
        len: *mut usize,
    ) -> colibri_status;
    pub fn colibri_text_stream_init(s: *mut colibri_text_stream);
    pub fn colibri_tokenizer_decode(
        tok: *const colibri_tokenizer,
        s: *mut colibri_text_stream,
        id: i32,
        out: *mut u8,
        out_cap: usize,
        out_len: *mut usize,
    ) -> colibri_status;
    pub fn colibri_tokenizer_flush(s: *mut colibri_text_stream, out: *mut u8, out_cap: usize, out_len: *mut usize)
        -> colibri_status;
    pub fn colibri_tokenizer_encode(
        tok: *const colibri_tokenizer,
        text: *const u8,
        text_len: usize,
        ids: *mut i32,
        ids_cap: usize,
        n_ids: *mut usize,
        work: *mut c_void,
        work_bytes: usize,
    ) -> colibri_status;
}
