//! An OpenAI-compatible HTTP API over the `llama` crate, used by `gdsllm serve`.
//!
//! This crate is for: the axum routes, request validation, streaming responses and metrics.
//!
//! It is not for: model execution or scheduling policy, which live in `llama`.
