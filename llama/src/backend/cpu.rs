//! The CPU backend: rayon across output rows (matmul) or (position, head) pairs (attention),
//! the vectorised inner loops of `kernels.rs`, `int8.rs` and `kquants.rs`, f32 accumulation.
//!
//! Two modes for the matmul rows:
//! - default: q4_0, q4_1 and q8_0 weights meet the activations quantized to 8 bits per 32
//!   values (`int8.rs`, as llama.cpp does): integer dot products, at the cost of the
//!   activations' rounding (`|x − x̂| ≤ max|x|/254` per 32 values; on SmolLM2 the logits move
//!   by up to a few tenths of logits near 30, see `tests/smollm2.rs`). On CPUs with AVX2, the
//!   matrices of resident weights are copied once into an interleaved layout (`repack`: eight
//!   rows per group, block by block; sixteen with AVX-512 VNNI, `vnni16`) and every row, decode
//!   or prompt, goes a group of weight rows at a time through `int8::gemm8_packed` (or
//!   `vnni16::gemm16`); weights that may move (streamed) keep their stored layout: decode rows
//!   (batches of fewer than `kernels::DECODE_ONCE_MIN_ROWS` rows) row by row (`int8::dot_rows`),
//!   a prompt's rows eight weight rows at a time (`int8::gemm8`).
//! - exact ([`CpuBackend::exact`], `--cpu-exact`): f32 activations for those dtypes
//!   (`kernels.rs`), which the SmolLM2 golden tests compare with the float reference.
//!
//! In both, f32/f16/bf16 weights take f32 activations and the k-quant-era dtypes 8-bit ones for
//! decode rows (`kquants.rs`; resident q5_0, q4_k and q6_k on AVX-512 VNNI through `vnni16`'s
//! sixteen-row copies, resident q5_0 elsewhere with AVX2 through `int8::gemm8_packed`'s
//! eight-row ones). In the default mode a prompt's rows of those dtypes take 8-bit activations
//! too (as llama.cpp's q8_K activations), through the same kernels as a decode row or, for the
//! super-block dtypes with AVX2, four rows at a time through `kquants::dot4` (the same bits as
//! one row), so that a row of a prompt is bit for bit that row alone; in the exact mode a
//! k-quant prompt's rows decode each weight row once to f32.
//!
//! Threads: the parallel regions (matmul row chunks, attention heads, a prompt's element-wise
//! work) run on `pool`: workers that spin between a decode step's microsecond-long regions
//! instead of sleeping, the calling thread taking tasks too (`GDSLLM_CPU_POOL=rayon` for rayon's
//! pool); the thread count is rayon's global pool's ([`CpuBackend::adopt_current_thread`],
//! `--cpu-threads`). Element-wise work (norms, RoPE, activations, the residual sums, the
//! quantizing of activations) is split over the threads only when it is a prompt's size.
//! A prompt's attention takes sixteen rows of one head a task (`kernels::attend_lanes`), a
//! decode row one (row, head) pair; both give the same bits. `GDSLLM_CPU_PROFILE=1` logs where
//! each pass's time went (`profile`).

mod pool;
mod profile;
mod repack;

use std::borrow::Cow;
use std::sync::Arc;

use weights_format::DType;

use self::profile::Op;
use self::repack::{Packing, RepackCache};

use super::kernels::{self, QK, RowsOperands};
use super::kquants::{self, QuantizedActs};
use super::{
    AttentionParams, AttentionSeq, AttentionShape, Backend, BackendError, NormInto, PassInfo,
    RowGroup, WeightView, check_cache_slots, check_store_slots, host_bytes,
};
use super::{int8, vnni16};

/// The CPU backend's parallel regions (`pool`), for the kernels' modules beside it.
pub(super) use self::pool::for_each as for_each_task;

/// Multi-threaded CPU backend (its threads: `pool`).
#[derive(Debug, Default)]
pub struct CpuBackend {
    /// f32 activations for q4_0/q4_1/q8_0 rows (see the module doc).
    exact: bool,
    /// Interleaved copies of the q4_0/q4_1/q8_0 matrices the default mode reads (`repack`).
    repacked: RepackCache,
}

/// A clone starts without the original's repacked copies (they are known by address, which
/// only names the same weight within one model's lifetime).
impl Clone for CpuBackend {
    fn clone(&self) -> CpuBackend {
        CpuBackend::with_exact(self.exact)
    }
}

impl CpuBackend {
    /// The default mode: 8-bit activations for q4_0/q4_1/q8_0 decode rows.
    pub fn new() -> CpuBackend {
        CpuBackend::with_exact(false)
    }

    /// The exact mode: f32 activations for q4_0/q4_1/q8_0 decode rows.
    pub fn exact() -> CpuBackend {
        CpuBackend::with_exact(true)
    }

    /// [`CpuBackend::exact`] when `exact`, else [`CpuBackend::new`].
    pub fn with_exact(exact: bool) -> CpuBackend {
        CpuBackend {
            exact,
            repacked: RepackCache::default(),
        }
    }

    /// Whether q4_0/q4_1/q8_0 decode rows take f32 activations.
    pub fn is_exact(&self) -> bool {
        self.exact
    }

