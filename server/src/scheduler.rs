//! The queue in front of the model: request handlers submit jobs, one worker thread owns the
//! model's time and runs them in arrival order, one sequence at a time.
//!
//! The seam for continuous batching (issue 7) is [`Worker::run`]: today it takes one job and
//! drives it to the end; a batching worker would instead admit up to `max_batch` generate jobs,
//! step them together one token per pass, and feed each job's events through the same
//! [`SequenceSink`]. Handlers, events and cancellation stay as they are.

use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use crate::engine::{CancelToken, Engine, EngineFinish, GeneratedToken, GenerationRequest};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::stop::StopMatcher;

/// Why a sequence ended, as reported to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End of sequence or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
    /// The client went away or the server is shutting down.
    Cancelled,
}

impl FinishReason {
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What a generate job sends back, in order.
#[derive(Debug)]
pub enum Event {
    /// Text to send now (stop strings already cut out) and the token it came with; a last
    /// `Delta` without a token releases text held back for a possible stop string.
    Delta {
        text: String,
        token: Option<GeneratedToken>,
    },
    /// Always the last event of a sequence that did not fail.
    Done {
        finish: FinishReason,
        completion_tokens: usize,
    },
    Failed(ApiError),
}

pub struct GenerateJob {
    pub request: GenerationRequest,
    pub stop: Vec<String>,
    pub cancel: CancelToken,
    pub events: mpsc::UnboundedSender<Event>,
}

pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    pub cancel: CancelToken,
    pub reply: oneshot::Sender<Result<Vec<Vec<f32>>, ApiError>>,
}

enum Job {
    Generate(GenerateJob, Instant),
    Embed(EmbedJob, Instant),
}

/// Receives a submitted sequence's events; dropping it (the client went away) cancels the
/// sequence, whether it is still queued or already running.
pub struct SequenceHandle {
    pub events: mpsc::UnboundedReceiver<Event>,
    cancel: CancelToken,
}

