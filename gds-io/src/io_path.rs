//! One trait for the three ways bytes reach device memory, how one is chosen, and how reads
//! are checked, split and accounted.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaStream};

use crate::error::GdsError;
use crate::file::GdsFile;
use crate::gpu::GdsBuffer;
use crate::host::ReadRecord;

/// File offsets and buffer offsets of device reads must be multiples of this (the alignment
/// of every blob and tensor in the GdsLLM format, and what O_DIRECT and GDS DMA need).
pub const DEVICE_READ_ALIGN: usize = crate::aligned::IO_ALIGN;

/// Environment variable that forces an I/O path (`cufile`, `bounce`, `host`, `auto`).
pub const IO_ENV: &str = "GDSLLM_IO";

/// The three read paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IoPath {
    /// cuFile: GPUDirect Storage DMA, or cuFile's own compatibility mode.
    Cufile,
    /// O_DIRECT by several threads into a pinned ring, async host→device copies.
    Bounce,
    /// O_DIRECT into aligned host memory, then a plain (pageable) copy to the device.
    Host,
}

impl IoPath {
    pub const ALL: [IoPath; 3] = [IoPath::Cufile, IoPath::Bounce, IoPath::Host];

    pub fn name(self) -> &'static str {
        match self {
            IoPath::Cufile => "cufile",
            IoPath::Bounce => "bounce",
            IoPath::Host => "host",
        }
    }
}

impl std::fmt::Display for IoPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A I/O path request: a specific I/O path or automatic choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoChoice {
    Auto,
    Force(IoPath),
}

impl FromStr for IoChoice {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(IoChoice::Auto),
            "cufile" | "gds" => Ok(IoChoice::Force(IoPath::Cufile)),
            "bounce" => Ok(IoChoice::Force(IoPath::Bounce)),
            "host" => Ok(IoChoice::Force(IoPath::Host)),
            other => Err(format!(
                "invalid I/O path {other:?}: expected one of cufile, bounce, host, auto"
            )),
        }
    }
}

/// The I/O path asked for: the `--io` flag if given, else `$GDSLLM_IO`, else automatic.
/// `env_value` is the variable's value (passed in so that callers and tests control it).
pub fn resolve_io_choice(
    flag: Option<&str>,
    env_value: Option<&str>,
) -> Result<IoChoice, GdsError> {
    if let Some(flag) = flag {
        return flag.parse().map_err(|_| GdsError::BadIoPathName {
            setting: "--io".into(),
            value: flag.into(),
        });
    }
    match env_value {
        Some(value) => value.parse().map_err(|_| GdsError::BadIoPathName {
            setting: IO_ENV.into(),
            value: value.into(),
        }),
        None => Ok(IoChoice::Auto),
    }
}

/// [`resolve_io_choice`] with `$GDSLLM_IO` read from the environment.
pub fn io_choice_from_env(flag: Option<&str>) -> Result<IoChoice, GdsError> {
    let env = std::env::var(IO_ENV).ok();
    resolve_io_choice(flag, env.as_deref())
}

/// What this machine can do, as far as I/O path choice is concerned.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Capabilities {
    /// A CUDA device could be opened.
    pub gpu: bool,
    /// libcufile loaded and its driver opened.
    pub cufile: bool,
    /// cuFile does true DMA (nvidia-fs or P2PDMA, not compatibility mode).
    pub gds_dma: bool,
    /// Measured GB/s of the bounce and host paths, when a probe read was done.
    pub bounce_gbps: Option<f64>,
    pub host_gbps: Option<f64>,
}

impl Capabilities {
    /// Whether `kind` can run here, or why not.
    pub fn check(&self, kind: IoPath) -> Result<(), GdsError> {
        let unavailable = |reason: &str| GdsError::IoPathUnavailable {
            io_path: kind.name(),
            reason: reason.to_string(),
        };
        match kind {
            _ if !self.gpu => Err(unavailable(
                "no GPU: device reads need CUDA (the CPU I/O path reads with DirectFile)",
            )),
            IoPath::Cufile if !self.cufile => Err(unavailable(
                "libcufile could not be loaded or its driver could not be opened",
            )),
            _ => Ok(()),
        }
    }
}

