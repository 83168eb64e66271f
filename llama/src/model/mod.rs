//! The model: its state, KV caches and the forward pass, written once over [`Backend`]
//! (llama2.c style: top to bottom, state allocated once). A pass is the embedding, then every
//! layer's attention and FFN blocks, then the LM head (the blocks are in `graph.rs`); which
//! tensors those read, and where they lie in each blob, comes from the family description
//! resolved at load ([`arch`]).

pub mod arch;
pub(crate) mod graph;
mod hidden;

use weights_format::Metadata;

use crate::LlamaError;
use crate::backend::{Backend, BackendError, PassInfo, RowGroup};
use crate::config::LlamaConfig;
use crate::weights::{BlobBytes, WeightSource, WeightView};

use arch::ModelTable;
use graph::{Graph, Layer, PassShape, Segment, State};

/// Per layer, a key and a value cache buffer.
type KvLayers<B> = Vec<(<B as Backend>::KvBuf, <B as Backend>::KvBuf)>;

/// The number of the next [`KvCache`] made (0 is the model's own sequence's).
static NEXT_KV_CACHE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One sequence's keys and values for every layer, `[slots, kv_dim]` each, and how many
/// positions are filled. A layer keeps all `capacity` positions, or on a sliding-window layer
/// a ring of at most twice its window (`residency::kv_positions`: position `p` in slot
/// `p % slots`). Batched decoding gives each sequence its own cache of the size it needs (see
/// [`crate::batch`] for why per-sequence rather than paged).
pub struct KvCache<B: Backend> {
    /// This cache's number ([`PassInfo::sequence`]): from [`NEXT_KV_CACHE`], so never one that
    /// an earlier cache had, even when its buffers land where an earlier cache's were.
    id: u64,
    layers: KvLayers<B>,
    kv_dim: usize,
    capacity: usize,
    len: usize,
    rings: Vec<Ring>,
}

/// A layer whose cache is a ring smaller than the positions it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ring {
    slots: usize,
    window: usize,
}

