//! The safe crate against the Python engine's outputs on exported models.
//!
//! The models and expected outputs come from tests/bindings/test_bindings_rust.py, which
//! exports them, runs them through the Python binding and then runs
//! `cargo test --offline` with COLIBRI_RUST_FIXTURES naming the directory.
//! Its cases.txt lists one case a line:
//!   feature NAME BATCH       NAME.bin, NAME.in.f32, NAME.ref.f32 (reference kernels), NAME.opt.f32
//!   lm NAME TEMP TOP_K TOP_P SEED NEW
//!                            NAME.bin, NAME.prompt.i32, NAME.logits.f32 (prefill), NAME.gen.i32
use colibri::{Arena, Model, Rng, Sampler, Status};
use std::fs;

mod common;
use common::*;

fn first_feature_model() -> (Vec<u32>, usize) {
    image(&cases("feature")[0][1])
}

#[test]
fn feature_models_match_the_python_engine() {
    for case in cases("feature") {
        let (name, batch): (&str, usize) = (&case[1], case[2].parse().unwrap());
        let (words, len) = image(name);
        let image = bytes(&words, len);
        let info = Model::info(image).unwrap();
        let need = Model::arena_size(image).unwrap();
        assert_eq!(need, info.arena_size);
        let mut a = arena(need);
        let mut model = Model::new(image, arena_bytes(&mut a, need)).unwrap();
        let input = f32s(fixtures().join(format!("{name}.in.f32")));
        let mut out = vec![f32::NAN; batch * info.output_size as usize];

        model.use_reference_kernels(true).unwrap();
        assert_eq!(model.kernels_name(), "reference");
        model.forward(&input, &mut out, batch).unwrap();
        // The reference kernels are the specification: the same bits as Python's.
        let want = f32s(fixtures().join(format!("{name}.ref.f32")));
        assert_eq!(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                   want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{name}: reference kernels");

        model.use_reference_kernels(false).unwrap();
        model.forward(&input, &mut out, batch).unwrap();
        let want = f32s(fixtures().join(format!("{name}.opt.f32")));
        assert_eq!(out.len(), want.len(), "{name}: optimised output length");
        let scale = 1.0 + want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let worst = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        // Both sides run this build's optimised kernels; the tolerance covers a
        // Python extension compiled with other flags (docs/model-format.md "Numerics").
        assert!(worst <= 1e-5 * scale, "{name}: optimised kernels differ by {worst}");
    }
}

#[test]
fn bad_images_give_their_status() {
    let (words, len) = first_feature_model();
    let good = bytes(&words, len);
    assert_eq!(Model::arena_size(&good[..10]), Err(Status::Truncated));
    let mut bad = words.clone();
    as_bytes_mut(&mut bad)[0] ^= 0xFF;
    assert_eq!(colibri::validate(bytes(&bad, len)), Err(Status::BadMagic));
    let mut bad = words.clone();
    as_bytes_mut(&mut bad)[len - 1] ^= 0x01;
    let corrupt = bytes(&bad, len);
    assert!(matches!(colibri::validate(corrupt), Err(Status::BadCrc | Status::BadPayloadCrc)));
    let need = Model::arena_size(good).unwrap();
    let mut a = arena(need);
    assert!(matches!(Model::new(corrupt, arena_bytes(&mut a, need)).err(),
                     Some(Status::BadCrc | Status::BadPayloadCrc)));
    assert_eq!(colibri::validate(good), Ok(()));

    // colibri_init needs a 4-byte aligned image.
    let mut shifted = vec![0u32; words.len() + 1];
    as_bytes_mut(&mut shifted)[1..1 + len].copy_from_slice(good);
    let unaligned = &bytes(&shifted, len + 1)[1..];
    assert_eq!(Model::new(unaligned, arena_bytes(&mut a, need)).err(), Some(Status::ImageAlign));
}

#[test]
fn arena_errors_give_their_status() {
    let (words, len) = first_feature_model();
    let image = bytes(&words, len);
    let need = Model::arena_size(image).unwrap();
    let mut a = arena(need + 8);
    assert_eq!(Model::new(image, &mut arena_bytes(&mut a, need)[..need - 1]).err(), Some(Status::ArenaTooSmall));
    assert_eq!(Model::new(image, &mut arena_bytes(&mut a, need + 8)[1..need + 1]).err(), Some(Status::ArenaAlign));
    // The arena is free again once the model is dropped.
    for _ in 0..2 {
        assert!(Model::new(image, arena_bytes(&mut a, need)).is_ok());
    }
}

#[test]
fn buffer_and_batch_errors_give_their_status() {
    let (words, len) = first_feature_model();
    let image = bytes(&words, len);
    let info = Model::info(image).unwrap();
    let (d_in, d_out) = (info.input_size as usize, info.output_size as usize);
    let need = Model::arena_size(image).unwrap();
    let mut a = arena(need);
    let mut model = Model::new(image, arena_bytes(&mut a, need)).unwrap();
    let input = vec![0.5f32; d_in * 2];
    let mut out = vec![0f32; d_out * 2];
    assert_eq!(model.forward(&input[..d_in], &mut out[..d_out], 1), Ok(()));
    assert_eq!(model.forward(&input[..d_in + 1], &mut out[..d_out], 1), Err(Status::BufferSize));
    assert_eq!(model.forward(&input[..d_in], &mut out[..d_out - 1], 1), Err(Status::BufferSize));
    assert_eq!(model.forward(&input[..0], &mut out[..0], 0), Err(Status::BadBatch));
    let big = info.max_batch as usize + 1;
    assert_eq!(model.forward(&vec![0.0; big * d_in], &mut vec![0.0; big * d_out], big), Err(Status::BadBatch));
    // A feature model has no token calls.
    assert_eq!(model.lm_reset(), Err(Status::ModelKind));
}

#[test]
fn status_display_is_the_engine_text() {
    assert_eq!(Status::ArenaTooSmall.to_string(), "arena too small for this model (see colibri_model_size)");
    for status in Status::ALL {
        assert_eq!(Status::from_code(status.code()), Some(status));
        assert!(!status.to_string().is_empty() && status.to_string() != "unknown status", "{status:?}");
    }
    assert_eq!(colibri::check(sys_ok()), Ok(()));
    assert_eq!(colibri::version(), colibri::sys::COLIBRI_VERSION_STRING);
}

fn sys_ok() -> i32 {
    colibri::sys::COLIBRI_OK
}

/// Every colibri_status of the header is a Status variant with the same value,
/// named after it (COLIBRI_E_ARENA_TOO_SMALL: ArenaTooSmall).
#[test]
fn status_enum_covers_the_header() {
    let header = fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"),
                                            "/../../../firmware/colibri_core/include/colibri_format.h")).unwrap();
    let mut from_header = Vec::new();
    for line in header.lines() {
        let Some(rest) = line.trim().strip_prefix("COLIBRI_E_") else { continue };
        let (name, value) = rest.split_once(" = ").unwrap();
        let value: i32 = value.split(',').next().unwrap().parse().unwrap();
        let camel: String = name.split('_').map(|w| w[..1].to_string() + &w[1..].to_lowercase()).collect();
        from_header.push((camel, value));
    }
    let ours: Vec<(String, i32)> = Status::ALL.iter().map(|s| (format!("{s:?}"), s.code())).collect();
    assert_eq!(ours, from_header);
}

