//! The running cache: buffers, the reader thread, and the `acquire` API the forward pass uses.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use gds_io::ParallelRead;
use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard};
use weights_format::Model;

use crate::clock::{Clock, SystemClock};
use crate::engine::{Engine, Job, Location, LocationState, Lookup, Outcome, ReadFrom};
use crate::error::ResidencyError;
use crate::memory::{CpuMemory, DeviceBuffer, DeviceMemory, HostBlock, ReleaseFence, WeightBytes};
use crate::options::{
    AUTO_RAM_SHARE, BlobChecksums, Budget, HostCache, ResidencyOptions, human_bytes, mem_available,
};
use crate::plan::{ModelLayout, Plan, PlanInputs};
use crate::source::{BlobSource, open_model_source};
use crate::stats::ResidencyStats;

type Buffer = RwLock<Box<dyn DeviceBuffer>>;

/// Device memory `--vram-budget auto` leaves free on a GPU: kernels, the cuBLAS workspace and
/// other processes' small allocations.
pub const GPU_AUTO_MARGIN: u64 = 1 << 30;

struct Shared {
    engine: Mutex<Engine>,
    changed: Condvar,
    slots: Vec<Buffer>,
    resident: Vec<Option<Buffer>>,
    host_tier: Vec<RwLock<Option<Box<dyn HostBlock>>>>,
    host_tier_bytes: AtomicU64,
    /// Bytes hashed for checksums and the nanoseconds spent on them.
    checksum_bytes: AtomicU64,
    checksum_nanos: AtomicU64,
    /// Per staging slot: what compute said must finish before the slot is written again.
    slot_fences: Vec<Mutex<Option<Box<dyn ReleaseFence>>>>,
    names: Vec<String>,
    source: Arc<dyn BlobSource>,
    memory: Arc<dyn DeviceMemory>,
    clock: Arc<dyn Clock>,
    jobs: Mutex<mpsc::Sender<Option<Job>>>,
    stopping: AtomicBool,
    reader_stopped: AtomicBool,
    checksums: BlobChecksums,
    /// Per blob: its bytes have been checked against its checksum once.
    verified: Vec<AtomicBool>,
    /// Which byte ranges of a blob a fill from the host tier copies
    /// ([`Residency::set_fill_ranges`]).
    fill_ranges: RwLock<Option<Arc<FillRangesFn>>>,
    /// Per blob: its last fill when it copied only some ranges, `None` when it copied the
    /// whole blob.
    partial_fills: Vec<Mutex<Option<PartialFill>>>,
}

/// A fill from the host tier that copied only some byte ranges of its blob.
struct PartialFill {
    tag: u64,
    /// Sorted, disjoint `(offset, len)`: what the device holds.
    ranges: Vec<(u64, u64)>,
}

/// What a fill from the host tier copies of blob `blob` now: `Some((tag, ranges))` copies only
/// the byte ranges `(offset, len)` and marks the fill with `tag`
/// ([`Residency::filled_with`]); `None` copies the whole blob. Asked again when a blob whose
/// last fill was partial is acquired: the ranges it names then that the fill left out are
/// copied up before the blob is handed out ([`Residency::set_fill_ranges`]).
pub type FillRangesFn = dyn Fn(usize) -> Option<(u64, Vec<(u64, u64)>)> + Send + Sync;

/// The planned cache of blobs in device memory. `Send + Sync`; one forward pass at a time
/// calls [`Residency::acquire`] in plan order.
pub struct Residency {
    shared: Arc<Shared>,
    plan: Plan,
    reader: Option<JoinHandle<()>>,
}

/// A blob in memory: [`BlobGuard::bytes`] says whether in host memory (the CPU backend) or
/// in device memory. Dropping it releases the staging slot so the next read in plan order can
/// start — after the [`ReleaseFence`] given to [`BlobGuard::release_after`], if any.
pub struct BlobGuard<'a> {
    owner: &'a Residency,
    location: Location,
    len: usize,
    buffer: Option<RwLockReadGuard<'a, Box<dyn DeviceBuffer>>>,
    fence: Option<Box<dyn ReleaseFence>>,
    /// The blob's host-tier copy, held while the guard lives
    /// ([`Residency::acquire_with_host_copy`]).
    host_copy: Option<RwLockReadGuard<'a, Option<Box<dyn HostBlock>>>>,
}

