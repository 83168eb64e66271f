//! The narrow set of operations the forward pass needs, and the backends that implement them.
//!
//! The forward pass ([`crate::model`]) is written once against [`Backend`]; a backend owns its
//! activation buffers ([`Backend::Buf`]) and reads weights from the blob bytes that residency
//! hands out ([`WeightView`]). Shapes are checked when a weight is looked up
//! ([`crate::weights`]), so the ops themselves take them as given.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod kernels;
pub(crate) mod kquants;
pub mod reference;

use weights_format::DType;

pub use cpu::CpuBackend;
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, DeviceWeights};
pub use kernels::f16_bits_to_f32;
pub use reference::ReferenceBackend;

/// A weight tensor as stored in a blob: row-major `[rows, cols]` (a vector has `rows == 1`),
/// `cols` a whole number of `dtype` blocks.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// The bytes in host memory; empty when the tensor is only in device memory (then
    /// `device` is set, and only a device backend is ever given the view).
    pub bytes: &'a [u8],
    /// The device address of the first byte, when the tensor is in device memory.
    pub device: Option<u64>,
}

impl<'a> WeightView<'a> {
    /// A view of host bytes.
    pub fn host(dtype: DType, rows: usize, cols: usize, bytes: &'a [u8]) -> WeightView<'a> {
        WeightView {
            dtype,
            rows,
            cols,
            bytes,
            device: None,
        }
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_len() * self.dtype.block_bytes()
    }

    /// Row `i` as bytes.
    pub fn row(&self, i: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.bytes[i * rb..(i + 1) * rb]
    }
}

/// Head layout of grouped-query attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    /// Each KV head serves `n_heads / n_kv_heads` consecutive query heads (HF `repeat_kv`).
    pub n_kv_heads: usize,
    pub head_dim: usize,
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

/// One sequence's part of a batched attention: query rows `row0 .. row0+rows` at positions
/// `pos0 ..` against that sequence's own caches (`[capacity, n_kv_heads·head_dim]` each).
pub struct AttentionSeq<'a, Buf> {
    pub row0: usize,
    pub rows: usize,
    pub pos0: usize,
    pub k_cache: &'a Buf,
    pub v_cache: &'a Buf,
}

/// The operations of one forward pass. Every activation is f32 and row-major; `rows` is the
/// number of token positions processed together (the whole prompt during prefill, 1 while
/// decoding) and only the first `rows · width` values of a buffer are read or written.
pub trait Backend: Send + Sync {
    /// An activation buffer (host memory for the CPU backend).
    type Buf: Send;

    /// Short name for logs and `--json` (`"cpu"`).
    fn name(&self) -> &'static str;

    /// A zeroed buffer of `len` values.
    fn alloc(&self, len: usize) -> Self::Buf;

    /// A zeroed KV-cache buffer of `len` values. A backend may store it in a narrower type
    /// (the CUDA backend uses f16); it is only written by `copy_rows` and read by `attention`.
    fn alloc_kv(&self, len: usize) -> Self::Buf {
        self.alloc(len)
    }

    /// Copies the first `out.len()` values of `buf` to host memory.
    fn read(&self, buf: &Self::Buf, out: &mut [f32]);

    /// The first failure of an op since the backend was created (a device backend's ops cannot
    /// return errors one by one); checked after every forward pass.
    fn status(&self) -> Result<(), crate::LlamaError> {
        Ok(())
    }

