//! The narrow interface the HTTP layer needs from a model, so that routes, validation,
//! streaming and the queue are tested against a small fake and the real model plugs in through
//! one adapter ([`crate::llama_engine`]).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

pub use llama::GrammarSpec;

pub use crate::tools::{ToolCall, ToolFormat};

/// One chat message after validation (content parts already joined into text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's function calls (sent back by the client after a tool call).
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of text only.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// Whether the message carries tool calls or a tool result (which only a chat template
    /// that takes tools can render).
    pub fn has_tool_parts(&self) -> bool {
        !self.tool_calls.is_empty() || self.tool_call_id.is_some() || self.role == "tool"
    }
}

/// How the next token is chosen. `temperature == 0` means greedy (argmax) and ignores the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Nucleus sampling; 1 keeps every token.
    pub top_p: f32,
    /// 0 keeps every token.
    pub top_k: usize,
    /// Drops tokens whose probability is below `min_p` times the top token's; 0 keeps all.
    pub min_p: f32,
    /// A fixed seed makes sampling repeatable; `None` seeds from the clock.
    pub seed: Option<u64>,
    /// OpenAI semantics: subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// OpenAI semantics: subtracted per occurrence from the logit of generated tokens.
    pub frequency_penalty: f32,
    /// OpenAI's `logit_bias`: `(token id, bias in [-100, 100])` added to the logits; -100
    /// bans the token. Ids are checked against [`Engine::vocab_size`] before a request runs.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

/// One sequence to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// Prompt token ids, already checked to fit the context.
    pub prompt: Vec<u32>,
    /// Generation stops after this many tokens (or when the context is full).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// `Some(k)`: report the chosen token's log-probability and the `k` most likely
    /// alternatives (log-softmax of the model's raw logits) with every token.
    pub logprobs: Option<usize>,
    /// The grammar the output must follow (structured output), checked with
    /// [`Engine::check_grammar`] before the request runs.
    pub grammar: Option<GrammarSpec>,
}

/// A token with its log-probability.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    /// The token's own text (lossy UTF-8 of `bytes`).
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// One generated token as the engine hands it to the server.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    pub id: u32,
    /// Text this token completes. Empty while a multi-byte character is still incomplete; the
    /// bytes then appear in a later token's `text`.
    pub text: String,
    /// Present when the request asked for log-probabilities.
    pub logprob: Option<TokenLogprob>,
    /// The most likely alternatives, most likely first (`logprobs` of the request long).
    pub top_logprobs: Vec<TokenLogprob>,
}

/// Why an engine stopped generating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFinish {
    /// The model produced an end-of-sequence token (not reported as a token).
    EndOfSequence,
    /// `max_tokens` reached.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// The sink returned `Break` or the cancel token fired.
    Stopped,
}

/// Set from any thread to stop a sequence; the engine checks it between tokens.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Counters of the weight streaming underneath the model, exported on `/metrics`. All are
/// totals since the engine was loaded.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Bytes brought to the compute device per tier (`"disk"`, `"host"`, `"on_demand"`), and
    /// bytes fetched onto local disk from the network tier (`"network"`: a model served over
    /// HTTP, each blob once; read from disk after that).
    pub bytes_by_tier: Vec<(&'static str, u64)>,
    /// Weight bytes held now per tier, for `/api/ps`: `"resident"` (in device memory for the
    /// whole run), `"staging"` (the ring the rest streams through), `"host"` (the host tier).
    pub held_by_tier: Vec<(&'static str, u64)>,
    /// Bytes brought into device memory per second of wall time, GB/s.
    pub io_gbps: f64,
    /// Weight acquisitions served from device memory (or a prefetch already in flight).
    pub residency_hits: u64,
    /// Weight acquisitions that had to start a read on demand.
    pub residency_misses: u64,
    /// Seconds the compute side waited for weights.
    pub compute_stall_seconds: f64,
    /// Forward passes completed.
    pub passes: u64,
}

/// Bytes per memory tier: `device` is the compute device's memory (GPU memory; on the CPU, the
/// RAM its resident weights, staging ring, KV cache and scratch take) and `host` the host tier
/// streamed layers are kept in (`--host-cache`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierBytes {
    pub device: u64,
    pub host: u64,
}

