//! `GET /v1/ws`: JSON-RPC 2.0 over a WebSocket, for real-time clients. It shares everything
//! with the REST API: the scheduler (the same queue, continuous batching and `--max-queue`
//! limit), the request validation of `/v1/completions`, `/v1/chat/completions` and
//! `/v1/embeddings`, the API keys and the message size limit (`--body-limit`).
//!
//! One JSON-RPC message per text frame; params are by name (an object). Batches (arrays) are
//! refused with -32600: a streaming method answers over many frames, so there is no single
//! batch answer to give. Requests need an `id`; only `cancel` may be sent as a notification.
//!
//! Methods:
//! - `auth {key}`: when the server has API keys and the upgrade carried no
//!   `Authorization: Bearer` header, the first call must be this one (-32001 otherwise).
//! - `generate` (the body of `/v1/completions`) and `chat` (the body of
//!   `/v1/chat/completions`): every token is sent as it is sampled, as a `token` notification
//!   `{request, index, text, token_id}`; then the result `{model, text, token_ids,
//!   finish_reason, usage}`. Many may run at once on one socket.
//! - `embed {input, model?, normalize?, dimensions?, quantize?}`: vectors of the model's
//!   embedding (mean-pooled, unit length). `dimensions: d` keeps the first `d` components
//!   (Matryoshka-style truncation: no fitted projection, so it is only as good as the model's
//!   leading components) and `normalize` (default true) rescales the result to unit length
//!   again. `quantize: "int8"` gives `round(x / scale)` in -127..127 with the per-vector
//!   `scale` (x ≈ q·scale); `"binary"` gives the sign bits (1 for x > 0) packed eight to a
//!   byte, most significant bit first (numpy's `packbits`), with `bits`.
//! - `cancel {id}`: ends the running `generate`/`chat` with that id; its result then says
//!   `finish_reason: "cancelled"`.
//! - `models`: the list of `/v1/models`.
//! - `io_events {interval_ms?}` → a subscription id; then `io_events` notifications
//!   `{subscription, result}`, one per interval in which the model ran passes over its
//!   weights, with what those passes did: passes, bytes brought per tier, stall seconds and
//!   GB/s. `io_events_unsubscribe {subscription}` ends one.
//!
//! A client that disconnects cancels every sequence it had running (their KV cache is freed
//! before the next step), exactly as a dropped SSE stream does.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::engine::{CancelToken, EngineStats};
use crate::error::{ApiError, RETRY_AFTER_SECONDS};
use crate::params::{self, PromptInput};
use crate::routes;
use crate::scheduler::{Event, SequenceHandle};
use crate::server::{check_bearer, key_allowed};
use crate::state::AppState;

/// JSON-RPC 2.0 error codes: the standard ones and this server's (-32000 to -32099).
pub mod codes {
    /// The frame is not JSON.
    pub const PARSE_ERROR: i64 = -32700;
    /// Not a JSON-RPC 2.0 request object (or a batch, or a binary frame).
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// A parameter is missing or wrong; `data.param` names it.
    pub const INVALID_PARAMS: i64 = -32602;
    pub const INTERNAL_ERROR: i64 = -32603;
    /// No API key, or a wrong one.
    pub const UNAUTHORIZED: i64 = -32001;
    /// The request queue is full (REST's 429); retry after `data.retry_after_seconds`.
    pub const SERVER_BUSY: i64 = -32002;
    /// The model is loading, failed to load, or the server is shutting down (REST's 503).
    pub const UNAVAILABLE: i64 = -32003;
}

/// Messages waiting for the socket; a slow reader makes its own requests wait, not others'.
const OUTBOX: usize = 256;
/// `io_events` subscriptions one socket may hold.
const MAX_SUBSCRIPTIONS: usize = 8;
/// How often the connection looks at finished tasks and at a shutdown.
const HOUSEKEEPING: Duration = Duration::from_millis(250);
/// `io_events` polling interval: default and bounds, milliseconds.
const IO_EVENTS_DEFAULT_MS: u64 = 100;
const IO_EVENTS_MIN_MS: u64 = 10;
const IO_EVENTS_MAX_MS: u64 = 60_000;

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }

    fn param(param: &str, message: impl Into<String>) -> RpcError {
        RpcError {
            data: Some(json!({"param": param})),
            ..RpcError::new(codes::INVALID_PARAMS, message)
        }
    }
}

