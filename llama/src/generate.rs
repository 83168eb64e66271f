//! Generating text. [`SeqStep`] is the one per-sequence step — sample (with penalties), end on
//! EOS or a stop string, detokenize for streaming, log-probabilities on request — that every
//! generation loop uses: the session's ([`Session::generate`], which the server's single
//! requests run too), and the batched ones ([`crate::batch::generate_batch`], the server's
//! batches). [`Session`] is a model with its tokenizer and the tokens in its KV cache.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::time::Instant;

use serde::Serialize;

use crate::LlamaError;
use crate::backend::Backend;
use crate::grammar::Constraint;
use crate::model::Llama;
use crate::sampling::{Sampler, SamplerConfig, Scores};
use crate::stop::StopMatcher;
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::weights::WeightSource;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation ends before the first occurrence of any of these in the text.
    pub stop: Vec<String>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token (not included in the text).
    Eos,
    /// A stop string (not included in the text).
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The KV cache is full.
    Context,
    /// The caller said stop (a cancelled request, a client gone).
    Cancelled,
}

/// The result of one generation.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub prompt_tokens: Vec<u32>,
    /// Generated ids, including a final EOS if one was produced.
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Prompt positions actually computed (the rest were reused from the KV cache).
    pub prompt_computed: usize,
    pub prompt_seconds: f64,
    pub generation_seconds: f64,
}

impl Generation {
    pub fn prompt_tokens_per_second(&self) -> f64 {
        self.prompt_computed as f64 / self.prompt_seconds.max(1e-9)
    }
    /// Decode speed: the first token comes from the prefill, so it is not counted.
    pub fn generation_tokens_per_second(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.generation_seconds.max(1e-9)
    }
}

/// OpenAI's penalties, subtracted from the logits of tokens already generated (0: off).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Penalties {
    /// Once for every token that occurred.
    pub presence: f32,
    /// Per occurrence.
    pub frequency: f32,
}

impl Penalties {
    fn active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0
    }
}

/// Log-probabilities (log-softmax of the logits the token was sampled from) of a token and of
/// the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    pub token: f32,
    /// `(id, log-probability)`, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// What [`SeqStep::next`] chose.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The sampled token (an EOS id when the sequence ends with it).
    pub token: u32,
    /// Text that can be handed out now: what the token completed, minus anything that may be
    /// the start of a stop string (held back until a later token decides).
    pub text: String,
    /// When asked for ([`SeqStep::with_logprobs`]; not for an EOS).
    pub logprobs: Option<Logprobs>,
    /// Set when the sequence ends with this token: [`FinishReason::Eos`] (no text) or
    /// [`FinishReason::Stop`] (`text` is what came before the stop string).
    pub end: Option<FinishReason>,
}

/// One sequence's choice of tokens and its text: sampling, EOS and stop strings, streaming
/// detokenization, and on request OpenAI penalties and log-probabilities.
pub struct SeqStep {
    sampler: Sampler,
    /// Prompt and generated ids (for the repeat penalty).
    history: Vec<u32>,
    /// Generated ids, including a final EOS.
    tokens: Vec<u32>,
    eos: Vec<u32>,
    decoder: StreamDecoder,
    stop: StopMatcher,
    /// The text handed out so far.
    text: String,
    penalties: Penalties,
    counts: HashMap<u32, u32>,
    /// `(token, bias)` added to the logits; a bias of [`BAN_BIAS`] or below bans the token.
    logit_bias: Vec<(u32, f32)>,
    /// The grammar the output must follow.
    constraint: Option<Constraint>,
    /// The logits after penalties, biases and the grammar's mask (only when one is set).
    adjusted: Vec<f32>,
    logprobs: Option<usize>,
}

/// A logit bias this low bans its token outright (OpenAI's `logit_bias` of -100), rather than
/// making it merely unlikely.
pub const BAN_BIAS: f32 = -100.0;

impl SeqStep {
    /// A sequence after `prompt`, sampled by `sampler`, ending at any of the `eos` ids or
    /// before any of the `stop` strings.
    pub fn new(prompt: &[u32], sampler: Sampler, eos: &[u32], stop: &[String]) -> SeqStep {
        SeqStep {
            sampler,
            history: prompt.to_vec(),
            tokens: Vec::new(),
            eos: eos.to_vec(),
            decoder: StreamDecoder::new(),
            stop: StopMatcher::new(stop),
            text: String::new(),
            penalties: Penalties::default(),
            counts: HashMap::new(),
            logit_bias: Vec::new(),
            constraint: None,
            adjusted: Vec::new(),
            logprobs: None,
        }
    }

