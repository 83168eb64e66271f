//! What a transfer can fail with. Every message names the URL (or the file) and says what to
//! do next where there is something to do.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{url}: not an http:// or https:// URL ({reason})")]
    BadUrl { url: String, reason: String },
    #[error("{url}: cannot reach the server: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url}: the server closed the connection without answering ({reason})")]
    Disconnected { url: String, reason: String },
    #[error("{url}: not found (HTTP 404)")]
    NotFound { url: String },
    #[error(
        "{url}: access refused (HTTP {status}); a private or gated Hugging Face repository needs \
         a token in HF_TOKEN"
    )]
    Unauthorized { url: String, status: u16 },
    #[error("{url}: the server answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error(
        "{url}: the server ignored the Range request for bytes {offset}- (it answered with the \
         whole file), and the transfer dropped again; it cannot be resumed from this server"
    )]
    RangeIgnored { url: String, offset: u64 },
    #[error(
        "{url}: the server answered a request for bytes {asked}- with bytes {got}- (Content-Range \
         {content_range:?})"
    )]
    WrongRange {
        url: String,
        asked: u64,
        got: u64,
        content_range: String,
    },
    #[error(
        "{url}: the transfer ended after {received} of {expected} bytes ({reason}); run the same \
         command again to resume"
    )]
    Truncated {
        url: String,
        received: u64,
        expected: u64,
        reason: String,
    },
    #[error("{url}: the server sent {received} bytes, more than the {expected} it announced")]
    TooLong {
        url: String,
        received: u64,
        expected: u64,
    },
    #[error("{url}: the file is {actual} bytes, but {expected} were expected ({source_of_size})")]
    WrongSize {
        url: String,
        expected: u64,
        actual: u64,
        /// Who said `expected` (e.g. "the repository's file list").
        source_of_size: String,
    },
    #[error(
        "{url}: {algorithm} is {actual}, expected {expected} (from {source_of_checksum}); the \
         download was removed"
    )]
    Checksum {
        url: String,
        algorithm: &'static str,
        expected: String,
        actual: String,
        source_of_checksum: String,
    },
    #[error(
        "{path}: no space left on the device after {written} bytes; the partial download was \
         removed (free space, or point GDSLLM_HOME / HF_HOME at a larger disk)"
    )]
    DiskFull { path: PathBuf, written: u64 },
    #[error("{url}: {reason}")]
    BadResponse { url: String, reason: String },
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
}

impl FetchError {
    pub(crate) fn io(path: &std::path::Path, error: std::io::Error) -> FetchError {
        FetchError::Io {
            path: path.to_path_buf(),
            error,
        }
    }

    /// Whether trying the same transfer again may succeed (a connection that dropped or stalled
    /// mid-transfer, a busy server), as opposed to an answer that will not change (404, a
    /// checksum mismatch, a full disk) or a server that cannot be reached at all.
    pub fn is_transient(&self) -> bool {
        match self {
            FetchError::Truncated { .. } | FetchError::Disconnected { .. } => true,
            FetchError::Status { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }
}
