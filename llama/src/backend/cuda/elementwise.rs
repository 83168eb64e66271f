//! Row- and element-wise device work: the embedding lookup, the norms (rmsnorm, its per-head
//! and post-norm forms), the gated activations, the bias add, scaling and soft-capping, row
//! copies, and the f32 ↔ f16 conversions of the KV cache.

use cudarc::driver::CudaFunction;

use crate::backend::{Activation, BackendError, NormInto, WeightView};

use super::device::{blocks, dtype_code, elementwise, kq_kernels};
use super::weights::device_ptr;
use super::{CudaBackend, CudaBuf, CudaKvBuf};

/// Threads per block of `embed_rows`.
const EMBED_THREADS: u32 = 256;
/// Threads per block of `rmsnorm` and `add_rmsnorm` (must match RMS_THREADS in norm_rope.cu).
const RMS_THREADS: u32 = 1024;
/// Pieces (one warp each) per block of `rmsnorm_pieces` (RMS_PIECE_WARPS in norm_rope.cu).
const RMS_PIECE_WARPS: u32 = 8;
/// Threads per block (one block a row) of `argmax_rows` (ARGMAX_THREADS in elementwise.cu).
const ARGMAX_THREADS: u32 = 1024;

/// An activation's code in the kernels (`gate_act` of elementwise.cu): 0 silu, 1 GeLU (tanh).
pub(super) fn gate_act_code(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
    }
}

impl CudaBackend {
    /// `out[r, :] = table[ids[r], :]` for a table in device memory.
    pub(super) fn embed_launch(
        &self,
        table: WeightView<'_>,
        ids: &[u32],
        out: &CudaBuf,
    ) -> Result<(), BackendError> {
        if ids.is_empty() {
            return Ok(());
        }
        let w = device_ptr(&table)?.addr();
        let ids_dev = self.queue.upload(ids, "uploading token ids")?;
        let ids_ptr = self.queue.addr(&ids_dev);
        let o = self.addr(out, 0);
        let (row_bytes, dtype, dim) = (
            table.row_bytes() as u64,
            dtype_code(table.dtype),
            table.cols as i32,
        );
        let kernel = if kq_kernels(table.dtype) {
            &self.kernels.kq_embed_rows
        } else {
            &self.kernels.embed_rows
        };
        let mut b = self.queue.kernel(kernel, "embed_rows kernel");
        b.arg(&w)
            .arg(&row_bytes)
            .arg(&dtype)
            .arg(&ids_ptr)
            .arg(&dim)
            .arg(&o);
        let cfg = blocks((ids.len() as u32, 1), EMBED_THREADS);
        // SAFETY: ids are < the table's rows (checked by the model), the table holds
        // rows·row_bytes bytes, `out` holds ids.len()·dim values; `ids_dev` is freed in stream
        // order after the kernel.
        unsafe { b.run(cfg) }
    }

    /// Rows read into host memory, copied up and then decoded like a table.
    pub(super) fn embed_host_launch(
        &self,
        rows: WeightView<'_>,
        out: &CudaBuf,
    ) -> Result<(), BackendError> {
        let host = rows.bytes.host().ok_or(BackendError::WrongMemory {
            backend: "cuda (rows read from the host)",
            found: "device",
        })?;
        let up = self.queue.upload(host, "uploading embedding rows")?;
        // SAFETY: `up` holds `host.len()` bytes and lives until the launch below is queued
        // (its free is ordered after the kernel on the same stream).
        let ptr = unsafe { crate::weights::DevicePtr::from_raw(self.queue.addr(&up), host.len()) };
        let table = WeightView::device(rows.dtype, rows.rows, rows.cols, ptr);
        let ids: Vec<u32> = (0..rows.rows as u32).collect();
        self.embed_launch(table, &ids, out)
    }

