//! The operations the forward pass uses, and the backends that implement them.
//!
//! The forward pass ([`crate::model`]) is written once against [`Backend`]; a backend owns its
//! activation buffers ([`Backend::Buf`]) and KV-cache buffers ([`Backend::KvBuf`]) and reads
//! weights from the [`WeightView`]s the model cuts out of the blobs residency hands out. Shapes
//! are checked when the model resolves its tensors at load ([`crate::model::arch`]), so the ops
//! take them as given. Every op returns a [`Result`]: a failure is reported by the op that
//! failed, never stored for later.
//!
//! This layer knows nothing of models, generation or loading: it sits below them.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod int8;
pub(crate) mod kernels;
pub(crate) mod kquants;
pub mod reference;
pub(crate) mod vnni16;

pub use crate::error::BackendError;
pub use crate::weights::WeightView;
pub use cpu::CpuBackend;
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, DeviceWeights};
pub use kernels::f16_bits_to_f32;
pub use reference::ReferenceBackend;

/// Head layout of grouped-query attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    /// Each KV head serves `n_heads / n_kv_heads` consecutive query heads (HF `repeat_kv`).
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// The gate's activation in the FFN `down(act(gate(x)) · up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x·sigmoid(x)`.
    Silu,
    /// GeLU, tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    GeluTanh,
}

/// An FFN's gate and up weights (one shape) and the gate's activation: what
/// [`Backend::matmul_gated_batch`] multiplies.
#[derive(Debug, Clone, Copy)]
pub struct GatedWeights<'w> {
    pub gate: WeightView<'w>,
    pub up: WeightView<'w>,
    pub act: Activation,
}

/// What [`Backend::rmsnorm`] does with each normalised value: write it over `out`, or add it
/// to `out` (a post-norm before the residual add: Gemma's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormInto {
    Write,
    Add,
}

/// What one layer's attention does beyond its head layout: how its scores are scaled and which
/// keys each query sees.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Multiplier of `q·k` (usually `1/√head_dim`).
    pub scale: f32,
    /// `Some(w)`: the query at position `p` sees keys `p - w + 1 ..= p` only (a sliding-window
    /// layer); `None`: every key up to `p`.
    pub window: Option<usize>,
}

impl AttentionParams {
    /// Scores scaled by `1/√head_dim`, every earlier key seen.
    pub fn causal(shape: AttentionShape) -> AttentionParams {
        AttentionParams {
            scale: 1.0 / (shape.head_dim as f32).sqrt(),
            window: None,
        }
    }

    /// The first position the query at `pos` sees.
    pub fn first_key(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Rows of a batched matmul that belong to one sequence: `rows` consecutive activation rows,
/// and the row count a single-sequence pass computes the same positions with (`solo_rows`: the
/// whole prompt during its prefill, however the batch chunks it; 1 when decoding). A backend
/// whose kernels depend on the row count (the CPU one decodes quantized weight rows once for 4
/// or more rows) uses it to give every row exactly the result it would have alone, so a
/// sequence's output does not depend on what it is batched with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowGroup {
    pub rows: usize,
    pub solo_rows: usize,
}

impl RowGroup {
    /// `rows` rows computed as one sequence of that many rows.
    pub fn solo(rows: usize) -> RowGroup {
        RowGroup {
            rows,
            solo_rows: rows,
        }
    }
}

/// One sequence's part of a batched attention: query rows `row0 .. row0+rows` at positions
/// `pos0 ..` against that sequence's own caches (`[slots, n_kv_heads·head_dim]` each; position
/// `t` is in slot `t % slots`, see [`Backend::rope_store_kv`]).
pub struct AttentionSeq<'a, Kv> {
    pub row0: usize,
    pub rows: usize,
    pub pos0: usize,
    pub k_cache: &'a Kv,
    pub v_cache: &'a Kv,
}

