//! The endpoint handlers and the OpenAI response shapes (whole responses and SSE chunks).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{Value, json};

use crate::engine::{Engine, GeneratedToken, GenerationRequest, TokenLogprob};
use crate::error::ApiError;
use crate::models::ListedModel;
use crate::params::{self, COMPLETIONS_DEFAULT_MAX_TOKENS, CommonParams, PromptInput};
use crate::scheduler::{Event, FinishReason, SequenceHandle};
use crate::state::AppState;
use crate::tools::{self, ReplyTools, StreamPiece, ToolCall, ToolStream};

type AppResult = Result<Response, ApiError>;

/// A JSON request body; every failure is an OpenAI-shaped 400 (or 413 over the size limit).
pub struct JsonBody(pub Value);

impl FromRequest<Arc<AppState>> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let limit = state.config.body_read_timeout;
        let read = tokio::time::timeout(limit, Bytes::from_request(req, state)).await;
        let read = read.map_err(|_| ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "the request body did not arrive within {} s",
                limit.as_secs_f64()
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
        })?;
        let bytes = read.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError {
                    status: StatusCode::PAYLOAD_TOO_LARGE,
                    message: format!(
                        "the request body is larger than this server's limit of {} bytes",
                        state.config.body_limit
                    ),
                    kind: "invalid_request_error",
                    param: None,
                    code: Some("request_too_large"),
                }
            } else {
                ApiError::bad_request(format!(
                    "reading the request body: {}",
                    rejection.body_text()
                ))
            }
        })?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(crate) fn new_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}-{nanos:08x}{n:08x}")
}

pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.health() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(err) => err.into_response(),
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    // The engine counters are the default model's (as before several models were served).
    let stats = state.ready().ok().map(|(engine, _)| engine.stats());
    let text = state.metrics.render(stats.as_ref());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

/// `GET /api/ps`: what the server holds (`gdsllm ps`): each model slot, the default first, with
/// its state, the memory it holds per tier, the weight bytes held per tier and read per tier so
/// far; and with a memory budget, the totals against it (`memory`).
pub async fn ps(State(state): State<Arc<AppState>>) -> Response {
    let mut body = json!({"models": state.slots_report()});
    if let Some(memory) = state.memory_report() {
        body["memory"] = memory;
    }
    Json(body).into_response()
}

pub async fn fallback(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!("no endpoint {method} {}", uri.path()))
}

pub(crate) fn model_object(id: &str, created: u64) -> Value {
    json!({"id": id, "object": "model", "created": created, "owned_by": "gdsllm"})
}

/// A `/v1/models` entry with whether the model is loaded.
fn listed_object(state: &AppState, model: &ListedModel) -> Value {
    let mut object = model_object(&model.id, state.started);
    object["loaded"] = json!(model.loaded);
    if let Some(held) = model.held {
        object["memory_bytes"] = json!({"device": held.device, "host": held.host});
    }
    object
}

/// `GET /v1/models`: the default model's names, the loaded models and every model the server
/// can load (the store's, with their aliases), each with `loaded` (and, when loaded, the bytes
/// it holds per tier, `memory_bytes`); with a memory budget, `memory` has the server's totals
/// against it.
pub async fn models(State(state): State<Arc<AppState>>) -> AppResult {
    state.health()?;
    let data: Vec<Value> = state
        .list_models()
        .iter()
        .map(|m| listed_object(&state, m))
        .collect();
    let mut body = json!({"object": "list", "data": data});
    if let Some(memory) = state.memory_report() {
        body["memory"] = memory;
    }
    Ok(Json(body).into_response())
}

pub async fn model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> AppResult {
    state.health()?;
    let listed = state.list_models();
    match listed.iter().find(|m| m.id == id) {
        Some(m) => Ok(Json(listed_object(&state, m)).into_response()),
        None => {
            let names: Vec<String> = listed.into_iter().map(|m| m.id).collect();
            Err(ApiError::model_not_found(&id, &names))
        }
    }
}

/// `POST /v1/models/{id}/load`: loads the model (waiting for it) unless it is loaded already.
pub async fn load_model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> AppResult {
    let model = state.load_model(&id).await?;
    let mut object = model_object(&id, state.started);
    object["loaded"] = json!(true);
    object["root"] = json!(model.name);
    Ok(Json(object).into_response())
}

