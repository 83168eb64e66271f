//! The queue in front of the model: request handlers submit jobs, one worker thread owns the
//! model's time.
//!
//! With an engine that batches ([`Engine::batch`]) the worker runs continuous batching: it
//! moves every submitted generate job into the engine's batch (up to `max_batch` run
//! together, one pass over the weights per step; the rest wait there for room), steps the
//! batch, and between steps takes new jobs, runs one bounded piece of an embeddings request
//! and cancels the sequences whose client has gone, which frees their KV cache at once.
//! Without batching it runs generate jobs one at a time in arrival order, and embeddings in
//! pieces between them. Either way each sequence's tokens go through its own
//! [`SequenceOutput`] (stop strings, latency metrics, events).
//!
//! Fairness and bounds: an embeddings request never holds the worker for more than
//! [`EMBED_PIECE_TOKENS`] tokens at a time, so a chat submitted behind a long one waits at
//! most one piece before its first step. The queue is bounded: at most `max_batch +
//! max_queue` requests are queued or running; beyond that [`Scheduler::generate`] and
//! [`Scheduler::embed`] answer 429 at once, with `Retry-After`.

use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use crate::engine::{
    CancelToken, Engine, EngineBatch, EngineError, EngineFinish, GeneratedToken, GenerationRequest,
};
use crate::error::ApiError;
use crate::metrics::Metrics;
use llama::StopMatcher;

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

/// Tokens of embedding input the worker computes before it looks at the batch again (at
/// least one whole input, however long).
pub const EMBED_PIECE_TOKENS: usize = 512;

pub struct GenerateJob {
    pub request: GenerationRequest,
    pub stop: Vec<String>,
    pub cancel: CancelToken,
    pub events: mpsc::UnboundedSender<Event>,
    _slot: QueueSlot,
}

pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    pub cancel: CancelToken,
    pub reply: oneshot::Sender<Result<Vec<Vec<f32>>, ApiError>>,
    _slot: QueueSlot,
}

impl GenerateJob {
    /// Gives back the job's place first, then sends its last event: a client that has its
    /// answer never finds the request still counted (the model registry unloads only a model
    /// that holds none).
    fn send_last(self, last: Event) {
        let GenerateJob { events, _slot, .. } = self;
        drop(_slot);
        let _ = events.send(last);
    }
}

/// One place among the requests the scheduler holds (queued or running); given back when the
/// job is dropped, however it ended.
struct QueueSlot(Arc<AtomicUsize>);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An embeddings request being worked through piece by piece.
struct EmbedWork {
    job: EmbedJob,
    vectors: Vec<Vec<f32>>,
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

impl SequenceHandle {
    /// A token that cancels this sequence from elsewhere (a transport's `cancel` call); the
    /// sequence then ends with [`FinishReason::Cancelled`] as its last event.
    pub fn canceller(&self) -> CancelToken {
        self.cancel.clone()
    }
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
    /// Requests queued or running, against `capacity`.
    held: Arc<AtomicUsize>,
    capacity: usize,
    cancel_all: CancelToken,
    metrics: Arc<Metrics>,
    worker: Mutex<Option<JoinHandle<()>>>,
    max_batch: usize,
}

impl Scheduler {
    /// Starts the worker thread that owns `engine`'s time. At most `max_batch + max_queue`
    /// requests are held (running or queued); more are refused with 429.
    pub fn start(
        engine: Arc<dyn Engine>,
        metrics: Arc<Metrics>,
        max_batch: usize,
        max_queue: usize,
    ) -> Scheduler {
        let (sender, receiver) = crossbeam_channel::unbounded();
        let waiting = Arc::new(AtomicUsize::new(0));
        let cancel_all = CancelToken::new();
        let worker = Worker {
            engine,
            metrics: metrics.clone(),
            waiting: waiting.clone(),
            cancel_all: cancel_all.clone(),
            max_batch: max_batch.max(1),
        };
        let handle = std::thread::Builder::new()
            .name("gdsllm-model".into())
            .spawn(move || worker.run(receiver))
            .expect("spawning the model worker thread");
        Scheduler {
            sender: Mutex::new(Some(sender)),
            waiting,
            held: Arc::new(AtomicUsize::new(0)),
            capacity: max_batch.max(1) + max_queue,
            cancel_all,
            metrics,
            worker: Mutex::new(Some(handle)),
            max_batch,
        }
    }

