//! The `host` I/O path: O_DIRECT reads into aligned host memory, for the CPU I/O path.
//!
//! O_DIRECT keeps model weights out of the page cache (the residency cache decides what stays in
//! RAM, not the kernel) and lets several threads keep the NVMe queue deep. Filesystems that
//! refuse O_DIRECT (tmpfs, some overlays) get a buffered open instead, logged once and reported
//! as `direct: false` in every [`ReadRecord`].

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::aligned::{AlignedBuf, IO_ALIGN, align_up};

/// Name of this I/O path in [`ReadRecord::io_path`].
pub const IO_PATH_NAME: &str = "host";

/// Errors of the host path; each names the file and, for reads, the offset.
#[derive(Debug, thiserror::Error)]
pub enum HostIoError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read of {len} bytes at offset {offset} of {path} failed: {source}")]
    Read {
        path: PathBuf,
        offset: u64,
        len: usize,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "unaligned direct read of {path}: offset {offset}, length {len}, buffer address {addr:#x} \
         must all be multiples of {IO_ALIGN}"
    )]
    Unaligned {
        path: PathBuf,
        offset: u64,
        len: usize,
        addr: usize,
    },
    #[error("{path} ends at byte {file_len}, before the requested range {offset}..{end}")]
    OutOfRange {
        path: PathBuf,
        offset: u64,
        end: u64,
        file_len: u64,
    },
    #[error("destination of {dst_len} bytes is too small for {len} bytes read from {path}")]
    DestinationTooSmall {
        path: PathBuf,
        len: u64,
        dst_len: usize,
    },
    #[error(transparent)]
    Alloc(#[from] crate::aligned::AllocError),
}

/// Accounting of one (possibly split) read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRecord {
    pub bytes: u64,
    /// Which I/O path did the read (`"host"` here).
    pub io_path: &'static str,
    /// Whether the file was opened with O_DIRECT (false: buffered fallback).
    pub direct: bool,
    /// Whether the bytes passed through host memory on their way (always true for `host`).
    pub via_host_memory: bool,
    pub elapsed: Duration,
    /// How many requests the read was split into.
    pub requests: usize,
}

impl ReadRecord {
    /// Throughput of this read in GB/s (10^9 bytes per second); 0 for an instantaneous read.
    pub fn gbps(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / secs / 1e9
        } else {
            0.0
        }
    }
}

/// How a large read is split: requests of `request_bytes` issued by `threads` threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelRead {
    /// Size of one request, rounded up to a multiple of [`IO_ALIGN`].
    pub request_bytes: usize,
    /// Requests in flight at once: the disk queue depth.
    pub threads: usize,
}

impl Default for ParallelRead {
    /// 8 threads × 16 MiB: the raw O_DIRECT reference of `gdsllm bench-io`, which gave the
    /// GPU machine's disk its full speed (a 7B layer of ~386 MiB is 25 requests).
    fn default() -> Self {
        ParallelRead {
            request_bytes: 16 << 20,
            threads: 8,
        }
    }
}

/// The smallest request [`ParallelRead::balanced_request`] makes of a large read.
const MIN_BALANCED_REQUEST: u64 = 1 << 20;

impl ParallelRead {
    /// The request size for a read of `len` bytes: at most `request_bytes` (aligned), and as
    /// even as alignment allows over a number of requests that is a multiple of `threads`, so
    /// every thread has the same work. With a fixed size, a 147 MB layer (7B Q5_K_M) was 9 × 16
    /// MiB requests on 8 threads: a second round with one request in flight. Measured on the
    /// H200 VM (2026-11-28) it did not move that model's disk-streamed decode (its layers read at
    /// 1.0–1.05 GB/s before and after, where `bench-io`'s raw pass makes 1.6): the even split
    /// only removes an idle tail; what slows those reads is elsewhere.
    pub fn balanced_request(&self, len: u64) -> usize {
        let max = align_up(self.request_bytes.max(1) as u64);
        let threads = self.threads.max(1) as u64;
        let rounds = len.div_ceil(max).div_ceil(threads).max(1);
        // Not below 1 MiB: a small blob is not worth eight tiny requests.
        let floor = max.min(MIN_BALANCED_REQUEST);
        align_up(len.div_ceil(rounds * threads)).clamp(floor, max) as usize
    }
}

static BUFFERED_FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// A file opened for aligned positional reads, with O_DIRECT when the filesystem allows it.
#[derive(Debug)]
pub struct DirectFile {
    file: File,
    path: PathBuf,
    direct: bool,
    len: u64,
    /// A buffered handle for [`DirectFile::read_span`], opened at its first call when `file`
    /// is O_DIRECT.
    buffered: std::sync::OnceLock<File>,
}

