//! Device memory as the residency cache needs it: slots of N bytes within a budget.
//!
//! Narrow on purpose: allocate, fill from a source or from the host tier, and a completion
//! token. On CPU "device" memory is aligned host memory and fills are synchronous;
//! [`crate::gpu::GpuMemory`] implements the same traits with device buffers filled through
//! `gds-io`, and compute hands back a [`ReleaseFence`] with each streamed blob so that a slot is
//! only refilled once the device has finished reading it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use gds_io::{AlignedBuf, DevicePtr};

use crate::error::ResidencyError;
use crate::source::BlobSource;

/// Where a blob's bytes are: host memory (the CPU backend reads them as a slice) or device
/// memory (kernels read them by address). What compute is handed says which, so no one reads an
/// empty slice or looks a device copy up by host address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightBytes<'a> {
    Host(&'a [u8]),
    Device(DevicePtr<'a>),
    /// The same bytes in both: a streamed blob in device memory whose host-tier copy (pinned
    /// RAM) the CPU reads too, for a matmul split between the two (`llama::hybrid`).
    Both(&'a [u8], DevicePtr<'a>),
}

impl<'a> WeightBytes<'a> {
    pub fn len(&self) -> usize {
        match self {
            WeightBytes::Host(b) => b.len(),
            WeightBytes::Device(p) | WeightBytes::Both(_, p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` bytes from `offset`, in the same memory; `None` past the end.
    pub fn slice(&self, offset: usize, len: usize) -> Option<WeightBytes<'a>> {
        match self {
            WeightBytes::Host(b) => b
                .get(offset..offset.checked_add(len)?)
                .map(WeightBytes::Host),
            WeightBytes::Device(p) => p.slice(offset, len).map(WeightBytes::Device),
            WeightBytes::Both(b, p) => Some(WeightBytes::Both(
                b.get(offset..offset.checked_add(len)?)?,
                p.slice(offset, len)?,
            )),
        }
    }

    /// The bytes, when they are in host memory.
    pub fn host(&self) -> Option<&'a [u8]> {
        match self {
            WeightBytes::Host(b) | WeightBytes::Both(b, _) => Some(b),
            WeightBytes::Device(_) => None,
        }
    }

    /// The device range, when the bytes are in device memory.
    pub fn device(&self) -> Option<DevicePtr<'a>> {
        match self {
            WeightBytes::Host(_) => None,
            WeightBytes::Device(p) | WeightBytes::Both(_, p) => Some(*p),
        }
    }
}

/// Marks a finished fill. CPU fills complete before they return, so this carries nothing yet.
#[derive(Debug)]
#[must_use]
pub struct Completion(());

impl Completion {
    pub fn done() -> Completion {
        Completion(())
    }
    /// Blocks until the fill is visible to compute (immediate on CPU).
    pub fn wait(self) {}
}

/// Host memory holding one blob of the host tier.
pub trait HostBlock: Send + Sync {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl HostBlock for AlignedBuf {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Told to the residency cache when compute releases a blob whose reads by the device may
/// still be queued (a GPU stream runs behind the host): the cache waits for it before it
/// writes another blob into the same buffer.
pub trait ReleaseFence: Send {
    /// Blocks until the device no longer reads the buffer.
    fn wait(&self) -> Result<(), String>;
}

/// A budgeted allocator of device buffers.
pub trait DeviceMemory: Send + Sync {
    /// Bytes this memory may hand out in total.
    fn budget(&self) -> u64;
    /// A buffer of at least `bytes` bytes; fails (without exceeding the budget) when the
    /// budget or the device cannot provide it.
    fn alloc(&self, bytes: u64, what: &str) -> Result<Box<dyn DeviceBuffer>, ResidencyError>;
    /// Bytes currently allocated.
    fn used(&self) -> u64;
    /// Highest `used` seen.
    fn peak(&self) -> u64;
    /// Host memory for one blob of the host tier, 4096-aligned (O_DIRECT reads land in it).
    /// A GPU memory hands out page-locked memory, so copies up run at full PCIe speed.
    fn alloc_host(&self, bytes: u64) -> Result<Box<dyn HostBlock>, ResidencyError> {
        AlignedBuf::zeroed(bytes as usize)
            .map(|b| Box::new(b) as Box<dyn HostBlock>)
            .map_err(|_| ResidencyError::Alloc {
                bytes,
                what: "host tier".into(),
            })
    }
}

/// One buffer (a ring slot or a resident blob).
pub trait DeviceBuffer: Send + Sync {
    /// Bytes the buffer holds: the length of [`bytes`](Self::bytes).
    fn capacity(&self) -> u64 {
        self.bytes().len() as u64
    }
    /// Reads blob `blob` (`len` bytes) from `source` into the buffer.
    fn fill_from_source(
        &mut self,
        source: &dyn BlobSource,
        blob: usize,
        len: u64,
    ) -> Result<Completion, ResidencyError>;
    /// Copies `bytes` from the host tier into the start of the buffer.
    fn fill_from_host(&mut self, bytes: &[u8]) -> Result<Completion, ResidencyError> {
        self.fill_range_from_host(0, bytes)
    }
    /// Copies `bytes` from the host tier into the buffer at `offset` (one range of a blob).
    fn fill_range_from_host(
        &mut self,
        offset: usize,
        bytes: &[u8],
    ) -> Result<Completion, ResidencyError>;
    /// The whole buffer, in host or device memory.
    fn bytes(&self) -> WeightBytes<'_>;
    /// XXH3-64 of the first `len` bytes, as compute will see them. Host memory is hashed in
    /// place; device memory must override this (copying the bytes back to hash them).
    fn xxh3(&self, len: u64) -> Result<u64, ResidencyError> {
        let bytes = self
            .bytes()
            .host()
            .and_then(|b| b.get(..len as usize))
            .ok_or(ResidencyError::RangeOutOfBounds {
                file: "(buffer in host memory)".into(),
                offset: 0,
                end: len,
                length: self.bytes().len() as u64,
            })?;
        Ok(xxhash_rust::xxh3::xxh3_64(bytes))
    }

    /// [`fill_from_source`](Self::fill_from_source) of blob `blob`, then its XXH3-64 (of the
    /// first `len` bytes) and the time spent hashing. Buffers whose bytes pass through host
    /// memory on their way in override this to hash them there rather than read them back.
    fn fill_and_hash(
        &mut self,
        source: &dyn BlobSource,
        blob: usize,
        len: u64,
    ) -> Result<(u64, std::time::Duration), ResidencyError> {
        self.fill_from_source(source, blob, len)?.wait();
        let started = std::time::Instant::now();
        let digest = self.xxh3(len)?;
        Ok((digest, started.elapsed()))
    }
}

/// Host memory standing in for device memory on the CPU backend.
#[derive(Debug)]
pub struct CpuMemory {
    budget: u64,
    /// Simulates a device that has less memory than the budget claims (another process took
    /// some): allocations beyond it fail.
    physical_limit: Option<u64>,
    usage: Usage,
}

impl CpuMemory {
    pub fn new(budget: u64) -> CpuMemory {
        CpuMemory {
            budget,
            physical_limit: None,
            usage: Usage::default(),
        }
    }

    /// Allocations beyond `limit` bytes in total fail although the budget would allow them:
    /// the memory-pressure case.
    pub fn with_physical_limit(budget: u64, limit: u64) -> CpuMemory {
        CpuMemory {
            physical_limit: Some(limit),
            ..CpuMemory::new(budget)
        }
    }
}

impl DeviceMemory for CpuMemory {
    fn budget(&self) -> u64 {
        self.budget
    }

    fn alloc(&self, bytes: u64, what: &str) -> Result<Box<dyn DeviceBuffer>, ResidencyError> {
        let capacity = gds_io::aligned::align_up(bytes);
        let limit = self.physical_limit.unwrap_or(u64::MAX).min(self.budget);
        let fail = || ResidencyError::Alloc {
            bytes: capacity,
            what: what.to_string(),
        };
        let reservation = self.usage.reserve(capacity, limit).ok_or_else(fail)?;
        match AlignedBuf::zeroed(capacity as usize) {
            Ok(buf) => Ok(Box::new(CpuBuffer {
                buf,
                _reservation: reservation,
            })),
            Err(_) => Err(fail()),
        }
    }

    fn used(&self) -> u64 {
        self.usage.used()
    }

    fn peak(&self) -> u64 {
        self.usage.peak()
    }
}

/// The bytes a memory's live buffers hold against its limit, and the most they ever held.
#[derive(Debug, Default)]
pub(crate) struct Usage {
    used: Arc<AtomicU64>,
    peak: AtomicU64,
}

impl Usage {
    /// Reserves `bytes` if the total stays within `limit` (and raises the peak); None
    /// otherwise. Lock-free, so allocations from several threads never exceed the limit
    /// together. The bytes are given back when the reservation is dropped.
    pub(crate) fn reserve(&self, bytes: u64, limit: u64) -> Option<Reservation> {
        let mut current = self.used.load(Ordering::Acquire);
        loop {
            let next = current.checked_add(bytes).filter(|&n| n <= limit)?;
            match self
                .used
                .compare_exchange(current, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::AcqRel);
                    return Some(Reservation {
                        bytes,
                        used: Arc::clone(&self.used),
                    });
                }
                Err(actual) => current = actual,
            }
        }
    }

    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }
}

/// Bytes counted in a [`Usage`] while this lives (a buffer holds its own).
pub(crate) struct Reservation {
    bytes: u64,
    used: Arc<AtomicU64>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

struct CpuBuffer {
    buf: AlignedBuf,
    _reservation: Reservation,
}

impl DeviceBuffer for CpuBuffer {
    fn fill_from_source(
        &mut self,
        source: &dyn BlobSource,
        blob: usize,
        len: u64,
    ) -> Result<Completion, ResidencyError> {
        let aligned = gds_io::aligned::align_up(len) as usize;
        source.read_blob(blob, &mut self.buf[..aligned])?;
        Ok(Completion::done())
    }

    fn fill_range_from_host(
        &mut self,
        offset: usize,
        bytes: &[u8],
    ) -> Result<Completion, ResidencyError> {
        let end = offset
            .checked_add(bytes.len())
            .filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(ResidencyError::RangeOutOfBounds {
                file: "(host buffer)".into(),
                offset: offset as u64,
                end: (offset + bytes.len()) as u64,
                length: self.buf.len() as u64,
            });
        };
        self.buf[offset..end].copy_from_slice(bytes);
        Ok(Completion::done())
    }

    fn bytes(&self) -> WeightBytes<'_> {
        WeightBytes::Host(&self.buf)
    }
}
