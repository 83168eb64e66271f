//! Continuous batching: many sequences share each pass over the weights.
//!
//! When weights stream from disk a pass costs the same whether it serves one sequence or
//! thirty-two, so the [`Batcher`] puts every running sequence into every pass: sequences join
//! and leave between steps, new prompts are prefilled in chunks next to the decode rows of the
//! running ones (which are never held back by a long prompt), at most `max_batch` sequences run
//! at once, and their KV caches together stay within a byte budget; a sequence that does not
//! fit waits in arrival order until others finish. Cancelling a sequence frees its cache at
//! once.
//!
//! KV caches are per sequence and contiguous, sized when the sequence is admitted for all the
//! positions it can reach (prompt + `max_new`, at most the context), rather than paged. Paging
//! would pack the budget tighter when sequences stop early, but it needs an attention kernel
//! that follows a block table on every backend; a contiguous cache works with the existing
//! `attention` op of each backend (the CUDA one included) unchanged, and reserving a
//! sequence's whole need up front means a running sequence can never run out of cache
//! mid-generation, so nothing ever has to be preempted or recomputed.
//!
//! With [`Batcher::with_prefix_cache`] a sequence whose prompt starts like a recent one's
//! takes those positions from a [`PrefixCache`] when it is admitted and computes only the
//! rest; each prompt's positions are offered to the cache when its prefill completes (see
//! [`crate::prefix_cache`] for the design and why reuse changes no result).
//!
//! Sampling stays with the caller: [`Batcher::step`] hands each sequence's logits to a closure
//! that returns the next token or ends the sequence. [`generate_batch`] is the plain text
//! generation loop on top of it, choosing tokens with the same per-sequence step
//! ([`crate::generate::SeqStep`]) as [`crate::Session::generate`].

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use crate::LlamaError;
use crate::backend::Backend;
use crate::generate::{FinishReason, GenerateOptions, Generation, SeqStep};
use crate::model::{BatchSeq, KvCache, Llama};
use crate::prefix_cache::{PREFIX_BLOCK, PrefixCache, PrefixCacheStats, positions_in_wide_chunks};
use crate::sampling::{Sampler, Scores};
use crate::tokenizer::Tokenizer;
use crate::weights::WeightSource;

/// Names a sequence of one [`Batcher`].
pub type SeqId = u64;

/// How the caller of [`Batcher::step`] chooses a sequence's tokens, which decides what a pass
/// hands back for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Choosing {
    /// From the whole row of logits (sampling, penalties, grammars, log-probabilities):
    /// `step` hands over [`Scores::Logits`].
    #[default]
    FromLogits,
    /// Always the largest logit ([`crate::sampling::argmax`]). When every sequence with
    /// logits in a pass chooses so, the backend takes the argmax where the logits are
    /// ([`Llama::forward_batch_greedy`]: on a GPU only the ids come back) and `step` hands
    /// over [`Scores::Greedy`]; otherwise [`Scores::Logits`], whose [`Scores::greedy`] is the
    /// same token.
    Greedy,
}

/// Limits of a [`Batcher`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Most sequences in a pass (prefilling or decoding).
    pub max_batch: usize,
    /// Most prompt tokens computed per pass, over all sequences being prefilled. Decode rows
    /// come on top, so a long prompt delays running sequences by at most this much work.
    pub prefill_chunk: usize,
    /// Bytes of KV cache the admitted sequences may hold together.
    pub kv_budget: u64,
}

/// Prompt tokens per pass when nothing else is said: long prompts still take few passes,
/// while a decode step that carries a chunk stays a few times a plain decode step.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

impl BatchConfig {
    /// `max_batch` sequences with room for `model`'s whole context each (the budget never
    /// holds anyone back before `max_batch` does), and the default prefill chunk.
    pub fn for_model<B: Backend, W: WeightSource>(
        model: &Llama<B, W>,
        max_batch: usize,
    ) -> BatchConfig {
        BatchConfig {
            max_batch,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            kv_budget: model.kv_cache_bytes(model.context()) * max_batch as u64,
        }
    }

    /// Rows a pass may need: every sequence's decode row plus a prefill chunk. A model for
    /// this batch is made with at least this `max_rows`.
    pub fn rows_per_pass(&self) -> usize {
        self.max_batch + self.prefill_chunk
    }
}

/// Why the batcher ended a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqEnd {
    /// The step's closure returned `None` (EOS, a stop string, the client went away).
    Stopped,
    /// `max_new` tokens generated.
    Length,
    /// The context is full.
    Context,
}

