//! The store from the command line, over loopback HTTP only: `pull` through HF_ENDPOINT,
//! `list` / `show` / `tag` / `rm`, `-m FILE.gguf` converting once, the errors a new user meets,
//! and `serve -m http://…/` answering like the local model while fetching each blob once.

mod serve_common;

use std::path::Path;
use std::process::Output;
use std::sync::Arc;

use gdsllm_fetch::testing::{Content, TestServer};
use serde_json::{Value, json};
use serve_common::{Served, gdsllm, model_dir, runtime};

/// `gdsllm ARGS` with the store at `home`.
fn gdsllm_in(home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = gdsllm();
    cmd.env("GDSLLM_HOME", home).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn ok_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&out.stdout));
    })
}

fn failed(out: &Output) -> String {
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_new_users_mistakes_get_answers_that_say_what_works() {
    let home = tempfile::tempdir().unwrap();
    let err = failed(&gdsllm_in(home.path(), &["pull", "llama3"], &[]));
    assert!(
        err.contains("hf.co/OWNER/REPO[:QUANT]") && err.contains("https://HOST/path/file.gguf"),
        "{err}"
    );
    let err = failed(&gdsllm_in(
        home.path(),
        &["run", "-m", "model.gguf", "-p", "x"],
        &[],
    ));
    assert!(err.contains("\"model.gguf\": no such file"), "{err}");
    let err = failed(&gdsllm_in(
        home.path(),
        &["run", "-m", "qwen", "-p", "x"],
        &[],
    ));
    assert!(
        err.contains("not in the store")
            && err.contains("-m FILE.gguf")
            && err.contains("gdsllm pull"),
        "{err}"
    );
    let out = gdsllm_in(home.path(), &["list"], &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("is empty"));
    assert_eq!(
        ok_json(&gdsllm_in(home.path(), &["list", "--json"], &[])),
        json!([])
    );
}

#[test]
fn run_m_a_gguf_converts_it_into_the_store_once_and_says_so() {
    let Some(gguf) = gdsllm_convert::testing::model_path("GDSLLM_TEST_GGUF") else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let greedy = |model: &str| -> Vec<String> {
        [
            "run", "-m", model, "-p", "Hi", "-n", "2", "--temp", "0", "-c", "64", "--json",
        ]
        .map(String::from)
        .to_vec()
    };
    let args = greedy(gguf.to_str().unwrap());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let first = gdsllm_in(home.path(), &args, &[]);
    let text = ok_json(&first)["text"].as_str().unwrap().to_string();
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(
        stderr.contains("converted into the store as smollm2-135m-instruct:q4_1"),
        "{stderr}"
    );
    let second = gdsllm_in(home.path(), &args, &[]);
    assert_eq!(ok_json(&second)["text"], text.as_str());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("on an earlier run"), "{stderr}");
    let by_name = greedy("smollm2-135m-instruct:q4_1");
    let by_name: Vec<&str> = by_name.iter().map(String::as_str).collect();
    let by_name = gdsllm_in(home.path(), &by_name, &[]);
    assert_eq!(ok_json(&by_name)["text"], text.as_str());
}

#[test]
fn pull_from_a_hub_then_list_show_tag_and_rm() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("t.gguf");
    gdsllm_convert::testing::TinyLlama::new(7, true)
        .gguf(weights_format::DType::Q8_0)
        .write_to(&gguf)
        .unwrap();
    server.add_hf_repo(
        "org/Tiny-GGUF",
        vec![(
            "Tiny-Q8_0.gguf".into(),
            Content::Bytes(Arc::new(std::fs::read(&gguf).unwrap())),
        )],
    );
    let home = dir.path().join("store");
    let hf_home = dir.path().join("hf").to_string_lossy().into_owned();
    let url = server.url();
    let env = [("HF_ENDPOINT", url.as_str()), ("HF_HOME", hf_home.as_str())];
    let pulled = ok_json(&gdsllm_in(
        &home,
        &["pull", "hf.co/org/Tiny-GGUF:Q8_0", "--json"],
        &env,
    ));
    assert_eq!(pulled["name"], "tiny:q8_0");
    assert_eq!(pulled["source"], "hf.co/org/Tiny-GGUF:Q8_0");
    assert!(pulled["fetched_bytes"].as_u64().unwrap() > 0);
    let again = ok_json(&gdsllm_in(
        &home,
        &["pull", "org/Tiny-GGUF:q8_0", "--json"],
        &env,
    ));
    assert_eq!(again["up_to_date"], true);

    let shown = ok_json(&gdsllm_in(&home, &["show", "tiny:q8_0", "--json"], &[]));
    assert_eq!(shown["architecture"], "llama");
    assert_eq!(shown["n_layers"], 2);
    assert!(shown["parameters"].as_u64().unwrap() > 0);
    assert!(shown["tensor_types"]["q8_0"]["tensors"].as_u64().unwrap() > 0);
    assert!(shown["tensor_types"]["f32"]["tensors"].as_u64().unwrap() > 0);
    assert_eq!(shown["chat_template"], true);
    assert!(
        shown["default_plan"]["Ok"]["resident_bytes"]
            .as_u64()
            .is_some(),
        "{shown}"
    );
    let text =
        String::from_utf8_lossy(&gdsllm_in(&home, &["show", "tiny:q8_0"], &[]).stdout).into_owned();
    assert!(
        text.contains("q8_0 ×") && text.contains("default plan"),
        "{text}"
    );

    ok_json(&gdsllm_in(
        &home,
        &["tag", "tiny:q8_0", "mine:small", "--json"],
        &[],
    ));
    let listed = ok_json(&gdsllm_in(&home, &["list", "--json"], &[]));
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["mine:small", "tiny:q8_0"]);
    let text = String::from_utf8_lossy(&gdsllm_in(&home, &["list"], &[]).stdout).into_owned();
    assert!(
        text.contains("tiny:q8_0") && text.contains("hf.co/org/Tiny-GGUF:Q8_0"),
        "{text}"
    );

    let removed = ok_json(&gdsllm_in(
        &home,
        &["rm", "mine:small", "tiny:q8_0", "--json"],
        &[],
    ));
    assert!(
        removed[0]["deleted"].is_null() && removed[1]["deleted"].is_string(),
        "{removed}"
    );
    assert_eq!(
        ok_json(&gdsllm_in(&home, &["list", "--json"], &[])),
        json!([])
    );
    let err = failed(&gdsllm_in(&home, &["rm", "tiny:q8_0"], &[]));
    assert!(err.contains("not in the store"), "{err}");
}

