//! The `bounce` I/O path: several threads read with O_DIRECT into a ring of pinned host
//! buffers; each filled buffer is copied to the device with an async copy on a dedicated copy
//! stream, and an event per buffer says when it may be refilled. Disk reads and PCIe copies
//! overlap, so the pipeline runs at the disk's speed.
//!
//! Reads are queued on a [`BouncePipeline`]: every request of every submitted read goes into
//! one FIFO that the reader threads drain, so a caller that submits blob i+1 before waiting
//! for blob i (double buffering, as residency streams) never lets the disk queue run dry at a
//! blob boundary. [`DeviceReader::read`] is a pipeline with one read in it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use cudarc::driver::{CudaEvent, CudaStream, result, sys::CUdeviceptr};

use crate::error::GdsError;
use crate::file::GdsFile;
use crate::gpu::{GdsBuffer, Gpu, PinnedBuf};
use crate::host::ReadRecord;
use crate::io_path::{DeviceRead, DeviceReader, IoPath, IoStats, IoTotals, ReadSpan, ReadTicket};

/// Tuning of the bounce ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BounceConfig {
    /// Size of one pinned buffer, i.e. of one disk request (rounded up to 4096).
    pub slot_bytes: usize,
    /// Pinned buffers in the ring; several per thread so that a thread never waits for a
    /// host→device copy before it can issue its next disk read.
    pub slots: usize,
    /// Threads issuing O_DIRECT reads: the disk queue depth.
    pub threads: usize,
}

impl BounceConfig {
    /// `threads` readers issuing `request_bytes` requests, with four pinned slots per reader
    /// (at least 64 MiB of ring) so copies never hold up reads.
    pub fn with_request(request_bytes: usize, threads: usize) -> BounceConfig {
        let threads = threads.max(1);
        let slot_bytes = request_bytes.max(crate::aligned::IO_ALIGN);
        let slots = (4 * threads).max((64 << 20) / slot_bytes).min(256);
        BounceConfig {
            slot_bytes,
            slots,
            threads,
        }
    }
}

impl Default for BounceConfig {
    /// 8 readers × 1 MiB requests, 64 slots (64 MiB pinned). On the GPU machine's virtio disk
    /// (H100 VM, one `gdsllm bench-io --drop-caches` run over a 13.5 GB 7B-shaped model) the
    /// double-buffered ring gave 4.79 GB/s with 1 MiB requests, 3.60 with 4 MiB and 3.54 with
    /// 16 MiB, against 3.32 for raw 8 × 16 MiB O_DIRECT; the gds-io GPU test agreed (4.54 vs
    /// 3.50). `gdsllm bench-io --bounce-request-mib` sweeps it on other disks.
    fn default() -> Self {
        BounceConfig::with_request(1 << 20, 8)
    }
}

struct Slot {
    host: PinnedBuf,
    /// Recorded after the copy out of `host`; the slot may be refilled once it completes.
    copied: Option<CudaEvent>,
}

pub struct BounceReader {
    gpu: Gpu,
    copy_stream: Arc<CudaStream>,
    slots: Vec<Mutex<Slot>>,
    free_tx: Sender<usize>,
    free_rx: Receiver<usize>,
    config: BounceConfig,
    stats: IoStats,
}

/// Progress of one submitted read, shared by the reader threads working on its requests.
struct ReadState {
    remaining: Mutex<usize>,
    finished: Condvar,
    error: Mutex<Option<GdsError>>,
}

impl ReadState {
    fn failed(&self) -> bool {
        self.error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn complete_one(&self, outcome: Result<(), GdsError>) {
        if let Err(err) = outcome {
            self.error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(err);
        }
        let mut remaining = self.remaining.lock().unwrap_or_else(|p| p.into_inner());
        *remaining -= 1;
        if *remaining == 0 {
            self.finished.notify_all();
        }
    }
}

/// One disk request of a submitted read.
struct Job<'env> {
    file: &'env GdsFile,
    part: ReadSpan,
    base: CUdeviceptr,
    state: Arc<ReadState>,
}

/// A read queued on a [`BouncePipeline`]; [`BouncePipeline::wait`] returns when its bytes are
/// in device memory.
#[must_use = "wait for the ticket before using (or dropping) the destination buffer's bytes"]
pub struct BounceTicket {
    state: Arc<ReadState>,
    bytes: u64,
    requests: usize,
    direct: bool,
    submitted: Instant,
}

