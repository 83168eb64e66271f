//! Matmuls: the kernels of `matmul.cu` for decoding and small batches (they read the stored
//! blocks once at full bandwidth and keep the activations in f32, or for quantized weights in
//! the 16-bit integers of [`super::scratch::X16`]), cuBLAS for prompts.

use cudarc::cublas::sys::cudaDataType;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use weights_format::DType;

use crate::backend::{Activation, BackendError, RowGroup, WeightView};

use super::device::{GemmArgs, blocks, dtype_code, elementwise, kq_kernels};
use super::elementwise::gate_act_code;
use super::weights::device_ptr;
use super::{CudaBackend, CudaBuf};

/// Warps per block (they split the columns), weight rows per block (`MM_WROWS`), input rows
/// per block (`MM_ROWS`) and weights per launch (`MM_MAX_JOBS`) of the matmul kernels (must
/// match `matmul.cu`).
const MM_WARPS: u32 = 4;
const MM_WROWS: u32 = 4;
const MM_ROWS: u32 = 8;
const MM_MAX_JOBS: usize = 3;
/// Gate (and up) rows a block of the gated one-row kernels (`MM_GROWS`).
const MM_GROWS: u32 = MM_WROWS / 2;

/// The weights one matmul launch multiplies the same input with: must match `MatmulJobs` in
/// `matmul.cu` (three pointers, three pointers, five ints; 72 bytes with padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MatmulJobs {
    w: [u64; MM_MAX_JOBS],
    out: [u64; MM_MAX_JOBS],
    m: [i32; MM_MAX_JOBS],
    n_jobs: i32,
    accumulate: i32,
}

// SAFETY: plain data with the C layout of the kernel's by-value parameter (`repr(C)`, no
// pointers the host dereferences, every bit pattern valid).
unsafe impl cudarc::driver::DeviceRepr for MatmulJobs {}