impl TierBytes {
    pub const fn new(device: u64, host: u64) -> TierBytes {
        TierBytes { device, host }
    }

    /// Whether `self` fits in `room` on both tiers.
    pub fn fits_in(self, room: TierBytes) -> bool {
        self.device <= room.device && self.host <= room.host
    }

    pub fn saturating_add(self, other: TierBytes) -> TierBytes {
        TierBytes::new(
            self.device.saturating_add(other.device),
            self.host.saturating_add(other.host),
        )
    }

    pub fn saturating_sub(self, other: TierBytes) -> TierBytes {
        TierBytes::new(
            self.device.saturating_sub(other.device),
            self.host.saturating_sub(other.host),
        )
    }

    /// The smaller of the two on each tier.
    pub fn min(self, other: TierBytes) -> TierBytes {
        TierBytes::new(self.device.min(other.device), self.host.min(other.host))
    }
}

/// What a loaded model holds in memory, as its residency plan and engine know it, for the
/// server's budgets across models ([`crate::models`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelMemory {
    /// Held per tier: on the device its resident weights, staging ring, KV caches and
    /// scratch (the plan's reserve); on the host its host tier.
    pub held: TierBytes,
    /// The budgets the model was planned with (after `auto` was resolved at its load): a
    /// server whose budgets are `auto` takes its first model's as the whole server's.
    pub budget: TierBytes,
    /// The backend that computes: `"cpu"`, `"cuda"` or `"split"` (GPU with CPU help).
    pub backend: &'static str,
}

/// How full a batch's KV memory is, and what its prefix cache has served, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUsage {
    /// KV-cache bytes the running sequences hold.
    pub kv_used_bytes: u64,
    /// The most they may hold together (0: unknown).
    pub kv_budget_bytes: u64,
    /// Prompt tokens looked up in the prefix cache, since the batch began.
    pub prefix_queried_tokens: u64,
    /// Prompt tokens served from the prefix cache instead of computed.
    pub prefix_hit_tokens: u64,
    /// Bytes the prefix cache holds now.
    pub prefix_bytes: u64,
}

/// What an engine can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request cannot be served as given (reported to the client as 400).
    #[error("{0}")]
    InvalidInput(String),
    /// The model failed (reported as 500).
    #[error("{0}")]
    Failed(String),
}

/// Sequences decoded together, one pass over the weights per step (continuous batching), made
/// by [`Engine::batch`] and driven by the server's worker thread alone. Sequences join with
/// [`EngineBatch::add`] and leave when they end or are cancelled, between steps.
pub trait EngineBatch {
    /// Queues a sequence under a new id; it starts at a later step, in arrival order, once the
    /// batch limit and the KV-cache budget allow (it waits, it does not fail, while they are
    /// full). Fails at once only when it could never run, e.g. its KV cache alone would exceed
    /// the whole budget.
    fn add(&mut self, request: &GenerationRequest) -> Result<u64, EngineError>;

    /// Ends a queued or running sequence now and frees its KV cache; it is not reported by
    /// later steps.
    fn cancel(&mut self, id: u64);

    /// One pass: every running sequence that has a new token hands it to `on_token(id,
    /// token)` (`Break` ends that sequence), and queued sequences are admitted and prefilled as
    /// room allows. Returns the sequences that ended in this step and why (or how that one
    /// sequence failed). An `Err` is a failure of the whole pass.
    #[allow(clippy::type_complexity)]
    fn step(
        &mut self,
        on_token: &mut dyn FnMut(u64, GeneratedToken) -> ControlFlow<()>,
    ) -> Result<Vec<(u64, Result<EngineFinish, EngineError>)>, EngineError>;

