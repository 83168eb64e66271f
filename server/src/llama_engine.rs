//! The real [`Engine`]: the `llama` crate's model, tokenizer, chat template and sampler behind
//! the server's narrow interface.
//!
//! Single requests run [`llama::Session::generate_with`] and batches `llama`'s continuous
//! [`Batcher`]; both choose tokens with `llama`'s one per-sequence step ([`SeqStep`], with the
//! request's penalties and log-probabilities), so greedy output is the same as `gdsllm run`'s and
//! a batched request gets exactly its single-request tokens. Stop strings are the scheduler's
//! (it holds text back from the stream), so the engine's steps have none.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use llama::{
    Backend, BatchConfig, Batcher, ChatTemplate, ChatValue, Choosing, Constraint, Device,
    FinishReason, GrammarCompiler, GrammarSpec, LlamaError, LoadedModel, Message, OpenOptions,
    OpenedModel, Penalties, Sampler, SamplerConfig, SeqEnd, SeqStep, Session, Step, Tokenizer,
    WeightSource,
};
use parking_lot::Mutex;

use crate::engine::{
    CacheUsage, CancelToken, ChatMessage, Engine, EngineBatch, EngineError, EngineFinish,
    EngineStats, GeneratedToken, GenerationRequest, ModelMemory, TierBytes, TokenLogprob,
};
use crate::tools::{self, ToolFormat};

fn engine_error(err: LlamaError) -> EngineError {
    match err {
        LlamaError::ContextOverflow { .. }
        | LlamaError::KvBudget { .. }
        | LlamaError::TokenOutOfRange { .. }
        | LlamaError::Sampling { .. }
        | LlamaError::Grammar { .. }
        | LlamaError::NoChatTemplate
        | LlamaError::ChatTemplate { .. } => EngineError::InvalidInput(err.to_string()),
        other => EngineError::Failed(other.to_string()),
    }
}

/// A `llama` model served through [`Engine`].
pub struct LlamaEngine<B: Backend, W: WeightSource> {
    model_id: String,
    session: Mutex<Session<B, W>>,
    /// The session's tokenizer, shared: request handlers tokenize while the worker holds the
    /// session.
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    bos_text: String,
    eos_text: String,
    bos_id: Option<u32>,
    add_bos: bool,
    eos_ids: Vec<u32>,
    context: usize,
    vocab: usize,
    /// Binds grammars to the tokenizer; built on the first request with a grammar (it reads
    /// every token's bytes), or why it cannot be.
    grammars: std::sync::OnceLock<Result<GrammarCompiler, String>>,
    /// Weight-streaming counters, read without the session's lock (the worker holds that
    /// while it generates, and `/metrics` must not wait for a sequence to end).
    residency: Option<Arc<residency::Residency>>,
    /// The backend that computes (`Backend::name`), for [`Engine::memory`].
    backend: &'static str,
    /// KV-cache bytes a batch's sequences may hold together; `None`: room for every sequence
    /// of the batch at the full context.
    kv_budget: Option<u64>,
    /// Bytes of recent prompts' KV positions a batch keeps for new requests with the same
    /// prefix (`llama::prefix_cache`); 0 keeps none.
    prefix_cache_bytes: u64,
}

impl<B: Backend, W: WeightSource + Send> LlamaEngine<B, W> {
    /// Serves a loaded model; a model without a chat template makes chat requests a 400.
    pub fn new(model_id: impl Into<String>, model: LoadedModel<B, W>) -> LlamaEngine<B, W> {
        let llama = model.session.model();
        let config = llama.config();
        LlamaEngine {
            model_id: model_id.into(),
            bos_id: config.bos_token_id,
            add_bos: config.add_bos_token,
            eos_ids: config.eos_token_ids.clone(),
            context: llama.context(),
            vocab: config.vocab_size,
            grammars: std::sync::OnceLock::new(),
            residency: llama.weights().residency_handle(),
            backend: llama.backend().name(),
            tokenizer: model.session.tokenizer().clone(),
            session: Mutex::new(model.session),
            chat_template: model.chat_template,
            bos_text: model.bos_token,
            eos_text: model.eos_token,
            kv_budget: None,
            prefix_cache_bytes: 0,
        }
    }

    /// Keeps up to `bytes` of recent prompts' KV positions for requests that start the same
    /// way (on top of the KV budget); 0 keeps none.
    pub fn with_prefix_cache(mut self, bytes: u64) -> LlamaEngine<B, W> {
        self.prefix_cache_bytes = bytes;
        self
    }

    /// Caps the KV cache of a batch's sequences together (see [`Engine::batch`]); beyond it,
    /// new sequences wait for running ones to finish.
    pub fn with_kv_budget(mut self, bytes: u64) -> LlamaEngine<B, W> {
        self.kv_budget = Some(bytes);
        self
    }
}

