//! The attention block's device work: RoPE with the KV-cache stores in one launch, and
//! attention over the f16 cache — the tiled kernel for prompts, the split (flash-decoding)
//! kernels for one query row.

use crate::backend::{AttentionSeq, AttentionShape, BackendError};

use super::device::{blocks, elementwise};
use super::{CudaBackend, CudaBuf, CudaKvBuf};

/// Threads per block of the attention kernels: they assume 256.
const ROW_THREADS: u32 = 256;

/// Positions per chunk of the decode attention kernel: a 4096-token context is 32 chunks per
/// head, so even 8 heads fill the GPU.
const ATT_SPLIT: usize = 128;

impl CudaBackend {
    /// One launch: RoPE on `rows` rows of q and k at device addresses `qp` and `kp`, then
    /// those k and v (at `vp`) rows stored in the f16 caches at `kc`/`vc` at positions
    /// `pos0 ..`, with the frequencies at `f`. While a pass is recorded the kernel reads the
    /// position from the pass parameters.
    pub(super) fn rope_store_kv_launch(
        &self,
        [qp, kp, vp, f, kc, vc]: [u64; 6],
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
    ) -> Result<(), BackendError> {
        if rows == 0 {
            return Ok(());
        }
        let hd = shape.head_dim;
        let pos_ptr = self.graphs.pos_param(&self.queue).unwrap_or(0);
        let (rows_i, nh, nkv, hd_i, p0) = (
            rows as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            hd as i32,
            pos0 as i32,
        );
        let mut b = self
            .queue
            .kernel(&self.kernels.rope_store_kv, "rope_store_kv kernel");
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&rows_i)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd_i)
            .arg(&p0)
            .arg(&pos_ptr)
            .arg(&f)
            .arg(&kc)
            .arg(&vc);
        // SAFETY: the caller passes live buffers: rows·n_heads·head_dim values at qp,
        // rows·n_kv_heads·head_dim at kp and vp, head_dim/2 frequencies at f, and caches at
        // kc/vc that hold the positions pos0 .. pos0+rows (the model checks the capacity).
        unsafe {
            b.run(elementwise(
                rows * (shape.n_heads + shape.n_kv_heads) * hd / 2,
            ))
        }
    }

    /// Each sequence's query rows against its own caches, in place in `q` and `out`: one row
    /// through the split decode kernels, more through the tiled kernel.
    pub(super) fn attention_seqs(
        &self,
        q: &CudaBuf,
        seqs: &[AttentionSeq<'_, CudaKvBuf>],
        shape: AttentionShape,
        out: &CudaBuf,
    ) -> Result<(), BackendError> {
        if shape.head_dim > ROW_THREADS as usize {
            return Err(BackendError::Unsupported {
                op: "attention",
                message: format!("head_dim {} > {ROW_THREADS}", shape.head_dim),
            });
        }
        let width = shape.n_heads * shape.head_dim;
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        for s in seqs.iter().filter(|s| s.rows > 0) {
            let (qp, op) = (self.addr(q, s.row0 * width), self.addr(out, s.row0 * width));
            let (kp, vp) = (self.kv_addr(s.k_cache), self.kv_addr(s.v_cache));
            if s.rows == 1 {
                let capacity = s.k_cache.0.len() / (shape.n_kv_heads * shape.head_dim);
                self.attention_decode(qp, kp, vp, s.pos0, capacity, shape, scale, op)?;
            } else {
                self.attention_rows(qp, kp, vp, s.rows, s.pos0, shape, scale, op)?;
            }
        }
        Ok(())
    }

    /// `rows` query rows at positions `pos0 ..`: one block per (row, head).
    #[allow(clippy::too_many_arguments)]
    fn attention_rows(
        &self,
        qp: u64,
        kp: u64,
        vp: u64,
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        scale: f32,
        op: u64,
    ) -> Result<(), BackendError> {
        let (p0, nh, nkv, hd) = (
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
        );
        let mut b = self
            .queue
            .kernel(&self.kernels.attention, "attention kernel");
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&p0)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&scale)
            .arg(&op);
        let cfg = blocks(((rows * shape.n_heads) as u32, 1), ROW_THREADS);
        // SAFETY: q and out hold rows·n_heads·head_dim values, the caches at least
        // (pos0+rows)·n_kv_heads·head_dim; head_dim <= 256 was checked by the caller.
        unsafe { b.run(cfg) }
    }

    /// One query row: the positions in chunks of [`ATT_SPLIT`] over (head, chunk) blocks, then
    /// the chunks merged (see `attention_decode` in attention.cu). While a pass is recorded
    /// the grid covers the whole cache (`capacity` positions) and the kernels read the
    /// position from the pass parameters; the chunks past it come out empty and the merge
    /// skips them.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode(
        &self,
        qp: u64,
        kp: u64,
        vp: u64,
        pos0: usize,
        capacity: usize,
        shape: AttentionShape,
        scale: f32,
        op: u64,
    ) -> Result<(), BackendError> {
        let pos_dev = self.graphs.pos_param(&self.queue);
        let n_splits = if pos_dev.is_some() {
            capacity.max(pos0 + 1).div_ceil(ATT_SPLIT)
        } else {
            (pos0 + 1).div_ceil(ATT_SPLIT)
        };
        let partials =
            shape.n_heads * capacity.max(pos0 + 1).div_ceil(ATT_SPLIT) * (2 + shape.head_dim);
        let pp = self
            .attention_scratch
            .room(&self.queue, &self.graphs, partials)?;
        let (p0, nh, nkv, hd, split) = (
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            ATT_SPLIT as i32,
        );
        let pos_ptr = pos_dev.unwrap_or(0);
        let mut b = self
            .queue
            .kernel(&self.kernels.attention_decode, "attention_decode kernel");
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&p0)
            .arg(&pos_ptr)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&scale)
            .arg(&split)
            .arg(&pp);
        let cfg = blocks((shape.n_heads as u32, n_splits as u32), ROW_THREADS);
        // SAFETY: q holds n_heads·head_dim values, the caches `capacity` positions of
        // n_kv_heads·head_dim (the kernel reads only the first pos+1), the partials
        // n_heads·n_splits·(2+head_dim) (sized above for the capacity); ATT_SPLIT <= the
        // kernel's tile of 1024.
        unsafe { b.run(cfg) }?;
        let n_splits_i = n_splits as i32;
        let mut b = self
            .queue
            .kernel(&self.kernels.attention_combine, "attention_combine kernel");
        b.arg(&pp).arg(&n_splits_i).arg(&hd).arg(&op);
        let cfg = blocks((shape.n_heads as u32, 1), ROW_THREADS);
        // SAFETY: reads the partials written above, writes n_heads·head_dim values of out.
        unsafe { b.run(cfg) }
    }
}
