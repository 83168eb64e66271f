//! Shared helpers for tests that need the real SmolLM2 model.
#![allow(dead_code)]

use std::path::PathBuf;

/// The golden reference file: `$GDSLLM_GOLDEN`, or `shared/reference/` beside the checkout.
pub fn golden() -> serde_json::Value {
    let path = std::env::var_os("GDSLLM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../shared/reference/smollm2-golden.json")
        });
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden file is JSON")
}

pub use gdsllm_convert::testing::model_path;
