//! Where the forward pass gets weight bytes from, and typed, checked views of the tensors
//! inside a blob.
//!
//! [`WeightSource`] is the forward pass's only way to weights. It mirrors `residency`'s API
//! (acquire a whole blob for the duration of its use, `read_range` for embedding rows of an
//! untied model, `end_pass` after the LM head) so that the production path is residency itself.

use std::path::Path;

use weights_format::{BlobMeta, DType, Metadata, names};

use crate::LlamaError;
use crate::backend::WeightView;

/// Where one acquired blob's bytes are: host memory (the CPU backend), device memory (the CUDA
/// backend streaming through residency), or both (weights uploaded once for tests).
pub trait BlobBytes {
    /// The bytes in host memory; empty when the blob is only in device memory.
    fn host(&self) -> &[u8];
    /// The blob's length in bytes.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device address of the blob's first byte, when it is in device memory.
    fn device_ptr(&self) -> Option<u64> {
        None
    }
}

impl BlobBytes for &[u8] {
    fn host(&self) -> &[u8] {
        self
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

impl BlobBytes for residency::BlobGuard<'_> {
    fn host(&self) -> &[u8] {
        self
    }
    fn len(&self) -> usize {
        residency::BlobGuard::len(self)
    }
    fn device_ptr(&self) -> Option<u64> {
        residency::BlobGuard::device_ptr(self)
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

    /// `len` bytes of blob `index` from `offset` (embedding rows of an untied model).
    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError>;

    /// Called after each forward pass (after the LM head).
    fn end_pass(&self);

    /// The residency cache's statistics, when weights come through one.
    fn residency_stats(&self) -> Option<residency::ResidencyStats> {
        None
    }

    /// Whether every blob stays where it is for the model's lifetime (nothing streams): then
    /// a blob's address never changes, so a recorded decode step may keep using it, and
    /// acquiring the whole embedding table costs nothing.
    fn all_resident(&self) -> bool {
        false
    }
}

/// Blob indices of one model, in streaming order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobLayout {
    pub embed: usize,
    pub layers: Vec<usize>,
    pub output: usize,
}

impl BlobLayout {
    /// Finds `embed.bin`, `layer_NNN.bin` and `output.bin` in `metadata.blobs`.
    pub fn from_metadata(meta: &Metadata, n_layers: usize) -> Result<BlobLayout, LlamaError> {
        let find = |file: &str| {
            meta.blobs
                .iter()
                .position(|b| b.file == file)
                .ok_or_else(|| LlamaError::MissingBlob {
                    file: file.to_string(),
                })
        };
        Ok(BlobLayout {
            embed: find(names::EMBED_BLOB)?,
            layers: (0..n_layers)
                .map(|i| find(&names::layer_blob(i)))
                .collect::<Result<_, _>>()?,
            output: find(names::OUTPUT_BLOB)?,
        })
    }
}

/// Finds tensor `name` in `blob` (whose bytes `bytes` holds) and checks its shape and extent.
/// `expected` is the row-major shape the forward pass needs: `[rows, cols]` or `[len]`.
pub fn tensor<'a, G: BlobBytes + ?Sized>(
    blob: &BlobMeta,
    bytes: &'a G,
    name: &str,
    expected: &[usize],
) -> Result<WeightView<'a>, LlamaError> {
    let t = blob.tensor(name).ok_or_else(|| LlamaError::MissingTensor {
        blob: blob.file.clone(),
        name: name.to_string(),
    })?;
    let expected_u64: Vec<u64> = expected.iter().map(|&d| d as u64).collect();
    if t.shape != expected_u64 {
        return Err(LlamaError::TensorShape {
            blob: blob.file.clone(),
            name: name.to_string(),
            found: t.shape.clone(),
            expected: expected_u64,
        });
    }
    let bounds = || LlamaError::TensorBounds {
        blob: blob.file.clone(),
        name: name.to_string(),
        dtype: t.dtype,
        offset: t.offset,
        length: t.length,
        blob_len: bytes.len(),
    };
    let host = bytes.host();
    if t.dtype.byte_len(&t.shape) != Some(t.length) {
        return Err(bounds());
    }
    let start = usize::try_from(t.offset).map_err(|_| bounds())?;
    let len = usize::try_from(t.length).map_err(|_| bounds())?;
    let end = start.checked_add(len).ok_or_else(bounds)?;
    if end > bytes.len() {
        return Err(bounds());
    }
    let device = bytes.device_ptr().map(|p| p + start as u64);
    // Device-only blobs have no host bytes: the view is empty there and carries the address.
    let slice = match (host.get(start..end), device) {
        (Some(s), _) => s,
        (None, Some(_)) => &[],
        (None, None) => return Err(bounds()),
    };
    let (rows, cols) = match expected {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        _ => return Err(bounds()),
    };
    Ok(WeightView {
        dtype: t.dtype,
        rows,
        cols,
        bytes: slice,
        device,
    })
}

/// The dtype, byte offset and row length of the embedding table, for `read_range` lookups.
pub(crate) fn embedding_rows(
    blob: &BlobMeta,
    vocab: usize,
    dim: usize,
) -> Result<(DType, u64, usize), LlamaError> {
    let t = blob
        .tensor(names::TOKEN_EMBD)
        .ok_or_else(|| LlamaError::MissingTensor {
            blob: blob.file.clone(),
            name: names::TOKEN_EMBD.to_string(),
        })?;
    if t.shape != [vocab as u64, dim as u64] {
        return Err(LlamaError::TensorShape {
            blob: blob.file.clone(),
            name: names::TOKEN_EMBD.to_string(),
            found: t.shape.clone(),
            expected: vec![vocab as u64, dim as u64],
        });
    }
    let row_bytes = dim / t.dtype.block_len() * t.dtype.block_bytes();
    Ok((t.dtype, t.offset, row_bytes))
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
}
