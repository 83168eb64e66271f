//! The decision core: which read to issue next, into which slot, and what each acquire costs.
//!
//! It holds no buffers, threads or clocks. The runtime ([`crate::Residency`]) and the
//! discrete-event simulator ([`crate::sim`]) both drive this same state machine, passing the
//! time of each event, so the simulated checks exercise the production decisions.

use std::collections::VecDeque;
use std::time::Duration;

use crate::error::ResidencyError;
use crate::options::Policy;
use crate::plan::{Placement, Plan};
use crate::stats::{MAX_KEPT_PASSES, PassStats, ResidencyStats};

/// Where an acquired blob's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// Ring slot `i`.
    Slot(usize),
    /// The blob's own resident buffer.
    Resident(usize),
}

/// Where a read takes its bytes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    Disk,
    HostTier,
}

/// One read for the I/O side to perform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub id: u64,
    pub blob: usize,
    pub into: Location,
    pub from: ReadFrom,
    pub bytes: u64,
    /// Keep a host-tier copy of what is read from disk.
    pub keep_in_host: bool,
}

/// State of a location as a waiter sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocationState {
    Loading,
    Ready,
    Failed(String),
}

/// Result of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The blob is (or will be) at `location`, pinned until `release`.
    Got { location: Location, ready: bool },
    /// No slot can take the blob until a read in flight finishes; ask again after the next
    /// completion.
    Retry,
}

