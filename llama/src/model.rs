//! The forward pass, written once over [`Backend`] (llama2.c style: top to bottom, every weight
//! with its shape, state allocated once).

mod hidden;

use weights_format::{Metadata, names};

use crate::LlamaError;
use crate::backend::{AttentionShape, Backend};
use crate::config::LlamaConfig;
use crate::weights::{BlobLayout, WeightSource, embedding_rows, tensor};

/// Activation buffers, sized once for `max_rows` positions per pass.
struct State<B: Backend> {
    /// Residual stream `[rows, dim]`.
    x: B::Buf,
    /// Normed input of a sub-block `[rows, dim]`.
    xb: B::Buf,
    /// Sub-block output before the residual add `[rows, dim]`.
    xb2: B::Buf,
    q: B::Buf,   // [rows, q_dim]
    k: B::Buf,   // [rows, kv_dim]
    v: B::Buf,   // [rows, kv_dim]
    att: B::Buf, // [rows, q_dim]
    hb: B::Buf,  // [rows, ffn_dim]
    hb2: B::Buf, // [rows, ffn_dim]
    /// The last position's residual and normed residual `[dim]`.
    last: B::Buf,
    last_norm: B::Buf,
    /// `[vocab]`
    logits: B::Buf,
}

/// A LLaMA-family model bound to a backend, a weight source and a KV cache of `context`
/// positions.
pub struct Llama<B: Backend, W: WeightSource> {
    backend: B,
    weights: W,
    metadata: Metadata,
    config: LlamaConfig,
    layout: BlobLayout,
    context: usize,
    max_rows: usize,
    state: State<B>,
    /// Per layer `[context, kv_dim]` keys and values.
    kv_cache: Vec<(B::Buf, B::Buf)>,
    pos: usize,
    logits: Vec<f32>,
}

