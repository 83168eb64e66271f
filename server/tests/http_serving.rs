//! The serving surface around the model (issue 19): CORS for browser front-ends and the
//! server-side system prompts, against the fake engine.

mod common;

use std::sync::Arc;

use common::{FakeEngine, TestServer};
use gdsllm_server::cors::CorsOrigins;
use gdsllm_server::{ChatMessage, ServerConfig};
use serde_json::json;

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

const ORIGIN: &str = "http://localhost:3000";

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
    let r = client()
        .post(ts.url("/v1/chat/completions"))
        .header("Origin", ORIGIN)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client()
        .post(ts.url("/v1/chat/completions"))
        .header("Origin", ORIGIN)
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await
        .unwrap();
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
        let r = client()
            .post(ts.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let rendered = engine.rendered.lock().clone();
    let system = |content: &str| ChatMessage {
        role: "system".into(),
        content: content.into(),
    };
    assert_eq!(rendered[0][0], system("Default."));
    assert_eq!(rendered[1][0], system("Helper's own."));
    assert_eq!(rendered[1][1].role, "user");
    ts.shutdown().await;
}
