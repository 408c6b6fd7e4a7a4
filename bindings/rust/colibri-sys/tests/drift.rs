//! Holds the hand-written declarations of colibri-sys to colibri.h and
//! colibri_format.h. The header is the source of truth: this test reads it,
//! compiles a C program against it (with the C compiler the build used), and
//! fails on any difference in
//!   - sizes and field offsets of every struct, and the named enum types,
//!   - the value of every numeric #define and every enumerator,
//!   - the set of COLIBRI_API functions, and each one's signature: the Rust
//!     declaration is translated to a C function type and the C compiler
//!     checks it is compatible with the header's prototype (likewise the
//!     callback typedefs).
use colibri_sys as sys;
use std::collections::BTreeSet;
use std::fs;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

const INCLUDE: &str = env!("COLIBRI_INCLUDE_DIR");
const CC: &str = env!("COLIBRI_BUILD_CC");

fn header_text() -> String {
    let mut all = String::new();
    for name in ["colibri_format.h", "colibri.h", "colibri_tokenizer.h"] {
        all += &fs::read_to_string(Path::new(INCLUDE).join(name)).unwrap();
        all.push('\n');
    }
    strip_comments(&all)
}

fn strip_comments(src: &str) -> String {
    let mut out = String::new();
    let mut rest = src;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out += &rest[..b];
                let end = rest[b..].find("*/").expect("unterminated comment") + b + 2;
                rest = &rest[end..];
            }
            (_, Some(l)) => {
                out += &rest[..l];
                rest = &rest[l..];
                rest = &rest[rest.find('\n').unwrap_or(rest.len())..];
            }
            _ => {
                out += rest;
                return out;
            }
        }
    }
}

fn flat(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn ident_before(s: &str) -> &str {
    let s = s.trim_end();
    let start = s.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
    &s[start..]
}

/// Numeric object-like macros: name only (the C program prints their values).
fn header_defines(text: &str) -> Vec<String> {
    // Not values: include guards, the attribute, the initializer, the X-macro, the string.
    let skip = ["COLIBRI_H", "COLIBRI_FORMAT_H", "COLIBRI_TOKENIZER_H", "COLIBRI_API", "COLIBRI_EXEC_INIT",
                "COLIBRI_VERSION_STRING"];
    let mut names = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.trim().strip_prefix("#define ") else { continue };
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let function_like = rest[name.len()..].starts_with('(');
        // The Split patterns are strings the C encoder compares against; the crate encodes through it.
        let pattern = name.starts_with("COLIBRI_SPLIT_PATTERN_");
        if name.starts_with("COLIBRI_") && !function_like && !pattern && !skip.contains(&name.as_str())
            && !names.contains(&name)
        {
            names.push(name);
        }
    }
    names
}

/// `typedef KIND NAME { body } NAME;` bodies.
fn typedef_bodies(text: &str, kind: &str) -> Vec<(String, String)> {
    let text = flat(text);
    let key = format!("typedef {kind} ");
    let mut found = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find(&key) {
        rest = &rest[i + key.len()..];
        let Some(open) = rest.find('{') else { break };
        if rest[..open].contains(';') {
            continue; // an opaque forward typedef (colibri_ctx)
        }
        let close = rest.find('}').unwrap();
        let name = rest[close + 1..].split(';').next().unwrap().trim().to_string();
        found.push((name, rest[open + 1..close].to_string()));
        rest = &rest[close..];
    }
    found
}

fn struct_fields(body: &str) -> Vec<String> {
    let mut fields = Vec::new();
    for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        for piece in decl.split(',') {
            // an array field's name comes before its bounds: `uint8_t held[4]`
            fields.push(ident_before(piece.split('[').next().unwrap()).to_string());
        }
    }
    fields
}

fn enumerators(text: &str) -> Vec<String> {
    typedef_bodies(text, "enum")
        .iter()
        .flat_map(|(_, body)| body.split(',').map(|e| e.split('=').next().unwrap().trim().to_string()))
        .filter(|e| !e.is_empty())
        .collect()
}

