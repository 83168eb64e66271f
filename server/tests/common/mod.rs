//! A small deterministic engine and an in-process server for the HTTP tests.
#![allow(dead_code)]

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use gdsllm_server::{
    CacheUsage, CancelToken, ChatMessage, Engine, EngineBatch, EngineError, EngineFinish,
    EngineStats, GeneratedToken, GenerationRequest, ModelMemory, Server, ServerConfig,
    TokenLogprob,
};
use parking_lot::Mutex;

/// The converted SmolLM2 of `GDSLLM_TEST_MODEL`; `None` (skip) only when
/// `GDSLLM_SKIP_MODEL_TESTS=1`, a panic otherwise.
pub fn model_dir() -> Option<std::path::PathBuf> {
    gdsllm_convert::testing::model_path("GDSLLM_TEST_MODEL")
}

/// The words the fake model "generates", in order, starting at an offset taken from the prompt.
pub const SCRIPT: &[&str] = &[
    " alpha", " beta", " gamma", " delta", " epsilon", " zeta", " eta", " theta", " iota",
    " kappa", " lambda", " mu",
];
pub const BOS: u32 = 1;
pub const EMBED_DIM: usize = 8;
pub const VOCAB: u32 = 5000;

/// Generates `SCRIPT[start..]` then EOS, where `start = sum(prompt) % 4`; token ids are
/// `100 + index into SCRIPT`. Records what it was asked.
pub struct FakeEngine {
    pub context: usize,
    pub token_delay: Duration,
    pub requests: Mutex<Vec<GenerationRequest>>,
    pub rendered: Mutex<Vec<Vec<ChatMessage>>>,
    /// Tokens handed out per generate call (to see where cancelled sequences stopped).
    pub produced: Mutex<Vec<usize>>,
    /// Whether `batch` gives a batch (continuous batching) instead of `None`.
    pub batching: bool,
    /// The most sequences a batch step has run at once.
    pub most_running: Mutex<usize>,
    /// What the engine did, in order: "embed" per embedded input, "token" per generated token.
    pub events: Mutex<Vec<&'static str>>,
    /// When set, the first `embed` call waits for a message on it (or 10 s) before it works:
    /// tests submit more requests while the worker is held there.
    pub embed_gate: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    /// What [`Engine::memory`] reports (`None`: nothing, as an engine that does not know).
    pub memory: Option<ModelMemory>,
}

impl FakeEngine {
    pub fn new() -> FakeEngine {
        FakeEngine {
            context: 64,
            token_delay: Duration::ZERO,
            requests: Mutex::new(Vec::new()),
            rendered: Mutex::new(Vec::new()),
            produced: Mutex::new(Vec::new()),
            batching: false,
            most_running: Mutex::new(0),
            events: Mutex::new(Vec::new()),
            embed_gate: Mutex::new(None),
            memory: None,
        }
    }

    /// Like [`FakeEngine::slow`] with continuous batching: each step takes `delay` and gives
    /// every running sequence its next word.
    pub fn batching(delay: Duration) -> FakeEngine {
        FakeEngine {
            batching: true,
            ..FakeEngine::slow(delay)
        }
    }

    pub fn slow(delay: Duration) -> FakeEngine {
        FakeEngine {
            token_delay: delay,
            ..FakeEngine::new()
        }
    }

    pub fn word_id(word: &str) -> u32 {
        // FNV-1a, folded into the vocabulary above the script's ids.
        let mut h: u32 = 0x811c_9dc5;
        for b in word.bytes() {
            h = (h ^ b as u32).wrapping_mul(0x0100_0193);
        }
        200 + h % (VOCAB - 200)
    }

    /// What the fake answers to `prompt` with room for `max_tokens`.
    pub fn expected(prompt: &[u32], max_tokens: usize) -> (String, bool) {
        let start = (prompt.iter().map(|&t| t as u64).sum::<u64>() % 4) as usize;
        let words = &SCRIPT[start..];
        let n = words.len().min(max_tokens);
        (words[..n].concat(), n == words.len())
    }

    pub fn tokenize_text(text: &str, add_bos: bool) -> Vec<u32> {
        let mut ids: Vec<u32> = add_bos.then_some(BOS).into_iter().collect();
        ids.extend(text.split_whitespace().map(FakeEngine::word_id));
        ids
    }

    pub fn render(messages: &[ChatMessage]) -> String {
        let mut s: String = messages
            .iter()
            .map(|m| format!("<{}> {} ", m.role, m.content))
            .collect();
        s.push_str("<assistant>");
        s
    }
}

