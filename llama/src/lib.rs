//! LLaMA-family language models.
//!
//! This crate is for: the model config, tokenizer and chat template, sampling, the KV cache,
//! continuous batching and the forward pass over a narrow `Backend` trait, with a CPU
//! implementation always built and a CUDA one behind the `cuda` feature (kernels compiled at
//! run time by NVRTC; a build with the feature runs without a GPU and reports why CUDA is
//! unusable).
//!
//! It is not for: deciding where weights live or when they are read (that is `residency`), nor
//! HTTP (that is `server`).

pub mod backend;
pub mod batch;
pub mod chat;
pub mod config;
mod error;
pub mod generate;
mod load;
pub mod model;
pub mod sampling;
pub mod tokenizer;
pub mod weights;

pub use backend::{AttentionSeq, Backend, CpuBackend, ReferenceBackend, RowGroup, WeightView};
#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, DeviceWeights};
pub use batch::{BatchConfig, Batcher, Finished, SeqEnd, SeqId, generate_batch};
pub use chat::{ChatTemplate, ChatValue, Message};
pub use config::LlamaConfig;
pub use error::LlamaError;
pub use generate::{FinishReason, GenerateOptions, Generation, Session};
pub use load::{CpuModel, LoadedModel, load_cpu, load_cpu_rows};
pub use model::{BatchSeq, KvCache, Llama};
pub use sampling::{Sampler, SamplerConfig};
pub use tokenizer::{StreamDecoder, Tokenizer};
pub use weights::{BlobBytes, BlobLayout, InMemoryWeights, WeightSource};
