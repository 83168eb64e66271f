//! The cache of layer blobs in device memory.
//!
//! This crate is for: planning which blobs stay resident for the whole run and which stream
//! through a ring of staging slots, prefetching in layer order, the optional pinned host tier,
//! and the statistics of all of it.
//!
//! It is not for: doing the reads themselves (that is `gds-io`) or interpreting tensors
//! (that is `llama`).
