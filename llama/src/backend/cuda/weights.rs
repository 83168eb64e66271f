//! Weights in device memory, as the kernels take them: [`DevicePtr`]s, never host bytes.
//!
//! Two sources hand them out. [`CudaWeights`] is the runtime's: residency's reader thread
//! fills ring slots and resident blobs in device memory through `gds-io` (cuFile, or O_DIRECT →
//! pinned ring → async copy); a filled blob is visible to every stream. Kernels that read a
//! streamed slot are only queued when its guard drops, so the guard records an event on the
//! compute stream and hands it to residency as the slot's release fence: the reader (not the
//! compute thread) waits for it before refilling the slot. The compute thread therefore never
//! synchronises with the device per layer; it only waits when a blob it needs has not been
//! read yet. [`DeviceWeights`] is the tests' reference: every blob uploaded once.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice};
use residency::{BlobGuard, GpuMemory, ReleaseFence, Residency};

use crate::LlamaError;
use crate::backend::BackendError;
use crate::weights::{BlobBytes, DevicePtr, WeightBytes, WeightSource, WeightView, copy_range};

use super::CudaBackend;
use super::device::Queue;

/// The device range of a weight; host bytes are an error (nothing is uploaded behind the
/// caller's back).
pub(super) fn device_ptr<'a>(w: &WeightView<'a>) -> Result<DevicePtr<'a>, BackendError> {
    w.bytes.device().ok_or(BackendError::WrongMemory {
        backend: "cuda",
        found: "host",
    })
}

/// Every blob of a model in device memory, uploaded once ([`CudaBackend::upload_weights`]),
/// with the host copy the untied embedding rows are read from: the upload-once path the tests
/// compare the runtime's residency path with.
#[derive(Clone)]
pub struct DeviceWeights {
    host: Arc<Vec<Vec<u8>>>,
    /// Each blob's device copy and its address.
    device: Arc<Vec<(CudaSlice<u8>, u64)>>,
}

impl std::fmt::Debug for DeviceWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceWeights")
            .field("blobs", &self.host.len())
            .field("bytes", &self.total_bytes())
            .finish()
    }
}

impl DeviceWeights {
    /// Bytes of all blobs.
    pub fn total_bytes(&self) -> usize {
        self.host.iter().map(Vec::len).sum()
    }
}

/// A blob of [`DeviceWeights`].
pub struct DeviceBlob<'a> {
    ptr: DevicePtr<'a>,
}

impl<'a> DeviceBlob<'a> {
    /// The blob's device range, for as long as the weights live.
    pub fn ptr(&self) -> DevicePtr<'a> {
        self.ptr
    }
}

impl BlobBytes for DeviceBlob<'_> {
    fn bytes(&self) -> WeightBytes<'_> {
        WeightBytes::Device(self.ptr)
    }
}

impl WeightSource for DeviceWeights {
    type Guard<'a> = DeviceBlob<'a>;

    fn acquire(&self, index: usize) -> Result<DeviceBlob<'_>, LlamaError> {
        let (slice, addr) = self
            .device
            .get(index)
            .ok_or_else(|| LlamaError::MissingBlob {
                file: format!("#{index}"),
            })?;
        // SAFETY: the slice is owned by `self.device`, which the borrow of `self` keeps alive,
        // and holds `slice.len()` bytes at `addr`.
        let ptr = unsafe { DevicePtr::from_raw(*addr, slice.len()) };
        Ok(DeviceBlob { ptr })
    }

    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError> {
        let blob = self
            .host
            .get(index)
            .ok_or_else(|| LlamaError::MissingBlob {
                file: format!("#{index}"),
            })?;
        copy_range(blob, index, offset, len)
    }

    fn end_pass(&self) {}

    /// Uploaded once: every blob stays at its device address while the weights live (so the
    /// backend may record decode passes, as it does for a wholly resident residency plan).
    fn all_resident(&self) -> bool {
        true
    }
}