/// A queue of reads served by the reader's threads, open for the duration of
/// [`BounceReader::pipeline`]. Files and buffers passed to [`submit`](Self::submit) are
/// borrowed for the whole pipeline, so they cannot go away while a request is in flight.
pub struct BouncePipeline<'scope, 'env> {
    reader: &'env BounceReader,
    scope: &'scope std::thread::Scope<'scope, 'env>,
    jobs_tx: Sender<Job<'env>>,
    jobs_rx: Receiver<Job<'env>>,
    spawned: std::cell::Cell<usize>,
    queued: std::cell::Cell<usize>,
}

impl BounceReader {
    /// Allocates the pinned ring (`slots × slot_bytes`) and the copy stream.
    pub fn new(gpu: &Gpu, config: BounceConfig) -> Result<BounceReader, GdsError> {
        let slot_bytes = config
            .slot_bytes
            .max(1)
            .next_multiple_of(crate::aligned::IO_ALIGN);
        let config = BounceConfig {
            slot_bytes,
            slots: config.slots.max(1),
            threads: config.threads.max(1),
        };
        let copy_stream = gpu.new_stream()?;
        let (free_tx, free_rx) = crossbeam_channel::bounded(config.slots);
        let mut slots = Vec::with_capacity(config.slots);
        for index in 0..config.slots {
            slots.push(Mutex::new(Slot {
                host: PinnedBuf::alloc(gpu, slot_bytes)?,
                copied: None,
            }));
            free_tx
                .send(index)
                .expect("the channel has room for every slot and its receiver is alive");
        }
        Ok(BounceReader {
            gpu: gpu.clone(),
            copy_stream,
            slots,
            free_tx,
            free_rx,
            config,
            stats: IoStats::default(),
        })
    }

    pub fn config(&self) -> BounceConfig {
        self.config
    }

    /// Runs `body` with a pipeline whose reader threads live until `body` returns; reads
    /// still queued then are finished (and their errors dropped) before this returns.
    ///
    /// ```no_run
    /// # use gds_io::{BounceReader, GdsBuffer, GdsFile};
    /// # fn stream(bounce: &BounceReader, files: &[GdsFile], bufs: &[GdsBuffer; 2]) -> Result<(), gds_io::GdsError> {
    /// bounce.pipeline(|p| {
    ///     // Double buffering: blob i+1 is queued before blob i is waited for.
    ///     let mut pending = std::collections::VecDeque::new();
    ///     for (i, file) in files.iter().enumerate() {
    ///         if pending.len() == 2 {
    ///             p.wait(pending.pop_front().unwrap())?; // frees bufs[i % 2]
    ///         }
    ///         pending.push_back(p.submit(file, 0, file.len() as usize, &bufs[i % 2], 0)?);
    ///     }
    ///     pending.into_iter().try_for_each(|t| p.wait(t).map(drop))
    /// })
    /// # }
    /// ```
    pub fn pipeline<'env, T>(
        &'env self,
        body: impl for<'scope> FnOnce(&BouncePipeline<'scope, 'env>) -> Result<T, GdsError>,
    ) -> Result<T, GdsError> {
        std::thread::scope(|scope| {
            let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded();
            let pipeline = BouncePipeline {
                reader: self,
                scope,
                jobs_tx,
                jobs_rx,
                spawned: std::cell::Cell::new(0),
                queued: std::cell::Cell::new(0),
            };
            let outcome = body(&pipeline);
            // Dropping the sender ends the reader threads once the queue is empty; the scope
            // joins them before returning, so nothing outlives the borrowed files and buffers.
            drop(pipeline);
            outcome
        })
    }

    fn serve(&self, jobs: Receiver<Job<'_>>) {
        if let Err(err) = self.gpu.bind() {
            // Fail every job this thread would have taken instead of hanging their waiters.
            let message = err.to_string();
            for job in jobs {
                job.state.complete_one(Err(GdsError::IoPathUnavailable {
                    io_path: "bounce",
                    reason: format!("reader thread cannot bind the CUDA context: {message}"),
                }));
            }
            return;
        }
        for job in jobs {
            let outcome = if job.state.failed() {
                Ok(()) // the read already failed; skip the rest of its requests
            } else {
                let index = self
                    .free_rx
                    .recv()
                    .expect("the reader holds a sender, so the ring channel stays open");
                let outcome = self.fill_and_copy(job.file, &job.part, job.base, index);
                self.free_tx
                    .send(index)
                    .expect("the ring channel has room for every slot it handed out");
                outcome
            };
            job.state.complete_one(outcome);
        }
    }

    fn fill_and_copy(
        &self,
        file: &GdsFile,
        part: &ReadSpan,
        base: CUdeviceptr,
        index: usize,
    ) -> Result<(), GdsError> {
        let mut slot = self.slots[index].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(copied) = slot.copied.take() {
            copied
                .synchronize()
                .map_err(GdsError::cuda("cuEventSynchronize"))?;
        }
        let aligned_len = part.len.next_multiple_of(crate::aligned::IO_ALIGN);
        let host = &mut slot.host.as_mut_slice()[..aligned_len];
        let direct = file.direct_file();
        let mut got = 0usize;
        while got < part.len {
            let n = direct.read_at(part.offset + got as u64, &mut host[got..])?;
            if n == 0 {
                break;
            }
            got += n;
            if !got.is_multiple_of(crate::aligned::IO_ALIGN) {
                break; // a short, unaligned read only happens at the end of the file
            }
        }
        if got < part.len {
            return Err(GdsError::PastEndOfFile {
                path: file.path().to_path_buf(),
                offset: part.offset,
                end: part.offset + part.len as u64,
                file_len: part.offset + got as u64,
            });
        }
        let source = &slot.host.as_slice()[..part.len];
        // SAFETY: the destination range lies inside `dst`'s allocation (ReadSpan::check), and
        // `dst` is borrowed by the pipeline until every job is done and its copies waited for
        // (BouncePipeline::wait, or the read_async ticket's event that `dst`'s Drop waits on);
        // the pinned source stays untouched until `copied` (recorded right after on the same
        // stream) completes, which the next user of this slot and the reader's Drop wait for.
        unsafe {
            result::memcpy_htod_async(
                base + part.dst_offset as u64,
                source,
                self.copy_stream.cu_stream(),
            )
        }
        .map_err(GdsError::cuda("cuMemcpyHtoDAsync"))?;
        let copied = self.gpu.new_event()?;
        copied
            .record(&self.copy_stream)
            .map_err(GdsError::cuda("cuEventRecord"))?;
        slot.copied = Some(copied);
        Ok(())
    }

    fn record_on_copy_stream(&self) -> Result<CudaEvent, GdsError> {
        self.gpu.bind()?;
        let event = self.gpu.new_event()?;
        event
            .record(&self.copy_stream)
            .map_err(GdsError::cuda("cuEventRecord"))?;
        Ok(event)
    }

    fn record(&self, ticket: &BounceTicket) -> ReadRecord {
        let record = ReadRecord {
            bytes: ticket.bytes,
            io_path: IoPath::Bounce.name(),
            direct: ticket.direct,
            via_host_memory: true,
            elapsed: ticket.submitted.elapsed(),
            requests: ticket.requests,
        };
        self.stats.add(&record);
        record
    }
}

