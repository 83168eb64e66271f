//! Several models in one `gdsllm serve`: a store holding the real SmolLM2 and a tiny random
//! model; both listed, both answering (each as `gdsllm run` does), loaded and unloaded through
//! the operator endpoints, the least recently used one unloaded at --max-models 1, an idle one
//! unloaded after --model-idle-timeout, an unknown one a 404; with a --vram-budget that holds
//! only one of them, requests alternating between them, one model loaded at a time.

mod serve_common;

use std::path::Path;
use std::time::{Duration, Instant};

use gdsllm_convert::synth::{SynthOptions, SynthShape, synth};
use serde_json::{Value, json};
use serve_common::*;
use weights_format::DType;

const QUESTION: &str = "What is the capital of France? Answer in one sentence.";

/// A 2-layer random model (its own tokenizer and chat template) at `dir`.
fn synth_tiny(dir: &Path) {
    let shape = SynthShape::new(2, 64, 128, 2, 1, 300, 256);
    let opts = SynthOptions {
        shape,
        dtype: DType::F32,
        seed: 7,
        threads: 1,
        shape_name: "serve-models-test".into(),
    };
    synth(dir, &opts, &mut |_| {}).expect("synth");
}

/// A store (`$GDSLLM_HOME`) holding `smollm2` (a link to the test model) and `tiny`.
fn two_model_store(model: &Path) -> tempfile::TempDir {
    let home = tempfile::tempdir().unwrap();
    let models = home.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    std::os::unix::fs::symlink(
        std::fs::canonicalize(model).unwrap(),
        models.join("smollm2"),
    )
    .unwrap();
    synth_tiny(&models.join("tiny"));
    home
}

struct Client {
    rt: tokio::runtime::Runtime,
    http: reqwest::Client,
}

impl Client {
    fn new() -> Client {
        Client {
            rt: runtime(),
            http: reqwest::Client::new(),
        }
    }

    fn send(&self, request: reqwest::RequestBuilder) -> (u16, String) {
        self.rt.block_on(async {
            let r = request.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        })
    }

    fn get_json(&self, url: String) -> Value {
        let (status, text) = self.send(self.http.get(url));
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    fn post(&self, url: String, body: &Value) -> (u16, Value) {
        let (status, text) = self.send(self.http.post(url).json(body));
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )
    }

    fn get_text(&self, url: String) -> String {
        let (status, text) = self.send(self.http.get(url));
        assert_eq!(status, 200, "{text}");
        text
    }
}

/// `/v1/models`: id → loaded.
fn listed(c: &Client, served: &Served) -> Vec<(String, bool)> {
    let v = c.get_json(served.url("/v1/models"));
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["loaded"].as_bool().unwrap(),
            )
        })
        .collect()
}

fn loaded(c: &Client, served: &Served, id: &str) -> bool {
    let models = listed(c, served);
    models
        .iter()
        .find(|(m, _)| m == id)
        .unwrap_or_else(|| panic!("{id} not listed: {models:?}"))
        .1
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in\n{text}"))
}