impl CudaBackend {
    /// Copies every blob (in `metadata.blobs` order) to device memory once and returns them
    /// as a weight source.
    pub fn upload_weights(&self, blobs: Vec<Vec<u8>>) -> Result<DeviceWeights, LlamaError> {
        let mut device = Vec::with_capacity(blobs.len());
        for bytes in &blobs {
            let slice = self.queue.upload(bytes, "uploading a weight blob")?;
            let addr = self.queue.addr(&slice);
            device.push((slice, addr));
        }
        self.queue.synchronize()?;
        Ok(DeviceWeights {
            host: Arc::new(blobs),
            device: Arc::new(device),
        })
    }
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
    queue: Arc<Queue>,
    /// Streamed blobs are handed out with their host-tier copy too
    /// ([`CudaWeights::with_host_copies`]).
    host_copies: bool,
}

impl std::fmt::Debug for CudaWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaWeights")
            .field("memory", &self.memory)
            .finish_non_exhaustive()
    }
}

impl CudaWeights {
    /// Weights read through `residency` into `memory`, for kernels queued by `backend` (whose
    /// stream the release fences are recorded on).
    pub fn new(residency: Residency, memory: Arc<GpuMemory>, backend: &CudaBackend) -> CudaWeights {
        CudaWeights {
            residency: Arc::new(residency),
            memory,
            queue: Arc::clone(&backend.queue),
            host_copies: false,
        }
    }

    /// Hands out each streamed blob that the host tier holds as
    /// [`crate::weights::WeightBytes::Both`]: device memory for the GPU's kernels and the
    /// pinned host copy the CPU reads in place (`crate::hybrid` splits matmuls that way).
    pub fn with_host_copies(mut self) -> CudaWeights {
        self.host_copies = true;
        self
    }

    pub fn residency(&self) -> &Residency {
        &self.residency
    }

    /// The GPU memory the cache lives in (its I/O backend and statistics).
    pub fn memory(&self) -> &GpuMemory {
        &self.memory
    }
}

/// A blob acquired for the CUDA backend; see the module documentation for its release fence.
pub struct CudaBlobGuard<'a> {
    inner: BlobGuard<'a>,
    queue: &'a Queue,
}

impl BlobBytes for CudaBlobGuard<'_> {
    fn bytes(&self) -> WeightBytes<'_> {
        self.inner.bytes()
    }
}

impl Drop for CudaBlobGuard<'_> {
    fn drop(&mut self) {
        if self.inner.is_resident() {
            return;
        }
        match self.queue.record_blocking_event() {
            Ok(event) => self.inner.release_after(Box::new(EventFence(event))),
            Err(err) => {
                // Without an event the only safe release is after the stream drains.
                tracing::warn!("recording a release event failed ({err}); synchronising instead");
                let _ = self.queue.synchronize();
            }
        }
    }
}

impl WeightSource for CudaWeights {
    type Guard<'a> = CudaBlobGuard<'a>;

    fn acquire(&self, index: usize) -> Result<CudaBlobGuard<'_>, LlamaError> {
        let inner = if self.host_copies {
            Residency::acquire_with_host_copy(&self.residency, index)?
        } else {
            Residency::acquire(&self.residency, index)?
        };
        Ok(CudaBlobGuard {
            inner,
            queue: &self.queue,
        })
    }

    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError> {
        Ok(Residency::read_range(
            &self.residency,
            index,
            offset,
            len as u64,
        )?)
    }

    fn end_pass(&self) {
        Residency::end_pass(&self.residency)
    }

    fn residency_handle(&self) -> Option<Arc<Residency>> {
        Some(Arc::clone(&self.residency))
    }

    fn all_resident(&self) -> bool {
        let plan = self.residency.plan();
        plan.disk_bytes_per_pass == 0 && plan.host_bytes_per_pass == 0
    }
}
