//! Getting models into the GdsLLM format.
//!
//! This crate is for: converting GGUF files and Hugging Face safetensors directories into the
//! format of `weights-format`, building `tokenizer.json` from GGUF metadata, writing synthetic
//! models of a given shape, and the local model store (`gdsllm pull`, `-m NAME`).
//!
//! It is not for: reading models at inference time (that is `weights-format` and `residency`).
//! It is shared by the `gdsllm` binary and `cargo xtask` so that both convert with the same code.

pub mod convert;
pub mod family;
pub mod gguf;
pub mod gguf_map;
pub mod gguf_writer;
pub mod hf;
pub mod lossless;
pub mod pull;
pub mod store;
pub mod synth;
pub mod testing;
pub mod tokenizer;

pub use convert::{
    ConvertError, ConvertOptions, ConvertReport, NoProgress, Progress, TargetDType, convert,
};
pub use pull::{PullError, PullOptions, Pulled, ensure_default_model, pull};
pub use store::{StoreError, resolve_model};