impl From<&ApiError> for RpcError {
    /// REST's statuses as JSON-RPC codes; `data` keeps REST's `type`, `param` and `code`.
    fn from(err: &ApiError) -> RpcError {
        let code = match err.status {
            StatusCode::UNAUTHORIZED => codes::UNAUTHORIZED,
            StatusCode::TOO_MANY_REQUESTS => codes::SERVER_BUSY,
            StatusCode::SERVICE_UNAVAILABLE => codes::UNAVAILABLE,
            s if s.is_client_error() => codes::INVALID_PARAMS,
            _ => codes::INTERNAL_ERROR,
        };
        let mut data = json!({"type": err.kind, "param": err.param, "code": err.code});
        if code == codes::SERVER_BUSY || code == codes::UNAVAILABLE {
            data["retry_after_seconds"] = json!(RETRY_AFTER_SECONDS);
        }
        RpcError {
            code,
            message: err.message.clone(),
            data: Some(data),
        }
    }
}

/// A response: `result` or `error`, never both.
#[derive(Serialize)]
struct RpcResponse<'a> {
    jsonrpc: &'static str,
    id: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<RpcError>,
}

#[derive(Serialize)]
struct RpcNotification<'a> {
    jsonrpc: &'static str,
    method: &'a str,
    params: Value,
}

fn response(id: &Value, answer: Result<Value, RpcError>) -> String {
    let (result, error) = match answer {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    let message = RpcResponse {
        jsonrpc: "2.0",
        id,
        result,
        error,
    };
    serde_json::to_string(&message).expect("JSON values serialize")
}

fn notification(method: &str, params: Value) -> String {
    let message = RpcNotification {
        jsonrpc: "2.0",
        method,
        params,
    };
    serde_json::to_string(&message).expect("JSON values serialize")
}

/// A request as parsed from one frame.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcRequest {
    /// `None` for a notification (no `id` member).
    pub id: Option<Value>,
    pub method: String,
    /// Always an object (absent params are an empty one).
    pub params: Map<String, Value>,
}

/// A request that cannot be answered, with the id to answer it under (null when the request's
/// own id could not be read); boxed, as it is the rare path.
pub type ParseFailure = Box<(Value, RpcError)>;

/// Parses one text frame.
pub fn parse_request(text: &str) -> Result<RpcRequest, ParseFailure> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        Box::new((
            Value::Null,
            RpcError::new(codes::PARSE_ERROR, format!("the message is not JSON: {e}")),
        ))
    })?;
    let invalid =
        |id: Value, message: &str| Box::new((id, RpcError::new(codes::INVALID_REQUEST, message)));
    let obj = match value {
        Value::Object(obj) => obj,
        Value::Array(_) => {
            return Err(invalid(
                Value::Null,
                "batch requests are not supported: send one request per message",
            ));
        }
        _ => {
            return Err(invalid(
                Value::Null,
                "a request must be a JSON-RPC 2.0 object",
            ));
        }
    };
    let id = match obj.get("id") {
        None => None,
        Some(id @ (Value::String(_) | Value::Number(_) | Value::Null)) => Some(id.clone()),
        Some(_) => {
            return Err(invalid(
                Value::Null,
                "`id` must be a string, a number or null",
            ));
        }
    };
    let answer_id = id.clone().unwrap_or(Value::Null);
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(invalid(answer_id, "`jsonrpc` must be \"2.0\""));
    }
    let Some(method) = obj.get("method").and_then(Value::as_str) else {
        return Err(invalid(answer_id, "`method` must be a string"));
    };
    let params = match obj.get("params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(p)) => p.clone(),
        Some(Value::Array(_)) => {
            return Err(Box::new((
                answer_id,
                RpcError::new(
                    codes::INVALID_PARAMS,
                    "params must be an object (by name), not an array",
                ),
            )));
        }
        Some(_) => return Err(invalid(answer_id, "`params` must be an object")),
    };
    Ok(RpcRequest {
        id,
        method: method.to_string(),
        params,
    })
}

/// How `embed` post-processes each vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbedOptions {
    pub normalize: bool,
    pub dimensions: Option<usize>,
    pub quantize: Option<Quantize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantize {
    Int8,
    Binary,
}

