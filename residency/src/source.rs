//! Where blob bytes come from: the model's files (through `gds_io::host`), those files fetched
//! first from the server a model is served from (`crate::network`), or a pattern generator for
//! tests and benches.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use gds_io::{DirectFile, ParallelRead};
use weights_format::Metadata;

use crate::error::ResidencyError;

/// Reads blob `i`, or a byte range of it, into a destination buffer.
pub trait BlobSource: Send + Sync {
    /// Number of blobs.
    fn blob_count(&self) -> usize;
    /// File name (or another human name) of the blob, for messages.
    fn blob_name(&self, blob: usize) -> String;
    /// Fills `dst` from the start of the blob. `dst` is 4096-aligned in address and length
    /// and at least the blob's length rounded up to 4096; bytes past the blob's end are
    /// unspecified.
    fn read_blob(&self, blob: usize, dst: &mut [u8]) -> Result<(), ResidencyError>;
    /// Reads `dst.len()` bytes at `offset` inside the blob (no alignment required).
    fn read_range(&self, blob: usize, offset: u64, dst: &mut [u8]) -> Result<(), ResidencyError>;
    /// The XXH3-64 the blob's bytes must hash to, when the source knows it (metadata.json).
    fn checksum(&self, _blob: usize) -> Option<u64> {
        None
    }
    /// The blob's length in bytes.
    fn blob_len(&self, blob: usize) -> u64;
    /// Makes the blob readable from local files (the network tier fetches it the first time);
    /// returns the bytes that crossed the network for it. The runtime calls it before every
    /// read, so that readers of the files themselves (the GPU's I/O paths) find the bytes.
    fn ensure_local(&self, _blob: usize) -> Result<u64, ResidencyError> {
        Ok(0)
    }
    /// XXH3-64 of the whole blob, read in pieces (for blobs that are never read whole).
    fn hash_blob(&self, blob: usize) -> Result<u64, ResidencyError> {
        const PIECE: u64 = 8 << 20;
        let len = self.blob_len(blob);
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut piece = vec![0u8; PIECE.min(len) as usize];
        let mut offset = 0;
        while offset < len {
            let n = PIECE.min(len - offset) as usize;
            self.read_range(blob, offset, &mut piece[..n])?;
            hasher.update(&piece[..n]);
            offset += n as u64;
        }
        Ok(hasher.digest())
    }
}

/// The source of the model in `dir`: its files, or, for a cache of a model served over HTTP
/// (`origin.json`), its files fetched first from the origin where missing.
pub fn open_model_source(
    dir: &Path,
    meta: &Metadata,
    how: ParallelRead,
) -> Result<Arc<dyn BlobSource>, ResidencyError> {
    let origin = crate::network::Origin::read(dir)?;
    let source: Arc<dyn BlobSource> = match origin {
        Some(origin) => Arc::new(crate::network::NetworkSource::open(dir, meta, origin, how)?),
        None => {
            let files = HostFileSource::open(dir, meta, how)?;
            if !files.all_direct() {
                tracing::info!(dir = %dir.display(), "model blobs are read through the page cache (no O_DIRECT on this filesystem)");
            }
            Arc::new(files)
        }
    };
    Ok(source)
}

/// The value of a `xxh3:<16 hex>` checksum of metadata.json (already validated by
/// `Model::open`; anything else is treated as unknown).
fn parse_checksum(text: &str) -> Option<u64> {
    u64::from_str_radix(text.strip_prefix("xxh3:")?, 16).ok()
}

/// The model's blob files, read with O_DIRECT (where the filesystem allows it) by a few
/// threads per blob.
#[derive(Debug)]
pub struct HostFileSource {
    files: Vec<DirectFile>,
    names: Vec<String>,
    checksums: Vec<Option<u64>>,
    how: ParallelRead,
}

impl HostFileSource {
    /// Opens every blob file of the model in `dir` and checks its length against the metadata.
    pub fn open(dir: &Path, meta: &Metadata, how: ParallelRead) -> Result<Self, ResidencyError> {
        let mut files = Vec::with_capacity(meta.blobs.len());
        for blob in &meta.blobs {
            let path = dir.join(&blob.file);
            let file = DirectFile::open(&path)?;
            if file.len() != blob.length {
                return Err(ResidencyError::BlobLength {
                    path,
                    expected: blob.length,
                    actual: file.len(),
                });
            }
            files.push(file);
        }
        Ok(HostFileSource {
            files,
            names: meta.blobs.iter().map(|b| b.file.clone()).collect(),
            checksums: meta
                .blobs
                .iter()
                .map(|b| parse_checksum(&b.checksum))
                .collect(),
            how,
        })
    }

    /// Whether every file reads with O_DIRECT.
    pub fn all_direct(&self) -> bool {
        self.files.iter().all(|f| f.is_direct())
    }
}

impl BlobSource for HostFileSource {
    fn blob_count(&self) -> usize {
        self.files.len()
    }

    fn blob_name(&self, blob: usize) -> String {
        self.names[blob].clone()
    }