/// Opens model directory `dir` on `device` (`llama::open`, which also decides `--device
/// auto`) for batches of up to `options.sequences` sequences; `options.kv_budget` caps their
/// KV caches together.
pub fn open(
    dir: &Path,
    model_id: impl Into<String>,
    device: Device,
    options: &OpenOptions,
) -> Result<Arc<dyn Engine>, LlamaError> {
    open_serving(dir, model_id, device, options, 0)
}

/// [`open`] with a prefix cache of `prefix_cache_bytes`, which `options.kv_budget` (when set)
/// includes: the model reserves room for both, and the running sequences get the rest.
pub fn open_serving(
    dir: &Path,
    model_id: impl Into<String>,
    device: Device,
    options: &OpenOptions,
    prefix_cache_bytes: u64,
) -> Result<Arc<dyn Engine>, LlamaError> {
    fn serve<B: Backend + 'static, W: WeightSource + Send + 'static>(
        model_id: String,
        model: LoadedModel<B, W>,
        kv_budget: Option<u64>,
        prefix_cache_bytes: u64,
    ) -> Arc<dyn Engine> {
        let engine = LlamaEngine::new(model_id, model).with_prefix_cache(prefix_cache_bytes);
        Arc::new(match kv_budget {
            Some(bytes) => engine.with_kv_budget(bytes),
            None => engine,
        })
    }
    if let Some(total) = options.kv_budget
        && prefix_cache_bytes >= total
    {
        return Err(LlamaError::Config {
            setting: "prefix cache",
            message: format!(
                "{prefix_cache_bytes} bytes leave nothing of the KV budget of {total} bytes"
            ),
        });
    }
    let kv_budget = options.kv_budget.map(|b| b - prefix_cache_bytes);
    let model_id = model_id.into();
    Ok(match llama::open(dir, device, options)? {
        OpenedModel::Cpu(m) => serve(model_id, *m, kv_budget, prefix_cache_bytes),
        #[cfg(feature = "cuda")]
        OpenedModel::Cuda(m) => serve(model_id, *m, kv_budget, prefix_cache_bytes),
        #[cfg(feature = "cuda")]
        OpenedModel::Hybrid(m) => serve(model_id, *m, kv_budget, prefix_cache_bytes),
    })
}

/// Engine counters from residency's.
fn residency_stats(residency: &residency::Residency) -> EngineStats {
    let s = residency.stats();
    EngineStats {
        bytes_by_tier: vec![
            ("disk", s.total.disk_bytes),
            ("host", s.total.host_copy_bytes),
            ("on_demand", s.total.on_demand_bytes),
            ("network", s.total.network_bytes),
        ],
        held_by_tier: vec![
            ("resident", residency.plan().resident_bytes),
            ("staging", residency.plan().ring_bytes),
            ("host", s.host_tier_bytes),
        ],
        io_gbps: s.effective_gbps,
        residency_hits: s.total.device_hits,
        residency_misses: s.total.device_misses,
        compute_stall_seconds: s.total.compute_wait_s,
        passes: s.passes_completed,
    }
}

impl<B: Backend, W: WeightSource + Send> LlamaEngine<B, W> {
    fn token_logprob(&self, id: u32, logprob: f32) -> TokenLogprob {
        let text = self.tokenizer.decode(&[id], false).unwrap_or_default();
        TokenLogprob {
            id,
            bytes: text.as_bytes().to_vec(),
            text,
            logprob,
        }
    }

