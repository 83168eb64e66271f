//! Where the forward pass gets weight bytes from, and the typed view of one tensor that the
//! backends compute with.
//!
//! Bytes flow one way: residency (or an in-memory source) hands out a blob as
//! [`WeightBytes`] — host memory or a device range, never an empty slice standing for device
//! memory — the model cuts its tensors out of it with the offsets it resolved once at load
//! ([`crate::model::arch`]), and each backend op receives a [`WeightView`] in the memory that
//! backend computes from.

use std::path::Path;
use std::sync::Arc;

use weights_format::{DType, Metadata};

use crate::LlamaError;

pub use residency::{DevicePtr, WeightBytes};

/// A weight tensor as stored in a blob: row-major `[rows, cols]` (a vector has `rows == 1`),
/// `cols` a whole number of `dtype` blocks, in host or device memory.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: WeightBytes<'a>,
}

impl<'a> WeightView<'a> {
    /// A view of host bytes.
    pub fn host(dtype: DType, rows: usize, cols: usize, bytes: &'a [u8]) -> WeightView<'a> {
        WeightView {
            dtype,
            rows,
            cols,
            bytes: WeightBytes::Host(bytes),
        }
    }

    /// A view of device memory.
    pub fn device(dtype: DType, rows: usize, cols: usize, ptr: DevicePtr<'a>) -> WeightView<'a> {
        WeightView {
            dtype,
            rows,
            cols,
            bytes: WeightBytes::Device(ptr),
        }
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_len() * self.dtype.block_bytes()
    }
}

/// One acquired blob: where its bytes are, valid while the value lives.
pub trait BlobBytes {
    fn bytes(&self) -> WeightBytes<'_>;
}

impl BlobBytes for &[u8] {
    fn bytes(&self) -> WeightBytes<'_> {
        WeightBytes::Host(self)
    }
}

impl BlobBytes for residency::BlobGuard<'_> {
    fn bytes(&self) -> WeightBytes<'_> {
        residency::BlobGuard::bytes(self)
    }
}

/// Supplies blob bytes in the order a forward pass needs them.
pub trait WeightSource {
    /// One whole blob, valid while the guard lives.
    type Guard<'a>: BlobBytes
    where
        Self: 'a;

    /// The whole blob `index` (into `metadata.blobs`).
    fn acquire(&self, index: usize) -> Result<Self::Guard<'_>, LlamaError>;

    /// `len` bytes of blob `index` from `offset`, in host memory (embedding rows of an untied
    /// model).
    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError>;

    /// Called after each forward pass (after the LM head).
    fn end_pass(&self);

    /// The residency cache the weights come through, shared: its statistics can be read while
    /// the model is busy (`/metrics`).
    fn residency_handle(&self) -> Option<Arc<residency::Residency>> {
        None
    }

    /// The residency cache's statistics, when weights come through one.
    fn residency_stats(&self) -> Option<residency::ResidencyStats> {
        self.residency_handle().map(|r| r.stats())
    }

    /// Whether every blob stays where it is for the model's lifetime (nothing streams): then
    /// a blob's address never changes, so a recorded pass may keep using it.
    fn all_resident(&self) -> bool {
        false
    }
}

/// Every blob read whole into memory: a [`WeightSource`] for tests and tools that build models
/// in memory. The runtime reads weights through `residency` instead.
#[derive(Debug, Clone)]
pub struct InMemoryWeights {
    blobs: Vec<Vec<u8>>,
}

impl InMemoryWeights {
    /// Blob bytes in `metadata.blobs` order.
    pub fn new(blobs: Vec<Vec<u8>>) -> InMemoryWeights {
        InMemoryWeights { blobs }
    }

    /// Reads every blob named in `meta` from `dir`.
    pub fn read_dir(dir: &Path, meta: &Metadata) -> Result<InMemoryWeights, LlamaError> {
        let blobs = meta
            .blobs
            .iter()
            .map(|b| {
                let path = dir.join(&b.file);
                std::fs::read(&path).map_err(|source| LlamaError::Io { path, source })
            })
            .collect::<Result<_, _>>()?;
        Ok(InMemoryWeights { blobs })
    }

    /// The blobs, in `metadata.blobs` order.
    pub fn into_blobs(self) -> Vec<Vec<u8>> {
        self.blobs
    }

    fn blob(&self, index: usize) -> Result<&[u8], LlamaError> {
        self.blobs
            .get(index)
            .map(Vec::as_slice)
            .ok_or_else(|| LlamaError::MissingBlob {
                file: format!("#{index}"),
            })
    }
}

/// `len` bytes of blob `index` (whose bytes are `blob`) from `offset`, or an error naming the
/// blob when the range is past its end: `read_range` of the weight sources held in memory.
pub(crate) fn copy_range(
    blob: &[u8],
    index: usize,
    offset: u64,
    len: usize,
) -> Result<Vec<u8>, LlamaError> {
    usize::try_from(offset)
        .ok()
        .and_then(|o| blob.get(o..o.checked_add(len)?))
        .map(<[u8]>::to_vec)
        .ok_or_else(|| LlamaError::Weights {
            blob: format!("#{index}"),
            message: format!(
                "range {offset}+{len} is past the end ({} bytes)",
                blob.len()
            ),
        })
}

impl WeightSource for InMemoryWeights {
    type Guard<'a> = &'a [u8];

    fn acquire(&self, index: usize) -> Result<&[u8], LlamaError> {
        self.blob(index)
    }

    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError> {
        copy_range(self.blob(index)?, index, offset, len)
    }

    fn end_pass(&self) {}

    /// The blobs are never moved or replaced.
    fn all_resident(&self) -> bool {
        true
    }
}

/// The production path: every blob comes through the residency cache (O_DIRECT reads into
/// aligned memory, planned resident set, staging ring with prefetch).
impl WeightSource for residency::Residency {
    type Guard<'a> = residency::BlobGuard<'a>;

    fn acquire(&self, index: usize) -> Result<residency::BlobGuard<'_>, LlamaError> {
        Ok(residency::Residency::acquire(self, index)?)
    }

    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError> {
        Ok(residency::Residency::read_range(
            self, index, offset, len as u64,
        )?)
    }

    fn end_pass(&self) {
        residency::Residency::end_pass(self)
    }

    fn residency_stats(&self) -> Option<residency::ResidencyStats> {
        Some(self.stats())
    }

    fn all_resident(&self) -> bool {
        nothing_streams(self)
    }
}

/// Whether the plan of `residency` keeps every blob resident (nothing read per pass).
fn nothing_streams(residency: &residency::Residency) -> bool {
    let plan = residency.plan();
    plan.disk_bytes_per_pass == 0 && plan.host_bytes_per_pass == 0
}

/// Residency shared between the model (which reads weights through it) and whoever reads its
/// statistics while the model is busy (`/metrics`): the CPU backend's production source.
impl WeightSource for Arc<residency::Residency> {
    type Guard<'a> = residency::BlobGuard<'a>;

    fn acquire(&self, index: usize) -> Result<residency::BlobGuard<'_>, LlamaError> {
        WeightSource::acquire(&**self, index)
    }

    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError> {
        WeightSource::read_range(&**self, index, offset, len)
    }

    fn end_pass(&self) {
        residency::Residency::end_pass(self)
    }

    fn residency_handle(&self) -> Option<Arc<residency::Residency>> {
        Some(Arc::clone(self))
    }

    fn all_resident(&self) -> bool {
        nothing_streams(self)
    }
}