/// A sequence that ended in a step; its cache is already freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub id: SeqId,
    pub end: SeqEnd,
}

struct Waiting {
    id: SeqId,
    choosing: Choosing,
    prompt: Vec<u32>,
    max_new: usize,
    /// KV positions to reserve at admission.
    capacity: usize,
}

struct Running<B: Backend> {
    id: SeqId,
    choosing: Choosing,
    prompt: Vec<u32>,
    /// Prompt tokens already computed.
    fed: usize,
    /// The last sampled token, computed in the next pass.
    pending: Option<u32>,
    generated: usize,
    max_new: usize,
    kv: KvCache<B>,
    kv_bytes: u64,
}

/// The continuous-batching scheduler: owns the waiting queue and every running sequence's KV
/// cache; the model is lent to each [`Batcher::step`] (so that, e.g., a server can run other
/// work on it between steps).
pub struct Batcher<B: Backend> {
    config: BatchConfig,
    context: usize,
    vocab: usize,
    /// What the KV caches are sized from: the model's config (each layer keeps its own
    /// positions, see `residency::kv_positions`) and the bytes of one value.
    kv_config: weights_format::ModelConfig,
    kv_value_bytes: u64,
    /// The single-sequence pass computes a prompt in chunks of this many rows.
    solo_chunk: usize,
    next_id: SeqId,
    waiting: VecDeque<Waiting>,
    /// In admission order, which is also the order prefill budget is handed out in.
    running: Vec<Running<B>>,
    /// Sequences that end without a pass (`max_new == 0`), reported by the next step.
    ended: Vec<Finished>,
    kv_used: u64,
    /// Recent prompts' positions for new sequences to start from (off when `None`).
    prefix_cache: Option<PrefixCache<B>>,
    /// The backend's [`Backend::uniform_rows_from`]: what the prefix cache may reuse.
    uniform_rows: usize,
}

impl<B: Backend> Batcher<B> {
    /// A batcher for sequences of `model` (its context is each sequence's limit). The model
    /// must take `max_batch` rows per pass at least, so that every sequence moves each step.
    pub fn new<W: WeightSource>(
        model: &Llama<B, W>,
        config: BatchConfig,
    ) -> Result<Batcher<B>, LlamaError> {
        let bad = |message: String| LlamaError::Config {
            setting: "batch",
            message,
        };
        if config.max_batch == 0 || config.prefill_chunk == 0 {
            return Err(bad(format!(
                "max_batch ({}) and prefill_chunk ({}) must be at least 1",
                config.max_batch, config.prefill_chunk
            )));
        }
        if model.max_rows() < config.max_batch {
            return Err(bad(format!(
                "the model takes {} rows per pass, fewer than max_batch {}",
                model.max_rows(),
                config.max_batch
            )));
        }
        Ok(Batcher {
            config,
            context: model.context(),
            vocab: model.config().vocab_size,
            kv_config: model.metadata().config.clone(),
            kv_value_bytes: model.backend().kv_value_bytes() as u64,
            solo_chunk: model.max_rows_per_sequence(),
            next_id: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            ended: Vec::new(),
            kv_used: 0,
            prefix_cache: None,
            uniform_rows: model.backend().uniform_rows_from(),
        })
    }

    /// Keeps recent prompts' KV positions, up to `bytes` of them (on the model's backend, on
    /// top of the budget of the running sequences), for new sequences with the same prefix;
    /// 0 keeps none.
    pub fn with_prefix_cache(mut self, bytes: u64) -> Batcher<B> {
        self.prefix_cache = (bytes > 0).then(|| PrefixCache::new(bytes));
        self
    }

