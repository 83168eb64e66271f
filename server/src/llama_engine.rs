//! The real [`Engine`]: the `llama` crate's model, tokenizer, chat template and sampler behind
//! the server's narrow interface.
//!
//! The generation loop is written here over `Llama::forward` rather than through
//! `llama::Session::generate` because the server needs per-token control that the session's
//! text callback does not give: cancellation between tokens, log-probabilities and OpenAI's
//! presence/frequency penalties. It follows the session's order exactly (prefill, sample,
//! EOS check, decode, forward), so greedy output is the same as `gdsllm run`'s.
//!
//! [`Engine::batch`] runs the same per-token steps ([`SeqGen`]) for many sequences at once
//! through `llama`'s continuous-batching [`Batcher`], whose batched passes give every sequence
//! exactly its single-sequence results; the server's worker uses that.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use llama::batch::DEFAULT_PREFILL_CHUNK;
use llama::{
    Backend, BatchConfig, Batcher, ChatTemplate, CpuBackend, Llama, LlamaError, Message, Sampler,
    SamplerConfig, SeqEnd, StreamDecoder, Tokenizer, WeightSource,
};
use parking_lot::Mutex;
use residency::{Residency, ResidencyOptions};

use crate::engine::{
    CancelToken, ChatMessage, Engine, EngineBatch, EngineError, EngineFinish, EngineStats,
    GeneratedToken, GenerationRequest, TokenLogprob,
};

fn engine_error(err: LlamaError) -> EngineError {
    match err {
        LlamaError::ContextOverflow { .. }
        | LlamaError::KvBudget { .. }
        | LlamaError::TokenOutOfRange { .. }
        | LlamaError::Sampling { .. }
        | LlamaError::NoChatTemplate
        | LlamaError::ChatTemplate { .. } => EngineError::InvalidInput(err.to_string()),
        other => EngineError::Failed(other.to_string()),
    }
}

/// Weight-streaming counters, read without the model's lock (the worker holds that while it
/// generates, and `/metrics` must not wait for a sequence to end).
pub type StatsFn = Box<dyn Fn() -> EngineStats + Send + Sync>;

/// A `llama` model served through [`Engine`].
pub struct LlamaEngine<B: Backend, W: WeightSource> {
    model_id: String,
    model: Mutex<Llama<B, W>>,
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    bos_text: String,
    eos_text: String,
    bos_id: Option<u32>,
    add_bos: bool,
    eos_ids: Vec<u32>,
    context: usize,
    stats: Option<StatsFn>,
    /// KV-cache bytes a batch's sequences may hold together; `None`: room for every sequence
    /// of the batch at the full context.
    kv_budget: Option<u64>,
}

impl<B: Backend, W: WeightSource + Send> LlamaEngine<B, W> {
    /// Wraps a model; `chat_template` None makes chat requests a 400.
    pub fn new(
        model_id: impl Into<String>,
        model: Llama<B, W>,
        tokenizer: Tokenizer,
        chat_template: Option<ChatTemplate>,
    ) -> LlamaEngine<B, W> {
        let config = model.config();
        let token_text =
            |id: Option<u32>| id.and_then(|id| tokenizer.token(id)).unwrap_or_default();
        let bos_text = token_text(config.bos_token_id);
        let eos_text = token_text(config.eos_token_ids.first().copied());
        LlamaEngine {
            model_id: model_id.into(),
            bos_id: config.bos_token_id,
            add_bos: config.add_bos_token,
            eos_ids: config.eos_token_ids.clone(),
            context: model.context(),
            model: Mutex::new(model),
            tokenizer,
            chat_template,
            bos_text,
            eos_text,
            stats: None,
            kv_budget: None,
        }
    }

    /// Caps the KV cache of a batch's sequences together (see [`Engine::batch`]); beyond it,
    /// new sequences wait for running ones to finish.
    pub fn with_kv_budget(mut self, bytes: u64) -> LlamaEngine<B, W> {
        self.kv_budget = Some(bytes);
        self
    }

    /// Where `/metrics` reads the weight-streaming counters from.
    pub fn with_stats(mut self, stats: StatsFn) -> LlamaEngine<B, W> {
        self.stats = Some(stats);
        self
    }
}

/// Residency shared between the model (which reads weights through it) and `/metrics` (which
/// reads its counters while the model is busy).
pub struct SharedResidency(pub Arc<Residency>);

impl WeightSource for SharedResidency {
    type Guard<'a> = residency::BlobGuard<'a>;

    fn acquire(&self, index: usize) -> Result<residency::BlobGuard<'_>, LlamaError> {
        Ok(self.0.acquire(index)?)
    }

    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError> {
        Ok(self.0.read_range(index, offset, len as u64)?)
    }

    fn end_pass(&self) {
        self.0.end_pass()
    }
}

/// The engine `gdsllm serve` runs on the CPU backend.
pub type CpuEngine = LlamaEngine<CpuBackend, SharedResidency>;

