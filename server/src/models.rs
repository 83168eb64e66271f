//! Several models in one server: the registry of model slots.
//!
//! Each loaded model has its own slot: its engine and its [`Scheduler`] (worker thread, queue,
//! batch). The default model (`serve -m`) is loaded at start, as a single-model server always
//! did; with a [`ModelSource`] (the CLI's, over the model store) a request naming another
//! model loads it on demand, and operators load and unload models by name.
//!
//! The rules, in one place:
//! - At most `max_models` models are loaded or loading at once. A load beyond it first unloads
//!   the least recently used idle model (no request holds it, none queued or running); when
//!   every loaded model is busy the request gets 429 with `Retry-After` at once.
//! - A request for a model that is loading waits for it, up to `model_load_timeout` (503
//!   after that); the load runs on a blocking thread, so requests for other models go on.
//!   Only the default model's first load (at start) answers 503 at once, as `/health` does.
//! - A model other than the default that has been idle for `model_idle_timeout` is unloaded;
//!   the default stays loaded (an operator may unload it, or a load at `max_models` may evict
//!   it; the next request that names it loads it again).
//! - `unload` of a model that is busy or still loading answers 409: the operator retries
//!   once its requests are done (nothing new is refused meanwhile).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::engine::Engine;
use crate::error::ApiError;
use crate::scheduler::Scheduler;
use crate::state::AppState;

/// A model the server can serve: what the registry needs to know to find and load it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceModel {
    /// The name it is listed under and answers to first (the loaded engine's id).
    pub name: String,
    /// Its other names (store names and tags of the same model).
    pub aliases: Vec<String>,
    /// What makes two names the same model (its directory): at most one slot per key.
    pub key: String,
}

impl SourceModel {
    fn answers_to(&self, name: &str) -> bool {
        self.name == name || self.aliases.iter().any(|a| a == name)
    }
}

/// Where models other than the default come from (the CLI implements it over the store).
/// Errors are messages: they go to the client (503) and the log.
pub trait ModelSource: Send + Sync {
    /// Every model that could be loaded, for `/v1/models`.
    fn list(&self) -> Result<Vec<SourceModel>, String>;
    /// The model `name` names, or `None` when there is none by that name.
    fn find(&self, name: &str) -> Result<Option<SourceModel>, String>;
    /// Loads `model` (blocking; called on a blocking thread).
    fn load(&self, model: &SourceModel) -> Result<Arc<dyn Engine>, String>;
}

pub(crate) enum SlotState {
    /// Changes (to `true`) when the load ends, either way.
    Loading(watch::Receiver<bool>),
    Ready {
        engine: Arc<dyn Engine>,
        scheduler: Arc<Scheduler>,
    },
    Failed(String),
}

pub(crate) struct Slot {
    pub model: SourceModel,
    pub state: SlotState,
    pub is_default: bool,
    last_used: Instant,
    /// Requests between finding the model and queueing on its scheduler (after that the
    /// scheduler's own count says the model is busy).
    leases: usize,
}

impl Slot {
    /// No request holds it, none is queued or running on it.
    fn idle(&self) -> bool {
        match &self.state {
            SlotState::Ready { scheduler, .. } => self.leases == 0 && scheduler.held() == 0,
            SlotState::Loading(_) => false,
            SlotState::Failed(_) => true,
        }
    }

    fn occupies(&self) -> bool {
        !matches!(self.state, SlotState::Failed(_))
    }
}

/// The slots and the default model's identity.
pub(crate) struct Registry {
    pub slots: Mutex<Vec<Slot>>,
    /// The default model: its names (id, then `--alias`es, then its store aliases) and key.
    pub default: Mutex<SourceModel>,
    /// Set once the default model's first load ended well.
    pub default_ready_once: std::sync::atomic::AtomicBool,
    pub source: std::sync::OnceLock<Arc<dyn ModelSource>>,
}