    /// `out[r, :] = table[ids[r], :]` for `table: [vocab, dim]`.
    fn embed_rows(&self, table: WeightView<'_>, ids: &[u32], out: &mut Self::Buf);

    /// `out[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) · weight` for `weight: [dim]`.
    fn rmsnorm(
        &self,
        x: &Self::Buf,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &mut Self::Buf,
    );

    /// `out[r, i] = Σ_c x[r, c] · w[i, c]` for `w: [out_dim, in_dim]` (x·Wᵀ, as `nn.Linear`).
    fn matmul(&self, x: &Self::Buf, rows: usize, w: WeightView<'_>, out: &mut Self::Buf);

    /// Several matmuls of the same input (Q/K/V, gate/up): `outs[i] = x · ws[i]ᵀ`. A backend
    /// may run them as one parallel region; the default runs them one after another.
    fn matmul_many(
        &self,
        x: &Self::Buf,
        rows: usize,
        ws: &[WeightView<'_>],
        outs: &mut [&mut Self::Buf],
    ) {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(x, rows, *w, out);
        }
    }

    /// Rotary embedding, Hugging Face `rotate_half` convention: in each head the pair is
    /// `(i, i + head_dim/2)` rotated by `(pos0 + r) · inv_freq[i]`. `x: [rows, n_heads·head_dim]`.
    fn rope(
        &self,
        x: &mut Self::Buf,
        rows: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        inv_freq: &[f32],
    );

    /// Copies rows `src_row .. src_row+rows` of `src` to rows `dst_row ..` of `dst`, each
    /// `row_len` values (filling the KV cache, picking the last position).
    fn copy_rows(
        &self,
        src: &Self::Buf,
        src_row: usize,
        dst: &mut Self::Buf,
        dst_row: usize,
        rows: usize,
        row_len: usize,
    );

    /// Causal grouped-query attention for query rows at positions `pos0 .. pos0+rows`, against
    /// the first `pos0 + rows` cached positions. `q, out: [rows, n_heads·head_dim]`;
    /// `k_cache, v_cache: [ctx, n_kv_heads·head_dim]`. Scores are scaled by `1/sqrt(head_dim)`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf,
        rows: usize,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        pos0: usize,
        shape: AttentionShape,
        out: &mut Self::Buf,
    );

    /// Bytes one KV-cache value takes in a buffer from [`Backend::alloc_kv`] (4 for f32), for
    /// the KV memory budget of batched decoding.
    fn kv_value_bytes(&self) -> usize {
        4
    }

    /// [`Backend::matmul_many`] over the rows of several sequences (`groups` in row order,
    /// covering rows `0 .. Σ rows`): one pass over each weight serves them all. Every row must
    /// come out exactly as a `matmul` of `solo_rows` rows computes it (see [`RowGroup`]). The
    /// default is one `matmul_many` over all rows, which is right for a backend whose results
    /// do not depend on the row count.
    fn matmul_batch(
        &self,
        x: &Self::Buf,
        groups: &[RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut Self::Buf],
    ) {
        let rows = groups.iter().map(|g| g.rows).sum();
        self.matmul_many(x, rows, ws, outs);
    }

    /// [`Backend::rope`] on rows `row0 .. row0+rows` of `x` (one sequence of a batch, at
    /// positions `pos0 ..`). The default ropes in place when `row0` is 0 and otherwise copies
    /// the rows through a temporary buffer; backends that can address rows override it.
    #[allow(clippy::too_many_arguments)]
    fn rope_at(
        &self,
        x: &mut Self::Buf,
        row0: usize,
        rows: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        inv_freq: &[f32],
    ) {
        if row0 == 0 {
            return self.rope(x, rows, n_heads, head_dim, pos0, inv_freq);
        }
        let width = n_heads * head_dim;
        let mut tmp = self.alloc(rows * width);
        self.copy_rows(x, row0, &mut tmp, 0, rows, width);
        self.rope(&mut tmp, rows, n_heads, head_dim, pos0, inv_freq);
        self.copy_rows(&tmp, 0, x, row0, rows, width);
    }

    /// [`Backend::attention`] for several sequences at once, each with its own rows of `q` and
    /// `out` and its own caches. The default calls `attention` per sequence (straight on `q`
    /// and `out` when the sequence starts at row 0, else through temporary buffers); backends
    /// override it to run all sequences in one launch or parallel region.
    fn attention_batch(
        &self,
        q: &Self::Buf,
        seqs: &[AttentionSeq<'_, Self::Buf>],
        shape: AttentionShape,
        out: &mut Self::Buf,
    ) {
        let width = shape.n_heads * shape.head_dim;
        for s in seqs {
            if s.row0 == 0 {
                self.attention(q, s.rows, s.k_cache, s.v_cache, s.pos0, shape, out);
                continue;
            }
            let mut tq = self.alloc(s.rows * width);
            let mut tout = self.alloc(s.rows * width);
            self.copy_rows(q, s.row0, &mut tq, 0, s.rows, width);
            self.attention(&tq, s.rows, s.k_cache, s.v_cache, s.pos0, shape, &mut tout);
            self.copy_rows(&tout, 0, out, s.row0, s.rows, width);
        }
    }

    /// `out += x · wᵀ` over the rows of `groups` (the residual connections after the attention
    /// output and FFN down projections), each row computed as [`Backend::matmul_batch`]
    /// computes it. `scratch` holds at least as many values as the product and may be
    /// overwritten. The default is `matmul_batch` into `scratch`, then [`Backend::add`]; a
    /// backend may accumulate in the matmul itself and save a pass over the output.
    fn matmul_add_batch(
        &self,
        x: &Self::Buf,
        groups: &[RowGroup],
        w: WeightView<'_>,
        scratch: &mut Self::Buf,
        out: &mut Self::Buf,
    ) {
        let rows: usize = groups.iter().map(|g| g.rows).sum();
        self.matmul_batch(x, groups, &[w], &mut [&mut *scratch]);
        self.add(out, scratch, rows * w.rows);
    }

    /// The position-dependent steps of attention for one sequence: rows `row0 .. row0+rows` of
    /// `q` and `k` get RoPE at positions `pos0 ..` ([`Backend::rope_at`]), then those rows of
    /// `k` and `v` are stored at the same positions of `k_cache` and `v_cache`
    /// (`[capacity, n_kv_heads·head_dim]`). The default is two `rope_at` and two
    /// [`Backend::copy_rows`]; a backend may do it in one pass.
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
        inv_freq: &[f32],
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
    ) {
        rope_store_kv_separately(
            self, q, k, v, row0, rows, pos0, shape, inv_freq, k_cache, v_cache,
        );
    }

    /// Whether this backend can record a single-sequence decode step once and replay it
    /// ([`Backend::begin_step_capture`]; CUDA graphs), which saves the per-op launch cost.
    fn records_steps(&self) -> bool {
        false
    }

    /// Starts recording the ops after the embedding of a single-sequence decode step at
    /// position `pos`: the ops that follow are recorded, not run, and those that depend on the
    /// position ([`Backend::rope_store_kv`], one-row [`Backend::attention`]) read it from the
    /// step parameter that [`Backend::replay_step`] sets. No op may read results back
    /// ([`Backend::read`]) until [`Backend::end_step_capture`]. False when recording cannot
    /// start; nothing is recorded then.
    fn begin_step_capture(&self, pos: usize) -> bool {
        let _ = pos;
        false
    }

    /// Ends the recording: whether a step was recorded (an op that cannot be recorded
    /// abandons it). Nothing of the recorded step has run yet.
    fn end_step_capture(&self) -> bool {
        false
    }

    /// Runs the recorded step at position `pos` (after the step's embedding has been queued);
    /// false when none is recorded (the backend drops a recording whose buffers it replaced).
    /// Failures show in [`Backend::status`].
    fn replay_step(&self, pos: usize) -> bool {
        let _ = pos;
        false
    }

    /// Drops the recorded step (the buffers it uses are about to be replaced).
    fn forget_step(&self) {}

    /// SiLU-gated FFN activation: `gate = silu(gate) · up` over `len` values.
    fn swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize);