    /// The most sequences decoded together (`--max-batch`).
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Requests queued or running now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Takes one of the places for requests, or answers 429 when all are held.
    fn reserve(&self) -> Result<QueueSlot, ApiError> {
        let held = self.held.fetch_add(1, Ordering::SeqCst);
        let slot = QueueSlot(self.held.clone());
        if held >= self.capacity {
            drop(slot);
            self.metrics.rejected();
            return Err(ApiError::busy(format!(
                "the server is busy: {} requests are running or queued (its limit); retry later",
                self.capacity
            )));
        }
        Ok(slot)
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
        let slot = self.reserve()?;
        let (events_tx, events) = mpsc::unbounded_channel();
        let cancel = CancelToken::new();
        let job = GenerateJob {
            request,
            stop,
            cancel: cancel.clone(),
            events: events_tx,
            _slot: slot,
        };
        self.submit(Job::Generate(job, Instant::now()))?;
        Ok(SequenceHandle { events, cancel })
    }

    /// Embeds each input (token ids) in order.
    pub async fn embed(&self, inputs: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>, ApiError> {
        let slot = self.reserve()?;
        let (reply, answer) = oneshot::channel();
        let cancel = CancelToken::new();
        let _cancel_if_dropped = CancelOnDrop(cancel.clone());
        self.submit(Job::Embed(
            EmbedJob {
                inputs,
                cancel,
                reply,
                _slot: slot,
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
    max_batch: usize,
}

/// A generate job inside the engine's batch.
struct Batched {
    job: GenerateJob,
    out: SequenceOutput,
    /// Whether it has left the batch's queue (its queue time is recorded then).
    admitted: bool,
}

impl Worker {
    fn run(self, jobs: crossbeam_channel::Receiver<Job>) {
        let engine = self.engine.clone();
        let batch = std::panic::catch_unwind(AssertUnwindSafe(|| engine.batch(self.max_batch)));
        match batch {
            Ok(Ok(Some(batch))) => self.run_batched(&*engine, batch, jobs),
            Ok(Ok(None)) => self.run_serial(jobs),
            Ok(Err(err)) => {
                tracing::warn!("batched decoding unavailable ({err}); one sequence at a time");
                self.run_serial(jobs)
            }
            Err(_) => {
                tracing::error!("the model panicked setting up batching; one sequence at a time");
                self.run_serial(jobs)
            }
        }
    }

    /// Takes a job off the channel: counts it out of the channel's waiting jobs and records
    /// how long it queued there.
    fn took(&self, queued: Instant) {
        let left = self.waiting.fetch_sub(1, Ordering::SeqCst) - 1;
        self.metrics.set_waiting(left);
        self.metrics.queue_time(queued.elapsed().as_secs_f64());
    }

    /// One sequence at a time in arrival order; embeddings go forward one piece at a time
    /// whenever no sequence is waiting.
    fn run_serial(self, jobs: crossbeam_channel::Receiver<Job>) {
        let mut generates: VecDeque<(GenerateJob, Instant)> = VecDeque::new();
        let mut embeds: VecDeque<EmbedWork> = VecDeque::new();
        let take = |job: Job,
                    generates: &mut VecDeque<(GenerateJob, Instant)>,
                    embeds: &mut VecDeque<EmbedWork>| match job {
            Job::Generate(job, queued) => {
                self.took(queued);
                generates.push_back((job, queued));
            }
            Job::Embed(job, queued) => {
                self.took(queued);
                embeds.push_back(EmbedWork {
                    job,
                    vectors: Vec::new(),
                });
            }
        };
        loop {
            if generates.is_empty() && embeds.is_empty() {
                match jobs.recv() {
                    Ok(job) => take(job, &mut generates, &mut embeds),
                    Err(_) => return,
                }
            }
            while let Ok(job) = jobs.try_recv() {
                take(job, &mut generates, &mut embeds);
            }
            // `running` drops back before the last event goes out, so a client that has its
            // answer never sees itself still counted.
            if let Some((job, queued)) = generates.pop_front() {
                self.metrics.set_running(1);
                let last = self.run_generate(&job, queued);
                self.metrics.set_running(0);
                job.send_last(last);
            } else {
                self.embed_step(&mut embeds, 0);
            }
        }
    }

    /// Runs the next piece of the first embeddings request, and answers it when it is done.
    fn embed_step(&self, embeds: &mut VecDeque<EmbedWork>, running: usize) {
        let Some(work) = embeds.front_mut() else {
            return;
        };
        self.metrics.set_running(running + 1);
        let done = self.embed_piece(work);
        self.metrics.set_running(running);
        if let Some(result) = done {
            let work = embeds.pop_front().expect("front exists");
            // The place goes back before the answer (see `GenerateJob::send_last`).
            let EmbedJob { reply, _slot, .. } = work.job;
            drop(_slot);
            let _ = reply.send(result);
        }
    }

    /// Embeds inputs of `work` until [`EMBED_PIECE_TOKENS`] tokens are done (at least one
    /// input); returns the answer once every input is done, or it failed or was cancelled.
    fn embed_piece(&self, work: &mut EmbedWork) -> Option<Result<Vec<Vec<f32>>, ApiError>> {
        let mut tokens_done = 0;
        while let Some(tokens) = work.job.inputs.get(work.vectors.len()) {
            if tokens_done > 0 && tokens_done + tokens.len() > EMBED_PIECE_TOKENS {
                return None;
            }
            if work.job.cancel.is_cancelled() || self.cancel_all.is_cancelled() {
                self.metrics.cancelled();
                return Some(Err(ApiError::unavailable("cancelled")));
            }
            self.metrics.prompt_tokens(tokens.len());
            match std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.embed(tokens))) {
                Ok(Ok(v)) => work.vectors.push(v),
                Ok(Err(err)) => return Some(Err(err.into())),
                Err(_) => {
                    tracing::error!("the model panicked while embedding");
                    return Some(Err(ApiError::internal("the model panicked")));
                }
            }
            tokens_done += tokens.len();
        }
        Some(Ok(std::mem::take(&mut work.vectors)))
    }

    /// Continuous batching: jobs join the engine's batch between steps and leave it when they
    /// end or their client goes away.
    fn run_batched<'e>(
        &self,
        engine: &'e dyn Engine,
        mut batch: Box<dyn EngineBatch + 'e>,
        jobs: crossbeam_channel::Receiver<Job>,
    ) {
        let mut active: HashMap<u64, Batched> = HashMap::new();
        let mut embeds: VecDeque<EmbedWork> = VecDeque::new();
        loop {
            // Wait for work only when there is nothing to step.
            if active.is_empty() && embeds.is_empty() {
                match jobs.recv() {
                    Ok(job) => self.take_job(job, &mut *batch, &mut active, &mut embeds),
                    Err(_) => return,
                }
            }
            while let Ok(job) = jobs.try_recv() {
                self.take_job(job, &mut *batch, &mut active, &mut embeds);
            }
            self.cancel_gone(&mut *batch, &mut active);
            // One bounded piece of embedding between two steps: a long request shares the
            // worker with the batch instead of holding it.
            self.embed_step(&mut embeds, batch.running());
            if active.is_empty() {
                continue;
            }
            let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| {
                batch.step(&mut |id, token| match active.get_mut(&id) {
                    Some(b) => {
                        b.out
                            .on_token(token, &b.job.events, &self.metrics, &self.cancel_all)
                    }
                    None => ControlFlow::Break(()),
                })
            }));
            let ended = match stepped {
                Ok(Ok(ended)) => ended,
                Ok(Err(err)) => {
                    tracing::error!("batched generation failed: {err}");
                    self.fail_all(&mut *batch, &mut active, || err_event(&err));
                    continue;
                }
                Err(_) => {
                    tracing::error!("the model panicked during batched generation");
                    self.fail_all(&mut *batch, &mut active, || {
                        Event::Failed(ApiError::internal("the model panicked"))
                    });
                    // The batch may be half-way through a step: start a fresh one.
                    match engine.batch(self.max_batch) {
                        Ok(Some(fresh)) => batch = fresh,
                        _ => {
                            tracing::error!("batching could not restart; one sequence at a time");
                            return self.run_serial_rest(jobs);
                        }
                    }
                    continue;
                }
            };
            for (&id, b) in active.iter_mut().filter(|(_, b)| !b.admitted) {
                if b.out.generated > 0 || batch.is_running(id) {
                    b.admitted = true;
                    self.metrics
                        .queue_time(b.out.queued.elapsed().as_secs_f64());
                }
            }
            self.update_gauges(&*batch);
            for (id, finish) in ended {
                let Some(mut b) = active.remove(&id) else {
                    continue;
                };
                if !b.admitted {
                    self.metrics
                        .queue_time(b.out.queued.elapsed().as_secs_f64());
                }
                let last = b.out.finish(finish, &b.job.events, &self.metrics);
                b.job.send_last(last);
            }
        }
    }