    /// Applies `penalties` to the logits before sampling.
    pub fn with_penalties(mut self, penalties: Penalties) -> SeqStep {
        self.penalties = penalties;
        self
    }

    /// Adds `bias` to the logit of each token before sampling ([`BAN_BIAS`] bans it); ids
    /// outside the vocabulary are ignored (callers validate them).
    pub fn with_logit_bias(mut self, bias: Vec<(u32, f32)>) -> SeqStep {
        self.logit_bias = bias;
        self
    }

    /// Samples only tokens `constraint` allows: once the grammar is complete, the mask leaves
    /// only the end-of-sequence tokens, so the sequence ends with one.
    pub fn with_constraint(mut self, constraint: Option<Constraint>) -> SeqStep {
        self.constraint = constraint;
        self
    }

    /// Reports the chosen token's log-probability and those of the `k` most likely tokens
    /// with every step.
    pub fn with_logprobs(mut self, k: Option<usize>) -> SeqStep {
        self.logprobs = k;
        self
    }

    /// The tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Chooses the token after `logits` and turns it into text.
    pub fn next(&mut self, logits: &[f32], tokenizer: &Tokenizer) -> Result<Step, LlamaError> {
        let adjust =
            self.penalties.active() || !self.logit_bias.is_empty() || self.constraint.is_some();
        let logits = if adjust {
            self.adjusted.clear();
            self.adjusted.extend_from_slice(logits);
            for (&id, &n) in &self.counts {
                if let Some(l) = self.adjusted.get_mut(id as usize) {
                    *l -= self.penalties.frequency * n as f32 + self.penalties.presence;
                }
            }
            for &(id, bias) in &self.logit_bias {
                if let Some(l) = self.adjusted.get_mut(id as usize) {
                    *l = if bias <= BAN_BIAS {
                        f32::NEG_INFINITY
                    } else {
                        *l + bias
                    };
                }
            }
            if let Some(constraint) = &mut self.constraint {
                constraint.mask(&mut self.adjusted)?;
            }
            &self.adjusted[..]
        } else {
            logits
        };
        let token = self.sampler.sample(logits, &self.history);
        let logprobs = self.logprobs.map(|k| logprobs(logits, token, k));
        self.accept(token, logprobs, tokenizer)
    }

    /// Whether this step picks the largest logit and needs nothing else of the logits: a
    /// greedy sampler without a repetition penalty, and no penalties, biases, grammar or
    /// log-probabilities. Such a step can take its token from [`Scores::Greedy`] (a batch
    /// hands that over when the backend took the argmax, see
    /// [`crate::batch::Choosing::Greedy`]).
    pub fn is_plain_greedy(&self) -> bool {
        let c = self.sampler.config();
        c.temperature <= 0.0
            && c.repeat_penalty == 1.0
            && !self.penalties.active()
            && self.logit_bias.is_empty()
            && self.constraint.is_none()
            && self.logprobs.is_none()
    }

    /// [`SeqStep::next`] from what a batched step hands over: the logits, or (for a plain
    /// greedy step, [`SeqStep::is_plain_greedy`]) the greedy token itself, which is what
    /// `next` would choose from those logits.
    pub fn next_from(
        &mut self,
        scores: Scores<'_>,
        tokenizer: &Tokenizer,
    ) -> Result<Step, LlamaError> {
        match scores {
            Scores::Logits(logits) => self.next(logits, tokenizer),
            Scores::Greedy(token) if self.is_plain_greedy() => self.accept(token, None, tokenizer),
            Scores::Greedy(_) => Err(LlamaError::Config {
                setting: "sampling",
                message: "a greedy token was handed to a sequence that samples from its logits"
                    .into(),
            }),
        }
    }

    /// The rest of a step once `token` is chosen (with its log-probabilities, when the step
    /// reports them; not for an end-of-sequence token).
    fn accept(
        &mut self,
        token: u32,
        logprobs: Option<Logprobs>,
        tokenizer: &Tokenizer,
    ) -> Result<Step, LlamaError> {
        self.tokens.push(token);
        self.history.push(token);
        if let Some(constraint) = &mut self.constraint {
            constraint.accept(token)?;
        }
        if self.eos.contains(&token) {
            return Ok(Step {
                token,
                text: String::new(),
                logprobs: None,
                end: Some(FinishReason::Eos),
            });
        }
        let piece = self.decoder.push(tokenizer, token)?;
        *self.counts.entry(token).or_default() += 1;
        let out = self.stop.push(&piece);
        self.text.push_str(&out.emit);
        Ok(Step {
            token,
            text: out.emit,
            logprobs,
            end: out.stopped.then_some(FinishReason::Stop),
        })
    }