    /// `out = rmsnorm(x) · weight` (also written quantized for the next matmul, see
    /// [`super::scratch::X16`], when the rows are whole blocks) or `out += rmsnorm(x) · weight`,
    /// `rows` rows.
    pub(super) fn rmsnorm_launch(
        &self,
        x: &CudaBuf,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &CudaBuf,
        into: NormInto,
    ) -> Result<(), BackendError> {
        if rows == 0 {
            return Ok(());
        }
        let w = device_ptr(&weight)?.addr();
        let (xp, op) = (self.addr(x, 0), self.addr(out, 0));
        let (dtype, dim) = (dtype_code(weight.dtype), weight.cols as i32);
        if into == NormInto::Add {
            let mut b = self
                .queue
                .kernel(&self.kernels.add_rmsnorm, "add_rmsnorm kernel");
            b.arg(&xp).arg(&w).arg(&dtype).arg(&dim).arg(&eps).arg(&op);
            // SAFETY: x and out hold rows·dim values, the weight dim values.
            return unsafe { b.run(blocks((rows as u32, 1), RMS_THREADS)) };
        }
        let n = rows * weight.cols;
        let (xq, xs) = self.x16.fused_target(&self.queue, &self.graphs, n)?;
        let mut b = self.queue.kernel(&self.kernels.rmsnorm, "rmsnorm kernel");
        b.arg(&xp)
            .arg(&w)
            .arg(&dtype)
            .arg(&dim)
            .arg(&eps)
            .arg(&op)
            .arg(&xq)
            .arg(&xs);
        let cfg = blocks((rows as u32, 1), RMS_THREADS);
        // SAFETY: x and out hold rows·dim values, the weight dim values; xq/xs are null or
        // (dim a multiple of 32) the scratch's room for rows·dim quantized values.
        unsafe { b.run(cfg) }?;
        self.x16.remember(&self.queue, op, n, (xq, xs));
        Ok(())
    }

    /// `gate = act(gate) · up` over `len` values; also written quantized (see
    /// [`CudaBackend::rmsnorm_launch`]).
    pub(super) fn gated_act_launch(
        &self,
        gate: &CudaBuf,
        up: &CudaBuf,
        len: usize,
        act: Activation,
    ) -> Result<(), BackendError> {
        if len == 0 {
            return Ok(());
        }
        let (gp, upp) = (self.addr(gate, 0), self.addr(up, 0));
        let (xq, xs) = self.x16.fused_target(&self.queue, &self.graphs, len)?;
        let (n, act) = (len as u64, gate_act_code(act));
        let mut b = self
            .queue
            .kernel(&self.kernels.gated_act, "gated_act kernel");
        b.arg(&gp).arg(&upp).arg(&n).arg(&act).arg(&xq).arg(&xs);
        let threads = if len.is_multiple_of(4) { len / 4 } else { len };
        // SAFETY: both buffers hold at least len values; the kernel touches elements < n (four
        // per thread when n is a multiple of 4); xq/xs are null or (n a multiple of 32) the
        // scratch's room for n quantized values.
        unsafe { b.run(elementwise(threads)) }?;
        self.x16.remember(&self.queue, gp, len, (xq, xs));
        Ok(())
    }

    /// `x` normalised in place in `pieces` pieces of `weight.cols` values (per-head norms).
    pub(super) fn rmsnorm_pieces_launch(
        &self,
        x: &CudaBuf,
        pieces: usize,
        weight: WeightView<'_>,
        eps: f32,
    ) -> Result<(), BackendError> {
        if pieces == 0 {
            return Ok(());
        }
        let w = device_ptr(&weight)?.addr();
        let xp = self.addr(x, 0);
        let (dtype, dim, n) = (dtype_code(weight.dtype), weight.cols as i32, pieces as i32);
        let mut b = self
            .queue
            .kernel(&self.kernels.rmsnorm_pieces, "rmsnorm_pieces kernel");
        b.arg(&xp).arg(&w).arg(&dtype).arg(&dim).arg(&eps).arg(&n);
        let cfg = blocks(
            ((pieces as u32).div_ceil(RMS_PIECE_WARPS), 1),
            32 * RMS_PIECE_WARPS,
        );
        // SAFETY: x holds pieces·dim values, the weight dim values; one warp per piece.
        unsafe { b.run(cfg) }
    }

    /// `x[r, :] += bias` over `rows` rows of `bias.cols` values.
    pub(super) fn add_bias_launch(
        &self,
        x: &CudaBuf,
        rows: usize,
        bias: WeightView<'_>,
    ) -> Result<(), BackendError> {
        let n = rows * bias.cols;
        if n == 0 {
            return Ok(());
        }
        let w = device_ptr(&bias)?.addr();
        let xp = self.addr(x, 0);
        let (dtype, width, n64) = (dtype_code(bias.dtype), bias.cols as i32, n as u64);
        let mut b = self.queue.kernel(&self.kernels.add_bias, "add_bias kernel");
        b.arg(&xp).arg(&w).arg(&dtype).arg(&width).arg(&n64);
        // SAFETY: x holds rows·width values, the bias width values.
        unsafe { b.run(elementwise(n)) }
    }