/// `POST /v1/models/{id}/unload`: unloads the model; 409 while it has requests in flight or is
/// loading. `unloaded` says whether it was loaded.
pub async fn unload_model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> AppResult {
    let (model, unloaded) = state.unload_model(&id)?;
    let mut object = model_object(&id, state.started);
    object["loaded"] = json!(false);
    object["unloaded"] = json!(unloaded);
    object["root"] = json!(model.name);
    Ok(Json(object).into_response())
}

/// The name to answer with: the requested one when it is ours, the model id when none given.
pub(crate) fn check_model(
    state: &AppState,
    engine: &dyn Engine,
    requested: Option<&str>,
) -> Result<String, ApiError> {
    let names = state.model_names(engine);
    match requested {
        None => Ok(names[0].clone()),
        Some(m) if names.iter().any(|n| n == m) => Ok(m.to_string()),
        Some(m) => Err(ApiError::model_not_found(m, &names)),
    }
}

fn context_error(param: &str, prompt: usize, context: usize) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        message: format!(
            "this model's context holds {context} tokens, but the prompt has {prompt} tokens \
             (at least one position must be left to generate into)"
        ),
        kind: "invalid_request_error",
        param: Some(param.to_string()),
        code: Some("context_length_exceeded"),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// Everything needed to shape one response's JSON.
struct Shape {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    logprobs: Option<usize>,
    include_usage: bool,
    /// A chat with tools: its reply is parsed into `tool_calls`.
    tools: Option<ReplyTools>,
}

fn logprob_entry(t: &TokenLogprob) -> Value {
    json!({"token": t.text, "logprob": t.logprob, "bytes": t.bytes})
}

impl Shape {
    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    /// `logprobs` of a choice for `tokens`; `text_offset` is where the first one starts in the
    /// completion text (completions only).
    fn logprobs(&self, tokens: &[GeneratedToken], mut text_offset: usize) -> Value {
        if self.logprobs.is_none() {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = tokens
                    .iter()
                    .filter_map(|t| {
                        let lp = t.logprob.as_ref()?;
                        let mut entry = logprob_entry(lp);
                        entry["top_logprobs"] = t.top_logprobs.iter().map(logprob_entry).collect();
                        Some(entry)
                    })
                    .collect();
                json!({"content": content})
            }
            Kind::Completion => {
                let (mut toks, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
                for t in tokens {
                    let Some(lp) = &t.logprob else { continue };
                    toks.push(json!(lp.text));
                    lps.push(json!(lp.logprob));
                    let top: serde_json::Map<String, Value> = t
                        .top_logprobs
                        .iter()
                        .map(|a| (a.text.clone(), json!(a.logprob)))
                        .collect();
                    tops.push(Value::Object(top));
                    offsets.push(json!(text_offset));
                    text_offset += lp.text.chars().count();
                }
                json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
            }
        }
    }

    fn response(&self, text: String, tokens: &[GeneratedToken], finish: FinishReason) -> Value {
        let choice = match self.kind {
            Kind::Chat if self.tools.is_some() => {
                let (message, finish) = self.tool_reply(&text, finish);
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": self.logprobs(tokens, 0),
                    "finish_reason": finish,
                })
            }
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(tokens, 0),
                "finish_reason": finish.as_openai(),
            }),
            Kind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": self.logprobs(tokens, 0),
                "finish_reason": finish.as_openai(),
            }),
        };
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": Value::Null,
            "choices": [choice],
            "usage": self.usage(tokens.len()),
        })
    }

    /// One streamed chunk; `text` None with `role` opens a chat stream.
    fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        tokens: &[GeneratedToken],
        text_offset: usize,
        finish: Option<&str>,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({
                    "index": 0,
                    "delta": delta,
                    "logprobs": if tokens.is_empty() { Value::Null } else { self.logprobs(tokens, text_offset) },
                    "finish_reason": finish,
                })
            }
            Kind::Completion => json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": if tokens.is_empty() { Value::Null } else { self.logprobs(tokens, text_offset) },
                "finish_reason": finish,
            }),
        };
        let mut chunk = json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": Value::Null,
            "choices": [choice],
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// The message of a chat with tools and its finish reason: `tool_calls` when the reply
    /// holds calls.
    fn tool_reply(&self, text: &str, finish: FinishReason) -> (Value, &'static str) {
        let Some(tools) = self.tools else {
            return (
                json!({"role": "assistant", "content": text}),
                finish.as_openai(),
            );
        };
        let mut reply = tools::parse_reply(tools.format, text, &mut || new_id("call"));
        if !tools.parallel {
            reply.calls.truncate(1);
        }
        if reply.calls.is_empty() {
            return (
                json!({"role": "assistant", "content": text}),
                finish.as_openai(),
            );
        }
        let calls: Vec<Value> = reply.calls.iter().map(ToolCall::to_openai).collect();
        (
            json!({"role": "assistant", "content": reply.content, "tool_calls": calls}),
            "tool_calls",
        )
    }

    /// A chat chunk with this `delta` (a streamed tool call).
    fn delta_chunk(&self, delta: Value) -> Value {
        let mut chunk = self.chunk(None, false, &[], 0, None);
        chunk["choices"][0]["delta"] = delta;
        chunk
    }

    /// The extra last chunk of `stream_options.include_usage`: no choices, the usage.
    fn usage_chunk(&self, completion_tokens: usize) -> Value {
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": Value::Null,
            "choices": [],
            "usage": self.usage(completion_tokens),
        })
    }
}