/// Reads `normalize`, `dimensions` and `quantize` from `embed`'s params and removes them, so
/// that the rest is checked as an `/v1/embeddings` body.
fn embed_options(params: &mut Map<String, Value>) -> Result<EmbedOptions, RpcError> {
    let normalize = match params.remove("normalize") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(RpcError::param(
                "normalize",
                "`normalize` must be a boolean",
            ));
        }
    };
    let dimensions = match params.remove("dimensions") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(d) if d >= 1 => Some(d as usize),
            _ => {
                return Err(RpcError::param(
                    "dimensions",
                    "`dimensions` must be a positive integer",
                ));
            }
        },
    };
    let quantize = match params.remove("quantize") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "int8" => Some(Quantize::Int8),
        Some(Value::String(s)) if s == "binary" => Some(Quantize::Binary),
        Some(_) => {
            return Err(RpcError::param(
                "quantize",
                "`quantize` must be \"int8\" or \"binary\"",
            ));
        }
    };
    Ok(EmbedOptions {
        normalize,
        dimensions,
        quantize,
    })
}

/// One embedding after truncation, renormalisation and quantisation, as JSON.
pub fn postprocess_embedding(mut v: Vec<f32>, options: EmbedOptions) -> Result<Value, RpcError> {
    let full = v.len();
    if let Some(d) = options.dimensions {
        if d > full {
            return Err(RpcError::param(
                "dimensions",
                format!(
                    "`dimensions` = {d} is more than the model's {} embedding dimensions",
                    full
                ),
            ));
        }
        v.truncate(d);
    }
    // The engine's vectors are unit length already: only a truncated one needs rescaling.
    if options.normalize && v.len() < full {
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        if norm > 0.0 {
            v.iter_mut().for_each(|x| *x /= norm);
        }
    }
    Ok(match options.quantize {
        None => json!({"embedding": v}),
        Some(Quantize::Int8) => {
            let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
            let q: Vec<i8> = v
                .iter()
                .map(|x| (x / scale).round().clamp(-127.0, 127.0) as i8)
                .collect();
            json!({"embedding": q, "scale": scale})
        }
        Some(Quantize::Binary) => {
            let packed: Vec<u8> = v
                .chunks(8)
                .map(|c| {
                    c.iter()
                        .enumerate()
                        .fold(0u8, |b, (i, x)| if *x > 0.0 { b | (0x80 >> i) } else { b })
                })
                .collect();
            json!({"embedding": packed, "bits": v.len()})
        }
    })
}

/// `GET /v1/ws`. A wrong `Authorization` header is refused with 401 before the upgrade; no
/// header means the client authenticates with `auth` (when the server has keys).
pub(crate) async fn upgrade(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let keys = &state.config.api_keys;
    let authed = if keys.is_empty() {
        true
    } else {
        let header = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok());
        match check_bearer(keys, header) {
            Some(Ok(())) => true,
            Some(Err(err)) => return err.into_response(),
            None => false,
        }
    };
    let limit = state.config.body_limit;
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |socket| run(socket, state, authed))
}

/// The running `generate`/`chat` calls of one socket, by their id's JSON text.
type InFlight = Arc<Mutex<HashMap<String, CancelToken>>>;

/// Removes a call from [`InFlight`] when its task ends, however it ends.
struct InFlightEntry {
    table: InFlight,
    key: String,
}

impl Drop for InFlightEntry {
    fn drop(&mut self) {
        self.table.lock().remove(&self.key);
    }
}

struct Connection {
    state: Arc<AppState>,
    authed: bool,
    out: mpsc::Sender<String>,
    /// Request tasks; dropping the set aborts them, which drops their sequence handles and so
    /// cancels their sequences.
    requests: JoinSet<()>,
    in_flight: InFlight,
    subscriptions: HashMap<String, tokio::task::AbortHandle>,
    next_subscription: u64,
}

async fn run(socket: WebSocket, state: Arc<AppState>, authed: bool) {
    let (mut sink, mut stream) = socket.split();
    let (out, mut outbox) = mpsc::channel::<String>(OUTBOX);
    let writer = tokio::spawn(async move {
        while let Some(text) = outbox.recv().await {
            if sink.send(Message::Text(text.into())).await.is_err() {
                return;
            }
        }
        let _ = sink.close().await;
    });
    let mut conn = Connection {
        state,
        authed,
        out,
        requests: JoinSet::new(),
        in_flight: Arc::default(),
        subscriptions: HashMap::new(),
        next_subscription: 0,
    };
    let mut housekeeping = tokio::time::interval(HOUSEKEEPING);
    loop {
        tokio::select! {
            frame = stream.next() => match frame {
                Some(Ok(Message::Text(text))) => conn.on_text(text.as_str()).await,
                Some(Ok(Message::Binary(_))) => {
                    let err = RpcError::new(
                        codes::INVALID_REQUEST,
                        "binary frames are not JSON-RPC: send each request as a text frame",
                    );
                    conn.send(response(&Value::Null, Err(err))).await;
                }
                // Pings are answered by the WebSocket layer itself.
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
            },
            _ = housekeeping.tick() => {
                while conn.requests.try_join_next().is_some() {}
                if conn.state.shutting_down.load(Ordering::SeqCst) && conn.requests.is_empty() {
                    break;
                }
            }
        }
    }
    for (_, sub) in conn.subscriptions.drain() {
        sub.abort();
    }
    // Aborts the request tasks: a client that went away frees its sequences now.
    drop(conn);
    let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
}