fn compile_and_run(name: &str, source: &str, run: bool) -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let c = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    fs::write(&c, source).unwrap();
    let mut cmd = Command::new(CC);
    cmd.args(["-std=gnu11", "-Wall", "-Werror", "-I", INCLUDE]).arg(&c);
    if run {
        cmd.arg("-o").arg(&exe);
    } else {
        cmd.arg("-fsyntax-only");
    }
    let out = cmd.output().unwrap_or_else(|e| panic!("could not run {CC}: {e}"));
    assert!(
        out.status.success(),
        "{CC} rejected {}:\n{}",
        c.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    if !run {
        return String::new();
    }
    let out = Command::new(&exe).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

macro_rules! layout {
    ($set:ident, $($ty:ident { $($field:ident),* })*) => {
        $(
            $set.insert(format!("size {} {}", stringify!($ty), size_of::<sys::$ty>()));
            $( $set.insert(format!("offset {}.{} {}", stringify!($ty), stringify!($field),
                                   offset_of!(sys::$ty, $field))); )*
        )*
    };
}

fn rust_facts() -> BTreeSet<String> {
    let mut facts = BTreeSet::new();
    layout!(facts,
        colibri_model_info { format_version, image_size, flags, input_size, output_size, max_batch, num_layers,
                             num_tensors, num_moe_layers, num_experts, num_shared_experts, num_parameters,
                             arena_size, vocab_size, max_seq_len, kv_cache_bytes }
        colibri_route { layer, first_expert, experts, shared, batch, tokens, token, gate }
        colibri_expert_call { struct_size, layer, expert, d, hidden, kind, activation, reserved, worker,
                              w1, w2, w3, b1, b2, b3, n, x, x_rows, gate, y, y_rows }
        colibri_exec { struct_size, workers, on_route, on_route_user, parallel_for, parallel_for_user,
                       expert, expert_user }
        colibri_rng { state }
        colibri_sampler { struct_size, temperature, top_k, top_p }
        colibri_tokenizer { section, size, vocab, kind, flags, max_piece, bos, eos, pad, unk }
        colibri_text_stream { held, held_len, started, reserved }
    );
    for (ty, size) in [("colibri_status", size_of::<sys::colibri_status>()),
                       ("colibri_kernel_set", size_of::<sys::colibri_kernel_set>())] {
        facts.insert(format!("size {ty} {size}"));
    }
    let values: &[(&str, i64)] = &[
        ("COLIBRI_MAGIC", sys::COLIBRI_MAGIC as i64),
        ("COLIBRI_FORMAT_VERSION", sys::COLIBRI_FORMAT_VERSION as i64),
        ("COLIBRI_FORMAT_VERSION_MIN", sys::COLIBRI_FORMAT_VERSION_MIN as i64),
        ("COLIBRI_FORMAT_VERSION_MAX", sys::COLIBRI_FORMAT_VERSION_MAX as i64),
        ("COLIBRI_NONE", sys::COLIBRI_NONE as i64),
        ("COLIBRI_PAYLOAD_ALIGN", sys::COLIBRI_PAYLOAD_ALIGN as i64),
        ("COLIBRI_PAGE_SIZE", sys::COLIBRI_PAGE_SIZE as i64),
        ("COLIBRI_MAX_BATCH_LIMIT", sys::COLIBRI_MAX_BATCH_LIMIT as i64),
        ("COLIBRI_MAX_ROUTES", sys::COLIBRI_MAX_ROUTES as i64),
        ("COLIBRI_MAX_SHARED", sys::COLIBRI_MAX_SHARED as i64),
        ("COLIBRI_MAX_RESIDUAL_DEPTH", sys::COLIBRI_MAX_RESIDUAL_DEPTH as i64),
        ("COLIBRI_HEADER_CRC_OFFSET", sys::COLIBRI_HEADER_CRC_OFFSET as i64),
        ("COLIBRI_CRC_START", sys::COLIBRI_CRC_START as i64),
        ("COLIBRI_TENSOR_CRC_VERSION", sys::COLIBRI_TENSOR_CRC_VERSION as i64),
        ("COLIBRI_LM_VERSION", sys::COLIBRI_LM_VERSION as i64),
        ("COLIBRI_Q8_PARAMS_HEADER", sys::COLIBRI_Q8_PARAMS_HEADER as i64),
        ("COLIBRI_Q8_FLAG_BIAS", sys::COLIBRI_Q8_FLAG_BIAS as i64),
        ("COLIBRI_Q4_VERSION", sys::COLIBRI_Q4_VERSION as i64),
        ("COLIBRI_Q4_PARAMS_HEADER", sys::COLIBRI_Q4_PARAMS_HEADER as i64),
        ("COLIBRI_Q4_FLAG_BIAS", sys::COLIBRI_Q4_FLAG_BIAS as i64),
        ("COLIBRI_Q4_GROUP_LOG2_MIN", sys::COLIBRI_Q4_GROUP_LOG2_MIN as i64),
        ("COLIBRI_Q4_GROUP_LOG2_MAX", sys::COLIBRI_Q4_GROUP_LOG2_MAX as i64),
        ("COLIBRI_MAX_SEQ_LEN", sys::COLIBRI_MAX_SEQ_LEN as i64),
        ("COLIBRI_WIDE_VERSION", sys::COLIBRI_WIDE_VERSION as i64),
        ("COLIBRI_WIDE_HEADER_SIZE", sys::COLIBRI_WIDE_HEADER_SIZE as i64),
        ("COLIBRI_WIDE_FIELDS_OFFSET", sys::COLIBRI_WIDE_FIELDS_OFFSET as i64),
        ("COLIBRI_NARROW_LIMIT", sys::COLIBRI_NARROW_LIMIT as i64),
        ("COLIBRI_MAX_TENSOR_ELEMENTS", sys::COLIBRI_MAX_TENSOR_ELEMENTS as i64),
        ("COLIBRI_HEADER_SIZE", sys::COLIBRI_HEADER_SIZE as i64),
        ("COLIBRI_TENSOR_SIZE", sys::COLIBRI_TENSOR_SIZE as i64),
        ("COLIBRI_TENSOR_WIDE_SIZE", sys::COLIBRI_TENSOR_WIDE_SIZE as i64),
        ("COLIBRI_LAYER_SIZE", sys::COLIBRI_LAYER_SIZE as i64),
        ("COLIBRI_MOE_SIZE", sys::COLIBRI_MOE_SIZE as i64),
        ("COLIBRI_EXPERT_SIZE", sys::COLIBRI_EXPERT_SIZE as i64),
        ("COLIBRI_ATTENTION_SIZE", sys::COLIBRI_ATTENTION_SIZE as i64),
        ("COLIBRI_ATTENTION_FLAGS_OFFSET", sys::COLIBRI_ATTENTION_FLAGS_OFFSET as i64),
        ("COLIBRI_ATTENTION_RESERVED", sys::COLIBRI_ATTENTION_RESERVED as i64),
        ("COLIBRI_FLAG_PAGE_ALIGNED", sys::COLIBRI_FLAG_PAGE_ALIGNED as i64),
        ("COLIBRI_LAYER_FLAG_INT8_ACT", sys::COLIBRI_LAYER_FLAG_INT8_ACT as i64),
        ("COLIBRI_EXPERT_FLAG_INT8_ACT", sys::COLIBRI_EXPERT_FLAG_INT8_ACT as i64),
        ("COLIBRI_LAYER_FLAG_INT8_BLOCKS", sys::COLIBRI_LAYER_FLAG_INT8_BLOCKS as i64),
        ("COLIBRI_EXPERT_FLAG_INT8_BLOCKS", sys::COLIBRI_EXPERT_FLAG_INT8_BLOCKS as i64),
        ("COLIBRI_ATTENTION_FLAG_INT8_BLOCKS", sys::COLIBRI_ATTENTION_FLAG_INT8_BLOCKS as i64),
        ("COLIBRI_DTYPE_F32", sys::COLIBRI_DTYPE_F32 as i64),
        ("COLIBRI_DTYPE_F16", sys::COLIBRI_DTYPE_F16 as i64),
        ("COLIBRI_DTYPE_I8", sys::COLIBRI_DTYPE_I8 as i64),
        ("COLIBRI_DTYPE_I32", sys::COLIBRI_DTYPE_I32 as i64),
        ("COLIBRI_DTYPE_Q8_PARAMS", sys::COLIBRI_DTYPE_Q8_PARAMS as i64),
        ("COLIBRI_DTYPE_I4", sys::COLIBRI_DTYPE_I4 as i64),
        ("COLIBRI_DTYPE_Q4_PARAMS", sys::COLIBRI_DTYPE_Q4_PARAMS as i64),
        ("COLIBRI_OP_LINEAR", sys::COLIBRI_OP_LINEAR as i64),
        ("COLIBRI_OP_ACTIVATION", sys::COLIBRI_OP_ACTIVATION as i64),
        ("COLIBRI_OP_LAYERNORM", sys::COLIBRI_OP_LAYERNORM as i64),
        ("COLIBRI_OP_RMSNORM", sys::COLIBRI_OP_RMSNORM as i64),
        ("COLIBRI_OP_RESIDUAL_PUSH", sys::COLIBRI_OP_RESIDUAL_PUSH as i64),
        ("COLIBRI_OP_RESIDUAL_ADD", sys::COLIBRI_OP_RESIDUAL_ADD as i64),
        ("COLIBRI_OP_MOE", sys::COLIBRI_OP_MOE as i64),
        ("COLIBRI_OP_EMBED", sys::COLIBRI_OP_EMBED as i64),
        ("COLIBRI_OP_ATTENTION", sys::COLIBRI_OP_ATTENTION as i64),
        ("COLIBRI_ACT_RELU", sys::COLIBRI_ACT_RELU as i64),
        ("COLIBRI_ACT_GELU_ERF", sys::COLIBRI_ACT_GELU_ERF as i64),
        ("COLIBRI_ACT_GELU_TANH", sys::COLIBRI_ACT_GELU_TANH as i64),
        ("COLIBRI_ACT_SILU", sys::COLIBRI_ACT_SILU as i64),
        ("COLIBRI_ACT_TANH", sys::COLIBRI_ACT_TANH as i64),
        ("COLIBRI_ACT_SIGMOID", sys::COLIBRI_ACT_SIGMOID as i64),
        ("COLIBRI_ROUTING_TOP1", sys::COLIBRI_ROUTING_TOP1 as i64),
        ("COLIBRI_ROUTING_TOPK_SOFTMAX", sys::COLIBRI_ROUTING_TOPK_SOFTMAX as i64),
        ("COLIBRI_ROUTING_SOFTMAX_TOPK", sys::COLIBRI_ROUTING_SOFTMAX_TOPK as i64),
        ("COLIBRI_ROUTING_DENSE", sys::COLIBRI_ROUTING_DENSE as i64),
        ("COLIBRI_MOE_FLAG_RENORMALIZE", sys::COLIBRI_MOE_FLAG_RENORMALIZE as i64),
        ("COLIBRI_EXPERT_MLP", sys::COLIBRI_EXPERT_MLP as i64),
        ("COLIBRI_EXPERT_GLU", sys::COLIBRI_EXPERT_GLU as i64),
        ("COLIBRI_TOKENIZER_VERSION", sys::COLIBRI_TOKENIZER_VERSION as i64),
        ("COLIBRI_TOKENIZER_MAGIC", sys::COLIBRI_TOKENIZER_MAGIC as i64),
        ("COLIBRI_TOKENIZER_SECTION_VERSION", sys::COLIBRI_TOKENIZER_SECTION_VERSION as i64),
        ("COLIBRI_TOKENIZER_SECTION_VERSION_MIN", sys::COLIBRI_TOKENIZER_SECTION_VERSION_MIN as i64),
        ("COLIBRI_TOKENIZER_INDEX_VERSION", sys::COLIBRI_TOKENIZER_INDEX_VERSION as i64),
        ("COLIBRI_TOKENIZER_MAX_PIECE", sys::COLIBRI_TOKENIZER_MAX_PIECE as i64),
        ("COLIBRI_TOKENIZER_HEADER_SIZE", sys::COLIBRI_TOKENIZER_HEADER_SIZE as i64),
        ("COLIBRI_TOKENIZER_BYTE_IDS", sys::COLIBRI_TOKENIZER_BYTE_IDS as i64),
        ("COLIBRI_DTYPE_TOKENIZER", sys::COLIBRI_DTYPE_TOKENIZER as i64),
        ("COLIBRI_TOKENIZER_BYTE_BPE", sys::COLIBRI_TOKENIZER_BYTE_BPE as i64),
        ("COLIBRI_TOKENIZER_SENTENCEPIECE_BPE", sys::COLIBRI_TOKENIZER_SENTENCEPIECE_BPE as i64),
        ("COLIBRI_TOKENIZER_SENTENCEPIECE_UNIGRAM", sys::COLIBRI_TOKENIZER_SENTENCEPIECE_UNIGRAM as i64),
        ("COLIBRI_TOKENIZER_FLAG_ADD_DUMMY_PREFIX", sys::COLIBRI_TOKENIZER_FLAG_ADD_DUMMY_PREFIX as i64),
        ("COLIBRI_TOKENIZER_FLAG_BYTE_FALLBACK", sys::COLIBRI_TOKENIZER_FLAG_BYTE_FALLBACK as i64),
        ("COLIBRI_TOKENIZER_FLAG_REMOVE_EXTRA_WHITESPACES", sys::COLIBRI_TOKENIZER_FLAG_REMOVE_EXTRA_WHITESPACES as i64),
        ("COLIBRI_TOKENIZER_FLAG_ADD_PREFIX_SPACE", sys::COLIBRI_TOKENIZER_FLAG_ADD_PREFIX_SPACE as i64),
        ("COLIBRI_TOKENIZER_FLAG_IGNORE_MERGES", sys::COLIBRI_TOKENIZER_FLAG_IGNORE_MERGES as i64),
        ("COLIBRI_TOKEN_NORMAL", sys::COLIBRI_TOKEN_NORMAL as i64),
        ("COLIBRI_TOKEN_BYTE", sys::COLIBRI_TOKEN_BYTE as i64),
        ("COLIBRI_TOKEN_CONTROL", sys::COLIBRI_TOKEN_CONTROL as i64),
        ("COLIBRI_TOKEN_UNKNOWN", sys::COLIBRI_TOKEN_UNKNOWN as i64),
        ("COLIBRI_TOKEN_USER_DEFINED", sys::COLIBRI_TOKEN_USER_DEFINED as i64),
        ("COLIBRI_TOKEN_UNUSED", sys::COLIBRI_TOKEN_UNUSED as i64),
        ("COLIBRI_NORMALIZER_NONE", sys::COLIBRI_NORMALIZER_NONE as i64),
        ("COLIBRI_NORMALIZER_NFC", sys::COLIBRI_NORMALIZER_NFC as i64),
        ("COLIBRI_PRE_TOKENIZER_NONE", sys::COLIBRI_PRE_TOKENIZER_NONE as i64),
        ("COLIBRI_PRE_TOKENIZER_BYTE_LEVEL", sys::COLIBRI_PRE_TOKENIZER_BYTE_LEVEL as i64),
        ("COLIBRI_PRE_TOKENIZER_SPLIT_BYTE_LEVEL", sys::COLIBRI_PRE_TOKENIZER_SPLIT_BYTE_LEVEL as i64),
        ("COLIBRI_VERSION_MAJOR", sys::COLIBRI_VERSION_MAJOR as i64),
        ("COLIBRI_VERSION_MINOR", sys::COLIBRI_VERSION_MINOR as i64),
        ("COLIBRI_VERSION_PATCH", sys::COLIBRI_VERSION_PATCH as i64),
        ("COLIBRI_ARENA_ALIGN", sys::COLIBRI_ARENA_ALIGN as i64),
        ("COLIBRI_CHECK_FULL", sys::COLIBRI_CHECK_FULL as i64),
        ("COLIBRI_CHECK_STRUCTURE", sys::COLIBRI_CHECK_STRUCTURE as i64),
        ("COLIBRI_EXPERT_DECLINED", sys::COLIBRI_EXPERT_DECLINED as i64),
        ("COLIBRI_EXEC_SIZE_V1", sys::COLIBRI_EXEC_SIZE_V1 as i64),
        ("COLIBRI_OK", sys::COLIBRI_OK as i64),
        ("COLIBRI_E_NULL_ARG", sys::COLIBRI_E_NULL_ARG as i64),
        ("COLIBRI_E_TRUNCATED", sys::COLIBRI_E_TRUNCATED as i64),
        ("COLIBRI_E_BAD_MAGIC", sys::COLIBRI_E_BAD_MAGIC as i64),
        ("COLIBRI_E_BAD_VERSION", sys::COLIBRI_E_BAD_VERSION as i64),
        ("COLIBRI_E_BAD_HEADER", sys::COLIBRI_E_BAD_HEADER as i64),
        ("COLIBRI_E_BAD_CRC", sys::COLIBRI_E_BAD_CRC as i64),
        ("COLIBRI_E_TABLE_BOUNDS", sys::COLIBRI_E_TABLE_BOUNDS as i64),
        ("COLIBRI_E_TENSOR_BOUNDS", sys::COLIBRI_E_TENSOR_BOUNDS as i64),
        ("COLIBRI_E_BAD_TENSOR", sys::COLIBRI_E_BAD_TENSOR as i64),
        ("COLIBRI_E_BAD_REF", sys::COLIBRI_E_BAD_REF as i64),
        ("COLIBRI_E_BAD_LAYER", sys::COLIBRI_E_BAD_LAYER as i64),
        ("COLIBRI_E_BAD_MOE", sys::COLIBRI_E_BAD_MOE as i64),
        ("COLIBRI_E_UNSUPPORTED", sys::COLIBRI_E_UNSUPPORTED as i64),
        ("COLIBRI_E_ARENA_TOO_SMALL", sys::COLIBRI_E_ARENA_TOO_SMALL as i64),
        ("COLIBRI_E_ARENA_ALIGN", sys::COLIBRI_E_ARENA_ALIGN as i64),
        ("COLIBRI_E_IMAGE_ALIGN", sys::COLIBRI_E_IMAGE_ALIGN as i64),
        ("COLIBRI_E_BAD_BATCH", sys::COLIBRI_E_BAD_BATCH as i64),
        ("COLIBRI_E_BUFFER_SIZE", sys::COLIBRI_E_BUFFER_SIZE as i64),
        ("COLIBRI_E_BAD_CONTEXT", sys::COLIBRI_E_BAD_CONTEXT as i64),
        ("COLIBRI_E_BAD_QUANT", sys::COLIBRI_E_BAD_QUANT as i64),
        ("COLIBRI_E_BAD_COMPENSATION", sys::COLIBRI_E_BAD_COMPENSATION as i64),
        ("COLIBRI_E_UNSUPPORTED_VERSION", sys::COLIBRI_E_UNSUPPORTED_VERSION as i64),
        ("COLIBRI_E_BAD_EXEC", sys::COLIBRI_E_BAD_EXEC as i64),
        ("COLIBRI_E_BAD_PAYLOAD_CRC", sys::COLIBRI_E_BAD_PAYLOAD_CRC as i64),
        ("COLIBRI_E_FILE_NOT_FOUND", sys::COLIBRI_E_FILE_NOT_FOUND as i64),
        ("COLIBRI_E_FILE_OPEN", sys::COLIBRI_E_FILE_OPEN as i64),
        ("COLIBRI_E_MMAP_FAILED", sys::COLIBRI_E_MMAP_FAILED as i64),
        ("COLIBRI_E_MLOCK_FAILED", sys::COLIBRI_E_MLOCK_FAILED as i64),
        ("COLIBRI_E_FILE_CHANGED", sys::COLIBRI_E_FILE_CHANGED as i64),
        ("COLIBRI_E_NO_SUCH_EXPERT", sys::COLIBRI_E_NO_SUCH_EXPERT as i64),
        ("COLIBRI_E_BAD_ATTENTION", sys::COLIBRI_E_BAD_ATTENTION as i64),
        ("COLIBRI_E_CACHE_FULL", sys::COLIBRI_E_CACHE_FULL as i64),
        ("COLIBRI_E_BAD_TOKEN", sys::COLIBRI_E_BAD_TOKEN as i64),
        ("COLIBRI_E_MODEL_KIND", sys::COLIBRI_E_MODEL_KIND as i64),
        ("COLIBRI_E_BAD_SAMPLER", sys::COLIBRI_E_BAD_SAMPLER as i64),
        ("COLIBRI_E_NAN_LOGITS", sys::COLIBRI_E_NAN_LOGITS as i64),
        ("COLIBRI_E_IMAGE_TOO_LARGE", sys::COLIBRI_E_IMAGE_TOO_LARGE as i64),
        ("COLIBRI_E_BAD_TOKENIZER", sys::COLIBRI_E_BAD_TOKENIZER as i64),
        ("COLIBRI_E_NO_TOKENIZER", sys::COLIBRI_E_NO_TOKENIZER as i64),
        ("COLIBRI_E_BAD_TEXT", sys::COLIBRI_E_BAD_TEXT as i64),
        ("COLIBRI_E_TEXT_NOT_NORMALIZED", sys::COLIBRI_E_TEXT_NOT_NORMALIZED as i64),
        ("COLIBRI_KERNELS_OPTIMISED", sys::COLIBRI_KERNELS_OPTIMISED as i64),
        ("COLIBRI_KERNELS_REFERENCE", sys::COLIBRI_KERNELS_REFERENCE as i64),
    ];
    for (name, value) in values {
        facts.insert(format!("value {name} {value}"));
    }
    facts.insert(format!("string COLIBRI_VERSION_STRING {}", sys::COLIBRI_VERSION_STRING));
    facts
}

#[test]
fn layouts_and_values_match_the_header() {
    let text = header_text();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"colibri.h\"\n#include \"colibri_tokenizer.h\"\nint main(void) {\n",
    );
    for (name, body) in typedef_bodies(&text, "struct") {
        c += &format!("    printf(\"size {name} %zu\\n\", sizeof({name}));\n");
        for field in struct_fields(&body) {
            c += &format!("    printf(\"offset {name}.{field} %zu\\n\", offsetof({name}, {field}));\n");
        }
    }
    for (name, _) in typedef_bodies(&text, "enum") {
        c += &format!("    printf(\"size {name} %zu\\n\", sizeof({name}));\n");
    }
    for name in header_defines(&text).iter().chain(enumerators(&text).iter()) {
        c += &format!("    printf(\"value {name} %lld\\n\", (long long)({name}));\n");
    }
    c += "    printf(\"string COLIBRI_VERSION_STRING %s\\n\", COLIBRI_VERSION_STRING);\n    return 0;\n}\n";
    let header: BTreeSet<String> = compile_and_run("colibri_layout", &c, true).lines().map(String::from).collect();
    let rust = rust_facts();
    let missing: Vec<_> = header.difference(&rust).collect();
    let extra: Vec<_> = rust.difference(&header).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "colibri-sys differs from colibri.h\n  header says (Rust lacks or disagrees): {missing:#?}\n  Rust says (header does not): {extra:#?}"
    );
    // Guard against a parser that silently found nothing.
    assert!(header.len() > 150, "only {} facts parsed from the header", header.len());
}