    /// `x += y` over `len` values (residual connections).
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf, len: usize);
}

/// [`Backend::rope_store_kv`] as two [`Backend::rope_at`] and two [`Backend::copy_rows`]: the
/// default, and what a backend that fuses them falls back to.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_store_kv_separately<B: Backend + ?Sized>(
    be: &B,
    q: &mut B::Buf,
    k: &mut B::Buf,
    v: &B::Buf,
    row0: usize,
    rows: usize,
    pos0: usize,
    shape: AttentionShape,
    inv_freq: &[f32],
    k_cache: &mut B::Buf,
    v_cache: &mut B::Buf,
) {
    let (hd, kv_dim) = (shape.head_dim, shape.n_kv_heads * shape.head_dim);
    be.rope_at(q, row0, rows, shape.n_heads, hd, pos0, inv_freq);
    be.rope_at(k, row0, rows, shape.n_kv_heads, hd, pos0, inv_freq);
    be.copy_rows(k, row0, k_cache, pos0, rows, kv_dim);
    be.copy_rows(v, row0, v_cache, pos0, rows, kv_dim);
}

/// Inverse RoPE frequencies `theta^(-2i/head_dim)`, `i < head_dim/2`, with Llama-3 style
/// scaling applied when configured (as in Hugging Face `_compute_llama3_parameters`).
pub fn rope_inv_freq(
    head_dim: usize,
    theta: f32,
    scaling: Option<&weights_format::RopeScaling>,
) -> Vec<f32> {
    let mut inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    if let Some(s) = scaling {
        match s.rope_type.as_str() {
            "linear" => inv.iter_mut().for_each(|f| *f /= s.factor),
            "llama3" => {
                let low = s.low_freq_factor.unwrap_or(1.0);
                let high = s.high_freq_factor.unwrap_or(4.0);
                let old_ctx = s.original_max_position_embeddings.unwrap_or(8192) as f32;
                let low_wavelen = old_ctx / low;
                let high_wavelen = old_ctx / high;
                for f in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= s.factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old_ctx / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                    }
                }
            }
            _ => {}
        }
    }
    inv
}
