//! Hybrid execution: two backends compute one matmul at the same time, each a share of its
//! output rows, so that the bandwidths of two paths to the weights add up.
//!
//! # Why rows of each matmul, and not whole layers
//!
//! Measured on the lent H100 VM (issue 24): a batch-1 decode of the f16 7B with 4 GiB of GPU
//! memory moves ~10.9 GB of non-resident weights per token. Pinned host→device copies bring
//! 55 GB/s, so streaming all of it takes 10.9 / 55 = 0.198 s (5.0 tok/s, what GdsLLM reached:
//! 4.97). The CPU reads RAM at ~77 GB/s, so computing all of it there takes 0.142 s (7.0 tok/s;
//! llama.cpp's `-ngl 8` made 7.9 with a few more layers on the GPU). A whole-layer split (as
//! `-ngl` does) cannot beat the faster of the two: layers run one after the other, so while
//! the CPU computes its layers the PCIe link idles, and the other way round. Splitting **each
//! matmul's output rows** instead makes both paths work on every layer at once: the CPU
//! computes rows `[0, k)` straight from the host tier's RAM while the GPU computes rows
//! `[k, n)` from what streams in, and the time is `10.9 GB / (77 + 55) GB/s = 0.083 s`
//! (12 tok/s, the CPU taking `77 / 132 = 58 %` of the rows) — where the two paths' bandwidths
//! add up; on one DRAM they add less, and `residency::placement` plans with what they achieve
//! together. Rows of a weight are contiguous
//! bytes of its blob in every dtype (a row is a whole number of blocks), so each side's share
//! is one byte range: the GPU streams only its share.
//!
//! # The grain, and what it costs
//!
//! A layer has four matmul calls (Q/K/V together, the attention output, gate/up together,
//! down); each split one hands the activation rows to the helper (a device→host read of
//! `rows · dim` f32, 16 KiB for a 7B's decode row) and brings its output columns back (at most
//! `rows · ffn` f32, 44 KiB). That is 4 synchronisations per non-resident layer: 120 per token
//! for the 7B's 30, each ~20–30 µs on PCIe, ~3 ms per token, 4 % of the 83 ms above. A coarser
//! grain (the CPU taking whole heads through attention, and a slice of the FFN through `down`)
//! would halve them, but the output projection and `down` would then be split by *columns*
//! (their inputs), which are not contiguous bytes of the blob: the GPU would stream strided
//! pieces. Rows of every matmul keep each share a single range, for 4 % of the time.
//!
//! At batch `B` a pass over the weights serves `B` rows on the GPU for the same bytes, while
//! the CPU's cost grows with the rows (at 32 rows it is compute-bound): the planner
//! (`residency::placement`) gives the CPU a smaller share as the batch grows, none to a pass of
//! more than 8 rows (measured: a split 32-row pass lost to the GPU alone at every share) and
//! none to a prefill chunk.
//!
//! # Where everything else runs
//!
//! Everything but the split matmuls (norms, RoPE, attention, the activations) runs on the
//! primary backend, and so does every layer's KV cache: attention reads the cache, not the
//! weights, so there is nothing to gain by splitting it at batch 1, and keeping it whole
//! keeps one sync per matmul call. (A model whose attention runs on the CPU would keep its KV
//! in RAM; this split does not do that.)
//!
//! [`SplitBackend`] is generic over its two [`Backend`]s (the helper's activations being host
//! vectors), so the whole arrangement is tested
//! with the CPU backend on both sides (`tests/hybrid.rs`): logits against a single backend's,
//! and [`SplitStats`] counting the rows and bytes each side computed against the plan.
//!
//! # On a GPU
//!
//! `--placement auto` (`OpenOptions::hybrid`) has [`crate::open`] build a
//! `SplitBackend<CudaBackend, CpuBackend>` when layers stream from the pinned host tier
//! (`hybrid::cuda`): the CPU reads its rows of each such blob from the host tier in place
//! ([`crate::weights::WeightBytes::Both`] hands out both copies), and residency copies only
//! the GPU's byte ranges of it over PCIe ([`primary_ranges`]), so that the bytes the two
//! sides read per pass are disjoint and the bandwidths add up. The share of each blob is the
//! planner's for the rows of the pass its fill was made for, never more than the planner's for
//! the pass that reads it: `hybrid::cuda` says how the first blobs of a pass, prefetched during
//! the one before, are completed when that is less. The split costs the decode CUDA
//! graph (off: host work sits between the GPU's ops), which streamed layers already turn off.
//! Each handoff is a synchronising read of the activations (into a host buffer the split
//! keeps, which the CPU's matmul reads as it is) and the two merges: the GPU's share, queued
//! right behind its matmul (so the GPU does it while the CPU computes), and the CPU's share,
//! which the CUDA backend stages in mapped pinned host memory and has its kernel read over
//! PCIe ([`ColumnSource::Host`]: no device allocation, no pageable copy, nothing
//! queued on a copy engine behind the residency ring's streamed copies); each is one kernel
//! launch for all rows. The buffers of the shares are kept from one call to the next.

