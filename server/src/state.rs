//! The application state every handler shares: the server's settings, the registry of model
//! slots (each loading, ready with its scheduler, or failed: [`crate::models`]), metrics and
//! the shutdown flag. Both the router
//! (`server`) and the handlers (`routes`) use it; neither imports the other's internals.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::engine::{ChatMessage, Engine};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::models::{Registry, SlotState};
use crate::scheduler::Scheduler;

/// Settings of one server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// With any key here, `/v1/*` needs `Authorization: Bearer <key>`.
    pub api_keys: Vec<String>,
    /// Extra names the model answers to (the first is listed first in `/v1/models`).
    pub aliases: Vec<String>,
    /// Inserted as the first message of a chat that has no system message.
    pub system_prompt: Option<String>,
    /// Per model (by its id or one of its aliases): the system prompt for chats that name it
    /// and have no system message, in place of `system_prompt`.
    pub model_system_prompts: Vec<(String, String)>,
    /// Browser origins allowed to call the API (CORS); `None`: no CORS headers, and browsers
    /// on other origins are refused by their own same-origin rule.
    pub cors_origins: Option<crate::cors::CorsOrigins>,
    /// The most sequences decoded together (continuous batching, when the engine has it;
    /// otherwise sequences run one at a time in arrival order).
    pub max_batch: usize,
    /// Largest request body in bytes (413 above it).
    pub body_limit: usize,
    /// After SIGINT/SIGTERM, in-flight requests may finish for this long; then they are
    /// cancelled.
    pub shutdown_grace: Duration,
    /// Requests that may wait for the model beyond the `max_batch` it runs; more get 429 with
    /// `Retry-After` at once instead of an ever longer queue.
    pub max_queue: usize,
    /// Open client connections. At the limit a new connection closes the oldest one that has
    /// no request in flight (a half-open or idle socket); if every one is busy, the new one is
    /// closed. Kept below the process's open-file limit.
    pub max_connections: usize,
    /// A client must send a request's headers within this long (and, between requests on a
    /// kept-alive connection, start the next one), or the connection is closed.
    pub header_read_timeout: Duration,
    /// A client must send a request's whole body within this long (408 otherwise).
    pub body_read_timeout: Duration,
    /// Models loaded (or loading) at once; loading one more first unloads the least recently
    /// used idle one ([`crate::models`]).
    pub max_models: usize,
    /// A model other than the default, idle this long, is unloaded; `None`: never.
    pub model_idle_timeout: Option<Duration>,
    /// A request for a model that is loading waits this long for it (503 after).
    pub model_load_timeout: Duration,
    /// The memory every loaded model together may hold (`--vram-budget`, `--host-cache`);
    /// `None`: no server-wide budget (each model sizes itself).
    pub memory_budget: Option<MemoryBudget>,
}

/// The server-wide memory budgets per tier; a tier's `None` is `auto`: the budget the first
/// (default) model was planned with at its load ([`crate::ModelMemory::budget`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryBudget {
    pub device: Option<u64>,
    pub host: Option<u64>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_keys: Vec::new(),
            aliases: Vec::new(),
            system_prompt: None,
            model_system_prompts: Vec::new(),
            cors_origins: None,
            max_batch: 1,
            body_limit: 4 << 20,
            shutdown_grace: Duration::from_secs(30),
            max_queue: 256,
            max_connections: 1024,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_models: 3,
            model_idle_timeout: Some(Duration::from_secs(300)),
            model_load_timeout: Duration::from_secs(600),
            memory_budget: None,
        }
    }
}

pub(crate) struct AppState {
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    pub models: Registry,
    pub shutting_down: AtomicBool,
    pub started: u64,
}

impl AppState {
    /// The default model's engine and queue (the WebSocket and gRPC transports serve the
    /// default model only), or 503 while it loads / after a failed load / while it is
    /// unloaded / in shutdown.
    pub fn ready(&self) -> Result<(Arc<dyn Engine>, Arc<Scheduler>), ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let slots = self.models.slots.lock();
        match slots.iter().find(|s| s.is_default).map(|s| &s.state) {
            Some(SlotState::Loading(_)) => Err(ApiError::unavailable("the model is loading")),
            Some(SlotState::Failed(m)) => Err(ApiError::unavailable(format!(
                "the model failed to load: {m}"
            ))),
            Some(SlotState::Ready { engine, scheduler }) => Ok((engine.clone(), scheduler.clone())),
            None => Err(ApiError::unavailable(
                "the default model is unloaded; a REST request (or POST /v1/models/{name}/load) \
                 loads it again",
            )),
        }
    }

    /// The system prompt for a chat addressed to `requested` (a name the model answers to) of
    /// the model `engine_id`: that name's own, else the model id's, else the server's.
    pub fn system_prompt_for(&self, requested: &str, engine_id: &str) -> Option<&str> {
        let own = |name: &str| {
            self.config
                .model_system_prompts
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, p)| p.as_str())
        };
        own(requested)
            .or_else(|| own(engine_id))
            .or(self.config.system_prompt.as_deref())
    }

    /// `messages` with the system prompt for `requested` of model `engine_id`
    /// ([`system_prompt_for`](Self::system_prompt_for)) first when they have no system message.
    pub fn with_system_prompt(
        &self,
        requested: &str,
        engine_id: &str,
        mut messages: Vec<ChatMessage>,
    ) -> Vec<ChatMessage> {
        if let Some(system) = self.system_prompt_for(requested, engine_id)
            && !messages.iter().any(|m| m.role == "system")
        {
            messages.insert(0, ChatMessage::new("system", system));
        }
        messages
    }

    /// Names the default model answers to: its id, then the aliases.
    pub fn model_names(&self, engine: &dyn Engine) -> Vec<String> {
        let mut names = vec![engine.model_id().to_string()];
        names.extend(self.config.aliases.iter().cloned());
        names
    }
}
