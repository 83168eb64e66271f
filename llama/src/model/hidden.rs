//! Final hidden states of every position (the residual stream after the output norm, what
//! Hugging Face calls `last_hidden_state`), for embeddings.

use super::Llama;
use super::graph;
use crate::LlamaError;
use crate::backend::Backend;
use crate::weights::{BlobBytes, WeightSource};

impl<B: Backend, W: WeightSource> Llama<B, W> {
    /// Runs `tokens` at positions `pos() ..` like [`Llama::forward`] and returns the
    /// output-normed hidden state of each position, `[tokens.len(), dim]` row-major.
    pub fn forward_hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>, LlamaError> {
        self.check_tokens(tokens)?;
        let dim = self.config.dim;
        let mut hidden = vec![0.0; tokens.len() * dim];
        let mut done = 0;
        for chunk in tokens.chunks(self.max_rows_per_sequence()) {
            // The pass leaves the chunk's residual stream in `state.x`; only its last row was
            // normed, so the output norm is applied again to all rows.
            self.single_pass(chunk, false)?;
            let rows = chunk.len();
            let out = &self.table.output;
            let guard = self.weights.acquire(out.blob)?;
            let output_norm = out.output_norm.view(guard.bytes(), &out.file)?; // [dim]
            let p = graph::PassShape::of(&self.config, &self.table, rows, &[]);
            graph::norm(
                &self.backend,
                &p,
                &self.state.x,
                rows,
                output_norm,
                &mut self.state.xb,
            )?;
            drop(guard);
            self.backend
                .read(&self.state.xb, &mut hidden[done * dim..(done + rows) * dim])?;
            done += rows;
        }
        Ok(hidden)
    }
}