pub mod calibrate;
#[cfg(feature = "cuda")]
pub mod cuda;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::backend::{
    AttentionParams, AttentionSeq, AttentionShape, Backend, BackendError, GatedWeights, KvStoreSeq,
    NormInto, PassInfo, ReferenceBackend, RowGroup,
};
use crate::backend::{CpuBackend, WeightView};

/// Measures this machine's figures for the planner for weights of the given dtypes (the CLI
/// keeps them under `$GDSLLM_HOME`); an error is a message.
pub type CalibrateFn =
    dyn Fn(&[weights_format::DType]) -> Result<residency::Calibration, String> + Send + Sync;

/// `--placement auto` on a GPU: the CPU computes a share of the matmuls of the layers the
/// host tier holds ([`crate::open`] builds a [`SplitBackend`] over the CUDA backend and the
/// CPU backend, see `hybrid::cuda`).
#[derive(Clone, Default)]
pub struct HybridOptions {
    /// This machine's figures for the planner (`residency::placement`), measured or loaded
    /// when the model's dtypes are known.
    pub calibrate: Option<Arc<CalibrateFn>>,
    /// For tests: every split matmul gives the CPU this share of its rows, whatever the
    /// planner would (no calibration needed).
    pub force_cpu_fraction: Option<f64>,
    /// For tests, with `force_cpu_fraction`: passes of more rows than this give the CPU
    /// nothing (as the planner does a prefill chunk); `None`: every pass gets the forced share.
    pub force_max_rows: Option<usize>,
}

impl std::fmt::Debug for HybridOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridOptions")
            .field("calibrate", &self.calibrate.is_some())
            .field("force_cpu_fraction", &self.force_cpu_fraction)
            .field("force_max_rows", &self.force_max_rows)
            .finish()
    }
}

/// Output rows of a split are a multiple of this, so each side's share stays aligned to the
/// row tiles of the matmul kernels.
pub const ROW_GRAIN: usize = 32;

/// The rows `[0, k)` of an `n`-row weight the helper computes for a share `fraction` of them:
/// `fraction · n` rounded to the nearest [`ROW_GRAIN`], within `0 ..= n` (all of them when the
/// rounding reaches `n`).
pub fn helper_rows(n: usize, fraction: f64) -> usize {
    if fraction.is_nan() || fraction <= 0.0 {
        return 0;
    }
    let grains = (fraction.min(1.0) * n as f64 / ROW_GRAIN as f64).round() as usize;
    (grains * ROW_GRAIN).min(n)
}

/// The tensors only ever read as a matmul's weight, whose rows `[0, k)` the primary may lack.
const MATMUL_WEIGHTS: [&str; 8] = {
    use weights_format::names::*;
    [
        ATTN_Q,
        ATTN_K,
        ATTN_V,
        ATTN_OUTPUT,
        FFN_GATE,
        FFN_UP,
        FFN_DOWN,
        OUTPUT,
    ]
};

/// The byte ranges of `blob` the primary (the GPU) needs when the helper (the CPU) takes share `fraction` of its matmuls:
/// rows `[k, n)` of each matmul weight, every other tensor whole.
pub fn primary_ranges(blob: &weights_format::BlobMeta, fraction: f64) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for t in &blob.tensors {
        let matmul = MATMUL_WEIGHTS.contains(&t.name.as_str());
        let (offset, len) = match t.shape.as_slice() {
            &[rows, _] if rows > 0 && matmul => {
                let row_bytes = t.length / rows;
                let skip = helper_rows(rows as usize, fraction) as u64 * row_bytes;
                (t.offset + skip, t.length - skip)
            }
            _ => (t.offset, t.length),
        };
        if len == 0 {
            continue;
        }
        match ranges.last_mut() {
            Some(last) if last.0 + last.1 == offset => last.1 += len,
            _ => ranges.push((offset, len)),
        }
    }
    ranges
}

/// Where a share's output block goes: `rows` rows of `src_cols` values into columns
/// `col0 .. col0 + src_cols` of a buffer of `rows` rows of `dst_cols` values, written over
/// them or added to them. One value, so that the trait, its checks and its kernels take the
/// geometry together rather than as five loose numbers in a fixed order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColumnPlacement {
    pub rows: usize,
    pub src_cols: usize,
    pub dst_cols: usize,
    pub col0: usize,
    pub into: NormInto,
}

impl ColumnPlacement {
    /// Values the block to place holds: `rows · src_cols`.
    pub fn src_len(&self) -> usize {
        self.rows * self.src_cols
    }

    /// Checks the placement against its buffers' lengths (in values): an error for `op`
    /// unless the source holds `rows · src_cols` values, the destination `rows · dst_cols`
    /// and the columns `col0 .. col0 + src_cols` lie within `dst_cols`.
    pub(crate) fn check(
        &self,
        op: &'static str,
        src_len: usize,
        dst_len: usize,
    ) -> Result<(), BackendError> {
        let ColumnPlacement {
            rows,
            src_cols,
            dst_cols,
            col0,
            ..
        } = *self;
        if col0 + src_cols > dst_cols || src_len < rows * src_cols || dst_len < rows * dst_cols {
            return Err(BackendError::Unsupported {
                op,
                message: format!(
                    "columns {col0}..{} of {rows} rows of {dst_cols} from {src_cols} (buffers of \
                     {} and {} values)",
                    col0 + src_cols,
                    src_len,
                    dst_len
                ),
            });
        }
        Ok(())
    }
}

