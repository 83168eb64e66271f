//! An OpenAI-compatible HTTP API over the `llama` crate, used by `gdsllm serve`.
//!
//! This crate is for: the axum routes, request validation, streaming responses, the bounded
//! request queue in front of each model's worker thread, the registry of loaded models
//! ([`models`]: several models in one server, loaded on demand), connection limits and
//! timeouts, auth and metrics. It talks to the model only
//! through the narrow [`Engine`] trait; [`llama_engine`] adapts the `llama` crate to it.
//!
//! It is not for: model execution or sampling (those live in `llama`), nor deciding where
//! weights live (that is `residency`).

mod connections;
pub mod cors;
pub mod engine;
mod error;
pub mod grpc;
pub mod llama_engine;
pub mod metrics;
pub mod models;
pub mod params;
mod routes;
pub mod scheduler;
mod server;
mod state;
pub mod tools;
mod ws;

pub use engine::{
    CacheUsage, CancelToken, ChatMessage, Engine, EngineBatch, EngineError, EngineFinish,
    EngineStats, GeneratedToken, GenerationRequest, GrammarSpec, ModelMemory, SamplingParams,
    TierBytes, TokenLogprob,
};
pub use error::{ApiError, ServerError};
pub use llama_engine::{LlamaEngine, open, open_serving};
pub use models::{MemoryNeed, ModelSource, SourceModel};
pub use server::{Server, load_api_key_file, shutdown_signal};
pub use state::{MemoryBudget, ServerConfig};