/// One sequence's part of [`Backend::rope_store_kv_batch`]: its rows `row0 .. row0+rows`, at
/// positions `pos0 ..`, stored into its own caches (`[slots, n_kv_heads·head_dim]` each; slot `pos % slots`).
pub struct KvStoreSeq<'a, Kv> {
    pub row0: usize,
    pub rows: usize,
    pub pos0: usize,
    pub k_cache: &'a mut Kv,
    pub v_cache: &'a mut Kv,
}

impl<Kv> KvStoreSeq<'_, Kv> {
    /// The same sequence for the attention that reads what was stored.
    pub fn attention(&self) -> AttentionSeq<'_, Kv> {
        AttentionSeq {
            row0: self.row0,
            rows: self.rows,
            pos0: self.pos0,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
        }
    }
}

/// What a backend is told about the pass that begins ([`Backend::begin_pass`]): enough to
/// decide whether the ops that follow can be recorded once and replayed (the CUDA backend's
/// graphs) without knowing anything about the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassInfo {
    /// Positions computed, all sequences together.
    pub rows: usize,
    /// Some when the pass computes one sequence, the model's own or a batch's alone in its pass
    /// (a server with one request): the number of its KV cache, 0 for the model's own, else a
    /// batch cache's ([`crate::KvCache`]), never reused for another cache. Its buffers
    /// (activations and KV cache) then change only with `generation` and this number, so a
    /// recording of its pass serves the later passes of the same cache. None for a pass of
    /// several sequences.
    pub sequence: Option<u64>,
    /// Position of the first row (of the first sequence).
    pub pos: usize,
    /// Every weight stays at its address for the model's lifetime.
    pub weights_stable: bool,
    /// Changes whenever the model replaces a buffer that its passes use, so a recording of an
    /// earlier pass is known to be stale.
    pub generation: u64,
}

/// The operations of one forward pass. Every activation is f32 and row-major; `rows` is the
/// number of token positions processed together (the whole prompt during prefill, 1 while
/// decoding) and only the first `rows · width` values of a buffer are read or written.
pub trait Backend: Send + Sync {
    /// An activation buffer of f32 values (host memory for the CPU backend).
    type Buf: Send;
    /// A KV-cache buffer; a backend may store it narrower than f32 (the CUDA one uses f16).
    type KvBuf: Send;

    /// Short name for logs and `--json` (`"cpu"`).
    fn name(&self) -> &'static str;

    /// A zeroed buffer of `len` values.
    fn alloc(&self, len: usize) -> Result<Self::Buf, BackendError>;

    /// A zeroed KV-cache buffer of `len` values, written only by [`Backend::rope_store_kv`]
    /// and read by [`Backend::attention_batch`].
    fn alloc_kv(&self, len: usize) -> Result<Self::KvBuf, BackendError>;

    /// Bytes one value of a [`Backend::KvBuf`] takes (4 for f32), for the KV memory budget.
    fn kv_value_bytes(&self) -> usize;

    /// Copies the first `values` values of `src` into the start of `dst` (both at least that
    /// long): the prefix cache handing cached positions to a new sequence. Not while a pass
    /// is running.
    fn copy_kv(
        &self,
        src: &Self::KvBuf,
        dst: &mut Self::KvBuf,
        values: usize,
    ) -> Result<(), BackendError>;

    /// The row count from which the matmuls compute every row the same way however many rows
    /// a sequence's pass has (below it they pick another kernel, which rounds differently;
    /// see [`RowGroup`]). The prefix cache only reuses positions computed in passes at least
    /// this wide, for passes at least this wide, so that reusing them changes no result.
    fn uniform_rows_from(&self) -> usize;

    /// A buffer holding `values` (the model's constants, such as the RoPE frequencies).
    fn upload(&self, values: &[f32]) -> Result<Self::Buf, BackendError>;

    /// Copies the first `out.len()` values of `buf` to host memory, once every op queued
    /// before has finished.
    fn read(&self, buf: &Self::Buf, out: &mut [f32]) -> Result<(), BackendError>;