impl Connection {
    async fn send(&self, text: String) {
        // Fails only when the writer has stopped (the client is gone): nothing to tell.
        let _ = self.out.send(text).await;
    }

    async fn on_text(&mut self, text: &str) {
        let request = match parse_request(text) {
            Ok(r) => r,
            Err(failure) => {
                let (id, err) = *failure;
                return self.send(response(&id, Err(err))).await;
            }
        };
        let Some(id) = request.id.clone() else {
            // Notifications get no answer; `cancel` is the one that makes sense without one.
            if request.method == "cancel" && self.authed {
                let _ = self.cancel(&request.params);
            } else {
                tracing::debug!(method = request.method, "JSON-RPC notification ignored");
            }
            return;
        };
        if !self.authed && request.method != "auth" {
            let err = RpcError::new(
                codes::UNAUTHORIZED,
                "missing API key: call `auth` with {\"key\": ...} first, or send \
                 `Authorization: Bearer <key>` with the upgrade request",
            );
            return self.send(response(&id, Err(err))).await;
        }
        let answer = match request.method.as_str() {
            "auth" => self.auth(&request.params),
            "models" => self.models(),
            "cancel" => self.cancel(&request.params),
            "generate" => return self.start_generation(id, request.params, false).await,
            "chat" => return self.start_generation(id, request.params, true).await,
            "embed" => return self.start_embedding(id, request.params).await,
            "io_events" => self.subscribe_io_events(&request.params),
            "io_events_unsubscribe" => self.unsubscribe(&request.params),
            other => Err(RpcError::new(
                codes::METHOD_NOT_FOUND,
                format!(
                    "no method `{other}`; this server has auth, generate, chat, embed, \
                     cancel, models, io_events, io_events_unsubscribe"
                ),
            )),
        };
        self.send(response(&id, answer)).await;
    }

    fn auth(&mut self, params: &Map<String, Value>) -> Result<Value, RpcError> {
        let keys = &self.state.config.api_keys;
        if keys.is_empty() {
            self.authed = true;
            return Ok(json!({"authenticated": true}));
        }
        let Some(key) = params.get("key").and_then(Value::as_str) else {
            return Err(RpcError::param("key", "`key` (a string) is required"));
        };
        if key_allowed(keys, key.trim()) {
            self.authed = true;
            Ok(json!({"authenticated": true}))
        } else {
            // The key itself never goes into the message or the log.
            Err(RpcError::from(&ApiError::unauthorized(
                "incorrect API key provided",
            )))
        }
    }

    fn models(&self) -> Result<Value, RpcError> {
        let (engine, _) = self.state.ready().map_err(|e| RpcError::from(&e))?;
        let data: Vec<Value> = self
            .state
            .model_names(&*engine)
            .iter()
            .map(|id| routes::model_object(id, self.state.started))
            .collect();
        Ok(json!({"object": "list", "data": data}))
    }

    fn cancel(&self, params: &Map<String, Value>) -> Result<Value, RpcError> {
        let Some(id) = params.get("id").filter(|v| v.is_string() || v.is_number()) else {
            return Err(RpcError::param(
                "id",
                "`id` (the id of the request to cancel) is required",
            ));
        };
        let found = self.in_flight.lock().get(&id.to_string()).cloned();
        if let Some(token) = &found {
            token.cancel();
        }
        Ok(json!({"cancelled": found.is_some()}))
    }

