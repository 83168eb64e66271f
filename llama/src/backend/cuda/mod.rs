//! The CUDA backend (feature `cuda`): f32 activations in device memory, an f16 KV cache, and
//! kernels compiled by NVRTC from the `.cu` files of `kernels/` on first use.
//!
//! Split by concern: `device` (the stream every op is queued on, cuBLAS, the kernels),
//! `weights` (weights as device pointers: streamed through residency, or uploaded once),
//! `scratch` (buffers the backend reuses, the quantized activations of the matmuls),
//! `graph` (recording a decode pass once as a CUDA graph and replaying it), `matmul`,
//! `attention` and `elementwise` (the ops), `compile` (NVRTC and its cache). This file
//! holds the backend and maps the [`Backend`] ops onto those.
//!
//! Every op returns its failure; none is stored for later. Weights reach the kernels only as
//! device pointers ([`crate::weights::WeightBytes::Device`]): a weight in host memory is an
//! error, and the one host-to-device weight copy of a pass (the rows of an untied embedding
//! table) is its own op, [`Backend::embed_host_rows`].

mod attention;
mod compile;
mod device;
mod elementwise;
mod graph;
mod matmul;
mod paths;
mod profile;
mod scratch;
mod split;
mod weights;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice};

use crate::LlamaError;
use crate::backend::{
    Activation, AttentionParams, AttentionSeq, AttentionShape, Backend, BackendError, GatedWeights,
    KvStoreSeq, NormInto, PassInfo, RowGroup, WeightView,
};

pub use compile::kernel_cache_dir;
pub use device::PinnedCopies;
pub use matmul::{CUBLAS_MIN_ROWS, mma_min_rows};
pub use paths::{CudaPaths, PATHS_ENV};

/// Counts of the work a [`CudaBackend`] has done on the device ([`CudaBackend::launch_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaunchCounts {
    /// Kernel launches and cuBLAS GEMMs run, those of graph replays included.
    pub kernels: u64,
    /// Calls the host made on the stream: each launch, copy, allocation, GEMM and graph replay.
    pub stream_calls: u64,
}
pub use profile::PROFILE_ENV;
pub use weights::{CudaBlobGuard, CudaWeights, DeviceBlob, DeviceWeights};

use device::{Kernels, Queue};
use graph::Graphs;
use scratch::{Scratch, X16};

/// An activation buffer in device memory (f32).
#[derive(Debug)]
pub struct CudaBuf(CudaSlice<f32>);

/// A KV-cache buffer in device memory (f16: half the memory and bandwidth of f32).
#[derive(Debug)]
pub struct CudaKvBuf(CudaSlice<u16>);

/// Whether this machine can run the CUDA backend at all (driver and NVRTC libraries loadable
/// and at least one device), with the reason when it cannot.
pub fn cuda_usable() -> Result<(), LlamaError> {
    cuda_usable_on(0)
}

/// [`cuda_usable`] for device `ordinal`.
pub fn cuda_usable_on(ordinal: usize) -> Result<(), LlamaError> {
    CudaBackend::new(ordinal).map(|_| ())
}