    /// Ends the sequence: the tokens, the whole text, and the part of it not handed out yet
    /// (the detokenizer's rest and the held-back tail; nothing after a stop string).
    pub fn finish(
        mut self,
        reason: FinishReason,
        tokenizer: &Tokenizer,
    ) -> Result<(Vec<u32>, String, String), LlamaError> {
        let mut tail = String::new();
        if reason != FinishReason::Stop {
            tail = self.stop.flush();
            tail.push_str(&self.decoder.finish(tokenizer)?);
            self.text.push_str(&tail);
        }
        Ok((self.tokens, self.text, tail))
    }
}

/// `log_softmax(logits)` of `token` and of the `k` most likely ids.
fn logprobs(logits: &[f32], token: u32, k: usize) -> Logprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    let lp: Vec<f32> = logits.iter().map(|&l| l - lse).collect();
    let mut order: Vec<u32> = (0..lp.len() as u32).collect();
    let k = k.min(order.len());
    let by_lp = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_lp);
    }
    order.truncate(k);
    order.sort_unstable_by(by_lp);
    Logprobs {
        token: lp[token as usize],
        top: order.iter().map(|&id| (id, lp[id as usize])).collect(),
    }
}

/// A model with its tokenizer and the tokens currently in its KV cache, so that a follow-up
/// prompt sharing a prefix (the next chat turn) only computes the new part.
pub struct Session<B: Backend, W: WeightSource> {
    model: Llama<B, W>,
    tokenizer: Tokenizer,
    cached: Vec<u32>,
}

impl<B: Backend, W: WeightSource> Session<B, W> {
    pub fn new(model: Llama<B, W>, tokenizer: Tokenizer) -> Session<B, W> {
        Session {
            model,
            tokenizer,
            cached: Vec::new(),
        }
    }

    pub fn model(&self) -> &Llama<B, W> {
        &self.model
    }

    /// The model itself (benchmarks drive `forward` directly); call [`Session::reset`] before
    /// generating again.
    pub fn model_mut(&mut self) -> &mut Llama<B, W> {
        self.cached.clear();
        &mut self.model
    }

    /// The model and tokenizer, for callers that drive the model themselves.
    pub fn into_parts(self) -> (Llama<B, W>, Tokenizer) {
        (self.model, self.tokenizer)
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model and the tokenizer at once (for [`crate::batch::generate_batch`]); empties the
    /// session's record of its cache like [`Session::model_mut`].
    pub fn parts_mut(&mut self) -> (&mut Llama<B, W>, &Tokenizer) {
        self.cached.clear();
        (&mut self.model, &self.tokenizer)
    }

    /// Empties the KV cache (the next prompt is computed from its first token).
    pub fn reset(&mut self) {
        self.model.truncate(0);
        self.cached.clear();
    }

    /// Logits after the last position computed (the prompt, or the last generated token).
    pub fn last_logits(&self) -> &[f32] {
        self.model.last_logits()
    }

    /// Token ids of a raw completion prompt (BOS first when the model asks for it).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, LlamaError> {
        let mut ids = Vec::new();
        let c = self.model.config();
        if c.add_bos_token {
            ids.extend(c.bos_token_id);
        }
        ids.extend(self.tokenizer.encode(text)?);
        Ok(ids)
    }

    /// A step for a sequence after `prompt` with `options`' sampler and stop strings and this
    /// model's EOS ids.
    pub fn step_for(
        &self,
        prompt: &[u32],
        options: &GenerateOptions,
    ) -> Result<SeqStep, LlamaError> {
        let sampler = Sampler::new(options.sampler.clone())?;
        Ok(SeqStep::new(
            prompt,
            sampler,
            &self.model.config().eos_token_ids,
            &options.stop,
        ))
    }