/// A greedy chat of a few tokens with the tokens' text: (content, tokens).
fn chat(served: &Served) -> (String, Vec<Value>) {
    let body = json!({
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 8, "logprobs": true,
    });
    let r: Value = runtime().block_on(async {
        reqwest::Client::new()
            .post(served.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    let content = r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}"));
    let tokens = r["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| json!([t["token"], t["bytes"]]))
        .collect();
    (content.to_string(), tokens)
}

/// The weight bytes `/metrics` counts for `tier`.
fn weight_bytes(served: &Served, tier: &str) -> u64 {
    let text = runtime().block_on(async {
        reqwest::get(served.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    let key = format!("gdsllm_weight_bytes_total{{tier=\"{tier}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

#[test]
fn serve_m_a_url_answers_like_the_local_model_and_later_passes_fetch_nothing() {
    let Some(dir) = model_dir() else { return };
    let blob_bytes: u64 = weights_format::Model::open(&dir)
        .unwrap()
        .metadata()
        .blobs
        .iter()
        .map(|b| b.length)
        .sum();
    let local = Served::start(&dir, &["-c", "512"], &[]);
    let expected = chat(&local);
    drop(local);

    let server = TestServer::start();
    server.add_dir("models/smollm2", &dir);
    let url = format!("{}/models/smollm2/", server.url());
    let home = tempfile::tempdir().unwrap();
    let home_str = home.path().to_string_lossy().into_owned();
    let env = [("GDSLLM_HOME", home_str.as_str())];
    let remote = Served::start(Path::new(&url), &["-c", "512"], &env);
    assert_eq!(
        chat(&remote),
        expected,
        "the served model answers like the local one"
    );
    assert_eq!(
        weight_bytes(&remote, "network"),
        blob_bytes,
        "each blob fetched once"
    );
    assert_eq!(chat(&remote), expected);
    assert_eq!(
        weight_bytes(&remote, "network"),
        blob_bytes,
        "the second pass fetches nothing"
    );
    // `ps` finds the server through the store and says what it holds.
    let ps = ok_json(&gdsllm_in(home.path(), &["ps", "--json"], &[]));
    let model = &ps[0]["models"][0];
    assert_eq!(ps[0]["url"], remote.base.as_str(), "{ps}");
    assert_eq!(model["state"], "ready");
    assert_eq!(model["read_bytes"]["network"], blob_bytes);
    let held: u64 = model["held_bytes"]["resident"].as_u64().unwrap()
        + model["held_bytes"]["staging"].as_u64().unwrap();
    assert!(held > 0, "{model}");
    let by_url = ok_json(&gdsllm_in(
        home.path(),
        &["ps", "--url", &remote.base, "--json"],
        &[],
    ));
    assert_eq!(by_url[0]["models"][0]["model"], model["model"]);
    let (ok, _) = remote.terminate();
    assert!(ok);

    // Restarted, with every blob on local disk: nothing crosses the network.
    server.reset_counts();
    let again = Served::start(Path::new(&url), &["-c", "512"], &env);
    assert_eq!(chat(&again), expected);
    assert_eq!(weight_bytes(&again, "network"), 0);
    let listed = ok_json(&gdsllm_in(home.path(), &["list", "--json"], &[]));
    assert_eq!(listed[0]["name"], url.as_str());
    assert_eq!(listed[0]["remote"], true);
    drop(again);
    let blob_requests = server
        .requests()
        .iter()
        .filter(|r| r.path.ends_with(".bin"))
        .count();
    assert_eq!(blob_requests, 0, "{:?}", server.requests());
}
