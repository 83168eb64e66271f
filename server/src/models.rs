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
//!
//! Memory (with [`ServerConfig::memory_budget`](crate::ServerConfig), the CLI's
//! `--vram-budget` and `--host-cache`): the budgets are the whole server's, across models.
//! Each slot holds bytes per tier ([`TierBytes`]): a loading model what it was given to load
//! with, a loaded one what its engine reports ([`Engine::memory`]: resident weights, staging
//! ring, KV caches and scratch on the device; its host tier); the registry keeps the sum.
//! `auto` budgets are what the default model was planned with at its first load (the free
//! device memory, or the share of RAM, then); until that load ends no other model loads
//! (503), as what the default takes is not known before. Loading a model:
//! - The source says what it needs for the whole budget ([`MemoryNeed`]): `full`, what it
//!   would take with the whole budget to itself (capped by what it needs to be fully
//!   resident), and `minimum`, the smallest plan residency accepts (everything streamed
//!   through the staging ring, no host tier).
//! - Idle models are unloaded, least recently used first, until `full` fits in what is left
//!   (and the count is below `max_models`): a model is not started smaller than it would be
//!   alone while idle models hold the memory. With only busy models left and `full` still not
//!   fitting, it loads with what is left if that is at least `minimum` (it streams more);
//!   otherwise nothing is unloaded and the request gets 429 with `Retry-After` naming the
//!   budget (an operator's load gets 409). A model whose `minimum` exceeds the whole budget
//!   gets 503.
//! - It loads with `min(left, full)` per tier as its budget.
//! - An unloaded model's memory counts as held until its engine is dropped (its worker
//!   stopped and every handle gone): loads wait for that before they start, so that a model
//!   evicted for memory has freed it before the next takes it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use residency::human_bytes;
use tokio::sync::watch;

use crate::engine::{Engine, TierBytes};
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

/// What a model needs of the server's memory budgets (see the module's rules).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryNeed {
    /// What it would hold with the whole budget to itself, at most what it needs to be fully
    /// resident.
    pub full: TierBytes,
    /// The least it can run with (everything streamed).
    pub minimum: TierBytes,
}

/// Where models other than the default come from (the CLI implements it over the store).
/// Errors are messages: they go to the client (503) and the log.
pub trait ModelSource: Send + Sync {
    /// Every model that could be loaded, for `/v1/models`.
    fn list(&self) -> Result<Vec<SourceModel>, String>;
    /// The model `name` names, or `None` when there is none by that name.
    fn find(&self, name: &str) -> Result<Option<SourceModel>, String>;
    /// What `model` needs out of the server's whole `budget`; `None`: not known (it is then
    /// given all that is left).
    fn memory_need(
        &self,
        model: &SourceModel,
        budget: TierBytes,
    ) -> Result<Option<MemoryNeed>, String> {
        let _ = (model, budget);
        Ok(None)
    }
    /// Loads `model` (blocking; called on a blocking thread) within `budget` per tier, the
    /// memory left for it; `None`: the server has no budget (the model sizes itself).
    fn load(
        &self,
        model: &SourceModel,
        budget: Option<TierBytes>,
    ) -> Result<Arc<dyn Engine>, String>;
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
    /// Memory it holds per tier: while loading, its budget; once loaded, what its engine
    /// reports (or still its budget when the engine does not say).
    pub held: TierBytes,
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

/// Memory of unloaded models whose engines are still being dropped.
#[derive(Default)]
pub(crate) struct Freeing {
    bytes: Mutex<TierBytes>,
    freed: Condvar,
}

impl Freeing {
    fn add(&self, bytes: TierBytes) {
        let mut held = self.bytes.lock();
        *held = held.saturating_add(bytes);
    }

    fn done(&self, bytes: TierBytes) {
        let mut held = self.bytes.lock();
        *held = held.saturating_sub(bytes);
        self.freed.notify_all();
    }

    pub fn held(&self) -> TierBytes {
        *self.bytes.lock()
    }

