//! The official `openai` Python package against `gdsllm serve` on the real model, through
//! scripts/openai_client_check.py and scripts/openai_tools_check.py (which pip-install `openai`
//! into a virtual environment when it is missing; set GDSLLM_OPENAI_VENV to reuse one).

mod serve_common;

use std::process::Command;

/// Runs `scripts/SCRIPT` on the test model and expects it to print `passed`.
fn run_check_script(script: &str, passed: &str) {
    let Some(dir) = serve_common::model_dir() else {
        return;
    };
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(script);
    let venv = tempfile::tempdir().unwrap();
    let venv_path = std::env::var_os("GDSLLM_OPENAI_VENV")
        .unwrap_or_else(|| venv.path().as_os_str().to_owned());
    let out = Command::new("python3")
        .arg(&script)
        .args(["--gdsllm", env!("CARGO_BIN_EXE_gdsllm"), "--model"])
        .arg(&dir)
        .arg("--venv")
        .arg(venv_path)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running python3 {}: {e} (python3 with venv and pip is needed)",
                script.display()
            )
        });
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{} failed:\n{stdout}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(passed));
}

#[test]
fn official_openai_python_client_works_unchanged() {
    run_check_script("openai_client_check.py", "all openai client checks passed");
}

#[test]
fn official_openai_python_client_calls_tools() {
    run_check_script("openai_tools_check.py", "all openai tool checks passed");
}