/// Engine counters from residency's.
pub fn residency_stats(residency: &Residency) -> EngineStats {
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

/// Opens model directory `dir` on the CPU backend with weights through residency and a KV
/// cache of `context` positions per sequence (0: the model's whole context), for batches of up
/// to `max_batch` sequences. As `llama::load_cpu` does, a prompt of up to `context` positions
/// is computed in one pass (a batch's pass also holds `max_batch` decode rows and a prefill
/// chunk).
pub fn open_cpu(
    dir: &Path,
    model_id: impl Into<String>,
    options: &ResidencyOptions,
    context: usize,
    max_batch: usize,
) -> Result<CpuEngine, LlamaError> {
    let model = weights_format::Model::open(dir)?;
    let metadata = model.metadata().clone();
    let context = if context == 0 {
        metadata.config.context_length as usize
    } else {
        context
    };
    let tokenizer = Tokenizer::from_file(model.dir().join(&metadata.tokenizer))?;
    let chat_template = match &metadata.chat_template {
        Some(t) => Some(ChatTemplate::from_file(model.dir().join(&t.file))?),
        None => None,
    };
    let residency = Arc::new(Residency::open_host(&model, options)?);
    let llama = Llama::new(
        CpuBackend::new(),
        SharedResidency(residency.clone()),
        metadata,
        context,
        context.max(max_batch + DEFAULT_PREFILL_CHUNK),
    )?;
    Ok(LlamaEngine::new(model_id, llama, tokenizer, chat_template)
        .with_stats(Box::new(move || residency_stats(&residency))))
}

/// The engine `gdsllm serve --device cuda` runs: weights in device memory through residency.
#[cfg(feature = "cuda")]
pub type CudaEngine = LlamaEngine<llama::CudaBackend, llama::backend::cuda::CudaWeights>;

/// Opens model directory `dir` on CUDA device `ordinal` (see `llama::backend::cuda::load_cuda`
/// for what stays resident and what streams).
#[cfg(feature = "cuda")]
pub fn open_cuda(
    dir: &Path,
    model_id: impl Into<String>,
    options: &ResidencyOptions,
    context: usize,
    max_batch: usize,
    ordinal: usize,
    io: residency::IoChoice,
) -> Result<CudaEngine, LlamaError> {
    let model = llama::backend::cuda::load_cuda(dir, options, context, max_batch, ordinal, io)?;
    let residency = model.session.model().weights().residency_handle();
    let (llama, tokenizer) = model.session.into_parts();
    Ok(
        LlamaEngine::new(model_id, llama, tokenizer, model.chat_template)
            .with_stats(Box::new(move || residency_stats(&residency))),
    )
}

/// `log_softmax(logits)[id]` for every id, computed once per token when logprobs are wanted.
fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    logits.iter().map(|&l| l - lse).collect()
}

/// One sequence's token choice: its sampler, OpenAI's penalties, log-probabilities and text
/// decoding. `generate` and the batch both pick tokens through it, so they pick the same ones.
struct SeqGen {
    sampler: Sampler,
    presence_penalty: f32,
    frequency_penalty: f32,
    counts: HashMap<u32, u32>,
    logprobs: Option<usize>,
    decoder: StreamDecoder,
    /// The penalised logits (only when a penalty is set).
    penalised: Vec<f32>,
}

/// What [`LlamaEngine::next_token`] chose.
enum Next {
    EndOfSequence,
    Token(GeneratedToken),
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

    fn seq_gen(&self, request: &GenerationRequest) -> Result<SeqGen, EngineError> {
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
        Ok(SeqGen {
            sampler,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            counts: HashMap::new(),
            logprobs: request.logprobs,
            decoder: StreamDecoder::new(),
            penalised: Vec::new(),
        })
    }

    /// Samples the token after `logits` (penalties first), with its log-probabilities and text.
    fn next_token(&self, seq: &mut SeqGen, logits: &[f32]) -> Result<Next, EngineError> {
        let logits = if seq.presence_penalty != 0.0 || seq.frequency_penalty != 0.0 {
            seq.penalised.clear();
            seq.penalised.extend_from_slice(logits);
            for (&id, &n) in &seq.counts {
                if let Some(l) = seq.penalised.get_mut(id as usize) {
                    *l -= seq.frequency_penalty * n as f32 + seq.presence_penalty;
                }
            }
            &seq.penalised[..]
        } else {
            logits
        };
        let next = seq.sampler.sample(logits, &[]);
        if self.eos_ids.contains(&next) {
            return Ok(Next::EndOfSequence);
        }
        let (logprob, top_logprobs) = match seq.logprobs {
            None => (None, Vec::new()),
            Some(k) => {
                let lp = log_softmax(logits);
                let mut order: Vec<u32> = (0..lp.len() as u32).collect();
                let k = k.min(order.len());
                let by_lp =
                    |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
                if k > 0 && k < order.len() {
                    order.select_nth_unstable_by(k - 1, by_lp);
                }
                order.truncate(k);
                order.sort_unstable_by(by_lp);
                let top = order
                    .iter()
                    .map(|&id| self.token_logprob(id, lp[id as usize]))
                    .collect();
                (Some(self.token_logprob(next, lp[next as usize])), top)
            }
        };
        let text = seq
            .decoder
            .push(&self.tokenizer, next)
            .map_err(engine_error)?;
        *seq.counts.entry(next).or_default() += 1;
        Ok(Next::Token(GeneratedToken {
            id: next,
            text,
            logprob,
            top_logprobs,
        }))
    }
}

