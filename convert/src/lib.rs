//! Getting models into the GdsLLM format.
//!
//! This crate is for: converting GGUF files and Hugging Face safetensors directories into the
//! format of `weights-format`, building `tokenizer.json` from GGUF metadata, and writing
//! synthetic models of a given shape.
//!
//! It is not for: reading models at inference time (that is `weights-format` and `residency`),
//! nor getting them from elsewhere and keeping them (the model store, `gdsllm-store`). It is
//! shared by the `gdsllm` binary and `cargo xtask` so that both convert with the same code.

pub mod convert;
pub mod error;
pub mod family;
pub mod gguf;
pub mod gguf_map;
pub mod gguf_writer;
pub mod hf;
pub mod lossless;
pub mod source;
pub mod synth;
pub mod testing;
pub mod tokenizer;

pub use convert::{ConvertOptions, ConvertReport, NoProgress, Progress, TargetDType, convert};
pub use error::ConvertError;
pub use source::SourceModel;
