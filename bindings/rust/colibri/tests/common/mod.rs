//! Fixture loading shared by the integration tests: the files tests/bindings/test_bindings_rust.py writes
//! (cases.txt and per-model images, inputs and Python engine outputs).
#![allow(dead_code)] // each test crate uses its own subset

use std::fs;
use std::path::PathBuf;

pub fn fixtures() -> PathBuf {
    PathBuf::from(std::env::var_os("COLIBRI_RUST_FIXTURES").expect(
        "COLIBRI_RUST_FIXTURES is not set: these tests compare with the Python engine; \
         run them through `pytest tests/bindings/test_bindings_rust.py`, which exports the models and sets it",
    ))
}

/// An image copy with the 4-byte alignment colibri_init requires
/// (a Vec<u8> guarantees none).
pub fn aligned_image(bytes: &[u8]) -> Vec<u32> {
    let mut words = vec![0u32; bytes.len().div_ceil(4)];
    as_bytes_mut(&mut words)[..bytes.len()].copy_from_slice(bytes);
    words
}

pub fn as_bytes_mut(words: &mut [u32]) -> &mut [u8] {
    // SAFETY: u32 has no invalid bit patterns and u8 alignment is 1.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len() * 4) }
}

pub fn image(name: &str) -> (Vec<u32>, usize) {
    let bytes = fs::read(fixtures().join(format!("{name}.bin"))).unwrap();
    (aligned_image(&bytes), bytes.len())
}

pub fn bytes(words: &[u32], len: usize) -> &[u8] {
    // SAFETY: as above, read-only.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), len) }
}

pub fn f32s(path: PathBuf) -> Vec<f32> {
    fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

pub fn i32s(path: PathBuf) -> Vec<i32> {
    fs::read(&path).unwrap().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// An 8-byte aligned arena of n bytes.
pub fn arena(n: usize) -> Vec<u64> {
    vec![0u64; n.div_ceil(8)]
}

pub fn arena_bytes(a: &mut [u64], n: usize) -> &mut [u8] {
    // SAFETY: u64 -> u8 view of the first n bytes.
    unsafe { std::slice::from_raw_parts_mut(a.as_mut_ptr().cast(), n) }
}

pub fn cases(kind: &str) -> Vec<Vec<String>> {
    let text = fs::read_to_string(fixtures().join("cases.txt")).unwrap();
    let found: Vec<Vec<String>> = text
        .lines()
        .map(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>())
        .filter(|f| f.first().map(String::as_str) == Some(kind))
        .collect();
    assert!(!found.is_empty(), "no {kind} case in cases.txt");
    found
}