impl Registry {
    /// A registry whose default model is loading.
    pub fn new() -> Registry {
        let (_, loading) = watch::channel(false);
        Registry {
            slots: Mutex::new(vec![Slot {
                model: SourceModel {
                    name: String::new(),
                    aliases: Vec::new(),
                    key: String::new(),
                },
                state: SlotState::Loading(loading),
                is_default: true,
                last_used: Instant::now(),
                leases: 0,
            }]),
            default: Mutex::new(SourceModel {
                name: String::new(),
                aliases: Vec::new(),
                key: String::new(),
            }),
            default_ready_once: std::sync::atomic::AtomicBool::new(false),
            source: std::sync::OnceLock::new(),
        }
    }
}

/// A model found for a request: its engine and queue, held against unloading until dropped
/// (the scheduler's own count covers what was queued by then).
pub(crate) struct ModelLease {
    pub engine: Arc<dyn Engine>,
    pub scheduler: Arc<Scheduler>,
    /// The name to answer with: the one requested, or the model id when none was.
    pub name: String,
    state: Arc<AppState>,
    key: String,
}

impl Drop for ModelLease {
    fn drop(&mut self) {
        let mut slots = self.state.models.slots.lock();
        if let Some(slot) = slots.iter_mut().find(|s| s.model.key == self.key) {
            slot.leases = slot.leases.saturating_sub(1);
            slot.last_used = Instant::now();
        }
    }
}

/// One row of `/v1/models`.
pub(crate) struct ListedModel {
    pub id: String,
    pub loaded: bool,
}

/// Closes a removed slot's scheduler and frees its engine once the worker has stopped.
fn retire(slot: Slot, state: &AppState) {
    if let SlotState::Ready { engine, scheduler } = slot.state {
        scheduler.close();
        state.metrics.model_unloaded(&slot.model.name);
        tracing::info!(model = slot.model.name, "model unloaded");
        let spawned = std::thread::Builder::new()
            .name("gdsllm-unload".into())
            .spawn(move || {
                scheduler.join();
                drop(engine);
            });
        if let Err(err) = spawned {
            tracing::warn!("cannot start a thread to unload a model: {err}");
        }
    }
}

