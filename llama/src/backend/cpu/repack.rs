//! The CPU backend's copies of weight matrices in an interleaved layout, which the 8-bit
//! activation matmuls read instead of the stored rows: on CPUs with AVX-512 VNNI the layout of
//! `vnni16::repack16` (sixteen rows per group; q4_0, q4_1, q8_0, q5_0, q4_k, q6_k), elsewhere
//! with AVX2 that of `int8::repack8` (eight rows per group; q4_0, q4_1, q8_0, q5_0). See [`Packing`].
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
use crate::backend::{int8, vnni16};

/// The interleaved layouts, each read by its own kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Packing {
    /// `int8::repack8`, read by `int8::gemm8_packed`.
    Rows8,
    /// `vnni16::repack16`, read by `vnni16::gemm16`.
    Rows16,
}

impl Packing {
    /// Rows per interleaved group.
    pub(super) fn rows(self) -> usize {
        match self {
            Packing::Rows8 => 8,
            Packing::Rows16 => 16,
        }
    }
}

/// Repacked copies by the stored bytes' (address, length).
type Copies = HashMap<(usize, usize), Arc<[u8]>>;

/// Rows each rayon task of the copy repacks (whole groups of either layout).
const ROWS_PER_TASK: usize = 512;

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

    /// The copy of `w` (stored bytes `bytes`) in the layout `packing`, made now if it is the
    /// first time; `None` when `w` is not repacked (see the module doc; the caller checked
    /// that its dtype and this CPU take the kernels of `packing`, which is the same for a dtype
    /// throughout a backend's life).
    pub(super) fn get(
        &self,
        w: &WeightView<'_>,
        bytes: &[u8],
        packing: Packing,
    ) -> Option<Arc<[u8]>> {
        if !self.stable.load(Ordering::Relaxed) || w.rows < packing.rows() {
            return None;
        }
        let mut copies = self.copies.lock().unwrap_or_else(PoisonError::into_inner);
        let copy = copies
            .entry((bytes.as_ptr() as usize, bytes.len()))
            .or_insert_with(|| repacked(w, bytes, packing));
        Some(Arc::clone(copy))
    }
}

/// `bytes` (the `w.rows` stored rows of `w`) in the layout `packing`, in parallel.
pub(super) fn repacked(w: &WeightView<'_>, bytes: &[u8], packing: Packing) -> Arc<[u8]> {
    let row_bytes = w.row_bytes();
    let bytes = &bytes[..w.rows * row_bytes];
    let mut out = vec![0u8; bytes.len()];
    let task = ROWS_PER_TASK * row_bytes;
    out.par_chunks_mut(task)
        .zip(bytes.par_chunks(task))
        .for_each(|(dst, src)| match packing {
            Packing::Rows8 => int8::repack8(w.dtype, src, row_bytes, dst),
            Packing::Rows16 => vnni16::repack16(w.dtype, src, row_bytes, dst),
        });
    out.into()
}