    /// Validates a `generate` or `chat` call the way REST does and queues it; its task streams
    /// the tokens and answers.
    async fn start_generation(&mut self, id: Value, params: Map<String, Value>, chat: bool) {
        let key = id.to_string();
        if self.in_flight.lock().contains_key(&key) {
            let err = RpcError::new(
                codes::INVALID_REQUEST,
                format!("id {key} is already used by a running request on this socket"),
            );
            return self.send(response(&id, Err(err))).await;
        }
        let queued = queue_generation(&self.state, &Value::Object(params), chat);
        let (handle, model, prompt_tokens) = match queued {
            Ok(q) => q,
            Err(err) => return self.send(response(&id, Err(RpcError::from(&err)))).await,
        };
        self.in_flight
            .lock()
            .insert(key.clone(), handle.canceller());
        let entry = InFlightEntry {
            table: self.in_flight.clone(),
            key,
        };
        let out = self.out.clone();
        self.requests.spawn(async move {
            let _entry = entry;
            stream_generation(out, id, handle, model, prompt_tokens).await;
        });
    }

    async fn start_embedding(&mut self, id: Value, mut params: Map<String, Value>) {
        let options = match embed_options(&mut params) {
            Ok(o) => o,
            Err(err) => return self.send(response(&id, Err(err))).await,
        };
        if params
            .get("encoding_format")
            .is_some_and(|f| !f.is_null() && f != "float")
        {
            let err = RpcError::param(
                "encoding_format",
                "`encoding_format` must be \"float\" here: vectors are JSON arrays \
                 (use `quantize` for a compact form)",
            );
            return self.send(response(&id, Err(err))).await;
        }
        let state = self.state.clone();
        let out = self.out.clone();
        self.requests.spawn(async move {
            let answer = embed(&state, Value::Object(params), options).await;
            let _ = out.send(response(&id, answer)).await;
        });
    }

    fn subscribe_io_events(&mut self, params: &Map<String, Value>) -> Result<Value, RpcError> {
        let interval_ms = match params.get("interval_ms").filter(|v| !v.is_null()) {
            None => IO_EVENTS_DEFAULT_MS,
            Some(v) => v
                .as_u64()
                .filter(|ms| (IO_EVENTS_MIN_MS..=IO_EVENTS_MAX_MS).contains(ms))
                .ok_or_else(|| {
                    RpcError::param(
                        "interval_ms",
                        format!(
                            "`interval_ms` must be an integer from {IO_EVENTS_MIN_MS} to \
                             {IO_EVENTS_MAX_MS}"
                        ),
                    )
                })?,
        };
        self.subscriptions.retain(|_, task| !task.is_finished());
        if self.subscriptions.len() >= MAX_SUBSCRIPTIONS {
            return Err(RpcError::new(
                codes::INVALID_REQUEST,
                format!("at most {MAX_SUBSCRIPTIONS} io_events subscriptions per socket"),
            ));
        }
        self.next_subscription += 1;
        let subscription = format!("io-{}", self.next_subscription);
        let task = tokio::spawn(io_events(
            self.out.clone(),
            self.state.clone(),
            subscription.clone(),
            Duration::from_millis(interval_ms),
        ));
        self.subscriptions
            .insert(subscription.clone(), task.abort_handle());
        Ok(json!(subscription))
    }

    fn unsubscribe(&mut self, params: &Map<String, Value>) -> Result<Value, RpcError> {
        let Some(sub) = params.get("subscription").and_then(Value::as_str) else {
            return Err(RpcError::param(
                "subscription",
                "`subscription` (the id `io_events` returned) is required",
            ));
        };
        let found = self.subscriptions.remove(sub);
        if let Some(task) = &found {
            task.abort();
        }
        Ok(json!({"unsubscribed": found.is_some()}))
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        for (_, sub) in self.subscriptions.drain() {
            sub.abort();
        }
    }
}

/// Checks a `generate`/`chat` body (`chat`: a `/v1/chat/completions` body, else a
/// `/v1/completions` one) exactly as REST does and queues it: (its events, the model name to
/// answer with, prompt tokens).
pub(crate) fn queue_generation(
    state: &AppState,
    body: &Value,
    chat: bool,
) -> Result<(SequenceHandle, String, usize), ApiError> {
    let (engine, scheduler) = state.ready()?;
    let (common, prompt, param, default_max, logprobs) = if chat {
        let req = params::chat_request(body)?;
        if req.tools.is_some() {
            return Err(ApiError::invalid_param(
                "tools",
                "tools are served on POST /v1/chat/completions, not over the WebSocket",
            ));
        }
        let model = routes::check_model(state, &*engine, req.common.model.as_deref())?;
        let messages = state.with_system_prompt(&model, engine.model_id(), req.messages);
        let text = engine.render_chat(&messages)?;
        // The template writes the BOS text itself when the model uses one.
        let prompt = engine.tokenize(&text, false)?;
        (req.common, prompt, "messages", None, req.logprobs)
    } else {
        let req = params::completion_request(body)?;
        let prompt = match req.prompt {
            PromptInput::Text(t) => engine.tokenize(&t, true)?,
            PromptInput::Tokens(ids) => ids,
        };
        let default_max = Some(params::COMPLETIONS_DEFAULT_MAX_TOKENS);
        (req.common, prompt, "prompt", default_max, req.logprobs)
    };
    let model = routes::check_model(state, &*engine, common.model.as_deref())?;
    let prompt_tokens = prompt.len();
    let handle = routes::submit(
        &*engine,
        &scheduler,
        prompt,
        param,
        &common,
        default_max,
        logprobs,
    )?;
    Ok((handle, model, prompt_tokens))
}