/// `logit_bias` ids must be in the vocabulary and a grammar must compile; both are 400s
/// naming their field.
fn check_output_controls(engine: &dyn Engine, common: &CommonParams) -> Result<(), ApiError> {
    let vocab = engine.vocab_size();
    if let Some(&(id, _)) = common
        .sampling
        .logit_bias
        .iter()
        .find(|&&(id, _)| id as usize >= vocab)
    {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!(
                "`logit_bias` names token {id}, outside this model's vocabulary of {vocab} tokens"
            ),
        ));
    }
    if let Some(grammar) = &common.grammar {
        engine.check_grammar(&grammar.spec).map_err(|e| {
            ApiError::invalid_param(grammar.param, format!("`{}`: {e}", grammar.param))
        })?;
    }
    Ok(())
}

fn cancelled_error() -> ApiError {
    ApiError::unavailable("the request was cancelled because the server is shutting down")
}

/// Checks the prompt against the context and queues it.
pub(crate) fn submit(
    engine: &dyn Engine,
    scheduler: &crate::scheduler::Scheduler,
    prompt: Vec<u32>,
    prompt_param: &str,
    common: &CommonParams,
    default_max_tokens: Option<usize>,
    logprobs: Option<usize>,
) -> Result<SequenceHandle, ApiError> {
    let context = engine.context_length();
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(
            prompt_param,
            "the prompt is empty (0 tokens)",
        ));
    }
    if prompt.len() >= context {
        return Err(context_error(prompt_param, prompt.len(), context));
    }
    let room = context - prompt.len();
    let max_tokens = common
        .max_tokens
        .or(default_max_tokens)
        .unwrap_or(room)
        .min(room);
    check_output_controls(engine, common)?;
    let request = GenerationRequest {
        prompt,
        max_tokens,
        sampling: common.sampling.clone(),
        logprobs,
        grammar: common.grammar.as_ref().map(|g| g.spec.clone()),
    };
    scheduler.generate(request, common.stop.clone())
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> AppResult {
    let mut req = params::chat_request(&body)?;
    let lease = state.model(req.common.model.as_deref()).await?;
    let (engine, scheduler) = (&lease.engine, &lease.scheduler);
    let model = lease.name.clone();
    let messages = state.with_system_prompt(&model, engine.model_id(), req.messages.clone());
    let (text, tools) = tools::render_chat_prompt(&**engine, &mut req, &messages)?;
    // The template writes the BOS text itself when the model uses one.
    let prompt = engine.tokenize(&text, false)?;
    let shape = Shape {
        kind: Kind::Chat,
        id: new_id("chatcmpl"),
        created: unix_now(),
        model,
        prompt_tokens: prompt.len(),
        logprobs: req.logprobs,
        include_usage: req.common.include_usage,
        tools,
    };
    let handle = submit(
        &**engine,
        scheduler,
        prompt,
        "messages",
        &req.common,
        None,
        req.logprobs,
    )?;
    respond(shape, handle, req.common.stream).await
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> AppResult {
    let req = params::completion_request(&body)?;
    let lease = state.model(req.common.model.as_deref()).await?;
    let (engine, scheduler) = (&lease.engine, &lease.scheduler);
    let model = lease.name.clone();
    let prompt = match req.prompt {
        PromptInput::Text(t) => engine.tokenize(&t, true)?,
        PromptInput::Tokens(ids) => ids,
    };
    let shape = Shape {
        kind: Kind::Completion,
        id: new_id("cmpl"),
        created: unix_now(),
        model,
        prompt_tokens: prompt.len(),
        logprobs: req.logprobs,
        include_usage: req.common.include_usage,
        tools: None,
    };
    let handle = submit(
        &**engine,
        scheduler,
        prompt,
        "prompt",
        &req.common,
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        req.logprobs,
    )?;
    respond(shape, handle, req.common.stream).await
}

async fn respond(shape: Shape, handle: SequenceHandle, stream: bool) -> AppResult {
    if stream {
        Ok(stream_response(shape, handle))
    } else {
        collect_response(shape, handle).await
    }
}

async fn collect_response(shape: Shape, mut handle: SequenceHandle) -> AppResult {
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(event) = handle.events.recv().await {
        match event {
            Event::Delta { text: t, token } => {
                text.push_str(&t);
                tokens.extend(token);
            }
            Event::Done {
                finish: FinishReason::Cancelled,
                ..
            } => return Err(cancelled_error()),
            Event::Done { finish, .. } => {
                return Ok(Json(shape.response(text, &tokens, finish)).into_response());
            }
            Event::Failed(err) => return Err(err),
        }
    }
    Err(ApiError::internal(
        "the model worker stopped before the sequence ended",
    ))
}

/// State of one SSE stream. It owns the sequence's handle, so a client that disconnects
/// drops it and cancels the sequence.
struct StreamState {
    shape: Shape,
    handle: SequenceHandle,
    pending: VecDeque<SseEvent>,
    started: bool,
    finished: bool,
    text_chars: usize,
    /// A chat with tools: its text split into content and calls as it arrives.
    tool_stream: Option<ToolStream>,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl StreamState {
    /// Turns the next sequence event into zero or more SSE events.
    fn on_event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Delta { text, token }) if self.tool_stream.is_some() => {
                let tokens: Vec<GeneratedToken> = token.into_iter().collect();
                let pieces = match &mut self.tool_stream {
                    Some(stream) => stream.push(&text, &mut || new_id("call")),
                    None => Vec::new(),
                };
                self.send_tool_pieces(pieces, &tokens);
            }
            Some(Event::Delta { text, token }) => {
                let tokens: Vec<GeneratedToken> = token.into_iter().collect();
                let has_logprobs = self.shape.logprobs.is_some() && !tokens.is_empty();
                if !text.is_empty() || has_logprobs {
                    let chunk = self.shape.chunk(
                        Some(&text),
                        false,
                        if has_logprobs { &tokens } else { &[] },
                        self.text_chars,
                        None,
                    );
                    self.pending.push_back(data(&chunk));
                }
                self.text_chars += text.chars().count();
            }
            Some(Event::Done {
                finish: FinishReason::Cancelled,
                ..
            }) => {
                self.pending.push_back(data(&cancelled_error().body()));
                self.finish();
            }
            Some(Event::Done {
                finish,
                completion_tokens,
            }) => {
                let mut finish = finish.as_openai();
                if let Some(stream) = &mut self.tool_stream {
                    let pieces = stream.finish(&mut || new_id("call"));
                    self.send_tool_pieces(pieces, &[]);
                    if self
                        .tool_stream
                        .as_ref()
                        .is_some_and(ToolStream::made_calls)
                    {
                        finish = "tool_calls";
                    }
                }
                let last = self.shape.chunk(
                    if self.shape.kind == Kind::Chat {
                        None
                    } else {
                        Some("")
                    },
                    false,
                    &[],
                    self.text_chars,
                    Some(finish),
                );
                self.pending.push_back(data(&last));
                if self.shape.include_usage {
                    self.pending
                        .push_back(data(&self.shape.usage_chunk(completion_tokens)));
                }
                self.finish();
            }
            Some(Event::Failed(err)) => {
                self.pending.push_back(data(&err.body()));
                self.finish();
            }
            None => {
                let err = ApiError::internal("the model worker stopped before the sequence ended");
                self.pending.push_back(data(&err.body()));
                self.finish();
            }
        }
    }

    /// Chunks for a chat with tools: content as content deltas, a call as OpenAI streams one
    /// (`tool_calls[i]` with its id and name, then its arguments); the tokens' logprobs go
    /// with the first chunk, or alone when the tokens completed nothing yet.
    fn send_tool_pieces(&mut self, pieces: Vec<StreamPiece>, tokens: &[GeneratedToken]) {
        let parallel = self.shape.tools.is_none_or(|t| t.parallel);
        let mut tokens = if self.shape.logprobs.is_some() {
            tokens
        } else {
            &[]
        };
        if pieces.is_empty() && !tokens.is_empty() {
            let chunk = self.shape.chunk(None, false, tokens, self.text_chars, None);
            self.pending.push_back(data(&chunk));
            return;
        }
        for piece in pieces {
            match piece {
                StreamPiece::Content(text) => {
                    let chunk = self
                        .shape
                        .chunk(Some(&text), false, tokens, self.text_chars, None);
                    self.pending.push_back(data(&chunk));
                    self.text_chars += text.chars().count();
                }
                StreamPiece::Call { index, .. } if index > 0 && !parallel => continue,
                StreamPiece::Call { index, call } => {
                    let opening = json!({"tool_calls": [{"index": index, "id": call.id,
                        "type": "function", "function": {"name": call.name, "arguments": ""}}]});
                    let mut chunk = self.shape.delta_chunk(opening);
                    if !tokens.is_empty() {
                        chunk["choices"][0]["logprobs"] =
                            self.shape.logprobs(tokens, self.text_chars);
                    }
                    self.pending.push_back(data(&chunk));
                    let arguments = json!({"tool_calls": [{"index": index,
                        "function": {"arguments": call.arguments}}]});
                    self.pending
                        .push_back(data(&self.shape.delta_chunk(arguments)));
                }
            }
            tokens = &[];
        }
    }

    fn finish(&mut self) {
        self.pending.push_back(SseEvent::default().data("[DONE]"));
        self.finished = true;
    }
}

