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

/// The path in environment variable `var`, or `None` when model tests are skipped
/// (`GDSLLM_SKIP_MODEL_TESTS=1`). Fails the test with instructions otherwise.
pub fn model_path(var: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var("GDSLLM_SKIP_MODEL_TESTS").as_deref() == Ok("1") => {
            eprintln!("skipped: {var} is unset and GDSLLM_SKIP_MODEL_TESTS=1");
            None
        }
        None => panic!(
            "{var} is unset. Run `gdsllm pull smollm2 --json` and set GDSLLM_TEST_GGUF to its \
             \"gguf\" path and GDSLLM_TEST_MODEL to its \"dir\" (or set \
             GDSLLM_SKIP_MODEL_TESTS=1 to skip tests that need the real model)"
        ),
    }
}