/// Forwards a sequence's tokens as `token` notifications, then answers the call. Stops
/// (dropping the handle, which cancels the sequence) when the client is gone.
async fn stream_generation(
    out: mpsc::Sender<String>,
    id: Value,
    mut handle: SequenceHandle,
    model: String,
    prompt_tokens: usize,
) {
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let answer = loop {
        match handle.events.recv().await {
            Some(Event::Delta { text: piece, token }) => {
                let mut params = json!({"request": id, "index": token_ids.len(), "text": piece});
                if let Some(token) = &token {
                    params["token_id"] = json!(token.id);
                    if let Some(lp) = &token.logprob {
                        params["logprob"] = json!(lp.logprob);
                    }
                    token_ids.push(token.id);
                }
                text.push_str(&piece);
                if out.send(notification("token", params)).await.is_err() {
                    return;
                }
            }
            Some(Event::Done {
                finish,
                completion_tokens,
            }) => {
                break Ok(json!({
                    "model": model,
                    "text": text,
                    "token_ids": token_ids,
                    "finish_reason": finish.as_openai(),
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    },
                }));
            }
            Some(Event::Failed(err)) => break Err(RpcError::from(&err)),
            None => {
                break Err(RpcError::new(
                    codes::INTERNAL_ERROR,
                    "the model worker stopped before the sequence ended",
                ));
            }
        }
    };
    let _ = out.send(response(&id, answer)).await;
}

