//! The cache of layer blobs in device memory.
//!
//! This crate is for: planning which blobs stay resident for the whole run and which stream
//! through a ring of staging slots, prefetching in layer order, the optional pinned host tier,
//! checking each blob against its checksum on its first read ([`BlobChecksums`]), the network
//! tier below the disk (a model served over HTTP, fetched blob by blob on first use), and the
//! statistics of all of it.
//!
//! It is not for: doing the reads or the HTTP transfers themselves (that is `gds-io` and
//! `gdsllm-fetch`) or interpreting tensors (that is `llama`).
//!
//! Layers: [`plan`] decides (pure), [`engine`] schedules reads and counts (pure state machine,
//! driven with event times), [`Residency`] runs it with buffers from a [`DeviceMemory`], a
//! reader thread over a [`BlobSource`] (the model's files, or [`network`]'s fetched on first
//! use) and a [`Clock`]; [`sim`] drives the same engine on a virtual clock for deterministic
//! checks and predictions.

pub mod clock;
pub mod engine;
mod error;
pub mod gpu;
pub mod memory;
pub mod network;
mod options;
pub mod placement;
pub mod plan;
mod runtime;
pub mod sim;
pub mod source;
mod stats;

pub use clock::{Clock, SystemClock, VirtualClock};
pub use error::ResidencyError;
pub use gds_io::DevicePtr;
pub use gds_io::{IoChoice, IoPath};
pub use gpu::GpuMemory;
pub use memory::{
    Completion, CpuMemory, DeviceBuffer, DeviceMemory, HostBlock, ReleaseFence, WeightBytes,
};
pub use network::{NetworkSource, Origin, init_cache};
pub use options::{
    AUTO_RAM_SHARE, BlobChecksums, Budget, HostCache, ParseBytesError, Policy, ResidencyOptions,
    human_bytes, mem_available, parse_bytes,
};
pub use placement::{
    CALIBRATION_VERSION, Calibration, ConcurrentRate, CpuRate, GpuMatmulRate, GpuRates, PassKind,
    PassPlacement, PlacementMode, PlacementPlan, Tier, Unit, UnitPlacement, plan_placement, units,
};
pub use plan::{
    BlobInfo, BlobKind, ModelLayout, Placement, Plan, PlanInputs, PlannedBlob, kv_cache_bytes,
    kv_positions,
};
pub use runtime::{BlobGuard, FillRangesFn, GPU_AUTO_MARGIN, Residency, plan_inputs};
pub use source::{BlobSource, HostFileSource, PatternSource, open_model_source};
pub use stats::{MAX_KEPT_PASSES, PassStats, ResidencyStats};
