//! LLaMA-family language models.
//!
//! This crate is for: the model config, tokenizer and chat template, sampling, the KV cache,
//! continuous batching and the forward pass over a narrow `Backend` trait, with a CPU
//! implementation always built and a CUDA one behind the `cuda` feature (kernels compiled at
//! run time by NVRTC; a build with the feature runs without a GPU and reports why CUDA is
//! unusable), and [`open`], which makes a model of a directory on either.
//!
//! Layers, bottom to top (each uses only those below it; `ARCHITECTURE.md` has the map):
//! [`weights`] → [`backend`] → [`model`] → [`generate`] → [`batch`] → [`load`].
//!
//! It is not for: deciding where weights live or when they are read (that is `residency`), nor
//! HTTP (that is `server`).

pub mod backend;
pub mod batch;
pub mod chat;
pub mod config;
mod error;
pub mod generate;
pub mod grammar;
pub mod hybrid;
pub mod load;
pub mod model;
pub mod prefix_cache;
pub mod sampling;
pub mod stop;
pub mod tokenizer;
pub mod weights;

pub use backend::{
    AttentionSeq, Backend, BackendError, CpuBackend, KvStoreSeq, PassInfo, ReferenceBackend,
    RowGroup,
};
#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, DeviceWeights};
pub use batch::{BatchConfig, Batcher, Choosing, Finished, SeqEnd, SeqId, generate_batch};
pub use chat::{ChatTemplate, ChatValue, Message};
pub use config::{LlamaConfig, clamp_context, rope_inv_freq};
pub use error::LlamaError;
pub use generate::{
    FinishReason, GenerateOptions, Generation, Logprobs, Penalties, SeqStep, Session, Step,
};
pub use grammar::{Constraint, GrammarCompiler, GrammarSpec};
#[cfg(feature = "cuda")]
pub use load::CudaModel;
pub use load::{CpuModel, Device, LoadedModel, OpenOptions, OpenedModel, open};
pub use model::{BatchSeq, KvCache, Llama};
pub use prefix_cache::{PREFIX_BLOCK, PrefixCache, PrefixCacheStats};
pub use sampling::{Sampler, SamplerConfig, Scores};
pub use stop::{StopMatcher, StopOutcome};
pub use tokenizer::{StreamDecoder, Tokenizer};
pub use weights::{BlobBytes, DevicePtr, InMemoryWeights, WeightBytes, WeightSource, WeightView};
