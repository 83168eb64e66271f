//! The generation loop: prefill the prompt in one pass, then sample token by token until EOS, a
//! stop string, the token limit or the end of the context, streaming text as it is complete.

use std::time::Instant;

use serde::Serialize;

use crate::LlamaError;
use crate::backend::Backend;
use crate::model::Llama;
use crate::sampling::{Sampler, SamplerConfig};
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

    /// Generates a continuation of `prompt`, calling `on_text` with each complete piece.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        options: &GenerateOptions,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation, LlamaError> {
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
        let sampler = Sampler::new(options.sampler.clone())?;

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
        self.cached.truncate(reuse);

        let started = Instant::now();
        let mut logits = self.model.forward(&prompt[reuse..])?.to_vec();
        self.cached.extend_from_slice(&prompt[reuse..]);
        let prompt_seconds = started.elapsed().as_secs_f64();

        let eos = self.model.config().eos_token_ids.clone();
        let mut text = TextOut::new(prompt, sampler);
        let started = Instant::now();
        let finish_reason = loop {
            if text.tokens.len() >= options.max_tokens {
                break FinishReason::Length;
            }
            if let Some(end) =
                text.accept(&logits, &eos, &self.tokenizer, &options.stop, &mut on_text)?
            {
                break end;
            }
            if text.tokens.len() >= options.max_tokens {
                break FinishReason::Length;
            }
            if self.model.pos() >= context {
                break FinishReason::Context;
            }
            let next = *text.tokens.last().expect("accept pushed a token");
            logits.clear();
            logits.extend_from_slice(self.model.forward(&[next])?);
            self.cached.push(next);
        };
        let (tokens, text) = text.finish(finish_reason, &self.tokenizer, &mut on_text)?;
        Ok(Generation {
            prompt_tokens: prompt.to_vec(),
            tokens,
            text,
            finish_reason,
            prompt_computed: prompt.len() - reuse,
            prompt_seconds,
            generation_seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// One sequence's output as it is sampled: the tokens, the text decoded so far and how much of
/// it has been handed out, with stop strings held back until they cannot match. Shared by
/// [`Session::generate`] and the batched [`crate::batch::generate_batch`], so that both end
/// sequences by the same rules.
pub(crate) struct TextOut {
    sampler: Sampler,
    /// Prompt and generated ids (for the repeat penalty).
    history: Vec<u32>,
    pub(crate) tokens: Vec<u32>,
    text: String,
    emitted: usize,
    decoder: StreamDecoder,
}

impl TextOut {
    pub(crate) fn new(prompt: &[u32], sampler: Sampler) -> TextOut {
        TextOut {
            sampler,
            history: prompt.to_vec(),
            tokens: Vec::new(),
            text: String::new(),
            emitted: 0,
            decoder: StreamDecoder::new(),
        }
    }

    /// Samples the next token from `logits` and adds it, calling `on_text` with whatever text
    /// is now complete. Returns the reason the sequence ends with this token (an EOS id or a
    /// stop string), or `None` when it goes on.
    pub(crate) fn accept(
        &mut self,
        logits: &[f32],
        eos: &[u32],
        tokenizer: &Tokenizer,
        stop: &[String],
        on_text: &mut impl FnMut(&str),
    ) -> Result<Option<FinishReason>, LlamaError> {
        let next = self.sampler.sample(logits, &self.history);
        self.tokens.push(next);
        self.history.push(next);
        if eos.contains(&next) {
            return Ok(Some(FinishReason::Eos));
        }
        self.text.push_str(&self.decoder.push(tokenizer, next)?);
        if let Some(cut) = find_stop(&self.text, stop) {
            self.text.truncate(cut);
            if cut > self.emitted {
                on_text(&self.text[self.emitted..]);
            }
            self.emitted = self.text.len();
            return Ok(Some(FinishReason::Stop));
        }
        // Hold back a tail that might grow into a stop string.
        let safe = self.text.len() - held_back(&self.text, stop);
        if safe > self.emitted {
            on_text(&self.text[self.emitted..safe]);
            self.emitted = safe;
        }
        Ok(None)
    }

    /// Ends the sequence: flushes the decoder and the held-back tail (unless a stop string cut
    /// the text) and returns the tokens and the text.
    pub(crate) fn finish(
        mut self,
        reason: FinishReason,
        tokenizer: &Tokenizer,
        on_text: &mut impl FnMut(&str),
    ) -> Result<(Vec<u32>, String), LlamaError> {
        if reason != FinishReason::Stop {
            self.text.push_str(&self.decoder.finish(tokenizer)?);
            if self.text.len() > self.emitted {
                on_text(&self.text[self.emitted..]);
            }
        }
        Ok((self.tokens, self.text))
    }
}

/// Byte offset of the earliest stop string in `text`.
fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

/// Length of the longest suffix of `text` that is a proper prefix of a stop string (on a char
/// boundary).
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        for (i, _) in s.char_indices().skip(1) {
            if i > hold && text.ends_with(&s[..i]) {
                hold = i;
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_found_and_partial_ones_held_back() {
        let stops = vec!["</s>".to_string(), "\n\n".to_string()];
        assert_eq!(find_stop("abc</s>def", &stops), Some(3));
        assert_eq!(find_stop("a\n\nb</s>", &stops), Some(1));
        assert_eq!(find_stop("abc", &stops), None);
        assert_eq!(held_back("abc</", &stops), 2);
        assert_eq!(held_back("abc\n", &stops), 1);
        assert_eq!(held_back("abc", &stops), 0);
    }
}
