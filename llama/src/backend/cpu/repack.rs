//! The CPU backend's copies of q4_0, q4_1 and q8_0 weight matrices in the interleaved layout of
//! `int8::repack8` (eight rows per group, block by block, scales side by side), which the
//! default (8-bit activation) matmuls read instead of the stored rows.
//!
//! Why: with the stored layout each weight row is a dot product of its own (a horizontal sum,
//! scalar scale conversions and offsets per block), or eight rows are transposed while being
//! read; interleaved once, one vector instruction serves eight rows and a block's scales are one
//! load (ggml-cpu's `repack.cpp` and AMX buffer types do the same for the same reason).
//!
//! When: a matrix is repacked the first time a matmul reads it in a pass whose weights stay at
//! their addresses for the model's lifetime ([`crate::backend::PassInfo::weights_stable`]; on the
//! CPU, every blob resident), so the first pass pays the copy (one parallel pass over those
//! bytes); copies are found again by the stored bytes' address and length. Streamed
//! weights (an address that may hold another blob's bytes next pass) are never repacked and
//! take the stored-layout kernels. What it costs: a second copy of those matrices in RAM for the
//! backend's lifetime; the stored copy stays where residency keeps it (other backends, the
//! embedding lookup and the hybrid split read that layout), though the CPU's matmuls no longer
//! read it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rayon::prelude::*;

use crate::backend::WeightView;
use crate::backend::int8;

/// Repacked copies by the stored bytes' (address, length).
type Copies = HashMap<(usize, usize), Arc<[u8]>>;

/// Groups of eight rows each rayon task of the copy repacks.
const GROUPS_PER_TASK: usize = 64;

/// The repacked copies of one backend (not shared by its clones: an address is only known to
/// name the same weight within one model's lifetime).
#[derive(Default)]
pub(super) struct RepackCache {
    /// Whether the current pass's weights stay at their addresses.
    stable: AtomicBool,
    copies: Mutex<Copies>,
}

impl std::fmt::Debug for RepackCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let copies = self.copies.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("RepackCache")
            .field("stable", &self.stable.load(Ordering::Relaxed))
            .field("copies", &copies.len())
            .finish()
    }
}

impl RepackCache {
    /// A pass begins whose weights do (or do not) stay at their addresses; when they do not,
    /// the copies made so far are dropped (their addresses may name other bytes now).
    pub(super) fn begin_pass(&self, weights_stable: bool) {
        self.stable.store(weights_stable, Ordering::Relaxed);
        if !weights_stable {
            self.copies
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
        }
    }

    /// The interleaved copy of `w`, whose stored bytes are `bytes`, made now if it is the
    /// first time; `None` when `w` is not repacked (see the module doc; the caller checked
    /// that its dtype and this CPU take the interleaved kernels).
    pub(super) fn get(&self, w: &WeightView<'_>, bytes: &[u8]) -> Option<Arc<[u8]>> {
        if !self.stable.load(Ordering::Relaxed) || w.rows < 8 {
            return None;
        }
        let mut copies = self.copies.lock().unwrap_or_else(PoisonError::into_inner);
        let copy = copies
            .entry((bytes.as_ptr() as usize, bytes.len()))
            .or_insert_with(|| repacked(w, bytes));
        Some(Arc::clone(copy))
    }
}

/// `bytes` (the `w.rows` stored rows of `w`) in the layout of `int8::repack8`, in parallel.
pub(super) fn repacked(w: &WeightView<'_>, bytes: &[u8]) -> Arc<[u8]> {
    let row_bytes = w.row_bytes();
    let bytes = &bytes[..w.rows * row_bytes];
    let mut out = vec![0u8; bytes.len()];
    let task = GROUPS_PER_TASK * 8 * row_bytes;
    out.par_chunks_mut(task)
        .zip(bytes.par_chunks(task))
        .for_each(|(dst, src)| int8::repack8(w.dtype, src, row_bytes, dst));
    out.into()
}