impl DirectFile {
    /// Opens `path` read-only with O_DIRECT, falling back to a buffered open when the
    /// filesystem refuses O_DIRECT at open or at the first read.
    pub fn open(path: impl AsRef<Path>) -> Result<DirectFile, HostIoError> {
        let path = path.as_ref().to_path_buf();
        let open_err = |source| HostIoError::Open {
            path: path.clone(),
            source,
        };
        let direct_attempt = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path);
        let (file, direct) = match direct_attempt {
            Ok(file) if direct_read_works(&file) => (file, true),
            Ok(_) => (File::open(&path).map_err(open_err)?, false),
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                (File::open(&path).map_err(open_err)?, false)
            }
            Err(err) => return Err(open_err(err)),
        };
        if !direct && !BUFFERED_FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
            tracing::info!(
                path = %path.display(),
                "filesystem refuses O_DIRECT; reading through the page cache instead \
                 (logged once per process)"
            );
        }
        let len = file.metadata().map_err(open_err)?.len();
        Ok(DirectFile {
            file,
            path,
            direct,
            len,
            buffered: std::sync::OnceLock::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// File length at open time.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check_aligned(&self, offset: u64, buf: &[u8]) -> Result<(), HostIoError> {
        let addr = buf.as_ptr() as usize;
        let align = IO_ALIGN as u64;
        if !offset.is_multiple_of(align)
            || !buf.len().is_multiple_of(IO_ALIGN)
            || !addr.is_multiple_of(IO_ALIGN)
        {
            return Err(HostIoError::Unaligned {
                path: self.path.clone(),
                offset,
                len: buf.len(),
                addr,
            });
        }
        Ok(())
    }

    /// One `pread` at an aligned offset into an aligned buffer of aligned length. Returns the
    /// bytes read, which is less than `buf.len()` only at end of file. Alignment is checked
    /// even on the buffered fallback, so code behaves the same on every filesystem.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize, HostIoError> {
        self.check_aligned(offset, buf)?;
        loop {
            match self.file.read_at(buf, offset) {
                Ok(n) => return Ok(n),
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(HostIoError::Read {
                        path: self.path.clone(),
                        offset,
                        len: buf.len(),
                        source,
                    });
                }
            }
        }
    }

    /// Fills `buf` from `offset`, retrying short reads; the end of `buf` past the end of the
    /// file is left untouched. Returns the bytes that came from the file.
    fn fill_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize, HostIoError> {
        let mut done = 0;
        while done < buf.len() {
            let n = self.read_at(offset + done as u64, &mut buf[done..])?;
            if n == 0 {
                break;
            }
            done += n;
            // A short read that is not block-aligned can only be the end of the file.
            if !done.is_multiple_of(IO_ALIGN) {
                break;
            }
        }
        Ok(done)
    }

    /// Reads `dst.len()` bytes at `offset` (both aligned), splitting the range into requests
    /// of `how.request_bytes` read by `how.threads` threads. The range must lie inside the
    /// file, except that the last request may run past an unaligned end of file.
    pub fn read_into_parallel(
        &self,
        offset: u64,
        dst: &mut [u8],
        how: ParallelRead,
    ) -> Result<ReadRecord, HostIoError> {
        self.check_aligned(offset, dst)?;
        let len = dst.len() as u64;
        if align_up(self.len) < offset + len {
            return Err(self.out_of_range(offset, len));
        }
        let start = Instant::now();
        let request = how.balanced_request(len);
        let chunks: Vec<(u64, &mut [u8])> = dst
            .chunks_mut(request)
            .enumerate()
            .map(|(i, chunk)| (offset + (i * request) as u64, chunk))
            .collect();
        let requests = chunks.len();
        let threads = how.threads.clamp(1, requests.max(1));
        let got: u64 = if threads <= 1 {
            let mut total = 0u64;
            for (off, chunk) in chunks {
                total += self.fill_at(off, chunk)? as u64;
            }
            total
        } else {
            // Round-robin assignment: neighbouring requests go to different threads, so the
            // disk sees `threads` requests in flight at ascending offsets.
            let mut per_thread: Vec<Vec<(u64, &mut [u8])>> =
                (0..threads).map(|_| Vec::new()).collect();
            for (i, item) in chunks.into_iter().enumerate() {
                per_thread[i % threads].push(item);
            }
            std::thread::scope(|scope| {
                let handles: Vec<_> = per_thread
                    .into_iter()
                    .map(|work| {
                        scope.spawn(move || -> Result<u64, HostIoError> {
                            let mut total = 0u64;
                            for (off, chunk) in work {
                                total += self.fill_at(off, chunk)? as u64;
                            }
                            Ok(total)
                        })
                    })
                    .collect();
                let mut total = 0u64;
                for handle in handles {
                    total += handle.join().expect("reader thread panicked")?;
                }
                Ok::<u64, HostIoError>(total)
            })?
        };
        let expected = len.min(self.len.saturating_sub(offset));
        if got < expected {
            // The file shrank after open.
            return Err(self.out_of_range(offset, len));
        }
        Ok(ReadRecord {
            bytes: got,
            io_path: IO_PATH_NAME,
            direct: self.direct,
            via_host_memory: true,
            elapsed: start.elapsed(),
            requests,
        })
    }

    /// Reads the aligned range `offset..offset+len` into a new [`AlignedBuf`] (its length is
    /// `len` rounded up to [`IO_ALIGN`]).
    pub fn read_range_parallel(
        &self,
        offset: u64,
        len: u64,
        how: ParallelRead,
    ) -> Result<(AlignedBuf, ReadRecord), HostIoError> {
        let mut buf = AlignedBuf::zeroed(len as usize)?;
        let record = self.read_into_parallel(offset, &mut buf, how)?;
        Ok((buf, record))
    }

    /// Reads an arbitrary (unaligned) byte range into `dst` through the page cache (a second,
    /// buffered handle when this one is O_DIRECT). For small on-demand reads such as the rows
    /// of an untied embedding table, one a token: through O_DIRECT each went to the disk every
    /// time (a 32-sequence decode step read its 32 rows one after another before its first
    /// kernel), where the page cache keeps the rows in use in RAM.
    pub fn read_span(&self, offset: u64, dst: &mut [u8]) -> Result<ReadRecord, HostIoError> {
        let len = dst.len() as u64;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| self.out_of_range(offset, len))?;
        if end > self.len {
            return Err(self.out_of_range(offset, len));
        }
        let start = Instant::now();
        let file = if self.direct {
            match self.buffered.get() {
                Some(file) => file,
                None => {
                    let file = File::open(&self.path).map_err(|source| HostIoError::Open {
                        path: self.path.clone(),
                        source,
                    })?;
                    // Another thread may have set it first: either handle reads the same file.
                    let _ = self.buffered.set(file);
                    self.buffered.get().expect("set just above")
                }
            }
        } else {
            &self.file
        };
        file.read_exact_at(dst, offset).map_err(|err| {
            if err.kind() == std::io::ErrorKind::UnexpectedEof {
                self.out_of_range(offset, len)
            } else {
                HostIoError::Read {
                    path: self.path.clone(),
                    offset,
                    len: len as usize,
                    source: err,
                }
            }
        })?;
        Ok(ReadRecord {
            bytes: len,
            io_path: IO_PATH_NAME,
            direct: false,
            via_host_memory: true,
            elapsed: start.elapsed(),
            requests: 1,
        })
    }

    fn out_of_range(&self, offset: u64, len: u64) -> HostIoError {
        HostIoError::OutOfRange {
            path: self.path.clone(),
            offset,
            end: offset.saturating_add(len),
            file_len: self.len,
        }
    }
}