/// A Rust FFI type as the C type it must be.
fn c_type(rust: &str) -> String {
    let rust = rust.trim();
    if let Some(inner) = rust.strip_prefix("*const ") {
        let inner = c_type(inner);
        return if inner.ends_with('*') { format!("{inner} const *") } else { format!("const {inner} *") };
    }
    if let Some(inner) = rust.strip_prefix("*mut ") {
        return format!("{} *", c_type(inner));
    }
    match rust {
        "c_void" => "void",
        "c_char" => "char",
        "c_int" => "int",
        "usize" => "size_t",
        "u8" => "uint8_t",
        "u16" => "uint16_t",
        "u32" => "uint32_t",
        "u64" => "uint64_t",
        "i32" => "int32_t",
        "f32" => "float",
        other => {
            assert!(other.starts_with("colibri_"), "no C equivalent for the Rust type {other}");
            other
        }
    }
    .to_string()
}

/// `(args) -> ret` of a Rust declaration as a C function-pointer type.
fn c_fn_type(args: &str, ret: Option<&str>) -> String {
    let params: Vec<String> = args
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|a| c_type(a.split_once(':').expect("named parameter").1))
        .collect();
    let params = if params.is_empty() { "void".to_string() } else { params.join(", ") };
    format!("{} (*)({params})", ret.map_or("void".to_string(), c_type))
}