/// Picks the I/O path for device reads. A forced choice is honoured when it can run. `Auto`
/// takes `cufile` only where cuFile does real DMA — in compatibility mode it is a POSIX read
/// through cuFile's own bounce buffers, which our tuned bounce ring matches or beats — and
/// otherwise the faster of `bounce` and `host` by measurement (bounce when unmeasured).
pub fn choose_io_path(caps: &Capabilities, choice: IoChoice) -> Result<IoPath, GdsError> {
    match choice {
        IoChoice::Force(kind) => {
            caps.check(kind)?;
            Ok(kind)
        }
        IoChoice::Auto => {
            caps.check(IoPath::Bounce)?;
            if caps.cufile && caps.gds_dma {
                return Ok(IoPath::Cufile);
            }
            match (caps.bounce_gbps, caps.host_gbps) {
                (Some(bounce), Some(host)) if host > bounce => Ok(IoPath::Host),
                _ => Ok(IoPath::Bounce),
            }
        }
    }
}

/// A checked device read: `len` bytes at file `offset` into `dst` at `dst_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadSpan {
    pub offset: u64,
    pub len: usize,
    pub dst_offset: usize,
}

impl ReadSpan {
    /// Validates a read against alignment, the file's length and the buffer's length. Any
    /// length is allowed (unaligned tails are handled by each I/O path).
    pub fn check(
        file: &GdsFile,
        offset: u64,
        len: usize,
        buffer_len: usize,
        dst_offset: usize,
    ) -> Result<ReadSpan, GdsError> {
        if !offset.is_multiple_of(DEVICE_READ_ALIGN as u64)
            || !dst_offset.is_multiple_of(DEVICE_READ_ALIGN)
        {
            return Err(GdsError::Misaligned {
                path: file.path().to_path_buf(),
                offset,
                dst_offset,
                align: DEVICE_READ_ALIGN,
            });
        }
        let end = offset.saturating_add(len as u64);
        if end > file.len() {
            return Err(GdsError::PastEndOfFile {
                path: file.path().to_path_buf(),
                offset,
                end,
                file_len: file.len(),
            });
        }
        if dst_offset.checked_add(len).is_none_or(|e| e > buffer_len) {
            return Err(GdsError::BufferTooSmall {
                path: file.path().to_path_buf(),
                buffer_len,
                dst_offset,
                len,
            });
        }
        Ok(ReadSpan {
            offset,
            len,
            dst_offset,
        })
    }

    /// Splits into requests of at most `request` bytes (rounded up to the alignment), in file
    /// order; every request but the last is a whole multiple of the alignment.
    pub fn split(&self, request: usize) -> Vec<ReadSpan> {
        let request = request.max(1).next_multiple_of(DEVICE_READ_ALIGN);
        (0..self.len)
            .step_by(request)
            .map(|start| ReadSpan {
                offset: self.offset + start as u64,
                len: request.min(self.len - start),
                dst_offset: self.dst_offset + start,
            })
            .collect()
    }
}

/// Completion of an asynchronous read. The caller's stream already waits for it; `wait`
/// blocks the host until the bytes are in device memory.
#[derive(Debug)]
pub struct ReadTicket {
    pub(crate) event: Option<CudaEvent>,
    pub record: ReadRecord,
}

impl ReadTicket {
    /// Blocks until the read has landed and returns its accounting (elapsed = time to issue).
    pub fn wait(self) -> Result<ReadRecord, GdsError> {
        if let Some(event) = &self.event {
            event
                .synchronize()
                .map_err(GdsError::cuda("cuEventSynchronize"))?;
        }
        Ok(self.record)
    }
}

/// Reads file regions into device memory. Implemented by the cufile, bounce and host
/// I/O paths; object safe so that callers can hold `Box<dyn DeviceReader>`.
pub trait DeviceReader: Send + Sync {
    fn kind(&self) -> IoPath;

    /// Reads `len` bytes at file `offset` into `dst[dst_offset..]`, returning once the bytes
    /// are in device memory. Offsets must be multiples of [`DEVICE_READ_ALIGN`].
    fn read(
        &self,
        file: &GdsFile,
        offset: u64,
        len: usize,
        dst: &GdsBuffer,
        dst_offset: usize,
    ) -> Result<ReadRecord, GdsError>;

    /// Like [`DeviceReader::read`], ordered on `stream`: the write into `dst` happens after the
    /// work already queued on `stream`, and work queued on `stream` afterwards sees the bytes.
    /// `dst` is not freed before the read lands (its Drop waits).
    ///
    /// The default is synchronous underneath: it drains `stream`, then reads, so the order
    /// holds but the calling thread waits. Readers with a real asynchronous path override it.
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