/// How a finished read went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Done {
        stored_in_host: bool,
        /// Bytes fetched from the network tier to local disk before the read.
        network_bytes: u64,
        /// Bytes copied from the host tier when only some ranges of the blob were
        /// ([`crate::Residency::set_fill_ranges`]); `None`: the whole blob.
        copied_bytes: Option<u64>,
    },
    Failed(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ResidentState {
    NotResident,
    Unloaded,
    Loading,
    Ready,
    Failed(String),
}

#[derive(Debug, Clone, Default)]
struct Slot {
    blob: Option<usize>,
    /// Position in the cyclic order (absolute, across passes) this content was fetched for;
    /// content at or after the consumer's position is still needed.
    seq: u64,
    loading: bool,
    pins: u32,
    last_used: u64,
    error: Option<String>,
}

/// The state machine.
#[derive(Debug)]
pub struct Engine {
    policy: Policy,
    order: Vec<usize>,
    position_in_order: Vec<Option<usize>>,
    lengths: Vec<u64>,
    slot_bytes: u64,
    resident: Vec<ResidentState>,
    slots: Vec<Slot>,
    host_planned: Vec<bool>,
    host_ready: Vec<bool>,
    consumer_seq: u64,
    next_job_id: u64,
    in_flight: usize,
    blocked_on_slot: bool,
    tick: u64,
    last_event: Duration,
    pass_start: Duration,
    issued: VecDeque<Job>,
    current: PassStats,
    finished: PassStats,
    passes: VecDeque<PassStats>,
    passes_completed: u64,
    blob_disk_reads: Vec<u64>,
    blob_host_copies: Vec<u64>,
}

impl Engine {
    pub fn new(plan: &Plan) -> Engine {
        let n_blobs = plan.blobs.len();
        let mut position_in_order = vec![None; n_blobs];
        for (pos, &b) in plan.order.iter().enumerate() {
            position_in_order[b] = Some(pos);
        }
        let resident = plan
            .blobs
            .iter()
            .map(|b| {
                if b.placement == Placement::Resident {
                    ResidentState::Unloaded
                } else {
                    ResidentState::NotResident
                }
            })
            .collect();
        Engine {
            policy: plan.policy,
            order: plan.order.clone(),
            position_in_order,
            lengths: plan.blobs.iter().map(|b| b.length).collect(),
            slot_bytes: plan.slot_bytes,
            resident,
            slots: vec![Slot::default(); plan.ring_slots],
            host_planned: plan
                .blobs
                .iter()
                .map(|b| b.placement == Placement::HostCached)
                .collect(),
            host_ready: vec![false; n_blobs],
            consumer_seq: 0,
            next_job_id: 0,
            in_flight: 0,
            blocked_on_slot: false,
            tick: 0,
            last_event: Duration::ZERO,
            pass_start: Duration::ZERO,
            issued: VecDeque::new(),
            current: PassStats::default(),
            finished: PassStats::default(),
            passes: VecDeque::new(),
            passes_completed: 0,
            blob_disk_reads: vec![0; n_blobs],
            blob_host_copies: vec![0; n_blobs],
        }
    }

    /// Reads issued since the last call, in the order the I/O side must perform them.
    pub fn take_jobs(&mut self) -> Vec<Job> {
        self.issued.drain(..).collect()
    }

    /// Starts the reads the plan wants before anyone asks (the head of the first pass).
    pub fn start(&mut self, now: Duration) {
        self.account(now);
        self.pass_start = now;
        self.schedule();
    }

    /// Asks for `blob`. On `Got` the location is pinned until [`Engine::release`].
    pub fn request(&mut self, blob: usize, now: Duration) -> Result<Lookup, ResidencyError> {
        if blob >= self.lengths.len() {
            return Err(ResidencyError::UnknownBlob {
                blob,
                count: self.lengths.len(),
            });
        }
        self.account(now);
        self.tick += 1;
        let (location, ready, hit) = match self.resident[blob].clone() {
            ResidentState::Ready => (Location::Resident(blob), true, true),
            ResidentState::Loading => (Location::Resident(blob), false, true),
            ResidentState::Unloaded | ResidentState::Failed(_) => {
                self.resident[blob] = ResidentState::Loading;
                self.issue(blob, Location::Resident(blob));
                (Location::Resident(blob), false, false)
            }
            ResidentState::NotResident => match self.request_streamed(blob)? {
                Some(got) => got,
                None => return Ok(Lookup::Retry),
            },
        };
        if let Location::Slot(i) = location {
            let slot = &mut self.slots[i];
            slot.pins += 1;
            slot.last_used = self.tick;
        }
        self.current.acquires += 1;
        if hit {
            self.current.device_hits += 1;
        } else {
            self.current.device_misses += 1;
        }
        if let Some(pos) = self.position_in_order[blob] {
            self.consumer_seq = self.nearest_seq(pos) + 1;
        }
        self.schedule();
        Ok(Lookup::Got { location, ready })
    }

    fn request_streamed(
        &mut self,
        blob: usize,
    ) -> Result<Option<(Location, bool, bool)>, ResidencyError> {
        if let Some(i) = self.slots.iter().position(|s| s.blob == Some(blob)) {
            let slot = &self.slots[i];
            if slot.error.is_none() || slot.pins > 0 || slot.loading {
                return Ok(Some((Location::Slot(i), !slot.loading, true)));
            }
            // A failed read nobody waits for: try again in the same slot.
            self.fill_slot(i, blob, self.seq_for(blob));
            return Ok(Some((Location::Slot(i), false, false)));
        }
        if self.lengths[blob] > self.slot_bytes {
            return Err(ResidencyError::BlobLargerThanSlot {
                file: format!("blob {blob}"),
                length: self.lengths[blob],
                slot_bytes: self.slot_bytes,
            });
        }
        match self.victim(true) {
            Some(i) => {
                self.fill_slot(i, blob, self.seq_for(blob));
                Ok(Some((Location::Slot(i), false, false)))
            }
            None if self.slots.iter().all(|s| s.pins > 0) => Err(ResidencyError::AllSlotsPinned {
                slots: self.slots.len(),
            }),
            None => Ok(None),
        }
    }

    /// Releases a location obtained from `request`.
    pub fn release(&mut self, location: Location, now: Duration) {
        self.account(now);
        if let Location::Slot(i) = location {
            let slot = &mut self.slots[i];
            slot.pins = slot.pins.saturating_sub(1);
            if slot.pins == 0 && slot.error.is_some() {
                slot.blob = None;
                slot.error = None;
            }
        }
        self.schedule();
    }

    /// The I/O side finished `job`.
    /// Counts a blob fetched from the network tier.
    pub fn add_network(&mut self, bytes: u64) {
        self.current.network_bytes += bytes;
        self.current.network_fetches += 1;
    }

    pub fn complete(&mut self, job: &Job, outcome: Outcome, now: Duration) {
        self.account(now);
        self.in_flight -= 1;
        match outcome {
            Outcome::Done {
                stored_in_host,
                network_bytes,
                copied_bytes,
            } => {
                if network_bytes > 0 {
                    self.add_network(network_bytes);
                }
                match job.from {
                    ReadFrom::Disk => {
                        self.current.disk_bytes += job.bytes;
                        self.current.disk_reads += 1;
                        self.blob_disk_reads[job.blob] += 1;
                        if matches!(job.into, Location::Slot(_)) {
                            self.current.host_misses += 1;
                        }
                    }
                    ReadFrom::HostTier => {
                        self.current.host_copy_bytes += copied_bytes.unwrap_or(job.bytes);
                        self.current.host_copies += 1;
                        self.current.host_hits += 1;
                        self.blob_host_copies[job.blob] += 1;
                    }
                }
                if job.keep_in_host {
                    if stored_in_host {
                        self.host_ready[job.blob] = true;
                    } else {
                        // No host memory for it: stop trying every pass.
                        self.host_planned[job.blob] = false;
                    }
                }
                match job.into {
                    Location::Resident(b) => self.resident[b] = ResidentState::Ready,
                    Location::Slot(i) => self.slots[i].loading = false,
                }
                self.schedule();
            }
            Outcome::Failed(message) => match job.into {
                // No reschedule: a broken file must not be re-read in a loop; the next
                // request retries.
                Location::Resident(b) => self.resident[b] = ResidentState::Failed(message),
                Location::Slot(i) => {
                    let slot = &mut self.slots[i];
                    slot.loading = false;
                    if slot.pins == 0 {
                        slot.blob = None;
                    } else {
                        slot.error = Some(message);
                    }
                }
            },
        }
    }

    /// What a waiter on `location` should do.
    pub fn state(&self, location: Location) -> LocationState {
        match location {
            Location::Resident(b) => match &self.resident[b] {
                ResidentState::Ready => LocationState::Ready,
                ResidentState::Failed(m) => LocationState::Failed(m.clone()),
                _ => LocationState::Loading,
            },
            Location::Slot(i) => {
                let slot = &self.slots[i];
                if let Some(m) = &slot.error {
                    LocationState::Failed(m.clone())
                } else if slot.loading {
                    LocationState::Loading
                } else {
                    LocationState::Ready
                }
            }
        }
    }

    /// Records time the compute side spent waiting for a read.
    pub fn add_compute_wait(&mut self, waited: Duration) {
        self.current.compute_wait_s += waited.as_secs_f64();
    }

    /// Records `bytes` copied from the host tier to complete a partial fill of `blob` when it
    /// was acquired ([`crate::Residency::set_fill_ranges`]).
    pub fn add_completed_fill(&mut self, blob: usize, bytes: u64) {
        self.current.host_copy_bytes += bytes;
        self.current.fill_completions += 1;
        tracing::trace!(blob, bytes, "completed a partial fill");
    }

    /// Records an on-demand range read.
    pub fn add_on_demand(&mut self, bytes: u64) {
        self.current.on_demand_bytes += bytes;
    }

    /// Ends the current pass and returns its statistics.
    pub fn end_pass(&mut self, now: Duration) -> PassStats {
        self.account(now);
        let mut pass = std::mem::take(&mut self.current);
        pass.elapsed_s = (now - self.pass_start).as_secs_f64();
        self.pass_start = now;
        self.finished.add(&pass);
        if self.passes.len() == MAX_KEPT_PASSES {
            self.passes.pop_front();
        }
        self.passes.push_back(pass.clone());
        self.passes_completed += 1;
        pass
    }

    pub fn stats(&self, now: Duration) -> ResidencyStats {
        let mut current = self.current.clone();
        current.elapsed_s = now.saturating_sub(self.pass_start).as_secs_f64();
        let mut total = self.finished.clone();
        total.add(&current);
        ResidencyStats {
            overlap_fraction: total.overlap_fraction(),
            effective_gbps: total.effective_gbps(),
            total,
            passes: self.passes.iter().cloned().collect(),
            passes_completed: self.passes_completed,
            current,
            blob_disk_reads: self.blob_disk_reads.clone(),
            blob_host_copies: self.blob_host_copies.clone(),
            ..ResidencyStats::default()
        }
    }

    /// Whether any read is issued and not yet completed.
    pub fn io_in_flight(&self) -> bool {
        self.in_flight > 0
    }

    /// Accumulates interval statistics up to `now`.
    fn account(&mut self, now: Duration) {
        let dt = now.saturating_sub(self.last_event).as_secs_f64();
        self.last_event = self.last_event.max(now);
        if self.in_flight > 0 {
            self.current.io_busy_s += dt;
        } else if self.blocked_on_slot {
            self.current.slot_wait_s += dt;
        }
    }

    /// The absolute position of order position `pos` nearest to the consumer (ties go
    /// forward), so an out-of-order request re-anchors prefetching where the caller is.
    fn nearest_seq(&self, pos: usize) -> u64 {
        let n = self.order.len() as u64;
        let c = self.consumer_seq;
        let base = c - c % n;
        let mut forward = base + pos as u64;
        if forward < c {
            forward += n;
        }
        match forward.checked_sub(n) {
            Some(backward) if c - backward < forward - c => backward,
            _ => forward,
        }
    }

    fn seq_for(&self, blob: usize) -> u64 {
        match self.position_in_order[blob] {
            Some(pos) => self.nearest_seq(pos),
            // Not in the order: stale as soon as it is released.
            None => self.consumer_seq.saturating_sub(1),
        }
    }

    /// A slot that may be overwritten: empty first, then the least recently used consumed
    /// one, and for an on-demand miss (`may_take_future`) the prefetched blob needed last.
    fn victim(&self, may_take_future: bool) -> Option<usize> {
        let c = self.consumer_seq;
        let lru = self.policy == Policy::Lru;
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.pins == 0 && !s.loading)
            .filter_map(|(i, s)| {
                let rank = if s.blob.is_none() || s.error.is_some() {
                    (0, 0)
                } else if lru || s.seq < c {
                    (1, s.last_used)
                } else if may_take_future {
                    (2, u64::MAX - s.seq)
                } else {
                    return None;
                };
                Some((rank, i))
            })
            .min()
            .map(|(_, i)| i)
    }

    fn fill_slot(&mut self, i: usize, blob: usize, seq: u64) {
        let slot = &mut self.slots[i];
        slot.blob = Some(blob);
        slot.seq = seq;
        slot.loading = true;
        slot.error = None;
        slot.last_used = self.tick;
        self.issue(blob, Location::Slot(i));
    }

    fn issue(&mut self, blob: usize, into: Location) {
        let streamed = matches!(into, Location::Slot(_));
        let from = if streamed && self.host_ready[blob] {
            ReadFrom::HostTier
        } else {
            ReadFrom::Disk
        };
        let job = Job {
            id: self.next_job_id,
            blob,
            into,
            from,
            bytes: self.lengths[blob],
            keep_in_host: streamed && from == ReadFrom::Disk && self.host_planned[blob],
        };
        self.next_job_id += 1;
        self.in_flight += 1;
        tracing::trace!(blob, bytes = job.bytes, from = ?from, into = ?into, "issue read");
        self.issued.push_back(job);
    }

    /// Issues reads for the next blobs in plan order: resident blobs not yet loaded, and
    /// streamed blobs into free slots, at most one pass ahead and at most k slots ahead.
    fn schedule(&mut self) {
        self.blocked_on_slot = false;
        if self.policy == Policy::Lru || self.order.is_empty() {
            return;
        }
        let n = self.order.len() as u64;
        let c = self.consumer_seq;
        let mut ahead = 0;
        for s in c..c + n {
            let blob = self.order[(s % n) as usize];
            match self.resident[blob] {
                ResidentState::Unloaded => {
                    self.resident[blob] = ResidentState::Loading;
                    self.issue(blob, Location::Resident(blob));
                    continue;
                }
                ResidentState::NotResident => {}
                _ => continue,
            }
            if ahead >= self.slots.len() {
                break;
            }
            if let Some(i) = self.slots.iter().position(|sl| sl.blob == Some(blob)) {
                let slot = &mut self.slots[i];
                if slot.seq < s {
                    slot.seq = s;
                }
                ahead += 1;
                continue;
            }
            match self.victim(false) {
                Some(i) => {
                    self.fill_slot(i, blob, s);
                    ahead += 1;
                }
                None => {
                    self.blocked_on_slot = true;
                    break;
                }
            }
        }
    }
}