    /// The worker's serial loop for the jobs left after batching broke down.
    fn run_serial_rest(&self, jobs: crossbeam_channel::Receiver<Job>) {
        let serial = Worker {
            engine: self.engine.clone(),
            metrics: self.metrics.clone(),
            waiting: self.waiting.clone(),
            cancel_all: self.cancel_all.clone(),
            max_batch: 1,
        };
        serial.run_serial(jobs);
    }

    fn update_gauges(&self, batch: &dyn EngineBatch) {
        self.metrics.set_cache_usage(&batch.cache_usage());
        self.metrics.set_running(batch.running());
        self.metrics
            .set_waiting(self.waiting.load(Ordering::SeqCst) + batch.waiting());
    }

    /// A job from the channel: an embedding joins the embeddings worked through between
    /// steps; a generate job joins the batch.
    fn take_job(
        &self,
        job: Job,
        batch: &mut dyn EngineBatch,
        active: &mut HashMap<u64, Batched>,
        embeds: &mut VecDeque<EmbedWork>,
    ) {
        match job {
            Job::Embed(job, queued) => {
                self.took(queued);
                embeds.push_back(EmbedWork {
                    job,
                    vectors: Vec::new(),
                });
            }
            Job::Generate(job, queued) => {
                let left = self.waiting.fetch_sub(1, Ordering::SeqCst) - 1;
                self.metrics.set_waiting(left + batch.waiting());
                if job.cancel.is_cancelled() || self.cancel_all.is_cancelled() {
                    self.metrics.cancelled();
                    let _ = job.events.send(Event::Done {
                        finish: FinishReason::Cancelled,
                        completion_tokens: 0,
                    });
                    return;
                }
                match batch.add(&job.request) {
                    Ok(id) => {
                        self.metrics.prompt_tokens(job.request.prompt.len());
                        let out = SequenceOutput::new(&job.stop, queued);
                        active.insert(
                            id,
                            Batched {
                                job,
                                out,
                                admitted: false,
                            },
                        );
                        self.update_gauges(batch);
                    }
                    Err(err) => {
                        let _ = job.events.send(err_event(&err));
                    }
                }
            }
        }
    }