/// The CUDA backend on one device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    device_name: String,
    /// Shared with [`CudaWeights`], which records release fences on it.
    queue: Arc<Queue>,
    kernels: Kernels,
    graphs: Graphs,
    x16: X16,
    /// Partial results of the split decode attention, sized for the largest cache seen (a
    /// recorded pass keeps using it).
    attention_scratch: Scratch<f32>,
    /// The same for the decode attention of a batch's sequences in one launch (apart, so that
    /// a batch never drops the recorded pass of a single sequence).
    seq_attention_scratch: Scratch<f32>,
    /// One ticket per head for the split decode attention: the last chunk of a head to finish
    /// merges the head (zeroed when allocated; the merging block sets its ticket back to 0).
    attention_tickets: Scratch<i32>,
    /// The new kernel paths this backend uses (see [`CudaPaths`]).
    paths: CudaPaths,
    /// What the device has: streaming multiprocessors (to size grids) and whether it has the
    /// tensor-core instructions of the mma kernels (compute capability 8.0 and later).
    sms: u32,
    tensor_cores: bool,
    /// The split-K partial sums and per-tile counters of the mma matmul kernels.
    mma_partials: Scratch<f32>,
    mma_counters: Scratch<i32>,
    /// The ids `argmax_rows` writes (one per row), reused by every greedy step: an allocation
    /// per decode step cost as much as the kernel.
    greedy_ids: Scratch<u32>,
    /// Mapped host buffers that bring a split matmul's CPU share into the activations
    /// (`split`).
    split_staging: split::HostStaging,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device_name)
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Opens device `ordinal` and loads (compiling on first use) the kernels. Fails with the
    /// reason — no driver library, no NVRTC library, no such device, compile log — and never
    /// panics when CUDA is missing.
    ///
    /// The new kernel paths are those `GDSLLM_CUDA_PATHS` names ([`CudaPaths::from_env`]).
    pub fn new(ordinal: usize) -> Result<CudaBackend, LlamaError> {
        CudaBackend::with_paths(ordinal, CudaPaths::from_env()?)
    }

    /// Runs `op` unless the ops called now belong to a replayed pass: the replay runs the
    /// recorded launches instead, so every op of the pass is skipped while it lasts.
    fn unless_replaying(
        &self,
        op: impl FnOnce() -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        if self.graphs.replaying() {
            return Ok(());
        }
        op()
    }

    /// [`CudaBackend::new`] with the given kernel paths (whatever the environment says).
    pub fn with_paths(ordinal: usize, paths: CudaPaths) -> Result<CudaBackend, LlamaError> {
        let ctx = device::open_context(ordinal)?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (sms, tensor_cores) = device::capabilities(&ctx)?;
        let queue = Queue::new(&ctx, format!("{device_name} ({ordinal})"))?;
        let kernels = Kernels::load(&ctx)?;
        let graphs = Graphs::new(&queue)?;
        tracing::debug!(%paths, sms, tensor_cores, "CUDA backend on {device_name}");
        Ok(CudaBackend {
            ctx,
            device_name,
            queue: Arc::new(queue),
            kernels,
            graphs,
            x16: X16::new(),
            attention_scratch: Scratch::new("allocating attention partials"),
            seq_attention_scratch: Scratch::new("allocating batched attention partials"),
            attention_tickets: Scratch::new("allocating attention tickets"),
            paths,
            sms,
            tensor_cores,
            mma_partials: Scratch::new("allocating matmul partial sums"),
            mma_counters: Scratch::new("allocating matmul tile counters"),
            greedy_ids: Scratch::new("allocating the greedy ids"),
            split_staging: split::HostStaging::new(),
        })
    }

    /// The new kernel paths this backend uses.
    pub fn paths(&self) -> CudaPaths {
        self.paths
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The device's CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Device-to-device copy speed over `bytes`-byte buffers: (bytes read, bytes read + bytes
    /// written) per second, in GB/s, best of a few copies. The reference that the resident
    /// decode speed is compared with (decode reads each weight byte once).
    pub fn measure_copy_gbps(&self, bytes: usize) -> Result<(f64, f64), LlamaError> {
        Ok(self.queue.measure_copy_gbps(bytes)?)
    }

    /// Host-to-device copy speed from page-locked memory over `bytes` bytes, GB/s, best of a
    /// few copies: the reference for the pinned host tier.
    pub fn measure_pinned_h2d_gbps(&self, bytes: usize) -> Result<f64, LlamaError> {
        Ok(self.queue.measure_pinned_h2d_gbps(bytes)?)
    }

    /// Pinned host→device copies (from a pinned buffer of `bytes`, in pieces of `piece`, on
    /// a thread and a stream of their own) to run beside other work: what the calibration's
    /// concurrent probe measures beside the CPU's matmuls
    /// (`hybrid::calibrate::measure_concurrent`).
    pub fn pinned_copies(&self, bytes: usize, piece: usize) -> Result<PinnedCopies, LlamaError> {
        Ok(self.queue.pinned_copies(bytes, piece)?)
    }

    /// Passes replayed from a recorded CUDA graph so far (see [`graph`]).
    pub fn step_replays(&self) -> u64 {
        self.graphs.replays()
    }

    /// Work on the device so far: kernels run (a graph replay counts as the kernels recorded in
    /// it) and calls the host made on the stream (launches, copies, allocations, GEMMs, graph
    /// replays). Their growth over decode steps is the fixed cost per token that graph
    /// replay and fused kernels cut (`gdsllm bench` prints it per generated token).
    pub fn launch_counts(&self) -> LaunchCounts {
        LaunchCounts {
            kernels: self.queue.kernels_run(),
            stream_calls: self.queue.issued(),
        }
    }

    /// Inputs of quantized matmuls converted by a `quantize_x16` launch of their own so far
    /// (those that rmsnorm or a gated activation wrote in that form as they produced them are not counted).
    pub fn x16_launches(&self) -> u64 {
        self.x16.launches()
    }

    /// The device address of value `offset` of `buf`.
    fn addr(&self, buf: &CudaBuf, offset: usize) -> u64 {
        self.queue.addr(&buf.0) + (offset * 4) as u64
    }

    fn kv_addr(&self, buf: &CudaKvBuf) -> u64 {
        self.queue.addr(&buf.0)
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type KvBuf = CudaKvBuf;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, len: usize) -> Result<CudaBuf, BackendError> {
        self.graphs.forbid_while_recording("an allocation")?;
        Ok(CudaBuf(
            self.queue.alloc_zeros(len, "allocating activations")?,
        ))
    }

    fn alloc_kv(&self, len: usize) -> Result<CudaKvBuf, BackendError> {
        self.graphs.forbid_while_recording("an allocation")?;
        Ok(CudaKvBuf(
            self.queue.alloc_zeros(len, "allocating a KV cache")?,
        ))
    }

    /// The KV cache is f16.
    fn kv_value_bytes(&self) -> usize {
        2
    }

    fn copy_kv(
        &self,
        src: &CudaKvBuf,
        dst: &mut CudaKvBuf,
        values: usize,
    ) -> Result<(), BackendError> {
        self.graphs.forbid_while_recording("a KV-cache copy")?;
        self.queue
            .copy(&src.0, &mut dst.0, values, "copying cached KV positions")
    }

    /// cuBLAS takes the prefill matmuls from this many rows on (`matmul::CUBLAS_MIN_ROWS`).
    fn uniform_rows_from(&self) -> usize {
        matmul::CUBLAS_MIN_ROWS
    }

    fn upload(&self, values: &[f32]) -> Result<CudaBuf, BackendError> {
        self.graphs
            .forbid_while_recording("a copy from host memory")?;
        Ok(CudaBuf(self.queue.upload(values, "uploading values")?))
    }

    fn read(&self, buf: &CudaBuf, out: &mut [f32]) -> Result<(), BackendError> {
        self.graphs
            .forbid_while_recording("a copy to host memory")?;
        self.queue.read(&buf.0, out, "copying results to the host")
    }

    fn argmax_rows(
        &self,
        logits: &CudaBuf,
        cols: usize,
        out: &mut [u32],
    ) -> Result<(), BackendError> {
        self.graphs
            .forbid_while_recording("a copy to host memory")?;
        self.argmax_launch(logits, cols, out)
    }

    fn begin_pass(&self, pass: &PassInfo) -> Result<(), BackendError> {
        self.graphs.begin(&self.queue, pass)
    }

    fn end_pass(&self, ran: bool) -> Result<(), BackendError> {
        self.graphs.end(&self.queue, ran)
    }

    fn embed_rows(
        &self,
        table: WeightView<'_>,
        ids: &[u32],
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.graphs
            .forbid_while_recording("a copy from host memory")?;
        self.embed_launch(table, ids, out)
    }

    fn embed_host_rows(&self, rows: WeightView<'_>, out: &mut CudaBuf) -> Result<(), BackendError> {
        self.graphs
            .forbid_while_recording("a copy from host memory")?;
        self.embed_host_launch(rows, out)
    }

    fn rmsnorm(
        &self,
        x: &CudaBuf,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &mut CudaBuf,
        into: NormInto,
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| self.rmsnorm_launch(x, rows, weight, eps, out, into))
    }

    /// Q/K/V and gate/up share one launch of the matmul kernel; see
    /// [`CudaBackend::matmul_groups`] for how a batch's rows are split.
    fn matmul_batch(
        &self,
        x: &CudaBuf,
        groups: &[RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut CudaBuf],
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| self.matmul_groups(x, groups, ws, outs, false))
    }

    /// The kernel adds to `out` as it writes (cuBLAS: β = 1); `scratch` is not used.
    fn matmul_add_batch(
        &self,
        x: &CudaBuf,
        groups: &[RowGroup],
        w: WeightView<'_>,
        _scratch: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| self.matmul_groups(x, groups, &[w], &mut [out], true))
    }

    fn rope_store_kv(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        row0: usize,
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        inv_freq: &CudaBuf,
        k_cache: &mut CudaKvBuf,
        v_cache: &mut CudaKvBuf,
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| {
            let (hd, kv_dim) = (shape.head_dim, shape.n_kv_heads * shape.head_dim);
            let addrs = [
                self.addr(q, row0 * shape.n_heads * hd),
                self.addr(k, row0 * kv_dim),
                self.addr(v, row0 * kv_dim),
                self.addr(inv_freq, 0),
                self.kv_addr(k_cache),
                self.kv_addr(v_cache),
            ];
            let slots = k_cache.0.len() / kv_dim;
            self.rope_store_kv_launch(addrs, rows, pos0, shape, slots)
        })
    }

    /// With the `seqs` path, every sequence of a batch in one launch (a single sequence, whose
    /// decode steps may be recorded, goes through `rope_store_kv`). That kernel stores position
    /// `p` at slot `p`, so a batch where a ring cache (a sliding-window layer's) has wrapped goes
    /// through `rope_store_kv` too.
    fn rope_store_kv_batch(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        seqs: &mut [KvStoreSeq<'_, CudaKvBuf>],
        shape: AttentionShape,
        inv_freq: &CudaBuf,
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| {
            let kv_dim = shape.n_kv_heads * shape.head_dim;
            let unwrapped = seqs
                .iter()
                .all(|s| s.pos0 + s.rows <= s.k_cache.0.len() / kv_dim);
            if !self.paths.seqs || seqs.len() < 2 || !unwrapped {
                for s in seqs.iter_mut() {
                    self.rope_store_kv(
                        q, k, v, s.row0, s.rows, s.pos0, shape, inv_freq, s.k_cache, s.v_cache,
                    )?;
                }
                return Ok(());
            }
            let addrs = [
                self.addr(q, 0),
                self.addr(k, 0),
                self.addr(v, 0),
                self.addr(inv_freq, 0),
            ];
            let table: Vec<attention::SeqEntry> = seqs
                .iter()
                .map(|s| attention::SeqEntry {
                    k_cache: self.kv_addr(s.k_cache),
                    v_cache: self.kv_addr(s.v_cache),
                    row0: s.row0,
                    rows: s.rows,
                    pos0: s.pos0,
                })
                .collect();
            self.rope_store_kv_seqs_launch(addrs, &table, shape)
        })
    }

    fn attention_batch(
        &self,
        q: &CudaBuf,
        seqs: &[AttentionSeq<'_, CudaKvBuf>],
        shape: AttentionShape,
        params: AttentionParams,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| self.attention_seqs(q, seqs, shape, params, out))
    }

    /// One launch for a single decoding row of f16/bf16 weights with the `gated` path
    /// (`matmul_gated_launch`), else the matmuls and the activation, as by default.
    fn matmul_gated_batch(
        &self,
        x: &CudaBuf,
        groups: &[RowGroup],
        ffn: GatedWeights<'_>,
        out: &mut CudaBuf,
        up_out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let GatedWeights { gate, up, act } = ffn;
        let rows: usize = groups.iter().map(|g| g.rows).sum();
        let fusable = self.paths.gated
            && rows == 1
            && gate.dtype == up.dtype
            && (gate.rows, gate.cols) == (up.rows, up.cols);
        match self.gated_kernel(gate.dtype).filter(|_| fusable) {
            Some(kernel) => self.unless_replaying(|| {
                self.matmul_gated_launch(kernel, self.addr(x, 0), gate, up, act, out)
            }),
            None => {
                self.matmul_batch(x, groups, &[gate, up], &mut [&mut *out, &mut *up_out])?;
                self.gated_activation(act, out, up_out, rows * gate.rows)
            }
        }
    }

    fn swiglu(&self, gate: &mut CudaBuf, up: &CudaBuf, len: usize) -> Result<(), BackendError> {
        self.unless_replaying(|| self.gated_act_launch(gate, up, len, Activation::Silu))
    }

    fn geglu(&self, gate: &mut CudaBuf, up: &CudaBuf, len: usize) -> Result<(), BackendError> {
        self.unless_replaying(|| self.gated_act_launch(gate, up, len, Activation::GeluTanh))
    }

    fn add_bias(
        &self,
        x: &mut CudaBuf,
        rows: usize,
        bias: WeightView<'_>,
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| self.add_bias_launch(x, rows, bias))
    }

    fn rmsnorm_pieces(
        &self,
        x: &mut CudaBuf,
        pieces: usize,
        weight: WeightView<'_>,
        eps: f32,
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| self.rmsnorm_pieces_launch(x, pieces, weight, eps))
    }

    fn scale(&self, x: &mut CudaBuf, len: usize, factor: f32) -> Result<(), BackendError> {
        self.unless_replaying(|| self.map_launch(&self.kernels.scale_f32, x, len, factor))
    }

    fn softcap(&self, x: &mut CudaBuf, len: usize, cap: f32) -> Result<(), BackendError> {
        self.unless_replaying(|| self.map_launch(&self.kernels.softcap, x, len, cap))
    }

    fn copy_rows(
        &self,
        src: &CudaBuf,
        src_row: usize,
        dst: &mut CudaBuf,
        dst_row: usize,
        rows: usize,
        row_len: usize,
    ) -> Result<(), BackendError> {
        self.unless_replaying(|| {
            let (s, d) = (
                self.addr(src, src_row * row_len),
                self.addr(dst, dst_row * row_len),
            );
            self.copy_launch(&self.kernels.copy_f32, s, d, rows * row_len)
        })
    }
}
