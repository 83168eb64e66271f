//! Starting `gdsllm serve` on the real model for the serve_* tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The converted SmolLM2 directory from `GDSLLM_TEST_MODEL`, or `None` (after saying so) when
/// `GDSLLM_SKIP_MODEL_TESTS=1`. Panics with instructions when neither is set.
pub fn model_dir() -> Option<PathBuf> {
    gdsllm_convert::testing::model_path("GDSLLM_TEST_MODEL")
}

pub fn gdsllm() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gdsllm"));
    // The tests must not depend on the caller's serve settings.
    for (k, _) in std::env::vars() {
        if k.starts_with("GDSLLM_") && k != "GDSLLM_TEST_MODEL" && k != "GDSLLM_HOME" {
            c.env_remove(k);
        }
    }
    c
}

/// Runs `cmd`, asserts it succeeded (showing its stderr if not) and returns its stdout.
pub fn stdout_of(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs `python3 scripts/SCRIPT --gdsllm <this build's gdsllm> --model DIR --venv V` and
/// expects it to succeed and print `marker`. The script pip-installs its Python packages into
/// the virtual environment V when they are missing: `$venv_env`, else one named after that
/// variable under cargo's directory for test files (`target/tmp`), shared by the checks of a
/// binary and kept between runs (a fresh environment for each of the three `openai` checks
/// took three minutes of a CI run). Skips (returns) when model tests are skipped.
pub fn run_python_client_check(script: &str, venv_env: &str, marker: &str) {
    let Some(dir) = model_dir() else {
        return;
    };
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(script);
    let venv_path = std::env::var_os(venv_env).unwrap_or_else(|| {
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(venv_env.to_lowercase())
            .into_os_string()
    });
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
    assert!(stdout.contains(marker), "{marker:?} not printed");
}

/// A running `gdsllm serve`; killed when dropped.
pub struct Served {
    pub child: Child,
    pub base: String,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Served {
    /// Starts `gdsllm serve -m DIR --port 0 ARGS` and waits until /health says ok.
    pub fn start(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Served {
        let mut cmd = gdsllm();
        cmd.args(["serve", "-m"])
            .arg(dir)
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawning gdsllm serve");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        let base = first.trim().to_string();
        assert!(
            base.starts_with("http://127.0.0.1:"),
            "first stdout line: {first:?}"
        );
        let mut stderr = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        let served = Served {
            child,
            base,
            stderr: Some(stderr),
        };
        served.wait_ready();
        served
    }

    fn wait_ready(&self) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        let rt = runtime();
        loop {
            let status = rt.block_on(async {
                client
                    .get(self.url("/health"))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            });
            if matches!(status, Ok(200)) {
                return;
            }
            assert!(Instant::now() < deadline, "server not ready: {status:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends SIGTERM and returns (exit success, stderr).
    pub fn terminate(mut self) -> (bool, String) {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM {pid}");
        let status = self.child.wait().unwrap();
        let stderr = self.stderr.take().unwrap().join().unwrap();
        (status.success(), stderr)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|s| s.trim().to_string())
        .collect()
}

/// Concatenated content of a streamed chat (or text of a streamed completion).
pub fn streamed_text(body: &str) -> (String, Option<String>, Vec<serde_json::Value>) {
    let events = sse_data(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let mut text = String::new();
    let mut finish = None;
    for c in &chunks {
        assert!(c.get("error").is_none(), "error in stream: {c}");
        let Some(choice) = c["choices"].get(0) else {
            continue;
        };
        if let Some(t) = choice["delta"]["content"]
            .as_str()
            .or(choice["text"].as_str())
        {
            text.push_str(t);
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (text, finish, chunks)
}

/// `gdsllm run -p PROMPT --temp 0 -n N --json` on the same model: (text, prompt_tokens,
/// finish_reason).
pub fn run_greedy(dir: &std::path::Path, prompt: &str, n: usize) -> (String, usize, String) {
    let stdout = stdout_of(gdsllm().args(["run", "-m"]).arg(dir).args([
        "-p",
        prompt,
        "--temp",
        "0",
        "-n",
        &n.to_string(),
        "--json",
        "-c",
        "1024",
    ]));
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    let prompt_tokens = match &v["prompt_tokens"] {
        serde_json::Value::Array(a) => a.len(),
        other => other.as_u64().unwrap() as usize,
    };
    (
        v["text"].as_str().unwrap().to_string(),
        prompt_tokens,
        v["finish_reason"].as_str().unwrap_or_default().to_string(),
    )
}

/// The model's chat template applied to `messages` (as the server and `gdsllm run`'s chat do).
pub fn render_chat(dir: &std::path::Path, messages: &[(&str, &str)]) -> String {
    let model = weights_format::Model::open(dir).unwrap();
    let meta = model.metadata();
    let tokenizer = llama::Tokenizer::from_file(dir.join(&meta.tokenizer)).unwrap();
    let template =
        llama::ChatTemplate::from_file(dir.join(&meta.chat_template.as_ref().unwrap().file))
            .unwrap();
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.token(i)).unwrap_or_default();
    let messages: Vec<llama::Message> = messages
        .iter()
        .map(|(r, c)| llama::Message::new(*r, *c))
        .collect();
    template
        .render(
            &messages,
            &text(meta.config.bos_token_id),
            &text(meta.config.eos_token_ids.first().copied()),
            true,
        )
        .unwrap()
}