impl<'scope, 'env> BouncePipeline<'scope, 'env> {
    /// Queues `len` bytes at `offset` of `file` for `dst[dst_offset..]` behind every read
    /// already queued. The disk reads start at once on the reader threads.
    pub fn submit(
        &self,
        file: &'env GdsFile,
        offset: u64,
        len: usize,
        dst: &'env GdsBuffer,
        dst_offset: usize,
    ) -> Result<BounceTicket, GdsError> {
        let span = ReadSpan::check(file, offset, len, dst.len(), dst_offset)?;
        // An earlier asynchronous write into `dst` must land before ours.
        dst.wait_pending()?;
        let parts = span.split(self.reader.config.slot_bytes);
        let state = Arc::new(ReadState {
            remaining: Mutex::new(parts.len()),
            finished: Condvar::new(),
            error: Mutex::new(None),
        });
        let ticket = BounceTicket {
            state: state.clone(),
            bytes: len as u64,
            requests: parts.len(),
            direct: file.is_direct(),
            submitted: Instant::now(),
        };
        let base = dst.device_ptr();
        for part in parts {
            self.jobs_tx
                .send(Job {
                    file,
                    part,
                    base,
                    state: state.clone(),
                })
                .expect("the pipeline holds a receiver, so the job queue stays open");
        }
        self.queued.set(self.queued.get() + ticket.requests);
        // Threads start lazily, so a small read does not spawn the whole pool.
        let wanted = self.queued.get().min(self.reader.config.threads);
        while self.spawned.get() < wanted {
            let jobs = self.jobs_rx.clone();
            let reader = self.reader;
            self.scope.spawn(move || reader.serve(jobs));
            self.spawned.set(self.spawned.get() + 1);
        }
        Ok(ticket)
    }