#[test]
fn static_arena_works_without_the_heap() {
    let (words, len) = first_feature_model();
    let image = bytes(&words, len);
    let need = Model::arena_size(image).unwrap();
    // As on a microcontroller: a static arena, no heap. Only this test touches it.
    static mut ARENA: Arena<{ 4 << 20 }> = Arena::new();
    let arena = unsafe { &mut *std::ptr::addr_of_mut!(ARENA) };
    assert!(need <= 4 << 20, "first model needs {need} bytes");
    let mut model = Model::new(image, arena.as_mut_slice()).unwrap();
    let info = Model::info(image).unwrap();
    let input = vec![0.25f32; info.input_size as usize];
    let mut out = vec![f32::NAN; info.output_size as usize];
    model.forward(&input, &mut out, 1).unwrap();
    assert!(out.iter().all(|v| v.is_finite()));
}

#[test]
fn language_models_match_the_python_engine() {
    for case in cases("lm") {
        let name = case[1].as_str();
        let sampler = Sampler { temperature: case[2].parse().unwrap(), top_k: case[3].parse().unwrap(),
                                top_p: case[4].parse().unwrap() };
        let seed: u64 = case[5].parse().unwrap();
        let new: usize = case[6].parse().unwrap();
        let (words, len) = image(name);
        let image = bytes(&words, len);
        let info = Model::info(image).unwrap();
        let vocab = info.vocab_size as usize;
        let need = Model::arena_size(image).unwrap();
        let mut a = arena(need);
        let mut model = Model::new(image, arena_bytes(&mut a, need)).unwrap();
        model.use_reference_kernels(true).unwrap();
        let prompt = i32s(fixtures().join(format!("{name}.prompt.i32")));
        assert!(prompt.len() <= info.max_batch as usize);

        let mut logits = vec![0f32; prompt.len() * vocab];
        model.lm_reset().unwrap();
        model.lm_forward(&prompt, &mut logits).unwrap();
        assert_eq!(model.lm_position(), Ok(prompt.len() as u32));
        let want = f32s(fixtures().join(format!("{name}.logits.f32")));
        assert_eq!(logits.len(), want.len(), "{name}: prefill logits length");
        assert!(logits.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: prefill logits");

        // Errors leave the cache as it was.
        assert_eq!(model.lm_forward(&[vocab as i32], &mut logits[..vocab]), Err(Status::BadToken));
        assert_eq!(model.lm_forward(&prompt[..1], &mut logits[..vocab - 1]), Err(Status::BufferSize));
        assert_eq!(model.lm_position(), Ok(prompt.len() as u32));
        let bad = Sampler { temperature: -1.0, ..Sampler::GREEDY };
        assert_eq!(model.lm_sample(&bad, &logits[..vocab], &mut Rng::new(0)), Err(Status::BadSampler));

        // One scratch row, so the prompt also runs token by token: the same cache, the same draws.
        let want = i32s(fixtures().join(format!("{name}.gen.i32")));
        for rows in [info.max_batch as usize, 1] {
            let mut scratch = vec![0f32; rows * vocab];
            let mut out = vec![-1i32; new];
            model.lm_generate(&prompt, &sampler, &mut Rng::new(seed), &mut scratch, &mut out).unwrap();
            assert_eq!(out, want, "{name}: generated tokens with {rows} logits rows");
        }
        let too_many = vec![0i32; info.max_seq_len as usize - prompt.len() + 2];
        let mut out = too_many.clone();
        assert_eq!(model.lm_generate(&prompt, &sampler, &mut Rng::new(seed), &mut logits, &mut out),
                   Err(Status::CacheFull));
        assert_eq!(model.lm_generate(&[], &sampler, &mut Rng::new(seed), &mut logits, &mut out[..1]),
                   Err(Status::BadBatch));
    }
}