    /// A fresh constraint for `grammar`, or why it cannot be (a 400).
    fn constraint(&self, grammar: &GrammarSpec) -> Result<Constraint, EngineError> {
        let compiler = self
            .grammars
            .get_or_init(|| {
                GrammarCompiler::new(&self.tokenizer, self.vocab, &self.eos_ids)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| {
                EngineError::InvalidInput(format!(
                    "this model's tokenizer cannot be used for structured output: {e}"
                ))
            })?;
        compiler.compile(grammar).map_err(engine_error)
    }

    /// The step that chooses a request's tokens: its sampler, penalties, logit biases, grammar
    /// and log-probabilities (no stop strings: the scheduler holds those back from the stream).
    fn seq_step(&self, request: &GenerationRequest) -> Result<SeqStep, EngineError> {
        let s = &request.sampling;
        let seed = s.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let sampler = Sampler::new(SamplerConfig {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            seed,
        })
        .map_err(engine_error)?;
        let constraint = request
            .grammar
            .as_ref()
            .map(|g| self.constraint(g))
            .transpose()?;
        Ok(SeqStep::new(&request.prompt, sampler, &self.eos_ids, &[])
            .with_penalties(Penalties {
                presence: s.presence_penalty,
                frequency: s.frequency_penalty,
            })
            .with_logit_bias(s.logit_bias.clone())
            .with_constraint(constraint)
            .with_logprobs(request.logprobs))
    }

    /// A step's token as the server reports it.
    fn generated(&self, step: &Step) -> GeneratedToken {
        let (logprob, top_logprobs) = match &step.logprobs {
            None => (None, Vec::new()),
            Some(lp) => (
                Some(self.token_logprob(step.token, lp.token)),
                lp.top
                    .iter()
                    .map(|&(id, l)| self.token_logprob(id, l))
                    .collect(),
            ),
        };
        GeneratedToken {
            id: step.token,
            text: step.text.clone(),
            logprob,
            top_logprobs,
        }
    }
}

/// A sequence of a [`LlamaBatch`].
struct BatchedSeq {
    step: SeqStep,
    /// Set when the sequence itself ended (EOS, the sink said stop, or a failure).
    end: Option<Result<EngineFinish, EngineError>>,
}

/// [`EngineBatch`] over `llama`'s [`Batcher`]: the session is locked for each step only.
struct LlamaBatch<'a, B: Backend, W: WeightSource> {
    engine: &'a LlamaEngine<B, W>,
    batcher: Batcher<B>,
    seqs: HashMap<u64, BatchedSeq>,
}

impl<B: Backend, W: WeightSource + Send> EngineBatch for LlamaBatch<'_, B, W> {
    fn add(&mut self, request: &GenerationRequest) -> Result<u64, EngineError> {
        let step = self.engine.seq_step(request)?;
        // A plain greedy request needs only the argmax, which the backend can take on the GPU.
        let choosing = if step.is_plain_greedy() {
            Choosing::Greedy
        } else {
            Choosing::FromLogits
        };
        let id = self
            .batcher
            .submit_choosing(request.prompt.clone(), request.max_tokens, choosing)
            .map_err(engine_error)?;
        self.seqs.insert(id, BatchedSeq { step, end: None });
        Ok(id)
    }

    fn cancel(&mut self, id: u64) {
        self.batcher.cancel(id);
        self.seqs.remove(&id);
    }

    fn step(
        &mut self,
        on_token: &mut dyn FnMut(u64, GeneratedToken) -> ControlFlow<()>,
    ) -> Result<Vec<(u64, Result<EngineFinish, EngineError>)>, EngineError> {
        let engine = self.engine;
        let seqs = &mut self.seqs;
        let finished = {
            let mut session = engine.session.lock();
            let (model, tokenizer) = session.parts_mut();
            self.batcher
                .step(model, |id, scores| {
                    let seq = seqs.get_mut(&id)?;
                    match seq.step.next_from(scores, tokenizer) {
                        Ok(step) if step.end == Some(FinishReason::Eos) => {
                            seq.end = Some(Ok(EngineFinish::EndOfSequence));
                            None
                        }
                        Ok(step) => {
                            if on_token(id, engine.generated(&step)).is_break() {
                                seq.end = Some(Ok(EngineFinish::Stopped));
                                return None;
                            }
                            Some(step.token)
                        }
                        Err(err) => {
                            seq.end = Some(Err(engine_error(err)));
                            None
                        }
                    }
                })
                .map_err(engine_error)?
        };
        Ok(finished
            .into_iter()
            .map(|f| {
                let end = seqs.remove(&f.id).and_then(|s| s.end);
                let finish = match f.end {
                    SeqEnd::Stopped => end.unwrap_or(Ok(EngineFinish::Stopped)),
                    SeqEnd::Length => Ok(EngineFinish::MaxTokens),
                    SeqEnd::Context => Ok(EngineFinish::ContextFull),
                };
                (f.id, finish)
            })
            .collect())
    }

    fn running(&self) -> usize {
        self.batcher.running()
    }

    fn waiting(&self) -> usize {
        self.batcher.waiting()
    }

    fn is_running(&self, id: u64) -> bool {
        self.batcher.is_running(id)
    }

    fn cache_usage(&self) -> CacheUsage {
        let prefix = self.batcher.prefix_cache_stats().unwrap_or_default();
        CacheUsage {
            kv_used_bytes: self.batcher.kv_used(),
            kv_budget_bytes: self.batcher.kv_budget(),
            prefix_queried_tokens: prefix.queried_tokens,
            prefix_hit_tokens: prefix.hit_tokens,
            prefix_bytes: prefix.bytes,
        }
    }
}

