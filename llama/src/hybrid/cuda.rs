//! The split on a CUDA GPU: [`SplitBackend`] over the CUDA backend (the primary: every op,
//! the KV caches, the rows `[k, n)` of each split matmul) and the CPU backend (the helper:
//! rows `[0, k)`), its weights through residency with each streamed blob's host-tier copy
//! handed out beside the device copy ([`CudaWeights::with_host_copies`]): the CPU reads the
//! pinned host tier in place, nothing is copied for it.
//!
//! # Which share, and what streams
//!
//! Each pass tells the split its rows before it starts; from then on, each fill of a blob
//! streamed from the host tier copies only the byte ranges the GPU needs at the planner's
//! (`residency::placement`, on the residency plan this run has and this machine's
//! calibration) CPU share for those rows — rows `[k, n)` of each matmul weight, every other
//! tensor whole ([`super::primary_ranges`], [`residency::Residency::set_fill_ranges`]) — so
//! the PCIe link carries the GPU's share while the CPU reads its own from RAM, and the two
//! bandwidths add up. The CPU then computes exactly the rows the blob's fill left out
//! ([`residency::Residency::filled_with`]): none for a blob copied whole (the first pass reads
//! every blob from disk; a prefill chunk gets no share).
//!
//! The first blobs of a pass are prefetched while the previous one runs, at the previous
//! pass's share. When such a blob is acquired (the pass's rows are known by then), residency
//! asks the ranges again and completes the fill: if this pass's share is lower (a prefill
//! after decode steps: none), the bytes of the rows the CPU no longer takes are copied from
//! the host tier into the same slot before the GPU reads it, and the CPU computes the lower
//! share; if it is higher (decode after a prefill), the GPU keeps what it has and the CPU
//! computes the fill's smaller share for that pass. So no pass has the CPU compute more rows
//! of a blob than the planner gives it for that pass's rows. Before this, a 512-row prefill
//! after decode steps ran ~11× slower than `--placement gpu` on the lent H100 (f16 7B,
//! 4 GiB: 163 vs 1872 tok/s): the CPU computed its decode share of the prefetched blobs at
//! 512 rows, where it is ~100× slower per byte than the GPU. What the completion costs: its
//! copy runs on the compute thread, not overlapped — for that model 2 slots × 58 % of 404 MB
//! at 55 GB/s ≈ 8.5 ms, against a 512-row chunk's ~270 ms — and nothing for decode steps of one
//! batch size after another (the same share, the same tag: nothing to copy).
//!
//! A blob may be refilled only once it is released, so the split needs more streamed blobs
//! than ring slots; with fewer, the GPU computes everything.
//!
//! # The ring's waits
//!
//! With `auto` on the lent H100 (f16 7B, 4 GiB, 2 ring slots) the reader sat idle for a free
//! slot 13.9 of 37 s (`slot_wait_s`: the next blob in plan order had no free slot). That is
//! the reader having copied ahead while the compute side — there the CPU's share of each
//! layer, slower beside the copies than its lone calibration said — had not released the slot
//! it read: a pass bound by the compute side. A deeper ring would not shorten it (and a third
//! slot of a 404 MB layer costs a resident layer, ~3.5 % more bytes streamed per token);
//! slots stay sized for whole blobs, since a prefill chunk (no CPU share) needs them whole,
//! so a share frees no room for more of them either. What shortens the waits is a share the
//! CPU keeps up with beside the copies: the planner's shared-DRAM model
//! (`residency::placement`, from the calibration's concurrent probe).
//!
//! The decode CUDA graph is off (every op is issued each step: the CPU's work between the
//! primary's ops cannot be captured). With layers streaming, graphs are not replayed anyway.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use residency::{PassKind, Placement, PlacementMode, Residency};
use weights_format::Metadata;

use crate::LlamaError;
use crate::backend::CpuBackend;
use crate::backend::cuda::{CudaBackend, CudaWeights};
use crate::load::LoadedModel;
use crate::weights::WeightSource;

use super::{HybridOptions, ShareFn, SplitBackend, primary_ranges};

/// A model on a CUDA GPU with the CPU computing a share of the streamed layers' matmuls.
pub type HybridModel = LoadedModel<SplitBackend<CudaBackend, CpuBackend>, CudaWeights>;

/// Told the rows of each pass before it starts.
pub type PassHook = dyn Fn(usize) + Send + Sync;

/// The planner's CPU share of each blob for a pass of some rows.
type Planned = dyn Fn(usize, usize) -> f64 + Send + Sync;