    /// Makes the calling thread worker 0 of rayon's global pool (`threads` workers in all, else
    /// rayon's default: `RAYON_NUM_THREADS` or one per core). Call it once, early, on the thread
    /// that will run the model's passes, before anything else uses rayon.
    ///
    /// Why: a parallel region started from a thread outside the pool is queued to the pool and
    /// the caller sleeps until a worker has finished it, so each of a decode step's ~150 matmul
    /// and attention regions paid a wake-up of a worker and one of the caller (a tenth of a
    /// decode step in `perf` with a pool of one worker; the caller's own core sat idle too).
    /// From a worker the region runs at once, the caller taking its share while idle workers
    /// steal the rest. (The parallel regions now run on `pool`'s spinning workers, whose caller
    /// takes tasks from any thread; this still sizes them, and matters for
    /// `GDSLLM_CPU_POOL=rayon` and the work left on rayon.)
    ///
    /// Returns whether the pool was set up here: not for a single thread (that thread would
    /// be the pool's only worker, and a parallel region another thread started would wait
    /// until this one next entered rayon), nor when rayon's global pool already existed
    /// (passes then run as before, only slower).
    pub fn adopt_current_thread(threads: Option<usize>) -> bool {
        let from_env = || {
            let n: usize = std::env::var("RAYON_NUM_THREADS").ok()?.parse().ok()?;
            (n > 0).then_some(n)
        };
        let n = threads
            .or_else(from_env)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if n < 2 {
            return false;
        }
        let builder = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .use_current_thread();
        match builder.build_global() {
            Ok(()) => true,
            Err(err) => {
                tracing::debug!("the CPU backend keeps rayon's existing global pool: {err}");
                false
            }
        }
    }

    /// The threads the CPU backend's parallel regions are shared among (the caller included):
    /// as many as rayon's global pool has.
    pub fn threads() -> usize {
        pool::threads()
    }

    /// Whether every row of a matmul of `dtype` (a prompt's too) takes 8-bit activations and
    /// `int8::gemm8`.
    fn gemm8(&self, dtype: DType) -> bool {
        !self.exact && int8::handles(dtype) && int8::has_gemm8()
    }

    /// Whether rows of `dtype` dotted from the blocks read 8-bit activations.
    fn quantizes(&self, dtype: DType) -> bool {
        kquants::handles(dtype) || (!self.exact && int8::handles(dtype))
    }

    /// The interleaved layout the 8-bit rows of `dtype` read, where its weights are resident
    /// (see `repack`): on AVX-512 VNNI the sixteen-row one for q4_0/q4_1/q8_0 (not in the
    /// exact mode) and for q5_0/q4_k/q6_k (8-bit activations in both modes), else with AVX2
    /// the eight-row one for q4_0/q4_1/q8_0 (not in the exact mode) and q5_0 (both modes).
    ///
    /// Why q5_0 too: its one-row kernel spends ~25 instructions on a 22-byte block (a software
    /// f16 scale, the fifth bits, a horizontal sum a row), so on a 2-core AVX2 machine Gemma 3
    /// 270M's q5_0 matrices (a sixth of its bytes) took as long a decode step as its q8_0
    /// output matrix three times their size.
    fn packing(&self, dtype: DType) -> Option<Packing> {
        let int8_rows = !self.exact && int8::handles(dtype);
        if vnni16::handles(dtype) && (int8_rows || kquants::handles(dtype)) && vnni16::available() {
            Some(Packing::Rows16)
        } else if self.gemm8(dtype) || (dtype == DType::Q5_0 && int8::has_gemm8()) {
            Some(Packing::Rows8)
        } else {
            None
        }
    }

    /// The interleaved copy of `w` (stored bytes `bytes`) that [`packed_rows`] reads, and its
    /// layout, when this backend computes `w`'s 8-bit rows that way (see `repack`).
    fn packed(&self, w: &WeightView<'_>, bytes: &[u8]) -> Option<(Arc<[u8]>, Packing)> {
        let packing = self.packing(w.dtype)?;
        Some((self.repacked.get(w, bytes, packing)?, packing))
    }
}

/// `out_t[i·n + (r − first)]` = weight row `i` of `w` (in the interleaved layout `packing`:
/// whole groups of rows, then the rows left over as stored) dotted with activation row `r` of
/// `xq`, for every `r` of `acts_rows` (`n` = its length) but those `skip` (indexed by `r`)
/// marks: the groups through `int8::gemm8_packed` or `vnni16::gemm16`, the rows left over
/// through the row kernels (`int8::dot_rows`, `kquants::dot`). Every activation row gets the
/// same result however many come together.
#[allow(clippy::too_many_arguments)]
fn packed_rows(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    packing: Packing,
    xq: &QuantizedActs,
    acts_rows: std::ops::Range<usize>,
    skip: Option<&[bool]>,
    out_t: &mut [f32],
) {
    let (first, n) = (acts_rows.start, acts_rows.len());
    let columns: Vec<usize> = (0..n)
        .filter(|&c| skip.is_none_or(|s| !s[first + c]))
        .collect();
    if columns.is_empty() {
        return;
    }
    let acts: Vec<_> = columns.iter().map(|&c| xq.row(dtype, first + c)).collect();
    let out = int8::Columns {
        out_t: &mut *out_t,
        stride: n,
        columns: &columns,
    };
    let done = match packing {
        Packing::Rows8 => int8::gemm8_packed(dtype, w, row_bytes, &acts, out),
        Packing::Rows16 => vnni16::gemm16(dtype, w, row_bytes, &acts, out),
    };
    let rest = &w[done * row_bytes..];
    if rest.is_empty() {
        return;
    }
    for (&r, x) in columns.iter().zip(&acts) {
        if int8::handles(dtype) {
            int8::dot_rows(dtype, rest, row_bytes, *x, &mut out_t[done * n + r..], n);
        } else {
            for (i, row) in rest.chunks_exact(row_bytes).enumerate() {
                out_t[(done + i) * n + r] = kquants::dot(dtype, row, *x);
            }
        }
    }
}

