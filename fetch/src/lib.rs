//! HTTP(S) downloads of model files.
//!
//! This crate is for: fetching a file (or the rest of one) over HTTP with range requests,
//! resuming after an interruption, retrying what a retry can fix, and checking the length and
//! sha256 the server (or the user) gives; a blocking client (the one hf-hub's sync API uses),
//! because its callers are a command-line pull and residency's reader thread. The `testing`
//! feature adds a loopback server with a Hugging Face-style layout and fault injection.
//!
//! It is not for: knowing what a model is, where the store keeps it, or Hugging Face
//! repositories (`gdsllm-store`), nor when a blob is needed (`residency`).

mod client;
mod digest;
mod download;
mod error;
#[cfg(feature = "testing")]
pub mod testing;

pub use client::{Client, ClientOptions, ExpectedSize, Piece, RemoteFile, Sink, Transfer};
pub use digest::{git_blob_id, sha256_from_headers, sha256_hex};
pub use download::{
    DownloadOptions, Downloaded, NoProgress, Progress, download, fetch_into_file, partial_path,
    remove_partial, sha256_file,
};
pub use error::FetchError;