/// The fake's words as a batch: the same tokens and finishes as `generate`, one word per
/// sequence per step.
struct FakeBatch<'a> {
    engine: &'a FakeEngine,
    max_batch: usize,
    next_id: u64,
    waiting: Vec<(u64, GenerationRequest)>,
    /// (id, request, words given)
    running: Vec<(u64, GenerationRequest, usize)>,
    /// What a prefix cache would report: every admitted prompt's tokens are queried, and
    /// those it shares with an earlier prompt are hits.
    cache: CacheUsage,
    seen_prompts: Vec<Vec<u32>>,
}

impl EngineBatch for FakeBatch<'_> {
    fn add(&mut self, request: &GenerationRequest) -> Result<u64, EngineError> {
        self.engine.requests.lock().push(request.clone());
        self.next_id += 1;
        self.waiting.push((self.next_id, request.clone()));
        Ok(self.next_id)
    }

    fn cancel(&mut self, id: u64) {
        self.waiting.retain(|w| w.0 != id);
        if let Some(i) = self.running.iter().position(|r| r.0 == id) {
            let (_, _, given) = self.running.remove(i);
            self.engine.produced.lock().push(given);
        }
    }

    fn step(
        &mut self,
        on_token: &mut dyn FnMut(u64, GeneratedToken) -> ControlFlow<()>,
    ) -> Result<Vec<(u64, Result<EngineFinish, EngineError>)>, EngineError> {
        while self.running.len() < self.max_batch && !self.waiting.is_empty() {
            let (id, request) = self.waiting.remove(0);
            let prompt = &request.prompt;
            let shared = self
                .seen_prompts
                .iter()
                .map(|p| p.iter().zip(prompt).take_while(|(a, b)| a == b).count());
            self.cache.prefix_queried_tokens += prompt.len() as u64;
            self.cache.prefix_hit_tokens += shared.max().unwrap_or(0) as u64;
            self.seen_prompts.push(prompt.clone());
            self.running.push((id, request, 0));
        }
        {
            let mut most = self.engine.most_running.lock();
            *most = (*most).max(self.running.len());
        }
        if !self.running.is_empty() {
            std::thread::sleep(self.engine.token_delay);
        }
        let mut ended = Vec::new();
        for (id, request, given) in &mut self.running {
            let start = (request.prompt.iter().map(|&t| t as u64).sum::<u64>() % 4) as usize;
            let i = *given;
            let finish = if start + i == SCRIPT.len() {
                Some(EngineFinish::EndOfSequence)
            } else if i == request.max_tokens {
                Some(EngineFinish::MaxTokens)
            } else {
                let word = SCRIPT[start + i];
                let token = GeneratedToken {
                    id: 100 + (start + i) as u32,
                    text: word.to_string(),
                    logprob: None,
                    top_logprobs: Vec::new(),
                };
                *given += 1;
                self.engine.events.lock().push("token");
                on_token(*id, token)
                    .is_break()
                    .then_some(EngineFinish::Stopped)
            };
            if let Some(f) = finish {
                ended.push((*id, Ok(f)));
            }
        }
        for (id, _) in &ended {
            let i = self.running.iter().position(|r| r.0 == *id).unwrap();
            let (_, _, given) = self.running.remove(i);
            self.engine.produced.lock().push(given);
        }
        Ok(ended)
    }

    fn running(&self) -> usize {
        self.running.len()
    }

    fn waiting(&self) -> usize {
        self.waiting.len()
    }

    fn is_running(&self, id: u64) -> bool {
        self.running.iter().any(|r| r.0 == id)
    }

    fn cache_usage(&self) -> CacheUsage {
        CacheUsage {
            kv_used_bytes: self.running.len() as u64,
            kv_budget_bytes: self.max_batch as u64,
            ..self.cache
        }
    }
}

fn lp(id: u32, logprob: f32) -> TokenLogprob {
    let text = format!("t{id}");
    TokenLogprob {
        id,
        bytes: text.as_bytes().to_vec(),
        text,
        logprob,
    }
}

impl Engine for FakeEngine {
    fn model_id(&self) -> &str {
        "fake-model"
    }

    fn context_length(&self) -> usize {
        self.context
    }

    fn vocab_size(&self) -> usize {
        VOCAB as usize
    }

