//! A discrete-event simulation of one compute stream and one I/O channel driving the same
//! [`Engine`] as the runtime, on a virtual clock: deterministic, no sleeps, no threads.

use std::collections::VecDeque;
use std::time::Duration;

use crate::engine::{Engine, Job, LocationState, Lookup, Outcome, ReadFrom};
use crate::error::ResidencyError;
use crate::plan::Plan;
use crate::stats::{PassStats, ResidencyStats};

/// Read times jittered per read by a factor uniform in `[1 - spread, 1 + spread]` (same mean).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Jitter {
    pub seed: u64,
    pub spread: f64,
}

/// What to simulate.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Disk read time per byte, in nanoseconds.
    pub disk_ns_per_byte: f64,
    /// Host-tier copy time per byte, in nanoseconds.
    pub host_ns_per_byte: f64,
    /// Compute time per blob index, in nanoseconds.
    pub compute_ns: Vec<u64>,
    /// The blobs each pass acquires, in order; `None`: the plan's order for `passes` passes.
    pub access: Option<Vec<Vec<usize>>>,
    pub passes: usize,
    pub jitter: Option<Jitter>,
}

/// What happened.
#[derive(Debug, Clone)]
pub struct SimReport {
    pub stats: ResidencyStats,
    pub passes: Vec<PassStats>,
    /// Every read, in issue order.
    pub jobs: Vec<Job>,
    pub total_ns: u64,
}

struct Channel {
    busy_until: u64,
    pending: VecDeque<(u64, Job)>,
    log: Vec<Job>,
    disk_ns_per_byte: f64,
    host_ns_per_byte: f64,
    rng: Option<(u64, f64)>,
}

impl Channel {
    fn submit(&mut self, jobs: Vec<Job>, at: u64) {
        for job in jobs {
            let per_byte = match job.from {
                ReadFrom::Disk => self.disk_ns_per_byte,
                ReadFrom::HostTier => self.host_ns_per_byte,
            };
            let mut ns = job.bytes as f64 * per_byte;
            if let Some((state, spread)) = &mut self.rng {
                *state ^= *state << 13;
                *state ^= *state >> 7;
                *state ^= *state << 17;
                let u = (*state >> 11) as f64 / (1u64 << 53) as f64;
                ns *= 1.0 + *spread * (2.0 * u - 1.0);
            }
            let start = at.max(self.busy_until);
            let finish = start + ns.round() as u64;
            self.busy_until = finish;
            self.log.push(job.clone());
            self.pending.push_back((finish, job));
        }
    }

    /// Completes every read that finishes by `t`, in order.
    fn advance(&mut self, engine: &mut Engine, t: u64) {
        while let Some(&(finish, _)) = self.pending.front() {
            if finish > t {
                break;
            }
            let (finish, job) = self.pending.pop_front().expect("front exists");
            let outcome = Outcome::Done {
                network_bytes: 0,
                stored_in_host: job.keep_in_host,
                copied_bytes: None,
            };
            engine.complete(&job, outcome, Duration::from_nanos(finish));
            let next = engine.take_jobs();
            self.submit(next, finish);
        }
    }

    fn next_finish(&self) -> Option<u64> {
        self.pending.front().map(|&(f, _)| f)
    }
}

/// Runs the simulation.
pub fn simulate(plan: &Plan, config: &SimConfig) -> Result<SimReport, ResidencyError> {
    let mut engine = Engine::new(plan);
    let mut channel = Channel {
        busy_until: 0,
        pending: VecDeque::new(),
        log: Vec::new(),
        disk_ns_per_byte: config.disk_ns_per_byte,
        host_ns_per_byte: config.host_ns_per_byte,
        rng: config.jitter.map(|j| (j.seed.max(1), j.spread)),
    };
    let access = config
        .access
        .clone()
        .unwrap_or_else(|| vec![plan.order.clone(); config.passes]);
    let stuck = || ResidencyError::ReadFailed {
        file: "(simulation)".into(),
        message: "waiting for a read that was never issued".into(),
    };
    let at = Duration::from_nanos;
    let mut t = 0u64;
    engine.start(at(0));
    let first = engine.take_jobs();
    channel.submit(first, 0);
    let mut passes = Vec::new();
    for pass in &access {
        for &blob in pass {
            channel.advance(&mut engine, t);
            let (location, ready) = loop {
                match engine.request(blob, at(t))? {
                    Lookup::Got { location, ready } => break (location, ready),
                    Lookup::Retry => {
                        t = channel.next_finish().ok_or_else(stuck)?;
                        channel.advance(&mut engine, t);
                    }
                }
            };
            let jobs = engine.take_jobs();
            channel.submit(jobs, t);
            if !ready {
                let from = t;
                while engine.state(location) == LocationState::Loading {
                    t = channel.next_finish().ok_or_else(stuck)?;
                    channel.advance(&mut engine, t);
                }
                engine.add_compute_wait(at(t - from));
            }
            t += config.compute_ns.get(blob).copied().unwrap_or(0);
            channel.advance(&mut engine, t);
            engine.release(location, at(t));
            let jobs = engine.take_jobs();
            channel.submit(jobs, t);
        }
        passes.push(engine.end_pass(at(t)));
    }
    Ok(SimReport {
        stats: engine.stats(at(t)),
        passes,
        jobs: channel.log,
        total_ns: t,
    })
}
