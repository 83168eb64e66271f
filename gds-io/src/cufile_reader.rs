//! The `cufile` I/O path: cuFileRead straight into device memory (GDS DMA where the platform has
//! nvidia-fs or P2PDMA, cuFile's compatibility mode otherwise). Large reads are split into
//! requests issued by several threads so the NVMe queue stays deep.

use std::sync::Arc;
use std::time::Instant;

use crate::driver::Driver;
use crate::error::GdsError;
use crate::file::GdsFile;
use crate::gpu::{GdsBuffer, Gpu};
use crate::host::ReadRecord;
use crate::io_path::{
    DeviceRead, DeviceReader, IoPath, IoStats, IoTotals, ReadSpan, for_each_parallel,
};

/// Tuning of the cufile path.
#[derive(Debug, Clone, Copy)]
pub struct CufileConfig {
    /// Bytes per cuFileRead request (16 MiB: what the raw O_DIRECT reference uses).
    pub request_bytes: usize,
    /// Threads issuing requests concurrently.
    pub threads: usize,
}

impl Default for CufileConfig {
    fn default() -> Self {
        CufileConfig {
            request_bytes: 16 << 20,
            threads: 8,
        }
    }
}

pub struct CufileReader {
    gpu: Gpu,
    driver: Arc<Driver>,
    config: CufileConfig,
    stats: IoStats,
}

impl CufileReader {
    pub fn new(gpu: &Gpu, driver: &Arc<Driver>, config: CufileConfig) -> CufileReader {
        CufileReader {
            gpu: gpu.clone(),
            driver: driver.clone(),
            config,
            stats: IoStats::default(),
        }
    }

    pub fn driver(&self) -> &Arc<Driver> {
        &self.driver
    }
}

impl CufileReader {
    /// Checks one read and splits it into requests (after any pending write into `dst`).
    fn plan<'a>(
        &self,
        read: &DeviceRead<'a>,
    ) -> Result<Vec<(&'a GdsFile, ReadSpan, cudarc::driver::sys::CUdeviceptr)>, GdsError> {
        let file = read.file;
        let span = ReadSpan::check(file, read.offset, read.len, read.dst.len(), read.dst_offset)?;
        if file.cufile_handle().is_none() {
            return Err(GdsError::IoPathUnavailable {
                io_path: "cufile",
                reason: format!("{} is not registered with cuFile", file.path().display()),
            });
        }
        // A pending async write into `dst` must land before cuFile writes the same memory.
        read.dst.wait_pending()?;
        let base = read.dst.device_ptr();
        Ok(span
            .split(self.config.request_bytes)
            .into_iter()
            .map(|part| (file, part, base))
            .collect())
    }

    /// Issues every request on up to `threads` threads, taking them in order from one list.
    fn run_requests(
        &self,
        requests: &[(&GdsFile, ReadSpan, cudarc::driver::sys::CUdeviceptr)],
    ) -> Result<(), GdsError> {
        let read = self.driver.api().read;
        for_each_parallel(requests, self.config.threads, |&(file, part, base)| {
            self.gpu.bind()?;
            let handle = file
                .cufile_handle()
                .expect("registration was checked by plan() and lives as long as `file`");
            let mut done = 0usize;
            while done < part.len {
                // SAFETY: `handle` is a live registered handle (borrowed from `file`); the
                // destination range `dst_offset + done .. + len` lies inside the allocation
                // (checked by ReadSpan::check); cuFile takes the allocation base plus offset.
                let got = unsafe {
                    read(
                        handle,
                        base as *mut libc::c_void,
                        part.len - done,
                        (part.offset + done as u64) as libc::off_t,
                        (part.dst_offset + done) as libc::off_t,
                    )
                };
                if got <= 0 {
                    let reason = if got == 0 {
                        "unexpected end of file".to_string()
                    } else if got.unsigned_abs() > cufile_sys::CUFILEOP_BASE_ERR as usize {
                        let code = got.unsigned_abs() as u32;
                        format!("cuFile error {code} ({})", cufile_sys::status_message(code))
                    } else {
                        std::io::Error::from_raw_os_error(got.unsigned_abs() as i32).to_string()
                    };
                    return Err(GdsError::Read {
                        path: file.path().to_path_buf(),
                        offset: part.offset + done as u64,
                        len: part.len - done,
                        reason,
                    });
                }
                done += got as usize;
            }
            Ok(())
        })
    }

    fn record(&self, bytes: u64, requests: usize, start: Instant) -> ReadRecord {
        let record = ReadRecord {
            bytes,
            io_path: IoPath::Cufile.name(),
            direct: true,
            via_host_memory: self.driver.properties().compat_mode,
            elapsed: start.elapsed(),
            requests,
        };
        self.stats.add(&record);
        record
    }
}

impl DeviceReader for CufileReader {
    fn kind(&self) -> IoPath {
        IoPath::Cufile
    }

    fn read(
        &self,
        file: &GdsFile,
        offset: u64,
        len: usize,
        dst: &GdsBuffer,
        dst_offset: usize,
    ) -> Result<ReadRecord, GdsError> {
        let requests = self.plan(&DeviceRead {
            file,
            offset,
            len,
            dst,
            dst_offset,
        })?;
        let start = Instant::now();
        self.run_requests(&requests)?;
        Ok(self.record(len as u64, requests.len(), start))
    }

    /// Every request of every read goes into one list served by the threads, so the queue
    /// stays deep across reads. The records share the batch's elapsed time.
    fn read_many(&self, reads: &[DeviceRead<'_>]) -> Result<Vec<ReadRecord>, GdsError> {
        let mut requests = Vec::new();
        let mut counts = Vec::with_capacity(reads.len());
        for read in reads {
            let planned = self.plan(read)?;
            counts.push(planned.len());
            requests.extend(planned);
        }
        let start = Instant::now();
        self.run_requests(&requests)?;
        Ok(reads
            .iter()
            .zip(counts)
            .map(|(read, n)| self.record(read.len as u64, n, start))
            .collect())
    }

    // read_async: the trait's synchronous default (libcufile's cuFileReadAsync is loaded
    // when present but not used yet).

    fn stats(&self) -> IoTotals {
        self.stats.totals()
    }
}