    /// The prefix cache's counters, when it is on.
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.prefix_cache.as_ref().map(PrefixCache::stats)
    }

    /// The budget of the running sequences' KV caches.
    pub fn kv_budget(&self) -> u64 {
        self.config.kv_budget
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// Queues a sequence that generates at most `max_new` tokens after `prompt`. It is
    /// admitted by a later step, in arrival order, once it fits `max_batch` and the KV budget.
    /// Fails at once (and never later) when it could not run even alone: an empty prompt, a
    /// token outside the vocabulary, a prompt longer than the context, or a cache larger than
    /// the whole budget.
    pub fn submit(&mut self, prompt: Vec<u32>, max_new: usize) -> Result<SeqId, LlamaError> {
        self.submit_choosing(prompt, max_new, Choosing::FromLogits)
    }

    /// [`Batcher::submit`] for a sequence whose tokens are chosen as `choosing` says.
    pub fn submit_choosing(
        &mut self,
        prompt: Vec<u32>,
        max_new: usize,
        choosing: Choosing,
    ) -> Result<SeqId, LlamaError> {
        if prompt.is_empty() {
            return Err(LlamaError::Config {
                setting: "prompt",
                message: "is empty".into(),
            });
        }
        if prompt.len() > self.context {
            return Err(LlamaError::ContextOverflow {
                prompt: prompt.len(),
                context: self.context,
            });
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(LlamaError::TokenOutOfRange {
                id,
                vocab: self.vocab,
            });
        }
        // The last sampled token is never computed, so `max_new - 1` positions follow the
        // prompt.
        let capacity = (prompt.len() + max_new.saturating_sub(1)).min(self.context);
        let needed = self.kv_bytes(capacity);
        if needed > self.config.kv_budget {
            return Err(LlamaError::KvBudget {
                positions: capacity,
                needed,
                budget: self.config.kv_budget,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        if max_new == 0 {
            self.ended.push(Finished {
                id,
                end: SeqEnd::Length,
            });
        } else {
            self.waiting.push_back(Waiting {
                id,
                choosing,
                prompt,
                max_new,
                capacity,
            });
        }
        Ok(id)
    }

    /// Ends sequence `id` wherever it is (waiting or running) and frees its KV cache now.
    /// Returns whether it was there.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            let r = self.running.remove(i);
            self.kv_used -= r.kv_bytes;
            return true;
        }
        let before = self.ended.len();
        self.ended.retain(|f| f.id != id);
        self.ended.len() != before
    }

    /// Bytes of KV cache held by admitted sequences.
    pub fn kv_used(&self) -> u64 {
        self.kv_used
    }

    /// Sequences queued, not yet admitted.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted (prefilling or decoding).
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether `id` has been admitted.
    pub fn is_running(&self, id: SeqId) -> bool {
        self.running.iter().any(|r| r.id == id)
    }

    /// Nothing queued, running or left to report.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.ended.is_empty()
    }

    fn kv_bytes(&self, capacity: usize) -> u64 {
        residency::kv_cache_bytes(&self.kv_config, capacity as u64, self.kv_value_bytes)
    }

    /// Copies the prompt positions of running sequence `i` (just prefilled) that may be reused
    /// into the prefix cache, unless it holds them already. A failure only costs the entry.
    fn offer_prefix<W: WeightSource>(&mut self, model: &Llama<B, W>, i: usize) {
        let Some(cache) = &mut self.prefix_cache else {
            return;
        };
        let r = &self.running[i];
        let positions =
            positions_in_wide_chunks(r.prompt.len(), self.solo_chunk, self.uniform_rows)
                / PREFIX_BLOCK
                * PREFIX_BLOCK;
        let bytes =
            residency::kv_cache_bytes(&self.kv_config, positions as u64, self.kv_value_bytes);
        if !cache.wants(&r.prompt, positions, bytes) {
            return;
        }
        let copied = model.new_kv_cache(positions).and_then(|mut entry| {
            Ok(entry
                .copy_prefix_from(model.backend(), &r.kv, positions)?
                .then_some(entry))
        });
        match copied {
            Ok(Some(entry)) => cache.store(&r.prompt, entry, bytes),
            Ok(None) => {}
            Err(err) => tracing::warn!("sequence {}: not caching its prompt: {err}", r.id),
        }
    }

    /// Moves waiting sequences in (front first) while they fit `max_batch` and the budget. The
    /// front one blocks those behind it, so a large request is not overtaken forever.
    fn admit<W: WeightSource>(&mut self, model: &Llama<B, W>) -> Result<(), LlamaError> {
        while let Some(front) = self.waiting.front() {
            let bytes = self.kv_bytes(front.capacity);
            if self.running.len() >= self.config.max_batch
                || self.kv_used + bytes > self.config.kv_budget
            {
                break;
            }
            let mut kv = model.new_kv_cache(front.capacity)?;
            let w = self.waiting.pop_front().expect("front exists");
            let fed = match &mut self.prefix_cache {
                Some(cache) => {
                    // At least the last prompt token is computed: its logits come next.
                    let limit = positions_in_wide_chunks(
                        w.prompt.len(),
                        self.solo_chunk,
                        self.uniform_rows,
                    )
                    .min(w.prompt.len() - 1);
                    match cache.fill(model.backend(), &w.prompt, limit, &mut kv) {
                        Ok(fed) => fed,
                        Err(err) => {
                            self.waiting.push_front(w);
                            return Err(err);
                        }
                    }
                }
                None => 0,
            };
            self.kv_used += bytes;
            self.running.push(Running {
                id: w.id,
                choosing: w.choosing,
                prompt: w.prompt,
                fed,
                pending: None,
                generated: 0,
                max_new: w.max_new,
                kv,
                kv_bytes: bytes,
            });
        }
        Ok(())
    }

    /// One pass over the weights: admits what fits, then computes every decoding sequence's
    /// last token and a chunk of the prompts being prefilled. For each sequence with new
    /// logits (decoding, or its prompt just completed) `next(id, scores)` returns the next
    /// token, or `None` to end the sequence; `scores` is the row of logits, or the greedy token
    /// when every such sequence of the pass was submitted as [`Choosing::Greedy`]. Returns the
    /// sequences that ended (their caches are freed). A step with nothing to run returns at
    /// once. On an error nothing has advanced, so the step can be retried.
    pub fn step<W: WeightSource>(
        &mut self,
        model: &mut Llama<B, W>,
        mut next: impl FnMut(SeqId, Scores<'_>) -> Option<u32>,
    ) -> Result<Vec<Finished>, LlamaError> {
        let started = std::time::Instant::now();
        self.admit(model)?;
        let decoding = self.running.iter().filter(|r| r.pending.is_some()).count();
        let mut prefill_left = self
            .config
            .prefill_chunk
            .min(model.max_rows().saturating_sub(decoding));
        // (index into running, prompt tokens taken this pass (0 for a decode row), the rows
        // the single-sequence pass computes them with)
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if r.pending.is_some() {
                plan.push((i, 0, 1));
            } else if prefill_left > 0 {
                // The single-sequence pass computes the prompt in chunks of `solo_chunk` rows
                // from its start; a pass here takes at most the rest of the current chunk, so
                // that its rows are computed as that chunk's (`BatchSeq::solo_rows`).
                let chunk_start = r.fed / self.solo_chunk * self.solo_chunk;
                let chunk_end = (chunk_start + self.solo_chunk).min(r.prompt.len());
                let take = (chunk_end - r.fed).min(prefill_left);
                prefill_left -= take;
                plan.push((i, take, chunk_end - chunk_start));
            }
        }
        if plan.is_empty() {
            return Ok(std::mem::take(&mut self.ended));
        }

        // Greedy ids instead of logits when no entry that wants logits needs more than its id.
        let mut greedy = true;
        let mut planned = plan.iter().peekable();
        let mut entries = Vec::with_capacity(plan.len());
        for (i, r) in self.running.iter_mut().enumerate() {
            let Some(&(_, take, solo_rows)) = planned.next_if(|(at, ..)| *at == i) else {
                continue;
            };
            let Running {
                prompt,
                fed,
                pending,
                kv,
                choosing,
                ..
            } = r;
            let entry = match pending {
                Some(token) => BatchSeq {
                    kv,
                    tokens: std::slice::from_ref(token),
                    solo_rows: 1,
                    logits: true,
                },
                None => BatchSeq {
                    kv,
                    tokens: &prompt[*fed..*fed + take],
                    solo_rows,
                    logits: *fed + take == prompt.len(),
                },
            };
            greedy &= !entry.logits || *choosing == Choosing::Greedy;
            entries.push(entry);
        }
        let before_pass = started.elapsed();
        let (logits, ids): (&[f32], &[u32]) = if greedy {
            (&[], model.forward_batch_greedy(&mut entries)?)
        } else {
            (model.forward_batch(&mut entries)?, &[])
        };
        drop(entries);
        let after_pass = started.elapsed();
        let mut finished = std::mem::take(&mut self.ended);

        let vocab = self.vocab;
        let mut row = 0;
        let mut ended: Vec<(usize, SeqEnd)> = Vec::new();
        // Sequences whose prompt completed in this pass, offered to the prefix cache.
        let mut prefilled: Vec<usize> = Vec::new();
        for &(i, take, _) in &plan {
            let r = &mut self.running[i];
            if r.pending.take().is_none() {
                r.fed += take;
                if r.fed < r.prompt.len() {
                    continue;
                }
                prefilled.push(i);
            }
            let scores = if greedy {
                Scores::Greedy(ids[row])
            } else {
                Scores::Logits(&logits[row * vocab..(row + 1) * vocab])
            };
            row += 1;
            let Some(token) = next(r.id, scores) else {
                ended.push((i, SeqEnd::Stopped));
                continue;
            };
            if token as usize >= vocab {
                // Not a token of this model: end the sequence rather than fail the batch.
                tracing::warn!("sequence {}: next token {token} is out of range", r.id);
                ended.push((i, SeqEnd::Stopped));
                continue;
            }
            r.generated += 1;
            if r.generated >= r.max_new {
                ended.push((i, SeqEnd::Length));
            } else if r.kv.len() >= r.kv.capacity() {
                ended.push((i, SeqEnd::Context));
            } else {
                r.pending = Some(token);
            }
        }
        for i in prefilled {
            self.offer_prefix(model, i);
        }
        // Highest index first, so that the earlier indices stay valid.
        for &(i, end) in ended.iter().rev() {
            let r = self.running.remove(i);
            self.kv_used -= r.kv_bytes;
            finished.push(Finished { id: r.id, end });
        }
        // `RUST_LOG=llama::pass_timing=trace`: the step's host time around its pass.
        tracing::trace!(
            target: "llama::pass_timing",
            before_pass_us = before_pass.as_micros() as u64,
            pass_us = (after_pass - before_pass).as_micros() as u64,
            after_pass_us = (started.elapsed() - after_pass).as_micros() as u64,
            "batch step"
        );
        Ok(finished)
    }
}