/// The block [`SplitTarget::write_columns`] places: a buffer of the backend's (the primary's
/// share), or values in host memory (the helper's share).
pub enum ColumnSource<'a, B> {
    Buffer(&'a B),
    /// May be overwritten as soon as the call returns.
    Host(&'a [f32]),
}

/// A backend that can place a block of values into some columns of a wider buffer: what
/// brings a share's output rows (which are columns of the activations) home. One method for
/// both kinds of [`ColumnSource`], so that each backend decides in one place how host values
/// get there: the CUDA backend has its kernel read them from mapped host memory, a host
/// backend writes them in place as it does a buffer's.
pub trait SplitTarget: Backend {
    /// `dst[r, col0 .. col0+src_cols] = src[r, :]` (or `+=` with [`NormInto::Add`]) for
    /// `r < rows`, `src: [rows, src_cols]`, `dst: [rows, dst_cols]` (see [`ColumnPlacement`]).
    fn write_columns(
        &self,
        src: ColumnSource<'_, Self::Buf>,
        dst: &mut Self::Buf,
        at: ColumnPlacement,
    ) -> Result<(), BackendError>;
}

/// [`SplitTarget::write_columns`] over host buffers.
fn write_columns_host(
    op: &'static str,
    src: &[f32],
    dst: &mut [f32],
    at: ColumnPlacement,
) -> Result<(), BackendError> {
    at.check(op, src.len(), dst.len())?;
    let (src_cols, dst_cols, col0) = (at.src_cols, at.dst_cols, at.col0);
    for r in 0..at.rows {
        let from = &src[r * src_cols..(r + 1) * src_cols];
        let to = &mut dst[r * dst_cols + col0..r * dst_cols + col0 + src_cols];
        match at.into {
            NormInto::Write => to.copy_from_slice(from),
            NormInto::Add => to.iter_mut().zip(from).for_each(|(a, b)| *a += b),
        }
    }
    Ok(())
}

/// [`SplitTarget`] for a backend whose buffers are host vectors.
macro_rules! host_split_target {
    ($backend:ty, $op:literal) => {
        impl SplitTarget for $backend {
            fn write_columns(
                &self,
                src: ColumnSource<'_, Vec<f32>>,
                dst: &mut Vec<f32>,
                at: ColumnPlacement,
            ) -> Result<(), BackendError> {
                let values = match src {
                    ColumnSource::Buffer(buf) => buf.as_slice(),
                    ColumnSource::Host(host) => host,
                };
                write_columns_host($op, values, dst, at)
            }
        }
    };
}

host_split_target!(CpuBackend, "cpu write_columns");
host_split_target!(ReferenceBackend, "reference write_columns");

/// The share of each blob's matmul rows the helper computes, for a pass of `rows` rows:
/// `fraction(blob, rows)` in `0 ..= 1` (0: the primary computes all of it).
pub type ShareFn = dyn Fn(usize, usize) -> f64 + Send + Sync;

/// What each side of a [`SplitBackend`] computed: output rows (summed over the weights of
/// every matmul call, not multiplied by the activation rows) and the weight bytes it read; and
/// where the time of each kind of pass went ([`PassTimes`], by the pass's rows).
#[derive(Debug, Default)]
pub struct SplitStats {
    helper_rows: AtomicU64,
    helper_bytes: AtomicU64,
    primary_rows: AtomicU64,
    primary_bytes: AtomicU64,
    /// Matmul calls that were split (each one synchronisation of the two sides).
    splits: AtomicU64,
    /// The pass running now: its rows and when it began.
    current: Mutex<Option<(usize, Instant)>>,
    /// The pass whose ops are queued and whose output is not yet read back.
    queued: Mutex<Option<(usize, Instant)>>,
    by_rows: Mutex<BTreeMap<usize, PassTimes>>,
}

/// Where the time of the passes of one row count went, summed over those passes: what tells
/// whether a split pass is bound by the helper's matmuls, by waiting for the primary, or by
/// the handoffs (the planner predicts the first and assumes the others small).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PassTimes {
    /// Passes of these rows that ran.
    pub passes: u64,
    /// Wall time from each pass's start until its output was read back (or the next pass began).
    pub seconds: f64,
    /// The helper's matmuls of split calls (the CPU's share).
    pub helper_seconds: f64,
    /// Reading each split call's input from the primary: the wait for the primary's ops
    /// queued before it (the GPU's share of the previous call, attention, norms).
    pub wait_seconds: f64,
    /// Putting both sides' shares into the outputs' columns: the host's time to stage and
    /// queue them (on a GPU their kernels run asynchronously; the time they take there shows
    /// in the next split call's wait).
    pub merge_seconds: f64,
    /// Weight bytes the helper read in those passes.
    pub helper_bytes: u64,
    /// Split matmul calls in those passes.
    pub splits: u64,
}

