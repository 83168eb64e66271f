//! `gdsllm run` and `gdsllm bench` end to end on the real SmolLM2 model.

mod serve_common;

use std::process::Command;

use gdsllm_convert::testing::golden;
use serve_common::{model_dir, stdout_of};

/// This build's gdsllm with the caller's environment (unlike the serve tests' `gdsllm`).
fn gdsllm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gdsllm"))
}

#[test]
fn run_json_greedy_matches_reference_and_reports_timings_io_residency() {
    let Some(dir) = model_dir() else { return };
    let case = &golden()["prompts"][0];
    // The exact mode: the float reference's greedy tokens are exact only there (the default's
    // 8-bit activations move this prompt's sixth token; llama/tests/smollm2.rs checks them
    // against the reference within their rounding).
    let stdout = stdout_of(gdsllm().args(["run", "--cpu-exact", "-m"]).arg(&dir).args([
        "-p",
        case["prompt"].as_str().unwrap(),
        "--temp",
        "0",
        "-n",
        "8",
        "-c",
        "64",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(v["prompt_tokens"], case["input_ids"]);
    let want: Vec<_> = case["greedy_ids"].as_array().unwrap()[..8].to_vec();
    assert_eq!(v["tokens"].as_array().unwrap(), &want);
    assert!(
        v["text"].as_str().unwrap().starts_with(" Paris."),
        "{}",
        v["text"]
    );
    assert!(v["timings"]["gen_tok_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["timings"]["load_s"].as_f64().is_some());
    assert_eq!(v["io"]["backend"], "host");
    assert!(v["io"]["bytes_read"].as_u64().unwrap() > 0);
    assert!(v["residency"]["passes_completed"].as_u64().unwrap() >= 8);
}

#[test]
fn run_streams_text_to_stdout_and_same_seed_repeats() {
    let Some(dir) = model_dir() else { return };
    let run = |seed: &str| {
        let stdout = stdout_of(gdsllm().args(["run", "-m"]).arg(&dir).args([
            "-p",
            "Once upon a time",
            "-n",
            "16",
            "-c",
            "64",
            "--temp",
            "1",
            "--seed",
            seed,
        ]));
        String::from_utf8(stdout).unwrap()
    };
    let a = run("5");
    assert!(!a.trim().is_empty());
    assert_eq!(a, run("5"));
    assert_ne!(a, run("6"));
}

#[test]
fn prompt_longer_than_context_fails_naming_both_numbers() {
    let Some(dir) = model_dir() else { return };
    let out = gdsllm()
        .args(["run", "-m"])
        .arg(&dir)
        .args([
            "-p",
            "one two three four five six seven eight nine ten",
            "-c",
            "4",
            "--temp",
            "0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the prompt has 10 tokens but the context holds 4"),
        "{err}"
    );
}

#[test]
fn chat_reads_stdin_until_bye() {
    let Some(dir) = model_dir() else { return };
    use std::io::Write;
    let mut child = gdsllm()
        .args(["run", "-m"])
        .arg(&dir)
        .args(["--temp", "0", "-n", "16", "-c", "256"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"/set temp 0\nWhat is 2+2?\n/bye\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains(">>> "), "{text}");
    assert!(
        text.contains("The answer to this classic math problem is 4."),
        "{text}"
    );
}

#[test]
fn bench_json_reports_pp_tg_and_load() {
    let Some(dir) = model_dir() else { return };
    let stdout = stdout_of(
        gdsllm()
            .args(["bench", "-m"])
            .arg(&dir)
            .args(["-p", "16", "-n", "4", "-r", "1", "--json"]),
    );
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    assert!(v["pp"]["mean"].as_f64().unwrap() > 0.0);
    assert!(v["tg"]["mean"].as_f64().unwrap() > 0.0);
    assert!(v["load"]["bytes"].as_u64().unwrap() > 0);
    // Launch counts are the CUDA backend's; the CPU run has none.
    assert!(v["tg"]["kernels_per_token"].is_null(), "{}", v["tg"]);
    assert!(v["tg"]["stream_calls_per_token"].is_null(), "{}", v["tg"]);
}

#[test]
fn run_file_decodes_every_line_in_one_batch_and_prints_them_in_order() {
    let Some(dir) = model_dir() else { return };
    let golden = golden();
    let cases = golden["prompts"].as_array().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("prompts.txt");
    let lines: Vec<&str> = cases
        .iter()
        .map(|c| c["prompt"].as_str().unwrap())
        .collect();
    // A blank line is skipped, not an empty prompt.
    std::fs::write(
        &file,
        format!("{}\n\n{}\n{}\n", lines[0], lines[1], lines[2]),
    )
    .unwrap();
    let run = |json: bool| {
        let mut cmd = gdsllm();
        // Exact mode, as above: the reference's greedy tokens.
        cmd.args(["run", "--cpu-exact", "-m"])
            .arg(&dir)
            .arg("-f")
            .arg(&file)
            .args(["--temp", "0", "-n", "8", "-c", "64"]);
        if json {
            cmd.arg("--json");
        }
        String::from_utf8(stdout_of(&mut cmd)).unwrap()
    };
    let stdout = run(true);
    let objects: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(objects.len(), cases.len(), "{stdout}");
    for (i, (v, case)) in objects.iter().zip(cases).enumerate() {
        // Each sequence of the batch gives the reference's greedy tokens, as it does alone.
        assert_eq!(v["index"], i);
        assert_eq!(v["prompt"], case["prompt"]);
        assert_eq!(v["prompt_tokens"], case["input_ids"]);
        let want = &case["greedy_ids"].as_array().unwrap()[..8];
        assert_eq!(v["tokens"].as_array().unwrap(), want, "prompt {i}");
        assert_eq!(v["finish_reason"], "length");
    }
    let text = run(false);
    let first = text.find("=== [1] The capital of France is").unwrap();
    let second = text.find("=== [2] def fibonacci(n):").unwrap();
    let third = text.find("=== [3] Once upon a time").unwrap();
    assert!(first < second && second < third, "{text}");
    assert!(text[first..second].contains(" Paris."), "{text}");
    assert_eq!(
        text[first..second].trim_end(),
        format!(
            "=== [1] {}\n{}",
            lines[0],
            objects[0]["text"].as_str().unwrap()
        )
        .trim_end()
    );
}

#[test]
fn bench_cpu_threads_sizes_the_pool_it_reports() {
    let Some(dir) = model_dir() else { return };
    for threads in ["1", "2", "3"] {
        let stdout = stdout_of(gdsllm().args(["bench", "-m"]).arg(&dir).args([
            "--device",
            "cpu",
            "--cpu-threads",
            threads,
            "-p",
            "8",
            "-n",
            "2",
            "-r",
            "1",
            "--json",
        ]));
        let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
        assert_eq!(v["threads"].to_string(), threads, "{v}");
        assert!(v["tg"]["mean"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn bench_batch_reports_aggregate_per_sequence_and_bytes_per_token() {
    let Some(dir) = model_dir() else { return };
    let stdout = stdout_of(gdsllm().args(["bench", "-m"]).arg(&dir).args([
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "1",
        "--batch",
        "1,4",
        "--resident-layers",
        "0",
        "--host-cache",
        "off",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    let rows = v["batch"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    for (r, size) in rows.iter().zip([1, 4]) {
        assert_eq!(r["batch"], size);
        let mean = r["mean"].as_f64().unwrap();
        assert!(mean > 0.0, "{r}");
        let per_seq = r["per_seq_tok_per_s"].as_f64().unwrap();
        assert!((per_seq * size as f64 - mean).abs() < 1e-6 * mean, "{r}");
    }
    // Every layer is re-read from disk on every pass, so one pass for four sequences streams
    // far fewer bytes per token than one pass for one.
    let bytes = |i: usize| rows[i]["bytes_per_token"].as_f64().unwrap();
    println!(
        "bytes per token: batch 1 {:.0}, batch 4 {:.0}",
        bytes(0),
        bytes(1)
    );
    assert!(bytes(0) > 1e6, "{v}");
    assert!(bytes(1) < bytes(0) / 2.0, "{v}");
}

#[test]
fn ctx_size_beyond_the_model_is_clamped_with_a_warning() {
    let Some(dir) = model_dir() else { return };
    let out = gdsllm()
        .args(["run", "-m"])
        .arg(&dir)
        .args([
            "-p", "Hi", "--temp", "0", "-n", "2", "-c", "1000000", "--json",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let context = weights_format::Model::open(&dir)
        .unwrap()
        .config()
        .context_length;
    assert!(
        stderr.contains(&format!(
            "--ctx-size 1000000 is larger than the model's context length {context}; using {context}"
        )),
        "{stderr}"
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report.is_object(), "{report}");
}

#[test]
fn cpu_share_is_checked_and_needs_the_split() {
    let out = gdsllm()
        .args(["bench", "-m", "x", "--cpu-share", "1.5"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("1.5 is not a share between 0 and 1"),
        "{stderr}"
    );

    let Some(dir) = model_dir() else { return };
    let out = gdsllm()
        .args(["bench", "--device", "cpu", "--cpu-share", "0.5", "-m"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("it needs --placement auto"), "{stderr}");
}
