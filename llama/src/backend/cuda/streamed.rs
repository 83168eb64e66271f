//! Weights streamed into device memory by `residency` for the CUDA backend, and the loader that
//! puts a model directory on a GPU.
//!
//! Residency's reader thread fills ring slots and resident blobs in device memory through
//! `gds-io` (cuFile, or O_DIRECT → pinned ring → async copy); a filled blob is visible to every
//! stream. Kernels that read a streamed slot are only queued when its guard drops, so the guard
//! records an event on the compute stream and hands it to residency as the slot's release fence:
//! the reader (not the compute thread) waits for it before refilling the slot. The compute
//! thread therefore never synchronises with the device per layer; it only waits when a blob it
//! needs has not been read yet.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use residency::{BlobGuard, GpuMemory, ReleaseFence, Residency, ResidencyOptions};

use super::CudaBackend;
use crate::LlamaError;
use crate::backend::Backend;
use crate::config::LlamaConfig;
use crate::load::{LoadedModel, ModelFiles};
use crate::weights::{BlobBytes, WeightSource};

/// Most positions one forward pass computes on the GPU: longer prompts take several passes.
/// Bounds the activation buffers (a 7B model needs ~70 KiB per position) without costing
/// prefill speed (512 rows already fill the matmul kernels).
pub const GPU_MAX_ROWS: usize = 512;

/// Bytes of device memory the f16 KV caches of `sequences` sequences of `context` positions,
/// the activation buffers of `max_rows` positions (f32) and a margin for kernels and
/// temporaries take besides the weights.
pub fn device_reserved_bytes(
    model: &weights_format::ModelConfig,
    context: usize,
    sequences: usize,
    max_rows: usize,
) -> Result<u64, LlamaError> {
    let c = LlamaConfig::from_model_config(model)?;
    let kv = residency::kv_cache_bytes(model, context as u64, 2) * sequences as u64;
    let per_row = 3 * c.dim + 2 * c.q_dim() + 2 * c.kv_dim() + 2 * c.ffn_dim;
    let activations = ((max_rows * per_row + 2 * c.dim + c.vocab_size) * 4) as u64;
    let margin = 256 << 20;
    Ok(kv + activations + margin)
}

/// A device-side release fence: an event recorded on the compute stream after the last kernel
/// that reads a slot.
struct EventFence(CudaEvent);

impl ReleaseFence for EventFence {
    fn wait(&self) -> Result<(), String> {
        self.0
            .synchronize()
            .map_err(|e| format!("cuEventSynchronize: {e}"))
    }
}

/// Model weights in device memory through the residency cache.
pub struct CudaWeights {
    residency: Arc<Residency>,
    memory: Arc<GpuMemory>,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for CudaWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaWeights")
            .field("memory", &self.memory)
            .finish_non_exhaustive()
    }
}

impl CudaWeights {
    pub fn residency(&self) -> &Residency {
        &self.residency
    }

    /// The cache, shared: its statistics can be read while the model is busy (`/metrics`).
    pub fn residency_handle(&self) -> Arc<Residency> {
        Arc::clone(&self.residency)
    }

    /// The GPU memory the cache lives in (its I/O backend and statistics).
    pub fn memory(&self) -> &GpuMemory {
        &self.memory
    }
}

/// A blob acquired for the CUDA backend; see the module documentation for its release fence.
pub struct CudaBlobGuard<'a> {
    inner: BlobGuard<'a>,
    stream: &'a Arc<CudaStream>,
}

impl BlobBytes for CudaBlobGuard<'_> {
    fn host(&self) -> &[u8] {
        &self.inner
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn device_ptr(&self) -> Option<u64> {
        self.inner.device_ptr()
    }
}

impl Drop for CudaBlobGuard<'_> {
    fn drop(&mut self) {
        if self.inner.is_resident() {
            return;
        }
        // Blocking sync: the reader thread sleeps on the fence instead of spinning a core.
        let event = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC));
        match event {
            Ok(event) => self.inner.release_after(Box::new(EventFence(event))),
            Err(err) => {
                // Without an event the only safe release is after the stream drains.
                tracing::warn!("recording a release event failed ({err}); synchronising instead");
                let _ = self.stream.synchronize();
            }
        }
    }
}

impl WeightSource for CudaWeights {
    type Guard<'a> = CudaBlobGuard<'a>;

    fn acquire(&self, index: usize) -> Result<CudaBlobGuard<'_>, LlamaError> {
        Ok(CudaBlobGuard {
            inner: self.residency.acquire(index)?,
            stream: &self.stream,
        })
    }

    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError> {
        Ok(self.residency.read_range(index, offset, len as u64)?)
    }

    fn end_pass(&self) {
        self.residency.end_pass()
    }

    fn residency_stats(&self) -> Option<residency::ResidencyStats> {
        Some(self.residency.stats())
    }

    fn all_resident(&self) -> bool {
        let plan = self.residency.plan();
        plan.disk_bytes_per_pass == 0 && plan.host_bytes_per_pass == 0
    }
}

/// A model on a CUDA GPU.
pub type CudaModel = LoadedModel<CudaBackend, CudaWeights>;

/// Opens `dir` on CUDA device `ordinal` with KV caches of `context` positions (0: the model's
/// context length) for `sequences` sequences decoded together (1: one at a time). What stays
/// resident and what streams is residency's plan for `options` (`--vram-budget`,
/// `--host-cache`, …); the KV caches, activations and a margin are reserved first. `io` picks
/// how blobs reach device memory (auto: cuFile where GDS DMA works, else O_DIRECT through a
/// pinned staging buffer).
pub fn load_cuda(
    dir: impl AsRef<Path>,
    options: &ResidencyOptions,
    context: usize,
    sequences: usize,
    ordinal: usize,
    io: residency::IoChoice,
) -> Result<CudaModel, LlamaError> {
    let started = Instant::now();
    let files = ModelFiles::open(dir.as_ref())?;
    let context = files.context(context);
    let sequences = sequences.max(1);
    // A batch's pass holds one row per sequence plus a prefill chunk.
    let max_rows = if sequences > 1 {
        sequences + crate::batch::DEFAULT_PREFILL_CHUNK
    } else {
        context.min(GPU_MAX_ROWS)
    };
    let mut options = options.clone();
    options.reserved_bytes =
        device_reserved_bytes(&files.metadata.config, context, sequences, max_rows)?;
    let backend = CudaBackend::new(ordinal)?;
    let (residency, memory) = Residency::open_gpu(&files.model, &options, ordinal, io)?;
    let plan = residency.plan();
    tracing::info!(
        device = backend.device_name(),
        io = %memory.io_path(),
        budget = plan.device_budget,
        resident_bytes = plan.resident_bytes,
        resident_layers = plan.resident_layers,
        streamed_bytes_per_pass = plan.disk_bytes_per_pass + plan.host_bytes_per_pass,
        "model on the GPU"
    );
    let weights = CudaWeights {
        residency: Arc::new(residency),
        memory,
        stream: Arc::clone(backend.stream()),
    };
    let llama = crate::Llama::new(backend, weights, files.metadata.clone(), context, max_rows)?;
    llama.backend().status()?;
    Ok(files.finish(llama, started))
}