    /// Blocks until every disk read of `ticket` has finished and its copy is queued on the
    /// copy stream; returns the first error any of them hit.
    fn wait_for_disk_reads(ticket: &BounceTicket) -> Result<(), GdsError> {
        let mut remaining = ticket
            .state
            .remaining
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        while *remaining > 0 {
            remaining = ticket
                .state
                .finished
                .wait(remaining)
                .unwrap_or_else(|p| p.into_inner());
        }
        drop(remaining);
        match ticket
            .state
            .error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Blocks until `ticket`'s bytes are in device memory. `elapsed` in the record runs from
    /// submission, so it includes time spent queued behind earlier reads.
    pub fn wait(&self, ticket: BounceTicket) -> Result<ReadRecord, GdsError> {
        Self::wait_for_disk_reads(&ticket)?;
        // Every copy of this read is on the copy stream by now; an event recorded after them
        // completes once they have (it may also wait for a few copies of the next read).
        self.reader
            .record_on_copy_stream()?
            .synchronize()
            .map_err(GdsError::cuda("cuEventSynchronize"))?;
        Ok(self.reader.record(&ticket))
    }

    /// Like [`wait`](Self::wait) but does not block the host: `stream` waits for the copies,
    /// and the returned ticket's `wait` blocks if the host needs to.
    pub fn wait_on_stream(
        &self,
        ticket: BounceTicket,
        stream: &Arc<CudaStream>,
        dst: &GdsBuffer,
    ) -> Result<ReadTicket, GdsError> {
        Self::wait_for_disk_reads(&ticket)?;
        let landed = self.reader.record_on_copy_stream()?;
        stream
            .wait(&landed)
            .map_err(GdsError::cuda("cuStreamWaitEvent"))?;
        dst.set_pending(self.reader.record_on_copy_stream()?);
        Ok(ReadTicket {
            event: Some(landed),
            record: self.reader.record(&ticket),
        })
    }
}

impl DeviceReader for BounceReader {
    fn kind(&self) -> IoPath {
        IoPath::Bounce
    }

    fn read(
        &self,
        file: &GdsFile,
        offset: u64,
        len: usize,
        dst: &GdsBuffer,
        dst_offset: usize,
    ) -> Result<ReadRecord, GdsError> {
        self.pipeline(|p| {
            let ticket = p.submit(file, offset, len, dst, dst_offset)?;
            p.wait(ticket)
        })
    }

    /// The disk reads run during this call; the copies are queued after the work already on
    /// `stream`, and `stream` waits for them. `elapsed` in the record is the time to issue.
    fn read_async(
        &self,
        file: &GdsFile,
        offset: u64,
        len: usize,
        dst: &GdsBuffer,
        dst_offset: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<ReadTicket, GdsError> {
        ReadSpan::check(file, offset, len, dst.len(), dst_offset)?;
        self.gpu.bind()?;
        let before = self.gpu.new_event()?;
        before
            .record(stream)
            .map_err(GdsError::cuda("cuEventRecord"))?;
        self.copy_stream
            .wait(&before)
            .map_err(GdsError::cuda("cuStreamWaitEvent"))?;
        self.pipeline(|p| {
            let ticket = p.submit(file, offset, len, dst, dst_offset)?;
            p.wait_on_stream(ticket, stream, dst)
        })
    }

    /// All requests of all reads share one queue, so the disk stays busy across reads.
    fn read_many(&self, reads: &[DeviceRead<'_>]) -> Result<Vec<ReadRecord>, GdsError> {
        self.pipeline(|p| {
            let tickets = reads
                .iter()
                .map(|r| p.submit(r.file, r.offset, r.len, r.dst, r.dst_offset))
                .collect::<Result<Vec<_>, _>>()?;
            tickets.into_iter().map(|t| p.wait(t)).collect()
        })
    }

    fn stats(&self) -> IoTotals {
        self.stats.totals()
    }
}

impl Drop for BounceReader {
    fn drop(&mut self) {
        // The pinned ring must not be freed under an in-flight copy.
        if self.gpu.bind().is_ok()
            && let Err(err) = self.copy_stream.synchronize()
        {
            tracing::error!("bounce copy stream failed at drop: {err}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_keeps_several_slots_per_reader() {
        let c = BounceConfig::default();
        assert_eq!((c.slot_bytes, c.threads), (1 << 20, 8));
        assert!(c.slots >= 4 * c.threads, "{c:?}");
        for mib in [1usize, 4, 8, 16] {
            let c = BounceConfig::with_request(mib << 20, 12);
            assert!(
                c.slots >= 4 * 12 && c.slots * c.slot_bytes >= 64 << 20,
                "{c:?}"
            );
        }
        assert_eq!(BounceConfig::with_request(0, 0).threads, 1);
    }
}