/// The weight rows of each task of a matmul of `out_rows` rows (`work_per_row` multiply-adds
/// each), in order: about four tasks a thread so that uneven cores even out, but never so
/// little work a task ([`min_work_per_task`]) that sharing it costs more than the work; when
/// there are more tasks than threads, a whole number of them a thread. Every task starts on a
/// group of sixteen rows (as `vnni16::gemm16` takes them, and so of eight, as `int8::gemm8`
/// does, and as the repacked copies interleave them), and the groups are dealt out evenly: a
/// task has at most one group more than another.
///
/// Why evenly: rounding one task size up to whole groups made fewer tasks than threads asked
/// for (a hybrid split's 1,843 rows on 12 threads: 48 tasks asked, 39 of 48 rows made, the last
/// round of them on 3 threads of 12), so a fifth of the threads idled at the end of each matmul.
fn row_tasks(out_rows: usize, work_per_row: usize) -> Vec<usize> {
    let threads = pool::threads().max(1);
    let total_work = out_rows * work_per_row.max(1);
    let mut tasks = (4 * threads)
        .min(total_work.div_ceil(min_work_per_task()))
        .max(1);
    if tasks > threads {
        tasks = tasks.next_multiple_of(threads);
    }
    let groups = out_rows.div_ceil(16).max(1);
    let tasks = tasks.min(groups);
    (0..tasks)
        .map(|t| {
            let (g0, g1) = (t * groups / tasks, (t + 1) * groups / tasks);
            (g1 * 16).min(out_rows) - g0 * 16
        })
        .collect()
}

/// `v` cut into consecutive pieces of `rows[i] · stride` values, each with its first row.
fn split_rows<'a>(
    mut v: &'a mut [f32],
    rows: &[usize],
    stride: usize,
) -> Vec<(usize, &'a mut [f32])> {
    let mut first = 0;
    let mut pieces = Vec::with_capacity(rows.len());
    for &n in rows {
        let (piece, rest) = std::mem::take(&mut v).split_at_mut(n * stride);
        pieces.push((first, piece));
        v = rest;
        first += n;
    }
    pieces
}

/// Multiply-adds (weight columns × activation rows) a matmul task gets at least: 64 Ki by
/// default, `GDSLLM_CPU_MIN_TASK_WORK=N` to measure others. A small model's matmuls are a few
/// microseconds of work each, and spreading them over every thread costs more in wake-ups than
/// it brings: on the H100 machine's 16 cores a SmolLM2-shaped q4_1 decoded at 257–258 tok/s
/// with 16 Ki, 295–321 with 64 Ki (256 Ki: 229–271); with 8 threads 317 against 336–369.
fn min_work_per_task() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        std::env::var("GDSLLM_CPU_MIN_TASK_WORK")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or(64 * 1024)
    })
}

/// Values of element-wise work below which an op stays on the calling thread: a decode step's
/// norms and activations (a few thousand values) cost less than waking other threads, a
/// prompt's (hundreds of thousands) were serial work that left 16 threads waiting.
const PARALLEL_MIN_VALUES: usize = 32 * 1024;

/// `f(chunk of a, matching chunk of b)` over `a` and `b` (as long as `a`), in parallel when
/// long enough. Chunks are whole multiples of `unit` values.
fn zip_chunks(a: &mut [f32], b: &[f32], unit: usize, f: impl Fn(&mut [f32], &[f32]) + Sync) {
    let unit = unit.max(1);
    if a.len() < PARALLEL_MIN_VALUES {
        f(a, &b[..a.len()]);
        return;
    }
    let chunk = (PARALLEL_MIN_VALUES / 4).div_ceil(unit) * unit;
    let len = a.len();
    let mut tasks: Vec<_> = a.chunks_mut(chunk).zip(b[..len].chunks(chunk)).collect();
    pool::for_each(&mut tasks, |(a, b)| f(a, b));
}

/// A gated unit: `unit(gate, up)` over the first `len` values (`kernels::swiglu`, `geglu`).
fn gated(gate: &mut [f32], up: &[f32], len: usize, unit: impl Fn(&mut [f32], &[f32]) + Sync) {
    zip_chunks(&mut gate[..len], &up[..len], 1, unit);
}

/// `rows` rows of `weight.cols` values of `x`, each RMS-normalised and multiplied by the
/// weight, handed to `store(normed value, output slot)`.
fn rmsnorm_rows(
    x: &[f32],
    rows: usize,
    weight: WeightView<'_>,
    eps: f32,
    out: &mut [f32],
    store: impl Fn(f32, &mut f32) + Sync,
) -> Result<(), BackendError> {
    let dim = weight.cols;
    let mut w = vec![0f32; dim];
    kernels::dequantize_row(weight.dtype, host(&weight)?, &mut w);
    zip_chunks(&mut out[..rows * dim], &x[..rows * dim], dim, |out, x| {
        for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            let ss = kernels::dot(xr, xr);
            let scale = 1.0 / (ss / dim as f32 + eps).sqrt();
            for ((o, xv), wv) in or.iter_mut().zip(xr).zip(&w) {
                store(xv * scale * wv, o);
            }
        }
    });
    Ok(())
}

/// What one weight of [`matmul_rows_of`]'s group reads, and how its rows are cut into tasks.
struct WeightPlan<'w> {
    w: WeightView<'w>,
    stored: &'w [u8],
    packed: Option<(Arc<[u8]>, Packing)>,
    /// The exact mode's k-quant split: wide rows from the stored rows, the others packed.
    split: bool,
    /// Per-block sums of the activation rows, where the f32-activation q4_0/q4_1 rows need them.
    xsums: Vec<f32>,
    /// Weight rows of each task ([`row_tasks`]).
    sizes: Vec<usize>,
    /// Whether every row reads the packed copy (such weights may split the activation rows).
    all_rows_packed: bool,
    /// The kernel each activation row takes on the stored rows ([`kernels::matmul_rows`]'s
    /// `wide`): the caller's choice, or every row narrow (see [`matmul_rows_of`]).
    row_kernels: Cow<'w, [bool]>,
    /// Activation rows of each span (see [`activation_span_rows`]).
    per_span: usize,
}

