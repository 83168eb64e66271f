//! `GET /v1/ws` (JSON-RPC 2.0 over a WebSocket) against the fake engine: streaming and the same
//! answers as REST, error codes over the wire, auth, cancel, limits, disconnects, io_events
//! and 200 concurrent streams.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{FakeEngine, TestServer, wait_for_metric};
use futures::{SinkExt, StreamExt};
use gdsllm_server::ServerConfig;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

fn ws_url(ts: &TestServer) -> String {
    ts.url("/v1/ws").replacen("http://", "ws://", 1)
}

async fn connect(ts: &TestServer) -> Socket {
    tokio_tungstenite::connect_async(ws_url(ts))
        .await
        .unwrap()
        .0
}

async fn send(ws: &mut Socket, v: Value) {
    ws.send(Message::Text(v.to_string().into())).await.unwrap();
}

async fn call(ws: &mut Socket, id: u64, method: &str, params: Value) {
    send(
        ws,
        json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
    )
    .await;
}

/// The next JSON message (30 s at most).
async fn next(ws: &mut Socket) -> Value {
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .expect("no message within 30 s")
            .expect("the socket closed")
            .unwrap();
        if let Message::Text(t) = frame {
            return serde_json::from_str(t.as_str()).unwrap();
        }
    }
}

/// Reads until the answer to `id`: (its `token` notifications' params, the answer).
async fn answer(ws: &mut Socket, id: u64) -> (Vec<Value>, Value) {
    let mut tokens = Vec::new();
    loop {
        let m = next(ws).await;
        assert_eq!(m["jsonrpc"], "2.0", "{m}");
        if m["method"] == "token" && m["params"]["request"] == id {
            tokens.push(m["params"].clone());
        } else if m["id"] == id {
            return (tokens, m);
        }
    }
}