fn split_signature(rest: &str) -> (&str, Option<&str>, &str) {
    let close = rest.find(')').unwrap();
    let args = &rest[..close];
    let after = rest[close + 1..].trim_start();
    match after.strip_prefix("->") {
        Some(r) => {
            let end = r.find([';', '>']).unwrap();
            (args, Some(r[..end].trim().trim_end_matches(',').trim_end()), &r[end..])
        }
        None => (args, None, after),
    }
}

#[test]
fn every_function_matches_its_prototype() {
    // Declarations only: the preprocessor lines include COLIBRI_API's own #define.
    let text = header_text();
    let declarations: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
    let header = flat(&declarations.join("\n"));
    let header_fns: BTreeSet<String> = header
        .split("COLIBRI_API ")
        .skip(1)
        .filter_map(|after| after.find('(').map(|p| ident_before(&after[..p]).to_string()))
        .collect();

    let rust = flat(&fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs")).unwrap()).replace("< ", "<");
    let mut checks = String::from("#include \"colibri.h\"\n#include \"colibri_tokenizer.h\"\n");
    let mut rust_fns = BTreeSet::new();
    for decl in rust.split("pub fn ").skip(1) {
        let name = &decl[..decl.find('(').unwrap()];
        let (args, ret, _) = split_signature(&decl[name.len() + 1..]);
        rust_fns.insert(name.to_string());
        checks += &format!(
            "_Static_assert(__builtin_types_compatible_p(__typeof__(&{name}), {}), \"{name}: the Rust declaration differs from colibri.h\");\n",
            c_fn_type(args, ret)
        );
    }
    let mut callbacks = 0;
    for def in rust.split("pub type ").skip(1) {
        let name = ident_before(&def[..def.find('=').unwrap()]).to_string();
        let value = def[def.find('=').unwrap() + 1..].trim_start();
        let ty = match value.strip_prefix("Option<unsafe extern \"C\" fn(") {
            Some(rest) => {
                callbacks += 1;
                let (args, ret, _) = split_signature(rest);
                c_fn_type(args, ret)
            }
            None => c_type(value.split(';').next().unwrap()),
        };
        checks += &format!(
            "_Static_assert(__builtin_types_compatible_p({name}, {ty}), \"{name}: the Rust type differs from colibri.h\");\n"
        );
    }
    assert_eq!(header_fns, rust_fns, "COLIBRI_API functions of colibri.h vs the extern block of colibri-sys");
    assert!(header_fns.len() >= 20 && callbacks == 4, "parsed {} functions, {callbacks} callbacks", header_fns.len());
    compile_and_run("colibri_signatures", &checks, false);
}
