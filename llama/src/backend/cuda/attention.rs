//! The attention block's device work: RoPE with the KV-cache stores in one launch, and
//! attention over the f16 cache — the tiled kernel for prompts, the split (flash-decoding)
//! kernels for one query row.

use crate::backend::{
    AttentionParams, AttentionSeq, AttentionShape, BackendError, check_cache_slots,
    check_store_slots,
};

use cudarc::driver::LaunchConfig;

use super::device::{Launch, blocks, elementwise};
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

/// Warps per block and query rows per block of `attention_flash_hd*` (FA_WARPS, FA_ROWS in
/// attention.cu).
const FA_WARPS: u32 = 4;
const FA_ROWS: usize = 16 * FA_WARPS as usize;

/// Sequences per launch of the kernels that take a [`SeqTable`] (`SEQS_MAX` in common.cuh).
const SEQS_MAX: usize = 64;

/// The sequences of one launch of `rope_store_kv_seqs` / `attention_*_seqs`: must match
/// `SeqTable` in common.cuh (64 cache pointers of each kind, then 64 each of row0, rows, pos0,
/// and the count).
#[repr(C)]
#[derive(Clone, Copy)]
struct SeqTable {
    k_cache: [u64; SEQS_MAX],
    v_cache: [u64; SEQS_MAX],
    row0: [i32; SEQS_MAX],
    rows: [i32; SEQS_MAX],
    pos0: [i32; SEQS_MAX],
    n: i32,
}

// SAFETY: plain data with the C layout of the kernels' by-value parameter (`repr(C)`, no
// pointers the host dereferences, every bit pattern valid).
unsafe impl cudarc::driver::DeviceRepr for SeqTable {}

/// One sequence of a [`SeqTable`]: its caches by device address, its rows and first position.
pub(super) struct SeqEntry {
    pub k_cache: u64,
    pub v_cache: u64,
    pub row0: usize,
    pub rows: usize,
    pub pos0: usize,
}

impl SeqTable {
    /// Up to [`SEQS_MAX`] entries.
    fn of(entries: &[SeqEntry]) -> SeqTable {
        let mut t = SeqTable {
            k_cache: [0; SEQS_MAX],
            v_cache: [0; SEQS_MAX],
            row0: [0; SEQS_MAX],
            rows: [0; SEQS_MAX],
            pos0: [0; SEQS_MAX],
            n: entries.len().min(SEQS_MAX) as i32,
        };
        for (i, e) in entries.iter().take(SEQS_MAX).enumerate() {
            t.k_cache[i] = e.k_cache;
            t.v_cache[i] = e.v_cache;
            t.row0[i] = e.row0 as i32;
            t.rows[i] = e.rows as i32;
            t.pos0[i] = e.pos0 as i32;
        }
        t
    }
}

/// What both RoPE-and-store kernels (`rope_store_kv`, `rope_store_kv_seqs`) take first: the
/// device addresses of q, k and v, the row count and the head layout; and their grid, one
/// thread per rotated pair of q and k.
struct RopeArgs {
    qkv: [u64; 3],
    rows: i32,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    rotated_pairs: usize,
}

impl RopeArgs {
    fn new(qkv: [u64; 3], rows: usize, shape: AttentionShape) -> RopeArgs {
        RopeArgs {
            qkv,
            rows: rows as i32,
            n_heads: shape.n_heads as i32,
            n_kv_heads: shape.n_kv_heads as i32,
            head_dim: shape.head_dim as i32,
            rotated_pairs: rows * (shape.n_heads + shape.n_kv_heads) * shape.head_dim / 2,
        }
    }

    /// Appends the arguments, in the kernels' order.
    fn push_to<'a>(&'a self, b: &mut Launch<'a>) {
        let [q, k, v] = &self.qkv;
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(&self.rows)
            .arg(&self.n_heads)
            .arg(&self.n_kv_heads)
            .arg(&self.head_dim);
    }

    fn grid(&self) -> LaunchConfig {
        elementwise(self.rotated_pairs)
    }
}

/// What the kernels that attend over one sequence's cache (`attention`, `attention_decode`)
/// take of the layer and the cache, in their order: the head layout, the score scale, the
/// cache's slots and the window (0: none).
struct CacheAttentionArgs {
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    scale: f32,
    slots: i32,
    window: i32,
}

