//! The `host` backend seen from the GPU: O_DIRECT reads (the host backend's [`DirectFile`]
//! parallel reads) into aligned, pageable host memory, then a plain synchronous copy to the
//! device. It is the reference the bounce ring must beat, and the path when pinned memory is
//! scarce.
//!
//! [`DirectFile`]: crate::host::DirectFile

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaStream, result};

use crate::aligned::AlignedBuf;
use crate::backend::{BackendKind, DeviceReader, IoStats, IoTotals, ReadSpan, ReadTicket};
use crate::error::GdsError;
use crate::file::GdsFile;
use crate::gpu::{GdsBuffer, Gpu};
use crate::host::{ParallelRead, ReadRecord};

/// Tuning of the host-staged path.
#[derive(Debug, Clone, Copy)]
pub struct HostStagedConfig {
    /// Bytes read into host memory before each copy to the device.
    pub window_bytes: usize,
    pub parallel: ParallelRead,
}

impl Default for HostStagedConfig {
    fn default() -> Self {
        HostStagedConfig {
            window_bytes: 64 << 20,
            parallel: ParallelRead::default(),
        }
    }
}

pub struct HostStagedBackend {
    gpu: Gpu,
    config: HostStagedConfig,
    window: Mutex<Option<AlignedBuf>>,
    stats: IoStats,
}

impl HostStagedBackend {
    pub fn new(gpu: &Gpu, config: HostStagedConfig) -> HostStagedBackend {
        HostStagedBackend {
            gpu: gpu.clone(),
            config: HostStagedConfig {
                window_bytes: config
                    .window_bytes
                    .max(1)
                    .next_multiple_of(crate::aligned::IO_ALIGN),
                parallel: config.parallel,
            },
            window: Mutex::new(None),
            stats: IoStats::default(),
        }
    }
}

impl DeviceReader for HostStagedBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn read(
        &self,
        file: &GdsFile,
        offset: u64,
        len: usize,
        dst: &GdsBuffer,
        dst_offset: usize,
    ) -> Result<ReadRecord, GdsError> {
        let span = ReadSpan::check(file, offset, len, dst.len(), dst_offset)?;
        dst.wait_pending()?;
        self.gpu.bind()?;
        let start = Instant::now();
        let mut guard = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let window = match guard.take() {
            Some(buf) if buf.len() == self.config.window_bytes => buf,
            _ => AlignedBuf::zeroed(self.config.window_bytes)
                .map_err(crate::host::HostIoError::from)?,
        };
        let window = guard.insert(window);
        let mut requests = 0;
        for piece in span.split(self.config.window_bytes) {
            let aligned = piece.len.next_multiple_of(crate::aligned::IO_ALIGN);
            let record = file.direct_file().read_into_parallel(
                piece.offset,
                &mut window[..aligned],
                self.config.parallel,
            )?;
            requests += record.requests;
            // SAFETY: the destination range is inside `dst` (ReadSpan::check) and the source
            // is `piece.len` initialised bytes of the window; the copy is synchronous.
            unsafe {
                result::memcpy_htod_sync(
                    dst.device_ptr() + piece.dst_offset as u64,
                    &window[..piece.len],
                )
            }
            .map_err(GdsError::cuda("cuMemcpyHtoD"))?;
        }
        let record = ReadRecord {
            bytes: len as u64,
            backend: BackendKind::Host.name(),
            direct: file.is_direct(),
            via_host_memory: true,
            elapsed: start.elapsed(),
            requests,
        };
        self.stats.add(&record);
        Ok(record)
    }

    /// Synchronous underneath: drains `stream`, reads, copies.
    fn read_async(
        &self,
        file: &GdsFile,
        offset: u64,
        len: usize,
        dst: &GdsBuffer,
        dst_offset: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<ReadTicket, GdsError> {
        stream
            .synchronize()
            .map_err(GdsError::cuda("cuStreamSynchronize"))?;
        let record = self.read(file, offset, len, dst, dst_offset)?;
        Ok(ReadTicket {
            event: None,
            record,
        })
    }

    fn stats(&self) -> IoTotals {
        self.stats.totals()
    }
}