impl PassTimes {
    /// The helper's weight bytes per second of its own matmul time (10^9).
    pub fn helper_gbps(&self) -> f64 {
        if self.helper_seconds > 0.0 {
            self.helper_bytes as f64 / self.helper_seconds / 1e9
        } else {
            0.0
        }
    }
}

/// A copy of [`SplitStats`]' counts at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SplitCounts {
    pub helper_rows: u64,
    pub helper_bytes: u64,
    pub primary_rows: u64,
    pub primary_bytes: u64,
    pub splits: u64,
}

impl SplitStats {
    pub fn counts(&self) -> SplitCounts {
        SplitCounts {
            helper_rows: self.helper_rows.load(Ordering::Relaxed),
            helper_bytes: self.helper_bytes.load(Ordering::Relaxed),
            primary_rows: self.primary_rows.load(Ordering::Relaxed),
            primary_bytes: self.primary_bytes.load(Ordering::Relaxed),
            splits: self.splits.load(Ordering::Relaxed),
        }
    }

    /// Where the time went, per row count of a pass (decode batch size or prefill chunk),
    /// ascending.
    pub fn pass_times(&self) -> Vec<(usize, PassTimes)> {
        lock(&self.by_rows)
            .iter()
            .map(|(&rows, &times)| (rows, times))
            .collect()
    }

    fn count(&self, helper: bool, rows: usize, bytes: usize) {
        let (r, b) = if helper {
            (&self.helper_rows, &self.helper_bytes)
        } else {
            (&self.primary_rows, &self.primary_bytes)
        };
        r.fetch_add(rows as u64, Ordering::Relaxed);
        b.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn begin_pass(&self, rows: usize) {
        self.finish_pass();
        *lock(&self.current) = Some((rows, Instant::now()));
    }

    /// The pass's ops are queued: its time runs on until its output is read back
    /// ([`Self::finish_pass`]), since on a GPU they may still be running.
    fn end_pass(&self, ran: bool) {
        let Some(pass) = lock(&self.current).take() else {
            return;
        };
        if ran {
            *lock(&self.queued) = Some(pass);
        }
    }

    /// Records the time of the pass last ended, up to now: called once its logits or ids are
    /// read back (the read waits for the primary's last op), or at the next pass's start for
    /// a pass read back from nothing (a prefill chunk before the last).
    ///
    /// Why not at `end_pass`: there the host has only queued the GPU's ops. A 32-sequence
    /// decode step of a 7B Q4_K_M at 4 GiB on the H200 measured 10.1–10.5 ms to that point and
    /// 15.6–16.7 ms to its ids; the difference was the GPU finishing the last layers and the
    /// LM head.
    fn finish_pass(&self) {
        let Some((rows, start)) = lock(&self.queued).take() else {
            return;
        };
        let mut by_rows = lock(&self.by_rows);
        let times = by_rows.entry(rows).or_default();
        times.passes += 1;
        times.seconds += start.elapsed().as_secs_f64();
    }

    /// Adds one split call's times to the pass running now.
    fn add_split(&self, helper_bytes: usize, wait: f64, helper: f64, merge: f64) {
        let Some((rows, _)) = *lock(&self.current) else {
            return;
        };
        let mut by_rows = lock(&self.by_rows);
        let times = by_rows.entry(rows).or_default();
        times.wait_seconds += wait;
        times.helper_seconds += helper;
        times.merge_seconds += merge;
        times.helper_bytes += helper_bytes as u64;
        times.splits += 1;
    }
}

/// A lock whose data stays usable if a thread panicked while holding it (statistics and
/// caches: a partial update is not worth a second panic).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Two backends as one: every op on `primary`, except the matmuls of the blobs the share
/// function gives the helper a share of, whose output rows `[0, k)` the `helper` computes
/// (from the same weight bytes, which it must be able to read: host memory for the CPU
/// backend, whose activations are host vectors too) while the primary computes rows `[k, n)`.
/// The model tells which blob its ops read through [`Backend::weights_from_blob`].
pub struct SplitBackend<P: SplitTarget, H: Backend<Buf = Vec<f32>>> {
    primary: P,
    helper: H,
    share: Box<ShareFn>,
    /// Told the rows of each pass before it starts.
    on_pass: Option<Box<dyn Fn(usize) + Send + Sync>>,
    /// The blob whose weights the ops read now (`usize::MAX`: none announced).
    blob: AtomicUsize,
    stats: Arc<SplitStats>,
    /// The buffers of the split calls, reused by every call.
    scratch: Mutex<SplitScratch<P::Buf>>,
}

/// The buffers a split call uses, kept from one call to the next and grown to the largest
/// asked for (only the first `rows · width` values of each are read or written): the helper's
/// input and outputs in host memory, and the primary's share of each output (`B`, with its
/// length in values).
struct SplitScratch<B> {
    x_host: Vec<f32>,
    helper_outs: Vec<Vec<f32>>,
    primary_outs: Vec<(usize, B)>,
}

impl<P: SplitTarget, H: Backend<Buf = Vec<f32>>> SplitBackend<P, H> {
    /// `share(blob, rows)`: the fraction of blob `blob`'s matmul rows the helper computes in a
    /// pass of `rows` rows.
    pub fn new(primary: P, helper: H, share: Box<ShareFn>) -> SplitBackend<P, H> {
        SplitBackend {
            primary,
            helper,
            share,
            on_pass: None,
            blob: AtomicUsize::new(usize::MAX),
            stats: Arc::new(SplitStats::default()),
            scratch: Mutex::new(SplitScratch {
                x_host: Vec::new(),
                helper_outs: Vec::new(),
                primary_outs: Vec::new(),
            }),
        }
    }

