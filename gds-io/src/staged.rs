//! The `host` I/O path seen from the GPU: O_DIRECT reads (the host path's [`DirectFile`]
//! parallel reads) into aligned, pageable host memory, then a plain synchronous copy to the
//! device, window by window, the copy of one window overlapping the read of the next. It is the reference the bounce ring must beat, and the path when pinned memory is
//! scarce.
//!
//! [`DirectFile`]: crate::host::DirectFile

use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::result;

use crate::aligned::AlignedBuf;
use crate::error::GdsError;
use crate::file::GdsFile;
use crate::gpu::{GdsBuffer, Gpu};
use crate::host::{ParallelRead, ReadRecord};
use crate::io_path::{DeviceReader, IoPath, IoStats, IoTotals, ReadSpan};

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
            parallel: ParallelRead {
                request_bytes: 16 << 20,
                threads: 8,
            },
        }
    }
}

pub struct HostStagedReader {
    gpu: Gpu,
    config: HostStagedConfig,
    /// The two staging windows, kept between reads.
    windows: Mutex<Vec<AlignedBuf>>,
    stats: IoStats,
}

impl HostStagedReader {
    pub fn new(gpu: &Gpu, config: HostStagedConfig) -> HostStagedReader {
        HostStagedReader {
            gpu: gpu.clone(),
            config: HostStagedConfig {
                window_bytes: config
                    .window_bytes
                    .max(1)
                    .next_multiple_of(crate::aligned::IO_ALIGN),
                parallel: config.parallel,
            },
            windows: Mutex::new(Vec::new()),
            stats: IoStats::default(),
        }
    }
}

impl DeviceReader for HostStagedReader {
    fn kind(&self) -> IoPath {
        IoPath::Host
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
        let mut spare = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        spare.retain(|w| w.len() == self.config.window_bytes);
        while spare.len() < 2 {
            spare.push(
                AlignedBuf::zeroed(self.config.window_bytes)
                    .map_err(crate::host::HostIoError::from)?,
            );
        }
        // Two windows: while one is copied to the device (a pageable copy, ~10 GB/s), the
        // disk fills the other, so the copies hide behind the reads.
        let (free_tx, free_rx) = crossbeam_channel::bounded::<AlignedBuf>(2);
        let (full_tx, full_rx) = crossbeam_channel::bounded::<(AlignedBuf, ReadSpan)>(2);
        for window in spare.drain(..) {
            free_tx.send(window).expect("room for both windows");
        }
        let base = dst.device_ptr();
        let outcome = std::thread::scope(|scope| -> Result<usize, GdsError> {
            let copier = scope.spawn(move || -> Result<(), GdsError> {
                self.gpu.bind()?;
                for (window, piece) in full_rx {
                    // SAFETY: the destination range is inside `dst` (ReadSpan::check) and the
                    // source is `piece.len` initialised bytes of the window; the copy is
                    // synchronous, so the window may be refilled as soon as it returns.
                    unsafe {
                        result::memcpy_htod_sync(
                            base + piece.dst_offset as u64,
                            &window[..piece.len],
                        )
                    }
                    .map_err(GdsError::cuda("cuMemcpyHtoD"))?;
                    if free_tx.send(window).is_err() {
                        break;
                    }
                }
                Ok(())
            });
            let mut requests = 0;
            let mut read_error = None;
            for piece in span.split(self.config.window_bytes) {
                let Ok(mut window) = free_rx.recv() else {
                    break; // the copier stopped with an error, reported below
                };
                let aligned = piece.len.next_multiple_of(crate::aligned::IO_ALIGN);
                match file.direct_file().read_into_parallel(
                    piece.offset,
                    &mut window[..aligned],
                    self.config.parallel,
                ) {
                    Ok(record) => requests += record.requests,
                    Err(err) => {
                        read_error = Some(GdsError::from(err));
                        break;
                    }
                }
                if full_tx.send((window, piece)).is_err() {
                    break;
                }
            }
            drop(full_tx);
            let copied = copier.join().expect("copy thread panicked");
            if let Some(err) = read_error {
                return Err(err);
            }
            copied.map(|()| requests)
        });
        spare.extend(free_rx.try_iter());
        let requests = outcome?;
        let record = ReadRecord {
            bytes: len as u64,
            io_path: IoPath::Host.name(),
            direct: file.is_direct(),
            via_host_memory: true,
            elapsed: start.elapsed(),
            requests,
        };
        self.stats.add(&record);
        Ok(record)
    }

    fn stats(&self) -> IoTotals {
        self.stats.totals()
    }
}