/// Where a cache filled up to `from` positions can be cut back to when `to` is asked for:
/// `to`, unless one of its rings has overwritten a key that the next position would see
/// (`to` further back than `slots - window` on a ring that has wrapped), then 0: nothing
/// is kept.
fn rewind(rings: &[Ring], from: usize, to: usize) -> usize {
    let kept = rings
        .iter()
        .all(|r| from <= r.slots || to + (r.slots - r.window) >= from);
    if kept || to >= from { to } else { 0 }
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

    /// Whether positions `0 .. positions` lie in slots `0 .. positions` of every layer (no ring
    /// has wrapped over them), so that they can be copied as one block.
    fn holds_unwrapped(&self, positions: usize) -> bool {
        positions <= self.capacity && self.rings.iter().all(|r| positions <= r.slots)
    }

    /// Makes this cache hold `src`'s first `positions` positions (and nothing after them):
    /// one copy per layer's keys and values on `backend`. Returns `false`, copying nothing,
    /// when either cache cannot hold them unwrapped (a ring layer shorter than `positions`),
    /// `src` has fewer or the caches are of different models.
    pub fn copy_prefix_from(
        &mut self,
        backend: &B,
        src: &KvCache<B>,
        positions: usize,
    ) -> Result<bool, LlamaError> {
        if positions > src.len
            || !src.holds_unwrapped(positions)
            || !self.holds_unwrapped(positions)
            || src.kv_dim != self.kv_dim
            || src.layers.len() != self.layers.len()
        {
            return Ok(false);
        }
        let values = positions * self.kv_dim;
        for ((k_dst, v_dst), (k_src, v_src)) in self.layers.iter_mut().zip(&src.layers) {
            backend.copy_kv(k_src, k_dst, values)?;
            backend.copy_kv(v_src, v_dst, values)?;
        }
        self.len = positions;
        Ok(true)
    }

    /// Forgets positions from `len` on. On a model with sliding-window layers a cache whose
    /// rings have wrapped can only go back a window's length; further back it forgets
    /// everything ([`KvCache::len`] says what was kept).
    pub fn truncate(&mut self, len: usize) {
        self.len = rewind(&self.rings, self.len, len.min(self.len));
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

/// A LLaMA-family model bound to a backend, a weight source and a KV cache of `context`
/// positions.
pub struct Llama<B: Backend, W: WeightSource> {
    backend: B,
    weights: W,
    metadata: Metadata,
    config: LlamaConfig,
    table: ModelTable,
    context: usize,
    max_rows: usize,
    state: State<B>,
    /// Per layer `[context, kv_dim]` keys and values of the single sequence of
    /// [`Llama::forward`]; allocated by its first call, so that a model used only for batches
    /// (which own their caches) does not hold a whole context's cache it never uses.
    kv_cache: KvLayers<B>,
    pos: usize,
    logits: Vec<f32>,
    /// `[sequences with logits, vocab]` of the last [`Llama::forward_batch`].
    batch_logits: Vec<f32>,
    /// The greedy tokens of the last greedy pass: one per sequence with logits of
    /// [`Llama::forward_batch_greedy`], or the one of [`Llama::forward_greedy`] (a pass of one
    /// sequence).
    greedy_ids: Vec<u32>,
    /// Bumped whenever `state` or `kv_cache` get new buffers (see [`PassInfo::generation`]).
    generation: u64,
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
        let table = ModelTable::resolve(&metadata, &config)?;
        between_1_and(
            "context",
            context,
            config.context_length,
            "the model's context_length",
        )?;
        // A single sequence never has more than `context` rows, but a batch of them may.
        let max_rows = max_rows.max(1);
        let state = State::new(&backend, &config, max_rows, context)?;
        let logits = vec![0.0; config.vocab_size];
        Ok(Llama {
            backend,
            weights,
            metadata,
            config,
            table,
            context,
            max_rows,
            state,
            kv_cache: Vec::new(),
            pos: 0,
            logits,
            batch_logits: Vec::new(),
            greedy_ids: Vec::new(),
            generation: 0,
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

    /// Most positions of one sequence one pass computes: `max_rows()`, and on a model with
    /// sliding-window layers at most the smallest window (so that a ring of twice the window
    /// still holds every key the pass's rows see; see `residency::kv_positions`). A longer
    /// prompt takes several passes.
    pub fn max_rows_per_sequence(&self) -> usize {
        self.config
            .smallest_window()
            .map_or(self.max_rows, |w| w.min(self.max_rows))
    }

    /// Bytes of a [`KvCache`] of `capacity` positions on this model's backend, each layer
    /// counted with the positions it keeps.
    pub fn kv_cache_bytes(&self, capacity: usize) -> u64 {
        residency::kv_cache_bytes(
            &self.metadata.config,
            capacity as u64,
            self.backend.kv_value_bytes() as u64,
        )
    }

    /// Positions layer `layer`'s cache keeps for a sequence of up to `capacity` positions.
    fn kv_slots(&self, layer: usize, capacity: usize) -> usize {
        residency::kv_positions(&self.metadata.config, layer as u32, capacity as u64) as usize
    }

    /// The layers whose caches of `capacity` positions are rings.
    fn kv_rings(&self, capacity: usize) -> Vec<Ring> {
        (0..self.config.n_layers)
            .filter_map(|l| {
                let window = self.config.window(l)?;
                let slots = self.kv_slots(l, capacity);
                (slots < capacity).then_some(Ring { slots, window })
            })
            .collect()
    }

    /// Per layer a pair of zeroed key and value buffers for `capacity` positions (each layer's
    /// own slots).
    fn alloc_kv_layers(&self, capacity: usize) -> Result<KvLayers<B>, LlamaError> {
        (0..self.config.n_layers)
            .map(|l| {
                let len = self.kv_slots(l, capacity) * self.config.kv_dim();
                Ok((self.backend.alloc_kv(len)?, self.backend.alloc_kv(len)?))
            })
            .collect()
    }

    /// An empty cache of `capacity` positions (1 ..= `context()`) for [`Llama::forward_batch`].
    pub fn new_kv_cache(&self, capacity: usize) -> Result<KvCache<B>, LlamaError> {
        between_1_and("KV cache capacity", capacity, self.context, "the context")?;
        Ok(KvCache {
            id: NEXT_KV_CACHE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            layers: self.alloc_kv_layers(capacity)?,
            kv_dim: self.config.kv_dim(),
            capacity,
            len: 0,
            rings: self.kv_rings(capacity),
        })
    }

    /// Positions already in the KV cache.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Logits after the last position computed (empty after a [`Llama::forward_greedy`]).
    pub fn last_logits(&self) -> &[f32] {
        &self.logits
    }

    /// Forgets cached positions from `pos` on (0 starts a new sequence). On a model with
    /// sliding-window layers the cache can only go back a window's length once its rings have
    /// wrapped; further back it forgets everything: [`Llama::pos`] says what was kept.
    pub fn truncate(&mut self, pos: usize) {
        self.pos = rewind(&self.kv_rings(self.context), self.pos, pos.min(self.pos));
    }

    /// Checks that `rows` more positions fit the context and that every token is in the
    /// vocabulary.
    fn check_tokens(&self, tokens: &[u32]) -> Result<(), LlamaError> {
        if self.pos + tokens.len() > self.context {
            return Err(LlamaError::ContextOverflow {
                prompt: self.pos + tokens.len(),
                context: self.context,
            });
        }
        self.check_vocab(tokens)
    }

    fn check_vocab(&self, tokens: &[u32]) -> Result<(), LlamaError> {
        match tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            Some(&id) => Err(LlamaError::TokenOutOfRange {
                id,
                vocab: self.config.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// Runs `tokens` at positions `pos() ..` (in passes of at most
    /// [`Llama::max_rows_per_sequence`] positions) and returns the logits after the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<&[f32], LlamaError> {
        if tokens.is_empty() {
            return Ok(&self.logits);
        }
        self.check_tokens(tokens)?;
        for chunk in tokens.chunks(self.max_rows_per_sequence()) {
            self.single_pass(chunk, false)?;
        }
        Ok(&self.logits)
    }

    /// [`Llama::forward`] for a sequence that chooses greedily: the greedy token after the last
    /// position, [`crate::sampling::argmax`] of the logits `forward` would return, taken by the
    /// backend where the logits are (on a GPU only the id comes back, not the whole row, and no
    /// host time goes into the argmax). [`Llama::last_logits`] is empty afterwards.
    pub fn forward_greedy(&mut self, tokens: &[u32]) -> Result<u32, LlamaError> {
        if tokens.is_empty() {
            return Err(LlamaError::Config {
                setting: "tokens",
                message: "a greedy step needs at least one token".into(),
            });
        }
        self.check_tokens(tokens)?;
        // The chunks of `forward`, the last one read back as its greedy token.
        let per = self.max_rows_per_sequence();
        let last = (tokens.len() - 1) / per * per;
        for chunk in tokens[..last].chunks(per) {
            self.single_pass(chunk, false)?;
        }
        self.single_pass(&tokens[last..], true)?;
        Ok(self.greedy_ids[0])
    }

    /// One pass of the single sequence over `tokens` at positions `pos ..`, on the model's own
    /// cache: the logits into `logits`, or with `greedy` the greedy token into `greedy_ids[0]`.
    fn single_pass(&mut self, tokens: &[u32], greedy: bool) -> Result<(), LlamaError> {
        if self.kv_cache.is_empty() {
            self.kv_cache = self.alloc_kv_layers(self.context)?;
            self.generation += 1;
        }
        let mut kv = std::mem::take(&mut self.kv_cache);
        let mut logits = std::mem::take(&mut self.logits);
        let mut ids = std::mem::take(&mut self.greedy_ids);
        let mut seg = [Segment {
            kv: &mut kv,
            row0: 0,
            rows: tokens.len(),
            pos0: self.pos,
            solo_rows: tokens.len(),
            logits: true,
        }];
        let mut readback = if greedy {
            logits.clear(); // no longer the logits after the last position
            Readback::Greedy(&mut ids)
        } else {
            Readback::Logits(&mut logits)
        };
        let mut done = self.pass(tokens, &mut seg, &mut readback, Some(0));
        if let Err(LlamaError::Backend(BackendError::PassNotRun { reason })) = &done {
            // The backend tried to record the pass and could not; it runs op by op from now.
            tracing::debug!("{reason}; running the pass op by op");
            done = self.pass(tokens, &mut seg, &mut readback, Some(0));
        }
        self.kv_cache = kv;
        self.logits = logits;
        self.greedy_ids = ids;
        done?;
        self.pos += tokens.len();
        Ok(())
    }

    /// Runs several sequences through one pass over the weights: each entry's tokens at
    /// positions `kv.len() ..` of its own cache, which then advances. Returns the logits after
    /// the last token of each entry that asked for them, `[n, vocab]` in entry order. Every
    /// sequence's results are those it gets alone (see [`BatchSeq::solo_rows`]). All tokens
    /// together must fit one pass (`max_rows()`), and each sequence's
    /// [`Llama::max_rows_per_sequence`].
    pub fn forward_batch(&mut self, seqs: &mut [BatchSeq<'_, B>]) -> Result<&[f32], LlamaError> {
        self.batch_pass(seqs, false)?;
        Ok(&self.batch_logits)
    }

    /// [`Llama::forward_batch`] for sequences that choose their next token greedily: instead
    /// of the logits, the greedy token after each entry that asked for logits (in entry order),
    /// [`crate::sampling::argmax`] of the row that `forward_batch` would return, taken by the
    /// backend where the logits are (on a GPU only the ids come back).
    pub fn forward_batch_greedy(
        &mut self,
        seqs: &mut [BatchSeq<'_, B>],
    ) -> Result<&[u32], LlamaError> {
        self.batch_pass(seqs, true)?;
        Ok(&self.greedy_ids)
    }

    /// The pass of [`Llama::forward_batch`] (`greedy`: of [`Llama::forward_batch_greedy`]).
    fn batch_pass(&mut self, seqs: &mut [BatchSeq<'_, B>], greedy: bool) -> Result<(), LlamaError> {
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
        let per_sequence = self.max_rows_per_sequence();
        if let Some(s) = seqs.iter().find(|s| s.tokens.len() > per_sequence) {
            return Err(LlamaError::Config {
                setting: "batch",
                message: format!(
                    "{} tokens of one sequence in one pass; this model takes at most \
                     {per_sequence} (its smallest attention window)",
                    s.tokens.len()
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
            self.check_vocab(s.tokens)?;
            tokens.extend_from_slice(s.tokens);
        }
        if seqs.is_empty() {
            self.batch_logits.clear();
            self.greedy_ids.clear();
            return Ok(());
        }
        // A sequence alone in its pass, computed as the model's own pass of the same rows would
        // be (all of its rows as one chunk, its logits wanted), runs as that one does: its
        // decode steps may be recorded and replayed by the backend, keyed by its cache. A
        // piece of a longer prompt chunk (`solo_rows` larger) or a pass without logits runs
        // other kernels, so it is not offered as one.
        let sequence = match &*seqs {
            [alone] if alone.logits && alone.solo_rows.max(1) == alone.tokens.len() => {
                Some(alone.kv.id)
            }
            _ => None,
        };
        let mut row0 = 0;
        let mut segs: Vec<Segment<'_, B>> = seqs
            .iter_mut()
            .map(|s| {
                let seg = Segment {
                    row0,
                    rows: s.tokens.len(),
                    pos0: s.kv.len,
                    solo_rows: s.solo_rows.max(1),
                    logits: s.logits,
                    kv: &mut s.kv.layers,
                };
                row0 += seg.rows;
                seg
            })
            .collect();
        let mut logits = std::mem::take(&mut self.batch_logits);
        let mut ids = std::mem::take(&mut self.greedy_ids);
        let mut readback = if greedy {
            Readback::Greedy(&mut ids)
        } else {
            Readback::Logits(&mut logits)
        };
        let mut done = self.pass(&tokens, &mut segs, &mut readback, sequence);
        if let Err(LlamaError::Backend(BackendError::PassNotRun { reason })) = &done {
            // As in `single_pass`: the recording failed, the backend runs the pass op by op.
            tracing::debug!("{reason}; running the pass op by op");
            done = self.pass(&tokens, &mut segs, &mut readback, sequence);
        }
        self.batch_logits = logits;
        self.greedy_ids = ids;
        done?;
        for s in seqs.iter_mut() {
            s.kv.len += s.tokens.len();
        }
        Ok(())
    }

    /// Makes `last`, `last_norm` and `logits` hold `n` rows.
    fn ensure_logit_rows(&mut self, n: usize) -> Result<(), LlamaError> {
        if n > self.state.logit_rows {
            let (be, c, s) = (&self.backend, &self.config, &mut self.state);
            s.last = be.alloc(n * c.dim)?;
            s.last_norm = be.alloc(n * c.dim)?;
            s.logits = be.alloc(n * c.vocab_size)?;
            s.logit_rows = n;
            self.generation += 1;
        }
        Ok(())
    }

    /// One pass over all weights for `tokens` (at most `max_rows`): the rows of each segment,
    /// each at its own positions in its own cache (`sequence`: the one segment's cache number,
    /// [`PassInfo::sequence`], when it is alone). The logits after each segment that asks for
    /// them, or their greedy tokens, go to `readback`.
    fn pass(
        &mut self,
        tokens: &[u32],
        segs: &mut [Segment<'_, B>],
        readback: &mut Readback<'_>,
        sequence: Option<u64>,
    ) -> Result<(), LlamaError> {
        let started = std::time::Instant::now();
        let n_logits = segs.iter().filter(|s| s.logits).count();
        self.ensure_logit_rows(n_logits)?;
        let Llama {
            backend: be,
            weights,
            config: c,
            table,
            state: s,
            generation,
            ..
        } = self;
        let groups: Vec<RowGroup> = segs
            .iter()
            .map(|g| RowGroup {
                rows: g.rows,
                solo_rows: g.solo_rows,
            })
            .collect();
        let p = PassShape::of(c, table, tokens.len(), &groups);

        // The inputs, then every layer, then the LM head (only the last position's logits of
        // each segment are needed: prefill samples after the prompt). The output blob is taken
        // even when no logits are, to keep the pass's order.
        let embed_guard = embed(be, weights, table, tokens, &mut s.x)?;
        be.begin_pass(&PassInfo {
            rows: tokens.len(),
            sequence,
            pos: segs.first().map_or(0, |g| g.pos0),
            weights_stable: weights.all_resident(),
            generation: *generation,
        })?;
        let mut graph = Graph { be, s, segs, p: &p };
        let ran = (|| {
            graph.scale_embeddings()?;
            for (l, layer) in table.layers.iter().enumerate() {
                let guard = weights.acquire(layer.blob)?;
                be.weights_from_blob(layer.blob);
                let w = Layer {
                    table: layer,
                    bytes: guard.bytes(),
                };
                graph.layer(l, &w)?;
            }
            let out = &table.output;
            let output_guard = weights.acquire(out.blob)?;
            be.weights_from_blob(out.blob);
            if n_logits > 0 {
                let output_norm = out.output_norm.view(output_guard.bytes(), &out.file)?; // [dim]
                let head = match (&out.output, &embed_guard) {
                    (Some(t), _) => t.view(output_guard.bytes(), &out.file)?, // [vocab, dim]
                    (None, Some(tied)) => {
                        table
                            .embed
                            .token_embd
                            .view(tied.bytes(), &table.embed.file)? // [vocab, dim]
                    }
                    (None, None) => {
                        return Err(LlamaError::MissingTensor {
                            blob: out.file.clone(),
                            name: weights_format::names::OUTPUT.to_string(),
                        });
                    }
                };
                graph.head(output_norm, head)?;
            }
            Ok::<_, LlamaError>(output_guard)
        })();
        let ended = be.end_pass(ran.is_ok());
        let output_guard = ran?;
        ended?;
        let queued = started.elapsed();
        match readback {
            Readback::Logits(logits) => {
                logits.resize(n_logits * c.vocab_size, 0.0);
                if n_logits > 0 {
                    be.read(&s.logits, logits)?;
                }
            }
            Readback::Greedy(ids) => {
                ids.resize(n_logits, 0);
                if n_logits > 0 {
                    be.argmax_rows(&s.logits, c.vocab_size, ids)?;
                }
            }
        }
        // Where a pass's wall time goes on the host: queueing its work, then waiting for it
        // (and for the logits): `RUST_LOG=llama::pass_timing=trace`.
        tracing::trace!(
            target: "llama::pass_timing",
            rows = tokens.len(),
            queued_us = queued.as_micros() as u64,
            waited_us = (started.elapsed() - queued).as_micros() as u64,
            "pass"
        );
        drop(output_guard);
        drop(embed_guard);
        weights.end_pass();
        Ok(())
    }
}

/// What a pass hands back for the segments that want logits, in segment order.
enum Readback<'a> {
    /// The logits, `[n, vocab]`.
    Logits(&'a mut Vec<f32>),
    /// The greedy token of each row (the backend's [`Backend::argmax_rows`]).
    Greedy(&'a mut Vec<u32>),
}

/// An error for `setting` unless `1 <= value <= max` (`max` being `what`).
fn between_1_and(
    setting: &'static str,
    value: usize,
    max: usize,
    what: &str,
) -> Result<(), LlamaError> {
    if value == 0 || value > max {
        return Err(LlamaError::Config {
            setting,
            message: format!("{value} must be between 1 and {what} {max}"),
        });
    }
    Ok(())
}

/// The pass's inputs: the embeddings of `tokens` into `x` (`[rows, dim]`). A tied table is also
/// the LM head, so its blob is acquired and its guard returned, to be held for the whole pass;
/// an untied one is only read row by row, into host memory.
fn embed<'w, B: Backend, W: WeightSource>(
    be: &B,
    weights: &'w W,
    table: &ModelTable,
    tokens: &[u32],
    x: &mut B::Buf,
) -> Result<Option<W::Guard<'w>>, LlamaError> {
    let embed = &table.embed;
    let t = &embed.token_embd; // [vocab, dim]
    if table.output.output.is_none() {
        let guard = weights.acquire(embed.blob)?;
        be.embed_rows(t.view(guard.bytes(), &embed.file)?, tokens, x)?;
        return Ok(Some(guard));
    }
    let row_bytes = t.row_bytes();
    let mut bytes = Vec::with_capacity(tokens.len() * row_bytes);
    for &id in tokens {
        let at = (t.offset + id as usize * row_bytes) as u64;
        bytes.extend(weights.read_range(embed.blob, at, row_bytes)?);
    }
    let rows = WeightView::host(t.dtype, tokens.len(), t.cols, &bytes); // [rows, dim]
    be.embed_host_rows(rows, x)?;
    Ok(None)
}