impl AppState {
    fn set_loaded_gauge(&self, slots: &[Slot]) {
        let loaded = slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Ready { .. }))
            .count();
        self.metrics.set_models_loaded(loaded);
    }

    /// `/health`: 503 while the default model first loads, after it failed, or in shutdown.
    pub fn health(&self) -> Result<(), ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let slots = self.models.slots.lock();
        match slots.iter().find(|s| s.is_default).map(|s| &s.state) {
            Some(SlotState::Failed(m)) => Err(ApiError::unavailable(format!(
                "the model failed to load: {m}"
            ))),
            _ if !self.models.default_ready_once.load(Ordering::SeqCst) => {
                Err(ApiError::unavailable("the model is loading"))
            }
            _ => Ok(()),
        }
    }

    /// The model `requested` names (the default when `None`), or 404 `model_not_found`.
    pub fn find_model(&self, requested: Option<&str>) -> Result<SourceModel, ApiError> {
        let default = self.models.default.lock().clone();
        let Some(name) = requested else {
            return Ok(default);
        };
        // A default whose name is not known yet (loading, no source) answers 503 as loading.
        if default.answers_to(name) || default.name.is_empty() {
            return Ok(default);
        }
        if let Some(slot) = self
            .models
            .slots
            .lock()
            .iter()
            .find(|s| s.model.answers_to(name))
        {
            return Ok(slot.model.clone());
        }
        if let Some(source) = self.models.source.get() {
            match source.find(name) {
                Ok(Some(found)) if found.key == default.key => return Ok(default),
                Ok(Some(found)) => return Ok(found),
                Ok(None) => {}
                Err(err) => {
                    return Err(ApiError::internal(format!(
                        "looking up model {name}: {err}"
                    )));
                }
            }
        }
        let names: Vec<String> = self.list_models().into_iter().map(|m| m.id).collect();
        Err(ApiError::model_not_found(name, &names))
    }

    /// Every model this server can serve: the default's names first, then the loaded ones,
    /// then the source's; each with whether it is loaded.
    pub(crate) fn list_models(&self) -> Vec<ListedModel> {
        let default = self.models.default.lock().clone();
        let source_models = match self.models.source.get().map(|s| s.list()) {
            Some(Ok(models)) => models,
            Some(Err(err)) => {
                tracing::warn!("listing the models the server can load: {err}");
                Vec::new()
            }
            None => Vec::new(),
        };
        let slots = self.models.slots.lock();
        let loaded = |key: &str| {
            slots
                .iter()
                .any(|s| s.model.key == key && matches!(s.state, SlotState::Ready { .. }))
        };
        let mut rows: Vec<ListedModel> = Vec::new();
        let mut add = |model: &SourceModel| {
            for id in std::iter::once(&model.name).chain(&model.aliases) {
                if !id.is_empty() && !rows.iter().any(|r| &r.id == id) {
                    rows.push(ListedModel {
                        id: id.clone(),
                        loaded: loaded(&model.key),
                    });
                }
            }
        };
        add(&default);
        for slot in slots.iter().filter(|s| !s.is_default) {
            add(&slot.model);
        }
        for model in &source_models {
            add(model);
        }
        rows
    }

    /// The model `requested` names, loaded (waiting for a load in progress, or starting one),
    /// held against unloading until the lease is dropped.
    pub(crate) async fn model(
        self: &Arc<Self>,
        requested: Option<&str>,
    ) -> Result<ModelLease, ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let model = self.find_model(requested)?;
        let name = requested.unwrap_or(&model.name).to_string();
        self.acquire(model, name).await
    }

    async fn acquire(
        self: &Arc<Self>,
        model: SourceModel,
        name: String,
    ) -> Result<ModelLease, ApiError> {
        let limit = self.config.model_load_timeout;
        let deadline = tokio::time::Instant::now() + limit;
        let mut waited = false;
        loop {
            let mut loading = {
                let mut slots = self.models.slots.lock();
                let found = slots.iter_mut().find(|s| s.model.key == model.key);
                match found {
                    Some(slot) => match &slot.state {
                        SlotState::Ready { engine, scheduler } => {
                            slot.leases += 1;
                            slot.last_used = Instant::now();
                            return Ok(ModelLease {
                                engine: engine.clone(),
                                scheduler: scheduler.clone(),
                                name,
                                state: self.clone(),
                                key: model.key,
                            });
                        }
                        SlotState::Loading(_)
                            if slot.is_default
                                && !self.models.default_ready_once.load(Ordering::SeqCst) =>
                        {
                            return Err(ApiError::unavailable("the model is loading"));
                        }
                        SlotState::Loading(rx) => rx.clone(),
                        SlotState::Failed(m) if waited || self.models.source.get().is_none() => {
                            return Err(ApiError::unavailable(format!(
                                "the model failed to load: {m}"
                            )));
                        }
                        // A failed load is tried again by the next request that names it.
                        SlotState::Failed(_) => self.start_load(&mut slots, &model)?,
                    },
                    None => self.start_load(&mut slots, &model)?,
                }
            };
            waited = true;
            match tokio::time::timeout_at(deadline, loading.changed()).await {
                // Ended (or the load's sender is gone): look at the slot again.
                Ok(_) => {}
                Err(_) => {
                    return Err(ApiError::unavailable(format!(
                        "model {} is still loading after {} s; retry later",
                        model.name,
                        limit.as_secs_f64()
                    )));
                }
            }
        }
    }

    /// Makes room (see the module's rules) and starts loading `model` on a blocking thread.
    fn start_load(
        self: &Arc<Self>,
        slots: &mut Vec<Slot>,
        model: &SourceModel,
    ) -> Result<watch::Receiver<bool>, ApiError> {
        let Some(source) = self.models.source.get().cloned() else {
            return Err(ApiError::unavailable(format!(
                "model {} is not loaded and this server cannot load models",
                model.name
            )));
        };
        slots.retain(|s| s.model.key != model.key);
        let occupied = slots.iter().filter(|s| s.occupies()).count();
        if occupied >= self.config.max_models {
            let victim = slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.occupies() && s.idle())
                .min_by_key(|(_, s)| s.last_used)
                .map(|(i, _)| i);
            let Some(victim) = victim else {
                self.metrics.rejected();
                return Err(ApiError::busy(format!(
                    "cannot load model {}: all {} loaded models are busy (--max-models); \
                     retry later",
                    model.name, self.config.max_models
                )));
            };
            let evicted = slots.remove(victim);
            tracing::info!(
                model = evicted.model.name,
                loading = model.name,
                "unloading the least recently used idle model to make room"
            );
            retire(evicted, self);
            self.set_loaded_gauge(slots);
        }
        let (done, loading) = watch::channel(false);
        let is_default = model.key == self.models.default.lock().key;
        slots.push(Slot {
            model: model.clone(),
            state: SlotState::Loading(loading.clone()),
            is_default,
            last_used: Instant::now(),
            leases: 0,
        });
        tracing::info!(model = model.name, "loading model on demand");
        let state = self.clone();
        let model = model.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let loaded = source.load(&model);
            match &loaded {
                Ok(_) => tracing::info!(
                    model = model.name,
                    seconds = started.elapsed().as_secs_f64(),
                    "model loaded"
                ),
                Err(err) => tracing::error!(model = model.name, "loading failed: {err}"),
            }
            state.finish_load(&model.key, loaded);
            let _ = done.send(true);
        });
        Ok(loading)
    }

    /// Names the default model (and its store aliases) and lets requests load other models
    /// from `source`.
    pub(crate) fn set_model_source(&self, source: Arc<dyn ModelSource>, default: SourceModel) {
        let mut aliases = self.config.aliases.clone();
        aliases.extend(default.aliases.iter().cloned());
        let default = SourceModel { aliases, ..default };
        for slot in self.models.slots.lock().iter_mut().filter(|s| s.is_default) {
            slot.model = default.clone();
        }
        *self.models.default.lock() = default;
        if self.models.source.set(source).is_err() {
            tracing::warn!("the server's model source is already set; keeping the first");
        }
    }

    /// The default model's load at start ended: ready with `engine`, or failed.
    pub(crate) fn finish_default_load(&self, loaded: Result<Arc<dyn Engine>, String>) {
        let key = {
            let mut default = self.models.default.lock();
            if default.name.is_empty()
                && let Ok(engine) = &loaded
            {
                default.name = engine.model_id().to_string();
                default.key = default.name.clone();
                default.aliases = self.config.aliases.clone();
            }
            default.clone()
        };
        {
            let mut slots = self.models.slots.lock();
            for slot in slots.iter_mut().filter(|s| s.is_default) {
                slot.model = key.clone();
            }
        }
        let ok = loaded.is_ok();
        self.finish_load(&key.key, loaded);
        if ok {
            self.models.default_ready_once.store(true, Ordering::SeqCst);
        }
    }

    /// Puts a finished load into its slot (if the slot is still waiting for it).
    pub(crate) fn finish_load(&self, key: &str, loaded: Result<Arc<dyn Engine>, String>) {
        let mut slots = self.models.slots.lock();
        let Some(slot) = slots
            .iter_mut()
            .find(|s| s.model.key == key && matches!(s.state, SlotState::Loading(_)))
        else {
            return;
        };
        match loaded {
            Ok(_) if self.shutting_down.load(Ordering::SeqCst) => {
                slot.state = SlotState::Failed("the server is shutting down".into());
            }
            Ok(engine) => {
                let scheduler = Arc::new(Scheduler::start(
                    engine.clone(),
                    self.metrics.for_model(&slot.model.name),
                    self.config.max_batch,
                    self.config.max_queue,
                ));
                self.metrics.model_loaded(&slot.model.name);
                slot.state = SlotState::Ready { engine, scheduler };
                slot.last_used = Instant::now();
            }
            Err(message) => slot.state = SlotState::Failed(message),
        }
        self.set_loaded_gauge(&slots);
    }

    /// `POST /v1/models/{name}/load`: loads the model (or finds it loaded) and waits for it.
    pub(crate) async fn load_model(self: &Arc<Self>, name: &str) -> Result<SourceModel, ApiError> {
        let lease = self.model(Some(name)).await?;
        let model = self.find_model(Some(name))?;
        drop(lease);
        Ok(model)
    }

    /// `POST /v1/models/{name}/unload`: `Ok(true)` when it was unloaded, `Ok(false)` when it
    /// was not loaded; 409 while it is busy or loading.
    pub(crate) fn unload_model(&self, name: &str) -> Result<(SourceModel, bool), ApiError> {
        let model = self.find_model(Some(name))?;
        let mut slots = self.models.slots.lock();
        let Some(index) = slots.iter().position(|s| s.model.key == model.key) else {
            return Ok((model, false));
        };
        let slot = &slots[index];
        if matches!(slot.state, SlotState::Loading(_)) {
            return Err(ApiError::conflict(format!(
                "model {name} is loading; unload it once it has loaded"
            )));
        }
        if !slot.idle() {
            return Err(ApiError::conflict(format!(
                "model {name} has requests in flight; retry once they are done"
            )));
        }
        if slot.is_default && self.models.source.get().is_none() {
            return Err(ApiError::conflict(format!(
                "model {name} is this server's only model and could not be loaded again"
            )));
        }
        let was_loaded = matches!(slot.state, SlotState::Ready { .. });
        let slot = slots.remove(index);
        retire(slot, self);
        self.set_loaded_gauge(&slots);
        Ok((model, was_loaded))
    }

    /// Unloads the models other than the default that have been idle for the idle timeout.
    pub(crate) fn unload_idle(&self, timeout: Duration) {
        let now = Instant::now();
        let mut slots = self.models.slots.lock();
        let mut expired = Vec::new();
        let mut i = 0;
        while i < slots.len() {
            let slot = &mut slots[i];
            if !slot.idle() {
                // A long stream counts as use until it ends.
                slot.last_used = now;
            }
            let due = !slot.is_default
                && matches!(slot.state, SlotState::Ready { .. })
                && slot.idle()
                && now.duration_since(slot.last_used) >= timeout;
            if due {
                expired.push(slots.remove(i));
            } else {
                i += 1;
            }
        }
        if expired.is_empty() {
            return;
        }
        self.set_loaded_gauge(&slots);
        drop(slots);
        for slot in expired {
            tracing::info!(model = slot.model.name, "idle for the idle timeout");
            retire(slot, self);
        }
    }

    /// `/api/ps`: every slot, the default first.
    pub(crate) fn slots_report(&self) -> Vec<serde_json::Value> {
        use serde_json::json;
        let tiers = |pairs: &[(&'static str, u64)]| -> serde_json::Map<String, serde_json::Value> {
            pairs
                .iter()
                .map(|(t, b)| (t.to_string(), json!(b)))
                .collect()
        };
        let slots = self.models.slots.lock();
        let mut order: Vec<&Slot> = slots.iter().collect();
        order.sort_by_key(|s| !s.is_default);
        order
            .into_iter()
            .map(|slot| {
                let mut row = match &slot.state {
                    SlotState::Loading(_) => json!({"state": "loading"}),
                    SlotState::Failed(message) => json!({"state": "failed", "error": message}),
                    SlotState::Ready { engine, scheduler } => {
                        let stats = engine.stats();
                        json!({
                            "state": "ready",
                            "model": engine.model_id(),
                            "context_length": engine.context_length(),
                            "held_bytes": tiers(&stats.held_by_tier),
                            "read_bytes": tiers(&stats.bytes_by_tier),
                            "passes": stats.passes,
                            "requests": scheduler.held(),
                            "idle_seconds": slot.last_used.elapsed().as_secs(),
                        })
                    }
                };
                if !slot.model.name.is_empty() {
                    row["model"] = json!(slot.model.name);
                }
                row
            })
            .collect()
    }

    /// Every loaded model's scheduler (for shutdown).
    pub(crate) fn schedulers(&self) -> Vec<Arc<Scheduler>> {
        self.models
            .slots
            .lock()
            .iter()
            .filter_map(|s| match &s.state {
                SlotState::Ready { scheduler, .. } => Some(scheduler.clone()),
                _ => None,
            })
            .collect()
    }
}

/// Runs [`AppState::unload_idle`] every fraction of `timeout` until the server shuts down.
pub(crate) async fn unload_idle_models(state: Arc<AppState>, timeout: Duration) {
    let tick = (timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !state.shutting_down.load(Ordering::SeqCst) {
        ticks.tick().await;
        state.unload_idle(timeout);
    }
}