fn stream_response(shape: Shape, handle: SequenceHandle) -> Response {
    let tool_stream = shape.tools.map(|t| ToolStream::new(t.format));
    let mut state = StreamState {
        shape,
        handle,
        pending: VecDeque::new(),
        started: false,
        finished: false,
        text_chars: 0,
        tool_stream,
    };
    if state.shape.kind == Kind::Chat {
        let opening = state.shape.chunk(Some(""), true, &[], 0, None);
        state.pending.push_back(data(&opening));
    }
    state.started = true;
    let stream = futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(ev) = st.pending.pop_front() {
                return Some((Ok::<_, Infallible>(ev), st));
            }
            if st.finished {
                return None;
            }
            let event = st.handle.events.recv().await;
            st.on_event(event);
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Token ids of each embeddings input, each checked to be non-empty and to fit the context.
pub(crate) fn embedding_tokens(
    engine: &dyn Engine,
    inputs: Vec<PromptInput>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let context = engine.context_length();
    let mut tokenized = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.into_iter().enumerate() {
        let tokens = match input {
            PromptInput::Text(t) => engine.tokenize(&t, true)?,
            PromptInput::Tokens(ids) => ids,
        };
        if tokens.is_empty() {
            return Err(ApiError::invalid_param(
                "input",
                format!("input {i} is empty (0 tokens)"),
            ));
        }
        if tokens.len() > context {
            return Err(ApiError {
                status: StatusCode::BAD_REQUEST,
                message: format!(
                    "input {i} has {} tokens, but this model's context holds {context} tokens",
                    tokens.len()
                ),
                kind: "invalid_request_error",
                param: Some("input".into()),
                code: Some("context_length_exceeded"),
            });
        }
        tokenized.push(tokens);
    }
    Ok(tokenized)
}

pub async fn embeddings(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> AppResult {
    let req = params::embeddings_request(&body)?;
    let lease = state.model(req.model.as_deref()).await?;
    let (engine, scheduler) = (&lease.engine, &lease.scheduler);
    let model = lease.name.clone();
    let inputs = embedding_tokens(&**engine, req.inputs)?;
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let vectors = scheduler.embed(inputs).await?;
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if req.base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response())
}
