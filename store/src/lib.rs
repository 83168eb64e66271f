//! The local model store.
//!
//! This crate is for: where models live on this machine (`$GDSLLM_HOME`) and under which
//! names (`qwen2.5:7b-q4_k_m`, [`index`]); getting them there (`gdsllm pull`: Hugging Face
//! repositories through hf-hub, GGUF files from any HTTP(S) server, local GGUF files, the
//! known models of [`catalog`]); finding them again for `-m` ([`resolve`]), converting or
//! pulling on first use; local caches of models served over HTTP ([`remote`]); `list`, `rm`,
//! `tag` and `show`.
//!
//! It is not for: converting (that is `gdsllm-convert`), HTTP transfers themselves
//! (`gdsllm-fetch`), or reading models at inference time (`weights-format`, `residency`, whose
//! network tier fetches a served model's blobs).

pub mod catalog;
mod error;
mod hf;
mod http;
pub mod index;
pub mod layout;
mod manage;
pub mod names;
mod pull;
mod pypi;
pub mod remote;
mod resolve;
pub mod spec;
pub mod summary;

pub use catalog::{DEFAULT_MODEL, KNOWN_MODELS, KnownModel, known_model};
pub use error::{ACCEPTED_FORMS, StoreError};
pub use hf::DEFAULT_QUANT;
pub use layout::{Store, gdsllm_home};
pub use manage::{Listed, Removed};
pub use pull::{PullOptions, PullProgress, Pulled, Quiet, pull};
pub use remote::RemoteModel;
pub use resolve::{Resolution, Resolved, resolve};
pub use spec::ModelSpec;
pub use summary::{ModelSummary, TierBytes, TypeCount, summarize};