    /// Cancels the sequences whose client has gone (or all, at shutdown): their caches are
    /// freed before the next step.
    fn cancel_gone(&self, batch: &mut dyn EngineBatch, active: &mut HashMap<u64, Batched>) {
        let all = self.cancel_all.is_cancelled();
        let gone: Vec<u64> = active
            .iter()
            .filter(|(_, b)| all || b.job.cancel.is_cancelled() || b.job.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        if gone.is_empty() {
            return;
        }
        for id in &gone {
            batch.cancel(*id);
        }
        self.update_gauges(batch);
        for id in gone {
            let b = active.remove(&id).expect("listed above");
            self.metrics.cancelled();
            tracing::info!(tokens = b.out.generated, "sequence cancelled");
            let _ = b.job.events.send(Event::Done {
                finish: FinishReason::Cancelled,
                completion_tokens: b.out.generated,
            });
        }
    }

    fn fail_all(
        &self,
        batch: &mut dyn EngineBatch,
        active: &mut HashMap<u64, Batched>,
        event: impl Fn() -> Event,
    ) {
        for (id, b) in active.drain() {
            batch.cancel(id);
            let _ = b.job.events.send(event());
        }
        self.update_gauges(batch);
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
        let mut out = SequenceOutput::new(&job.stop, queued);
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.engine.generate(&job.request, &job.cancel, &mut |t| {
                out.on_token(t, &job.events, &self.metrics, &self.cancel_all)
            })
        }));
        let finish = match result {
            Ok(finish) => finish,
            Err(_) => {
                tracing::error!("the model panicked during generation");
                return Event::Failed(ApiError::internal("the model panicked"));
            }
        };
        out.finish(finish, &job.events, &self.metrics)
    }
}