/// Generates a continuation of every prompt in one continuous batch over `model`. Each comes
/// out exactly as [`crate::Session::generate`] makes it alone with the same options (each
/// sequence gets its own sampler with the options' seed), provided the session's model
/// computes a whole prompt in one pass. `on_text(i, piece)` streams prompt `i`'s text.
/// Returns the generations in prompt order. Every prompt is checked before anything runs.
pub fn generate_batch<B: Backend, W: WeightSource>(
    model: &mut Llama<B, W>,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
    config: BatchConfig,
    mut on_text: impl FnMut(usize, &str),
) -> Result<Vec<Generation>, LlamaError> {
    struct Seq {
        out: Option<SeqStep>,
        /// Why its step ended it (EOS or a stop string).
        end: Option<FinishReason>,
        first_token: Option<Instant>,
        result: Option<Generation>,
    }
    let mut batcher = Batcher::new(model, config)?;
    let eos = model.config().eos_token_ids.clone();
    let mut index = HashMap::new();
    let mut seqs = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let sampler = Sampler::new(options.sampler.clone())?;
        let step = SeqStep::new(p, sampler, &eos, &options.stop);
        let choosing = if step.is_plain_greedy() {
            Choosing::Greedy
        } else {
            Choosing::FromLogits
        };
        index.insert(
            batcher.submit_choosing(p.clone(), options.max_tokens, choosing)?,
            i,
        );
        seqs.push(Seq {
            out: Some(step),
            end: None,
            first_token: None,
            result: None,
        });
    }
    let started = Instant::now();
    let mut failure = None;
    while !batcher.is_idle() {
        let finished = batcher.step(model, |id, scores| {
            let i = index[&id];
            let s = &mut seqs[i];
            s.first_token.get_or_insert_with(Instant::now);
            let out = s.out.as_mut().expect("running sequences have their output");
            match out.next_from(scores, tokenizer) {
                Ok(step) => {
                    if !step.text.is_empty() {
                        on_text(i, &step.text);
                    }
                    match step.end {
                        None => Some(step.token),
                        end => {
                            s.end = end;
                            None
                        }
                    }
                }
                Err(e) => {
                    failure.get_or_insert(e);
                    None
                }
            }
        })?;
        if let Some(e) = failure.take() {
            return Err(e);
        }
        for f in finished {
            let i = index[&f.id];
            let s = &mut seqs[i];
            let reason = match f.end {
                SeqEnd::Stopped => s.end.unwrap_or(FinishReason::Stop),
                SeqEnd::Length => FinishReason::Length,
                SeqEnd::Context => FinishReason::Context,
            };
            let out = s.out.take().expect("a sequence ends once");
            let (tokens, text, tail) = out.finish(reason, tokenizer)?;
            if !tail.is_empty() {
                on_text(i, &tail);
            }
            let first = s.first_token.unwrap_or_else(Instant::now);
            s.result = Some(Generation {
                prompt_tokens: prompts[i].clone(),
                tokens,
                text,
                finish_reason: reason,
                prompt_computed: prompts[i].len(),
                prompt_seconds: (first - started).as_secs_f64(),
                generation_seconds: first.elapsed().as_secs_f64(),
            });
        }
    }
    Ok(seqs
        .into_iter()
        .map(|s| s.result.expect("every sequence finished"))
        .collect())
}
