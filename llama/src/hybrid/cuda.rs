//! The split on a CUDA GPU: [`SplitBackend`] over the CUDA backend (the primary: every op,
//! the KV caches, the rows `[k, n)` of each split matmul) and the CPU backend (the helper:
//! rows `[0, k)`), its weights through residency with each streamed blob's host-tier copy
//! handed out beside the device copy ([`CudaWeights::with_host_copies`]): the CPU reads the
//! pinned host tier in place, nothing is copied for it.
//!
//! # Which share, and what streams
//!
//! Each blob streamed from the host tier gets one CPU share `f` for the run: the placement
//! planner's (`residency::placement`, on the residency plan this run has and this machine's
//! calibration) for a decode step of one row, where the split pays most. Its byte ranges
//! without the CPU's rows — rows `[k, n)` of each matmul weight, every other tensor whole —
//! are given to residency ([`residency::Residency::set_split_ranges`]), which then copies only
//! those from the host tier: the PCIe link carries the GPU's share while the CPU reads its
//! own from RAM, and the two bandwidths add up.
//!
//! A pass is split when the planner gives its row count a CPU share at all (decode steps;
//! not a prefill chunk, whose GPU work per byte dwarfs the CPU's). Before it starts,
//! residency is told whether fills may skip the CPU's rows
//! ([`residency::Residency::set_partial_fills`]); the first blobs of a pass may have been
//! filled during the previous one, so a blob whose fill skipped them
//! ([`residency::Residency::filled_partially`]) is split whatever the pass: a prefill after
//! decode steps has the CPU compute its share of those (at most the ring's slots of blobs)
//! at the prefill's rows. That is why partial fills need more streamed blobs than ring slots
//! (else a blob could be refilled while in use), and are off otherwise.
//!
//! The decode CUDA graph is off (every op is issued each step: the CPU's work between the
//! primary's ops cannot be captured). With layers streaming, graphs are not replayed anyway.

use std::collections::HashMap;
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

/// The planner's shares: `options.force_cpu_fraction` for every blob when set, else the
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
        return Ok(Box::new(move |_, _| fraction));
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
            let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
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
    let planned = planned_shares(meta, &residency, options)?;
    let plan = residency.plan();
    let host_blobs: Vec<usize> = (0..plan.blobs.len())
        .filter(|&b| plan.placement(b) == Placement::HostCached)
        .collect();
    // The embedding table is looked up by token on the GPU: always whole.
    let embed = meta.blob_index(weights_format::names::EMBED_BLOB);
    let mut fixed = vec![0.0; meta.blobs.len()];
    for &b in &host_blobs {
        fixed[b] = planned(b, 1);
        if fixed[b] > 0.0 && Some(b) != embed {
            residency.set_split_ranges(b, primary_ranges(&meta.blobs[b], fixed[b]))?;
        }
    }
    let partial_fills = host_blobs.len() > plan.ring_slots;
    if !partial_fills {
        tracing::info!(
            streamed = host_blobs.len(),
            ring_slots = plan.ring_slots,
            "--placement auto: too few streamed blobs to copy only the GPU's share of each"
        );
    }
    let split_rows: Mutex<HashMap<usize, bool>> = Mutex::default();
    let planned = Arc::new(planned);
    let blobs = host_blobs.clone();
    let split_pass = Arc::new(move |rows: usize| {
        let mut known = split_rows.lock().unwrap_or_else(|e| e.into_inner());
        *known
            .entry(rows)
            .or_insert_with(|| blobs.iter().any(|&b| planned(b, rows) > 0.0))
    });
    let hook_residency = Arc::clone(&residency);
    let hook_split = Arc::clone(&split_pass);
    let hook: Box<PassHook> = Box::new(move |rows| {
        hook_residency.set_partial_fills(partial_fills && hook_split(rows));
    });
    let share: Box<ShareFn> = Box::new(move |blob, rows| {
        let f = fixed.get(blob).copied().unwrap_or(0.0);
        if f > 0.0 && (residency.filled_partially(blob) || split_pass(rows)) {
            f
        } else {
            0.0
        }
    });
    Ok((share, hook))
}