impl WeightPlan<'_> {
    /// The activation rows of the span that row `r` is in.
    fn span_of(&self, r: usize, rows: usize) -> std::ops::Range<usize> {
        let start = r / self.per_span * self.per_span;
        start..(start + self.per_span).min(rows)
    }
}

/// `outs[i] = x · Wᵢᵀ` for the weights `ws` of one input (a prompt's Q, K and V; gate and up)
/// and the `wide.len()` rows of `x`, each row with the kernel `wide` picks for it (see
/// [`kernels::matmul_rows`]). Every weight's tasks run in one parallel region and their
/// products go back to rows in one more: a region per weight (and a transposition per weight)
/// left the threads a quarter idle on a SmolLM2 prompt, whose K and V are 12 groups of 16 rows
/// each for 16 threads.
fn matmul_rows_of(
    cpu: &CpuBackend,
    x: &[f32],
    wide: &[bool],
    ws: &[WeightView<'_>],
    outs: &mut [&mut Vec<f32>],
    xq: &mut QuantizedActs,
) -> Result<(), BackendError> {
    let int8 = !cpu.exact;
    let rows = wide.len();
    let mut plans = Vec::with_capacity(ws.len());
    for w in ws {
        let stored = host(w)?;
        let packed = cpu.packed(w, stored);
        // In the exact mode the k-quant-era dtypes' wide rows decode the stored rows once to
        // f32 and only their other rows read the packed copy. In the default mode every row of
        // a packed matrix reads it on 8-bit activations, as q4_0/q4_1/q8_0's prompt rows do:
        // decoding each weight row to f32 made a Gemma 3 270M Q4_K_M prompt 0.37x llama.cpp's
        // on 2 cores.
        let split =
            cpu.exact && packed.is_some() && kquants::handles(w.dtype) && wide.contains(&true);
        let k = w.cols;
        let xr = &x[..rows * k];
        let mut xsums = Vec::new();
        if matches!(w.dtype, DType::Q4_0 | DType::Q4_1) && !int8 && wide.contains(&false) {
            let mut one = Vec::new();
            for row in xr.chunks_exact(k) {
                kernels::block_sums(row, &mut one);
                xsums.extend_from_slice(&one);
            }
        }
        let all_rows_packed = packed.is_some() && !split;
        // The k-quant-era dtypes without a packed copy (q5_1, q2_k, q3_k, q5_k everywhere;
        // q5_0, q4_k, q6_k on a CPU without AVX-512 VNNI) keep the packed copy's rule in the
        // default mode: every row on the 8-bit activations, so that a prompt's rows are bit
        // for bit the rows alone. (Their wide rows decoded to f32 made a q5_0 prompt's rows
        // differ from the rows alone by up to 1 % on an AVX2 machine.)
        let all_narrow = !cpu.exact && packed.is_none() && kquants::handles(w.dtype);
        let row_kernels = if all_narrow && wide.contains(&true) {
            Cow::Owned(vec![false; rows])
        } else {
            Cow::Borrowed(wide)
        };
        if cpu.quantizes(w.dtype)
            && (row_kernels.contains(&false) || cpu.gemm8(w.dtype) || all_rows_packed)
        {
            xq.prepare(xr, k, w.dtype);
        }
        debug_assert_eq!(k % QK.min(w.dtype.block_len().max(1)), 0);
        plans.push(WeightPlan {
            w: *w,
            stored,
            sizes: row_tasks(w.rows, k * rows),
            packed,
            split,
            xsums,
            all_rows_packed,
            row_kernels,
            per_span: rows.max(1),
        });
    }
    // The all-packed weights split the activation rows as well when the group's weight-row
    // tasks alone are too few for the threads (see `activation_span_rows`).
    let weight_tasks = plans.iter().map(|p| p.sizes.len()).sum();
    let shared_span = activation_span_rows(weight_tasks, rows, true);
    for p in plans.iter_mut().filter(|p| p.all_rows_packed) {
        p.per_span = shared_span;
    }
    let xq: &QuantizedActs = xq;
    // A task: weight rows from `first` of plan `p` against the activation rows `acts`, into
    // `o` ([its weight rows, acts.len()]). Only the all-packed path splits the activation rows.
    let task = |p: &WeightPlan<'_>, first: usize, acts: std::ops::Range<usize>, o: &mut [f32]| {
        let (w, k) = (p.w, p.w.cols);
        let row_bytes = w.row_bytes();
        let n_rows = o.len() / acts.len();
        let range = first * row_bytes..(first + n_rows) * row_bytes;
        let ops = |wb| RowsOperands {
            dtype: w.dtype,
            w: wb,
            row_bytes,
            cols: k,
            x: &x[..rows * k],
            xsums: &p.xsums,
            xq,
            int8,
        };
        match &p.packed {
            Some((bytes, packing)) if !p.split => packed_rows(
                w.dtype,
                &bytes[range],
                row_bytes,
                *packing,
                xq,
                acts,
                None,
                o,
            ),
            Some((bytes, packing)) => {
                kernels::matmul_rows(ops(&p.stored[range.clone()]), wide, false, o);
                let wb = &bytes[range];
                packed_rows(w.dtype, wb, row_bytes, *packing, xq, 0..rows, Some(wide), o);
            }
            None => kernels::matmul_rows(ops(&p.stored[range]), &p.row_kernels, true, o),
        }
    };
    // A decode row: every weight's row tasks in one region, straight into the outputs.
    if rows == 1 {
        let mut tasks = Vec::new();
        for (i, (p, out)) in plans.iter().zip(outs.iter_mut()).enumerate() {
            for (first, o) in split_rows(&mut out[..p.w.rows], &p.sizes, 1) {
                tasks.push((i, first, o));
            }
        }
        pool::for_each(&mut tasks, |(i, first, o)| {
            task(&plans[*i], *first, 0..1, o)
        });
        return Ok(());
    }
    // Each task owns whole weight rows of one span of activation rows, so it writes a
    // transposed [m, span] block; a weight's spans' blocks lie one after the other in its
    // part of `products`, the weights' parts one after the other.
    let total: usize = plans.iter().map(|p| p.w.rows * rows).sum();
    let mut products = PRODUCTS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    if products.len() < total {
        products.resize(total, 0.0);
    }
    let mut parts: Vec<&mut [f32]> = Vec::with_capacity(plans.len());
    let mut rest = &mut products[..total];
    for p in &plans {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(p.w.rows * rows);
        parts.push(part);
        rest = tail;
    }
    let mut tasks = Vec::new();
    for (i, (p, part)) in plans.iter().zip(parts.iter_mut()).enumerate() {
        let m = p.w.rows;
        let mut rest = &mut part[..];
        for start in (0..rows).step_by(p.per_span) {
            let span = p.span_of(start, rows);
            let (block, tail) = std::mem::take(&mut rest).split_at_mut(m * span.len());
            rest = tail;
            for (first, o) in split_rows(block, &p.sizes, span.len()) {
                tasks.push((i, first, span.clone(), o));
            }
        }
    }
    pool::for_each(&mut tasks, |(i, first, acts, o)| {
        task(&plans[*i], *first, acts.clone(), o)
    });
    drop(tasks);
    // Back to [rows, m], eight output rows a task: for each weight row the eight values lie
    // side by side in the spans' blocks (one cache line), where a task of one output row read
    // each value from a line of its own (a tenth of a 512-token prompt's time on one thread).
    const ROWS_PER_TASK: usize = 8;
    let mut back = Vec::new();
    for (i, (p, out)) in plans.iter().zip(outs.iter_mut()).enumerate() {
        let m = p.w.rows;
        for (t, o) in out[..rows * m].chunks_mut(ROWS_PER_TASK * m).enumerate() {
            back.push((i, t * ROWS_PER_TASK, o));
        }
    }
    let parts: Vec<&[f32]> = parts.into_iter().map(|p| &*p).collect();
    pool::for_each(&mut back, |(i, r0, o)| {
        let (p, part) = (&plans[*i], parts[*i]);
        let m = p.w.rows;
        // Each output row's block, its column there, and the block's width.
        let sources: Vec<(&[f32], usize, usize)> = (*r0..*r0 + o.len() / m)
            .map(|r| {
                let span = p.span_of(r, rows);
                (
                    &part[m * span.start..m * span.end],
                    r - span.start,
                    span.len(),
                )
            })
            .collect();
        // Each output row written whole (strided reads, contiguous writes), over a tile of
        // weight rows whose source lines stay in L1 for the task's eight output rows: the
        // element-by-element loop over (weight row, output row), bounds-checked twice an
        // element, was 12 % of a Gemma 3 270M prompt on two AVX2 cores.
        const TILE: usize = 256;
        for i0 in (0..m).step_by(TILE) {
            let i1 = (i0 + TILE).min(m);
            for (j, (block, c, n)) in sources.iter().enumerate() {
                let src = block[i0 * n + c..].iter().step_by(*n);
                for (d, v) in o[j * m + i0..j * m + i1].iter_mut().zip(src) {
                    *d = *v;
                }
            }
        }
    });
    drop(parts);
    // Kept up to 16 MB (a LM head over a long prompt's rows is not worth holding on to).
    if products.len() <= 4 << 20 {
        PRODUCTS.with(|p| *p.borrow_mut() = products);
    }
    Ok(())
}