async fn rest(ts: &TestServer, path: &str, body: &Value) -> Value {
    reqwest::Client::new()
        .post(ts.url(path))
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_and_chat_stream_tokens_and_answer_as_rest_does() {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let mut ws = connect(&ts).await;

    let body = json!({"prompt": "one two three", "max_tokens": 5, "temperature": 0});
    call(&mut ws, 1, "generate", body.clone()).await;
    let (tokens, done) = answer(&mut ws, 1).await;
    let reference = rest(&ts, "/v1/completions", &body).await;
    let result = &done["result"];
    assert_eq!(result["text"], reference["choices"][0]["text"], "{done}");
    assert_eq!(
        result["finish_reason"],
        reference["choices"][0]["finish_reason"]
    );
    assert_eq!(result["usage"], reference["usage"]);
    assert_eq!(tokens.len(), 5);
    let streamed: String = tokens.iter().map(|t| t["text"].as_str().unwrap()).collect();
    assert_eq!(json!(streamed), result["text"]);
    let ids: Vec<Value> = tokens.iter().map(|t| t["token_id"].clone()).collect();
    assert_eq!(json!(ids), result["token_ids"]);
    assert_eq!(tokens[4]["index"], 4);

    let body = json!({"messages": [{"role": "user", "content": "hello there"}], "temperature": 0});
    call(&mut ws, 2, "chat", body.clone()).await;
    let (_, done) = answer(&mut ws, 2).await;
    let reference = rest(&ts, "/v1/chat/completions", &body).await;
    assert_eq!(
        done["result"]["text"],
        reference["choices"][0]["message"]["content"]
    );
    assert_eq!(done["result"]["finish_reason"], "stop");
    assert_eq!(done["result"]["model"], "fake-model");

    call(&mut ws, 3, "models", json!({})).await;
    let (_, models) = answer(&mut ws, 3).await;
    assert_eq!(models["result"]["data"][0]["id"], "fake-model");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_json_rpc_codes_over_the_wire() {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let mut ws = connect(&ts).await;
    ws.send(Message::Text("{oops".into())).await.unwrap();
    let m = next(&mut ws).await;
    assert_eq!(m["error"]["code"], -32700, "{m}");
    assert_eq!(m["id"], Value::Null);

    send(
        &mut ws,
        json!({"jsonrpc": "2.0", "method": "models", "id": [1]}),
    )
    .await;
    assert_eq!(next(&mut ws).await["error"]["code"], -32600);
    ws.send(Message::Binary(vec![1, 2].into())).await.unwrap();
    assert_eq!(next(&mut ws).await["error"]["code"], -32600);

    call(&mut ws, 4, "summon", json!({})).await;
    let m = next(&mut ws).await;
    assert_eq!(
        (m["id"].clone(), m["error"]["code"].clone()),
        (json!(4), json!(-32601))
    );

    call(
        &mut ws,
        5,
        "generate",
        json!({"prompt": "x", "max_tokens": -3}),
    )
    .await;
    let m = next(&mut ws).await;
    assert_eq!(m["error"]["code"], -32602, "{m}");
    assert_eq!(m["error"]["data"]["param"], "max_tokens", "{m}");

    call(
        &mut ws,
        6,
        "chat",
        json!({"messages": [{"role": "user", "content": "x"}], "model": "other"}),
    )
    .await;
    let m = next(&mut ws).await;
    assert_eq!(m["error"]["data"]["param"], "model", "{m}");

    call(
        &mut ws,
        7,
        "embed",
        json!({"input": "x", "quantize": "int3"}),
    )
    .await;
    let m = next(&mut ws).await;
    assert_eq!(m["error"]["data"]["param"], "quantize", "{m}");
    call(&mut ws, 8, "embed", json!({"input": "x", "dimensions": 9})).await;
    let m = next(&mut ws).await;
    assert_eq!(m["error"]["code"], -32602, "{m}");
    assert!(m["error"]["message"].as_str().unwrap().contains("9"), "{m}");
    call(&mut ws, 9, "io_events", json!({"interval_ms": 1})).await;
    assert_eq!(next(&mut ws).await["error"]["data"]["param"], "interval_ms");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_by_header_or_first_message() {
    let config = ServerConfig {
        api_keys: vec!["sesame".into()],
        ..Default::default()
    };
    let ts = TestServer::start(config, Arc::new(FakeEngine::new())).await;

    let mut wrong = ws_url(&ts).into_client_request().unwrap();
    wrong
        .headers_mut()
        .insert("authorization", "Bearer nope".parse().unwrap());
    match tokio_tungstenite::connect_async(wrong).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => assert_eq!(r.status(), 401),
        other => panic!("a wrong key must be refused before the upgrade: {other:?}"),
    }

    let mut right = ws_url(&ts).into_client_request().unwrap();
    right
        .headers_mut()
        .insert("authorization", "Bearer sesame".parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(right).await.unwrap();
    call(&mut ws, 1, "models", json!({})).await;
    assert!(next(&mut ws).await["result"]["data"].is_array());

    let mut ws = connect(&ts).await;
    call(&mut ws, 1, "generate", json!({"prompt": "x"})).await;
    let m = next(&mut ws).await;
    assert_eq!(m["error"]["code"], -32001, "{m}");
    call(&mut ws, 2, "auth", json!({"key": "guess"})).await;
    let m = next(&mut ws).await;
    assert_eq!(m["error"]["code"], -32001, "{m}");
    assert!(
        !m.to_string().contains("guess"),
        "the key must not be echoed: {m}"
    );
    call(&mut ws, 3, "auth", json!({"key": "sesame"})).await;
    assert_eq!(next(&mut ws).await["result"]["authenticated"], true);
    call(
        &mut ws,
        4,
        "generate",
        json!({"prompt": "x", "max_tokens": 2}),
    )
    .await;
    let (tokens, done) = answer(&mut ws, 4).await;
    assert_eq!(tokens.len(), 2, "{done}");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_a_running_generation() {
    let engine = Arc::new(FakeEngine::batching(Duration::from_millis(40)));
    let ts = TestServer::start(ServerConfig::default(), engine).await;
    let mut ws = connect(&ts).await;
    call(
        &mut ws,
        1,
        "generate",
        json!({"prompt": "a", "max_tokens": 12}),
    )
    .await;
    let first = next(&mut ws).await;
    assert_eq!(first["method"], "token", "{first}");
    call(&mut ws, 2, "cancel", json!({"id": 1})).await;
    let (mut cancel_answer, mut generate_answer) = (None, None);
    while cancel_answer.is_none() || generate_answer.is_none() {
        let m = next(&mut ws).await;
        match m["id"].as_u64() {
            Some(1) => generate_answer = Some(m),
            Some(2) => cancel_answer = Some(m),
            _ => {}
        }
    }
    assert_eq!(cancel_answer.unwrap()["result"]["cancelled"], true);
    let g = generate_answer.unwrap();
    assert_eq!(g["result"]["finish_reason"], "cancelled", "{g}");
    assert!(g["result"]["usage"]["completion_tokens"].as_u64().unwrap() < 12);
    // A finished id is no longer cancellable.
    call(&mut ws, 3, "cancel", json!({"id": 1})).await;
    assert_eq!(next(&mut ws).await["result"]["cancelled"], false);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_sequence() {
    let engine = Arc::new(FakeEngine::batching(Duration::from_millis(40)));
    let ts = TestServer::start(ServerConfig::default(), engine.clone()).await;
    let mut ws = connect(&ts).await;
    call(
        &mut ws,
        1,
        "generate",
        json!({"prompt": "a", "max_tokens": 12}),
    )
    .await;
    assert_eq!(next(&mut ws).await["method"], "token");
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_running", 1.0).await,
        1.0
    );
    drop(ws);
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_cancelled_total", 1.0).await,
        1.0
    );
    assert_eq!(
        wait_for_metric(&ts, "gdsllm_requests_running", 0.0).await,
        0.0
    );
    let produced = engine.produced.lock().clone();
    assert_eq!(produced.len(), 1, "{produced:?}");
    assert!(produced[0] < 11, "cancelled after {} tokens", produced[0]);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_server_busy() {
    let config = ServerConfig {
        max_batch: 1,
        max_queue: 0,
        ..Default::default()
    };
    let ts = TestServer::start(
        config,
        Arc::new(FakeEngine::slow(Duration::from_millis(40))),
    )
    .await;
    let mut ws = connect(&ts).await;
    call(
        &mut ws,
        1,
        "generate",
        json!({"prompt": "a", "max_tokens": 8}),
    )
    .await;
    assert_eq!(next(&mut ws).await["method"], "token");
    call(
        &mut ws,
        2,
        "generate",
        json!({"prompt": "b", "max_tokens": 8}),
    )
    .await;
    let (_, busy) = answer(&mut ws, 2).await;
    assert_eq!(busy["error"]["code"], -32002, "{busy}");
    assert_eq!(busy["error"]["data"]["retry_after_seconds"], 1);
    let (_, first) = answer(&mut ws, 1).await;
    assert!(first["result"]["text"].is_string(), "{first}");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embed_truncates_renormalises_and_quantises_rest_vectors() {
    let ts = TestServer::start(ServerConfig::default(), Arc::new(FakeEngine::new())).await;
    let reference = rest(
        &ts,
        "/v1/embeddings",
        &json!({"input": ["red fox", "blue"]}),
    )
    .await;
    let full: Vec<Vec<f32>> = reference["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| serde_json::from_value(d["embedding"].clone()).unwrap())
        .collect();
    let mut ws = connect(&ts).await;

    call(&mut ws, 1, "embed", json!({"input": ["red fox", "blue"]})).await;
    let (_, m) = answer(&mut ws, 1).await;
    for (i, v) in full.iter().enumerate() {
        let got: Vec<f32> =
            serde_json::from_value(m["result"]["data"][i]["embedding"].clone()).unwrap();
        assert_eq!(&got, v);
    }
    assert_eq!(m["result"]["usage"], reference["usage"]);

    call(
        &mut ws,
        2,
        "embed",
        json!({"input": "red fox", "dimensions": 3}),
    )
    .await;
    let (_, m) = answer(&mut ws, 2).await;
    let got: Vec<f32> =
        serde_json::from_value(m["result"]["data"][0]["embedding"].clone()).unwrap();
    let norm = full[0][..3].iter().map(|x| x * x).sum::<f32>().sqrt();
    let max_err = got
        .iter()
        .zip(&full[0][..3])
        .map(|(g, x)| (g - x / norm).abs())
        .fold(0f32, f32::max);
    println!("truncated + renormalised: max abs error {max_err} (tolerance 1e-6)");
    assert!(max_err <= 1e-6);

    call(
        &mut ws,
        3,
        "embed",
        json!({"input": "red fox", "quantize": "int8"}),
    )
    .await;
    let (_, m) = answer(&mut ws, 3).await;
    let item = &m["result"]["data"][0];
    let scale = item["scale"].as_f64().unwrap() as f32;
    let q: Vec<i8> = serde_json::from_value(item["embedding"].clone()).unwrap();
    let max_err = q
        .iter()
        .zip(&full[0])
        .map(|(q, x)| (*q as f32 * scale - x).abs())
        .fold(0f32, f32::max);
    println!(
        "int8: max abs error {max_err} (tolerance half a step, {})",
        scale / 2.0
    );
    assert!(max_err <= scale / 2.0 + 1e-6);

    call(
        &mut ws,
        4,
        "embed",
        json!({"input": "red fox", "quantize": "binary"}),
    )
    .await;
    let (_, m) = answer(&mut ws, 4).await;
    let item = &m["result"]["data"][0];
    let bytes: Vec<u8> = serde_json::from_value(item["embedding"].clone()).unwrap();
    assert_eq!(item["bits"], full[0].len());
    for (i, x) in full[0].iter().enumerate() {
        let bit = bytes[i / 8] >> (7 - i % 8) & 1;
        assert_eq!(bit == 1, *x > 0.0, "component {i} = {x}");
    }
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_events_stream_pass_statistics_while_requests_run() {
    let engine = Arc::new(FakeEngine::batching(Duration::from_millis(20)));
    let ts = TestServer::start(ServerConfig::default(), engine).await;
    let mut ws = connect(&ts).await;
    call(&mut ws, 1, "io_events", json!({"interval_ms": 10})).await;
    let sub = next(&mut ws).await["result"].clone();
    assert!(sub.is_string(), "{sub}");
    call(
        &mut ws,
        2,
        "generate",
        json!({"prompt": "a", "max_tokens": 8}),
    )
    .await;
    let mut events = Vec::new();
    let mut done = false;
    while !done || events.is_empty() {
        let m = next(&mut ws).await;
        if m["method"] == "io_events" {
            assert_eq!(m["params"]["subscription"], sub);
            events.push(m["params"]["result"].clone());
        } else if m["id"] == 2 {
            done = true;
        }
    }
    let passes: u64 = events.iter().map(|e| e["passes"].as_u64().unwrap()).sum();
    assert!(passes >= 1, "{events:?}");
    for e in &events {
        assert!(
            e["bytes_by_tier"].is_object() && e["gbps"].is_number(),
            "{e}"
        );
        assert!(
            e["stall_seconds"].is_number() && e["held_by_tier"]["resident"] == 1 << 20,
            "{e}"
        );
    }
    call(
        &mut ws,
        3,
        "io_events_unsubscribe",
        json!({"subscription": sub}),
    )
    .await;
    let (_, m) = answer(&mut ws, 3).await;
    assert_eq!(m["result"]["unsubscribed"], true);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_complete() {
    let config = ServerConfig {
        max_batch: 32,
        ..Default::default()
    };
    let ts = TestServer::start(
        config,
        Arc::new(FakeEngine::batching(Duration::from_millis(2))),
    )
    .await;
    let url = ws_url(&ts);
    let clients: Vec<_> = (0..200u64)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let (mut ws, _) = tokio_tungstenite::connect_async(url).await.unwrap();
                let prompt = format!("client {i}");
                call(
                    &mut ws,
                    i,
                    "generate",
                    json!({"prompt": prompt, "max_tokens": 4}),
                )
                .await;
                let (tokens, done) = answer(&mut ws, i).await;
                assert!(done.get("error").is_none(), "{done}");
                let text: String = tokens.iter().map(|t| t["text"].as_str().unwrap()).collect();
                assert_eq!(json!(text), done["result"]["text"]);
                let expected = FakeEngine::expected(&FakeEngine::tokenize_text(&prompt, true), 4).0;
                assert_eq!(text, expected);
            })
        })
        .collect();
    for c in clients {
        c.await.unwrap();
    }
    ts.shutdown().await;
}