impl MatmulJobs {
    /// The parameter of a launch over `jobs` (at most [`MM_MAX_JOBS`] weights and their
    /// outputs' device addresses).
    fn of(jobs: &[(&WeightView<'_>, u64)], accumulate: bool) -> Result<MatmulJobs, BackendError> {
        let mut params = MatmulJobs {
            n_jobs: jobs.len() as i32,
            accumulate: accumulate as i32,
            ..MatmulJobs::default()
        };
        for (i, (w, op)) in jobs.iter().enumerate() {
            params.w[i] = device_ptr(w)?.addr();
            params.out[i] = *op;
            params.m[i] = w.rows as i32;
        }
        Ok(params)
    }
}

/// What a matmul kernel reads as x: f32 rows, or (quantized weights) `quantize_x16`'s
/// integers and block records, by device address.
#[derive(Clone, Copy)]
enum MatmulInput {
    F32(u64),
    Int16 { xq: u64, xs: u64 },
}

/// The fewest rows the k-quant dtypes (q5_0 … iq4_xs) take to the tensor cores: measured on the
/// H100 (synth 7B q4_k, `bench --batch 8`), the eight-row kernel decodes 8 rows at 825 tok/s
/// and `kquants_mma.cu` at 550 (each lane decodes its block's scales per chunk); from 9 rows
/// on the tensor cores win (32 rows: 1,159 against 974).
const MMA_KQUANT_MIN_ROWS: usize = 9;

/// The fewest rows of a decode batch that `dtype`'s matmuls take to the tensor cores (when the
/// `mma` path is on): 2, or [`MMA_KQUANT_MIN_ROWS`] for the dtypes of `kquants_mma.cu`. Fewer
/// rows run the row kernels, whose results are the one-row kernel's bits.
pub fn mma_min_rows(dtype: DType) -> usize {
    if dtype_code(dtype) >= 6 {
        MMA_KQUANT_MIN_ROWS
    } else {
        2
    }
}

/// How many slices the columns of a tensor-core matmul are split into (grid.z): as many as keep
/// the blocks within one wave (`places`: blocks a multiprocessor times multiprocessors), at
/// least 8 chunks of 32 columns per slice, at most `split_max` (`MMA_SPLIT_MAX` of
/// `matmul_mma.cu`, 16 unless a define changes it). Rounding up instead left
/// a second wave of a few blocks (48 tiles: 288 blocks for 264 places), each as long as the
/// first. From the weights' shape and the device alone (not the row count), so that a row's
/// result does not depend on its batch.
fn mma_split(column_tiles: usize, n_chunks: usize, places: usize, split_max: usize) -> usize {
    (places / column_tiles.max(1))
        .min(n_chunks / 8)
        .clamp(1, split_max.max(1))
}

/// Matmuls of at least this many input rows go to cuBLAS (tensor cores; prefill is
/// compute-bound there): f16 weights as they are; bf16 and quantized ones converted to f16 one
/// matrix at a time into a temporary (as llama.cpp does for large batches). bf16 is not fed as
/// bf16 because x would then be rounded to 8 mantissa bits: on a 7B-shaped model that put the
/// prefill logits 3.3e-2 (relative) from the float32 reference, against 5e-3 with f16. Fewer rows —
/// decoding — stay on `matmul_*`, which reads the stored blocks once at full bandwidth and keeps
/// the activations in f32.
pub const CUBLAS_MIN_ROWS: usize = 16;

impl CudaBackend {
    /// `outs[i] (+)= x · ws[i]ᵀ` over the rows of `groups`, accumulating when `accumulate`:
    /// runs of sequences whose solo pass has fewer than [`CUBLAS_MIN_ROWS`] rows (decoding)
    /// share one launch of the matmul kernel, whose result per row does not depend on the row
    /// count; a sequence prefilling a prompt of at least that many rows gets its own cuBLAS
    /// GEMM, as alone.
    pub(super) fn matmul_groups(
        &self,
        x: &CudaBuf,
        groups: &[RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut CudaBuf],
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let Some(cols) = ws.first().map(|w| w.cols) else {
            return Ok(());
        };
        // Several sequences prefilling at once, on weights that cuBLAS takes through a
        // converted copy: each weight is converted once for all of their GEMMs (after the
        // decoding rows' launches) rather than once per sequence. The same GEMMs on the same
        // copies: the same bits.
        let prefills: Vec<(usize, usize)> = groups
            .iter()
            .scan(0, |row0, g| {
                let at = *row0;
                *row0 += g.rows;
                Some((at, g))
            })
            .filter(|(_, g)| g.solo_rows >= CUBLAS_MIN_ROWS && g.rows > 0)
            .map(|(at, g)| (at, g.rows))
            .collect();
        let shared_conversion = prefills.len() >= 2
            && self.queue.has_blas()
            && ws
                .iter()
                .all(|w| !matches!(w.dtype, DType::F16 | DType::F32));
        let mut row0 = 0;
        let mut i = 0;
        while i < groups.len() {
            let kernel_rows = groups[i].solo_rows < CUBLAS_MIN_ROWS;
            let mut rows = 0;
            while i < groups.len() && (groups[i].solo_rows < CUBLAS_MIN_ROWS) == kernel_rows {
                rows += groups[i].rows;
                i += 1;
                if !kernel_rows {
                    break; // one GEMM per prefilling sequence
                }
            }
            if rows > 0 && (kernel_rows || !shared_conversion) {
                let xp = self.addr(x, row0 * cols);
                let jobs: Vec<(&WeightView<'_>, u64)> = ws
                    .iter()
                    .zip(outs.iter())
                    .map(|(w, out)| (w, self.addr(out, row0 * w.rows)))
                    .collect();
                let solo = if kernel_rows { 1 } else { CUBLAS_MIN_ROWS };
                self.matmul_jobs(xp, rows, &jobs, solo, accumulate)?;
            }
            row0 += rows;
        }
        if shared_conversion {
            // Each sequence's x rounded to f16 once, by its first GEMM, for all the weights.
            let mut x_halves: Vec<Option<CudaSlice<u16>>> = prefills.iter().map(|_| None).collect();
            for (w, out) in ws.iter().zip(outs.iter()) {
                let to = if w.dtype == DType::Bf16 {
                    DType::F32
                } else {
                    DType::F16
                };
                let tmp = self.dequantize(w, device_ptr(w)?.addr(), to)?;
                let tp = self.queue.addr(&tmp);
                for (&(at, rows), x_half) in prefills.iter().zip(x_halves.iter_mut()) {
                    let (xp, op) = (self.addr(x, at * cols), self.addr(out, at * w.rows));
                    self.matmul_cublas(xp, rows, w, tp, to, op, accumulate, x_half)?;
                }
                // Freed in stream order, after the GEMMs that read it.
                drop(tmp);
            }
        }
        Ok(())
    }

    /// `out (+)= x · Wᵀ` for each `(W, out)` of `jobs` (weights of the same input, so of the
    /// same column count), `rows` rows at device addresses `xp` and `out`; `solo_rows` is the
    /// row count whose numerics the rows must have (cuBLAS from [`CUBLAS_MIN_ROWS`] on, the
    /// matmul kernels below it). Consecutive weights of one dtype share a kernel launch; the
    /// quantized ones share one conversion of x (`quantize_x16`).
    fn matmul_jobs(
        &self,
        xp: u64,
        rows: usize,
        jobs: &[(&WeightView<'_>, u64)],
        solo_rows: usize,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let Some(&(first, _)) = jobs.first() else {
            return Ok(());
        };
        let blas = self.queue.has_blas() && solo_rows >= CUBLAS_MIN_ROWS;
        let mut x16 = self.x16.lookup(&self.queue, xp, rows * first.cols);
        // x rounded to f16 for cuBLAS, once for all the GEMMs of this input (Q, K and V; gate
        // and up): three conversions of the same rows were 16 % of a 7B prompt pass (ncu).
        let mut x_half = None;
        let mut start = 0;
        while start < jobs.len() {
            let first = jobs[start].0;
            if blas && first.dtype != DType::F32 {
                self.matmul_blas(xp, rows, first, jobs[start].1, accumulate, &mut x_half)?;
                start += 1;
                continue;
            }
            let mut end = start + 1;
            while end < jobs.len()
                && end - start < MM_MAX_JOBS
                && jobs[end].0.dtype == first.dtype
                && !blas
            {
                end += 1;
            }
            let x = if first.dtype.is_quantized() {
                let (xq, xs) = match x16 {
                    Some(q) => q,
                    None => {
                        let q = self.x16.quantize(
                            &self.queue,
                            &self.graphs,
                            &self.kernels,
                            xp,
                            rows * first.cols,
                        )?;
                        x16 = Some(q);
                        q
                    }
                };
                MatmulInput::Int16 { xq, xs }
            } else {
                MatmulInput::F32(xp)
            };
            if self.mma_applies(rows, first) {
                self.launch_mma(x, rows, &jobs[start..end], accumulate)?;
            } else {
                self.launch_matmul(x, rows, &jobs[start..end], accumulate)?;
            }
            start = end;
        }
        Ok(())
    }

    /// Whether `rows` rows (fewer than a prompt's) times `w` go to the tensor-core kernels of
    /// `matmul_mma.cu` (and `kquants_mma.cu`): when that path is on, for two rows or more (one row is the decode
    /// step of a single sequence, which the one-row kernel reads at full bandwidth), on a
    /// device with the instructions, for the dtypes it has kernels for, whole 32-value chunks
    /// and a 16-byte aligned weight (tensors start 4096-aligned; the f16 path loads 16 bytes).
    /// The k-quant dtypes start at more rows ([`mma_min_rows`]).
    fn mma_applies(&self, rows: usize, w: &WeightView<'_>) -> bool {
        let min_rows = mma_min_rows(w.dtype);
        self.paths.mma
            && self.tensor_cores
            && rows >= min_rows
            && w.cols.is_multiple_of(32)
            && self.mma_kernels(w.dtype).is_some()
            && device_ptr(w).is_ok_and(|p| p.addr().is_multiple_of(16))
    }

    /// The tensor-core kernels of `dtype`, if it has them (every dtype but f32: `matmul_mma.cu`
    /// and, for the k-quant-era dtypes, `kquants_mma.cu`; a dtype without them keeps the
    /// one-row and eight-row kernels).
    fn mma_kernels(&self, dtype: DType) -> Option<&[CudaFunction]> {
        self.kernels
            .matmul_mma
            .get(dtype_code(dtype) as usize)
            .and_then(Option::as_ref)
            .map(Vec::as_slice)
    }

    /// One launch of a tensor-core matmul kernel over up to [`MM_MAX_JOBS`] weights of one
    /// dtype (see `matmul_mma.cu`): blocks of `MMA_BROWS` weight rows and up to 8·NT input
    /// rows (the narrowest kernel that takes `rows` in one block, else the widest the dtype
    /// has, and more blocks), the columns split into `split` slices so that the grid fills
    /// the GPU. The split depends on the weights' shape only, so a row's result does not
    /// depend on how many rows share the launch.
    fn launch_mma(
        &self,
        x: MatmulInput,
        rows: usize,
        jobs: &[(&WeightView<'_>, u64)],
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let params = MatmulJobs::of(jobs, accumulate)?;
        let geometry = self.kernels.mma_geometry;
        let blocks_x: usize = jobs
            .iter()
            .map(|(w, _)| w.rows.div_ceil(geometry.rows))
            .sum();
        let m_total: usize = jobs.iter().map(|(w, _)| w.rows).sum();
        let w = jobs[0].0;
        let n_chunks = w.cols / 32;
        let split = mma_split(
            blocks_x,
            n_chunks,
            geometry.blocks_per_sm * self.sms as usize,
            geometry.split_max,
        );
        let kernels = self.mma_kernels(w.dtype).ok_or(BackendError::Unsupported {
            op: "matmul_mma",
            message: format!("no tensor-core matmul for {:?}", w.dtype),
        })?;
        // Kernel v takes 8·2^v rows a block.
        let variant =
            (rows.div_ceil(8).next_power_of_two().trailing_zeros() as usize).min(kernels.len() - 1);
        let blocks_y = rows.div_ceil(8 << variant);
        let partial = if split > 1 {
            self.mma_partials
                .room(&self.queue, &self.graphs, split * rows * m_total)?
        } else {
            0
        };
        // With `slicesum` the slices are summed by a launch of their own (no counters: a null
        // pointer tells the kernel); else the last block of each tile sums them, its counter
        // zeroed when allocated and set back to 0 by that block.
        let sum_apart = split > 1 && self.paths.slicesum;
        let counters = if sum_apart {
            0
        } else {
            self.mma_counters
                .room(&self.queue, &self.graphs, blocks_x * blocks_y)?
        };
        let (x0, xs) = match x {
            MatmulInput::F32(xp) => (xp, 0u64),
            MatmulInput::Int16 { xq, xs } => (xq, xs),
        };
        let (rows_i, k, split_i) = (rows as i32, w.cols as i32, split as i32);
        let mut b = self.queue.kernel(&kernels[variant], "matmul_mma kernel");
        b.arg(&x0)
            .arg(&xs)
            .arg(&rows_i)
            .arg(&k)
            .arg(&params)
            .arg(&partial)
            .arg(&counters)
            .arg(&split_i);
        let cfg = LaunchConfig {
            grid_dim: (blocks_x as u32, blocks_y as u32, split as u32),
            block_dim: (geometry.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds rows·k values (f32 for f16/bf16 weights, else the 16-bit integers and
        // block records of `quantize_x16`), k a multiple of 32 (checked by `mma_applies`); each
        // job's weight has m rows of k values of the shared dtype in device memory and its
        // output rows·m values; the partial sums hold split·rows·Σm values when split > 1 and
        // the counters one per (column tile, row tile) of the grid, zero between launches (the
        // kernel resets them) or null; the grid is the one the kernel expects for these shapes.
        unsafe { b.run(cfg) }?;
        if sum_apart {
            let mut b = self
                .queue
                .kernel(&self.kernels.mma_sum_slices, "matmul_mma slice sum");
            b.arg(&partial).arg(&rows_i).arg(&split_i).arg(&params);
            let cfg = LaunchConfig {
                grid_dim: (m_total.div_ceil(256) as u32, rows as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the partial sums hold split·rows·Σm values, written by the launch just
            // queued before it on the same stream; each job's output holds rows·m values; one
            // thread per (row, column of Σm), those past Σm return.
            unsafe { b.run(cfg) }?;
        }
        Ok(())
    }

    /// One launch of a matmul kernel over up to [`MM_MAX_JOBS`] weights of one dtype.
    fn launch_matmul(
        &self,
        x: MatmulInput,
        rows: usize,
        jobs: &[(&WeightView<'_>, u64)],
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let params = MatmulJobs::of(jobs, accumulate)?;
        let n_blocks: u32 = jobs
            .iter()
            .map(|(w, _)| (w.rows as u32).div_ceil(MM_WROWS))
            .sum();
        let w = jobs[0].0;
        let (rows_i, k) = (rows as i32, w.cols as i32);
        // One input row per block when there is one: the kernel then keeps no accumulators
        // for rows that do not exist.
        let (variant, rows_per_block) = if rows == 1 { (0, 1) } else { (1, MM_ROWS) };
        let (x0, x1) = match x {
            MatmulInput::F32(xp) => (xp, None),
            MatmulInput::Int16 { xq, xs } => (xq, Some(xs)),
        };
        // One-row q6_k decoding takes the super-block kernel on every path: on the H100 it
        // lifted a random 7B Q6_K's tg128 from 0.63× to 0.99× llama.cpp (BENCHMARKS.md), while
        // for q4_k and q5_k, and several rows, it was slower (they stay behind `superblock`).
        let kernel = match (self.paths.superblock || variant == 0, w.dtype) {
            (true, DType::Q6K) => &self.kernels.matmul_superblock[2][variant],
            _ if !self.paths.superblock => {
                &self.kernels.matmul[dtype_code(w.dtype) as usize][variant]
            }
            (_, DType::Q4K) => &self.kernels.matmul_superblock[0][variant],
            (_, DType::Q5K) => &self.kernels.matmul_superblock[1][variant],
            _ => &self.kernels.matmul[dtype_code(w.dtype) as usize][variant],
        };
        let op = if variant == 0 {
            "matmul kernel, 1 row"
        } else {
            "matmul kernel, 8 rows"
        };
        let mut b = self.queue.kernel(kernel, op);
        b.arg(&x0);
        if let Some(xs) = &x1 {
            b.arg(xs);
        }
        b.arg(&rows_i).arg(&k).arg(&params);
        let cfg = blocks(
            (n_blocks, (rows as u32).div_ceil(rows_per_block)),
            MM_WARPS * 32,
        );
        // SAFETY: x holds rows·k values (f32, or for quantized weights the 16-bit integers and
        // block records of `quantize_x16` over them); each job's weight has m rows of k values
        // in whole blocks of the shared dtype (checked when the model resolved its tensors) in
        // device memory, and its output rows·m values; the grid covers ceil(m / MM_WROWS)
        // blocks per job and the rows in groups of the variant's rows per block, as the kernel
        // expects (the `superblock` kernels take q4_k/q5_k/q6_k only, whose rows are whole
        // 256-value super-blocks).
        unsafe { b.run(cfg) }
    }

    /// The one-row gated kernel (`matmul_*_r1_gated`) for weights of `dtype`: f16 and bf16.
    pub(super) fn gated_kernel(&self, dtype: DType) -> Option<&CudaFunction> {
        match dtype {
            DType::F16 => Some(&self.kernels.matmul_gated[0]),
            DType::Bf16 => Some(&self.kernels.matmul_gated[1]),
            _ => None,
        }
    }

    /// `out = act(x · gateᵀ) ⊙ (x · upᵀ)` for one row `x` (at device address `xp`) of weights
    /// of one shape and dtype, in one launch of their [`CudaBackend::gated_kernel`]: the bits of
    /// the one-row matmul of both and `gated_act` after it.
    pub(super) fn matmul_gated_launch(
        &self,
        kernel: &CudaFunction,
        xp: u64,
        gate: WeightView<'_>,
        up: WeightView<'_>,
        act: Activation,
        out: &CudaBuf,
    ) -> Result<(), BackendError> {
        let out_addr = self.addr(out, 0);
        // Jobs 0 and 1: the gate (written) and up (read with it); the kernel writes `out` only.
        let params = MatmulJobs::of(&[(&gate, out_addr), (&up, out_addr)], false)?;
        let (rows, k, act) = (1i32, gate.cols as i32, gate_act_code(act));
        let mut b = self.queue.kernel(kernel, "matmul kernel, 1 row, gated");
        b.arg(&xp).arg(&rows).arg(&k).arg(&params).arg(&act);
        let cfg = blocks(((gate.rows as u32).div_ceil(MM_GROWS), 1), MM_WARPS * 32);
        // SAFETY: x holds k f32 values; gate and up each have gate.rows rows of k values of the
        // kernel's 16-bit dtype in device memory (checked when the model resolved its tensors;
        // the caller checked that their shapes and dtypes agree and took the kernel of that
        // dtype), out holds gate.rows values; the grid covers
        // ceil(rows / MM_GROWS) blocks of MM_GROWS rows of each, as the kernel expects.
        unsafe { b.run(cfg) }
    }

    /// One cuBLAS GEMM: f16 weights as they are, bf16 through an f32 copy, quantized ones
    /// through an f16 copy (see [`CUBLAS_MIN_ROWS`]); `x_half` is x rounded to f16, made by
    /// the first GEMM of this x that needs it.
    fn matmul_blas(
        &self,
        xp: u64,
        rows: usize,
        w: &WeightView<'_>,
        op: u64,
        accumulate: bool,
        x_half: &mut Option<CudaSlice<u16>>,
    ) -> Result<(), BackendError> {
        let wp = device_ptr(w)?.addr();
        let to = match w.dtype {
            DType::F16 => {
                return self.matmul_cublas(xp, rows, w, wp, DType::F16, op, accumulate, x_half);
            }
            DType::Bf16 => DType::F32,
            _ => DType::F16,
        };
        let tmp = self.dequantize(w, wp, to)?;
        let tp = self.queue.addr(&tmp);
        self.matmul_cublas(xp, rows, w, tp, to, op, accumulate, x_half)?;
        // Freed in stream order, after the GEMM that reads it.
        drop(tmp);
        Ok(())
    }

    /// A bf16 or quantized weight matrix as f16 or f32 (`to`), in a temporary (stream-ordered)
    /// allocation of raw bytes.
    fn dequantize(
        &self,
        w: &WeightView<'_>,
        w_ptr: u64,
        to: DType,
    ) -> Result<CudaSlice<u8>, BackendError> {
        let n = w.rows * w.cols;
        // The block dtypes to f16 take a thread per 32-value block (`kq_dequant_f16` for the
        // k-quant-era ones, `dequant_blocks_f16` for q8_0, q4_0 and q4_1), decoding each block
        // once; bf16 (and anything to f32) eight values per thread.
        let legacy_block = matches!(w.dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1);
        let per_block = to == DType::F16 && (legacy_block || kq_kernels(w.dtype));
        let (kernel, elem) = match to {
            DType::F32 => (&self.kernels.dequant_f32, 4),
            _ if per_block && legacy_block => (&self.kernels.dequant_blocks_f16, 2),
            _ if per_block => (&self.kernels.kq_dequant_f16, 2),
            _ => (&self.kernels.dequant_f16, 2),
        };
        // Not zeroed first: that would be one more pass over the matrix.
        // SAFETY: the kernel below writes all n·elem bytes before the GEMM that reads them (and
        // if it fails to launch, the error stops the pass before the GEMM).
        let tmp = unsafe {
            self.queue
                .alloc::<u8>(n * elem, "allocating a converted weight")
        }?;
        let out = self.queue.addr(&tmp);
        let (dtype, n_blocks) = (dtype_code(w.dtype), (n / 32) as u64);
        let mut b = self.queue.kernel(kernel, "dequant kernel");
        b.arg(&w_ptr).arg(&dtype).arg(&n_blocks).arg(&out);
        // SAFETY: the weight holds n_blocks·32 values in whole blocks of its dtype (checked when
        // the model resolved it: rows of 32-value block dtypes are multiples of 32, of
        // super-block dtypes multiples of 256) and `tmp` room for n_blocks·32 values of `to`;
        // 32 values per thread (the per-block kernels) or eight.
        unsafe { b.run(elementwise(if per_block { n / 32 } else { n / 8 })) }?;
        Ok(tmp)
    }

    /// `out[rows, m] (+)= x[rows, k] · W[m, k]ᵀ` with cuBLAS, W of type `w_type` (f16 or f32)
    /// at `w_ptr`: x is rounded to that type (tensor cores take both operands in one type) into
    /// `x_half` unless an earlier GEMM of the same x did, products accumulate in f32.
    #[allow(clippy::too_many_arguments)]
    fn matmul_cublas(
        &self,
        xp: u64,
        rows: usize,
        w: &WeightView<'_>,
        w_ptr: u64,
        w_type: DType,
        op: u64,
        accumulate: bool,
        x_half: &mut Option<CudaSlice<u16>>,
    ) -> Result<(), BackendError> {
        let (m, k) = (w.rows, w.cols);
        let n = rows * k;
        // x in the weights' type: f32 as it is, else the rounded copy (weights reach cuBLAS as
        // f16 or f32 only).
        let (x_in, ab_type) = if w_type == DType::F32 {
            (xp, cudaDataType::CUDA_R_32F)
        } else {
            if x_half.is_none() {
                // SAFETY: the conversion below writes all n values before any GEMM reads them
                // (a failed launch stops the pass before the GEMM).
                let x16 = unsafe {
                    self.queue
                        .alloc::<u16>(n, "allocating a half-precision copy of x")
                }?;
                let x16p = self.queue.addr(&x16);
                let n64 = n as u64;
                let mut b = self
                    .queue
                    .kernel(&self.kernels.copy_f32_to_f16, "f32 to half kernel");
                b.arg(&xp).arg(&x16p).arg(&n64);
                // SAFETY: x holds rows·k values and x16 was allocated with exactly that many.
                unsafe { b.run(elementwise(n)) }?;
                *x_half = Some(x16);
            }
            let x16 = x_half.as_ref().expect("made above");
            (self.queue.addr(x16), cudaDataType::CUDA_R_16F)
        };
        let args = GemmArgs {
            m: m as i32,
            n: rows as i32,
            k: k as i32,
            a: w_ptr,
            b: x_in,
            c: op,
            ab_type,
            alpha: 1.0,
            beta: if accumulate { 1.0 } else { 0.0 },
        };
        // SAFETY: column-major view of the row-major operands: W is k×m (ld k) taken
        // transposed, x16 is k×rows (ld k), out is m×rows (ld m) = row-major [rows, m]. Every
        // pointer is a live device allocation of at least that extent (the weight's shape was
        // checked when the model resolved it; x and out hold rows·k and rows·m values); the
        // handle runs on the queue's stream, so x16 outlives the queued GEMM (the caller drops
        // it later, its free ordered on the same stream).
        unsafe { self.queue.gemm(args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_column_split_fills_the_gpu_without_thin_slices() {
        // 132 multiprocessors, two blocks each.
        let places = 264;
        // A 7B layer's matmuls in tiles of 256 rows: O (4096 x 4096: 16 tiles of 128 chunks),
        // Q/K/V together (48 tiles), gate and up together (86), down (16 tiles, 344 chunks).
        assert_eq!(mma_split(16, 128, places, 16), 16);
        assert_eq!(mma_split(48, 128, places, 16), 5);
        assert_eq!(mma_split(86, 128, places, 16), 3);
        assert_eq!(mma_split(16, 344, places, 16), 16);
        // Within one wave of two blocks per multiprocessor.
        for tiles in 1..300 {
            let split = mma_split(tiles, 4096, places, 16);
            assert!(
                split == 1 || tiles * split <= places,
                "{tiles} tiles: {split} slices"
            );
        }
        // A small model (3 tiles, 18 chunks): no slice thinner than 8 chunks.
        assert_eq!(mma_split(3, 18, places, 16), 2);
        // Enough tiles already, or too few chunks: one slice.
        assert_eq!(mma_split(400, 128, places, 16), 1);
        assert_eq!(mma_split(1, 3, places, 16), 1);
        assert_eq!(mma_split(1, 4096, places, 16), 16);
        // A module built with fewer slices at most (`MMA_SPLIT_MAX=8`).
        assert_eq!(mma_split(16, 128, places, 8), 8);
    }
}