    /// `hook(rows)` is called before each pass of `rows` rows starts (the CUDA split tells
    /// residency there whether fills may skip the CPU's rows).
    pub fn with_pass_hook(mut self, hook: Box<dyn Fn(usize) + Send + Sync>) -> Self {
        self.on_pass = Some(hook);
        self
    }

    pub fn primary(&self) -> &P {
        &self.primary
    }

    pub fn helper(&self) -> &H {
        &self.helper
    }

    /// What each side computed so far (shared: it can be read while the model runs).
    pub fn stats(&self) -> Arc<SplitStats> {
        Arc::clone(&self.stats)
    }

    /// The helper's fraction for the current blob and a pass of `rows` rows.
    fn fraction(&self, rows: usize) -> f64 {
        match self.blob.load(Ordering::Relaxed) {
            usize::MAX => 0.0,
            blob => (self.share)(blob, rows),
        }
    }

    /// `outs[i] (+)= x · ws[i]ᵀ` with each weight's rows `[0, k_i)` on the helper and the rest
    /// on the primary, each side's product brought into its columns of `outs[i]`.
    fn split_matmul(
        &self,
        x: &P::Buf,
        groups: &[RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut P::Buf],
        into: NormInto,
        ks: &[usize],
    ) -> Result<(), BackendError> {
        let rows: usize = groups.iter().map(|g| g.rows).sum();
        let cols = ws[0].cols;
        // A share of weight `i` (its rows from `first_row` on) is columns `first_row..` of
        // `outs[i]`.
        let placement = |i: usize, part: &WeightView<'_>, first_row: usize| ColumnPlacement {
            rows,
            src_cols: part.rows,
            dst_cols: ws[i].rows,
            col0: first_row,
            into,
        };
        let mut scratch = lock(&self.scratch);
        let SplitScratch {
            x_host,
            helper_outs,
            primary_outs,
        } = &mut *scratch;
        // The helper's input first: reading it back waits for the ops before, not for the
        // primary's share queued next.
        if x_host.len() < rows * cols {
            x_host.resize(rows * cols, 0.0);
        }
        let started = Instant::now();
        self.primary.read(x, &mut x_host[..rows * cols])?;
        let wait = started.elapsed().as_secs_f64();

        // The primary's share: rows [k, n) of each weight that has any, into buffers of
        // their own, queued before the helper starts so that both run at once.
        let mut primary_parts = Vec::new();
        for (i, (w, &k)) in ws.iter().zip(ks).enumerate() {
            if k < w.rows {
                primary_parts.push((i, k, rows_of(w, k, w.rows)?));
            }
        }
        for (j, (_, _, part)) in primary_parts.iter().enumerate() {
            let len = rows * part.rows;
            match primary_outs.get(j) {
                Some((have, _)) if *have >= len => {}
                _ => {
                    let buf = (len, self.primary.alloc(len)?);
                    if j < primary_outs.len() {
                        primary_outs[j] = buf;
                    } else {
                        primary_outs.push(buf);
                    }
                }
            }
        }
        let mut merge = 0.0;
        if !primary_parts.is_empty() {
            let views: Vec<WeightView<'_>> = primary_parts.iter().map(|p| p.2).collect();
            let mut bufs: Vec<&mut P::Buf> = primary_outs
                .iter_mut()
                .map(|(_, b)| b)
                .take(views.len())
                .collect();
            self.primary.matmul_batch(x, groups, &views, &mut bufs)?;
            for p in &primary_parts {
                self.stats
                    .count(false, p.2.rows, p.2.rows * p.2.row_bytes());
            }
            // Its columns go in place right behind it (the other columns are the helper's),
            // while the helper computes.
            let merge_started = Instant::now();
            for ((i, k, part), (_, buf)) in primary_parts.iter().zip(primary_outs.iter()) {
                let at = placement(*i, part, *k);
                self.primary
                    .write_columns(ColumnSource::Buffer(buf), outs[*i], at)?;
            }
            merge += merge_started.elapsed().as_secs_f64();
        }

