//! The HTTP layer against a deterministic fake engine: every endpoint, streaming and not,
//! errors, auth, metrics, disconnects and shutdown.

mod common;

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use common::{FakeEngine, TestServer, metric, metrics_text, sse_data, wait_for_metric};
use gdsllm_server::{ChatMessage, ServerConfig};
use serde_json::{Value, json};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(ts: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    post_url(ts.url(path), body.clone()).await
}

/// `post` for a task that cannot borrow the server.
async fn post_url(url: String, body: Value) -> (u16, Value) {
    let r = client().post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// Asserts OpenAI's error shape and returns (message, param).
fn error_of(body: &Value) -> (String, Value) {
    let e = &body["error"];
    assert!(e["message"].is_string(), "{body}");
    assert!(e["type"].is_string(), "{body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{body}"
    );
    (
        e["message"].as_str().unwrap().to_string(),
        e["param"].clone(),
    )
}

fn chat_body(content: &str) -> Value {
    json!({"model": "fake-model", "messages": [{"role": "user", "content": content}], "temperature": 0})
}

fn chat_prompt(messages: &[ChatMessage]) -> Vec<u32> {
    FakeEngine::tokenize_text(&FakeEngine::render(messages), false)
}

fn user(content: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::new("user", content)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_while_loading_then_ok() {
    let ts = TestServer::start_loading(ServerConfig::default()).await;
    let r = client().get(ts.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let (msg, _) = error_of(&r.json().await.unwrap());
    assert!(msg.contains("loading"), "{msg}");
    let (status, _) = post(&ts, "/v1/chat/completions", &chat_body("hi")).await;
    assert_eq!(status, 503);

    ts.server.set_engine(Arc::new(FakeEngine::new()));
    let r = client().get(ts.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"status": "ok"}));
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ps_says_what_the_server_holds_per_tier() {
    let ts = TestServer::start_loading(ServerConfig::default()).await;
    let ps = || async {
        let r = client().get(ts.url("/api/ps")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()
    };
    assert_eq!(ps().await, json!({"models": [{"state": "loading"}]}));
    ts.server.set_engine(Arc::new(FakeEngine::new()));
    let model = &ps().await["models"][0];
    assert_eq!(model["state"], "ready");
    assert_eq!(model["model"], "fake-model");
    assert_eq!(
        model["held_bytes"],
        json!({"resident": 1 << 20, "staging": 2 << 20, "host": 0})
    );
    assert_eq!(model["read_bytes"], json!({"disk": 4096, "host": 8192}));
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_load_is_reported_by_health() {
    let ts = TestServer::start_loading(ServerConfig::default()).await;
    ts.server.set_load_failed("metadata.json: missing");
    let r = client().get(ts.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let (msg, _) = error_of(&r.json().await.unwrap());
    assert!(msg.contains("metadata.json: missing"), "{msg}");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_id_and_aliases() {
    let config = ServerConfig {
        aliases: vec!["gpt-4o".into()],
        ..Default::default()
    };
    let ts = TestServer::start(config, Arc::new(FakeEngine::new())).await;
    let r: Value = client()
        .get(ts.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["object"], "list");
    let ids: Vec<&str> = r["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["fake-model", "gpt-4o"]);
    assert_eq!(r["data"][0]["object"], "model");
    let r = client()
        .get(ts.url("/v1/models/gpt-4o"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client()
        .get(ts.url("/v1/models/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    error_of(&r.json().await.unwrap());

    // The alias answers chat requests and is echoed back.
    let mut body = chat_body("hello");
    body["model"] = json!("gpt-4o");
    let (status, r) = post(&ts, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["model"], "gpt-4o");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_whole_and_streamed_agree() {
    let engine = Arc::new(FakeEngine::new());
    let ts = TestServer::start(ServerConfig::default(), engine.clone()).await;
    let prompt = chat_prompt(&user("tell me"));
    let (expected, _) = FakeEngine::expected(&prompt, 5);

    let mut body = chat_body("tell me");
    body["max_tokens"] = json!(5);
    let (status, r) = post(&ts, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r["choices"][0]["message"]["content"], expected.as_str());
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(r["usage"]["completion_tokens"], 5);
    assert_eq!(r["usage"]["total_tokens"], prompt.len() + 5);
    assert!(r["choices"][0]["logprobs"].is_null());

    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = client()
        .post(ts.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = sse_data(&resp.text().await.unwrap());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    assert_eq!(text, expected);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert!(finish["usage"].is_null());
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(usage["usage"]["prompt_tokens"], prompt.len());

    // Without max_tokens the model runs to EOS: finish_reason stop.
    let (_, r) = post(&ts, "/v1/chat/completions", &chat_body("tell me")).await;
    let (full, eos) = FakeEngine::expected(&prompt, usize::MAX);
    assert!(eos);
    assert_eq!(r["choices"][0]["message"]["content"], full.as_str());
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_parameters_reach_the_engine() {
    let engine = Arc::new(FakeEngine::new());
    let ts = TestServer::start(ServerConfig::default(), engine.clone()).await;
    let body = json!({
        "model": "fake-model", "messages": [{"role": "user", "content": "x"}],
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 42,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "max_completion_tokens": 3, "n": 1,
        "logit_bias": {"4999": -100},
    });
    let (status, r) = post(&ts, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    let req = engine.requests.lock().last().unwrap().clone();
    let s = &req.sampling;
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.min_p),
        (0.7, 0.9, 40, 0.05)
    );
    assert_eq!(
        (s.seed, s.presence_penalty, s.frequency_penalty),
        (Some(42), 0.5, -0.5)
    );
    assert_eq!(s.logit_bias, vec![(4999, -100.0)]);
    assert_eq!(req.max_tokens, 3);
    assert_eq!(req.logprobs, None);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_whole_and_streamed() {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let prompt = FakeEngine::tokenize_text("once upon a time", true);
    let (expected, _) = FakeEngine::expected(&prompt, 4);
    let body = json!({"model": "fake-model", "prompt": "once upon a time", "max_tokens": 4, "temperature": 0});
    let (status, r) = post(&ts, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["choices"][0]["text"], expected.as_str());
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["prompt_tokens"], prompt.len());

    let mut body = body;
    body["stream"] = json!(true);
    let text = client()
        .post(ts.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = sse_data(&text);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut got = String::new();
    let mut finish = Value::Null;
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        assert_eq!(c["object"], "text_completion");
        assert!(
            c.get("usage").is_none(),
            "usage only with include_usage: {c}"
        );
        got.push_str(c["choices"][0]["text"].as_str().unwrap());
        if !c["choices"][0]["finish_reason"].is_null() {
            finish = c["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(got, expected);
    assert_eq!(finish, "length");

    // Token-id prompts are taken as given; the default max_tokens is 16 (OpenAI's).
    let ids = vec![7u32, 8, 9];
    let (_, r) = post(
        &ts,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 2}),
    )
    .await;
    assert_eq!(
        r["choices"][0]["text"],
        FakeEngine::expected(&ids, 2).0.as_str()
    );
    assert_eq!(r["usage"]["prompt_tokens"], 3);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_text_whole_and_streamed() {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let prompt = FakeEngine::tokenize_text("abc", true);
    let (full, _) = FakeEngine::expected(&prompt, usize::MAX);
    // A stop string spanning two generated words.
    let words: Vec<&str> = full.split_inclusive(' ').collect();
    assert!(words.len() > 4, "{full}");
    let stop = "a gam".to_string();
    let cut = full.find(&stop);
    let body = json!({"prompt": "abc", "max_tokens": 50, "stop": [stop.clone(), "never"]});
    let (_, r) = post(&ts, "/v1/completions", &body).await;
    let expected = match cut {
        Some(at) => (&full[..at], "stop"),
        None => (full.as_str(), "stop"),
    };
    assert_eq!(r["choices"][0]["text"], expected.0, "full text {full:?}");
    assert_eq!(r["choices"][0]["finish_reason"], expected.1);

    // A stop string that is one whole word in the middle.
    let word = full
        .split(' ')
        .filter(|w| !w.is_empty())
        .nth(2)
        .unwrap()
        .to_string();
    let at = full.find(&word).unwrap();
    let mut body = json!({"prompt": "abc", "max_tokens": 50, "stop": word});
    let (_, r) = post(&ts, "/v1/completions", &body).await;
    assert_eq!(r["choices"][0]["text"], &full[..at]);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    body["stream"] = json!(true);
    let text = client()
        .post(ts.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = sse_data(&text);
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(streamed, &full[..at]);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_in_chat_and_completion_shapes() {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let mut body = chat_body("q");
    body["max_tokens"] = json!(3);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let (status, r) = post(&ts, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    let joined: String = content
        .iter()
        .map(|c| c["token"].as_str().unwrap())
        .collect();
    assert_eq!(
        joined,
        r["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert!((content[0]["logprob"].as_f64().unwrap() + 0.1).abs() < 1e-6);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(content[0]["bytes"].is_array());

    // Streamed: each chunk carries its token's logprobs.
    body["stream"] = json!(true);
    let text = client()
        .post(ts.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = sse_data(&text);
    let per_chunk: usize = events[..events.len() - 1]
        .iter()
        .map(|e| {
            let c: Value = serde_json::from_str(e).unwrap();
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .map_or(0, Vec::len)
        })
        .sum();
    assert_eq!(per_chunk, 3);

    let (_, r) = post(
        &ts,
        "/v1/completions",
        &json!({"prompt": "q", "max_tokens": 3, "logprobs": 2}),
    )
    .await;
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[1], tokens[0].chars().count() as u64);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_prompt_is_inserted_only_without_a_system_message() {
    let engine = Arc::new(FakeEngine::new());
    let config = ServerConfig {
        system_prompt: Some("Be brief.".into()),
        ..Default::default()
    };
    let ts = TestServer::start(config, engine.clone()).await;
    post(&ts, "/v1/chat/completions", &chat_body("hi")).await;
    let with_sys = json!({"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "hi"}]});
    post(&ts, "/v1/chat/completions", &with_sys).await;
    let rendered = engine.rendered.lock().clone();
    assert_eq!(rendered[0][0], ChatMessage::new("system", "Be brief."));
    assert_eq!(rendered[0][1].role, "user");
    assert_eq!(rendered[1].len(), 2);
    assert_eq!(rendered[1][0].content, "Own.");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_float_and_base64() {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let body = json!({"model": "fake-model", "input": ["hello world", "another text here"]});
    let (status, r) = post(&ts, "/v1/embeddings", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "list");
    let data = r["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    let floats: Vec<Vec<f32>> = data
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    for v in &floats {
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
    }
    assert_eq!(r["usage"]["prompt_tokens"], 3 + 4);

    let mut body = body;
    body["encoding_format"] = json!("base64");
    let (_, r) = post(&ts, "/v1/embeddings", &body).await;
    for (i, d) in r["data"].as_array().unwrap().iter().enumerate() {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(d["embedding"].as_str().unwrap())
            .unwrap();
        let v: Vec<f32> = bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(v, floats[i]);
    }
    // Bad token ids come back as a 400 from the engine.
    let (status, r) = post(&ts, "/v1/embeddings", &json!({"input": [1, 999999]})).await;
    assert_eq!(status, 400, "{r}");
    error_of(&r);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_shaped_errors() {
    let config = ServerConfig {
        body_limit: 4096,
        ..Default::default()
    };
    let ts = TestServer::start(config, Arc::new(FakeEngine::new())).await;
    // Malformed JSON.
    let r = client()
        .post(ts.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{\"messages\": [")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let (msg, _) = error_of(&r.json().await.unwrap());
    assert!(msg.contains("not valid JSON"), "{msg}");

    // Wrong types and invalid values name the field.
    for (body, param) in [
        (
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
            "temperature",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}),
            "top_p",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
            "max_tokens",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
            "stream",
        ),
        (json!({"messages": "x"}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 3}),
            "n",
        ),
    ] {
        let (status, r) = post(&ts, "/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{body}: {r}");
        let (msg, p) = error_of(&r);
        assert_eq!(p, param, "{msg}");
        assert!(msg.contains(param), "{msg}");
    }
    let (_, r) = post(
        &ts,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "n": 3}),
    )
    .await;
    assert!(error_of(&r).0.contains("n = 1"), "{r}");

    // Unknown model: 404.
    let mut body = chat_body("x");
    body["model"] = json!("gpt-5");
    let (status, r) = post(&ts, "/v1/chat/completions", &body).await;
    assert_eq!(status, 404);
    assert_eq!(r["error"]["code"], "model_not_found");
    let (status, _) = post(
        &ts,
        "/v1/embeddings",
        &json!({"model": "gpt-5", "input": "x"}),
    )
    .await;
    assert_eq!(status, 404);

    // Prompt over the context (64): 400 with both numbers.
    let long = vec!["w"; 70].join(" ");
    let (status, r) = post(&ts, "/v1/completions", &json!({"prompt": long})).await;
    assert_eq!(status, 400);
    let (msg, p) = error_of(&r);
    assert!(msg.contains("64") && msg.contains("71"), "{msg}");
    assert_eq!(p, "prompt");
    assert_eq!(r["error"]["code"], "context_length_exceeded");

    // Body over the limit: 413.
    let big = "x ".repeat(5000);
    let r = client()
        .post(ts.url("/v1/completions"))
        .json(&json!({"prompt": big}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let (msg, _) = error_of(&r.json().await.unwrap());
    assert!(msg.contains("4096"), "{msg}");

    // Unknown route.
    let r = client().get(ts.url("/v1/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    error_of(&r.json().await.unwrap());
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_v1_but_not_health() {
    let config = ServerConfig {
        api_keys: vec!["k-one".into(), "k-two".into()],
        ..Default::default()
    };
    let ts = TestServer::start(config, Arc::new(FakeEngine::new())).await;
    let r = client().get(ts.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = client().get(ts.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.unwrap();
    error_of(&body);
    assert_eq!(body["error"]["code"], "invalid_api_key");
    let r = client()
        .get(ts.url("/v1/models"))
        .bearer_auth("k-wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let text = r.text().await.unwrap();
    assert!(
        !text.contains("k-wrong") && !text.contains("k-one"),
        "{text}"
    );
    for key in ["k-one", "k-two"] {
        let r = client()
            .get(ts.url("/v1/models"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let r = client()
        .post(ts.url("/v1/chat/completions"))
        .json(&chat_body("x"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client()
        .post(ts.url("/v1/chat/completions"))
        .bearer_auth("k-two")
        .json(&chat_body("x"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_file_reads_keys_and_rejects_empty() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys");
    std::fs::write(&path, "# keys\nalpha\n\n  beta  \n").unwrap();
    assert_eq!(
        gdsllm_server::load_api_key_file(&path).unwrap(),
        ["alpha", "beta"]
    );
    std::fs::write(&path, "# none\n").unwrap();
    let err = gdsllm_server::load_api_key_file(&path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no key"), "{err}");
    let err = gdsllm_server::load_api_key_file(&dir.path().join("missing"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_tokens_and_engine_stats() {
    metrics_count(FakeEngine::new()).await;
    metrics_count(FakeEngine::batching(Duration::ZERO)).await;
}

async fn metrics_count(engine: FakeEngine) {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(engine)).await;
    let mut body = chat_body("hi");
    body["max_tokens"] = json!(3);
    post(&ts, "/v1/chat/completions", &body).await;
    post(&ts, "/v1/chat/completions", &body).await;
    body["model"] = json!("missing");
    post(&ts, "/v1/chat/completions", &body).await;
    let text = metrics_text(&ts).await;
    let prompt = chat_prompt(&user("hi")).len() as f64;
    let expected = [
        (
            "gdsllm_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}",
            2.0,
        ),
        (
            "gdsllm_requests_total{endpoint=\"/v1/chat/completions\",status=\"404\"}",
            1.0,
        ),
        ("gdsllm_generation_tokens_total", 6.0),
        ("gdsllm_prompt_tokens_total", 2.0 * prompt),
        ("gdsllm_time_to_first_token_seconds_count", 2.0),
        ("gdsllm_inter_token_latency_seconds_count", 4.0),
        ("gdsllm_requests_running", 0.0),
        ("gdsllm_requests_waiting", 0.0),
        ("gdsllm_weight_bytes_total{tier=\"disk\"}", 4096.0),
        ("gdsllm_weight_bytes_total{tier=\"host\"}", 8192.0),
        ("gdsllm_io_gbps", 2.5),
        ("gdsllm_residency_hits_total", 7.0),
        ("gdsllm_residency_misses_total", 3.0),
        ("gdsllm_compute_stall_seconds", 0.25),
    ];
    for (name, want) in expected {
        assert_eq!(metric(&text, name), Some(want), "{name}\n{text}");
    }
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_cancels_its_sequence() {
    disconnect_cancels(FakeEngine::slow(Duration::from_millis(40))).await;
    disconnect_cancels(FakeEngine::batching(Duration::from_millis(40))).await;
}

async fn disconnect_cancels(engine: FakeEngine) {
    let engine = Arc::new(engine);
    let ts = TestServer::start(ServerConfig::default(), engine.clone()).await;
    let mut body = chat_body("long story");
    body["stream"] = json!(true);
    let mut resp = client()
        .post(ts.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    // Read until the first content token arrives, then hang up.
    let mut seen = String::new();
    while !seen.contains("content\":\" ") {
        seen.push_str(&String::from_utf8_lossy(
            &resp.chunk().await.unwrap().unwrap(),
        ));
    }
    drop(resp);
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_cancelled_total", 1.0).await,
        1.0
    );
    let produced = engine.produced.lock().clone();
    let prompt = chat_prompt(&user("long story"));
    let full = FakeEngine::expected(&prompt, usize::MAX)
        .0
        .split_inclusive(' ')
        .count();
    assert_eq!(produced.len(), 1);
    assert!(
        produced[0] < full,
        "cancelled after {} of {full} tokens",
        produced[0]
    );

    // A non-streamed request whose client gives up is cancelled too.
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let err = quick
        .post(ts.url("/v1/chat/completions"))
        .json(&chat_body("long story"))
        .send()
        .await;
    assert!(err.is_err());
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_cancelled_total", 2.0).await,
        2.0
    );
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_running", 0.0).await,
        0.0
    );
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_each_get_their_own_answer() {
    concurrent_streams(FakeEngine::new(), ServerConfig::default()).await;
}

/// With batching, the streams run together, never more than `--max-batch` at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_streams_run_together_within_max_batch() {
    let engine = FakeEngine::batching(Duration::from_millis(5));
    let config = ServerConfig {
        max_batch: 4,
        ..ServerConfig::default()
    };
    let engine = concurrent_streams(engine, config).await;
    assert_eq!(*engine.most_running.lock(), 4);
    assert_eq!(engine.produced.lock().len(), 24);
}

async fn concurrent_streams(engine: FakeEngine, config: ServerConfig) -> Arc<FakeEngine> {
    let engine = Arc::new(engine);
    let ts = TestServer::start(config, engine.clone()).await;
    let prompts: Vec<String> = (0..24).map(|i| format!("question number {i}")).collect();
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let url = ts.url("/v1/chat/completions");
            let mut body = chat_body(p);
            body["stream"] = json!(true);
            tokio::spawn(async move {
                let text = client()
                    .post(url)
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap();
                let events = sse_data(&text);
                assert_eq!(events.last().unwrap(), "[DONE]");
                events[..events.len() - 1]
                    .iter()
                    .filter_map(|e| {
                        let c: Value = serde_json::from_str(e).unwrap();
                        c["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(str::to_string)
                    })
                    .collect::<String>()
            })
        })
        .collect();
    for (p, t) in prompts.iter().zip(tasks) {
        let got = t.await.unwrap();
        let expected = FakeEngine::expected(&chat_prompt(&user(p)), usize::MAX).0;
        assert_eq!(got, expected, "{p}");
    }
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_running", 0.0).await,
        0.0
    );
    ts.shutdown().await;
    engine
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_a_stream_finish_and_refuses_new_work() {
    shutdown_finishes(FakeEngine::slow(Duration::from_millis(20))).await;
    shutdown_finishes(FakeEngine::batching(Duration::from_millis(20))).await;
}

async fn shutdown_finishes(engine: FakeEngine) {
    let mut ts = TestServer::start(ServerConfig::default(), Arc::new(engine)).await;
    let mut body = chat_body("story");
    body["stream"] = json!(true);
    let resp = client()
        .post(ts.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    ts.trigger_shutdown();
    let text = resp.text().await.unwrap();
    let events = sse_data(&text);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let finish: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop", "{text}");
    ts.task.take().unwrap().await.unwrap().unwrap();
    assert!(
        client().get(ts.url("/health")).send().await.is_err(),
        "listener closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_what_outlives_the_grace_period() {
    shutdown_cancels(FakeEngine::slow(Duration::from_millis(300))).await;
    shutdown_cancels(FakeEngine::batching(Duration::from_millis(300))).await;
}

async fn shutdown_cancels(engine: FakeEngine) {
    let engine = Arc::new(engine);
    let config = ServerConfig {
        shutdown_grace: Duration::from_millis(100),
        ..Default::default()
    };
    let mut ts = TestServer::start(config, engine.clone()).await;
    let mut body = chat_body("story");
    body["stream"] = json!(true);
    let resp = client()
        .post(ts.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    ts.trigger_shutdown();
    let text = resp.text().await.unwrap();
    let events = sse_data(&text);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{text}"
    );
    ts.task.take().unwrap().await.unwrap().unwrap();
    let prompt = chat_prompt(&user("story"));
    let full = FakeEngine::expected(&prompt, usize::MAX)
        .0
        .split_inclusive(' ')
        .count();
    assert!(engine.produced.lock()[0] < full);
}

/// A long embeddings request is held in the engine; a short chat submitted behind it must get
/// its tokens after at most one more piece of embedding, not after all of it.
async fn long_embedding_does_not_stall_a_chat(mut engine: FakeEngine, config: ServerConfig) {
    const INPUTS: usize = 64;
    engine.context = 1024;
    let (release, gate) = std::sync::mpsc::channel();
    *engine.embed_gate.lock() = Some(gate);
    let engine = Arc::new(engine);
    let ts = TestServer::start(config, engine.clone()).await;
    // Inputs of 400 tokens: one per piece of EMBED_PIECE_TOKENS (512).
    let long_input = vec!["word"; 400].join(" ");
    let embed_body = json!({"input": vec![long_input; INPUTS]});
    let embed_url = ts.url("/v1/embeddings");
    let embedding = tokio::spawn(async move {
        let r = client()
            .post(embed_url)
            .json(&embed_body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    });
    // Wait until the worker is inside the first embed call (the gate was taken).
    for _ in 0..400 {
        if engine.embed_gate.lock().is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        engine.embed_gate.lock().is_none(),
        "the embedding never started"
    );
    let chat = tokio::spawn(post_url(ts.url("/v1/chat/completions"), chat_body("hello")));
    // The chat is queued behind the held worker before the embedding may go on.
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_waiting", 1.0).await,
        1.0
    );
    release.send(()).unwrap();
    let (status, body) = chat.await.unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, body) = embedding.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), INPUTS);
    let events = engine.events.lock().clone();
    let first_token = events.iter().position(|&e| e == "token").unwrap();
    let embeds_before = events[..first_token]
        .iter()
        .filter(|&&e| e == "embed")
        .count();
    println!("{embeds_before} of {INPUTS} inputs embedded before the chat's first token");
    // The input being embedded when the chat arrived, and at most one more piece.
    assert!(embeds_before <= 2, "{events:?}");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_embedding_shares_the_batched_worker() {
    let config = ServerConfig {
        max_batch: 4,
        ..ServerConfig::default()
    };
    long_embedding_does_not_stall_a_chat(FakeEngine::batching(Duration::ZERO), config).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_embedding_shares_the_serial_worker() {
    long_embedding_does_not_stall_a_chat(FakeEngine::new(), ServerConfig::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_with_retry_after() {
    // One running and two queued; the engine takes ~1 s per sequence, so all six requests
    // arrive while the first one runs.
    let config = ServerConfig {
        max_batch: 1,
        max_queue: 2,
        ..ServerConfig::default()
    };
    let ts = TestServer::start(
        config,
        Arc::new(FakeEngine::slow(Duration::from_millis(100))),
    )
    .await;
    let requests: Vec<_> = (0..6)
        .map(|i| {
            let url = ts.url("/v1/chat/completions");
            tokio::spawn(async move {
                let r = client()
                    .post(url)
                    .json(&chat_body(&format!("request {i}")))
                    .send()
                    .await
                    .unwrap();
                let retry_after = r.headers().get("retry-after").cloned();
                (
                    r.status().as_u16(),
                    retry_after,
                    r.json::<Value>().await.unwrap(),
                )
            })
        })
        .collect();
    let mut ok = 0;
    let mut busy = 0;
    for request in requests {
        let (status, retry_after, body) = request.await.unwrap();
        match status {
            200 => ok += 1,
            429 => {
                busy += 1;
                assert_eq!(retry_after.unwrap(), "1");
                let (msg, _) = error_of(&body);
                assert!(msg.contains("busy"), "{msg}");
            }
            other => panic!("{other}: {body}"),
        }
    }
    assert_eq!((ok, busy), (3, 3));
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_rejected_total", 3.0).await,
        3.0
    );
    // Once the queue drains there is room again.
    let (status, _) = post(&ts, "/v1/chat/completions", &chat_body("later")).await;
    assert_eq!(status, 200);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unimplemented_or_unusable_openai_fields_are_refused_by_name() {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    for (field, value) in [
        // Out of the vocabulary.
        ("logit_bias", json!({"5000": 5})),
        // This engine cannot constrain its output.
        ("response_format", json!({"type": "json_object"})),
        ("grammar", json!("start: \"a\"")),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        ("tool_choice", json!("required")),
    ] {
        let mut body = chat_body("hi");
        body[field] = value;
        let (status, body) = post(&ts, "/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{field}: {body}");
        let (msg, param) = error_of(&body);
        assert_eq!(param, json!(field), "{msg}");
    }
    ts.shutdown().await;
}

/// Reads from `stream` until the server closes it; true if it did within `limit`.
async fn closed_by_server(stream: &mut tokio::net::TcpStream, limit: Duration) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read_all = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(limit, read_all).await.ok()?;
    Some(got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_slow_bodies_are_cut_off() {
    use tokio::io::AsyncWriteExt;
    let config = ServerConfig {
        header_read_timeout: Duration::from_millis(300),
        body_read_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let ts = TestServer::start(config, Arc::new(FakeEngine::new())).await;
    let addr = ts.base.trim_start_matches("http://").to_string();
    // Headers that never end: the connection is closed.
    let mut half_open = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half_open
        .write_all(b"GET /health HTTP/1.1\r\nX: ")
        .await
        .unwrap();
    assert!(
        closed_by_server(&mut half_open, Duration::from_secs(10))
            .await
            .is_some(),
        "a connection that never finished its headers stayed open"
    );
    // A body that never arrives in full: 408.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 1000\r\n\r\n{\"messages\": ",
    )
    .await
    .unwrap();
    let answer = closed_by_server(&mut slow, Duration::from_secs(10))
        .await
        .expect("a request whose body never arrived was never answered");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_heads_are_refused() {
    use tokio::io::AsyncWriteExt;
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let addr = ts.base.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(200_000)
    );
    // The server may stop reading before all of it is written.
    let _ = s.write_all(head.as_bytes()).await;
    let answer = closed_by_server(&mut s, Duration::from_secs(10))
        .await
        .expect("no answer to an oversized head");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // Ordinary requests still work.
    let r = client().get(ts.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    ts.shutdown().await;
}
