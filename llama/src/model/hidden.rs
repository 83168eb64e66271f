//! Final hidden states of every position (the residual stream after the output norm, what
//! Hugging Face calls `last_hidden_state`), for embeddings.

use weights_format::names;

use super::Llama;
use crate::LlamaError;
use crate::backend::Backend;
use crate::weights::{WeightSource, tensor};

impl<B: Backend, W: WeightSource> Llama<B, W> {
    /// Runs `tokens` at positions `pos() ..` like [`Llama::forward`] and returns the
    /// output-normed hidden state of each position, `[tokens.len(), dim]` row-major.
    pub fn forward_hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>, LlamaError> {
        if self.pos + tokens.len() > self.context {
            return Err(LlamaError::ContextOverflow {
                prompt: self.pos + tokens.len(),
                context: self.context,
            });
        }
        if let Some(&id) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(LlamaError::TokenOutOfRange {
                id,
                vocab: self.config.vocab_size,
            });
        }
        let dim = self.config.dim;
        let mut hidden = vec![0.0; tokens.len() * dim];
        let mut done = 0;
        for chunk in tokens.chunks(self.max_rows) {
            // The pass leaves the chunk's residual stream in `state.x`; only its last row was
            // normed, so the output norm is applied again to all rows.
            self.single_pass(chunk)?;
            let rows = chunk.len();
            let guard = self.weights.acquire(self.layout.output)?;
            let blob = &self.metadata.blobs[self.layout.output];
            let output_norm = tensor(blob, &guard, names::OUTPUT_NORM, &[dim])?; // [dim]
            self.backend.rmsnorm(
                &self.state.x,
                rows,
                output_norm,
                self.config.rms_norm_eps,
                &mut self.state.xb,
            );
            drop(guard);
            self.backend
                .read(&self.state.xb, &mut hidden[done * dim..(done + rows) * dim]);
            self.backend.status()?;
            done += rows;
        }
        Ok(hidden)
    }
}