fn err_event(err: &EngineError) -> Event {
    let err = match err {
        EngineError::InvalidInput(m) => EngineError::InvalidInput(m.clone()),
        EngineError::Failed(m) => EngineError::Failed(m.clone()),
    };
    Event::Failed(err.into())
}

/// Turns a running sequence's tokens into events: stop strings, latency metrics, and noticing
/// that the client has gone; then its last event.
pub struct SequenceOutput {
    stop: StopMatcher,
    queued: Instant,
    last_token: Option<Instant>,
    generated: usize,
    hit_stop_string: bool,
}

impl SequenceOutput {
    fn new(stop: &[String], queued: Instant) -> SequenceOutput {
        SequenceOutput {
            stop: StopMatcher::new(stop),
            queued,
            last_token: None,
            generated: 0,
            hit_stop_string: false,
        }
    }

    fn on_token(
        &mut self,
        token: GeneratedToken,
        events: &mpsc::UnboundedSender<Event>,
        metrics: &Metrics,
        cancel_all: &CancelToken,
    ) -> ControlFlow<()> {
        let now = Instant::now();
        match self.last_token {
            None => metrics.time_to_first_token((now - self.queued).as_secs_f64()),
            Some(prev) => metrics.inter_token((now - prev).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.generated += 1;
        metrics.generated_token();
        let outcome = self.stop.push(&token.text);
        let sent = events.send(Event::Delta {
            text: outcome.emit,
            token: Some(token),
        });
        if sent.is_err() || cancel_all.is_cancelled() {
            return ControlFlow::Break(());
        }
        if outcome.stopped {
            self.hit_stop_string = true;
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }

    /// The last event of a sequence that ended with `finish` (sending the text held back for
    /// a stop string that never came).
    fn finish(
        &mut self,
        finish: Result<EngineFinish, EngineError>,
        events: &mpsc::UnboundedSender<Event>,
        metrics: &Metrics,
    ) -> Event {
        let finish = match finish {
            Ok(EngineFinish::EndOfSequence) => FinishReason::Stop,
            Ok(EngineFinish::MaxTokens | EngineFinish::ContextFull) => FinishReason::Length,
            Ok(EngineFinish::Stopped) if self.hit_stop_string => FinishReason::Stop,
            Ok(EngineFinish::Stopped) => FinishReason::Cancelled,
            Err(err) => {
                tracing::error!("generation failed: {err}");
                return Event::Failed(err.into());
            }
        };
        if finish == FinishReason::Cancelled {
            metrics.cancelled();
            tracing::info!(tokens = self.generated, "sequence cancelled");
        } else if !self.hit_stop_string {
            let rest = self.stop.flush();
            if !rest.is_empty() {
                let _ = events.send(Event::Delta {
                    text: rest,
                    token: None,
                });
            }
        }
        Event::Done {
            finish,
            completion_tokens: self.generated,
        }
    }
}
