//! The serving surface around the model (issue 19): CORS for browser front-ends and the
//! server-side system prompts, against the fake engine.

mod common;

use std::sync::Arc;

use common::{FakeEngine, TestServer, metrics_text};
use gdsllm_server::cors::CorsOrigins;
use gdsllm_server::{ChatMessage, ServerConfig};
use serde_json::json;

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

const ORIGIN: &str = "http://localhost:3000";

/// POSTs `body` to `/v1/chat/completions`, with an `Origin` and a key when given.
async fn chat(
    ts: &TestServer,
    body: &serde_json::Value,
    origin: Option<&str>,
    key: Option<&str>,
) -> reqwest::Response {
    let mut request = client().post(ts.url("/v1/chat/completions")).json(body);
    if let Some(origin) = origin {
        request = request.header("Origin", origin);
    }
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request.send().await.unwrap()
}

/// A browser's preflight for a chat request with a key: method OPTIONS, no credentials.
async fn preflight(ts: &TestServer, origin: &str) -> reqwest::Response {
    client()
        .request(reqwest::Method::OPTIONS, ts.url("/v1/chat/completions"))
        .header("Origin", origin)
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "authorization,content-type",
        )
        .send()
        .await
        .unwrap()
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_preflight_is_answered_without_a_key_and_requests_carry_the_origin() {
    let config = ServerConfig {
        api_keys: vec!["sekret".into()],
        cors_origins: Some(CorsOrigins::parse(ORIGIN).unwrap()),
        ..Default::default()
    };
    let ts = TestServer::start(config, Arc::new(FakeEngine::new())).await;

    let r = preflight(&ts, ORIGIN).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some(ORIGIN)
    );
    let methods = header(&r, "access-control-allow-methods").unwrap();
    assert!(methods.contains("POST"), "{methods}");
    let headers = header(&r, "access-control-allow-headers").unwrap();
    assert!(headers.contains("authorization"), "{headers}");

    // Another origin gets no allow header: the browser refuses it.
    let r = preflight(&ts, "http://evil.test").await;
    assert_eq!(header(&r, "access-control-allow-origin"), None);

    // The request itself still needs the key, and its response names the origin.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let r = chat(&ts, &body, Some(ORIGIN), None).await;
    assert_eq!(r.status(), 401);
    let r = chat(&ts, &body, Some(ORIGIN), Some("sekret")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some(ORIGIN)
    );
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_star_allows_any_origin_and_no_cors_sends_no_headers() {
    let config = ServerConfig {
        cors_origins: Some(CorsOrigins::parse("*").unwrap()),
        ..Default::default()
    };
    let ts = TestServer::start(config, Arc::new(FakeEngine::new())).await;
    let r = preflight(&ts, "http://anywhere.test").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some("*")
    );
    ts.shutdown().await;

    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let r = client()
        .get(ts.url("/v1/models"))
        .header("Origin", ORIGIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "access-control-allow-origin"), None);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_named_system_prompt_replaces_the_default_for_that_name() {
    let engine = Arc::new(FakeEngine::new());
    let config = ServerConfig {
        aliases: vec!["helper".into()],
        system_prompt: Some("Default.".into()),
        model_system_prompts: vec![("helper".into(), "Helper's own.".into())],
        ..Default::default()
    };
    let ts = TestServer::start(config, engine.clone()).await;
    for model in ["fake-model", "helper"] {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        assert_eq!(chat(&ts, &body, None, None).await.status(), 200);
    }
    let rendered = engine.rendered.lock().clone();
    let system = |content: &str| ChatMessage::new("system", content);
    assert_eq!(rendered[0][0], system("Default."));
    assert_eq!(rendered[1][0], system("Helper's own."));
    assert_eq!(rendered[1][1].role, "user");
    ts.shutdown().await;
}

