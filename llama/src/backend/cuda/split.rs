//! [`SplitTarget`] for the CUDA backend: a share of a split matmul's output columns placed
//! into the full activations (`crate::hybrid`), every row in one launch of
//! `write_columns_f32` (`kernels/elementwise.cu`).
//!
//! The helper's (the CPU's) share arrives as host values ([`ColumnSource::Host`]): they are
//! copied into a small ring of page-locked host buffers mapped into the device's address
//! space ([`HostStaging`]), and the same kernel reads them from there over PCIe. No
//! device allocation, no pageable copy, and no copy-engine transfer: an async host→device copy
//! would queue behind the residency ring's streamed weight copies (hundreds of MB per layer),
//! while the kernel's reads of a few hundred KB share the link with them.

use std::sync::Mutex;

use cudarc::driver::{CudaEvent, PinnedHostSlice};

use crate::backend::{BackendError, NormInto};
use crate::hybrid::{ColumnPlacement, ColumnSource, SplitTarget};

use super::device::{Queue, elementwise};
use super::{CudaBackend, CudaBuf};

/// Staging buffers in the ring: a split call merges at most three helper outputs (Q/K/V), so
/// with four a buffer is never waited for within a call, and the next call's synchronising
/// read of its input has let every earlier merge finish.
const STAGING_SLOTS: usize = 4;

/// The smallest staging buffer, in values (256 KiB): decode rows of a 7B's CPU share fit
/// without growing.
const STAGING_MIN: usize = 1 << 16;

/// One mapped host buffer of the ring: its device address, and the event recorded after the
/// kernel that reads it (the buffer is not written again before that kernel has run).
struct StagingSlot {
    host: PinnedHostSlice<f32>,
    dev: u64,
    read: CudaEvent,
}

/// A ring of page-locked host buffers mapped into the device ([`Queue::alloc_mapped`]),
/// each grown to the largest share asked for, for the helper's outputs on their way into the
/// primary's activations.
pub(super) struct HostStaging {
    ring: Mutex<(Vec<StagingSlot>, usize)>,
}

impl HostStaging {
    pub fn new() -> HostStaging {
        HostStaging {
            ring: Mutex::new((Vec::new(), 0)),
        }
    }

    /// Copies `values` into the next buffer of the ring (once the kernel that last read it has
    /// run), then queues `read(device address)` and records the buffer's event after it.
    fn stage(
        &self,
        queue: &Queue,
        values: &[f32],
        read: impl FnOnce(u64) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        const OP: &str = "staging a split matmul's columns";
        let mut guard = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let (slots, next) = &mut *guard;
        // A new buffer goes at the end (a failed call before may have left the ring short).
        let i = (*next % STAGING_SLOTS).min(slots.len());
        *next = (i + 1) % STAGING_SLOTS;
        if let Some(slot) = slots.get(i) {
            queue.wait_for(&slot.read, OP)?;
        }
        if slots.get(i).is_none_or(|s| s.host.len() < values.len()) {
            let len = values.len().next_power_of_two().max(STAGING_MIN);
            let (host, dev) = queue.alloc_mapped(len, OP)?;
            let slot = StagingSlot {
                host,
                dev,
                read: queue.new_event(OP)?,
            };
            // The slot replaced (if any) was waited for above: nothing reads it any more.
            if i < slots.len() {
                slots[i] = slot;
            } else {
                slots.push(slot);
            }
        }
        let slot = &mut slots[i];
        let staged = slot.host.as_mut_slice().map_err(|e| queue.error(OP, e))?;
        staged[..values.len()].copy_from_slice(values);
        // The kernel queued next reads these values: make the stores visible before the launch.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        read(slot.dev)?;
        queue.record(&slot.read, OP)
    }
}

impl CudaBackend {
    /// Checks a share's shape against `dst` ([`ColumnPlacement::check`]) and that no decode
    /// pass is being recorded; `false`: nothing to write (no rows or no columns).
    fn columns_to_write(
        &self,
        op: &'static str,
        src_len: usize,
        dst: &CudaBuf,
        at: ColumnPlacement,
    ) -> Result<bool, BackendError> {
        at.check(op, src_len, dst.0.len())?;
        if at.rows == 0 || at.src_cols == 0 {
            return Ok(false);
        }
        self.graphs
            .forbid_while_recording("a split matmul's columns")?;
        Ok(true)
    }

    /// One launch of `write_columns_f32`: `rows · src_cols` values at device address `src`
    /// into columns `col0..` of `dst` (checked by the caller).
    fn write_columns_launch(
        &self,
        src: u64,
        dst: &CudaBuf,
        at: ColumnPlacement,
    ) -> Result<(), BackendError> {
        let n = at.src_len();
        let to = self.addr(dst, 0);
        let (sc, dc, c0, n64, add) = (
            at.src_cols as u64,
            at.dst_cols as u64,
            at.col0 as u64,
            n as u64,
            i32::from(at.into == NormInto::Add),
        );
        let mut b = self
            .queue
            .kernel(&self.kernels.write_columns, "write_columns kernel");
        b.arg(&src)
            .arg(&sc)
            .arg(&to)
            .arg(&dc)
            .arg(&c0)
            .arg(&n64)
            .arg(&add);
        // SAFETY: `src` addresses rows·src_cols f32 values (a live device buffer or mapped
        // host buffer, checked or sized by the caller), `dst` holds rows·dst_cols values and
        // col0 + src_cols <= dst_cols (checked by the caller): thread i < n reads src[i] and
        // touches dst[(i / src_cols)·dst_cols + col0 + i % src_cols], inside both.
        unsafe { b.run(elementwise(n)) }
    }
}

impl SplitTarget for CudaBackend {
    fn write_columns(
        &self,
        src: ColumnSource<'_, CudaBuf>,
        dst: &mut CudaBuf,
        at: ColumnPlacement,
    ) -> Result<(), BackendError> {
        let (op, src_len) = match src {
            ColumnSource::Buffer(buf) => ("cuda write_columns", buf.0.len()),
            ColumnSource::Host(host) => ("cuda write_host_columns", host.len()),
        };
        if !self.columns_to_write(op, src_len, dst, at)? {
            return Ok(());
        }
        match src {
            ColumnSource::Buffer(buf) => self.write_columns_launch(self.addr(buf, 0), dst, at),
            ColumnSource::Host(host) => {
                let values = &host[..at.src_len()];
                self.split_staging.stage(&self.queue, values, |from| {
                    self.write_columns_launch(from, dst, at)
                })
            }
        }
    }
}
