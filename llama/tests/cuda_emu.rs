//! The CUDA kernel files run on the CPU emulator of `tests/cuda_emu` against slow references
//! (`scripts/cuda-emu-check.sh --quick`: the tensor-core matmuls, the one-launch attention steps
//! of a batch and flash attention against the existing kernels and f64 references). No GPU and
//! no `cuda` feature needed, only a C++17 compiler (`CXX`, default `c++`). Opt-in:
//! `GDSLLM_EMU_TESTS=1` (then a missing compiler FAILS the test; `cargo xtask ci` sets it).

#[test]
fn cuda_kernels_match_references_on_the_cpu_emulator() {
    if std::env::var("GDSLLM_EMU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set GDSLLM_EMU_TESTS=1 to run the CUDA kernels on the CPU emulator");
        return;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/cuda-emu-check.sh");
    let out = std::process::Command::new("bash")
        .args([script, "--quick"])
        .output()
        .expect("running bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the emulated kernel checks failed (or the C++ compiler is missing): {}",
        out.status
    );
    assert!(stdout.contains("all emulated kernel checks passed"));
}