    /// Generates a continuation of `prompt`, calling `on_text` with each complete piece.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        options: &GenerateOptions,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation, LlamaError> {
        let step = self.step_for(prompt, options)?;
        let (generation, tail) = self.generate_with(prompt, step, options.max_tokens, |s| {
            if !s.text.is_empty() {
                on_text(&s.text);
            }
            ControlFlow::Continue(())
        })?;
        if !tail.is_empty() {
            on_text(&tail);
        }
        Ok(generation)
    }

    /// Generates a continuation of `prompt` with `step` choosing every token, until it ends
    /// the sequence (EOS, a stop string), `max_tokens`, the end of the context, or `on_step`
    /// (called with every token but an EOS) breaks ([`FinishReason::Cancelled`]). The cached
    /// prefix the prompt shares with the last sequence is reused. Returns the generation and
    /// the end of its text that no step handed out.
    pub fn generate_with(
        &mut self,
        prompt: &[u32],
        mut step: SeqStep,
        max_tokens: usize,
        mut on_step: impl FnMut(&Step) -> ControlFlow<()>,
    ) -> Result<(Generation, String), LlamaError> {
        let context = self.model.context();
        if prompt.len() > context {
            return Err(LlamaError::ContextOverflow {
                prompt: prompt.len(),
                context,
            });
        }
        if prompt.is_empty() {
            return Err(LlamaError::Config {
                setting: "prompt",
                message: "is empty".into(),
            });
        }
        // Reuse the cached prefix, but always recompute at least the last prompt token so
        // that there are logits to sample from.
        let reuse = self
            .cached
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1)
            .min(self.model.pos());
        self.model.truncate(reuse);
        // A model with sliding-window layers may keep less than asked (see `Llama::truncate`).
        let reuse = self.model.pos();
        self.cached.truncate(reuse);

        let started = Instant::now();
        let mut logits = self.model.forward(&prompt[reuse..])?.to_vec();
        self.cached.extend_from_slice(&prompt[reuse..]);
        let prompt_seconds = started.elapsed().as_secs_f64();

        let started = Instant::now();
        let decoded = self.decode(&mut step, &mut logits, max_tokens, &mut on_step);
        // Every token but the last sampled one has been fed to the model.
        let fed = self.model.pos() - prompt.len();
        self.cached.extend_from_slice(&step.tokens()[..fed]);
        let finish_reason = decoded?;
        let (tokens, text, tail) = step.finish(finish_reason, &self.tokenizer)?;
        let generation = Generation {
            prompt_tokens: prompt.to_vec(),
            tokens,
            text,
            finish_reason,
            prompt_computed: prompt.len() - reuse,
            prompt_seconds,
            generation_seconds: started.elapsed().as_secs_f64(),
        };
        Ok((generation, tail))
    }

    /// Samples after `logits` and feeds each token back until the sequence ends.
    fn decode(
        &mut self,
        step: &mut SeqStep,
        logits: &mut Vec<f32>,
        max_tokens: usize,
        on_step: &mut impl FnMut(&Step) -> ControlFlow<()>,
    ) -> Result<FinishReason, LlamaError> {
        let context = self.model.context();
        // A plain greedy step needs only each position's argmax, which the backend takes where
        // the logits are (the prompt's logits are already here).
        let greedy = step.is_plain_greedy();
        let mut chosen: Option<u32> = None;
        loop {
            if step.tokens().len() >= max_tokens {
                return Ok(FinishReason::Length);
            }
            let scores = match chosen {
                Some(token) => Scores::Greedy(token),
                None => Scores::Logits(logits),
            };
            let s = step.next_from(scores, &self.tokenizer)?;
            if s.end == Some(FinishReason::Eos) {
                return Ok(FinishReason::Eos);
            }
            if on_step(&s).is_break() {
                return Ok(FinishReason::Cancelled);
            }
            if let Some(end) = s.end {
                return Ok(end);
            }
            if step.tokens().len() >= max_tokens {
                return Ok(FinishReason::Length);
            }
            if self.model.pos() >= context {
                return Ok(FinishReason::Context);
            }
            if greedy {
                chosen = Some(self.model.forward_greedy(&[s.token])?);
            } else {
                logits.clear();
                logits.extend_from_slice(self.model.forward(&[s.token])?);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_ranked_with_ties_to_the_lower_id() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let lse = logits.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
        let lp = logprobs(&logits, 2, 3);
        assert!((lp.token as f64 - (2.0 - lse)).abs() < 1e-6, "{}", lp.token);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        for &(id, l) in &lp.top {
            assert!((l as f64 - (logits[id as usize] as f64 - lse)).abs() < 1e-6);
        }
        assert!(logprobs(&logits, 0, 0).top.is_empty());
    }
}
