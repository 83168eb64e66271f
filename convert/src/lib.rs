//! Getting models into the GdsLLM format.
//!
//! This crate is for: converting GGUF files and Hugging Face safetensors directories into the
//! format of `weights-format`, building `tokenizer.json` from GGUF metadata, writing synthetic
//! models of a given shape, and the local model store (`gdsllm pull`, `-m NAME`).
//!
//! It is not for: reading models at inference time (that is `weights-format` and `residency`).
//! It is shared by the `gdsllm` binary and `cargo xtask` so that both convert with the same code.

pub mod catalog;
pub mod convert;
pub mod error;
pub mod family;
pub mod gguf;
pub mod gguf_map;
pub mod gguf_writer;
pub mod hf;
pub mod lossless;
pub mod pull;
pub mod source;
pub mod store;
pub mod synth;
pub mod testing;
pub mod tokenizer;

pub use catalog::{DEFAULT_MODEL, KNOWN_MODELS, KnownModel, known_model};
pub use convert::{ConvertOptions, ConvertReport, NoProgress, Progress, TargetDType, convert};
pub use error::ConvertError;
pub use pull::{PullError, PullOptions, Pulled, ensure_default_model, pull};
pub use source::SourceModel;
pub use store::{StoreError, resolve_model};