    fn read_blob(&self, blob: usize, dst: &mut [u8]) -> Result<(), ResidencyError> {
        let file = &self.files[blob];
        let len = gds_io::aligned::align_up(file.len()) as usize;
        let record = file.read_into_parallel(0, &mut dst[..len], self.how)?;
        tracing::trace!(
            blob,
            bytes = record.bytes,
            direct = record.direct,
            gbps = record.gbps(),
            "blob read"
        );
        Ok(())
    }

    fn read_range(&self, blob: usize, offset: u64, dst: &mut [u8]) -> Result<(), ResidencyError> {
        self.files[blob].read_span(offset, dst)?;
        Ok(())
    }

    fn checksum(&self, blob: usize) -> Option<u64> {
        self.checksums.get(blob).copied().flatten()
    }

    /// Reads the blob in large aligned pieces, as many threads as a whole-blob read uses, into
    /// one reused buffer (the default reads through an unaligned bounce per piece).
    fn hash_blob(&self, blob: usize) -> Result<u64, ResidencyError> {
        const PIECE: u64 = 32 << 20;
        let file = &self.files[blob];
        let len = file.len();
        let mut buf =
            gds_io::AlignedBuf::zeroed(PIECE.min(gds_io::aligned::align_up(len)) as usize)
                .map_err(|_| ResidencyError::Alloc {
                    bytes: PIECE,
                    what: format!("checksum of {}", self.names[blob]),
                })?;
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut offset = 0;
        while offset < len {
            let n = PIECE.min(len - offset);
            let aligned = gds_io::aligned::align_up(n) as usize;
            file.read_into_parallel(offset, &mut buf[..aligned], self.how)?;
            hasher.update(&buf[..n as usize]);
            offset += n;
        }
        Ok(hasher.digest())
    }

    fn blob_len(&self, blob: usize) -> u64 {
        self.files[blob].len()
    }
}

/// A source whose byte at `offset` of blob `b` is [`PatternSource::byte`]`(b, offset)`; counts
/// its reads. For tests and benches that need no files.
#[derive(Debug)]
pub struct PatternSource {
    lengths: Vec<u64>,
    blob_reads: Vec<AtomicU64>,
    bytes_read: AtomicU64,
    /// What each blob claims to hash to (see [`PatternSource::with_checksums`]).
    checksums: Vec<Option<u64>>,
}

impl PatternSource {
    pub fn new(lengths: Vec<u64>) -> PatternSource {
        PatternSource {
            blob_reads: lengths.iter().map(|_| AtomicU64::new(0)).collect(),
            checksums: vec![None; lengths.len()],
            lengths,
            bytes_read: AtomicU64::new(0),
        }
    }

    /// The same source claiming the true checksum of every blob except those in `wrong`,
    /// whose claimed checksum is off by one (a corrupt file, seen from the checker).
    pub fn with_checksums(mut self, wrong: &[usize]) -> PatternSource {
        self.checksums = (0..self.lengths.len())
            .map(|b| {
                let bytes: Vec<u8> = (0..self.lengths[b]).map(|i| Self::byte(b, i)).collect();
                let sum = xxhash_rust::xxh3::xxh3_64(&bytes);
                Some(if wrong.contains(&b) { sum ^ 1 } else { sum })
            })
            .collect();
        self
    }

    /// The content of every blob: distinct per blob and per position.
    pub fn byte(blob: usize, offset: u64) -> u8 {
        let x = (offset / 4).wrapping_mul(0x9E37_79B9) ^ (blob as u64).wrapping_mul(0x85EB_CA6B);
        (x ^ (x >> 13) ^ (offset & 3) << 5) as u8
    }

    /// Whether `bytes` are exactly blob `blob`'s first `bytes.len()` bytes.
    pub fn check(blob: usize, bytes: &[u8]) -> bool {
        bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| b == Self::byte(blob, i as u64))
    }

    /// Whole-blob reads so far, per blob.
    pub fn blob_reads(&self) -> Vec<u64> {
        self.blob_reads
            .iter()
            .map(|r| r.load(Ordering::Relaxed))
            .collect()
    }

    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }
}

impl BlobSource for PatternSource {
    fn blob_count(&self) -> usize {
        self.lengths.len()
    }

    fn blob_name(&self, blob: usize) -> String {
        format!("pattern blob {blob}")
    }

    fn read_blob(&self, blob: usize, dst: &mut [u8]) -> Result<(), ResidencyError> {
        let len = self.lengths[blob] as usize;
        for (i, b) in dst[..len].iter_mut().enumerate() {
            *b = Self::byte(blob, i as u64);
        }
        self.blob_reads[blob].fetch_add(1, Ordering::Relaxed);
        self.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    fn read_range(&self, blob: usize, offset: u64, dst: &mut [u8]) -> Result<(), ResidencyError> {
        for (i, b) in dst.iter_mut().enumerate() {
            *b = Self::byte(blob, offset + i as u64);
        }
        Ok(())
    }

    fn checksum(&self, blob: usize) -> Option<u64> {
        self.checksums[blob]
    }

    fn blob_len(&self, blob: usize) -> u64 {
        self.lengths[blob]
    }
}