impl<B, W> Engine for LlamaEngine<B, W>
where
    B: Backend + 'static,
    W: WeightSource + Send + 'static,
{
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn context_length(&self) -> usize {
        self.context
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn check_grammar(&self, grammar: &GrammarSpec) -> Result<(), EngineError> {
        self.constraint(grammar).map(drop)
    }

    fn tokenize(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, EngineError> {
        let mut ids = Vec::new();
        if add_bos && self.add_bos {
            ids.extend(self.bos_id);
        }
        ids.extend(self.tokenizer.encode(text).map_err(engine_error)?);
        Ok(ids)
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.render_chat_with_tools(messages, &[])
    }

    fn tool_format(&self) -> Option<ToolFormat> {
        ToolFormat::detect(self.chat_template.as_ref()?.source())
    }

    fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
    ) -> Result<String, EngineError> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            EngineError::InvalidInput(
                "this model has no chat template; use /v1/completions with a raw prompt".into(),
            )
        })?;
        let variables = [
            ("bos_token", self.bos_text.as_str()),
            ("eos_token", self.eos_text.as_str()),
        ];
        if tools.is_empty() && !messages.iter().any(ChatMessage::has_tool_parts) {
            let messages: Vec<Message> = messages
                .iter()
                .map(|m| Message::new(m.role.clone(), m.content.clone()))
                .collect();
            return template
                .render_conversation(
                    &ChatValue::from_serialize(&messages),
                    None,
                    &variables,
                    true,
                )
                .map_err(engine_error);
        }
        if self.tool_format().is_none() {
            return Err(EngineError::InvalidInput(
                "this model's chat template does not take tools".into(),
            ));
        }
        let messages: Vec<serde_json::Value> =
            messages.iter().map(tools::template_message).collect();
        let tools = (!tools.is_empty()).then(|| ChatValue::from_serialize(&tools));
        template
            .render_conversation(
                &ChatValue::from_serialize(&messages),
                tools.as_ref(),
                &variables,
                true,
            )
            .map_err(engine_error)
    }

    fn generate(
        &self,
        request: &GenerationRequest,
        cancel: &CancelToken,
        on_token: &mut dyn FnMut(GeneratedToken) -> ControlFlow<()>,
    ) -> Result<EngineFinish, EngineError> {
        let step = self.seq_step(request)?;
        let mut session = self.session.lock();
        // Every sequence starts from an empty cache (prefix reuse would need per-sequence
        // caches kept across requests).
        session.reset();
        let (generation, _) = session
            .generate_with(&request.prompt, step, request.max_tokens, |step| {
                if cancel.is_cancelled() {
                    return ControlFlow::Break(());
                }
                on_token(self.generated(step))
            })
            .map_err(engine_error)?;
        Ok(match generation.finish_reason {
            FinishReason::Eos => EngineFinish::EndOfSequence,
            FinishReason::Length => EngineFinish::MaxTokens,
            FinishReason::Context => EngineFinish::ContextFull,
            FinishReason::Stop | FinishReason::Cancelled => EngineFinish::Stopped,
        })
    }

    fn batch(&self, max_batch: usize) -> Result<Option<Box<dyn EngineBatch + '_>>, EngineError> {
        let session = self.session.lock();
        let model = session.model();
        let mut config = BatchConfig::for_model(model, max_batch);
        if let Some(bytes) = self.kv_budget {
            config.kv_budget = bytes;
        }
        let batcher = Batcher::new(model, config)
            .map_err(engine_error)?
            .with_prefix_cache(self.prefix_cache_bytes);
        drop(session);
        Ok(Some(Box::new(LlamaBatch {
            engine: self,
            batcher,
            seqs: HashMap::new(),
        })))
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut session = self.session.lock();
        let model = session.model_mut();
        model.truncate(0);
        let dim = model.config().dim;
        let hidden = model.forward_hidden(tokens).map_err(engine_error);
        model.truncate(0);
        let hidden = hidden?;
        let rows = tokens.len().max(1) as f64;
        let mut mean: Vec<f64> = vec![0.0; dim];
        for row in hidden.chunks_exact(dim) {
            for (m, &x) in mean.iter_mut().zip(row) {
                *m += x as f64;
            }
        }
        let norm = mean.iter().map(|m| (m / rows).powi(2)).sum::<f64>().sqrt();
        if norm == 0.0 || !norm.is_finite() {
            return Err(EngineError::Failed(format!(
                "the mean hidden state has norm {norm}"
            )));
        }
        Ok(mean.iter().map(|m| (m / rows / norm) as f32).collect())
    }

    fn stats(&self) -> EngineStats {
        self.residency
            .as_deref()
            .map(residency_stats)
            .unwrap_or_default()
    }

    fn memory(&self) -> Option<ModelMemory> {
        let plan = self.residency.as_deref()?.plan();
        Some(ModelMemory {
            held: TierBytes::new(
                plan.reserved_bytes + plan.device_bytes(),
                plan.host_cached_bytes,
            ),
            budget: TierBytes::new(plan.device_budget, plan.host_budget),
            backend: self.backend,
        })
    }
}
