//! The attention block's device work: RoPE with the KV-cache stores in one launch, and
//! attention over the f16 cache — the tiled kernel for prompts, the split (flash-decoding)
//! kernels for one query row.

use crate::backend::{
    AttentionParams, AttentionSeq, AttentionShape, BackendError, check_cache_slots,
};

use super::device::{blocks, elementwise};
use super::{CudaBackend, CudaBuf, CudaKvBuf};

/// Threads per block of the attention kernels: they assume 256.
const ROW_THREADS: u32 = 256;

/// A sequence's K and V caches (device addresses) and the positions they hold.
#[derive(Debug, Clone, Copy)]
struct Cache {
    kp: u64,
    vp: u64,
    slots: usize,
}

/// Positions per chunk of the decode attention kernel: a 4096-token context is 32 chunks per
/// head, so even 8 heads fill the GPU.
const ATT_SPLIT: usize = 128;

impl CudaBackend {
    /// One launch: RoPE on `rows` rows of q and k at device addresses `qp` and `kp`, then
    /// those k and v (at `vp`) rows stored in the f16 caches of `slots` positions at `kc`/`vc`
    /// at positions `pos0 ..` (slot `pos % slots`), with the frequencies at `f`. While a pass
    /// is recorded the kernel reads the position from the pass parameters.
    pub(super) fn rope_store_kv_launch(
        &self,
        [qp, kp, vp, f, kc, vc]: [u64; 6],
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        slots: usize,
    ) -> Result<(), BackendError> {
        if rows == 0 {
            return Ok(());
        }
        if slots == 0 {
            return Err(BackendError::Unsupported {
                op: "rope_store_kv",
                message: "the KV cache holds no position".into(),
            });
        }
        let slots_i = slots as i32;
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
            .arg(&vc)
            .arg(&slots_i);
        // SAFETY: the caller passes live buffers: rows·n_heads·head_dim values at qp,
        // rows·n_kv_heads·head_dim at kp and vp, head_dim/2 frequencies at f, and caches at
        // kc/vc of `slots` positions (the kernel writes slot pos % slots).
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
        params: AttentionParams,
        out: &CudaBuf,
    ) -> Result<(), BackendError> {
        if shape.head_dim > ROW_THREADS as usize {
            return Err(BackendError::Unsupported {
                op: "attention",
                message: format!("head_dim {} > {ROW_THREADS}", shape.head_dim),
            });
        }
        let width = shape.n_heads * shape.head_dim;
        for s in seqs.iter().filter(|s| s.rows > 0) {
            let (qp, op) = (self.addr(q, s.row0 * width), self.addr(out, s.row0 * width));
            let (kp, vp) = (self.kv_addr(s.k_cache), self.kv_addr(s.v_cache));
            let cache = Cache {
                kp,
                vp,
                slots: s.k_cache.0.len() / (shape.n_kv_heads * shape.head_dim),
            };
            check_cache_slots(cache.slots, s.pos0, s.rows, params)?;
            if s.rows == 1 {
                self.attention_decode(qp, cache, s.pos0, shape, params, op)?;
            } else {
                self.attention_rows([qp, op], cache, (s.rows, s.pos0), shape, params)?;
            }
        }
        Ok(())
    }

    /// `rows` query rows (at device address `qp`, out at `op`) at positions `pos0 ..`: one
    /// block per (row, head).
    fn attention_rows(
        &self,
        [qp, op]: [u64; 2],
        cache: Cache,
        (rows, pos0): (usize, usize),
        shape: AttentionShape,
        params: AttentionParams,
    ) -> Result<(), BackendError> {
        let Cache { kp, vp, slots } = cache;
        let (p0, nh, nkv, hd, slots_i, window) = (
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            slots as i32,
            params.window.unwrap_or(0) as i32,
        );
        let scale = params.scale;
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
            .arg(&slots_i)
            .arg(&window)
            .arg(&op);
        let cfg = blocks(((rows * shape.n_heads) as u32, 1), ROW_THREADS);
        // SAFETY: q and out hold rows·n_heads·head_dim values, the caches `slots` positions of
        // n_kv_heads·head_dim (enough for the rows: checked by the caller, as head_dim <= 256).
        unsafe { b.run(cfg) }
    }

    /// One query row: the positions it sees in chunks of [`ATT_SPLIT`] over (head, chunk)
    /// blocks, then the chunks merged (see `attention_decode` in attention.cu). While a pass
    /// is recorded the grid covers the whole cache (`slots` positions, at least what the row
    /// sees) and the kernels read the position from the pass parameters; the chunks past it
    /// come out empty and the merge skips them.
    fn attention_decode(
        &self,
        qp: u64,
        cache: Cache,
        pos0: usize,
        shape: AttentionShape,
        params: AttentionParams,
        op: u64,
    ) -> Result<(), BackendError> {
        let Cache { kp, vp, slots } = cache;
        let pos_dev = self.graphs.pos_param(&self.queue);
        let seen = pos0 + 1 - params.first_key(pos0);
        let n_splits = if pos_dev.is_some() {
            slots.max(seen).div_ceil(ATT_SPLIT)
        } else {
            seen.div_ceil(ATT_SPLIT)
        };
        let partials = shape.n_heads * slots.max(seen).div_ceil(ATT_SPLIT) * (2 + shape.head_dim);
        let pp = self
            .attention_scratch
            .room(&self.queue, &self.graphs, partials)?;
        let (p0, nh, nkv, hd, split, slots_i, window) = (
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            ATT_SPLIT as i32,
            slots as i32,
            params.window.unwrap_or(0) as i32,
        );
        let scale = params.scale;
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
            .arg(&slots_i)
            .arg(&window)
            .arg(&split)
            .arg(&pp);
        let cfg = blocks((shape.n_heads as u32, n_splits as u32), ROW_THREADS);
        // SAFETY: q holds n_heads·head_dim values, the caches `slots` positions of
        // n_kv_heads·head_dim (the kernel reads the slots of the positions the row sees), the
        // partials n_heads·n_splits·(2+head_dim) (sized above for the slots); ATT_SPLIT <= the
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