/// `embed`: REST's validation and the shared scheduler, then the post-processing.
async fn embed(state: &AppState, body: Value, options: EmbedOptions) -> Result<Value, RpcError> {
    let err = |e: ApiError| RpcError::from(&e);
    let (engine, scheduler) = state.ready().map_err(err)?;
    let req = params::embeddings_request(&body).map_err(err)?;
    let model = routes::check_model(state, &*engine, req.model.as_deref()).map_err(err)?;
    let inputs = routes::embedding_tokens(&*engine, req.inputs).map_err(err)?;
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let vectors = scheduler.embed(inputs).await.map_err(err)?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let mut item = postprocess_embedding(v, options)?;
            item["index"] = json!(i);
            Ok(item)
        })
        .collect::<Result<Vec<Value>, RpcError>>()?;
    Ok(json!({
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
}

/// What the passes between two readings of the engine's counters did.
pub fn io_delta(before: &EngineStats, after: &EngineStats, seconds: f64) -> Value {
    let tier = |pairs: &[(&'static str, u64)], name: &str| {
        pairs
            .iter()
            .find(|(t, _)| *t == name)
            .map_or(0, |(_, b)| *b)
    };
    let mut bytes = Map::new();
    let mut device_bytes = 0u64;
    for (name, now) in &after.bytes_by_tier {
        let delta = now.saturating_sub(tier(&before.bytes_by_tier, name));
        bytes.insert(name.to_string(), json!(delta));
        // The network tier fills local disk, not the compute device.
        if *name != "network" {
            device_bytes += delta;
        }
    }
    let held: Map<String, Value> = after
        .held_by_tier
        .iter()
        .map(|(t, b)| (t.to_string(), json!(b)))
        .collect();
    json!({
        "passes": after.passes.saturating_sub(before.passes),
        "passes_total": after.passes,
        "seconds": seconds,
        "bytes_by_tier": bytes,
        "held_by_tier": held,
        "stall_seconds": (after.compute_stall_seconds - before.compute_stall_seconds).max(0.0),
        "gbps": if seconds > 0.0 { device_bytes as f64 / seconds / 1e9 } else { 0.0 },
        "residency_hits": after.residency_hits.saturating_sub(before.residency_hits),
        "residency_misses": after.residency_misses.saturating_sub(before.residency_misses),
    })
}

/// Reads the engine's counters every `interval` and sends what changed whenever passes ran.
async fn io_events(
    out: mpsc::Sender<String>,
    state: Arc<AppState>,
    subscription: String,
    interval: Duration,
) {
    let mut last: Option<(EngineStats, Instant)> = None;
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Ok((engine, _)) = state.ready() else {
            last = None;
            continue;
        };
        let stats = engine.stats();
        let now = Instant::now();
        if let Some((before, at)) = &last {
            if stats.passes == before.passes {
                continue;
            }
            let result = io_delta(before, &stats, (now - *at).as_secs_f64());
            let params = json!({"subscription": subscription, "result": result});
            if out.send(notification("io_events", params)).await.is_err() {
                return;
            }
        }
        last = Some((stats, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_of(text: &str) -> (Value, i64) {
        let (id, err) = *parse_request(text).unwrap_err();
        (id, err.code)
    }

    #[test]
    fn framing_errors_get_the_standard_codes() {
        assert_eq!(err_of("{not json"), (Value::Null, codes::PARSE_ERROR));
        assert_eq!(
            err_of(r#"[{"jsonrpc":"2.0","method":"models","id":1}]"#),
            (Value::Null, codes::INVALID_REQUEST)
        );
        assert_eq!(err_of("42"), (Value::Null, codes::INVALID_REQUEST));
        assert_eq!(
            err_of(r#"{"jsonrpc":"1.0","method":"models","id":7}"#),
            (json!(7), codes::INVALID_REQUEST)
        );
        assert_eq!(
            err_of(r#"{"jsonrpc":"2.0","method":3,"id":"a"}"#),
            (json!("a"), codes::INVALID_REQUEST)
        );
        assert_eq!(
            err_of(r#"{"jsonrpc":"2.0","method":"models","id":{"x":1}}"#),
            (Value::Null, codes::INVALID_REQUEST)
        );
        assert_eq!(
            err_of(r#"{"jsonrpc":"2.0","method":"generate","params":[1],"id":2}"#),
            (json!(2), codes::INVALID_PARAMS)
        );
        assert_eq!(
            err_of(r#"{"jsonrpc":"2.0","method":"generate","params":"x","id":2}"#),
            (json!(2), codes::INVALID_REQUEST)
        );
    }

    #[test]
    fn requests_and_notifications_parse() {
        let r =
            parse_request(r#"{"jsonrpc":"2.0","method":"embed","params":{"input":"x"},"id":"q"}"#)
                .unwrap();
        assert_eq!(r.id, Some(json!("q")));
        assert_eq!(r.method, "embed");
        assert_eq!(r.params.get("input"), Some(&json!("x")));
        let n = parse_request(r#"{"jsonrpc":"2.0","method":"cancel","params":{"id":1}}"#).unwrap();
        assert_eq!(n.id, None);
        let null_id = parse_request(r#"{"jsonrpc":"2.0","method":"models","id":null}"#).unwrap();
        assert_eq!(null_id.id, Some(Value::Null));
        assert!(null_id.params.is_empty());
    }

    #[test]
    fn responses_have_result_or_error_and_rest_statuses_map_to_codes() {
        let ok: Value = serde_json::from_str(&response(&json!(1), Ok(json!({"a": 1})))).unwrap();
        assert_eq!(ok, json!({"jsonrpc": "2.0", "id": 1, "result": {"a": 1}}));
        let busy = RpcError::from(&ApiError::busy("full"));
        assert_eq!(busy.code, codes::SERVER_BUSY);
        assert_eq!(busy.data.as_ref().unwrap()["retry_after_seconds"], 1);
        let e: Value = serde_json::from_str(&response(&json!("x"), Err(busy))).unwrap();
        assert_eq!(e["error"]["code"], codes::SERVER_BUSY);
        assert!(e.get("result").is_none());
        for (err, code) in [
            (ApiError::unauthorized("k"), codes::UNAUTHORIZED),
            (ApiError::unavailable("loading"), codes::UNAVAILABLE),
            (
                ApiError::invalid_param("max_tokens", "bad"),
                codes::INVALID_PARAMS,
            ),
            (
                ApiError::model_not_found("m", &["a".into()]),
                codes::INVALID_PARAMS,
            ),
            (ApiError::internal("boom"), codes::INTERNAL_ERROR),
        ] {
            let rpc = RpcError::from(&err);
            assert_eq!(rpc.code, code, "{err:?}");
            assert_eq!(rpc.message, err.message);
            assert_eq!(rpc.data.unwrap()["param"], json!(err.param));
        }
    }

    fn options(
        normalize: bool,
        dimensions: Option<usize>,
        quantize: Option<Quantize>,
    ) -> EmbedOptions {
        EmbedOptions {
            normalize,
            dimensions,
            quantize,
        }
    }

    #[test]
    fn truncation_renormalises_and_quantisation_round_trips() {
        let v = vec![0.6, -0.48, 0.64, 0.0];
        let t = postprocess_embedding(v.clone(), options(true, Some(2), None)).unwrap();
        let t: Vec<f32> = serde_json::from_value(t["embedding"].clone()).unwrap();
        let want = [0.6 / 0.768_375_f32, -0.48 / 0.768_375];
        for (got, want) in t.iter().zip(want) {
            assert!((got - want).abs() < 1e-5, "{t:?} vs {want}");
        }
        let raw = postprocess_embedding(v.clone(), options(false, Some(2), None)).unwrap();
        assert_eq!(raw["embedding"], json!([0.6f32, -0.48f32]));

        let q =
            postprocess_embedding(v.clone(), options(true, None, Some(Quantize::Int8))).unwrap();
        let scale = q["scale"].as_f64().unwrap() as f32;
        let ints: Vec<i8> = serde_json::from_value(q["embedding"].clone()).unwrap();
        assert_eq!(ints[2], 127);
        let mut max_err = 0f32;
        for (x, q) in v.iter().zip(&ints) {
            max_err = max_err.max((x - *q as f32 * scale).abs());
        }
        println!(
            "int8 max abs error {max_err} (half a step: {})",
            scale / 2.0
        );
        assert!(max_err <= scale / 2.0 + 1e-6);

        let bits = vec![1.0, -1.0, 0.5, 0.0, -0.1, 2.0, 3.0, -4.0, 0.7];
        let b = postprocess_embedding(bits, options(false, None, Some(Quantize::Binary))).unwrap();
        assert_eq!(b["embedding"], json!([0b1010_0110u8, 0b1000_0000u8]));
        assert_eq!(b["bits"], 9);

        let too_many = postprocess_embedding(v, options(true, Some(5), None)).unwrap_err();
        assert_eq!(too_many.code, codes::INVALID_PARAMS);
        assert!(too_many.message.contains("5"), "{}", too_many.message);
    }

    #[test]
    fn embed_options_are_checked_by_name() {
        let mut p = json!({"input": "x", "dimensions": 0})
            .as_object()
            .unwrap()
            .clone();
        let err = embed_options(&mut p).unwrap_err();
        assert_eq!(err.data.unwrap()["param"], "dimensions");
        let mut p = json!({"quantize": "int4"}).as_object().unwrap().clone();
        assert_eq!(
            embed_options(&mut p).unwrap_err().data.unwrap()["param"],
            "quantize"
        );
        let mut p =
            json!({"input": "x", "normalize": false, "dimensions": 4, "quantize": "binary"})
                .as_object()
                .unwrap()
                .clone();
        assert_eq!(
            embed_options(&mut p).unwrap(),
            options(false, Some(4), Some(Quantize::Binary))
        );
        assert_eq!(p, *json!({"input": "x"}).as_object().unwrap());
    }

    #[test]
    fn io_delta_reports_what_the_passes_between_two_readings_did() {
        let before = EngineStats {
            bytes_by_tier: vec![("disk", 1000), ("host", 0)],
            compute_stall_seconds: 0.5,
            passes: 3,
            residency_misses: 2,
            ..Default::default()
        };
        let after = EngineStats {
            bytes_by_tier: vec![("disk", 3000), ("host", 4000), ("network", 9000)],
            held_by_tier: vec![("resident", 77)],
            compute_stall_seconds: 0.75,
            passes: 5,
            residency_misses: 3,
            ..Default::default()
        };
        let d = io_delta(&before, &after, 2.0);
        assert_eq!(d["passes"], 2);
        assert_eq!(d["passes_total"], 5);
        assert_eq!(
            d["bytes_by_tier"],
            json!({"disk": 2000, "host": 4000, "network": 9000})
        );
        assert_eq!(d["held_by_tier"], json!({"resident": 77}));
        assert_eq!(d["stall_seconds"], 0.25);
        assert_eq!(d["gbps"], 6000.0 / 2.0 / 1e9);
        assert_eq!(d["residency_misses"], 1);
    }
}
