//! Statistics per pass and per run.

use serde::Serialize;

/// Counters of one pass (a token or a prefill batch), or of a whole run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PassStats {
    /// Acquires served.
    pub acquires: u64,
    pub disk_bytes: u64,
    pub disk_reads: u64,
    pub host_copy_bytes: u64,
    pub host_copies: u64,
    /// Partial fills brought up to more of their blob when acquired
    /// ([`crate::Residency::set_fill_ranges`]); their bytes count in `host_copy_bytes`.
    pub fill_completions: u64,
    /// Bytes fetched from the network tier onto local disk (a model served over HTTP), each
    /// blob once; they are counted again in `disk_bytes` when read from there.
    pub network_bytes: u64,
    pub network_fetches: u64,
    /// Acquires whose blob was in device memory or already on its way (prefetched).
    pub device_hits: u64,
    /// Acquires that had to start a read on demand.
    pub device_misses: u64,
    /// Streamed reads served from the host tier.
    pub host_hits: u64,
    /// Streamed reads that went to disk.
    pub host_misses: u64,
    /// Bytes read on demand with `read_range` (embedding rows), outside the plan.
    pub on_demand_bytes: u64,
    /// Time the compute side waited in `acquire` for a read to finish.
    pub compute_wait_s: f64,
    /// Time the I/O side sat idle because the next read in plan order had no free slot.
    pub slot_wait_s: f64,
    /// Time at least one read was in flight.
    pub io_busy_s: f64,
    /// Wall time of the pass (or of the run).
    pub elapsed_s: f64,
}

impl PassStats {
    pub(crate) fn add(&mut self, other: &PassStats) {
        self.acquires += other.acquires;
        self.disk_bytes += other.disk_bytes;
        self.disk_reads += other.disk_reads;
        self.host_copy_bytes += other.host_copy_bytes;
        self.host_copies += other.host_copies;
        self.fill_completions += other.fill_completions;
        self.network_bytes += other.network_bytes;
        self.network_fetches += other.network_fetches;
        self.device_hits += other.device_hits;
        self.device_misses += other.device_misses;
        self.host_hits += other.host_hits;
        self.host_misses += other.host_misses;
        self.on_demand_bytes += other.on_demand_bytes;
        self.compute_wait_s += other.compute_wait_s;
        self.slot_wait_s += other.slot_wait_s;
        self.io_busy_s += other.io_busy_s;
        self.elapsed_s += other.elapsed_s;
    }

    /// Share of the I/O time hidden behind compute: 1 means compute never waited.
    pub fn overlap_fraction(&self) -> f64 {
        if self.io_busy_s > 0.0 {
            ((self.io_busy_s - self.compute_wait_s) / self.io_busy_s).clamp(0.0, 1.0)
        } else {
            1.0
        }
    }

    /// Bytes brought into device memory (disk + host tier) per second of wall time, in GB/s.
    pub fn effective_gbps(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            (self.disk_bytes + self.host_copy_bytes) as f64 / self.elapsed_s / 1e9
        } else {
            0.0
        }
    }

    /// Bytes read from disk, planned and on demand.
    pub fn disk_read_bytes(&self) -> u64 {
        self.disk_bytes + self.on_demand_bytes
    }

    /// [`disk_read_bytes`](Self::disk_read_bytes) per second that a read was in flight, in
    /// GB/s (0 when nothing was read).
    pub fn disk_read_gbps(&self) -> f64 {
        if self.io_busy_s > 0.0 {
            self.disk_read_bytes() as f64 / self.io_busy_s / 1e9
        } else {
            0.0
        }
    }

    /// Device hits over acquires.
    pub fn device_hit_rate(&self) -> f64 {
        let total = self.device_hits + self.device_misses;
        if total == 0 {
            0.0
        } else {
            self.device_hits as f64 / total as f64
        }
    }
}

/// What [`crate::Residency::stats`] returns.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ResidencyStats {
    /// Everything since open, the pass in progress included.
    pub total: PassStats,
    /// Completed passes, oldest first (the last [`MAX_KEPT_PASSES`]).
    pub passes: Vec<PassStats>,
    pub passes_completed: u64,
    /// The pass in progress.
    pub current: PassStats,
    /// Disk reads per blob since open (index into the model's blobs).
    pub blob_disk_reads: Vec<u64>,
    /// Host-tier copies per blob since open.
    pub blob_host_copies: Vec<u64>,
    /// Highest device bytes allocated at once.
    pub peak_device_bytes: u64,
    pub device_budget: u64,
    pub host_tier_bytes: u64,
    /// Bytes hashed to check blobs against their checksums, and the seconds that took (on the
    /// reader thread, or on the caller's for blobs read in pieces).
    pub checksum_bytes: u64,
    pub checksum_seconds: f64,
    /// Derived from `total`, for `--json` readers.
    pub overlap_fraction: f64,
    pub effective_gbps: f64,
}

/// How many per-pass records a long run keeps.
pub const MAX_KEPT_PASSES: usize = 4096;