impl BlobGuard<'_> {
    /// The blob's bytes (without the padding of its buffer), where they are.
    pub fn bytes(&self) -> WeightBytes<'_> {
        let buffer = self.buffer.as_ref().expect("present until drop");
        let bytes = buffer
            .bytes()
            .slice(0, self.len)
            .expect("a buffer holds the blob it was filled with");
        match (bytes, self.host_copy()) {
            (WeightBytes::Device(device), Some(host)) => WeightBytes::Both(host, device),
            (bytes, _) => bytes,
        }
    }

    /// The blob's host-tier copy, when it was acquired with
    /// [`Residency::acquire_with_host_copy`] and the host tier holds it.
    pub fn host_copy(&self) -> Option<&[u8]> {
        let block = self.host_copy.as_ref()?.as_ref()?;
        block.bytes().get(..self.len)
    }

    /// The bytes when the blob is in host memory.
    pub fn host(&self) -> Option<&[u8]> {
        self.bytes().host()
    }

    /// The blob's length in bytes (without the padding of its buffer).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the blob stays in memory for the whole run (no later read replaces it).
    pub fn is_resident(&self) -> bool {
        matches!(self.location, Location::Resident(_))
    }

    /// The staging slot is not written again before `fence` says the device is done with it.
    /// A resident blob is never rewritten, so its fence is dropped at once.
    pub fn release_after(&mut self, fence: Box<dyn ReleaseFence>) {
        if !self.is_resident() {
            self.fence = Some(fence);
        }
    }
}

impl Drop for BlobGuard<'_> {
    fn drop(&mut self) {
        // Unlock the buffer before the engine may hand the slot to the reader.
        self.buffer.take();
        self.host_copy.take();
        if let (Some(fence), Location::Slot(i)) = (self.fence.take(), self.location) {
            *self.owner.shared.slot_fences[i].lock() = Some(fence);
        }
        self.owner.release(self.location);
    }
}

impl Residency {
    /// CPU: "device" memory is host memory; reads go through `gds_io::host` (O_DIRECT).
    pub fn open_host(model: &Model, opts: &ResidencyOptions) -> Result<Residency, ResidencyError> {
        let meta = model.metadata();
        let layout = ModelLayout::from_metadata(meta)?;
        let source = open_model_source(model.dir(), meta, ParallelRead::default())?;
        let budget = match opts.device_budget {
            Budget::Bytes(b) => b,
            Budget::Auto => auto_ram_share("--vram-budget auto")?,
        };
        Residency::open_with(
            layout,
            source,
            Arc::new(CpuMemory::new(budget)),
            Arc::new(SystemClock::new()),
            opts,
        )
    }

    /// GPU `ordinal`: slots and resident blobs in device memory, filled through the `gds-io`
    /// I/O path `io` resolves to; the host tier is page-locked. `--vram-budget auto` is the
    /// device's free memory less [`GPU_AUTO_MARGIN`]. Returns the memory too, for its I/O
    /// statistics.
    pub fn open_gpu(
        model: &Model,
        opts: &ResidencyOptions,
        ordinal: usize,
        io: gds_io::IoChoice,
    ) -> Result<(Residency, Arc<crate::gpu::GpuMemory>), ResidencyError> {
        let meta = model.metadata();
        let layout = ModelLayout::from_metadata(meta)?;
        let budget = match opts.device_budget {
            Budget::Bytes(b) => Some(b),
            Budget::Auto => None,
        };
        let mut memory = crate::gpu::GpuMemory::open(ordinal, io, model.dir(), meta, budget)?;
        if budget.is_none() {
            memory.reduce_budget(GPU_AUTO_MARGIN);
        }
        let memory = Arc::new(memory);
        let source = open_model_source(model.dir(), meta, ParallelRead::default())?;
        let residency = Residency::open_with(
            layout,
            source,
            memory.clone(),
            Arc::new(SystemClock::new()),
            opts,
        )?;
        Ok((residency, memory))
    }

