//! Several models in one server (`server/src/models.rs`) against fake engines: a model loaded
//! on demand, requests waiting for a load in progress (one load for all of them), 429 when
//! every loaded model is busy at --max-models, 409 when unloading a busy model, the least
//! recently used idle model unloaded to make room; with a memory budget across models, idle
//! models unloaded for memory and 429 (409 for an operator) while busy ones hold it.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{FakeEngine, TestServer, metric, metrics_text};
use gdsllm_server::{
    Engine, MemoryBudget, MemoryNeed, ModelMemory, ModelSource, ServerConfig, SourceModel,
    TierBytes,
};
use parking_lot::Mutex;
use serde_json::{Value, json};

/// Serves `other` (a slow fake) besides the default; each load takes `load_time`.
struct FakeSource {
    load_time: Duration,
    loads: AtomicUsize,
}

fn source_model(name: &str) -> SourceModel {
    SourceModel {
        name: name.into(),
        aliases: Vec::new(),
        key: format!("key-{name}"),
    }
}

impl ModelSource for FakeSource {
    fn list(&self) -> Result<Vec<SourceModel>, String> {
        Ok(vec![source_model("fake-model"), source_model("other")])
    }

    fn find(&self, name: &str) -> Result<Option<SourceModel>, String> {
        Ok(self.list()?.into_iter().find(|m| m.name == name))
    }

    fn load(
        &self,
        model: &SourceModel,
        budget: Option<TierBytes>,
    ) -> Result<Arc<dyn Engine>, String> {
        assert_eq!(budget, None, "this server has no memory budget");
        std::thread::sleep(self.load_time);
        self.loads.fetch_add(1, Ordering::SeqCst);
        let engine = if model.name == "fake-model" {
            FakeEngine::slow(Duration::from_millis(20))
        } else {
            FakeEngine::new()
        };
        Ok(Arc::new(engine))
    }
}

/// A server with max_models 1, its default a slow fake, `other` loadable.
async fn start(load_time: Duration) -> (TestServer, Arc<FakeSource>) {
    let config = ServerConfig {
        max_models: 1,
        ..Default::default()
    };
    let ts = TestServer::start_loading(config).await;
    let source = Arc::new(FakeSource {
        load_time,
        loads: AtomicUsize::new(0),
    });
    ts.server
        .set_model_source(source.clone(), source_model("fake-model"));
    // Slow enough (300 ms a token, 9 to 12 tokens) that a request keeps it busy a while.
    ts.server
        .set_engine(Arc::new(FakeEngine::slow(Duration::from_millis(300))));
    (ts, source)
}

async fn post(ts: &TestServer, path: &str, body: &Value) -> (u16, Value, Option<String>) {
    let r = reqwest::Client::new()
        .post(ts.url(path))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (status, r.json().await.unwrap(), retry)
}

fn chat(model: &str, max_tokens: usize) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
           "max_tokens": max_tokens})
}