/// The planner's shares: `options.force_cpu_fraction` for every blob when set (none for a
/// pass of more than `options.force_max_rows` rows), else the
/// placement planner's on the run's residency plan with this machine's calibration (planned
/// once per row count, then cached).
fn planned_shares(
    meta: &Metadata,
    residency: &Residency,
    options: &HybridOptions,
) -> Result<Box<Planned>, LlamaError> {
    if let Some(fraction) = options.force_cpu_fraction {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(LlamaError::Config {
                setting: "force_cpu_fraction",
                message: format!("{fraction} is not a share between 0 and 1"),
            });
        }
        let max_rows = options.force_max_rows.unwrap_or(usize::MAX);
        return Ok(Box::new(
            move |_, rows| {
                if rows <= max_rows { fraction } else { 0.0 }
            },
        ));
    }
    let calibrate = options.calibrate.as_ref().ok_or(LlamaError::Config {
        setting: "--placement auto",
        message: "needs this machine's calibration (gdsllm plan --calibrate)".into(),
    })?;
    let layout = residency::ModelLayout::from_metadata(meta)?;
    let units = residency::units(meta, &layout);
    let calibration =
        calibrate(&residency::placement::dtypes_by_bytes(&units)).map_err(|message| {
            LlamaError::Config {
                setting: "--placement auto",
                message: format!("calibrating this machine: {message}"),
            }
        })?;
    let plan = residency.plan().clone();
    // Checked once here, so that planning later cannot fail.
    residency::plan_placement(
        &units,
        &calibration,
        PlacementMode::Auto,
        &[(PassKind::Decode { batch: 1 }, Some(&plan))],
    )?;
    let cache: Mutex<HashMap<usize, Arc<residency::PassPlacement>>> = Mutex::default();
    Ok(Box::new(move |blob, rows| {
        let placed = {
            let mut cache = super::lock(&cache);
            let entry = cache.entry(rows).or_insert_with(|| {
                // Every matmul of a pass of `rows` rows: a decode step's layers and head alike.
                let pass = [(PassKind::Decode { batch: rows }, Some(&plan))];
                let placed =
                    residency::plan_placement(&units, &calibration, PlacementMode::Auto, &pass)
                        .expect("planned once at open");
                Arc::new(placed.passes.into_iter().next().expect("one pass planned"))
            });
            Arc::clone(entry)
        };
        placed.cpu_share(blob)
    }))
}

/// The share function and the pass hook of a [`SplitBackend`] over `weights` (see the
/// module doc).
pub fn split_shares(
    meta: &Metadata,
    weights: &CudaWeights,
    options: &HybridOptions,
) -> Result<(Box<ShareFn>, Box<PassHook>), LlamaError> {
    let residency: Arc<Residency> =
        weights
            .residency_handle()
            .ok_or_else(|| LlamaError::Config {
                setting: "--placement auto",
                message: "the weights do not come through residency".into(),
            })?;
    let planned: Arc<Planned> = Arc::from(planned_shares(meta, &residency, options)?);
    let plan = residency.plan();
    // The embedding table is looked up by token on the GPU: always whole.
    let embed = meta.blob_index(weights_format::names::EMBED_BLOB);
    let split_blobs: Vec<bool> = (0..plan.blobs.len())
        .map(|b| plan.placement(b) == Placement::HostCached && Some(b) != embed)
        .collect();
    let streamed = split_blobs.iter().filter(|&&s| s).count();
    if streamed <= plan.ring_slots {
        tracing::info!(
            streamed,
            ring_slots = plan.ring_slots,
            "--placement auto: too few blobs stream to split (a blob could be refilled while in \
             use); the GPU computes everything"
        );
    }
    // The rows of the pass being run, which the fills started now are for.
    let rows_now = Arc::new(AtomicUsize::new(1));
    if streamed > plan.ring_slots {
        let (planned, rows_now) = (Arc::clone(&planned), Arc::clone(&rows_now));
        let blobs = meta.blobs.clone();
        residency.set_fill_ranges(Some(Arc::new(move |blob| {
            if !split_blobs.get(blob).copied().unwrap_or(false) {
                return None;
            }
            let share = planned(blob, rows_now.load(Ordering::Relaxed));
            (share > 0.0).then(|| (share.to_bits(), primary_ranges(&blobs[blob], share)))
        })));
    }
    let hook: Box<PassHook> = Box::new(move |rows| rows_now.store(rows, Ordering::Relaxed));
    // The share a blob's fill holds, as completed for this pass when it was acquired (the CPU
    // computes exactly the rows the fill left out); none for a whole fill: the GPU has every
    // byte, and splitting would only add work.
    let share: Box<ShareFn> =
        Box::new(move |blob, _rows| residency.filled_with(blob).map_or(0.0, f64::from_bits));
    Ok((share, hook))
}
