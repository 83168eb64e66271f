//! The error of every conversion step, shared by the source readers and the writer driver.

use std::path::{Path, PathBuf};

use weights_format::FormatError;

use crate::gguf::GgufError;
use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: neither a .gguf file nor a Hugging Face directory with config.json")]
    UnknownInput { path: PathBuf },
    #[error("{path}: missing config key {key}")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: config key {key}: {reason}")]
    BadKey {
        path: PathBuf,
        key: String,
        reason: String,
    },
    #[error("{path}: missing tensor {tensor}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor {tensor}: {reason}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("{path}: {reason}")]
    BadInput { path: PathBuf, reason: String },
    #[error("{path}: output exists (use --force to replace it)")]
    OutputExists { path: PathBuf },
}

impl ConvertError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> ConvertError {
        ConvertError::Io {
            path: path.to_path_buf(),
            error: source,
        }
    }
}