    /// Performs several reads, returning once all of them are in device memory. Readers that
    /// can keep the disk queue deep across reads (bounce, cufile) queue every request of every
    /// read at once, so there is no idle gap between one read and the next; the default does
    /// the reads one after another.
    fn read_many(&self, reads: &[DeviceRead<'_>]) -> Result<Vec<ReadRecord>, GdsError> {
        reads
            .iter()
            .map(|r| self.read(r.file, r.offset, r.len, r.dst, r.dst_offset))
            .collect()
    }

    /// Totals of every read this I/O path did.
    fn stats(&self) -> IoTotals;
}

/// One read of a [`DeviceReader::read_many`] batch: `len` bytes at `offset` of `file` into
/// `dst[dst_offset..]`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRead<'a> {
    pub file: &'a GdsFile,
    pub offset: u64,
    pub len: usize,
    pub dst: &'a GdsBuffer,
    pub dst_offset: usize,
}

/// Running totals of an I/O path's reads.
#[derive(Debug, Default)]
pub struct IoStats {
    bytes: AtomicU64,
    reads: AtomicU64,
    nanos: AtomicU64,
    via_host_bytes: AtomicU64,
}

/// A snapshot of [`IoStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IoTotals {
    pub bytes: u64,
    pub reads: u64,
    /// Sum of per-read wall times (reads may overlap, so this can exceed real time).
    pub busy: Duration,
    /// Bytes that passed through host memory on the way.
    pub via_host_bytes: u64,
}