/// The value of the sample `name` (no labels) in a Prometheus text exposition.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_the_batch_s_kv_usage_and_prefix_cache_counters() {
    let engine = Arc::new(FakeEngine::batching(std::time::Duration::ZERO));
    let config = ServerConfig {
        max_batch: 4,
        ..Default::default()
    };
    let ts = TestServer::start(config, engine.clone()).await;
    let text = metrics_text(&ts).await;
    assert_eq!(sample(&text, "gdsllm_prefix_cache_queries_total"), 0.0);
    assert_eq!(sample(&text, "gdsllm_kv_cache_usage_perc"), 0.0);
    let body =
        json!({"messages": [{"role": "user", "content": "the same words"}], "max_tokens": 2});
    for _ in 0..2 {
        assert_eq!(chat(&ts, &body, None, None).await.status(), 200);
    }
    let prompt_len = engine.requests.lock()[0].prompt.len() as f64;
    let text = metrics_text(&ts).await;
    assert_eq!(
        sample(&text, "gdsllm_prefix_cache_queries_total"),
        2.0 * prompt_len
    );
    // The fake serves a prompt it has seen whole from its "cache".
    assert_eq!(sample(&text, "gdsllm_prefix_cache_hits_total"), prompt_len);
    assert!(
        text.contains("# TYPE gdsllm_kv_cache_usage_perc gauge"),
        "{text}"
    );
    ts.shutdown().await;
}

/// A greedy chat answer's text and its prompt's token count.
async fn answer(ts: &TestServer, body: &serde_json::Value) -> (String, u64) {
    let r = chat(ts, body, None, None).await;
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    (
        text.to_string(),
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
    )
}

/// A chat with SmolLM2 on the CPU through `open_serving` with prefix caching (ctx 2048).
fn smollm2_server_engine(prefix_cache_bytes: u64) -> Option<Arc<dyn gdsllm_server::Engine>> {
    let dir = common::model_dir()?;
    let options = llama::OpenOptions {
        context: 2048,
        sequences: 2,
        ..llama::OpenOptions::default()
    };
    let engine = gdsllm_server::open_serving(
        &dir,
        "smol",
        llama::Device::Cpu,
        &options,
        prefix_cache_bytes,
    );
    Some(engine.unwrap())
}

/// A second request with the same long system prompt is served its positions from the
/// prefix cache (the hit counter moves by whole blocks of them), and its answer is the
/// greedy answer of a server without the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_shared_system_prompt_hits_the_prefix_cache_and_answers_the_same() {
    let Some(cached) = smollm2_server_engine(256 << 20) else {
        return;
    };
    let plain = smollm2_server_engine(0).unwrap();
    let system = "You are a careful assistant for a library. ".repeat(40);
    let ask = |question: &str| {
        json!({
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "temperature": 0,
            "max_tokens": 6,
        })
    };
    let config = || ServerConfig {
        max_batch: 2,
        ..Default::default()
    };
    let with_cache = TestServer::start_loading(config()).await;
    with_cache.server.set_engine(cached);
    let without = TestServer::start_loading(config()).await;
    without.server.set_engine(plain);

    let questions = ["Which books are new?", "When do you open?"];
    let mut answers = Vec::new();
    for q in questions {
        answers.push(answer(&with_cache, &ask(q)).await);
    }
    let text = metrics_text(&with_cache).await;
    let queried = sample(&text, "gdsllm_prefix_cache_queries_total");
    let hits = sample(&text, "gdsllm_prefix_cache_hits_total");
    println!("prefix cache: {hits} of {queried} prompt tokens served");
    let (first_len, second_len) = (answers[0].1 as f64, answers[1].1 as f64);
    assert_eq!(queried, first_len + second_len);
    // The system prompt is ~360 tokens: most of the second prompt came from the cache.
    assert!(hits >= 256.0 && hits < second_len, "{hits} of {second_len}");
    assert_eq!(hits % llama::PREFIX_BLOCK as f64, 0.0);
    assert!(sample(&text, "gdsllm_prefix_cache_bytes") > 0.0);

    // The second answer is the one computed on cached positions.
    let (plain_text, _) = answer(&without, &ask(questions[1])).await;
    assert_eq!(answers[1].0, plain_text);
    let text = metrics_text(&without).await;
    assert_eq!(sample(&text, "gdsllm_prefix_cache_hits_total"), 0.0);
    with_cache.shutdown().await;
    without.shutdown().await;
}