    fn tokenize(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, EngineError> {
        Ok(FakeEngine::tokenize_text(text, add_bos))
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.rendered.lock().push(messages.to_vec());
        Ok(FakeEngine::render(messages))
    }

    fn generate(
        &self,
        request: &GenerationRequest,
        cancel: &CancelToken,
        on_token: &mut dyn FnMut(GeneratedToken) -> ControlFlow<()>,
    ) -> Result<EngineFinish, EngineError> {
        self.requests.lock().push(request.clone());
        let start = (request.prompt.iter().map(|&t| t as u64).sum::<u64>() % 4) as usize;
        let mut produced = 0;
        let finish = 'run: {
            for (i, word) in SCRIPT[start..].iter().enumerate() {
                if i == request.max_tokens {
                    break 'run EngineFinish::MaxTokens;
                }
                if cancel.is_cancelled() {
                    break 'run EngineFinish::Stopped;
                }
                std::thread::sleep(self.token_delay);
                let id = 100 + (start + i) as u32;
                let logprob = -0.1 * (i + 1) as f32;
                let token = GeneratedToken {
                    id,
                    text: word.to_string(),
                    logprob: request.logprobs.map(|_| TokenLogprob {
                        id,
                        text: word.to_string(),
                        bytes: word.as_bytes().to_vec(),
                        logprob,
                    }),
                    top_logprobs: (0..request.logprobs.unwrap_or(0))
                        .map(|k| lp(id + 1 + k as u32, logprob - 1.0 - k as f32))
                        .collect(),
                };
                produced += 1;
                self.events.lock().push("token");
                if on_token(token).is_break() {
                    break 'run EngineFinish::Stopped;
                }
            }
            EngineFinish::EndOfSequence
        };
        self.produced.lock().push(produced);
        Ok(finish)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let gate = self.embed_gate.lock().take();
        if let Some(gate) = gate {
            let _ = gate.recv_timeout(Duration::from_secs(10));
        }
        self.events.lock().push("embed");
        if let Some(t) = tokens.iter().find(|&&t| t >= VOCAB) {
            return Err(EngineError::InvalidInput(format!(
                "token id {t} is outside the vocabulary of {VOCAB} tokens"
            )));
        }
        let mut v = [0.0f32; EMBED_DIM];
        for &t in tokens {
            v[t as usize % EMBED_DIM] += 1.0 + (t % 3) as f32;
        }
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        Ok(v.iter().map(|x| x / norm).collect())
    }

    fn batch(&self, max_batch: usize) -> Result<Option<Box<dyn EngineBatch + '_>>, EngineError> {
        if !self.batching {
            return Ok(None);
        }
        Ok(Some(Box::new(FakeBatch {
            engine: self,
            max_batch,
            next_id: 0,
            waiting: Vec::new(),
            running: Vec::new(),
            cache: CacheUsage::default(),
            seen_prompts: Vec::new(),
        })))
    }

    fn memory(&self) -> Option<ModelMemory> {
        self.memory
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            bytes_by_tier: vec![("disk", 4096), ("host", 8192)],
            held_by_tier: vec![("resident", 1 << 20), ("staging", 2 << 20), ("host", 0)],
            io_gbps: 2.5,
            residency_hits: 7,
            residency_misses: 3,
            compute_stall_seconds: 0.25,
            // Advances with every generated token, so `io_events` has passes to report.
            passes: 11 + self.events.lock().iter().filter(|e| **e == "token").count() as u64,
        }
    }
}

/// A server on a free loopback port, serving until dropped or shut down.
pub struct TestServer {
    pub base: String,
    pub server: Server,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<Result<(), gdsllm_server::ServerError>>>,
}

impl TestServer {
    /// Starts serving with no model yet (health says loading).
    pub async fn start_loading(config: ServerConfig) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = Server::new(config);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let s = server.clone();
        let task = tokio::spawn(async move {
            s.serve(listener, async {
                let _ = rx.await;
            })
            .await
        });
        TestServer {
            base,
            server,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    pub async fn start(config: ServerConfig, engine: Arc<FakeEngine>) -> TestServer {
        let ts = TestServer::start_loading(config).await;
        ts.server.set_engine(engine);
        ts
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Signals shutdown and waits for `serve` to return.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }

    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|s| s.trim().to_string())
        .collect()
}

/// The value of metric `name_and_labels` in a `/metrics` text.
pub fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_and_labels) && l[name_and_labels.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The server's `/metrics` text.
pub async fn metrics_text(ts: &TestServer) -> String {
    reqwest::get(ts.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Polls `/metrics` until `name` is `want` (5 s at most); returns the last value seen.
pub async fn wait_for_metric(ts: &TestServer, name: &str, want: f64) -> f64 {
    let mut last = f64::NAN;
    for _ in 0..200 {
        last = metric(&metrics_text(ts).await, name).unwrap_or(f64::NAN);
        if last == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    last
}