impl IoStats {
    pub fn add(&self, record: &ReadRecord) {
        self.bytes.fetch_add(record.bytes, Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.nanos
            .fetch_add(record.elapsed.as_nanos() as u64, Ordering::Relaxed);
        if record.via_host_memory {
            self.via_host_bytes
                .fetch_add(record.bytes, Ordering::Relaxed);
        }
    }

    pub fn totals(&self) -> IoTotals {
        IoTotals {
            bytes: self.bytes.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            busy: Duration::from_nanos(self.nanos.load(Ordering::Relaxed)),
            via_host_bytes: self.via_host_bytes.load(Ordering::Relaxed),
        }
    }
}

/// Runs `work` over `items` on up to `threads` scoped threads pulling the next index from a
/// shared counter, so a slow request does not hold up the queue. Returns the first error.
pub(crate) fn for_each_parallel<T: Sync>(
    items: &[T],
    threads: usize,
    work: impl Fn(&T) -> Result<(), GdsError> + Sync,
) -> Result<(), GdsError> {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.iter().try_for_each(work);
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> Result<(), GdsError> {
                    loop {
                        if failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(index) else {
                            return Ok(());
                        };
                        if let Err(err) = work(item) {
                            failed.store(true, Ordering::Relaxed);
                            return Err(err);
                        }
                    }
                })
            })
            .collect();
        let mut first_error = None;
        for handle in handles {
            match handle.join() {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    first_error.get_or_insert(err);
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        first_error.map_or(Ok(()), Err)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(gpu: bool, cufile: bool, gds_dma: bool) -> Capabilities {
        Capabilities {
            gpu,
            cufile,
            gds_dma,
            ..Default::default()
        }
    }

    #[test]
    fn auto_prefers_cufile_only_with_real_dma() {
        assert_eq!(
            choose_io_path(&caps(true, true, true), IoChoice::Auto).unwrap(),
            IoPath::Cufile
        );
        // Compatibility mode: cuFile is a POSIX read through its own bounce buffers.
        assert_eq!(
            choose_io_path(&caps(true, true, false), IoChoice::Auto).unwrap(),
            IoPath::Bounce
        );
        assert_eq!(
            choose_io_path(&caps(true, false, false), IoChoice::Auto).unwrap(),
            IoPath::Bounce
        );
    }

    #[test]
    fn auto_takes_the_faster_measured_fallback() {
        let mut c = caps(true, true, false);
        c.bounce_gbps = Some(3.7);
        c.host_gbps = Some(2.7);
        assert_eq!(choose_io_path(&c, IoChoice::Auto).unwrap(), IoPath::Bounce);
        c.host_gbps = Some(4.0);
        assert_eq!(choose_io_path(&c, IoChoice::Auto).unwrap(), IoPath::Host);
        // With real DMA, measurements of the fallbacks do not matter.
        c.gds_dma = true;
        assert_eq!(choose_io_path(&c, IoChoice::Auto).unwrap(), IoPath::Cufile);
    }

    #[test]
    fn forced_choices_are_honoured_or_explained() {
        let c = caps(true, false, false);
        assert_eq!(
            choose_io_path(&c, IoChoice::Force(IoPath::Host)).unwrap(),
            IoPath::Host
        );
        let err = choose_io_path(&c, IoChoice::Force(IoPath::Cufile)).unwrap_err();
        assert!(err.to_string().contains("cufile"), "{err}");
        let err = choose_io_path(&caps(false, false, false), IoChoice::Auto).unwrap_err();
        assert!(err.to_string().contains("no GPU"), "{err}");
    }

    #[test]
    fn flag_overrides_env_and_bad_names_name_their_setting() {
        assert_eq!(resolve_io_choice(None, None).unwrap(), IoChoice::Auto);
        assert_eq!(
            resolve_io_choice(None, Some("bounce")).unwrap(),
            IoChoice::Force(IoPath::Bounce)
        );
        assert_eq!(
            resolve_io_choice(Some("HOST"), Some("bounce")).unwrap(),
            IoChoice::Force(IoPath::Host)
        );
        assert_eq!(
            resolve_io_choice(Some("auto"), Some("host")).unwrap(),
            IoChoice::Auto
        );
        let err = resolve_io_choice(None, Some("nvme")).unwrap_err();
        assert!(
            err.to_string().contains(IO_ENV) && err.to_string().contains("nvme"),
            "{err}"
        );
        let err = resolve_io_choice(Some("fast"), None).unwrap_err();
        assert!(
            err.to_string().contains("--io") && err.to_string().contains("fast"),
            "{err}"
        );
    }

    fn file_of_len(dir: &std::path::Path, len: usize) -> GdsFile {
        let path = dir.join("f.bin");
        std::fs::write(&path, vec![7u8; len]).unwrap();
        GdsFile::open(&path).unwrap()
    }

    #[test]
    fn read_spans_are_checked_with_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = file_of_len(dir.path(), 3 * 4096 + 100);
        assert!(ReadSpan::check(&file, 4096, 2 * 4096 + 100, 1 << 20, 0).is_ok());
        let err = ReadSpan::check(&file, 100, 10, 1 << 20, 0).unwrap_err();
        assert!(
            matches!(err, GdsError::Misaligned { offset: 100, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("f.bin") && err.to_string().contains("4096"));
        let err = ReadSpan::check(&file, 0, 10, 1 << 20, 12).unwrap_err();
        assert!(
            matches!(err, GdsError::Misaligned { dst_offset: 12, .. }),
            "{err}"
        );
        let err = ReadSpan::check(&file, 4096, 3 * 4096, 1 << 20, 0).unwrap_err();
        assert!(
            matches!(
                err,
                GdsError::PastEndOfFile {
                    file_len: 12388,
                    ..
                }
            ),
            "{err}"
        );
        let err = ReadSpan::check(&file, 0, 8192, 8192, 4096).unwrap_err();
        assert!(matches!(err, GdsError::BufferTooSmall { .. }), "{err}");
        let err = ReadSpan::check(&file, u64::MAX - 4095, 8192, 1 << 20, 0).unwrap_err();
        assert!(matches!(err, GdsError::PastEndOfFile { .. }), "{err}");
    }

    #[test]
    fn split_covers_the_span_exactly_with_aligned_pieces() {
        for (len, request) in [
            (1usize, 4096usize),
            (4096, 4096),
            (10 << 20, 3 << 20),
            (12345, 5000),
            (8 << 20, 8 << 20),
        ] {
            let span = ReadSpan {
                offset: 8192,
                len,
                dst_offset: 4096,
            };
            let parts = span.split(request);
            let mut expected_offset = span.offset;
            let mut total = 0;
            for (i, part) in parts.iter().enumerate() {
                assert_eq!(part.offset, expected_offset);
                assert_eq!(part.dst_offset as u64 - 4096, part.offset - 8192);
                assert!(part.offset.is_multiple_of(4096));
                if i + 1 < parts.len() {
                    assert!(part.len.is_multiple_of(4096));
                }
                assert!(part.len <= request.next_multiple_of(4096));
                expected_offset += part.len as u64;
                total += part.len;
            }
            assert_eq!(total, len, "len {len} request {request}");
        }
    }

    #[test]
    fn parallel_runner_visits_every_item_once_and_reports_errors() {
        let seen: Vec<AtomicU64> = (0..100).map(|_| AtomicU64::new(0)).collect();
        let items: Vec<usize> = (0..100).collect();
        for_each_parallel(&items, 7, |&i| {
            seen[i].fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
        assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
        let err = for_each_parallel(&items, 4, |&i| {
            if i == 42 {
                Err(GdsError::EmptyAllocation)
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        assert!(matches!(err, GdsError::EmptyAllocation));
    }
}