        // The helper's share: rows [0, k) of each weight that has any.
        let mut helper_parts = Vec::new();
        for (i, (w, &k)) in ws.iter().zip(ks).enumerate() {
            if k > 0 {
                helper_parts.push((i, rows_of(w, 0, k)?));
            }
        }
        if helper_outs.len() < helper_parts.len() {
            helper_outs.resize_with(helper_parts.len(), Vec::new);
        }
        for ((_, part), out) in helper_parts.iter().zip(helper_outs.iter_mut()) {
            if out.len() < rows * part.rows {
                out.resize(rows * part.rows, 0.0);
            }
        }
        let helper_started = Instant::now();
        {
            let views: Vec<WeightView<'_>> = helper_parts.iter().map(|p| p.1).collect();
            let mut bufs: Vec<&mut Vec<f32>> = helper_outs.iter_mut().take(views.len()).collect();
            self.helper
                .matmul_batch(x_host, groups, &views, &mut bufs)?;
        }
        let helper_s = helper_started.elapsed().as_secs_f64();
        let mut helper_bytes = 0;
        for p in &helper_parts {
            let bytes = p.1.rows * p.1.row_bytes();
            helper_bytes += bytes;
            self.stats.count(true, p.1.rows, bytes);
        }

        // The helper's columns, straight from its host buffers.
        let merge_started = Instant::now();
        for ((i, part), host) in helper_parts.iter().zip(helper_outs.iter()) {
            let at = placement(*i, part, 0);
            let values = ColumnSource::Host(&host[..at.src_len()]);
            self.primary.write_columns(values, outs[*i], at)?;
        }
        self.stats.splits.fetch_add(1, Ordering::Relaxed);
        merge += merge_started.elapsed().as_secs_f64();
        self.stats.add_split(helper_bytes, wait, helper_s, merge);
        Ok(())
    }

    /// The helper's rows of each weight for a pass of `groups`: none of a weight the helper
    /// cannot read (a resident blob in device memory only).
    fn helper_rows_of(&self, groups: &[RowGroup], ws: &[WeightView<'_>]) -> Vec<usize> {
        let rows: usize = groups.iter().map(|g| g.rows).sum();
        let fraction = self.fraction(rows);
        ws.iter()
            .map(|w| match w.bytes.host() {
                Some(_) => helper_rows(w.rows, fraction),
                None => 0,
            })
            .collect()
    }

    fn count_primary(&self, ws: &[WeightView<'_>]) {
        for w in ws {
            self.stats.count(false, w.rows, w.rows * w.row_bytes());
        }
    }
}

/// Rows `r0 .. r1` of `w`: a contiguous byte range of it in any dtype.
fn rows_of<'a>(w: &WeightView<'a>, r0: usize, r1: usize) -> Result<WeightView<'a>, BackendError> {
    let row_bytes = w.row_bytes();
    let bytes = w
        .bytes
        .slice(r0 * row_bytes, (r1 - r0) * row_bytes)
        .ok_or_else(|| BackendError::Unsupported {
            op: "split matmul",
            message: format!(
                "rows {r0}..{r1} of a [{}, {}] {:?} weight of {} bytes",
                w.rows,
                w.cols,
                w.dtype,
                w.bytes.len()
            ),
        })?;
    Ok(WeightView {
        dtype: w.dtype,
        rows: r1 - r0,
        cols: w.cols,
        bytes,
    })
}

impl<P: SplitTarget, H: Backend<Buf = Vec<f32>>> Backend for SplitBackend<P, H> {
    type Buf = P::Buf;
    type KvBuf = P::KvBuf;