    /// `x = f(x)` over `len` values with a one-float-parameter elementwise kernel (`scale_f32`,
    /// `softcap`).
    pub(super) fn map_launch(
        &self,
        kernel: &CudaFunction,
        x: &CudaBuf,
        len: usize,
        param: f32,
    ) -> Result<(), BackendError> {
        if len == 0 {
            return Ok(());
        }
        let (xp, n) = (self.addr(x, 0), len as u64);
        let mut b = self.queue.kernel(kernel, "elementwise kernel");
        b.arg(&xp).arg(&n).arg(&param);
        // SAFETY: x holds at least len values; the kernel takes (float*, u64, float).
        unsafe { b.run(elementwise(len)) }
    }

    /// The greedy id of each of the first `out.len()` rows of `logits` (`[rows, cols]`): one
    /// block a row (`argmax_rows`), then only the ids come back.
    pub(super) fn argmax_launch(
        &self,
        logits: &CudaBuf,
        cols: usize,
        out: &mut [u32],
    ) -> Result<(), BackendError> {
        if out.is_empty() {
            return Ok(());
        }
        let rows = out.len();
        if logits.0.len() < rows * cols {
            return Err(BackendError::Unsupported {
                op: "argmax_rows",
                message: format!(
                    "{rows} rows of {cols} logits from a buffer of {} values",
                    logits.0.len()
                ),
            });
        }
        // Room for 256 ids at least, so that growing (which drops a recorded pass) happens
        // once for every batch a server runs.
        let op = self
            .greedy_ids
            .room(&self.queue, &self.graphs, rows.max(256))?;
        let (xp, n) = (self.addr(logits, 0), cols as u64);
        let mut b = self
            .queue
            .kernel(&self.kernels.argmax_rows, "argmax_rows kernel");
        b.arg(&xp).arg(&n).arg(&op);
        let cfg = blocks((rows as u32, 1), ARGMAX_THREADS);
        // SAFETY: `logits` holds rows·cols values (checked above), the scratch at `op` room
        // for `rows` u32; the kernel takes (const float*, u64, u32*) and writes ids[blockIdx.x]
        // only.
        unsafe { b.run(cfg) }?;
        self.greedy_ids
            .read(&self.queue, out, "copying the greedy ids to the host")
    }

    /// `n` values from device address `src` to `dst` through a `copy_*` kernel (which converts
    /// between f32 and f16 as its name says).
    pub(super) fn copy_launch(
        &self,
        kernel: &CudaFunction,
        src: u64,
        dst: u64,
        n: usize,
    ) -> Result<(), BackendError> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.queue.kernel(kernel, "copy kernel");
        b.arg(&src).arg(&dst).arg(&n64);
        // SAFETY: the caller passes addresses of live buffers of at least n elements of the
        // kernel's source and destination types.
        unsafe { b.run(elementwise(n)) }
    }

    /// A KV-cache buffer holding `values` rounded to f16, as `rope_store_kv` stores them (for
    /// tests that fill a cache directly).
    pub fn upload_kv(&self, values: &[f32]) -> Result<CudaKvBuf, BackendError> {
        let src = self.queue.upload(values, "uploading KV values")?;
        let dst = CudaKvBuf(
            self.queue
                .alloc_zeros::<u16>(values.len(), "allocating a KV buffer")?,
        );
        let (s, d) = (self.queue.addr(&src), self.kv_addr(&dst));
        self.copy_launch(&self.kernels.copy_f32_to_f16, s, d, values.len())?;
        Ok(dst)
    }

    /// The first `out.len()` values of a KV-cache buffer, as f32 (for tests).
    pub fn read_kv(&self, buf: &CudaKvBuf, out: &mut [f32]) -> Result<(), BackendError> {
        let tmp = self
            .queue
            .alloc_zeros::<f32>(out.len(), "allocating a read buffer")?;
        let (s, d) = (self.kv_addr(buf), self.queue.addr(&tmp));
        self.copy_launch(&self.kernels.copy_f16_to_f32, s, d, out.len())?;
        self.queue.read(&tmp, out, "copying KV values to the host")
    }
}
