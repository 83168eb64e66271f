//! Recording a pass once as a CUDA graph and replaying it: a capability of this backend alone,
//! decided from the [`PassInfo`] the model gives at [`Backend::begin_pass`] (as ggml-cuda
//! decides from the graph it is handed), invisible to the model.
//!
//! A pass qualifies when it is one decode row of one sequence (the model's own, or a batch's
//! alone in its pass: [`PassInfo::sequence`] says which cache) and every weight stays where it
//! is: then the same kernels run with the same addresses at every step, and only the position
//! differs. The kernels that depend on it ([`super::attention`]) read it from
//! a parameter in device memory while recording, which each replay sets first. The first
//! qualifying pass of a [`PassInfo::generation`] runs op by op (it creates every buffer a pass
//! creates lazily); the next is recorded and then launched; the ones after are replayed, their
//! ops skipped as the model calls them. A replay is launched when its pass begins (after the
//! pass's inputs are queued, before the model walks its layers), not when it ends: the host's
//! walk over the skipped ops (about 0.1 ms a 7B step on the H200 machine) then overlaps the
//! GPU's work instead of leaving the GPU idle before each step. A new generation or sequence,
//! or a scratch buffer of the backend growing, drops the recording. `GDSLLM_CUDA_GRAPH=0`
//! turns all of it off.
//!
//! [`Backend::begin_pass`]: crate::backend::Backend::begin_pass

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudarc::driver::{CudaGraph, CudaSlice};

use crate::backend::{BackendError, PassInfo};

use super::device::Queue;

/// How the ops of the current pass run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Launched one by one (also outside any pass).
    Eager,
    /// Recorded into a graph, launched at the end of the pass.
    Record,
    /// Already recorded: the graph launched when the pass begins, its ops skipped as the model
    /// calls them.
    Replay,
}

/// What a recording's launches point into: the model's buffers of one generation and one
/// sequence's KV cache ([`PassInfo::generation`], [`PassInfo::sequence`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Buffers {
    generation: u64,
    sequence: u64,
}

/// A CUDA graph owned by the backend.
struct StepGraph {
    graph: CudaGraph,
    buffers: Buffers,
    /// The kernels (launches and GEMMs) recorded in it.
    kernels: u64,
}

// SAFETY: the graph is a pair of driver handles with no thread affinity; the backend only
// touches it with the `state` mutex held, which serialises every call on it as the CUDA graph
// API requires.
unsafe impl Send for StepGraph {}

struct State {
    mode: Mode,
    graph: Option<StepGraph>,
    /// The buffers of the qualifying pass that last ran op by op.
    eager: Option<Buffers>,
    /// Set when a recording failed: every pass then runs op by op.
    failed: bool,
    /// The position of the recorded pass (one i32 in device memory), written before each
    /// replay.
    pos: CudaSlice<i32>,
    /// The buffers of the current qualifying pass.
    current: Buffers,
}

/// The recording and replaying of passes.
pub(super) struct Graphs {
    enabled: bool,
    state: Mutex<State>,
    /// Whether ops are skipped (a replay is under way): read by every op, so not behind the
    /// mutex.
    replaying: AtomicBool,
    /// Whether ops are being recorded.
    recording: AtomicBool,
    replays: AtomicU64,
}