impl CacheAttentionArgs {
    fn new(shape: AttentionShape, params: AttentionParams, slots: usize) -> CacheAttentionArgs {
        CacheAttentionArgs {
            n_heads: shape.n_heads as i32,
            n_kv_heads: shape.n_kv_heads as i32,
            head_dim: shape.head_dim as i32,
            scale: params.scale,
            slots: slots as i32,
            window: params.window.unwrap_or(0) as i32,
        }
    }

    /// Appends the arguments, in the kernels' order.
    fn push_to<'a>(&'a self, b: &mut Launch<'a>) {
        b.arg(&self.n_heads)
            .arg(&self.n_kv_heads)
            .arg(&self.head_dim)
            .arg(&self.scale)
            .arg(&self.slots)
            .arg(&self.window);
    }
}

impl CudaBackend {
    /// `rope_store_kv` for the rows of all `seqs` (rows counted from 0 at `q`, `k`, `v`; the
    /// frequencies at `f`), [`SEQS_MAX`] sequences per launch.
    pub(super) fn rope_store_kv_seqs_launch(
        &self,
        [qp, kp, vp, f]: [u64; 4],
        seqs: &[SeqEntry],
        shape: AttentionShape,
    ) -> Result<(), BackendError> {
        let (q_dim, kv_dim) = (
            shape.n_heads * shape.head_dim,
            shape.n_kv_heads * shape.head_dim,
        );
        for chunk in seqs.chunks(SEQS_MAX) {
            // Rows of this chunk counted from its first sequence's.
            let first = chunk[0].row0;
            let rows: usize = chunk.iter().map(|s| s.rows).sum();
            if rows == 0 {
                continue;
            }
            let local: Vec<SeqEntry> = chunk
                .iter()
                .map(|s| SeqEntry {
                    row0: s.row0 - first,
                    ..*s
                })
                .collect();
            let table = SeqTable::of(&local);
            let rope = RopeArgs::new(
                [
                    qp + (first * q_dim * 4) as u64,
                    kp + (first * kv_dim * 4) as u64,
                    vp + (first * kv_dim * 4) as u64,
                ],
                rows,
                shape,
            );
            let mut b = self.queue.kernel(
                &self.kernels.rope_store_kv_seqs,
                "rope_store_kv_seqs kernel",
            );
            rope.push_to(&mut b);
            b.arg(&f).arg(&table);
            // SAFETY: the chunk's rows are consecutive from `first` (the model lays sequences
            // out in row order), so q/k/v hold rows·n_heads·head_dim and rows·kv_dim values
            // from there; each sequence's caches hold its positions pos0 .. pos0+rows (the
            // model checks the capacity).
            unsafe { b.run(rope.grid()) }?;
        }
        Ok(())
    }