/// `/v1/models`.
async fn models_json(ts: &TestServer) -> Value {
    reqwest::get(ts.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn loaded(ts: &TestServer) -> Vec<(String, bool)> {
    let v = models_json(ts).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_models_are_not_unloaded_and_idle_ones_make_room() {
    let (ts, source) = start(Duration::ZERO).await;
    assert_eq!(
        loaded(&ts).await,
        [("fake-model".into(), true), ("other".into(), false)]
    );
    // A long request keeps the default busy.
    let long = tokio::spawn({
        let url = ts.url("/v1/chat/completions");
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .json(
                    &json!({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 40, "stream": true}),
                )
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.text().await.unwrap()
        }
    });
    // Wait until it runs.
    common::wait_for_metric(&ts, "gdsllm_requests_running", 1.0).await;
    // The model's own series says the same (the unlabelled one is the sum over models).
    assert_eq!(
        common::wait_for_metric(
            &ts,
            "gdsllm_model_requests_running{model=\"fake-model\"}",
            1.0
        )
        .await,
        1.0
    );
    let (status, body, _) = post(&ts, "/v1/models/fake-model/unload", &json!({})).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "model_busy");
    let (status, body, retry) = post(&ts, "/v1/chat/completions", &chat("other", 2)).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(retry.as_deref(), Some("1"));
    assert_eq!(source.loads.load(Ordering::SeqCst), 0);

    // Once it is done, the idle default makes room for the other model.
    let streamed = long.await.unwrap();
    assert!(streamed.contains("[DONE]"), "{streamed}");
    let (status, body, _) = post(&ts, "/v1/chat/completions", &chat("other", 2)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "other");
    assert_eq!(
        loaded(&ts).await,
        [("fake-model".into(), false), ("other".into(), true)]
    );
    let text = metrics_text(&ts).await;
    assert_eq!(metric(&text, "gdsllm_models_loaded"), Some(1.0));
    assert_eq!(
        metric(&text, "gdsllm_model_unloads_total{model=\"fake-model\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(&text, "gdsllm_model_evictions_total{reason=\"count\"}"),
        Some(1.0)
    );
    // A request naming no model goes to the default, which loads again.
    let mut body = chat("x", 2);
    body.as_object_mut().unwrap().remove("model");
    let (status, body, _) = post(&ts, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "fake-model");
    assert_eq!(source.loads.load(Ordering::SeqCst), 2);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_for_a_loading_model_wait_for_one_load() {
    let (ts, source) = start(Duration::from_millis(300)).await;
    let requests: Vec<_> = (0..3)
        .map(|_| {
            let url = ts.url("/v1/chat/completions");
            tokio::spawn(async move {
                let r = reqwest::Client::new()
                    .post(url)
                    .json(&chat("other", 2))
                    .send()
                    .await
                    .unwrap();
                r.status().as_u16()
            })
        })
        .collect();
    for r in requests {
        assert_eq!(r.await.unwrap(), 200);
    }
    assert_eq!(source.loads.load(Ordering::SeqCst), 1);
    let (status, body, _) = post(&ts, "/v1/chat/completions", &chat("missing", 2)).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    let (status, body, _) = post(&ts, "/v1/models/other/unload", &json!({})).await;
    assert_eq!((status, &body["unloaded"]), (200, &json!(true)), "{body}");
    let (status, body, _) = post(&ts, "/v1/models/other/unload", &json!({})).await;
    assert_eq!((status, &body["unloaded"]), (200, &json!(false)), "{body}");
    ts.shutdown().await;
}

/// Three models of 400 bytes of device memory each (300 at the least, all streamed) in a
/// budget of 1000: two fit as they would alone; the third needs one of them gone.
struct SizedSource {
    /// The server's budget.
    budget: TierBytes,
    /// Each load's name and the budget it was given.
    loads: Mutex<Vec<(String, Option<TierBytes>)>>,
}

const FULL: TierBytes = TierBytes::new(400, 40);
const MINIMUM: TierBytes = TierBytes::new(300, 0);
const BUDGET: TierBytes = TierBytes::new(1000, 100);

/// A fake that holds `held` of the budget and decodes a token every `token_ms` (a streamed
/// request of 9 to 12 tokens keeps it busy a while).
fn sized_engine(held: TierBytes, token_ms: u64) -> FakeEngine {
    FakeEngine {
        memory: Some(ModelMemory {
            held,
            budget: BUDGET,
            backend: "cpu",
        }),
        ..FakeEngine::slow(Duration::from_millis(token_ms))
    }
}

impl ModelSource for SizedSource {
    fn list(&self) -> Result<Vec<SourceModel>, String> {
        Ok(["fake-model", "b", "c"]
            .into_iter()
            .map(source_model)
            .collect())
    }

    fn find(&self, name: &str) -> Result<Option<SourceModel>, String> {
        Ok(self.list()?.into_iter().find(|m| m.name == name))
    }

    fn memory_need(
        &self,
        _model: &SourceModel,
        budget: TierBytes,
    ) -> Result<Option<MemoryNeed>, String> {
        assert_eq!(budget, self.budget);
        Ok(Some(MemoryNeed {
            full: FULL,
            minimum: MINIMUM,
        }))
    }

    fn load(
        &self,
        model: &SourceModel,
        budget: Option<TierBytes>,
    ) -> Result<Arc<dyn Engine>, String> {
        self.loads.lock().push((model.name.clone(), budget));
        let budget = budget.ok_or("no budget given")?;
        // As a residency plan would: what it needs, at most its budget. `c` is slower, so
        // that it is still busy when `b` is done.
        let token_ms = if model.name == "c" { 500 } else { 100 };
        Ok(Arc::new(sized_engine(FULL.min(budget), token_ms)))
    }
}

/// Starts a streamed request for `model` long enough to keep it busy; returns its body.
fn keep_busy(ts: &TestServer, model: &str) -> tokio::task::JoinHandle<String> {
    let url = ts.url("/v1/chat/completions");
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 40, "stream": true});
    tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap()
    })
}

