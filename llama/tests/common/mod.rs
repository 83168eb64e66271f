//! Shared by the tests that need the real SmolLM2 model.
#![allow(dead_code)]

use std::path::PathBuf;

#[allow(unused_imports)] // not every test binary that includes this module asks for these
pub use gdsllm_convert::testing::{env_path, golden};

/// The converted model directory from `GDSLLM_TEST_MODEL`, or `None` (after saying so) when
/// `GDSLLM_SKIP_MODEL_TESTS=1`. Panics with instructions when neither is set.
pub fn model_dir() -> Option<PathBuf> {
    gdsllm_convert::testing::model_path("GDSLLM_TEST_MODEL")
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