impl Drop for SequenceHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Cancels its token when dropped (an embeddings request whose client went away).
struct CancelOnDrop(CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

pub struct Scheduler {
    sender: Mutex<Option<crossbeam_channel::Sender<Job>>>,
    waiting: Arc<AtomicUsize>,
    cancel_all: CancelToken,
    metrics: Arc<Metrics>,
    worker: Mutex<Option<JoinHandle<()>>>,
    max_batch: usize,
}

impl Scheduler {
    /// Starts the worker thread that owns `engine`'s time.
    pub fn start(engine: Arc<dyn Engine>, metrics: Arc<Metrics>, max_batch: usize) -> Scheduler {
        let (sender, receiver) = crossbeam_channel::unbounded();
        let waiting = Arc::new(AtomicUsize::new(0));
        let cancel_all = CancelToken::new();
        let worker = Worker {
            engine,
            metrics: metrics.clone(),
            waiting: waiting.clone(),
            cancel_all: cancel_all.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("gdsllm-model".into())
            .spawn(move || worker.run(receiver))
            .expect("spawning the model worker thread");
        Scheduler {
            sender: Mutex::new(Some(sender)),
            waiting,
            cancel_all,
            metrics,
            worker: Mutex::new(Some(handle)),
            max_batch,
        }
    }

    /// The future batch limit (`--max-batch`); sequences run one at a time today.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn submit(&self, job: Job) -> Result<(), ApiError> {
        let guard = self.sender.lock();
        let sender = guard
            .as_ref()
            .ok_or_else(|| ApiError::unavailable("the server is shutting down"))?;
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.metrics
            .set_waiting(self.waiting.load(Ordering::SeqCst));
        sender.send(job).map_err(|_| {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            ApiError::unavailable("the model worker has stopped")
        })
    }

    /// Queues a sequence; its events arrive on the returned handle.
    pub fn generate(
        &self,
        request: GenerationRequest,
        stop: Vec<String>,
    ) -> Result<SequenceHandle, ApiError> {
        let (events_tx, events) = mpsc::unbounded_channel();
        let cancel = CancelToken::new();
        let job = GenerateJob {
            request,
            stop,
            cancel: cancel.clone(),
            events: events_tx,
        };
        self.submit(Job::Generate(job, Instant::now()))?;
        Ok(SequenceHandle { events, cancel })
    }

    /// Embeds each input (token ids) in order.
    pub async fn embed(&self, inputs: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>, ApiError> {
        let (reply, answer) = oneshot::channel();
        let cancel = CancelToken::new();
        let _cancel_if_dropped = CancelOnDrop(cancel.clone());
        self.submit(Job::Embed(
            EmbedJob {
                inputs,
                cancel,
                reply,
            },
            Instant::now(),
        ))?;
        answer
            .await
            .map_err(|_| ApiError::unavailable("the request was cancelled (shutdown)"))?
    }

    /// Refuses new jobs; queued and running ones go on (see [`Scheduler::cancel_all`]).
    pub fn close(&self) {
        self.sender.lock().take();
    }

    /// Ends every queued and running sequence as soon as the worker notices.
    pub fn cancel_all(&self) {
        self.cancel_all.cancel();
    }

    /// Waits for the worker thread to finish the queue (call after [`Scheduler::close`]).
    pub fn join(&self) {
        if let Some(handle) = self.worker.lock().take() {
            let _ = handle.join();
        }
    }
}

struct Worker {
    engine: Arc<dyn Engine>,
    metrics: Arc<Metrics>,
    waiting: Arc<AtomicUsize>,
    cancel_all: CancelToken,
}

impl Worker {
    fn run(self, jobs: crossbeam_channel::Receiver<Job>) {
        for job in jobs {
            let left = self.waiting.fetch_sub(1, Ordering::SeqCst) - 1;
            self.metrics.set_waiting(left);
            // `running` drops back before the last event goes out, so a client that has its
            // answer never sees itself still counted.
            match job {
                Job::Generate(job, queued) => {
                    self.metrics.queue_time(queued.elapsed().as_secs_f64());
                    self.metrics.set_running(1);
                    let last = self.run_generate(&job, queued);
                    self.metrics.set_running(0);
                    let _ = job.events.send(last);
                }
                Job::Embed(job, queued) => {
                    self.metrics.queue_time(queued.elapsed().as_secs_f64());
                    self.metrics.set_running(1);
                    let result = self.run_embed(&job);
                    self.metrics.set_running(0);
                    let _ = job.reply.send(result);
                }
            }
        }
    }

    /// Runs one sequence, sending its deltas; returns its last event.
    fn run_generate(&self, job: &GenerateJob, queued: Instant) -> Event {
        if job.cancel.is_cancelled() || self.cancel_all.is_cancelled() {
            self.metrics.cancelled();
            return Event::Done {
                finish: FinishReason::Cancelled,
                completion_tokens: 0,
            };
        }
        self.metrics.prompt_tokens(job.request.prompt.len());
        let mut sink = SequenceSink {
            stop: StopMatcher::new(&job.stop),
            events: &job.events,
            metrics: &self.metrics,
            cancel_all: &self.cancel_all,
            queued,
            last_token: None,
            generated: 0,
            hit_stop_string: false,
        };
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.engine
                .generate(&job.request, &job.cancel, &mut |t| sink.on_token(t))
        }));
        let finish = match result {
            Ok(Ok(EngineFinish::EndOfSequence)) => FinishReason::Stop,
            Ok(Ok(EngineFinish::MaxTokens | EngineFinish::ContextFull)) => FinishReason::Length,
            Ok(Ok(EngineFinish::Stopped)) if sink.hit_stop_string => FinishReason::Stop,
            Ok(Ok(EngineFinish::Stopped)) => FinishReason::Cancelled,
            Ok(Err(err)) => {
                tracing::error!("generation failed: {err}");
                return Event::Failed(err.into());
            }
            Err(_) => {
                tracing::error!("the model panicked during generation");
                return Event::Failed(ApiError::internal("the model panicked"));
            }
        };
        if finish == FinishReason::Cancelled {
            self.metrics.cancelled();
            tracing::info!(tokens = sink.generated, "sequence cancelled");
        } else if !sink.hit_stop_string {
            let rest = sink.stop.flush();
            if !rest.is_empty() {
                let _ = job.events.send(Event::Delta {
                    text: rest,
                    token: None,
                });
            }
        }
        Event::Done {
            finish,
            completion_tokens: sink.generated,
        }
    }

    fn run_embed(&self, job: &EmbedJob) -> Result<Vec<Vec<f32>>, ApiError> {
        let mut out = Vec::with_capacity(job.inputs.len());
        for tokens in &job.inputs {
            if job.cancel.is_cancelled() || self.cancel_all.is_cancelled() {
                self.metrics.cancelled();
                return Err(ApiError::unavailable("cancelled"));
            }
            self.metrics.prompt_tokens(tokens.len());
            match std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.embed(tokens))) {
                Ok(Ok(v)) => out.push(v),
                Ok(Err(err)) => return Err(err.into()),
                Err(_) => {
                    tracing::error!("the model panicked while embedding");
                    return Err(ApiError::internal("the model panicked"));
                }
            }
        }
        Ok(out)
    }
}

/// Turns a running sequence's tokens into events: stop strings, latency metrics, and noticing
/// that the client has gone.
pub struct SequenceSink<'a> {
    stop: StopMatcher,
    events: &'a mpsc::UnboundedSender<Event>,
    metrics: &'a Metrics,
    cancel_all: &'a CancelToken,
    queued: Instant,
    last_token: Option<Instant>,
    generated: usize,
    hit_stop_string: bool,
}

impl SequenceSink<'_> {
    fn on_token(&mut self, token: GeneratedToken) -> ControlFlow<()> {
        let now = Instant::now();
        match self.last_token {
            None => self
                .metrics
                .time_to_first_token((now - self.queued).as_secs_f64()),
            Some(prev) => self.metrics.inter_token((now - prev).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.generated += 1;
        self.metrics.generated_token();
        let outcome = self.stop.push(&token.text);
        let sent = self.events.send(Event::Delta {
            text: outcome.emit,
            token: Some(token),
        });
        if sent.is_err() || self.cancel_all.is_cancelled() {
            return ControlFlow::Break(());
        }
        if outcome.stopped {
            self.hit_stop_string = true;
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }
}