/// A server with a memory budget of `budget` over [`SizedSource`]'s models, the default
/// loaded (holding [`FULL`]).
async fn start_sized(budget: TierBytes) -> (TestServer, Arc<SizedSource>) {
    let (ts, source, _) = start_sized_with_default(budget).await;
    (ts, source)
}

/// [`start_sized`], and the default model's engine.
async fn start_sized_with_default(
    budget: TierBytes,
) -> (TestServer, Arc<SizedSource>, Arc<dyn Engine>) {
    let config = ServerConfig {
        max_models: 3,
        memory_budget: Some(MemoryBudget {
            device: Some(budget.device),
            host: Some(budget.host),
        }),
        ..Default::default()
    };
    let ts = TestServer::start_loading(config).await;
    let source = Arc::new(SizedSource {
        budget,
        loads: Mutex::new(Vec::new()),
    });
    ts.server
        .set_model_source(source.clone(), source_model("fake-model"));
    let default: Arc<dyn Engine> = Arc::new(sized_engine(FULL, 100));
    ts.server.set_engine(default.clone());
    (ts, source, default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_budget_across_models_unloads_idle_ones_and_refuses_while_busy_ones_hold_it() {
    let (ts, source) = start_sized(BUDGET).await;

    // The second model fits beside the default, as it would alone.
    let (status, body, _) = post(&ts, "/v1/chat/completions", &chat("b", 2)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        loaded(&ts).await,
        [
            ("fake-model".into(), true),
            ("b".into(), true),
            ("c".into(), false)
        ]
    );
    let models = models_json(&ts).await;
    assert_eq!(
        models["data"][1]["memory_bytes"],
        json!({"device": 400, "host": 40})
    );
    assert_eq!(
        models["memory"]["held_bytes"],
        json!({"device": 800, "host": 80})
    );
    assert_eq!(
        models["memory"]["budget_bytes"],
        json!({"device": 1000, "host": 100})
    );

    // The third does not fit (200 left, 300 at the least): the least recently used idle
    // model (the default, last used before `b`) is unloaded, and `c` gets what it would alone.
    let (status, body, _) = post(&ts, "/v1/chat/completions", &chat("c", 2)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        loaded(&ts).await,
        [
            ("fake-model".into(), false),
            ("b".into(), true),
            ("c".into(), true)
        ]
    );
    assert_eq!(
        source.loads.lock().last(),
        Some(&("c".to_string(), Some(FULL)))
    );
    let text = metrics_text(&ts).await;
    assert_eq!(
        metric(&text, "gdsllm_model_evictions_total{reason=\"memory\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            "gdsllm_model_memory_bytes{model=\"fake-model\",tier=\"device\"}"
        ),
        Some(0.0)
    );
    assert_eq!(
        metric(
            &text,
            "gdsllm_model_memory_bytes{model=\"c\",tier=\"device\"}"
        ),
        Some(400.0)
    );
    assert_eq!(
        metric(&text, "gdsllm_memory_budget_bytes{tier=\"device\"}"),
        Some(1000.0)
    );
    // The unloaded default's memory is free once its engine is gone.
    assert_eq!(
        common::wait_for_metric(&ts, "gdsllm_memory_held_bytes{tier=\"device\"}", 800.0).await,
        800.0
    );

    // Both loaded models busy: the default cannot get even its smallest plan.
    let busy_b = keep_busy(&ts, "b");
    let busy_c = keep_busy(&ts, "c");
    assert_eq!(
        common::wait_for_metric(&ts, "gdsllm_requests_running", 2.0).await,
        2.0
    );
    let (status, body, retry) = post(&ts, "/v1/chat/completions", &chat("fake-model", 2)).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(retry.as_deref(), Some("1"));
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("memory budget") && message.contains("--vram-budget"),
        "{message}"
    );
    // An operator's load is refused the same way, as a conflict.
    let (status, body, _) = post(&ts, "/v1/models/fake-model/load", &json!({})).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "model_busy");
    assert_eq!(source.loads.lock().len(), 2, "nothing loaded while refused");

    // Once `b` is done, it makes room (`c`, slower, is still busy and stays).
    let streamed = busy_b.await.unwrap();
    assert!(streamed.contains("[DONE]"), "{streamed}");
    let (status, body, _) = post(&ts, "/v1/chat/completions", &chat("fake-model", 2)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        loaded(&ts).await,
        // The loaded ones first.
        [
            ("fake-model".into(), true),
            ("c".into(), true),
            ("b".into(), false)
        ]
    );
    let text = metrics_text(&ts).await;
    assert_eq!(
        metric(&text, "gdsllm_model_evictions_total{reason=\"memory\"}"),
        Some(2.0)
    );
    let streamed = busy_c.await.unwrap();
    assert!(streamed.contains("[DONE]"), "{streamed}");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_loads_smaller_when_busy_models_leave_less_than_it_would_take_alone() {
    // 700: the default's 400 leaves 300 of device memory, the least `b` runs with.
    let (ts, source) = start_sized(TierBytes::new(700, 100)).await;
    let busy = keep_busy(&ts, "fake-model");
    assert_eq!(
        common::wait_for_metric(&ts, "gdsllm_requests_running", 1.0).await,
        1.0
    );
    let (status, body, _) = post(&ts, "/v1/chat/completions", &chat("b", 2)).await;
    assert_eq!(status, 200, "{body}");
    // Given what is left of the device budget, and what it wants of the host tier.
    assert_eq!(
        source.loads.lock().last(),
        Some(&("b".to_string(), Some(TierBytes::new(300, 40))))
    );
    let models = models_json(&ts).await;
    assert_eq!(
        models["memory"]["held_bytes"],
        json!({"device": 700, "host": 80})
    );
    let text = metrics_text(&ts).await;
    assert_eq!(
        metric(
            &text,
            "gdsllm_model_memory_bytes{model=\"b\",tier=\"device\"}"
        ),
        Some(300.0)
    );
    assert_eq!(
        metric(&text, "gdsllm_model_evictions_total{reason=\"memory\"}"),
        None,
        "nothing was unloaded"
    );
    assert!(busy.await.unwrap().contains("[DONE]"));
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_waits_until_the_model_unloaded_for_it_is_gone() {
    // The test keeps a handle on the default's engine: unloaded, it is not freed until that
    // handle goes too.
    let (ts, source, default) = start_sized_with_default(BUDGET).await;
    let (status, body, _) = post(&ts, "/v1/chat/completions", &chat("b", 2)).await;
    assert_eq!(status, 200, "{body}");
    let third = tokio::spawn({
        let url = ts.url("/v1/chat/completions");
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .json(&chat("c", 2))
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }
    });
    // The default is unloaded for `c`, but its memory still counts as held.
    assert_eq!(
        common::wait_for_metric(&ts, "gdsllm_model_evictions_total{reason=\"memory\"}", 1.0).await,
        1.0
    );
    let text = metrics_text(&ts).await;
    assert_eq!(
        metric(&text, "gdsllm_memory_held_bytes{tier=\"device\"}"),
        Some(1200.0),
        "the default (being freed), b, and c's budget"
    );
    assert!(
        source.loads.lock().iter().all(|(name, _)| name != "c"),
        "c loaded while the default's engine was still held"
    );
    drop(default);
    assert_eq!(third.await.unwrap(), 200);
    assert_eq!(
        source.loads.lock().last(),
        Some(&("c".to_string(), Some(FULL)))
    );
    assert_eq!(
        common::wait_for_metric(&ts, "gdsllm_memory_held_bytes{tier=\"device\"}", 800.0).await,
        800.0
    );
    ts.shutdown().await;
}
