//! GPU time per kind of op, to see where a pass spends it (`GDSLLM_CUDA_PROFILE=1`): every
//! launch, GEMM and graph replay queued outside a recording is bracketed by two timing events,
//! resolved whenever the host waits for the stream anyway (reading results), and the totals are
//! logged when the backend is dropped, largest first. Off, it costs one branch per op. The
//! events themselves add a little time to each op: compare shares, not absolute times, with a
//! run without it.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

/// The environment variable that turns the profile on.
pub const PROFILE_ENV: &str = "GDSLLM_CUDA_PROFILE";

#[derive(Default)]
struct Inner {
    /// Ops queued but not yet timed: (op, start, end).
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    /// Per op: count and total milliseconds.
    totals: BTreeMap<&'static str, (u64, f64)>,
}

pub(super) struct Profile {
    inner: Mutex<Inner>,
}

impl Profile {
    /// A profile when `GDSLLM_CUDA_PROFILE=1`.
    pub fn from_env() -> Option<Profile> {
        (std::env::var(PROFILE_ENV).as_deref() == Ok("1")).then(|| Profile {
            inner: Mutex::new(Inner::default()),
        })
    }

    fn timing_event(stream: &CudaStream) -> Option<CudaEvent> {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| tracing::debug!("profile event: {e}"))
            .ok()
    }

    /// Times `queue_it` (which queues `op` on `stream`).
    pub fn time<R>(
        &self,
        stream: &CudaStream,
        op: &'static str,
        queue_it: impl FnOnce() -> R,
    ) -> R {
        let start = Profile::timing_event(stream);
        let r = queue_it();
        if let (Some(start), Some(end)) = (start, Profile::timing_event(stream)) {
            self.inner
                .lock()
                .expect("not poisoned")
                .pending
                .push((op, start, end));
        }
        r
    }

    /// Adds the times of the ops queued so far (waits for them).
    pub fn settle(&self) {
        let mut inner = self.inner.lock().expect("not poisoned");
        for (op, start, end) in std::mem::take(&mut inner.pending) {
            if let Ok(ms) = start.elapsed_ms(&end) {
                let t = inner.totals.entry(op).or_insert((0, 0.0));
                t.0 += 1;
                t.1 += ms as f64;
            }
        }
    }

    /// The totals as a table, largest first.
    pub fn report(&self) -> String {
        self.settle();
        let inner = self.inner.lock().expect("not poisoned");
        let all: f64 = inner.totals.values().map(|t| t.1).sum();
        let mut rows: Vec<_> = inner.totals.iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let mut out = format!(
            "GPU time per op ({PROFILE_ENV}=1), {all:.1} ms in all:\n{:<32} {:>9} {:>11} {:>10} {:>6}\n",
            "op", "count", "total ms", "mean us", "share"
        );
        for (op, (n, ms)) in rows {
            out.push_str(&format!(
                "{op:<32} {n:>9} {ms:>11.2} {:>10.1} {:>5.1}%\n",
                ms * 1e3 / *n as f64,
                100.0 * ms / all.max(1e-9)
            ));
        }
        out
    }
}
