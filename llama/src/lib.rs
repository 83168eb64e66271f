//! LLaMA-family language models.
//!
//! This crate is for: the model config, tokenizer and chat template, sampling, the KV cache and
//! the forward pass over a narrow `Backend` trait, with a CPU implementation always built and a
//! CUDA one behind the `cuda` feature.
//!
//! It is not for: deciding where weights live or when they are read (that is `residency`), nor
//! HTTP (that is `server`).