impl<B: Backend, W: WeightSource> Llama<B, W> {
    /// Allocates state for `context` positions (at most the model's) and up to `max_rows`
    /// positions per forward pass (a longer prompt takes several passes).
    pub fn new(
        backend: B,
        weights: W,
        metadata: Metadata,
        context: usize,
        max_rows: usize,
    ) -> Result<Self, LlamaError> {
        let config = LlamaConfig::from_model_config(&metadata.config)?;
        let layout = BlobLayout::from_metadata(&metadata, config.n_layers)?;
        if context == 0 || context > config.context_length {
            return Err(LlamaError::Config {
                setting: "context",
                message: format!(
                    "{context} must be between 1 and the model's context_length {}",
                    config.context_length
                ),
            });
        }
        let max_rows = max_rows.clamp(1, context);
        let c = &config;
        let state = State {
            x: backend.alloc(max_rows * c.dim),
            xb: backend.alloc(max_rows * c.dim),
            xb2: backend.alloc(max_rows * c.dim),
            q: backend.alloc(max_rows * c.q_dim()),
            k: backend.alloc(max_rows * c.kv_dim()),
            v: backend.alloc(max_rows * c.kv_dim()),
            att: backend.alloc(max_rows * c.q_dim()),
            hb: backend.alloc(max_rows * c.ffn_dim),
            hb2: backend.alloc(max_rows * c.ffn_dim),
            last: backend.alloc(c.dim),
            last_norm: backend.alloc(c.dim),
            logits: backend.alloc(c.vocab_size),
        };
        let kv_cache = (0..c.n_layers)
            .map(|_| {
                (
                    backend.alloc_kv(context * c.kv_dim()),
                    backend.alloc_kv(context * c.kv_dim()),
                )
            })
            .collect();
        let logits = vec![0.0; c.vocab_size];
        Ok(Llama {
            backend,
            weights,
            metadata,
            config,
            layout,
            context,
            max_rows,
            state,
            kv_cache,
            pos: 0,
            logits,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn weights(&self) -> &W {
        &self.weights
    }

    /// Positions the KV cache holds.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Positions already in the KV cache.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Logits after the last position computed.
    pub fn last_logits(&self) -> &[f32] {
        &self.logits
    }

    /// Forgets cached positions from `pos` on (0 starts a new sequence).
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
    }

    /// Runs `tokens` at positions `pos() ..` (in passes of at most `max_rows` positions) and
    /// returns the logits after the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<&[f32], LlamaError> {
        if tokens.is_empty() {
            return Ok(&self.logits);
        }
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
        for chunk in tokens.chunks(self.max_rows) {
            self.forward_pass(chunk)?;
        }
        Ok(&self.logits)
    }

    /// One pass over all weights for `tokens` (at most `max_rows`) at positions `pos ..`.
    fn forward_pass(&mut self, tokens: &[u32]) -> Result<(), LlamaError> {
        let c = &self.config;
        let (dim, q_dim, kv_dim, ffn) = (c.dim, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let rows = tokens.len();
        let pos0 = self.pos;
        let eps = c.rms_norm_eps;
        let shape = AttentionShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        let be = &self.backend;
        let s = &mut self.state;
        let blobs = &self.metadata.blobs;

        // Token embeddings -> x [rows, dim]. A tied table is also the LM head, so its blob is
        // held for the whole pass; an untied one is only read row by row.
        let embed_blob = &blobs[self.layout.embed];
        let embed_guard = if c.tie_word_embeddings {
            let guard = self.weights.acquire(self.layout.embed)?;
            let table = tensor(embed_blob, &guard, names::TOKEN_EMBD, &[c.vocab_size, dim])?; // [vocab, dim]
            be.embed_rows(table, tokens, &mut s.x);
            Some(guard)
        } else {
            let (dtype, offset, row_bytes) = embedding_rows(embed_blob, c.vocab_size, dim)?;
            let mut bytes = Vec::with_capacity(rows * row_bytes);
            for &id in tokens {
                let at = offset + (id as u64) * row_bytes as u64;
                bytes.extend(self.weights.read_range(self.layout.embed, at, row_bytes)?);
            }
            let picked = crate::backend::WeightView::host(dtype, rows, dim, &bytes); // [rows, dim]
            let ids: Vec<u32> = (0..rows as u32).collect();
            be.embed_rows(picked, &ids, &mut s.x);
            None
        };

        for (l, &blob_index) in self.layout.layers.iter().enumerate() {
            let guard = self.weights.acquire(blob_index)?;
            let blob = &blobs[blob_index];
            let attn_norm = tensor(blob, &guard, names::ATTN_NORM, &[dim])?; // [dim]
            let wq = tensor(blob, &guard, names::ATTN_Q, &[q_dim, dim])?; // [n_heads·hd, dim]
            let wk = tensor(blob, &guard, names::ATTN_K, &[kv_dim, dim])?; // [n_kv·hd, dim]
            let wv = tensor(blob, &guard, names::ATTN_V, &[kv_dim, dim])?; // [n_kv·hd, dim]
            let wo = tensor(blob, &guard, names::ATTN_OUTPUT, &[dim, q_dim])?; // [dim, n_heads·hd]
            let ffn_norm = tensor(blob, &guard, names::FFN_NORM, &[dim])?; // [dim]
            let w_gate = tensor(blob, &guard, names::FFN_GATE, &[ffn, dim])?; // [ffn, dim]
            let w_up = tensor(blob, &guard, names::FFN_UP, &[ffn, dim])?; // [ffn, dim]
            let w_down = tensor(blob, &guard, names::FFN_DOWN, &[dim, ffn])?; // [dim, ffn]
            let (k_cache, v_cache) = &mut self.kv_cache[l]; // [context, kv_dim] each

            // Attention: x += Wo · attn(rope(Wq·n), rope(Wk·n), Wv·n), n = rmsnorm(x)
            be.rmsnorm(&s.x, rows, attn_norm, eps, &mut s.xb);
            be.matmul_many(
                &s.xb,
                rows,
                &[wq, wk, wv],
                &mut [&mut s.q, &mut s.k, &mut s.v],
            );
            be.rope(
                &mut s.q,
                rows,
                c.n_heads,
                c.head_dim,
                pos0,
                &c.rope_inv_freq,
            );
            be.rope(
                &mut s.k,
                rows,
                c.n_kv_heads,
                c.head_dim,
                pos0,
                &c.rope_inv_freq,
            );
            be.copy_rows(&s.k, 0, k_cache, pos0, rows, kv_dim);
            be.copy_rows(&s.v, 0, v_cache, pos0, rows, kv_dim);
            be.attention(&s.q, rows, k_cache, v_cache, pos0, shape, &mut s.att);
            be.matmul(&s.att, rows, wo, &mut s.xb2);
            be.add(&mut s.x, &s.xb2, rows * dim);

            // FFN: x += W_down · (silu(W_gate·n) ⊙ W_up·n), n = rmsnorm(x)
            be.rmsnorm(&s.x, rows, ffn_norm, eps, &mut s.xb);
            be.matmul_many(&s.xb, rows, &[w_gate, w_up], &mut [&mut s.hb, &mut s.hb2]);
            be.swiglu(&mut s.hb, &s.hb2, rows * ffn);
            be.matmul(&s.hb, rows, w_down, &mut s.xb2);
            be.add(&mut s.x, &s.xb2, rows * dim);
        }

        // Only the last position's logits are needed (prefill samples after the prompt).
        let output_guard = self.weights.acquire(self.layout.output)?;
        let output_blob = &blobs[self.layout.output];
        let output_norm = tensor(output_blob, &output_guard, names::OUTPUT_NORM, &[dim])?; // [dim]
        be.copy_rows(&s.x, rows - 1, &mut s.last, 0, 1, dim);
        be.rmsnorm(&s.last, 1, output_norm, eps, &mut s.last_norm);
        let head = match &embed_guard {
            Some(g) => tensor(embed_blob, g, names::TOKEN_EMBD, &[c.vocab_size, dim])?, // [vocab, dim]
            None => tensor(
                output_blob,
                &output_guard,
                names::OUTPUT,
                &[c.vocab_size, dim],
            )?, // [vocab, dim]
        };
        be.matmul(&s.last_norm, 1, head, &mut s.logits);
        be.read(&s.logits, &mut self.logits);
        be.status()?;
        drop(output_guard);
        drop(embed_guard);
        self.weights.end_pass();
        self.pos += rows;
        Ok(())
    }
}