impl Graphs {
    pub fn new(queue: &Queue) -> Result<Graphs, BackendError> {
        let pos = queue.alloc_zeros::<i32>(1, "allocating the pass parameters")?;
        Ok(Graphs {
            enabled: std::env::var("GDSLLM_CUDA_GRAPH").map_or(true, |v| v != "0"),
            state: Mutex::new(State {
                mode: Mode::Eager,
                graph: None,
                eager: None,
                failed: false,
                pos,
                current: Buffers {
                    generation: 0,
                    sequence: 0,
                },
            }),
            replaying: AtomicBool::new(false),
            recording: AtomicBool::new(false),
            replays: AtomicU64::new(0),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("not poisoned")
    }

    /// Passes replayed from a recording so far (the recording pass included).
    pub fn replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// Whether the ops called now are part of a replayed pass (they are skipped).
    pub fn replaying(&self) -> bool {
        self.replaying.load(Ordering::Relaxed)
    }

    /// Whether the ops called now are being recorded.
    pub fn recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    /// The device address of the pass's position while recording (the kernels that depend on
    /// the position read it there), else None.
    pub fn pos_param(&self, queue: &Queue) -> Option<u64> {
        if !self.recording.load(Ordering::Relaxed) {
            return None;
        }
        Some(queue.addr(&self.state().pos))
    }

    /// Decides how the pass described by `info` runs, and starts recording it if it is to be
    /// recorded.
    pub fn begin(&self, queue: &Queue, info: &PassInfo) -> Result<(), BackendError> {
        let mut st = self.state();
        st.mode = Mode::Eager;
        let qualifies = self.enabled && !st.failed && info.rows == 1 && info.weights_stable;
        let Some(sequence) = info.sequence.filter(|_| qualifies) else {
            return Ok(());
        };
        let buffers = Buffers {
            generation: info.generation,
            sequence,
        };
        st.current = buffers;
        if st.graph.as_ref().is_some_and(|g| g.buffers != buffers) {
            st.graph = None;
        }
        let pos = [info.pos as i32];
        if st.graph.is_some() {
            let State { pos: param, .. } = &mut *st;
            queue.write(&pos, param, "writing the pass position")?;
            self.launch(queue, &st)?;
            st.mode = Mode::Replay;
            self.replaying.store(true, Ordering::Relaxed);
        } else if st.eager == Some(buffers) {
            let State { pos: param, .. } = &mut *st;
            queue.write(&pos, param, "writing the pass position")?;
            match queue.begin_capture() {
                Ok(()) => {
                    st.mode = Mode::Record;
                    self.recording.store(true, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::debug!("cuStreamBeginCapture: {e}; passes run op by op");
                    st.failed = true;
                }
            }
        } else {
            st.eager = Some(buffers);
        }
        Ok(())
    }

    /// Ends the pass: launches the recording made now when every op of the pass was queued
    /// (`ran`). A replay was launched when its pass began: if the model's walk fails after it,
    /// the step has run on the device all the same, and the pass returns the walk's error. A
    /// recording that failed is dropped, passes run op by op from then on, and the error says
    /// the pass did not run.
    pub fn end(&self, queue: &Queue, ran: bool) -> Result<(), BackendError> {
        let mut st = self.state();
        let mode = std::mem::replace(&mut st.mode, Mode::Eager);
        self.replaying.store(false, Ordering::Relaxed);
        match mode {
            Mode::Eager => Ok(()),
            Mode::Replay => Ok(()),
            Mode::Record => {
                self.recording.store(false, Ordering::Relaxed);
                let captured = queue.end_capture();
                if !ran || st.failed {
                    // An op failed or could not be recorded: what was captured is incomplete.
                    st.failed = true;
                    return Err(BackendError::PassNotRun {
                        reason: "an op of the recorded pass failed".into(),
                    });
                }
                match captured {
                    Ok((Some(graph), kernels)) => {
                        st.graph = Some(StepGraph {
                            graph,
                            buffers: st.current,
                            kernels,
                        });
                        self.launch(queue, &st)
                    }
                    Ok((None, _)) => Err(self.fail(&mut st, "the recording is empty".into())),
                    Err(e) => Err(self.fail(&mut st, format!("recording the pass: {e}"))),
                }
            }
        }
    }

    fn launch(&self, queue: &Queue, st: &State) -> Result<(), BackendError> {
        let graph = st.graph.as_ref().ok_or(BackendError::PassNotRun {
            reason: "no recording to replay".into(),
        })?;
        queue.launch_graph(&graph.graph, graph.kernels)?;
        self.replays.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn fail(&self, st: &mut State, reason: String) -> BackendError {
        st.failed = true;
        st.graph = None;
        BackendError::PassNotRun { reason }
    }

    /// Called before the backend replaces one of its own buffers: the recording used the old
    /// one. Not possible while recording (the pass would not run as recorded): an error that
    /// says the pass did not run.
    pub fn before_realloc(&self, what: &str) -> Result<(), BackendError> {
        let mut st = self.state();
        if st.mode == Mode::Record {
            return Err(self.fail(&mut st, format!("{what} while recording")));
        }
        st.graph = None;
        Ok(())
    }

    /// Refuses what cannot be recorded (a copy from host memory, an allocation) while
    /// recording.
    pub fn forbid_while_recording(&self, what: &str) -> Result<(), BackendError> {
        if !self.recording.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut st = self.state();
        Err(self.fail(&mut st, format!("{what} cannot be recorded")))
    }
}