    /// The greedy choice of each of the first `out.len()` rows of `logits` (`[rows, cols]`):
    /// [`crate::sampling::argmax`] of the row, once every op queued before has finished. The
    /// default reads the rows back and takes them on the host; a device backend takes them
    /// where the logits are and reads back only the ids (a decode step of 32 greedy sequences
    /// of a 49,152-token vocabulary otherwise copies 6.3 MB back and scans it on the host).
    fn argmax_rows(
        &self,
        logits: &Self::Buf,
        cols: usize,
        out: &mut [u32],
    ) -> Result<(), BackendError> {
        if cols == 0 {
            out.fill(0); // no logits: as `argmax` of an empty row
            return Ok(());
        }
        let mut host = vec![0.0; out.len() * cols];
        self.read(logits, &mut host)?;
        for (id, row) in out.iter_mut().zip(host.chunks_exact(cols)) {
            *id = crate::sampling::argmax(row);
        }
        Ok(())
    }

    /// The ops up to [`Backend::end_pass`] form one pass over the weights, described by
    /// `pass`; its inputs (the embedding, which reads token ids from host memory) are already
    /// in place. A backend may record such a pass once and replay it later instead of running
    /// its ops one by one; nothing may be read back before `end_pass`.
    fn begin_pass(&self, pass: &PassInfo) -> Result<(), BackendError> {
        let _ = pass;
        Ok(())
    }

    /// Ends the pass begun by [`Backend::begin_pass`]; `ran` says whether every op of it was
    /// called and succeeded (it is called after a failure too, with `false`). When this
    /// returns Ok after a pass that ran, its ops have run or are queued to run.
    fn end_pass(&self, ran: bool) -> Result<(), BackendError> {
        let _ = ran;
        Ok(())
    }

    /// The ops that follow, up to the next call or the end of the pass, read the weights of
    /// blob `blob` (an index into the model's `metadata.blobs`): each layer's in turn, then the
    /// output blob's for the LM head. A backend that places blobs differently (the hybrid
    /// split, [`crate::hybrid`]) decides here; the others need not know.
    fn weights_from_blob(&self, blob: usize) {
        let _ = blob;
    }

