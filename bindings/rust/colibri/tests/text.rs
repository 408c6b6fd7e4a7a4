//! Text on the device through the crate (docs/lm.md "Encoding", "Decoding"): `Tokenizer::encode` gives
//! the host library's ids, `TextDecoder` the host's text of them, and a greedy `Model::lm_generate`
//! cut at the tokenizer's EOS decodes to `colibri.LM.generate_text`'s text, for the byte-level BPE and
//! SentencePiece tokenizers tests/bindings/test_bindings_rust.py trains (text.txt).

mod common;

use colibri::{encode_max_ids, encode_work_bytes, Model, Rng, Sampler, Status, Tokenizer};
use common::{aligned_image, bytes, fixtures};
use std::fs;

fn hex(s: &str) -> Vec<u8> {
    if s == "-" {
        return Vec::new();
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn decode(tok: &Tokenizer<'_>, ids: &[i32]) -> String {
    let mut out = vec![0u8; tok.decode_bytes()];
    let mut decoder = tok.decoder();
    let mut text = String::new();
    for &id in ids {
        text += decoder.push(id, &mut out).unwrap();
    }
    text += decoder.flush(&mut out).unwrap();
    text
}

struct Case {
    prompt: Vec<u8>,
    ids: Vec<i32>,
    decoded: Vec<u8>,
    generated: Vec<u8>,
}

fn cases() -> Vec<(String, usize, i32, Vec<Case>)> {
    let text = fs::read_to_string(fixtures().join("text.txt")).unwrap();
    let mut out: Vec<(String, usize, i32, Vec<Case>)> = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f[0] {
            "text" => out.push((f[1].to_string(), f[2].parse().unwrap(), f[3].parse().unwrap(), Vec::new())),
            "case" => out.last_mut().unwrap().3.push(Case {
                prompt: hex(f[2]),
                ids: f[3].split(',').filter(|v| !v.is_empty()).map(|v| v.parse().unwrap()).collect(),
                decoded: hex(f[4]),
                generated: hex(f[5]),
            }),
            other => panic!("text.txt: unknown line {other}"),
        }
    }
    assert_eq!(out.len(), 3);
    out
}

#[test]
fn encode_and_decode_equal_the_host() {
    for (name, _, eos, cases) in cases() {
        let raw = fs::read(fixtures().join(format!("{name}.bin"))).unwrap();
        let words = aligned_image(&raw);
        let tok = Tokenizer::open(bytes(&words, raw.len())).unwrap();
        assert_eq!(tok.eos(), Some(eos), "{name}");
        for case in &cases {
            let mut ids = vec![0i32; encode_max_ids(case.prompt.len())];
            let mut work = vec![0u8; encode_work_bytes(case.prompt.len())];
            let n = tok.encode(&case.prompt, &mut ids, &mut work).unwrap();
            assert_eq!(&ids[..n], &case.ids[..], "{name}: {:?}", String::from_utf8_lossy(&case.prompt));
            assert_eq!(decode(&tok, &case.ids).as_bytes(), &case.decoded[..], "{name}");
            // one id short: BufferSize with the count; a work buffer short: ArenaTooSmall
            assert_eq!(tok.encode(&case.prompt, &mut ids[..n - 1], &mut work), Err((Status::BufferSize, n)));
            let short = work.len() - 1;
            assert_eq!(tok.encode(&case.prompt, &mut ids, &mut work[..short]).map_err(|e| e.0),
                       Err(Status::ArenaTooSmall));
        }
        let mut ids = [0i32; 8];
        let mut work = [0u8; 256];
        assert_eq!(tok.encode(b"ok\xff", &mut ids, &mut work).map_err(|e| e.0), Err(Status::BadText));
    }
}

#[test]
fn generated_text_equals_the_host() {
    for (name, new, eos, cases) in cases() {
        let raw = fs::read(fixtures().join(format!("{name}.bin"))).unwrap();
        let words = aligned_image(&raw);
        let image = bytes(&words, raw.len());
        let tok = Tokenizer::open(image).unwrap();
        let mut arena = vec![0u64; Model::arena_size(image).unwrap().div_ceil(8)];
        // SAFETY: u64 to bytes, the arena 8-byte aligned.
        let arena = unsafe { std::slice::from_raw_parts_mut(arena.as_mut_ptr().cast::<u8>(), arena.len() * 8) };
        let mut model = Model::new(image, arena).unwrap();
        model.use_reference_kernels(true).unwrap();
        let vocab = model.model_info().vocab_size as usize;
        let mut logits = vec![0f32; vocab * model.model_info().max_batch as usize];
        for case in &cases {
            let mut out = vec![0i32; new];
            model.lm_generate(&case.ids, &Sampler::GREEDY, &mut Rng::new(0), &mut logits, &mut out).unwrap();
            let end = out.iter().position(|&t| t == eos).map_or(out.len(), |i| i + 1);
            assert_eq!(decode(&tok, &out[..end]).as_bytes(), &case.generated[..], "{name}");
        }
    }
}

#[test]
fn an_image_without_a_tokenizer_has_none() {
    let raw = fs::read(fixtures().join("lm-greedy.bin")).unwrap();
    let words = aligned_image(&raw);
    assert_eq!(Tokenizer::open(bytes(&words, raw.len())).err(), Some(Status::NoTokenizer));
}