/// The activation rows of each span (the last may have fewer) a prompt's matmul of
/// `weight_tasks` weight-row tasks is split into: one span of all `rows` unless `split` (the all-packed path) and the weight tasks alone are too
/// few to keep every thread busy. Why: a small model's prompt matmul is tens of microseconds on
/// 16 threads, and a SmolLM2 576-row matrix makes 36 tasks of 16 rows (whole groups for
/// `vnni16`): 2.25 a thread, so a third of the threads idle for a third of the region.
/// Splitting the prompt's rows as well (each task then reads its weight rows again, from
/// cache) gives about four tasks a thread, a whole number of them where the rows allow.
fn activation_span_rows(weight_tasks: usize, rows: usize, split: bool) -> usize {
    let threads = pool::threads();
    // Activation rows a span keeps at least: the packed kernels take them four at a time.
    const MIN_SPAN: usize = 8;
    if !split || threads < 2 || rows < 2 * MIN_SPAN || weight_tasks >= 8 * threads {
        return rows.max(1);
    }
    let mut spans = (4 * threads)
        .div_ceil(weight_tasks)
        .min(rows / MIN_SPAN)
        .max(1);
    // A whole number of tasks a thread where the rows allow it.
    while spans < rows / MIN_SPAN && !(spans * weight_tasks).is_multiple_of(threads) {
        spans += 1;
    }
    rows.div_ceil(spans)
}

fn host<'a>(w: &WeightView<'a>) -> Result<&'a [u8], BackendError> {
    host_bytes(w, "cpu")
}

