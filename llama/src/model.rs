//! The forward pass, written once over [`Backend`] (llama2.c style: top to bottom, every weight
//! with its shape, state allocated once).

mod hidden;

use weights_format::{Metadata, names};

use crate::LlamaError;
use crate::backend::{AttentionSeq, AttentionShape, Backend, RowGroup};
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
    /// The residual and normed residual of each sequence's last position `[logit_rows, dim]`.
    last: B::Buf,
    last_norm: B::Buf,
    /// `[logit_rows, vocab]`
    logits: B::Buf,
    /// Rows `last`, `last_norm` and `logits` hold: 1 until a batch needs more.
    logit_rows: usize,
}

/// One sequence's keys and values for every layer, `[capacity, kv_dim]` each, and how many
/// positions are filled. Batched decoding gives each sequence its own cache of the size it
/// needs (see [`crate::batch`] for why per-sequence rather than paged).
pub struct KvCache<B: Backend> {
    layers: Vec<(B::Buf, B::Buf)>,
    kv_dim: usize,
    capacity: usize,
    len: usize,
}

impl<B: Backend> KvCache<B> {
    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets positions from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// One sequence's part of a [`Llama::forward_batch`]: `tokens` run at positions `kv.len() ..`.
pub struct BatchSeq<'a, B: Backend> {
    pub kv: &'a mut KvCache<B>,
    pub tokens: &'a [u32],
    /// The row count a single-sequence [`Llama::forward`] computes these positions with (the
    /// whole prompt while prefilling it in chunks, 1 when decoding), so that the results are
    /// bit for bit those of the sequence alone (see [`RowGroup`]).
    pub solo_rows: usize,
    /// Whether to compute the logits after the last token (a prefill chunk that does not end
    /// the prompt needs none).
    pub logits: bool,
}

/// A sequence's rows in one pass, with the cache layers they read and fill.
struct Segment<'a, B: Backend> {
    kv: &'a mut [(B::Buf, B::Buf)],
    rows: usize,
    pos0: usize,
    solo_rows: usize,
    logits: bool,
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
    /// Per layer `[context, kv_dim]` keys and values of the single sequence of
    /// [`Llama::forward`]; allocated by its first call, so that a model used only for batches
    /// (which own their caches) does not hold a whole context's cache it never uses.
    kv_cache: Vec<(B::Buf, B::Buf)>,
    pos: usize,
    logits: Vec<f32>,
    /// `[sequences with logits, vocab]` of the last [`Llama::forward_batch`].
    batch_logits: Vec<f32>,
    /// Decode steps run op by op so far: recording one waits for the first.
    eager_decode_steps: usize,
    /// Whether the backend holds a recording of this model's decode step.
    step_recorded: bool,
    /// Set when recording failed: every step then runs op by op.
    recording_failed: bool,
}