    /// Opens over any source, memory and clock. The device budget is the smaller of
    /// `opts.device_budget` and `memory.budget()`.
    pub fn open_with(
        layout: ModelLayout,
        source: Arc<dyn BlobSource>,
        memory: Arc<dyn DeviceMemory>,
        clock: Arc<dyn Clock>,
        opts: &ResidencyOptions,
    ) -> Result<Residency, ResidencyError> {
        if source.blob_count() != layout.blobs.len() {
            return Err(ResidencyError::Layout {
                file: "metadata.json".into(),
                reason: format!(
                    "the source has {} blobs, the layout {}",
                    source.blob_count(),
                    layout.blobs.len()
                ),
            });
        }
        let mut inputs = plan_inputs(opts, Some(memory.budget()))?;
        let (plan, slots, resident) = loop {
            let plan = Plan::compute(&layout, &inputs)?;
            match allocate(&plan, memory.as_ref()) {
                Ok((slots, resident)) => break (plan, slots, resident),
                Err(allocated) => {
                    // Shrink to what the device actually gave us, so the next plan keeps
                    // fewer blobs resident; Plan::compute says so if even the ring is lost.
                    let shrunk = (inputs.reserved_bytes + allocated).min(inputs.device_budget - 1);
                    tracing::warn!(
                        budget = inputs.device_budget,
                        allocated,
                        resident_bytes = plan.resident_bytes,
                        "device allocation failed under memory pressure; shrinking the budget \
                         from {} to {} and the resident set with it",
                        human_bytes(inputs.device_budget),
                        human_bytes(shrunk),
                    );
                    inputs.device_budget = shrunk;
                }
            }
        };
        tracing::info!(
            resident_bytes = plan.resident_bytes,
            resident_layers = plan.resident_layers,
            ring_slots = plan.ring_slots,
            slot_bytes = plan.slot_bytes,
            disk_bytes_per_pass = plan.disk_bytes_per_pass,
            host_bytes_per_pass = plan.host_bytes_per_pass,
            "residency plan"
        );
        let (sender, receiver) = mpsc::channel();
        let mut engine = Engine::new(&plan);
        engine.start(clock.now());
        let first_jobs = engine.take_jobs();
        let shared = Arc::new(Shared {
            engine: Mutex::new(engine),
            changed: Condvar::new(),
            slots,
            resident,
            host_tier: layout.blobs.iter().map(|_| RwLock::new(None)).collect(),
            fill_ranges: RwLock::new(None),
            partial_fills: layout.blobs.iter().map(|_| Mutex::new(None)).collect(),
            host_tier_bytes: AtomicU64::new(0),
            checksum_bytes: AtomicU64::new(0),
            checksum_nanos: AtomicU64::new(0),
            slot_fences: (0..plan.ring_slots).map(|_| Mutex::new(None)).collect(),
            names: layout.blobs.iter().map(|b| b.file.clone()).collect(),
            source,
            memory,
            clock,
            jobs: Mutex::new(sender),
            stopping: AtomicBool::new(false),
            reader_stopped: AtomicBool::new(false),
            checksums: opts.checksums,
            verified: layout
                .blobs
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
        });
        let reader_shared = Arc::clone(&shared);
        let reader = std::thread::Builder::new()
            .name("residency-reader".into())
            .spawn(move || reader_loop(&reader_shared, receiver))
            .map_err(|e| ResidencyError::ReadFailed {
                file: "(reader thread)".into(),
                message: e.to_string(),
            })?;
        shared.send(first_jobs);
        Ok(Residency {
            shared,
            plan,
            reader: Some(reader),
        })
    }