    /// `out[r, :] = table[ids[r], :]` for `table: [vocab, dim]`.
    fn embed_rows(
        &self,
        table: WeightView<'_>,
        ids: &[u32],
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// `out[r, :] = rows[r, :]` for rows of an embedding table that were read into host
    /// memory for this pass (an untied table is never acquired whole). A device backend copies
    /// them up first: the one host-to-device copy of weights a pass makes, and this op says so.
    fn embed_host_rows(
        &self,
        rows: WeightView<'_>,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// `out[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) · weight` for `weight: [dim]`, or
    /// with [`NormInto::Add`] `out[r, :] +=` the same.
    fn rmsnorm(
        &self,
        x: &Self::Buf,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &mut Self::Buf,
        into: NormInto,
    ) -> Result<(), BackendError>;

    /// `outs[i][r, :] = x[r, :] · ws[i]ᵀ` (as `nn.Linear`) for several weights of the same
    /// input (Q/K/V, gate/up), over the rows of `groups` (in row order, covering rows
    /// `0 .. Σ rows`): one pass over each weight serves every sequence of a batch. Every row
    /// comes out exactly as it does for a call with one group of `solo_rows` rows (see
    /// [`RowGroup`]).
    fn matmul_batch(
        &self,
        x: &Self::Buf,
        groups: &[RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut Self::Buf],
    ) -> Result<(), BackendError>;

    /// `out += x · wᵀ` over the rows of `groups` (the residual connections after the attention
    /// output and FFN down projections), each row's product computed as
    /// [`Backend::matmul_batch`] computes it. `scratch` holds at least as many values as the
    /// product and may be overwritten.
    fn matmul_add_batch(
        &self,
        x: &Self::Buf,
        groups: &[RowGroup],
        w: WeightView<'_>,
        scratch: &mut Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// The position-dependent steps of attention for one sequence: rows `row0 .. row0+rows` of
    /// `q` (`[.., n_heads·head_dim]`) and `k` (`[.., n_kv_heads·head_dim]`) get rotary
    /// embeddings at positions `pos0 ..` (Hugging Face `rotate_half`: in each head the pair
    /// `(i, i + head_dim/2)` is rotated by `pos · inv_freq[i]`), then those rows of `k` and
    /// `v` are stored in `k_cache` and `v_cache` (`[slots, n_kv_heads·head_dim]`), position
    /// `pos` in slot `pos % slots`: a cache of at least as many slots as positions holds each
    /// at its own index, a smaller one is a ring (a sliding-window layer's). `inv_freq` holds
    /// `head_dim / 2` values.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_kv(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        row0: usize,
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        inv_freq: &Self::Buf,
        k_cache: &mut Self::KvBuf,
        v_cache: &mut Self::KvBuf,
    ) -> Result<(), BackendError>;

    /// [`Backend::rope_store_kv`] for every sequence of a batch (their rows of `q`, `k` and
    /// `v`, each at its own positions, into its own caches). The default calls it per
    /// sequence; a backend may do them all at once.
    fn rope_store_kv_batch(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        seqs: &mut [KvStoreSeq<'_, Self::KvBuf>],
        shape: AttentionShape,
        inv_freq: &Self::Buf,
    ) -> Result<(), BackendError> {
        for s in seqs.iter_mut() {
            self.rope_store_kv(
                q, k, v, s.row0, s.rows, s.pos0, shape, inv_freq, s.k_cache, s.v_cache,
            )?;
        }
        Ok(())
    }

    /// Causal grouped-query attention for each sequence of `seqs`: its query row at position
    /// `p` (rows at `pos0 .. pos0+rows`) against the keys and values of positions
    /// `params.first_key(p) ..= p` of its caches (slot `t % slots` holds position `t`), keys
    /// taken in position order, into the same rows of `out` (`[.., n_heads·head_dim]`).
    /// Scores are scaled by `params.scale`. Each sequence's rows come out as they do for it
    /// alone. A cache too small for the positions a row sees is an error.
    fn attention_batch(
        &self,
        q: &Self::Buf,
        seqs: &[AttentionSeq<'_, Self::KvBuf>],
        shape: AttentionShape,
        params: AttentionParams,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// The FFN's gated product over the rows of `groups`: `out = act(x · gateᵀ) ⊙ (x · upᵀ)`
    /// for `ffn`'s weights; `up_out` (as large as `out`) may be overwritten. By
    /// default [`Backend::matmul_batch`] of both, then [`Backend::swiglu`] or
    /// [`Backend::geglu`]; a backend may do it in fewer passes (the CUDA backend's one launch
    /// for a decoding row of 16-bit weights) with the same results.
    fn matmul_gated_batch(
        &self,
        x: &Self::Buf,
        groups: &[RowGroup],
        ffn: GatedWeights<'_>,
        out: &mut Self::Buf,
        up_out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        let GatedWeights { gate, up, act } = ffn;
        self.matmul_batch(x, groups, &[gate, up], &mut [&mut *out, &mut *up_out])?;
        let len = groups.iter().map(|g| g.rows).sum::<usize>() * gate.rows;
        self.gated_activation(act, out, up_out, len)
    }

    /// `gate = act(gate) · up` over `len` values: [`Backend::swiglu`] or [`Backend::geglu`].
    fn gated_activation(
        &self,
        act: Activation,
        gate: &mut Self::Buf,
        up: &Self::Buf,
        len: usize,
    ) -> Result<(), BackendError> {
        match act {
            Activation::Silu => self.swiglu(gate, up, len),
            Activation::GeluTanh => self.geglu(gate, up, len),
        }
    }

    /// SiLU-gated FFN activation: `gate = silu(gate) · up` over `len` values.
    fn swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize) -> Result<(), BackendError>;

    /// GeLU-gated FFN activation (tanh approximation, Gemma's `gelu_pytorch_tanh`):
    /// `gate = 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))) · up` over `len` values.
    fn geglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize) -> Result<(), BackendError>;

    /// `x[r, :] += bias` for `rows` rows of `bias.cols` values (the Q/K/V biases).
    fn add_bias(
        &self,
        x: &mut Self::Buf,
        rows: usize,
        bias: WeightView<'_>,
    ) -> Result<(), BackendError>;

    /// [`Backend::rmsnorm`] in place over `pieces` consecutive pieces of `weight.cols` values
    /// each: the per-head norm of Q or K (`pieces = rows · heads`, `weight: [head_dim]`). By
    /// default just that, from a copy of the pieces.
    fn rmsnorm_pieces(
        &self,
        x: &mut Self::Buf,
        pieces: usize,
        weight: WeightView<'_>,
        eps: f32,
    ) -> Result<(), BackendError> {
        let mut input = self.alloc(pieces * weight.cols)?;
        self.copy_rows(x, 0, &mut input, 0, pieces, weight.cols)?;
        self.rmsnorm(&input, pieces, weight, eps, x, NormInto::Write)
    }

    /// `x = factor · x` over `len` values (Gemma's embedding scale).
    fn scale(&self, x: &mut Self::Buf, len: usize, factor: f32) -> Result<(), BackendError>;

    /// `x = cap · tanh(x / cap)` over `len` values (a final logit soft-cap).
    fn softcap(&self, x: &mut Self::Buf, len: usize, cap: f32) -> Result<(), BackendError>;

    /// Copies rows `src_row .. src_row+rows` of `src` to rows `dst_row ..` of `dst`, each
    /// `row_len` values (picking each sequence's last position for the LM head).
    fn copy_rows(
        &self,
        src: &Self::Buf,
        src_row: usize,
        dst: &mut Self::Buf,
        dst_row: usize,
        rows: usize,
        row_len: usize,
    ) -> Result<(), BackendError>;
}

/// The attention of a sequence over a cache of `slots` positions needs, for its rows at
/// `pos0 .. pos0+rows`, that none of the keys a row sees was overwritten by a later position of
/// the same ring: `slots` at least the positions the last row sees plus those written after
/// the first row's first key. An error says which cache is too small.
pub(crate) fn check_cache_slots(
    slots: usize,
    pos0: usize,
    rows: usize,
    params: AttentionParams,
) -> Result<(), BackendError> {
    if rows == 0 {
        return Ok(());
    }
    let last = pos0 + rows - 1;
    let needed = last + 1 - params.first_key(pos0);
    if slots < needed {
        return Err(BackendError::Unsupported {
            op: "attention",
            message: format!(
                "a cache of {slots} positions cannot serve rows at positions {pos0}..={last} \
                 (they see positions from {} on)",
                params.first_key(pos0)
            ),
        });
    }
    Ok(())
}

/// [`Backend::rope_store_kv`] of `rows` rows into a cache of `slots` positions: a cache of no
/// position can take none.
pub(crate) fn check_store_slots(slots: usize, rows: usize) -> Result<(), BackendError> {
    if slots == 0 && rows > 0 {
        return Err(BackendError::Unsupported {
            op: "rope_store_kv",
            message: "the KV cache holds no position".into(),
        });
    }
    Ok(())
}

/// The host bytes of a weight, for backends that compute from host memory.
pub(crate) fn host_bytes<'a>(
    w: &WeightView<'a>,
    backend: &'static str,
) -> Result<&'a [u8], BackendError> {
    w.bytes.host().ok_or(BackendError::WrongMemory {
        backend,
        found: "device",
    })
}

/// `out += x · wᵀ` as [`Backend::matmul_batch`] into `scratch`, then an f32 add: the
/// `matmul_add_batch` of the backends that compute in host memory.
pub(crate) fn matmul_then_add<B: Backend<Buf = Vec<f32>>>(
    be: &B,
    x: &Vec<f32>,
    groups: &[RowGroup],
    w: WeightView<'_>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) -> Result<(), BackendError> {
    let rows: usize = groups.iter().map(|g| g.rows).sum();
    be.matmul_batch(x, groups, &[w], &mut [&mut *scratch])?;
    let len = rows * w.rows;
    for (a, b) in out[..len].iter_mut().zip(&scratch[..len]) {
        *a += b;
    }
    Ok(())
}