/// The cosines and sines of rotary position `pos0 + r` for each of `rows` rows, `[rows,
/// inv_freq.len()]` each: computed once for a pass's Q and K (each computed them, and a
/// prompt's K, too short to be split among the threads, took its 4,096 sines and cosines a
/// layer on one thread: most of a 128-token prompt's serial time on 16 threads).
fn rope_angles(rows: usize, pos0: usize, inv_freq: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let (mut cos, mut sin) = (vec![0f32; rows * half], vec![0f32; rows * half]);
    let fill = |r0: usize, cos: &mut [f32], sin: &mut [f32]| {
        for (r, (c, s)) in cos
            .chunks_exact_mut(half)
            .zip(sin.chunks_exact_mut(half))
            .enumerate()
        {
            let pos = (pos0 + r0 + r) as f32;
            for i in 0..half {
                let angle = pos * inv_freq[i];
                c[i] = angle.cos();
                s[i] = angle.sin();
            }
        }
    };
    // Sines and cosines cost ~20 ns each: worth splitting from a few thousand.
    const ROWS_PER_TASK: usize = 16;
    if half == 0 || rows * half < 4096 {
        fill(0, &mut cos, &mut sin);
        return (cos, sin);
    }
    let chunk = ROWS_PER_TASK * half;
    let mut tasks: Vec<_> = cos
        .chunks_mut(chunk)
        .zip(sin.chunks_mut(chunk))
        .enumerate()
        .collect();
    pool::for_each(&mut tasks, |(t, (c, s))| fill(*t * ROWS_PER_TASK, c, s));
    (cos, sin)
}

/// Rotary embedding of whole rows of `width` values with the angles of [`rope_angles`] (rows
/// in parallel when there are many).
fn rope_rows(x: &mut [f32], width: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    let rotate = |x: &mut [f32], cos: &[f32], sin: &[f32]| {
        for ((xr, cos), sin) in x
            .chunks_exact_mut(width)
            .zip(cos.chunks_exact(half))
            .zip(sin.chunks_exact(half))
        {
            for head in xr.chunks_exact_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        }
    };
    if x.len() >= PARALLEL_MIN_VALUES && x.len() >= 2 * width {
        let rows_per_task = (PARALLEL_MIN_VALUES / 4).div_ceil(width);
        let mut tasks: Vec<_> = x
            .chunks_mut(rows_per_task * width)
            .zip(
                cos.chunks(rows_per_task * half)
                    .zip(sin.chunks(rows_per_task * half)),
            )
            .collect();
        pool::for_each(&mut tasks, |(part, (cos, sin))| rotate(part, cos, sin));
        return;
    }
    rotate(x, cos, sin);
}