    /// Waits until every unloaded engine is gone, or `deadline`; false at the deadline.
    fn wait(&self, deadline: Instant) -> bool {
        let mut held = self.bytes.lock();
        while *held != TierBytes::default() {
            if self.freed.wait_until(&mut held, deadline).timed_out() {
                return false;
            }
        }
        true
    }
}

/// The server's budgets across models, as far as they are known.
enum Budget {
    /// No server-wide budget.
    Unlimited,
    /// `auto`: known once the default model's first load ends.
    Pending,
    Known(TierBytes),
}

/// The slots and the default model's identity.
pub(crate) struct Registry {
    pub slots: Mutex<Vec<Slot>>,
    /// The default model: its names (id, then `--alias`es, then its store aliases) and key.
    pub default: Mutex<SourceModel>,
    /// Set once the default model's first load ended well.
    pub default_ready_once: std::sync::atomic::AtomicBool,
    pub source: std::sync::OnceLock<Arc<dyn ModelSource>>,
    /// The budgets once `auto` is resolved (set at start when both are given in bytes).
    pub budget: Mutex<Option<TierBytes>>,
    pub freeing: Arc<Freeing>,
}

impl Registry {
    /// A registry whose default model is loading, with `budget`.
    pub fn new(budget: Option<crate::MemoryBudget>) -> Registry {
        let known = budget.and_then(|b| Some(TierBytes::new(b.device?, b.host?)));
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
                held: TierBytes::default(),
            }]),
            default: Mutex::new(SourceModel {
                name: String::new(),
                aliases: Vec::new(),
                key: String::new(),
            }),
            default_ready_once: std::sync::atomic::AtomicBool::new(false),
            source: std::sync::OnceLock::new(),
            budget: Mutex::new(known),
            freeing: Arc::new(Freeing::default()),
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
    /// What it holds per tier, when loaded.
    pub held: Option<TierBytes>,
}

/// How long an unloaded engine may take to be dropped before its memory counts as free
/// anyway (a handle kept somewhere it should not be; logged).
const FREE_TIMEOUT: Duration = Duration::from_secs(60);

/// Closes a removed slot's scheduler and frees its engine once the worker has stopped and the
/// last handle on it is gone; its memory counts as held ([`Freeing`]) until then. `reason`
/// labels the eviction counter.
fn retire(slot: Slot, state: &AppState, reason: &'static str) {
    if let SlotState::Ready { engine, scheduler } = slot.state {
        scheduler.close();
        state.metrics.model_unloaded(&slot.model.name);
        state
            .metrics
            .set_model_memory(&slot.model.name, TierBytes::default());
        state.metrics.model_evicted(reason);
        tracing::info!(model = slot.model.name, reason, "model unloaded");
        let held = slot.held;
        let freeing = state.models.freeing.clone();
        freeing.add(held);
        let name = slot.model.name;
        let spawned = std::thread::Builder::new()
            .name("gdsllm-unload".into())
            .spawn({
                let freeing = freeing.clone();
                move || {
                    scheduler.join();
                    drop(scheduler);
                    let deadline = Instant::now() + FREE_TIMEOUT;
                    while Arc::strong_count(&engine) > 1 && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    if Arc::strong_count(&engine) > 1 {
                        tracing::warn!(
                            model = name,
                            "the unloaded model is still referenced after {} s; counting its \
                             memory as free",
                            FREE_TIMEOUT.as_secs()
                        );
                    }
                    drop(engine);
                    freeing.done(held);
                }
            });
        if let Err(err) = spawned {
            tracing::warn!("cannot start a thread to unload a model: {err}");
            freeing.done(held);
        }
    }
}

fn describe(bytes: TierBytes) -> String {
    format!(
        "{} of device memory and {} of host tier",
        human_bytes(bytes.device),
        human_bytes(bytes.host)
    )
}