    /// Decode attention of the one-row sequences `seqs` (their query rows counted from 0 at
    /// `qp`, outputs likewise at `op`): one launch of `attention_decode_seqs` over (head,
    /// chunk, sequence) and one of `attention_combine_seqs` per [`SEQS_MAX`] sequences.
    fn attention_decode_seqs_launch(
        &self,
        qp: u64,
        op: u64,
        seqs: &[SeqEntry],
        shape: AttentionShape,
        scale: f32,
    ) -> Result<(), BackendError> {
        for chunk in seqs.chunks(SEQS_MAX) {
            let max_splits = chunk
                .iter()
                .map(|s| (s.pos0 + 1).div_ceil(ATT_SPLIT))
                .max()
                .unwrap_or(1);
            let partials = chunk.len() * shape.n_heads * max_splits * (2 + shape.head_dim);
            let pp = self
                .seq_attention_scratch
                .room(&self.queue, &self.graphs, partials)?;
            let table = SeqTable::of(chunk);
            let (nh, nkv, hd, split, max_splits_i) = (
                shape.n_heads as i32,
                shape.n_kv_heads as i32,
                shape.head_dim as i32,
                ATT_SPLIT as i32,
                max_splits as i32,
            );
            let mut b = self.queue.kernel(
                &self.kernels.attention_decode_seqs,
                "attention_decode_seqs kernel",
            );
            b.arg(&qp)
                .arg(&nh)
                .arg(&nkv)
                .arg(&hd)
                .arg(&scale)
                .arg(&split)
                .arg(&pp)
                .arg(&table);
            let cfg = LaunchConfig {
                grid_dim: (shape.n_heads as u32, max_splits as u32, chunk.len() as u32),
                block_dim: (ROW_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: q holds the query rows row0[z] of every sequence (n_heads·head_dim values
            // each), each sequence's caches its positions 0 ..= pos0; the partials hold
            // n_seqs·n_heads·max_splits·(2+head_dim) values; head_dim <= 256 was checked.
            unsafe { b.run(cfg) }?;
            let mut b = self.queue.kernel(
                &self.kernels.attention_combine_seqs,
                "attention_combine_seqs kernel",
            );
            b.arg(&pp)
                .arg(&max_splits_i)
                .arg(&nh)
                .arg(&hd)
                .arg(&split)
                .arg(&op)
                .arg(&table);
            let cfg = blocks((shape.n_heads as u32, chunk.len() as u32), ROW_THREADS);
            // SAFETY: reads the partials written above (the chunks each sequence has), writes
            // n_heads·head_dim values of each sequence's output row.
            unsafe { b.run(cfg) }?;
        }
        Ok(())
    }

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
        check_store_slots(slots, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let rope = RopeArgs::new([qp, kp, vp], rows, shape);
        let (p0, slots_i) = (pos0 as i32, slots as i32);
        let pos_ptr = self.graphs.pos_param(&self.queue).unwrap_or(0);
        let mut b = self
            .queue
            .kernel(&self.kernels.rope_store_kv, "rope_store_kv kernel");
        rope.push_to(&mut b);
        b.arg(&p0)
            .arg(&pos_ptr)
            .arg(&f)
            .arg(&kc)
            .arg(&vc)
            .arg(&slots_i);
        // SAFETY: the caller passes live buffers: rows·n_heads·head_dim values at qp,
        // rows·n_kv_heads·head_dim at kp and vp, head_dim/2 frequencies at f, and caches at
        // kc/vc of `slots` positions (the kernel writes slot pos % slots).
        unsafe { b.run(rope.grid()) }
    }

    /// Each sequence's query rows against its own caches, in place in `q` and `out`: one row
    /// through the split decode kernels, more through the tiled kernel; with the new paths
    /// (not for a sliding-window layer) a batch's one-row sequences in one launch and prompts
    /// through flash attention.
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
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        for s in seqs {
            check_cache_slots(s.k_cache.0.len() / kv_dim, s.pos0, s.rows, params)?;
        }
        // The one-launch and flash kernels know neither windows nor ring caches: a
        // sliding-window layer's attention goes through the kernels that do. Without a window
        // every cache holds all the positions its rows see (checked above), slot t for
        // position t.
        let whole_caches = params.window.is_none();
        // With the `seqs` path, the one-row sequences of a batch in one launch.
        let batched =
            whole_caches && self.paths.seqs && seqs.iter().filter(|s| s.rows == 1).count() >= 2;
        if batched {
            let ones: Vec<SeqEntry> = seqs
                .iter()
                .filter(|s| s.rows == 1)
                .map(|s| SeqEntry {
                    k_cache: self.kv_addr(s.k_cache),
                    v_cache: self.kv_addr(s.v_cache),
                    row0: s.row0,
                    rows: 1,
                    pos0: s.pos0,
                })
                .collect();
            self.attention_decode_seqs_launch(
                self.addr(q, 0),
                self.addr(out, 0),
                &ones,
                shape,
                params.scale,
            )?;
        }
        let flash = self.flash_kernel(shape).filter(|_| whole_caches);
        for s in seqs
            .iter()
            .filter(|s| s.rows > 0 && !(batched && s.rows == 1))
        {
            let (qp, op) = (self.addr(q, s.row0 * width), self.addr(out, s.row0 * width));
            let (kp, vp) = (self.kv_addr(s.k_cache), self.kv_addr(s.v_cache));
            let cache = Cache {
                kp,
                vp,
                slots: s.k_cache.0.len() / kv_dim,
            };
            if s.rows == 1 {
                // Alone, its output is the whole input of the output projection, which the
                // kernel can hand over quantized.
                let whole_output = seqs.len() == 1;
                self.attention_decode(qp, cache, s.pos0, shape, params, op, whole_output)?;
            } else if let Some(kernel) = flash {
                self.attention_flash(
                    kernel,
                    [qp, kp, vp, op],
                    s.rows,
                    s.pos0,
                    shape,
                    params.scale,
                )?;
            } else {
                self.attention_rows([qp, op], cache, (s.rows, s.pos0), shape, params)?;
            }
        }
        Ok(())
    }

    /// The tensor-core prompt attention kernel for `shape`, when the `flash` path is on, the
    /// device has the instructions and there is a kernel for its head_dim (64, 128).
    fn flash_kernel(&self, shape: AttentionShape) -> Option<&cudarc::driver::CudaFunction> {
        if !self.paths.flash || !self.tensor_cores {
            return None;
        }
        match shape.head_dim {
            64 => Some(&self.kernels.attention_flash[0]),
            128 => Some(&self.kernels.attention_flash[1]),
            _ => None,
        }
    }

    /// `rows` query rows at positions `pos0 ..` on tensor cores (`attention_flash_hd*`):
    /// blocks of [`FA_ROWS`] rows of one head.
    fn attention_flash(
        &self,
        kernel: &cudarc::driver::CudaFunction,
        [qp, kp, vp, op]: [u64; 4],
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        scale: f32,
    ) -> Result<(), BackendError> {
        let (rows_i, p0, nh, nkv) = (
            rows as i32,
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
        );
        let mut b = self.queue.kernel(kernel, "attention_flash kernel");
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&rows_i)
            .arg(&p0)
            .arg(&nh)
            .arg(&nkv)
            .arg(&scale)
            .arg(&op);
        let cfg = blocks(
            (rows.div_ceil(FA_ROWS) as u32, shape.n_heads as u32),
            FA_WARPS * 32,
        );
        // SAFETY: q and out hold rows·n_heads·head_dim values, the caches at least
        // (pos0+rows)·n_kv_heads·head_dim; the kernel is the one for this head_dim; the grid
        // covers the rows in blocks of FA_ROWS for every head.
        unsafe { b.run(cfg) }
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
        let layer = CacheAttentionArgs::new(shape, params, slots);
        let p0 = pos0 as i32;
        let mut b = self
            .queue
            .kernel(&self.kernels.attention, "attention kernel");
        b.arg(&qp).arg(&kp).arg(&vp).arg(&p0);
        layer.push_to(&mut b);
        b.arg(&op);
        let cfg = blocks(((rows * shape.n_heads) as u32, 1), ROW_THREADS);
        // SAFETY: q and out hold rows·n_heads·head_dim values, the caches `slots` positions of
        // n_kv_heads·head_dim (enough for the rows: checked by the caller, as head_dim <= 256).
        unsafe { b.run(cfg) }
    }

    /// One query row: the positions it sees in chunks of [`ATT_SPLIT`] over (head, chunk)
    /// blocks, the last chunk of each head to finish merging the head's chunks (see
    /// `attention_decode` in attention.cu). While a pass is recorded the grid covers the whole
    /// cache (`slots` positions, at least what the row sees) and the kernel reads the position
    /// from the pass parameters; the chunks past it come out empty and the merge skips them.
    /// With `quantize_out` (the output is all the next matmul reads) the kernel also writes
    /// the output in the quantized matmuls' 16-bit form and [`super::scratch::X16`] remembers
    /// it, so the output projection needs no `quantize_x16` launch.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode(
        &self,
        qp: u64,
        cache: Cache,
        pos0: usize,
        shape: AttentionShape,
        params: AttentionParams,
        op: u64,
        quantize_out: bool,
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
        let tickets = self
            .attention_tickets
            .room(&self.queue, &self.graphs, shape.n_heads)?;
        let width = shape.n_heads * shape.head_dim;
        let (xq, xs) = if quantize_out && shape.head_dim.is_multiple_of(32) {
            self.x16.fused_target(&self.queue, &self.graphs, width)?
        } else {
            (0, 0)
        };
        let layer = CacheAttentionArgs::new(shape, params, slots);
        let (p0, split) = (pos0 as i32, ATT_SPLIT as i32);
        let pos_ptr = pos_dev.unwrap_or(0);
        let mut b = self
            .queue
            .kernel(&self.kernels.attention_decode, "attention_decode kernel");
        b.arg(&qp).arg(&kp).arg(&vp).arg(&p0).arg(&pos_ptr);
        layer.push_to(&mut b);
        b.arg(&split)
            .arg(&pp)
            .arg(&op)
            .arg(&tickets)
            .arg(&xq)
            .arg(&xs);
        let cfg = blocks((shape.n_heads as u32, n_splits as u32), ROW_THREADS);
        // SAFETY: q and out hold n_heads·head_dim values, the caches `slots` positions of
        // n_kv_heads·head_dim (the kernel reads the slots of the positions the row sees), the
        // partials n_heads·n_splits·(2+head_dim) (sized above for the slots), the tickets
        // n_heads zeros (each merging block restores its 0); ATT_SPLIT <= the kernel's tile of
        // 1024; xq/xs, unless 0, room for n_heads·head_dim quantized values (head_dim a
        // multiple of 32, so each head is whole blocks of them).
        unsafe { b.run(cfg) }?;
        self.x16.remember(&self.queue, op, width, (xq, xs));
        Ok(())
    }
}