/// A greedy chat with `model` (none: the default): its reply.
fn chat(c: &Client, served: &Served, model: Option<&str>) -> String {
    let mut body = json!({"messages": [{"role": "user", "content": QUESTION}],
                          "temperature": 0, "max_tokens": 16});
    if let Some(model) = model {
        body["model"] = json!(model);
    }
    let (status, r) = c.post(served.url("/v1/chat/completions"), &body);
    assert_eq!(status, 200, "{r}");
    if let Some(model) = model {
        assert_eq!(r["model"], model);
    }
    r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The greedy reply `gdsllm run` gives on the model at `dir` to the same chat.
fn run_reply(dir: &Path) -> String {
    run_greedy(dir, &render_chat(dir, &[("user", QUESTION)]), 16).0
}

/// The store of [`two_model_store`] and its two model directories (`None`: model tests
/// skipped).
fn two_models() -> Option<(tempfile::TempDir, std::path::PathBuf, std::path::PathBuf)> {
    let home = two_model_store(&model_dir()?);
    let smollm2 = home.path().join("models/smollm2");
    let tiny = home.path().join("models/tiny");
    Some((home, smollm2, tiny))
}

#[test]
fn two_models_listed_chatted_loaded_and_unloaded() {
    let Some((home, smollm2, tiny)) = two_models() else {
        return;
    };
    let home_str = home.path().to_str().unwrap();
    let c = Client::new();
    let served = Served::start(
        &smollm2,
        &["-c", "256", "--max-models", "2"],
        &[("GDSLLM_HOME", home_str)],
    );

    // Both listed; only the default loaded.
    assert_eq!(
        listed(&c, &served),
        [("smollm2".to_string(), true), ("tiny".to_string(), false)]
    );

    // Both answer, each as `gdsllm run` does on it, and differently.
    let first = chat(&c, &served, Some("smollm2"));
    assert_eq!(first, run_reply(&smollm2));
    let second = chat(&c, &served, Some("tiny"));
    println!("smollm2: {first:?}; tiny: {second:?}");
    // The random model may stop at max_tokens inside a UTF-8 character: `gdsllm run` prints
    // the unfinished bytes as U+FFFD, the server leaves them out; up to there they agree.
    let tiny_run = run_reply(&tiny);
    assert!(
        !second.is_empty() && tiny_run.starts_with(&second),
        "served {second:?}, gdsllm run {tiny_run:?}"
    );
    assert_ne!(first, second);
    assert!(loaded(&c, &served, "tiny"));
    let text = c.get_text(served.url("/metrics"));
    assert_eq!(metric(&text, "gdsllm_models_loaded"), 2.0);
    assert_eq!(
        metric(&text, "gdsllm_model_loads_total{model=\"tiny\"}"),
        1.0
    );

    // The operator endpoints.
    let (status, r) = c.post(served.url("/v1/models/tiny/unload"), &json!({}));
    assert_eq!((status, &r["unloaded"]), (200, &json!(true)), "{r}");
    assert!(!loaded(&c, &served, "tiny"));
    let text = c.get_text(served.url("/metrics"));
    assert_eq!(metric(&text, "gdsllm_models_loaded"), 1.0);
    assert_eq!(
        metric(&text, "gdsllm_model_unloads_total{model=\"tiny\"}"),
        1.0
    );
    let (status, r) = c.post(served.url("/v1/models/tiny/load"), &json!({}));
    assert_eq!((status, &r["loaded"]), (200, &json!(true)), "{r}");
    assert!(loaded(&c, &served, "tiny"));
    let text = c.get_text(served.url("/metrics"));
    assert_eq!(
        metric(&text, "gdsllm_model_loads_total{model=\"tiny\"}"),
        2.0
    );
    // `gdsllm ps` shows both.
    let stdout = stdout_of(gdsllm().env("GDSLLM_HOME", home_str).args([
        "ps",
        "--json",
        "--url",
        &served.base,
    ]));
    let ps: Value = serde_json::from_slice(&stdout).unwrap();
    let held: Vec<&str> = ps[0]["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["model"].as_str().unwrap())
        .collect();
    assert_eq!(held, ["smollm2", "tiny"], "{ps}");

    // A model the store does not have.
    let body = json!({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]});
    let (status, r) = c.post(served.url("/v1/chat/completions"), &body);
    assert_eq!(status, 404, "{r}");
    assert_eq!(r["error"]["code"], "model_not_found");
    assert_eq!(r["error"]["param"], "model");
    let (status, r) = c.post(served.url("/v1/models/no-such-model/load"), &json!({}));
    assert_eq!(status, 404, "{r}");
    drop(served);

    // One model at a time: a request for the second unloads the first; an idle model other
    // than the default unloads after the idle timeout; the default loads again on demand.
    let served = Served::start(
        &smollm2,
        &[
            "-c",
            "256",
            "--max-models",
            "1",
            "--model-idle-timeout",
            "1s",
        ],
        &[("GDSLLM_HOME", home_str)],
    );
    assert_eq!(chat(&c, &served, Some("tiny")), second);
    let text = c.get_text(served.url("/metrics"));
    assert_eq!(
        metric(&text, "gdsllm_model_unloads_total{model=\"smollm2\"}"),
        1.0
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while loaded(&c, &served, "tiny") {
        assert!(
            Instant::now() < deadline,
            "tiny still loaded 60 s after its last request (idle timeout 1 s)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(listed(&c, &served).iter().filter(|(_, l)| *l).count(), 0);
    assert_eq!(chat(&c, &served, None), first);
    assert!(loaded(&c, &served, "smollm2"));
}

/// What `/v1/models` says model `id` holds on the device.
fn device_bytes(c: &Client, served: &Served, id: &str) -> u64 {
    let v = c.get_json(served.url("/v1/models"));
    let row = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == id)
        .unwrap_or_else(|| panic!("{id} not listed: {v}"));
    row["memory_bytes"]["device"]
        .as_u64()
        .unwrap_or_else(|| panic!("{id} holds no device memory: {v}"))
}

#[test]
fn a_budget_that_holds_one_model_serves_both_one_at_a_time() {
    let Some((home, smollm2, tiny)) = two_models() else {
        return;
    };
    let home_str = home.path().to_str().unwrap();
    let c = Client::new();
    // No prefix cache: the weights make most of what each holds.
    let flags = [
        "-c",
        "256",
        "--max-batch",
        "2",
        "--prefix-cache-bytes",
        "0",
        "--host-cache",
        "off",
    ];

    // What each needs alone, with room for both.
    let served = Served::start(
        &smollm2,
        &[&flags[..], &["--vram-budget", "16GiB"]].concat(),
        &[("GDSLLM_HOME", home_str)],
    );
    let (status, r) = c.post(served.url("/v1/models/tiny/load"), &json!({}));
    assert_eq!(status, 200, "{r}");
    let big = device_bytes(&c, &served, "smollm2");
    let small = device_bytes(&c, &served, "tiny");
    let v = c.get_json(served.url("/v1/models"));
    assert_eq!(
        v["memory"]["held_bytes"]["device"],
        json!(big + small),
        "{v}"
    );
    assert_eq!(
        v["memory"]["budget_bytes"]["device"],
        json!(16u64 << 30),
        "{v}"
    );
    drop(served);
    println!("smollm2 holds {big} bytes, tiny {small}");
    assert!(small < big, "tiny {small} >= smollm2 {big}");

    // A budget for the larger one and half the smaller: each fits alone, never both.
    let budget = (big + small / 2).to_string();
    let served = Served::start(
        &smollm2,
        &[&flags[..], &["--vram-budget", &budget]].concat(),
        &[("GDSLLM_HOME", home_str)],
    );
    let smollm2_reply = run_reply(&smollm2);
    let tiny_reply = run_reply(&tiny);
    let one_loaded = |id: &str| {
        let models = listed(&c, &served);
        let loaded: Vec<&str> = models
            .iter()
            .filter(|(_, l)| *l)
            .map(|(m, _)| m.as_str())
            .collect();
        assert_eq!(loaded, [id], "{models:?}");
    };
    one_loaded("smollm2");
    for round in 0..2 {
        let reply = chat(&c, &served, Some("tiny"));
        assert!(
            !reply.is_empty() && tiny_reply.starts_with(&reply),
            "round {round}: served {reply:?}, gdsllm run {tiny_reply:?}"
        );
        one_loaded("tiny");
        assert_eq!(device_bytes(&c, &served, "tiny"), small);
        assert_eq!(chat(&c, &served, Some("smollm2")), smollm2_reply);
        one_loaded("smollm2");
        // Loaded with what it would have alone: all resident, as before.
        assert_eq!(device_bytes(&c, &served, "smollm2"), big);
    }
    let text = c.get_text(served.url("/metrics"));
    assert_eq!(
        metric(&text, "gdsllm_model_evictions_total{reason=\"memory\"}"),
        4.0
    );
    assert_eq!(
        metric(&text, "gdsllm_memory_budget_bytes{tier=\"device\"}"),
        (big + small / 2) as f64
    );
    // `gdsllm ps` says the same.
    let out = gdsllm()
        .env("GDSLLM_HOME", home_str)
        .args(["ps", "--url", &served.base])
        .output()
        .unwrap();
    let ps = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && ps.contains("memory"), "{ps}");
    println!("{ps}");
}