/// A sequence of a [`LlamaBatch`].
struct BatchedSeq {
    choice: SeqGen,
    /// Set when the sequence itself ended (EOS, the sink said stop, or a failure).
    end: Option<Result<EngineFinish, EngineError>>,
}

/// [`EngineBatch`] over `llama`'s [`Batcher`]: the model is locked for each step only.
struct LlamaBatch<'a, B: Backend, W: WeightSource> {
    engine: &'a LlamaEngine<B, W>,
    batcher: Batcher<B>,
    seqs: HashMap<u64, BatchedSeq>,
}

impl<B: Backend, W: WeightSource + Send> EngineBatch for LlamaBatch<'_, B, W> {
    fn add(&mut self, request: &GenerationRequest) -> Result<u64, EngineError> {
        let choice = self.engine.seq_gen(request)?;
        let id = self
            .batcher
            .submit(request.prompt.clone(), request.max_tokens)
            .map_err(engine_error)?;
        self.seqs.insert(id, BatchedSeq { choice, end: None });
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
            let mut model = engine.model.lock();
            self.batcher
                .step(&mut model, |id, logits| {
                    let seq = seqs.get_mut(&id)?;
                    match engine.next_token(&mut seq.choice, logits) {
                        Ok(Next::EndOfSequence) => {
                            seq.end = Some(Ok(EngineFinish::EndOfSequence));
                            None
                        }
                        Ok(Next::Token(token)) => {
                            let next = token.id;
                            if on_token(id, token).is_break() {
                                seq.end = Some(Ok(EngineFinish::Stopped));
                                return None;
                            }
                            Some(next)
                        }
                        Err(err) => {
                            seq.end = Some(Err(err));
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

    fn tokenize(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, EngineError> {
        let mut ids = Vec::new();
        if add_bos && self.add_bos {
            ids.extend(self.bos_id);
        }
        ids.extend(self.tokenizer.encode(text).map_err(engine_error)?);
        Ok(ids)
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            EngineError::InvalidInput(
                "this model has no chat template; use /v1/completions with a raw prompt".into(),
            )
        })?;
        let messages: Vec<Message> = messages
            .iter()
            .map(|m| Message::new(m.role.clone(), m.content.clone()))
            .collect();
        template
            .render(&messages, &self.bos_text, &self.eos_text, true)
            .map_err(engine_error)
    }

    fn generate(
        &self,
        request: &GenerationRequest,
        cancel: &CancelToken,
        on_token: &mut dyn FnMut(GeneratedToken) -> ControlFlow<()>,
    ) -> Result<EngineFinish, EngineError> {
        let mut seq = self.seq_gen(request)?;
        let mut model = self.model.lock();
        // Every sequence starts from an empty cache (prefix reuse would need per-sequence
        // caches kept across requests).
        model.truncate(0);
        let mut logits = model
            .forward(&request.prompt)
            .map_err(engine_error)?
            .to_vec();
        let mut generated = 0usize;
        loop {
            if generated >= request.max_tokens {
                return Ok(EngineFinish::MaxTokens);
            }
            if cancel.is_cancelled() {
                return Ok(EngineFinish::Stopped);
            }
            let token = match self.next_token(&mut seq, &logits)? {
                Next::EndOfSequence => return Ok(EngineFinish::EndOfSequence),
                Next::Token(token) => token,
            };
            let next = token.id;
            generated += 1;
            if on_token(token).is_break() {
                return Ok(EngineFinish::Stopped);
            }
            if generated >= request.max_tokens {
                return Ok(EngineFinish::MaxTokens);
            }
            if model.pos() >= self.context {
                return Ok(EngineFinish::ContextFull);
            }
            logits.clear();
            logits.extend_from_slice(model.forward(&[next]).map_err(engine_error)?);
        }
    }

    fn batch(&self, max_batch: usize) -> Result<Option<Box<dyn EngineBatch + '_>>, EngineError> {
        let model = self.model.lock();
        let mut config = BatchConfig::for_model(&model, max_batch);
        if let Some(bytes) = self.kv_budget {
            config.kv_budget = bytes;
        }
        let batcher = Batcher::new(&model, config).map_err(engine_error)?;
        drop(model);
        Ok(Some(Box::new(LlamaBatch {
            engine: self,
            batcher,
            seqs: HashMap::new(),
        })))
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut model = self.model.lock();
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
        self.stats.as_ref().map(|f| f()).unwrap_or_default()
    }
}