impl<B: Backend, W: WeightSource> Llama<B, W> {
    /// Allocates state for `context` positions (at most the model's) and up to `max_rows`
    /// positions per forward pass (a longer prompt takes several passes; the sequences of a
    /// batch share them).
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
        // A single sequence never has more than `context` rows, but a batch of them may.
        let max_rows = max_rows.max(1);
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
            logit_rows: 1,
        };
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
            kv_cache: Vec::new(),
            pos: 0,
            logits,
            batch_logits: Vec::new(),
            eager_decode_steps: 0,
            step_recorded: false,
            recording_failed: false,
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

    /// Most positions one pass computes (all sequences of a batch together).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Bytes of a [`KvCache`] of `capacity` positions on this model's backend.
    pub fn kv_cache_bytes(&self, capacity: usize) -> u64 {
        let c = &self.config;
        (capacity * c.kv_dim() * 2 * c.n_layers * self.backend.kv_value_bytes()) as u64
    }

    /// An empty cache of `capacity` positions (1 ..= `context()`) for [`Llama::forward_batch`].
    pub fn new_kv_cache(&self, capacity: usize) -> Result<KvCache<B>, LlamaError> {
        if capacity == 0 || capacity > self.context {
            return Err(LlamaError::Config {
                setting: "KV cache capacity",
                message: format!(
                    "{capacity} must be between 1 and the context {}",
                    self.context
                ),
            });
        }
        let kv_dim = self.config.kv_dim();
        let layers = (0..self.config.n_layers)
            .map(|_| {
                (
                    self.backend.alloc_kv(capacity * kv_dim),
                    self.backend.alloc_kv(capacity * kv_dim),
                )
            })
            .collect();
        Ok(KvCache {
            layers,
            kv_dim,
            capacity,
            len: 0,
        })
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
            self.single_pass(chunk)?;
        }
        Ok(&self.logits)
    }

    /// One pass of the single sequence over `tokens` at positions `pos ..`, on the model's own
    /// cache. A decode step goes through the backend's recorded step when it can record one
    /// (see [`Llama::step_mode`]).
    fn single_pass(&mut self, tokens: &[u32]) -> Result<(), LlamaError> {
        if self.kv_cache.is_empty() {
            let len = self.context * self.config.kv_dim();
            self.kv_cache = (0..self.config.n_layers)
                .map(|_| (self.backend.alloc_kv(len), self.backend.alloc_kv(len)))
                .collect();
        }
        let mode = self.step_mode(tokens.len());
        let ran = self.single_pass_as(tokens, mode)?;
        match mode {
            PassMode::Eager if tokens.len() == 1 => self.eager_decode_steps += 1,
            PassMode::Record if ran => self.step_recorded = true,
            PassMode::Record => {
                tracing::debug!("the decode step could not be recorded; decoding op by op");
                self.recording_failed = true;
            }
            // The backend dropped its recording (it replaced a buffer the step used): record
            // again at the next step.
            PassMode::Replay if !ran => self.step_recorded = false,
            _ => {}
        }
        if !ran {
            self.single_pass_as(tokens, PassMode::Eager)?;
        }
        self.pos += tokens.len();
        Ok(())
    }

    /// How a single-sequence pass of `rows` positions runs: a decode step is recorded once the
    /// weights are all resident (their addresses never change) and one step has run op by op
    /// (which creates every buffer a step creates lazily), then replayed.
    fn step_mode(&self, rows: usize) -> PassMode {
        if rows != 1
            || self.recording_failed
            || !self.backend.records_steps()
            || !self.weights.all_resident()
        {
            PassMode::Eager
        } else if self.step_recorded {
            PassMode::Replay
        } else if self.eager_decode_steps >= 1 {
            PassMode::Record
        } else {
            PassMode::Eager
        }
    }

    fn single_pass_as(&mut self, tokens: &[u32], mode: PassMode) -> Result<bool, LlamaError> {
        let mut kv = std::mem::take(&mut self.kv_cache);
        let mut logits = std::mem::take(&mut self.logits);
        let mut seg = [Segment {
            kv: &mut kv,
            rows: tokens.len(),
            pos0: self.pos,
            solo_rows: tokens.len(),
            logits: true,
        }];
        let done = self.forward_pass(tokens, &mut seg, &mut logits, mode);
        self.kv_cache = kv;
        self.logits = logits;
        done
    }

    /// Runs several sequences through one pass over the weights: each entry's tokens at
    /// positions `kv.len() ..` of its own cache, which then advances. Returns the logits after
    /// the last token of each entry that asked for them, `[n, vocab]` in entry order. Every
    /// sequence's results are those it gets alone (see [`BatchSeq::solo_rows`]). All tokens
    /// together must fit one pass (`max_rows()`).
    pub fn forward_batch(&mut self, seqs: &mut [BatchSeq<'_, B>]) -> Result<&[f32], LlamaError> {
        let rows: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if rows > self.max_rows {
            return Err(LlamaError::Config {
                setting: "batch",
                message: format!(
                    "{rows} tokens in one pass; the model was set up for at most {}",
                    self.max_rows
                ),
            });
        }
        let mut tokens = Vec::with_capacity(rows);
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                return Err(LlamaError::Config {
                    setting: "batch",
                    message: "a sequence of the batch has no tokens".into(),
                });
            }
            if s.kv.layers.len() != self.config.n_layers || s.kv.kv_dim != self.config.kv_dim() {
                return Err(LlamaError::Config {
                    setting: "batch",
                    message: "a KV cache was made for a model of another shape".into(),
                });
            }
            if s.kv.len + s.tokens.len() > s.kv.capacity {
                return Err(LlamaError::ContextOverflow {
                    prompt: s.kv.len + s.tokens.len(),
                    context: s.kv.capacity,
                });
            }
            if let Some(&id) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.config.vocab_size)
            {
                return Err(LlamaError::TokenOutOfRange {
                    id,
                    vocab: self.config.vocab_size,
                });
            }
            tokens.extend_from_slice(s.tokens);
        }
        if seqs.is_empty() {
            self.batch_logits.clear();
            return Ok(&self.batch_logits);
        }
        let mut segs: Vec<Segment<'_, B>> = seqs
            .iter_mut()
            .map(|s| Segment {
                rows: s.tokens.len(),
                pos0: s.kv.len,
                solo_rows: s.solo_rows.max(1),
                logits: s.logits,
                kv: &mut s.kv.layers,
            })
            .collect();
        let mut logits = std::mem::take(&mut self.batch_logits);
        let done = self.forward_pass(&tokens, &mut segs, &mut logits, PassMode::Eager);
        self.batch_logits = logits;
        done?;
        for s in seqs.iter_mut() {
            s.kv.len += s.tokens.len();
        }
        Ok(&self.batch_logits)
    }

    /// Makes `last`, `last_norm` and `logits` hold `n` rows.
    fn ensure_logit_rows(&mut self, n: usize) {
        if n > self.state.logit_rows {
            let (be, c, s) = (&self.backend, &self.config, &mut self.state);
            s.last = be.alloc(n * c.dim);
            s.last_norm = be.alloc(n * c.dim);
            s.logits = be.alloc(n * c.vocab_size);
            s.logit_rows = n;
            // A recorded decode step wrote into the buffers just replaced.
            be.forget_step();
            self.step_recorded = false;
        }
    }

    /// One pass over all weights for `tokens` (at most `max_rows`): the rows of each segment in
    /// turn, each at its own positions in its own cache. The logits after each segment that
    /// asks for them go to `logits_out` (`[n, vocab]`). The matmuls take all rows together: that
    /// is what shares the pass over the weights. The embedding always runs op by op; what
    /// follows it runs as `mode` says (a recorded decode step has one segment of one row).
    /// Ok(false): the recorded step was not available and nothing after the embedding ran.
    fn forward_pass(
        &mut self,
        tokens: &[u32],
        segs: &mut [Segment<'_, B>],
        logits_out: &mut Vec<f32>,
        mode: PassMode,
    ) -> Result<bool, LlamaError> {
        let n_logits = segs.iter().filter(|s| s.logits).count();
        self.ensure_logit_rows(n_logits);
        let c = &self.config;
        let (dim, q_dim, kv_dim, ffn) = (c.dim, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let rows = tokens.len();
        let eps = c.rms_norm_eps;
        let shape = AttentionShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        let groups: Vec<RowGroup> = segs
            .iter()
            .map(|g| RowGroup {
                rows: g.rows,
                solo_rows: g.solo_rows,
            })
            .collect();
        // First row of each segment.
        let row0: Vec<usize> = segs
            .iter()
            .scan(0, |next, g| {
                let first = *next;
                *next += g.rows;
                Some(first)
            })
            .collect();
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

        // What follows the embedding runs op by op, is recorded (then replayed) or is replayed.
        let pos = segs.first().map_or(0, |g| g.pos0);
        let mut capture = None;
        match mode {
            PassMode::Eager => {}
            PassMode::Record => {
                if !be.begin_step_capture(pos) {
                    return Ok(false);
                }
                // Ends the recording on every way out, errors included.
                capture = Some(StepCapture { backend: be });
            }
            PassMode::Replay => {
                if !be.replay_step(pos) {
                    return Ok(false);
                }
            }
        }
        let layers = if mode == PassMode::Replay {
            &[][..]
        } else {
            &self.layout.layers[..]
        };
        for (l, &blob_index) in layers.iter().enumerate() {
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

            // Attention: x += Wo · attn(rope(Wq·n), rope(Wk·n), Wv·n), n = rmsnorm(x)
            be.rmsnorm(&s.x, rows, attn_norm, eps, &mut s.xb);
            be.matmul_batch(
                &s.xb,
                &groups,
                &[wq, wk, wv],
                &mut [&mut s.q, &mut s.k, &mut s.v],
            );
            // Each sequence's rows at its own positions, into its own cache
            // ([capacity, kv_dim] each).
            for (g, &r0) in segs.iter_mut().zip(&row0) {
                let (k_cache, v_cache) = &mut g.kv[l];
                be.rope_store_kv(
                    &mut s.q,
                    &mut s.k,
                    &s.v,
                    r0,
                    g.rows,
                    g.pos0,
                    shape,
                    &c.rope_inv_freq,
                    k_cache,
                    v_cache,
                );
            }
            let attn: Vec<AttentionSeq<'_, B::Buf>> = segs
                .iter()
                .zip(&row0)
                .map(|(g, &r0)| AttentionSeq {
                    row0: r0,
                    rows: g.rows,
                    pos0: g.pos0,
                    k_cache: &g.kv[l].0,
                    v_cache: &g.kv[l].1,
                })
                .collect();
            be.attention_batch(&s.q, &attn, shape, &mut s.att);
            be.matmul_add_batch(&s.att, &groups, wo, &mut s.xb2, &mut s.x);

            // FFN: x += W_down · (silu(W_gate·n) ⊙ W_up·n), n = rmsnorm(x)
            be.rmsnorm(&s.x, rows, ffn_norm, eps, &mut s.xb);
            be.matmul_batch(
                &s.xb,
                &groups,
                &[w_gate, w_up],
                &mut [&mut s.hb, &mut s.hb2],
            );
            be.swiglu(&mut s.hb, &s.hb2, rows * ffn);
            be.matmul_add_batch(&s.hb, &groups, w_down, &mut s.xb2, &mut s.x);
        }

        // Only the last position's logits of each segment are needed (prefill samples after
        // the prompt). The output blob is taken even when none are, to keep the pass's order.
        let output_guard = if mode == PassMode::Replay {
            None
        } else {
            Some(self.weights.acquire(self.layout.output)?)
        };
        if let Some(output_guard) = output_guard.as_ref().filter(|_| n_logits > 0) {
            let output_blob = &blobs[self.layout.output];
            let output_norm = tensor(output_blob, output_guard, names::OUTPUT_NORM, &[dim])?; // [dim]
            let mut i = 0;
            for (g, &r0) in segs.iter().zip(&row0) {
                if g.logits {
                    be.copy_rows(&s.x, r0 + g.rows - 1, &mut s.last, i, 1, dim);
                    i += 1;
                }
            }
            be.rmsnorm(&s.last, n_logits, output_norm, eps, &mut s.last_norm);
            let head = match &embed_guard {
                Some(g) => tensor(embed_blob, g, names::TOKEN_EMBD, &[c.vocab_size, dim])?, // [vocab, dim]
                None => tensor(
                    output_blob,
                    output_guard,
                    names::OUTPUT,
                    &[c.vocab_size, dim],
                )?, // [vocab, dim]
            };
            // Each row is one decode-like position, computed as it is alone.
            let one = RowGroup {
                rows: 1,
                solo_rows: 1,
            };
            be.matmul_batch(
                &s.last_norm,
                &vec![one; n_logits],
                &[head],
                &mut [&mut s.logits],
            );
        }
        if let Some(capture) = capture.take() {
            // Recorded, not run: run it now.
            if !(capture.finish() && be.replay_step(pos)) {
                return Ok(false);
            }
        }
        if n_logits > 0 {
            logits_out.resize(n_logits * c.vocab_size, 0.0);
            be.read(&s.logits, logits_out);
        } else {
            logits_out.clear();
        }
        be.status()?;
        drop(output_guard);
        drop(embed_guard);
        self.weights.end_pass();
        Ok(true)
    }
}

/// How the ops of a pass after the embedding run (see [`Backend::begin_step_capture`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PassMode {
    /// Launched one by one.
    Eager,
    /// Recorded as the model's decode step, then replayed.
    Record,
    /// The recorded decode step replayed.
    Replay,
}

/// A recording in progress: dropping it (an early return) ends it and discards the step.
struct StepCapture<'b, B: Backend> {
    backend: &'b B,
}

impl<B: Backend> StepCapture<'_, B> {
    /// Ends the recording: whether a step was recorded.
    fn finish(self) -> bool {
        let this = std::mem::ManuallyDrop::new(self);
        this.backend.end_step_capture()
    }
}

impl<B: Backend> Drop for StepCapture<'_, B> {
    fn drop(&mut self) {
        self.backend.end_step_capture();
        self.backend.forget_step();
    }
}