    fn name(&self) -> &'static str {
        "split"
    }

    fn alloc(&self, len: usize) -> Result<P::Buf, BackendError> {
        self.primary.alloc(len)
    }

    fn alloc_kv(&self, len: usize) -> Result<P::KvBuf, BackendError> {
        self.primary.alloc_kv(len)
    }

    fn kv_value_bytes(&self) -> usize {
        self.primary.kv_value_bytes()
    }

    fn copy_kv(
        &self,
        src: &P::KvBuf,
        dst: &mut P::KvBuf,
        values: usize,
    ) -> Result<(), BackendError> {
        self.primary.copy_kv(src, dst, values)
    }

    fn uniform_rows_from(&self) -> usize {
        self.primary
            .uniform_rows_from()
            .max(self.helper.uniform_rows_from())
    }

    fn upload(&self, values: &[f32]) -> Result<P::Buf, BackendError> {
        self.primary.upload(values)
    }

    fn read(&self, buf: &P::Buf, out: &mut [f32]) -> Result<(), BackendError> {
        let read = self.primary.read(buf, out);
        self.stats.finish_pass();
        read
    }

    fn argmax_rows(
        &self,
        logits: &P::Buf,
        cols: usize,
        out: &mut [u32],
    ) -> Result<(), BackendError> {
        let read = self.primary.argmax_rows(logits, cols, out);
        self.stats.finish_pass();
        read
    }

    fn begin_pass(&self, pass: &PassInfo) -> Result<(), BackendError> {
        self.blob.store(usize::MAX, Ordering::Relaxed);
        self.stats.begin_pass(pass.rows);
        if let Some(hook) = &self.on_pass {
            hook(pass.rows);
        }
        // Host work between the primary's ops cannot be recorded and replayed.
        self.primary.begin_pass(&PassInfo {
            weights_stable: false,
            ..*pass
        })
    }

    fn end_pass(&self, ran: bool) -> Result<(), BackendError> {
        self.blob.store(usize::MAX, Ordering::Relaxed);
        let ended = self.primary.end_pass(ran);
        self.stats.end_pass(ran && ended.is_ok());
        ended
    }

    fn weights_from_blob(&self, blob: usize) {
        self.blob.store(blob, Ordering::Relaxed);
    }

    fn embed_rows(
        &self,
        table: WeightView<'_>,
        ids: &[u32],
        out: &mut P::Buf,
    ) -> Result<(), BackendError> {
        self.primary.embed_rows(table, ids, out)
    }

    fn embed_host_rows(&self, rows: WeightView<'_>, out: &mut P::Buf) -> Result<(), BackendError> {
        self.primary.embed_host_rows(rows, out)
    }

    fn rmsnorm(
        &self,
        x: &P::Buf,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &mut P::Buf,
        into: NormInto,
    ) -> Result<(), BackendError> {
        self.primary.rmsnorm(x, rows, weight, eps, out, into)
    }

    fn matmul_batch(
        &self,
        x: &P::Buf,
        groups: &[RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut P::Buf],
    ) -> Result<(), BackendError> {
        let ks = self.helper_rows_of(groups, ws);
        if ws.is_empty() || ks.iter().all(|&k| k == 0) {
            self.count_primary(ws);
            return self.primary.matmul_batch(x, groups, ws, outs);
        }
        self.split_matmul(x, groups, ws, outs, NormInto::Write, &ks)
    }

    fn matmul_add_batch(
        &self,
        x: &P::Buf,
        groups: &[RowGroup],
        w: WeightView<'_>,
        scratch: &mut P::Buf,
        out: &mut P::Buf,
    ) -> Result<(), BackendError> {
        let ks = self.helper_rows_of(groups, &[w]);
        if ks[0] == 0 {
            self.count_primary(&[w]);
            return self.primary.matmul_add_batch(x, groups, w, scratch, out);
        }
        self.split_matmul(x, groups, &[w], &mut [out], NormInto::Add, &ks)
    }

    fn rope_store_kv(
        &self,
        q: &mut P::Buf,
        k: &mut P::Buf,
        v: &P::Buf,
        row0: usize,
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        inv_freq: &P::Buf,
        k_cache: &mut P::KvBuf,
        v_cache: &mut P::KvBuf,
    ) -> Result<(), BackendError> {
        self.primary
            .rope_store_kv(q, k, v, row0, rows, pos0, shape, inv_freq, k_cache, v_cache)
    }

    fn rope_store_kv_batch(
        &self,
        q: &mut P::Buf,
        k: &mut P::Buf,
        v: &P::Buf,
        seqs: &mut [KvStoreSeq<'_, P::KvBuf>],
        shape: AttentionShape,
        inv_freq: &P::Buf,
    ) -> Result<(), BackendError> {
        self.primary
            .rope_store_kv_batch(q, k, v, seqs, shape, inv_freq)
    }

    fn attention_batch(
        &self,
        q: &P::Buf,
        seqs: &[AttentionSeq<'_, P::KvBuf>],
        shape: AttentionShape,
        params: AttentionParams,
        out: &mut P::Buf,
    ) -> Result<(), BackendError> {
        self.primary.attention_batch(q, seqs, shape, params, out)
    }

    /// The primary's own gated product when neither weight is split (it may fuse it), else
    /// the split matmuls and the primary's activation.
    fn matmul_gated_batch(
        &self,
        x: &P::Buf,
        groups: &[RowGroup],
        ffn: GatedWeights<'_>,
        out: &mut P::Buf,
        up_out: &mut P::Buf,
    ) -> Result<(), BackendError> {
        let GatedWeights { gate, up, act } = ffn;
        let ks = self.helper_rows_of(groups, &[gate, up]);
        if ks.iter().all(|&k| k == 0) {
            self.count_primary(&[gate, up]);
            return self.primary.matmul_gated_batch(x, groups, ffn, out, up_out);
        }
        self.split_matmul(
            x,
            groups,
            &[gate, up],
            &mut [&mut *out, &mut *up_out],
            NormInto::Write,
            &ks,
        )?;
        let len = groups.iter().map(|g| g.rows).sum::<usize>() * gate.rows;
        self.gated_activation(act, out, up_out, len)
    }

    fn swiglu(&self, gate: &mut P::Buf, up: &P::Buf, len: usize) -> Result<(), BackendError> {
        self.primary.swiglu(gate, up, len)
    }

    fn geglu(&self, gate: &mut P::Buf, up: &P::Buf, len: usize) -> Result<(), BackendError> {
        self.primary.geglu(gate, up, len)
    }

    fn add_bias(
        &self,
        x: &mut P::Buf,
        rows: usize,
        bias: WeightView<'_>,
    ) -> Result<(), BackendError> {
        self.primary.add_bias(x, rows, bias)
    }

    fn rmsnorm_pieces(
        &self,
        x: &mut P::Buf,
        pieces: usize,
        weight: WeightView<'_>,
        eps: f32,
    ) -> Result<(), BackendError> {
        self.primary.rmsnorm_pieces(x, pieces, weight, eps)
    }

    fn scale(&self, x: &mut P::Buf, len: usize, factor: f32) -> Result<(), BackendError> {
        self.primary.scale(x, len, factor)
    }

    fn softcap(&self, x: &mut P::Buf, len: usize, cap: f32) -> Result<(), BackendError> {
        self.primary.softcap(x, len, cap)
    }

    fn copy_rows(
        &self,
        src: &P::Buf,
        src_row: usize,
        dst: &mut P::Buf,
        dst_row: usize,
        rows: usize,
        row_len: usize,
    ) -> Result<(), BackendError> {
        self.primary
            .copy_rows(src, src_row, dst, dst_row, rows, row_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helper_rows_round_to_the_grain_within_the_weight() {
        assert_eq!(helper_rows(4096, 0.0), 0);
        assert_eq!(helper_rows(4096, -1.0), 0);
        assert_eq!(helper_rows(4096, f64::NAN), 0);
        assert_eq!(helper_rows(4096, 0.58), 2368); // 74 grains of 32
        assert_eq!(helper_rows(4096, 1.0), 4096);
        assert_eq!(helper_rows(4096, 7.0), 4096);
        assert_eq!(helper_rows(100, 0.99), 96);
        assert_eq!(helper_rows(20, 0.9), 20);
        assert_eq!(helper_rows(20, 0.2), 0);
    }

    #[test]
    fn the_primary_ranges_skip_the_helper_rows_of_matmul_weights_only() {
        use weights_format::{BlobMeta, TensorMeta};
        let tensor = |name: &str, shape: Vec<u64>, offset: u64, length: u64| TensorMeta {
            name: name.into(),
            dtype: weights_format::DType::F16,
            shape,
            offset,
            length,
        };
        // [128, 64] f16 weights: rows of 128 bytes.
        let blob = BlobMeta {
            file: "layer_000.bin".into(),
            length: 3 * 16384 + 4096,
            checksum: String::new(),
            tensors: vec![
                tensor("attn_norm", vec![64], 0, 128),
                tensor("attn_q", vec![128, 64], 4096, 16384),
                tensor("attn_k", vec![128, 64], 4096 + 16384, 16384),
                tensor("some_table", vec![128, 64], 4096 + 2 * 16384, 16384),
            ],
        };
        // Half the rows: 64 of 128, 8 KiB of each matmul weight on the helper.
        assert_eq!(
            primary_ranges(&blob, 0.5),
            [
                (0, 128),
                (4096 + 8192, 8192),
                // attn_k's second half runs on into the whole table after it.
                (4096 + 16384 + 8192, 8192 + 16384),
            ]
        );
        // No share: every tensor whole, adjacent ones merged.
        assert_eq!(primary_ranges(&blob, 0.0), [(0, 128), (4096, 3 * 16384)]);
        // All of it: the matmul weights are gone, the rest stays.
        assert_eq!(
            primary_ranges(&blob, 1.0),
            [(0, 128), (4096 + 2 * 16384, 16384)]
        );
    }

    #[test]
    fn write_columns_writes_and_adds_into_its_columns_only() {
        let be = CpuBackend::new();
        let src = vec![1.0, 2.0, 3.0, 4.0]; // [2, 2]
        let mut dst = vec![10.0; 8]; // [2, 4]
        let at = |col0, into| ColumnPlacement {
            rows: 2,
            src_cols: 2,
            dst_cols: 4,
            col0,
            into,
        };
        let buffer = ColumnSource::Buffer;
        be.write_columns(buffer(&src), &mut dst, at(1, NormInto::Write))
            .unwrap();
        assert_eq!(dst, [10.0, 1.0, 2.0, 10.0, 10.0, 3.0, 4.0, 10.0]);
        be.write_columns(buffer(&src), &mut dst, at(2, NormInto::Add))
            .unwrap();
        assert_eq!(dst, [10.0, 1.0, 3.0, 12.0, 10.0, 3.0, 7.0, 14.0]);
        let err = be
            .write_columns(buffer(&src), &mut dst, at(3, NormInto::Write))
            .unwrap_err();
        assert!(err.to_string().contains("columns 3..5"), "{err}");
        // From host values: the same, for a host backend in place.
        let host = ColumnSource::Host;
        be.write_columns(host(&src), &mut dst, at(0, NormInto::Add))
            .unwrap();
        assert_eq!(dst, [11.0, 3.0, 3.0, 12.0, 13.0, 7.0, 7.0, 14.0]);
        let err = be
            .write_columns(host(&src[..3]), &mut dst, at(0, NormInto::Write))
            .unwrap_err();
        assert!(err.to_string().contains("buffers of 3"), "{err}");
    }
}