    /// Sequences admitted (being prefilled or decoded).
    fn running(&self) -> usize;

    /// Sequences queued inside the batch, waiting for room.
    fn waiting(&self) -> usize;

    /// Whether sequence `id` has been admitted.
    fn is_running(&self, id: u64) -> bool;

    /// KV-cache and prefix-cache figures; zeros when the engine keeps none.
    fn cache_usage(&self) -> CacheUsage {
        CacheUsage::default()
    }
}

/// A loaded model as the server sees it. Every method takes `&self`: the server calls
/// `generate` and `embed` from one worker thread only, and the rest from request handlers.
pub trait Engine: Send + Sync + 'static {
    /// The model's name in `/v1/models` and responses.
    fn model_id(&self) -> &str;

    /// Positions one sequence may hold (prompt + generated).
    fn context_length(&self) -> usize;

    /// Logits per position: every valid token id is below this.
    fn vocab_size(&self) -> usize;

    /// Whether `grammar` compiles for this model (an invalid JSON schema or Lark grammar is
    /// an [`EngineError::InvalidInput`] saying why). The default: this engine cannot
    /// constrain its output at all.
    fn check_grammar(&self, grammar: &GrammarSpec) -> Result<(), EngineError> {
        let _ = grammar;
        Err(EngineError::InvalidInput(
            "this model cannot constrain its output to a grammar".into(),
        ))
    }

    /// How this model writes tool calls (recognised from its chat template), or `None` when
    /// its template takes no tools (requests with `tools` then get a 400).
    fn tool_format(&self) -> Option<ToolFormat> {
        None
    }

    /// The chat template applied to `messages` (tool calls and tool results included) with
    /// the function `tools` offered (OpenAI `tools` objects), ending with the assistant's
    /// turn opening. The default: an engine without [`Engine::tool_format`] renders plain
    /// chats only.
    fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
    ) -> Result<String, EngineError> {
        if tools.is_empty() && !messages.iter().any(ChatMessage::has_tool_parts) {
            self.render_chat(messages)
        } else {
            Err(EngineError::InvalidInput(
                "this model's chat template does not take tools".into(),
            ))
        }
    }

    /// Token ids of `text`; special-token text (`<|im_start|>`) becomes its special token.
    /// `add_bos` prepends the model's BOS token when the model's config asks for one.
    fn tokenize(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, EngineError>;

    /// The model's chat template applied to `messages`, ending with the assistant's turn
    /// opening (`add_generation_prompt`).
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError>;

    /// Generates until EOS, `max_tokens`, a full context, `cancel`, or `on_token` returning
    /// `Break`; each token goes to `on_token` as soon as it is sampled.
    fn generate(
        &self,
        request: &GenerationRequest,
        cancel: &CancelToken,
        on_token: &mut dyn FnMut(GeneratedToken) -> ControlFlow<()>,
    ) -> Result<EngineFinish, EngineError>;

    /// The mean over positions of the model's final (normed) hidden state for `tokens`,
    /// L2-normalised.
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError>;

    /// Weight-streaming counters for `/metrics`.
    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }

    /// The memory this model holds per tier, for the server's budgets; `None`: not known (it
    /// then counts as holding what it was given to load with).
    fn memory(&self) -> Option<ModelMemory> {
        None
    }

    /// A batch of up to `max_batch` sequences decoded together, when the engine can do that.
    /// `Ok(None)` (the default) makes the server run sequences one at a time through
    /// [`Engine::generate`]. The batch borrows the engine and is used from one thread while
    /// `embed` may be called between its steps.
    fn batch(&self, max_batch: usize) -> Result<Option<Box<dyn EngineBatch + '_>>, EngineError> {
        let _ = max_batch;
        Ok(None)
    }
}
