//! Where a CPU pass's wall time goes, with `GDSLLM_CPU_PROFILE=1`: for each kind of op, its
//! own time (without the ops it calls), how much of that was inside parallel regions, and how
//! busy the threads were in those regions; logged at the end of each pass (target
//! `llama::cpu_profile`, level info), then reset.
//!
//! Why: on the GPU machine's 16 threads a small model's prompt ran at ~6× its one-thread rate
//! where the threads could give 16×, and a profiler that samples (`perf`) is not on that
//! machine. The split this prints (time outside any region, regions whose threads wait on
//! each other, op kinds) says which of those it is. Off, each op pays one relaxed load.

use std::cell::RefCell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The kinds of op a pass's time is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Embed,
    Norm,
    Matmul,
    /// The sum into the residual after a matmul (`matmul_add_batch` less its matmul).
    Add,
    RopeStore,
    Attention,
    Activation,
    /// Bias, scale, softcap, copies.
    Other,
    Logits,
}

const OPS: [Op; 9] = [
    Op::Embed,
    Op::Norm,
    Op::Matmul,
    Op::Add,
    Op::RopeStore,
    Op::Attention,
    Op::Activation,
    Op::Other,
    Op::Logits,
];

/// Whether `GDSLLM_CPU_PROFILE` is set (to anything but `0`).
pub(super) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("GDSLLM_CPU_PROFILE").is_ok_and(|v| v != "0"))
}

/// One op kind's figures for the pass so far, in nanoseconds.
#[derive(Clone, Copy, Default)]
struct Figures {
    calls: u64,
    /// Wall time of the op without the ops it called.
    own_ns: u64,
    regions: u64,
    /// Wall time of its parallel regions, from the caller.
    region_ns: u64,
}

struct Pass {
    started: Option<Instant>,
    figures: [Figures; OPS.len()],
}

static PASS: Mutex<Pass> = Mutex::new(Pass {
    started: None,
    figures: [Figures {
        calls: 0,
        own_ns: 0,
        regions: 0,
        region_ns: 0,
    }; OPS.len()],
});

/// Time the tasks of the current pass's regions ran, summed over the threads, by op.
static BUSY_NS: [AtomicU64; OPS.len()] = [const { AtomicU64::new(0) }; OPS.len()];

/// `op`'s slot: [`OPS`] lists the kinds in their declaration order (a test checks).
fn index(op: Op) -> usize {
    op as usize
}

thread_local! {
    /// The ops the calling thread is inside, innermost last: (op, start, time of the ops
    /// called from it).
    static STACK: RefCell<Vec<(Op, Instant, u64)>> = const { RefCell::new(Vec::new()) };
}

fn with_pass(f: impl FnOnce(&mut Pass)) {
    let mut pass = PASS.lock().unwrap_or_else(|p| p.into_inner());
    f(&mut pass);
}

/// Counts the time until it is dropped as `op`'s (less the ops started inside it).
pub(super) struct OpGuard {
    on: bool,
}

/// Starts timing `op` on this thread (nothing when profiling is off).
pub(super) fn op(op: Op) -> OpGuard {
    if !enabled() {
        return OpGuard { on: false };
    }
    STACK.with(|s| s.borrow_mut().push((op, Instant::now(), 0)));
    OpGuard { on: true }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        if !self.on {
            return;
        }
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            let Some((op, start, children)) = s.pop() else {
                return;
            };
            let elapsed = start.elapsed().as_nanos() as u64;
            if let Some(parent) = s.last_mut() {
                parent.2 += elapsed;
            }
            with_pass(|p| {
                let f = &mut p.figures[index(op)];
                f.calls += 1;
                f.own_ns += elapsed.saturating_sub(children);
            });
        });
    }
}

/// The op this thread is inside (the one a region it starts is counted for).
fn current() -> Op {
    STACK.with(|s| s.borrow().last().map_or(Op::Other, |e| e.0))
}

/// A region's timer: started by the thread that runs the region.
pub(super) struct Region {
    op: Op,
    start: Instant,
}

/// Starts timing a parallel region (`None` when profiling is off).
pub(super) fn region() -> Option<Region> {
    enabled().then(|| Region {
        op: current(),
        start: Instant::now(),
    })
}

impl Region {
    /// The index of the op its tasks count for (for [`Region::task`]).
    pub(super) fn slot(&self) -> usize {
        index(self.op)
    }

    /// Runs one task of the region, adding its time to the op's busy time.
    pub(super) fn task<R>(slot: usize, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        BUSY_NS[slot].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let elapsed = self.start.elapsed().as_nanos() as u64;
        with_pass(|p| {
            let f = &mut p.figures[index(self.op)];
            f.regions += 1;
            f.region_ns += elapsed;
        });
    }
}

/// Marks the start of a pass.
pub(super) fn begin_pass() {
    if !enabled() {
        return;
    }
    with_pass(|p| {
        p.started = Some(Instant::now());
        p.figures = [Figures::default(); OPS.len()];
    });
    for b in &BUSY_NS {
        b.store(0, Ordering::Relaxed);
    }
}

/// Logs the pass's figures (`threads`: the regions' threads, the caller included).
pub(super) fn end_pass(threads: usize) {
    if !enabled() {
        return;
    }
    with_pass(|p| {
        let Some(started) = p.started.take() else {
            return;
        };
        let wall = started.elapsed().as_nanos() as u64;
        let ms = |ns: u64| ns as f64 / 1e6;
        let mut in_ops = 0;
        let mut rows = Vec::new();
        for (i, op) in OPS.iter().enumerate() {
            let f = p.figures[i];
            in_ops += f.own_ns;
            if f.calls == 0 {
                continue;
            }
            let busy = BUSY_NS[i].load(Ordering::Relaxed);
            // How busy the threads were while the op's regions ran.
            let use_pct = if f.region_ns > 0 {
                100.0 * busy as f64 / (f.region_ns as f64 * threads as f64)
            } else {
                0.0
            };
            rows.push(format!(
                "{op:?} {:.3} ms ({} calls; {} regions {:.3} ms, threads {use_pct:.0}% busy; outside regions {:.3} ms)",
                ms(f.own_ns),
                f.calls,
                f.regions,
                ms(f.region_ns),
                ms(f.own_ns.saturating_sub(f.region_ns)),
            ));
        }
        tracing::info!(
            target: "llama::cpu_profile",
            "pass {:.3} ms on {threads} threads, {:.3} ms outside the backend's ops: {}",
            ms(wall),
            ms(wall.saturating_sub(in_ops)),
            rows.join(" | ")
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_op_kind_has_its_own_slot() {
        // `index` is the declaration order; `OPS` must list every kind in that order.
        for (i, op) in OPS.iter().enumerate() {
            assert_eq!(index(*op), i, "{op:?}");
        }
    }
}