thread_local! {
    /// A prompt matmul's products in the transposed layout its tasks write (every value is
    /// written before it is read), kept between calls: allocating and zeroing them each time
    /// (up to 0.8 MB for a SmolLM2 prompt of 128 tokens) was serial time on 16 threads.
    static PRODUCTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl CpuBackend {
    /// Several matmuls of the same input, as one parallel region (a prompt's: and one more that
    /// puts their products back in rows).
    fn matmul_many(
        &self,
        x: &[f32],
        rows: usize,
        ws: &[WeightView<'_>],
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), BackendError> {
        // A decode row (one row) takes the one-row kernels, a prompt's rows the wide ones.
        let wide = vec![rows >= kernels::DECODE_ONCE_MIN_ROWS; rows];
        matmul_rows_of(self, x, &wide, ws, outs, &mut QuantizedActs::default())
    }
}

/// A task of [`CpuBackend::attention_batch`]'s parallel region.
enum AttentionTask<'o> {
    /// One (row, head) pair: `idx = row · n_heads + head`.
    Pair { idx: usize, out: &'o mut [f32] },
    /// Consecutive rows `rows` of sequence `seq` (indices within it), one head.
    Rows {
        seq: usize,
        head: usize,
        rows: std::ops::Range<usize>,
        outs: Vec<&'o mut [f32]>,
    },
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type KvBuf = Vec<f32>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; len])
    }

    fn alloc_kv(&self, len: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; len])
    }

    fn kv_value_bytes(&self) -> usize {
        4
    }

    fn copy_kv(
        &self,
        src: &Vec<f32>,
        dst: &mut Vec<f32>,
        values: usize,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Other);
        dst[..values].copy_from_slice(&src[..values]);
        Ok(())
    }

    /// Remembers whether the weights stay where they are, which decides whether the matmuls
    /// may read repacked copies of them (see `repack`).
    fn begin_pass(&self, pass: &PassInfo) -> Result<(), BackendError> {
        profile::begin_pass();
        self.repacked.begin_pass(pass.weights_stable);
        Ok(())
    }

    /// Logs where the pass's time went with `GDSLLM_CPU_PROFILE=1` (`profile`).
    fn end_pass(&self, ran: bool) -> Result<(), BackendError> {
        if ran {
            profile::end_pass(pool::threads());
        }
        Ok(())
    }

    fn uniform_rows_from(&self) -> usize {
        kernels::DECODE_ONCE_MIN_ROWS
    }

    fn upload(&self, values: &[f32]) -> Result<Vec<f32>, BackendError> {
        Ok(values.to_vec())
    }

    fn read(&self, buf: &Vec<f32>, out: &mut [f32]) -> Result<(), BackendError> {
        out.copy_from_slice(&buf[..out.len()]);
        Ok(())
    }

    fn argmax_rows(
        &self,
        logits: &Vec<f32>,
        cols: usize,
        out: &mut [u32],
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Logits);
        if cols == 0 {
            out.fill(0);
            return Ok(());
        }
        // The rows where they are, without the copy of the default.
        for (id, row) in out.iter_mut().zip(logits.chunks_exact(cols)) {
            *id = crate::sampling::argmax(row);
        }
        Ok(())
    }

    fn embed_rows(
        &self,
        table: WeightView<'_>,
        ids: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Embed);
        let (bytes, dim, rb) = (host(&table)?, table.cols, table.row_bytes());
        for (o, &id) in out.chunks_exact_mut(dim).zip(ids) {
            let id = id as usize;
            kernels::dequantize_row(table.dtype, &bytes[id * rb..(id + 1) * rb], o);
        }
        Ok(())
    }

    /// The rows are in host memory already: decoded like any table.
    fn embed_host_rows(
        &self,
        rows: WeightView<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let ids: Vec<u32> = (0..rows.rows as u32).collect();
        self.embed_rows(rows, &ids, out)
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &mut Vec<f32>,
        into: NormInto,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Norm);
        match into {
            NormInto::Write => rmsnorm_rows(x, rows, weight, eps, out, |v, o| *o = v),
            NormInto::Add => rmsnorm_rows(x, rows, weight, eps, out, |v, o| *o += v),
        }
    }

    fn matmul_batch(
        &self,
        x: &Vec<f32>,
        groups: &[RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Matmul);
        let rows: usize = groups.iter().map(|g| g.rows).sum();
        let wide: Vec<bool> = groups
            .iter()
            .flat_map(|g| std::iter::repeat_n(g.solo_rows >= kernels::DECODE_ONCE_MIN_ROWS, g.rows))
            .collect();
        // When every row would use the kernel that `rows` rows get anyway, this is an ordinary
        // matmul (a single sequence, or a batch of decode rows below the threshold).
        if wide
            .iter()
            .all(|&w| w == (rows >= kernels::DECODE_ONCE_MIN_ROWS))
        {
            return self.matmul_many(x, rows, ws, outs);
        }
        matmul_rows_of(self, x, &wide, ws, outs, &mut QuantizedActs::default())
    }

    /// The product into `scratch`, then added to `out` (a prompt's rows by the threads).
    fn matmul_add_batch(
        &self,
        x: &Vec<f32>,
        groups: &[RowGroup],
        w: WeightView<'_>,
        scratch: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Add);
        let rows: usize = groups.iter().map(|g| g.rows).sum();
        self.matmul_batch(x, groups, &[w], &mut [&mut *scratch])?;
        let len = rows * w.rows;
        zip_chunks(&mut out[..len], &scratch[..len], 1, |o, s| {
            for (a, b) in o.iter_mut().zip(s) {
                *a += b;
            }
        });
        Ok(())
    }

    fn rope_store_kv(
        &self,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &Vec<f32>,
        row0: usize,
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        inv_freq: &Vec<f32>,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::RopeStore);
        let (hd, q_dim, kv_dim) = (
            shape.head_dim,
            shape.n_heads * shape.head_dim,
            shape.n_kv_heads * shape.head_dim,
        );
        let rows_of = |width: usize| row0 * width..(row0 + rows) * width;
        let (cos, sin) = rope_angles(rows, pos0, &inv_freq[..hd / 2]);
        rope_rows(&mut q[rows_of(q_dim)], q_dim, hd, &cos, &sin);
        rope_rows(&mut k[rows_of(kv_dim)], kv_dim, hd, &cos, &sin);
        let slots = k_cache.len() / kv_dim;
        check_store_slots(slots, rows)?;
        // A prompt's rows stored by the threads, eight a task, when their slots do not wrap:
        // its first writes to a new cache fault its pages in (on the GPU machine 250 µs a
        // layer for 128 SmolLM2 rows, 13 % of the prompt's pass on 16 threads, on one thread).
        const ROWS_PER_TASK: usize = 8;
        let first = pos0 % slots;
        if rows >= 2 * ROWS_PER_TASK && first + rows <= slots {
            let (at, src) = (first * kv_dim..(first + rows) * kv_dim, rows_of(kv_dim));
            let chunk = ROWS_PER_TASK * kv_dim;
            let mut tasks: Vec<_> = k_cache[at.clone()]
                .chunks_mut(chunk)
                .zip(v_cache[at].chunks_mut(chunk))
                .zip(k[src.clone()].chunks(chunk).zip(v[src].chunks(chunk)))
                .collect();
            pool::for_each(&mut tasks, |((kc, vc), (kr, vr))| {
                kc.copy_from_slice(kr);
                vc.copy_from_slice(vr);
            });
            return Ok(());
        }
        for r in 0..rows {
            let at = (pos0 + r) % slots * kv_dim..((pos0 + r) % slots + 1) * kv_dim;
            let src = (row0 + r) * kv_dim..(row0 + r + 1) * kv_dim;
            k_cache[at.clone()].copy_from_slice(&k[src.clone()]);
            v_cache[at].copy_from_slice(&v[src]);
        }
        Ok(())
    }

    fn attention_batch(
        &self,
        q: &Vec<f32>,
        seqs: &[AttentionSeq<'_, Vec<f32>>],
        shape: AttentionShape,
        params: AttentionParams,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Attention);
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        let group = n_heads / n_kv_heads;
        let kv_width = n_kv_heads * head_dim;
        let scale = params.scale;
        for s in seqs {
            check_cache_slots(s.k_cache.len() / kv_width, s.pos0, s.rows, params)?;
        }
        // The sequence of each query row, so that one parallel region covers every (row, head)
        // pair of the batch; each pair is computed exactly as it is for a sequence alone.
        let rows = seqs.iter().map(|s| s.row0 + s.rows).max().unwrap_or(0);
        let mut row_seq = vec![usize::MAX; rows];
        for (i, s) in seqs.iter().enumerate() {
            row_seq[s.row0..s.row0 + s.rows].fill(i);
        }
        // A sequence's prompt rows go through `attend_lanes` up to 16 rows of one head at a
        // time (the same bits as `attend` a row at a time, so which path a row takes changes
        // nothing); a decode row, and any row when the head's values are not whole groups of
        // 16, through `attend`.
        let lanes = kernels::ATTEND_LANES;
        let tiled = |s: &AttentionSeq<'_, Vec<f32>>| {
            s.rows >= 2 && head_dim.is_multiple_of(16) && kernels::attend_lanes_fast()
        };
        let mut pieces: Vec<Option<&mut [f32]>> = out[..rows * n_heads * head_dim]
            .chunks_mut(head_dim)
            .map(Some)
            .collect();
        let mut tasks: Vec<AttentionTask<'_>> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if !tiled(s) {
                continue;
            }
            for h in 0..n_heads {
                for r0 in (0..s.rows).step_by(lanes) {
                    let rows = r0..(r0 + lanes).min(s.rows);
                    let outs = rows
                        .clone()
                        .filter_map(|r| pieces[(s.row0 + r) * n_heads + h].take())
                        .collect();
                    tasks.push(AttentionTask::Rows {
                        seq: i,
                        head: h,
                        rows,
                        outs,
                    });
                }
            }
        }
        for (idx, piece) in pieces.into_iter().enumerate() {
            if let Some(o) = piece {
                tasks.push(AttentionTask::Pair { idx, out: o });
            }
        }
        let key_range = |s: &AttentionSeq<'_, Vec<f32>>, r: usize| {
            let pos = s.pos0 + r;
            params.first_key(pos)..pos + 1
        };
        fn cached<'a>(
            s: &AttentionSeq<'a, Vec<f32>>,
            h: usize,
            (group, kv_width, head_dim): (usize, usize, usize),
        ) -> kernels::CachedHead<'a> {
            kernels::CachedHead {
                k: s.k_cache,
                v: s.v_cache,
                width: kv_width,
                offset: (h / group) * head_dim,
            }
        }
        let dims = (group, kv_width, head_dim);
        pool::for_each_init(
            &mut tasks,
            || (Vec::new(), Vec::new()),
            |(scores, lane_scores), task| match task {
                AttentionTask::Pair { idx, out: o } => {
                    let idx = *idx;
                    let (row, h) = (idx / n_heads, idx % n_heads);
                    let Some(s) = seqs.get(row_seq[row]) else {
                        return;
                    };
                    let qh = &q[idx * head_dim..(idx + 1) * head_dim];
                    let keys = key_range(s, row - s.row0);
                    kernels::attend(qh, cached(s, h, dims), keys, scale, scores, o);
                }
                AttentionTask::Rows {
                    seq,
                    head,
                    rows,
                    outs,
                } => {
                    let (s, h) = (&seqs[*seq], *head);
                    let at = |r: usize| ((s.row0 + r) * n_heads + h) * head_dim;
                    let qs: Vec<&[f32]> =
                        rows.clone().map(|r| &q[at(r)..at(r) + head_dim]).collect();
                    let keys: Vec<_> = rows.clone().map(|r| key_range(s, r)).collect();
                    kernels::attend_lanes(&qs, cached(s, h, dims), &keys, scale, lane_scores, outs);
                }
            },
        );
        Ok(())
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize) -> Result<(), BackendError> {
        let _op = profile::op(Op::Activation);
        gated(gate, up, len, kernels::swiglu);
        Ok(())
    }

    fn geglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize) -> Result<(), BackendError> {
        let _op = profile::op(Op::Activation);
        gated(gate, up, len, kernels::geglu);
        Ok(())
    }

    fn add_bias(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        bias: WeightView<'_>,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Other);
        let mut b = vec![0f32; bias.cols];
        kernels::dequantize_row(bias.dtype, host(&bias)?, &mut b);
        for xr in x[..rows * bias.cols].chunks_exact_mut(bias.cols) {
            for (v, bv) in xr.iter_mut().zip(&b) {
                *v += bv;
            }
        }
        Ok(())
    }

    /// The default's copy without zeroing it first (`alloc` zeroes): this runs for every
    /// layer's Q and K.
    fn rmsnorm_pieces(
        &self,
        x: &mut Vec<f32>,
        pieces: usize,
        weight: WeightView<'_>,
        eps: f32,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Norm);
        let input = x[..pieces * weight.cols].to_vec();
        rmsnorm_rows(&input, pieces, weight, eps, x, |v, o| *o = v)
    }

    fn scale(&self, x: &mut Vec<f32>, len: usize, factor: f32) -> Result<(), BackendError> {
        let _op = profile::op(Op::Other);
        x[..len].iter_mut().for_each(|v| *v *= factor);
        Ok(())
    }

    fn softcap(&self, x: &mut Vec<f32>, len: usize, cap: f32) -> Result<(), BackendError> {
        let _op = profile::op(Op::Other);
        x[..len]
            .iter_mut()
            .for_each(|v| *v = cap * (*v / cap).tanh());
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &Vec<f32>,
        src_row: usize,
        dst: &mut Vec<f32>,
        dst_row: usize,
        rows: usize,
        row_len: usize,
    ) -> Result<(), BackendError> {
        let _op = profile::op(Op::Other);
        dst[dst_row * row_len..(dst_row + rows) * row_len]
            .copy_from_slice(&src[src_row * row_len..(src_row + rows) * row_len]);
        Ok(())
    }
}