/// Some filesystems accept O_DIRECT at open and refuse it (EINVAL) at the first read.
fn direct_read_works(file: &File) -> bool {
    let Ok(mut probe) = AlignedBuf::zeroed(IO_ALIGN) else {
        return false;
    };
    loop {
        match file.read_at(&mut probe, 0) {
            Ok(_) => return true,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_read_is_split_into_even_rounds_of_requests() {
        const MIB: u64 = 1 << 20;
        let how = ParallelRead::default(); // 8 × 16 MiB
        for len in [
            147_382_272u64,
            386 * MIB,
            4096 * MIB + 4096,
            129 * MIB,
            16 * MIB,
            3 * MIB,
        ] {
            let size = how.balanced_request(len) as u64;
            let requests = len.div_ceil(size);
            println!("{len} bytes: {requests} requests of {size}");
            assert!(
                size <= 16 * MIB && size.is_multiple_of(IO_ALIGN as u64),
                "{len}: {size}"
            );
            // Every thread gets the same number of requests, give or take the short last one.
            let rounds = requests.div_ceil(8);
            assert!(
                requests > 8 * (rounds - 1) + 6 || len < 8 * MIB,
                "{len}: {requests} requests"
            );
        }
        // 9 × 16 MiB would leave a second round of one request: now 16 requests of ~9 MB.
        assert_eq!(
            147_382_272u64.div_ceil(how.balanced_request(147_382_272) as u64),
            16
        );
        // Small reads are not cut below 1 MiB, nor a tiny read below one aligned request.
        assert_eq!(how.balanced_request(3 * MIB), MIB as usize);
        assert_eq!(how.balanced_request(100), MIB as usize);
        let tiny = ParallelRead {
            request_bytes: 4096,
            threads: 3,
        };
        assert_eq!(tiny.balanced_request(10_000), 4096);
    }

    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(name);
        std::fs::File::create(&path)
            .unwrap()
            .write_all(bytes)
            .unwrap();
        path
    }

    #[test]
    fn parallel_read_equals_plain_read() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = pattern(5 * 1024 * 1024 + 3 * 4096, 1);
        let path = write_file(dir.path(), "a.bin", &bytes);
        let file = DirectFile::open(&path).unwrap();
        eprintln!("direct I/O on the temp dir: {}", file.is_direct());
        for (threads, request) in [(1, 4096), (3, 1 << 20), (8, 64 << 10), (16, 16 << 20)] {
            let how = ParallelRead {
                request_bytes: request,
                threads,
            };
            let (buf, rec) = file
                .read_range_parallel(4096, bytes.len() as u64 - 4096, how)
                .unwrap();
            assert_eq!(&buf[..], &bytes[4096..]);
            assert_eq!(rec.bytes, bytes.len() as u64 - 4096);
            assert_eq!(rec.io_path, "host");
            assert!(rec.via_host_memory);
            assert_eq!(rec.direct, file.is_direct());
        }
    }

    #[test]
    fn random_spans_equal_file_bytes() {
        let dir = tempfile::tempdir().unwrap();
        // Unaligned file length: the last block is partial.
        let bytes = pattern(300_001, 2);
        let path = write_file(dir.path(), "b.bin", &bytes);
        let file = DirectFile::open(&path).unwrap();
        let mut x = 12345u64;
        for _ in 0..200 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let off = (x >> 33) as usize % bytes.len();
            let len = ((x >> 13) as usize % 20_000).min(bytes.len() - off);
            let mut dst = vec![0u8; len];
            file.read_span(off as u64, &mut dst).unwrap();
            assert_eq!(dst, &bytes[off..off + len], "span {off}+{len}");
        }
        // The partial last block reads through an aligned range too.
        let (buf, rec) = file
            .read_range_parallel(0, align_up(bytes.len() as u64), ParallelRead::default())
            .unwrap();
        assert_eq!(rec.bytes, bytes.len() as u64);
        assert_eq!(&buf[..bytes.len()], &bytes[..]);
    }

    #[test]
    fn unaligned_and_out_of_range_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path(), "c.bin", &pattern(8192, 3));
        let file = DirectFile::open(&path).unwrap();
        let mut buf = AlignedBuf::zeroed(4096).unwrap();
        let err = file.read_at(100, &mut buf).unwrap_err();
        assert!(matches!(err, HostIoError::Unaligned { offset: 100, .. }));
        assert!(err.to_string().contains("c.bin"), "{err}");
        let err = file.read_at(0, &mut buf[..100]).unwrap_err();
        assert!(matches!(err, HostIoError::Unaligned { len: 100, .. }));
        let mut wide = AlignedBuf::zeroed(8192).unwrap();
        let err = file.read_at(0, &mut wide[1..4097]).unwrap_err();
        assert!(matches!(err, HostIoError::Unaligned { len: 4096, .. }));
        let err = file
            .read_range_parallel(4096, 8192, ParallelRead::default())
            .unwrap_err();
        assert!(
            matches!(
                err,
                HostIoError::OutOfRange {
                    offset: 4096,
                    end: 12288,
                    file_len: 8192,
                    ..
                }
            ),
            "{err}"
        );
        let mut dst = [0u8; 10];
        assert!(file.read_span(8190, &mut dst).is_err());
        // At end of file read_at returns 0, not an error.
        assert_eq!(file.read_at(8192, &mut buf).unwrap(), 0);
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = DirectFile::open("/nonexistent/dir/model.bin").unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/dir/model.bin"),
            "{err}"
        );
    }

    #[test]
    fn tmpfs_falls_back_to_buffered_reads() {
        // /dev/shm is tmpfs on most Linux systems, and tmpfs refuses O_DIRECT.
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            eprintln!("no /dev/shm here; the fallback is covered where it exists");
            return;
        };
        let bytes = pattern(3 * 4096, 4);
        let path = write_file(dir.path(), "d.bin", &bytes);
        let file = DirectFile::open(&path).unwrap();
        eprintln!("direct on /dev/shm: {}", file.is_direct());
        let (buf, rec) = file
            .read_range_parallel(0, bytes.len() as u64, ParallelRead::default())
            .unwrap();
        assert_eq!(&buf[..], &bytes[..]);
        assert_eq!(rec.direct, file.is_direct());
    }
}