    /// [`Residency::acquire`], and when the host tier holds the blob (a streamed blob after
    /// its first read), its host copy too: [`BlobGuard::bytes`] is then
    /// [`WeightBytes::Both`], device memory for the GPU and pinned RAM the CPU reads in place
    /// (`llama::hybrid` splits its matmuls between the two). The host tier never drops a blob,
    /// so the copy stays valid while the guard lives.
    pub fn acquire_with_host_copy(&self, blob: usize) -> Result<BlobGuard<'_>, ResidencyError> {
        let mut guard = self.acquire(blob)?;
        if !guard.is_resident() {
            let host = self.shared.host_tier[blob].read();
            if host.is_some() {
                guard.host_copy = Some(host);
            }
        }
        Ok(guard)
    }

    /// Which byte ranges of each blob a fill from the host tier into a staging slot copies
    /// from now on (`llama::hybrid`: the GPU's rows of each split matmul weight and every
    /// tensor it reads whole, at the share of the pass being run): the PCIe link carries the
    /// GPU's share alone while the CPU reads its own from the host tier in place. `None`:
    /// whole blobs. A range outside its blob fails the read that asked for it.
    ///
    /// A blob is often filled before the pass that reads it starts (the ring prefetches the
    /// next pass's first blobs during this one), so `ranges` is asked again when a blob whose
    /// last fill was partial is acquired: the bytes it names now that the fill left out are
    /// copied from the host tier into the same slot first (a slot holds a whole blob), and the
    /// fill takes the new tag (none when `ranges` now says the whole blob). Bytes the fill
    /// holds and `ranges` no longer names stay, under the fill's own tag: the device has them,
    /// and the caller computes from what it has. `llama::hybrid` relies on this so that a
    /// prefill after decode steps has the GPU compute every row of the blobs prefetched at the
    /// decode share, instead of the CPU computing that share at the prefill's rows.
    pub fn set_fill_ranges(&self, ranges: Option<Arc<FillRangesFn>>) {
        *self.shared.fill_ranges.write() = ranges;
    }

    /// The tag of blob `blob`'s last fill when it copied only some ranges
    /// ([`Residency::set_fill_ranges`]), as completed when it was last acquired: the device
    /// then holds only those, and the CPU must compute what they leave out; `None` when the
    /// device holds the whole blob.
    pub fn filled_with(&self, blob: usize) -> Option<u64> {
        let fill = self.shared.partial_fills.get(blob)?.lock();
        fill.as_ref().map(|f| f.tag)
    }

    /// Brings the fill of blob `blob` in `location` up to what the fill ranges ask for now
    /// ([`Residency::set_fill_ranges`]), when its last fill was partial and left out some of
    /// it. Left as it is when another guard holds the slot (its bytes cannot change under it).
    fn complete_fill(&self, blob: usize, location: Location) -> Result<(), ResidencyError> {
        let shared = &self.shared;
        let Location::Slot(_) = location else {
            return Ok(());
        };
        if shared.partial_fills[blob].lock().is_none() {
            return Ok(());
        }
        // Asked before taking the fill's lock: the caller's function may look at fills.
        let want = shared.fill_ranges.read().clone().and_then(|f| f(blob));
        let mut fill = shared.partial_fills[blob].lock();
        let Some(have) = fill.as_ref() else {
            return Ok(());
        };
        let len = self.plan.blobs[blob].length;
        if want.as_ref().is_some_and(|(tag, _)| *tag == have.tag) {
            return Ok(());
        }
        let (tag, want) = match want {
            Some((tag, ranges)) => (Some(tag), ranges),
            None => (None, vec![(0, len)]),
        };
        let missing = missing_ranges(&want, &have.ranges);
        if missing.is_empty() {
            return Ok(());
        }
        let host = shared.host_tier[blob].read();
        let Some(block) = host.as_ref() else {
            return Ok(());
        };
        let Some(mut buffer) = shared.buffer(location).try_write() else {
            return Ok(());
        };
        shared.copy_ranges(blob, &mut buffer, &block.bytes()[..len as usize], &missing)?;
        let copied: u64 = missing.iter().map(|r| r.1).sum();
        shared.engine.lock().add_completed_fill(blob, copied);
        *fill = tag.map(|tag| PartialFill {
            tag,
            ranges: union_ranges(&have.ranges, &missing),
        });
        Ok(())
    }

    /// Returns when blob `blob` is fully in memory; waits only if its read is not finished.
    pub fn acquire(&self, blob: usize) -> Result<BlobGuard<'_>, ResidencyError> {
        let _span = tracing::trace_span!("acquire", blob).entered();
        let shared = &self.shared;
        let mut engine = shared.engine.lock();
        let (location, ready) = loop {
            match engine.request(blob, shared.clock.now())? {
                Lookup::Got { location, ready } => break (location, ready),
                Lookup::Retry => {
                    shared.send(engine.take_jobs());
                    shared.wait(&mut engine)?;
                }
            }
        };
        shared.send(engine.take_jobs());
        if !ready {
            let waited_from = shared.clock.now();
            loop {
                match engine.state(location) {
                    LocationState::Ready => break,
                    LocationState::Loading => {
                        if let Err(err) = shared.wait(&mut engine) {
                            engine.release(location, shared.clock.now());
                            return Err(err);
                        }
                    }
                    LocationState::Failed(message) => {
                        engine.release(location, shared.clock.now());
                        shared.send(engine.take_jobs());
                        return Err(ResidencyError::ReadFailed {
                            file: shared.names[blob].clone(),
                            message,
                        });
                    }
                }
            }
            engine.add_compute_wait(shared.clock.now().saturating_sub(waited_from));
        }
        drop(engine);
        if let Err(err) = self.complete_fill(blob, location) {
            self.release(location);
            return Err(err);
        }
        let buffer = shared.buffer(location).read();
        Ok(BlobGuard {
            owner: self,
            location,
            len: self.plan.blobs[blob].length as usize,
            buffer: Some(buffer),
            fence: None,
            host_copy: None,
        })
    }

    /// On-demand read of part of a blob (embedding rows of an untied model) without staging it.
    pub fn read_range(
        &self,
        blob: usize,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, ResidencyError> {
        self.check_range(blob, offset, len)?;
        let fetched = self.shared.source.ensure_local(blob)?;
        if fetched > 0 {
            self.shared.engine.lock().add_network(fetched);
        }
        if let Some(expected) = self.shared.unchecked(blob) {
            // Read in pieces, never whole, so its first piece is the moment to prove the file:
            // once, on this thread, before any of its bytes are used.
            let shared = &self.shared;
            let actual = shared.timed_hash(blob, || shared.source.hash_blob(blob))?;
            shared.check(blob, expected, actual)?;
        }
        let mut out = vec![0u8; len as usize];
        self.shared.source.read_range(blob, offset, &mut out)?;
        self.shared.engine.lock().add_on_demand(len);
        Ok(out)
    }

    /// Marks the end of one forward pass (a token or a prefill batch).
    pub fn end_pass(&self) {
        let pass = self.shared.engine.lock().end_pass(self.shared.clock.now());
        tracing::debug!(
            disk_bytes = pass.disk_bytes,
            host_copy_bytes = pass.host_copy_bytes,
            device_hits = pass.device_hits,
            device_misses = pass.device_misses,
            compute_wait_s = pass.compute_wait_s,
            slot_wait_s = pass.slot_wait_s,
            overlap = pass.overlap_fraction(),
            effective_gbps = pass.effective_gbps(),
            "residency pass"
        );
    }

    pub fn stats(&self) -> ResidencyStats {
        let mut stats = self.shared.engine.lock().stats(self.shared.clock.now());
        stats.peak_device_bytes = self.shared.memory.peak();
        stats.device_budget = self.plan.device_budget;
        stats.host_tier_bytes = self.shared.host_tier_bytes.load(Ordering::Relaxed);
        stats.checksum_bytes = self.shared.checksum_bytes.load(Ordering::Relaxed);
        stats.checksum_seconds = self.shared.checksum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        stats
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// An error unless blob `blob` exists and holds bytes `offset .. offset + len`.
    fn check_range(&self, blob: usize, offset: u64, len: u64) -> Result<(), ResidencyError> {
        let info = self
            .plan
            .blobs
            .get(blob)
            .ok_or(ResidencyError::UnknownBlob {
                blob,
                count: self.plan.blobs.len(),
            })?;
        if offset.checked_add(len).is_none_or(|end| end > info.length) {
            return Err(ResidencyError::RangeOutOfBounds {
                file: info.file.clone(),
                offset,
                end: offset.saturating_add(len),
                length: info.length,
            });
        }
        Ok(())
    }

    fn release(&self, location: Location) {
        let mut engine = self.shared.engine.lock();
        engine.release(location, self.shared.clock.now());
        self.shared.send(engine.take_jobs());
    }
}

impl Drop for Residency {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        let _ = self.shared.jobs.lock().send(None);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

impl Shared {
    fn send(&self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let sender = self.jobs.lock();
        for job in jobs {
            // A closed channel means the reader stopped; waiters notice through the flag.
            let _ = sender.send(Some(job));
        }
    }

    fn wait(&self, engine: &mut parking_lot::MutexGuard<'_, Engine>) -> Result<(), ResidencyError> {
        if self.reader_stopped.load(Ordering::Acquire) {
            return Err(ResidencyError::ReaderStopped);
        }
        // The timeout only guards against a reader that died without notifying.
        self.changed.wait_for(engine, Duration::from_millis(500));
        Ok(())
    }

    fn buffer(&self, location: Location) -> &Buffer {
        match location {
            Location::Slot(i) => &self.slots[i],
            Location::Resident(b) => self.resident[b]
                .as_ref()
                .expect("resident buffer allocated at open"),
        }
    }

    /// Performs one read; returns whether the blob went into the host tier, the bytes
    /// fetched from the network for it, and the bytes copied when only its split ranges were.
    fn perform(&self, job: &Job) -> Result<(bool, u64, Option<u64>), ResidencyError> {
        let _span = tracing::debug_span!("residency_read", blob = job.blob, bytes = job.bytes, from = ?job.from).entered();
        if let Location::Slot(i) = job.into {
            let fence = self.slot_fences[i].lock().take();
            if let Some(fence) = fence {
                fence.wait().map_err(|message| ResidencyError::ReadFailed {
                    file: self.names[job.blob].clone(),
                    message: format!(
                        "waiting for the device to finish the slot's last blob: {message}"
                    ),
                })?;
            }
        }
        let (blob, len) = (job.blob, job.bytes);
        // The network tier (if any) brings the blob to local disk before anything reads it;
        // a blob in the host tier was fetched and checked before it got there.
        let host_copy = job.from == ReadFrom::HostTier && self.host_tier[blob].read().is_some();
        let fetched = if host_copy {
            0
        } else {
            self.source.ensure_local(blob)?
        };
        let mut buffer = self.buffer(job.into).write();
        // A blob read from disk is hashed where its bytes lie before compute may use them, the
        // first time only (`BlobChecksums`). The host tier holds only checked bytes.
        let from_disk = |buffer: &mut Box<dyn DeviceBuffer>| -> Result<(), ResidencyError> {
            match self.unchecked(blob) {
                Some(expected) => {
                    let (actual, hashing) =
                        buffer.fill_and_hash(self.source.as_ref(), blob, len)?;
                    self.count_hash(blob, hashing);
                    self.check(blob, expected, actual)
                }
                None => {
                    buffer
                        .fill_from_source(self.source.as_ref(), blob, len)?
                        .wait();
                    Ok(())
                }
            }
        };
        *self.partial_fills[blob].lock() = None;
        match job.from {
            ReadFrom::HostTier => {
                let host = self.host_tier[blob].read();
                let partial = match (job.into, host.is_some()) {
                    (Location::Slot(_), true) => {
                        let ranges = self.fill_ranges.read().clone();
                        ranges.and_then(|f| f(blob))
                    }
                    _ => None,
                };
                let mut copied = None;
                match host.as_ref() {
                    Some(block) if partial.is_some() => {
                        let (tag, ranges) = partial.expect("matched");
                        self.copy_ranges(
                            blob,
                            &mut buffer,
                            &block.bytes()[..len as usize],
                            &ranges,
                        )?;
                        copied = Some(ranges.iter().map(|r| r.1).sum());
                        *self.partial_fills[blob].lock() = Some(PartialFill {
                            tag,
                            ranges: union_ranges(&ranges, &[]),
                        });
                    }
                    Some(block) => buffer
                        .fill_from_host(&block.bytes()[..len as usize])?
                        .wait(),
                    None => from_disk(&mut buffer)?,
                }
                Ok((false, fetched, copied))
            }
            ReadFrom::Disk if job.keep_in_host => match self.memory.alloc_host(len) {
                Ok(mut host) => {
                    self.source.read_blob(blob, host.bytes_mut())?;
                    if let Some(expected) = self.unchecked(blob) {
                        let bytes = &host.bytes()[..len as usize];
                        let actual =
                            self.timed_hash(blob, || Ok(xxhash_rust::xxh3::xxh3_64(bytes)))?;
                        self.check(blob, expected, actual)?;
                    }
                    buffer.fill_from_host(&host.bytes()[..len as usize])?.wait();
                    self.host_tier_bytes
                        .fetch_add(host.bytes().len() as u64, Ordering::Relaxed);
                    *self.host_tier[blob].write() = Some(host);
                    Ok((true, fetched, None))
                }
                Err(err) => {
                    tracing::warn!(file = %self.names[blob], "host tier: {err}; this blob keeps streaming from disk");
                    from_disk(&mut buffer)?;
                    Ok((false, fetched, None))
                }
            },
            ReadFrom::Disk => {
                from_disk(&mut buffer)?;
                Ok((false, fetched, None))
            }
        }
    }

    /// Copies byte ranges `(offset, len)` of blob `blob`'s host-tier copy `host` into the
    /// same offsets of `buffer`; a range outside the blob is an error naming it.
    fn copy_ranges(
        &self,
        blob: usize,
        buffer: &mut Box<dyn DeviceBuffer>,
        host: &[u8],
        ranges: &[(u64, u64)],
    ) -> Result<(), ResidencyError> {
        for &(offset, n) in ranges {
            let piece = offset
                .checked_add(n)
                .and_then(|end| host.get(offset as usize..end as usize))
                .ok_or_else(|| ResidencyError::RangeOutOfBounds {
                    file: self.names[blob].clone(),
                    offset,
                    end: offset.saturating_add(n),
                    length: host.len() as u64,
                })?;
            buffer.fill_range_from_host(offset as usize, piece)?.wait();
        }
        Ok(())
    }

    /// The checksum blob `blob` must still be checked against: `None` when checking is off,
    /// the source knows no checksum, or the blob has already been checked.
    fn unchecked(&self, blob: usize) -> Option<u64> {
        if self.checksums == BlobChecksums::Off || self.verified[blob].load(Ordering::Acquire) {
            return None;
        }
        self.source.checksum(blob)
    }

    /// Runs `hash` (of blob `blob`) and counts its bytes and time.
    fn timed_hash(
        &self,
        blob: usize,
        hash: impl FnOnce() -> Result<u64, ResidencyError>,
    ) -> Result<u64, ResidencyError> {
        let started = std::time::Instant::now();
        let digest = hash()?;
        self.count_hash(blob, started.elapsed());
        Ok(digest)
    }

    /// Counts blob `blob`'s bytes as hashed, in `elapsed`.
    fn count_hash(&self, blob: usize, elapsed: std::time::Duration) {
        self.checksum_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        self.checksum_bytes
            .fetch_add(self.source.blob_len(blob), Ordering::Relaxed);
    }

    /// Records a successful check, or fails with an error naming the blob.
    fn check(&self, blob: usize, expected: u64, actual: u64) -> Result<(), ResidencyError> {
        if actual != expected {
            tracing::error!(file = %self.names[blob], "checksum mismatch: the model file is corrupt");
            return Err(ResidencyError::Checksum {
                file: self.names[blob].clone(),
                expected,
                actual,
            });
        }
        self.verified[blob].store(true, Ordering::Release);
        Ok(())
    }
}

fn reader_loop(shared: &Shared, jobs: mpsc::Receiver<Option<Job>>) {
    while let Ok(Some(job)) = jobs.recv() {
        if shared.stopping.load(Ordering::Acquire) {
            break;
        }
        let outcome = match shared.perform(&job) {
            Ok((stored_in_host, network_bytes, copied_bytes)) => Outcome::Done {
                stored_in_host,
                network_bytes,
                copied_bytes,
            },
            Err(err) => {
                tracing::warn!(file = %shared.names[job.blob], "read failed: {err}");
                Outcome::Failed(err.to_string())
            }
        };
        let mut engine = shared.engine.lock();
        engine.complete(&job, outcome, shared.clock.now());
        shared.send(engine.take_jobs());
        drop(engine);
        shared.changed.notify_all();
    }
    shared.reader_stopped.store(true, Ordering::Release);
    shared.changed.notify_all();
}

/// `ranges` sorted by offset, empty ones dropped, overlapping or adjacent ones merged.
fn normalized(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut sorted: Vec<(u64, u64)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    sorted.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (offset, len) in sorted {
        match out.last_mut() {
            Some(last) if offset <= last.0 + last.1 => {
                last.1 = last.1.max(offset + len - last.0);
            }
            _ => out.push((offset, len)),
        }
    }
    out
}

/// The byte ranges of `a` and `b` together, sorted and merged.
fn union_ranges(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    normalized(&[a, b].concat())
}

/// The bytes of `want` that `have` lacks, as sorted disjoint `(offset, len)` ranges.
fn missing_ranges(want: &[(u64, u64)], have: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let have = normalized(have);
    let mut out = Vec::new();
    for (offset, len) in normalized(want) {
        let end = offset + len;
        let mut at = offset;
        for &(h0, hn) in &have {
            let h1 = h0 + hn;
            if h1 <= at || h0 >= end {
                continue;
            }
            if h0 > at {
                out.push((at, h0 - at));
            }
            at = at.max(h1);
            if at >= end {
                break;
            }
        }
        if at < end {
            out.push((at, end - at));
        }
    }
    out
}

/// Allocates the ring, then the resident buffers in plan order. On failure returns how many
/// bytes had been allocated (everything is freed again).
#[allow(clippy::type_complexity)]
fn allocate(
    plan: &Plan,
    memory: &dyn DeviceMemory,
) -> Result<(Vec<Buffer>, Vec<Option<Buffer>>), u64> {
    let mut allocated = 0u64;
    let mut slots = Vec::with_capacity(plan.ring_slots);
    for i in 0..plan.ring_slots {
        let buf = memory
            .alloc(plan.slot_bytes, &format!("staging slot {i}"))
            .map_err(|_| allocated)?;
        allocated += buf.capacity();
        slots.push(RwLock::new(buf));
    }
    let mut resident: Vec<Option<Buffer>> = plan.blobs.iter().map(|_| None).collect();
    for &b in &plan.order {
        if plan.is_resident(b) {
            let buf = memory
                .alloc(plan.blobs[b].length, &plan.blobs[b].file)
                .map_err(|_| allocated)?;
            allocated += buf.capacity();
            resident[b] = Some(RwLock::new(buf));
        }
    }
    Ok((slots, resident))
}

/// Resolves `auto` budgets into plan inputs. `device_memory` is what the device memory can
/// hand out (the smaller of it and an explicit budget is used); `None` means host RAM is the
/// device memory (CPU), whose `auto` is a share of `MemAvailable`.
pub fn plan_inputs(
    opts: &ResidencyOptions,
    device_memory: Option<u64>,
) -> Result<PlanInputs, ResidencyError> {
    let device_budget = match (opts.device_budget, device_memory) {
        (Budget::Bytes(b), Some(limit)) => b.min(limit),
        (Budget::Bytes(b), None) => b,
        (Budget::Auto, Some(limit)) => limit,
        (Budget::Auto, None) => auto_ram_share("--vram-budget auto")?,
    };
    let host_budget = match opts.host_cache {
        HostCache::Off => 0,
        HostCache::Bytes(b) => b,
        // On CPU the device tier is RAM too, so it comes off the same share.
        HostCache::Auto => auto_ram_share("--host-cache auto")?.saturating_sub(device_budget),
    };
    Ok(PlanInputs {
        device_budget,
        reserved_bytes: opts.reserved_bytes,
        host_budget,
        ring_slots: opts.prefetch + 1,
        resident_layers: opts.resident_layers,
        policy: opts.policy,
    })
}

fn auto_ram_share(setting: &'static str) -> Result<u64, ResidencyError> {
    let available = mem_available().ok_or_else(|| ResidencyError::InvalidOption {
        setting,
        reason: "MemAvailable could not be read from /proc/meminfo; give a size instead".into(),
    })?;
    Ok((available as f64 * AUTO_RAM_SHARE) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_ranges_are_the_wanted_bytes_not_held() {
        // Held: [10, 20) and [30, 40).
        let have = [(30, 10), (10, 10)];
        assert_eq!(
            missing_ranges(&[(0, 50)], &have),
            [(0, 10), (20, 10), (40, 10)]
        );
        assert_eq!(missing_ranges(&[(12, 5), (32, 4)], &have), []);
        assert_eq!(missing_ranges(&[(15, 20)], &have), [(20, 10)]);
        assert_eq!(
            missing_ranges(&[(5, 10), (35, 10)], &have),
            [(5, 5), (40, 5)]
        );
        assert_eq!(missing_ranges(&[(0, 8)], &[]), [(0, 8)]);
        assert_eq!(missing_ranges(&[(4, 0)], &[]), []);
        // Overlapping wants are merged first: nothing is copied twice.
        assert_eq!(missing_ranges(&[(0, 6), (4, 6)], &[]), [(0, 10)]);
    }

    #[test]
    fn union_ranges_sort_and_merge() {
        assert_eq!(
            union_ranges(&[(30, 10), (10, 10)], &[(20, 10), (50, 0), (60, 1)]),
            [(10, 30), (60, 1)]
        );
        assert_eq!(union_ranges(&[(0, 10)], &[(2, 3)]), [(0, 10)]);
    }
}
