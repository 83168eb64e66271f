//! Shared by the tests that need the real SmolLM2 model.
#![allow(dead_code)]

use std::path::PathBuf;

/// The converted model directory from `GDSLLM_TEST_MODEL`, or `None` (after saying so) when
/// `GDSLLM_SKIP_MODEL_TESTS=1`. Panics with instructions when neither is set.
pub fn model_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("GDSLLM_TEST_MODEL") {
        return Some(PathBuf::from(dir));
    }
    if std::env::var("GDSLLM_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("skipped: GDSLLM_SKIP_MODEL_TESTS=1 and GDSLLM_TEST_MODEL is unset");
        return None;
    }
    panic!(
        "GDSLLM_TEST_MODEL is not set: run `gdsllm pull smollm2` and set GDSLLM_TEST_MODEL to the \
         converted model directory (or set GDSLLM_SKIP_MODEL_TESTS=1 to skip model tests)"
    );
}

/// The path in environment variable `var` (a file or directory the tests need, made by CI),
/// or `None` (after saying so) when `GDSLLM_SKIP_MODEL_TESTS=1`. Panics with `how` (how to make
/// it) otherwise.
pub fn env_path(var: &str, how: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Some(PathBuf::from(p));
    }
    if std::env::var("GDSLLM_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("skipped: GDSLLM_SKIP_MODEL_TESTS=1 and {var} is unset");
        return None;
    }
    panic!("{var} is not set: {how} (or set GDSLLM_SKIP_MODEL_TESTS=1 to skip model tests)");
}

/// The golden reference outputs checked into the shared reference directory.
pub fn golden() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/reference/smollm2-golden.json");
    let path = std::env::var_os("GDSLLM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or(path);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set GDSLLM_GOLDEN)", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Indices of the `k` largest values, largest first.
pub fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    idx.truncate(k);
    idx
}

pub fn argmax(logits: &[f32]) -> u32 {
    top_k(logits, 1)[0]
}