impl AppState {
    fn set_loaded_gauge(&self, slots: &[Slot]) {
        let loaded = slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Ready { .. }))
            .count();
        self.metrics.set_models_loaded(loaded);
        self.metrics
            .set_memory(self.held_total(slots), *self.models.budget.lock());
    }

    /// What the models hold together, the unloaded ones still being freed included.
    fn held_total(&self, slots: &[Slot]) -> TierBytes {
        slots.iter().fold(self.models.freeing.held(), |sum, s| {
            sum.saturating_add(s.held)
        })
    }

    fn budget(&self) -> Budget {
        if self.config.memory_budget.is_none() {
            return Budget::Unlimited;
        }
        // Until the default model has loaded, what it holds is not known.
        if !self.models.default_ready_once.load(Ordering::SeqCst) {
            return Budget::Pending;
        }
        match *self.models.budget.lock() {
            Some(known) => Budget::Known(known),
            None => Budget::Pending,
        }
    }

    /// The memory the models hold together (unloaded ones still being freed included) against
    /// the budgets (`null` until `auto` is known), for `/v1/models` and `/api/ps`; `None` when
    /// the server has no budget.
    pub(crate) fn memory_report(&self) -> Option<serde_json::Value> {
        use serde_json::json;
        self.config.memory_budget?;
        let tiers = |b: TierBytes| json!({"device": b.device, "host": b.host});
        let held = self.held_total(&self.models.slots.lock());
        let budget = match self.budget() {
            Budget::Known(b) => tiers(b),
            Budget::Unlimited | Budget::Pending => serde_json::Value::Null,
        };
        Some(json!({"held_bytes": tiers(held), "budget_bytes": budget}))
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
        let held = |key: &str| {
            slots
                .iter()
                .find(|s| s.model.key == key && matches!(s.state, SlotState::Ready { .. }))
                .map(|s| s.held)
        };
        let mut rows: Vec<ListedModel> = Vec::new();
        let mut add = |model: &SourceModel| {
            for id in std::iter::once(&model.name).chain(&model.aliases) {
                if !id.is_empty() && !rows.iter().any(|r| &r.id == id) {
                    let held = held(&model.key);
                    rows.push(ListedModel {
                        id: id.clone(),
                        loaded: held.is_some(),
                        held,
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
        let budget = match self.budget() {
            Budget::Unlimited => None,
            Budget::Pending => {
                return Err(ApiError::unavailable(format!(
                    "cannot load model {} yet: the default model is still loading, and what it \
                     takes of the memory budget is known once it has loaded; retry later",
                    model.name
                )));
            }
            Budget::Known(budget) => Some(budget),
        };
        let whole = budget.unwrap_or(TierBytes::new(u64::MAX, u64::MAX));
        let need = match budget {
            Some(budget) => source.memory_need(model, budget).map_err(|err| {
                ApiError::unavailable(format!("cannot load model {}: {err}", model.name))
            })?,
            None => None,
        };
        if let Some(need) = need
            && !need.minimum.fits_in(whole)
        {
            return Err(ApiError::unavailable(format!(
                "model {} needs at least {}, more than the server's whole memory budget ({}; \
                 --vram-budget, --host-cache)",
                model.name,
                describe(need.minimum),
                describe(whole)
            )));
        }
        // What it would have alone; with no need known, everything left.
        let wanted = need.map_or(whole, |n| {
            TierBytes::new(
                n.full.device.max(n.minimum.device),
                n.full.host.max(n.minimum.host),
            )
            .min(whole)
        });
        let minimum = need.map_or(TierBytes::default(), |n| n.minimum);

        // Unload idle models, least recently used first, until the count allows one more and
        // what it would have alone fits; decide first, unload only if it then loads.
        let occupied = slots.iter().filter(|s| s.occupies()).count();
        let held = slots
            .iter()
            .filter(|s| s.occupies())
            .fold(TierBytes::default(), |sum, s| sum.saturating_add(s.held));
        let mut idle: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].occupies() && slots[i].idle())
            .collect();
        idle.sort_by_key(|&i| slots[i].last_used);
        let mut idle = idle.into_iter();
        let mut evict: Vec<(usize, &'static str)> = Vec::new();
        let mut freed = TierBytes::default();
        let left = |freed: TierBytes| whole.saturating_sub(held.saturating_sub(freed));
        loop {
            let count_ok = occupied - evict.len() < self.config.max_models;
            // With no need known, any memory left will do.
            let memory_ok = match need {
                Some(_) => wanted.fits_in(left(freed)),
                None => true,
            };
            if count_ok && memory_ok {
                break;
            }
            let Some(victim) = idle.next() else { break };
            evict.push((victim, if count_ok { "memory" } else { "count" }));
            freed = freed.saturating_add(slots[victim].held);
        }
        if occupied - evict.len() >= self.config.max_models {
            self.metrics.rejected();
            return Err(ApiError::busy(format!(
                "cannot load model {}: all {} loaded models are busy (--max-models); \
                 retry later",
                model.name, self.config.max_models
            )));
        }
        let left = left(freed);
        if !minimum.fits_in(left) {
            self.metrics.rejected();
            return Err(ApiError::busy(format!(
                "cannot load model {}: it needs at least {}, and the busy models hold {} of \
                 the server's memory budget ({}; --vram-budget, --host-cache); retry later",
                model.name,
                describe(minimum),
                describe(held.saturating_sub(freed)),
                describe(whole)
            )));
        }
        evict.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (victim, reason) in evict {
            let evicted = slots.remove(victim);
            tracing::info!(
                model = evicted.model.name,
                loading = model.name,
                reason,
                "unloading the least recently used idle model to make room"
            );
            retire(evicted, self, reason);
        }
        let granted = budget.map(|_| left.min(wanted));
        let (done, loading) = watch::channel(false);
        let is_default = model.key == self.models.default.lock().key;
        slots.push(Slot {
            model: model.clone(),
            state: SlotState::Loading(loading.clone()),
            is_default,
            last_used: Instant::now(),
            leases: 0,
            held: granted.unwrap_or_default(),
        });
        self.set_loaded_gauge(slots);
        tracing::info!(
            model = model.name,
            budget = granted.map(describe),
            "loading model on demand"
        );
        let state = self.clone();
        let model = model.clone();
        tokio::task::spawn_blocking(move || {
            // The memory of models unloaded to make room is free only once their engines
            // are gone.
            let deadline = Instant::now() + state.config.model_load_timeout;
            if !state.models.freeing.wait(deadline) {
                tracing::warn!(
                    model = model.name,
                    "unloaded models still hold memory; loading anyway"
                );
            }
            let started = Instant::now();
            let loaded = source.load(&model, granted);
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
        if let (Some(configured), Ok(engine)) = (self.config.memory_budget, &loaded) {
            let mut budget = self.models.budget.lock();
            if budget.is_none() {
                // `auto`: what the default model was planned with; a tier it does not report
                // is not limited.
                let planned = engine.memory().map(|m| m.budget);
                let resolved = TierBytes::new(
                    configured
                        .device
                        .or(planned.map(|b| b.device))
                        .unwrap_or(u64::MAX),
                    configured
                        .host
                        .or(planned.map(|b| b.host))
                        .unwrap_or(u64::MAX),
                );
                tracing::info!(
                    device = resolved.device,
                    host = resolved.host,
                    "the server's memory budget across models"
                );
                *budget = Some(resolved);
            }
        }
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
                if let Some(memory) = engine.memory() {
                    slot.held = memory.held;
                }
                self.metrics.set_model_memory(&slot.model.name, slot.held);
                slot.state = SlotState::Ready { engine, scheduler };
                slot.last_used = Instant::now();
            }
            Err(message) => {
                slot.state = SlotState::Failed(message);
                slot.held = TierBytes::default();
            }
        }
        self.set_loaded_gauge(&slots);
    }

    /// `POST /v1/models/{name}/load`: loads the model (or finds it loaded) and waits for it;
    /// 409 where a request would get 429 (the models that hold the memory are busy).
    pub(crate) async fn load_model(self: &Arc<Self>, name: &str) -> Result<SourceModel, ApiError> {
        let lease = self.model(Some(name)).await.map_err(|err| {
            if err.status == axum::http::StatusCode::TOO_MANY_REQUESTS {
                ApiError::conflict(err.message)
            } else {
                err
            }
        })?;
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
        retire(slot, self, "operator");
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
        drop(slots);
        for slot in expired {
            tracing::info!(model = slot.model.name, "idle for the idle timeout");
            retire(slot, self, "idle_timeout");
        }
        self.set_loaded_gauge(&self.models.slots.lock());
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
                if matches!(slot.state, SlotState::Ready { .. }) {
                    row["memory_bytes"] =
                        json!({"device": slot.held.device, "host": slot.held.host});
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
