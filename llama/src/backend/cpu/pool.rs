//! The threads the CPU backend's parallel regions run on.
//!
//! A decode step of a small model is a few hundred parallel regions of a few microseconds each
//! (SmolLM2-135M: ~210 matmuls and 30 attentions a token). On rayon's pool each region wakes
//! sleeping workers and steals its tasks through the deques: on the GPU machine's 16 threads a
//! SmolLM2-shaped q4_1 decoded at 258–276 tok/s where llama.cpp, whose threads spin on a
//! barrier between ops, made 514–558, and 16 threads decoded slower than 8. So by default the
//! regions run on a `micropool` pool whose workers spin for a while (`GDSLLM_CPU_SPIN` spin
//! iterations, 3,000 by default: ~0.1 ms) after each region before they sleep, and whose
//! caller takes tasks too instead of waiting: a region then costs an atomic per task, not a
//! wake-up per worker.
//!
//! Each task is claimed on its own (an atomic per task). Dealing the tasks out as one run per
//! thread (micropool's `split_by_threads`) measured slower on the GPU machine's 16 threads
//! (SmolLM2-shaped q4_1 decode 277–296 against 282–346 tok/s, BENCHMARKS.md 2026-11-29), with
//! smaller tasks as well. With one thread the caller runs a region's tasks itself.
//!
//! `GDSLLM_CPU_POOL=rayon` runs the regions on rayon's global pool as before (for an A/B in
//! one binary). Either way the pool has as many threads as rayon's global pool (the caller
//! counts as one), which `CpuBackend::adopt_current_thread` sizes.
//!
//! Not for: work outside a pass (the one-time repacking of weights stays on rayon).
//!
//! A panic inside a task aborts the process on the spinning pool (micropool cannot unwind
//! through its workers); tasks are kernels over inputs checked before the region starts.

use std::sync::OnceLock;

use super::profile;

use micropool::iter::{ExactParallelSourceExt, IntoExactParallelRefMutSource, ParallelIteratorExt};
use rayon::iter::{IntoParallelRefMutIterator, ParallelIterator};

/// Which pool the regions run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Spin-then-sleep workers (`micropool`); the default.
    Spin,
    /// rayon's global pool.
    Rayon,
}

fn kind() -> Kind {
    static KIND: OnceLock<Kind> = OnceLock::new();
    *KIND.get_or_init(|| match std::env::var("GDSLLM_CPU_POOL").as_deref() {
        Ok("rayon") => Kind::Rayon,
        Ok("spin") | Err(_) => Kind::Spin,
        Ok(other) => {
            tracing::warn!("GDSLLM_CPU_POOL={other:?} is neither \"spin\" nor \"rayon\": spin");
            Kind::Spin
        }
    })
}

/// Spin iterations a worker waits for the next region before it sleeps.
fn spin_iterations() -> usize {
    std::env::var("GDSLLM_CPU_SPIN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

/// The spinning pool, built at the first region with one worker fewer than rayon's pool has
/// threads (the caller is the other); `None` with rayon chosen or a single thread.
fn spin_pool() -> Option<&'static micropool::ThreadPool> {
    static POOL: OnceLock<Option<micropool::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = rayon::current_num_threads();
        (kind() == Kind::Spin && threads > 1).then(|| {
            micropool::ThreadPoolBuilder::default()
                .num_threads(threads - 1)
                .idle_spin_cycles(spin_iterations())
                .build()
        })
    })
    .as_ref()
}

/// The threads a region is shared among (the caller included).
pub(super) fn threads() -> usize {
    rayon::current_num_threads()
}

/// `f(task)` for every task, in parallel.
pub(in crate::backend) fn for_each<T: Send>(tasks: &mut [T], f: impl Fn(&mut T) + Sync + Send) {
    for_each_init(tasks, || (), |_, task| f(task));
}

/// [`for_each`] with a scratch value made by `init` for the tasks that share it.
pub(super) fn for_each_init<T: Send, S>(
    tasks: &mut [T],
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, &mut T) + Sync + Send,
) {
    if tasks.is_empty() {
        return;
    }
    let region = profile::region();
    let slot = region.as_ref().map(profile::Region::slot);
    let f = |s: &mut S, t: &mut T| match slot {
        Some(slot) => profile::Region::task(slot, || f(s, t)),
        None => f(s, t),
    };
    match (tasks.len(), spin_pool()) {
        (1, _) => f(&mut init(), &mut tasks[0]),
        // One thread: the caller runs them (handing them to a pool of one meant a sleep and a
        // wake-up per region).
        _ if threads() == 1 => {
            let mut scratch = init();
            for task in tasks.iter_mut() {
                f(&mut scratch, task);
            }
        }
        (_, Some(pool)) => IntoExactParallelRefMutSource::par_iter_mut(tasks)
            .with_thread_pool(pool.split_per_item())
            .for_each_init(init, f),
        (_, None) => IntoParallelRefMutIterator::par_iter_mut(tasks).for_each_init(init, f),
    }
    drop(region);
}
