use std::path::PathBuf;

use crate::DType;

/// Everything that can be wrong with a model directory, or go wrong while writing one.
///
/// Variants about a blob name the blob file (`layer_007.bin`); variants about a tensor name
/// the blob and the tensor, so a message always points at the place to look.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{}: line {line}, column {column}: {message}", path.display())]
    Json {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },

    #[error(
        "{}: format_version {found} is not supported (this build reads versions {} to {supported})",
        path.display(), crate::OLDEST_FORMAT_VERSION
    )]
    UnsupportedVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },

    #[error("metadata.json: config.{key}: {reason}")]
    Config { key: String, reason: String },

    #[error("{}: missing {what}", path.display())]
    MissingFile { path: PathBuf, what: String },

    #[error("{}: is {found}; model files must be regular files", path.display())]
    NotRegularFile { path: PathBuf, found: &'static str },

    #[error(
        "{}: a symlink to {}, outside the model directory (refused: every file a model names \
         must lie inside its directory)",
        path.display(),
        target.display()
    )]
    OutsideModelDir { path: PathBuf, target: PathBuf },

    #[error("{}: larger than the {limit}-byte limit for this file", path.display())]
    TooLarge { path: PathBuf, limit: u64 },

    #[error(
        "metadata.json was changed after it was written: metadata.json.xxh3 says {expected}, \
         the file hashes to {actual} (after a deliberate edit, run `gdsllm verify \
         --update-metadata-checksum MODEL`)"
    )]
    MetadataChanged { expected: String, actual: String },

    #[error("metadata.json: {field} {name:?} is not a plain file name inside the model directory")]
    BadFileName { field: String, name: String },

    #[error("{}: already exists (remove it first, or choose another output)", path.display())]
    OutputExists { path: PathBuf },

    #[error("metadata.json: blobs[{index}] is {found:?}, expected {expected:?}")]
    BlobOrder {
        index: usize,
        expected: String,
        found: String,
    },

    #[error(
        "metadata.json: {found} blobs listed, expected {expected} ({n_layers} layers + embed + output)"
    )]
    BlobCount {
        found: usize,
        expected: u64,
        n_layers: u32,
    },

    #[error("{blob}: file is {actual} bytes, metadata.json says {expected}")]
    BlobSize {
        blob: String,
        expected: u64,
        actual: u64,
    },

    #[error("{blob}: length {length} is not a multiple of {alignment}")]
    BlobUnaligned {
        blob: String,
        length: u64,
        alignment: u64,
    },

    #[error("{blob}: checksum {value:?} is not of the form \"xxh3:<16 lowercase hex digits>\"")]
    ChecksumSyntax { blob: String, value: String },

    #[error("{blob}: checksum mismatch: metadata.json says {expected}, file hashes to {actual}")]
    BadChecksum {
        blob: String,
        expected: String,
        actual: String,
    },

    #[error("{blob}: read only {read} of {expected} bytes while verifying")]
    ShortRead {
        blob: String,
        read: u64,
        expected: u64,
    },

    #[error("{} of {total} files (metadata.json and blobs) failed verification: {}", errors.len(), list(errors))]
    VerifyFailed {
        total: usize,
        errors: Vec<FormatError>,
    },

    #[error(
        "{blob}: tensor {tensor}: bytes {offset}..{offset}+{length} run past the blob's {blob_length} bytes"
    )]
    TensorOutOfBounds {
        blob: String,
        tensor: String,
        offset: u64,
        length: u64,
        blob_length: u64,
    },

    #[error("{blob}: tensor {tensor}: offset {offset} is not a multiple of {alignment}")]
    Misaligned {
        blob: String,
        tensor: String,
        offset: u64,
        alignment: u64,
    },

    #[error(
        "{blob}: tensor {tensor}: {dtype} {shape:?} needs {} bytes, metadata.json says {length}",
        expected.map(|e| e.to_string()).unwrap_or_else(|| "an impossible number of".into())
    )]
    SizeMismatch {
        blob: String,
        tensor: String,
        dtype: DType,
        shape: Vec<u64>,
        length: u64,
        /// `None` when the shape is not a whole number of blocks or overflows.
        expected: Option<u64>,
    },

    #[error("{blob}: tensors {tensor} and {other} overlap")]
    Overlap {
        blob: String,
        tensor: String,
        other: String,
    },

    #[error("{blob}: tensor {tensor} appears more than once")]
    DuplicateTensor { blob: String, tensor: String },

    #[error("{blob}: tensor {tensor} is missing")]
    MissingTensor { blob: String, tensor: String },

    #[error("{blob}: tensor {tensor} does not belong in this blob")]
    UnexpectedTensor { blob: String, tensor: String },

    #[error("{blob}: tensor {tensor}: shape {found:?}, the config implies {expected:?}")]
    WrongShape {
        blob: String,
        tensor: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },

    #[error("{blob}: tensor {tensor}: dtype {dtype} is not allowed here ({reason})")]
    DTypeNotAllowed {
        blob: String,
        tensor: String,
        dtype: DType,
        reason: &'static str,
    },

    #[error(
        "{blob}: tensor {tensor}: dtype {dtype} needs format_version {needed}, but metadata.json says {found}"
    )]
    DTypeNeedsVersion {
        blob: String,
        tensor: String,
        dtype: DType,
        needed: u32,
        found: u32,
    },

    #[error("{blob}: tensor {tensor}: {reason}")]
    TensorWrite {
        blob: String,
        tensor: String,
        reason: String,
    },

    #[error("writer: {reason}")]
    Writer { reason: String },
}

fn list(errors: &[FormatError]) -> String {
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

impl FormatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> FormatError {
        FormatError::Io {
            path: path.into(),
            source,
        }
    }

    /// The blob files this error is about (every failed blob for `VerifyFailed`).
    pub fn blobs(&self) -> Vec<&str> {
        match self {
            FormatError::VerifyFailed { errors, .. } => {
                errors.iter().flat_map(|e| e.blobs()).collect()
            }
            FormatError::BlobSize { blob, .. }
            | FormatError::BlobUnaligned { blob, .. }
            | FormatError::ChecksumSyntax { blob, .. }
            | FormatError::BadChecksum { blob, .. }
            | FormatError::ShortRead { blob, .. }
            | FormatError::TensorOutOfBounds { blob, .. }
            | FormatError::Misaligned { blob, .. }
            | FormatError::SizeMismatch { blob, .. }
            | FormatError::Overlap { blob, .. }
            | FormatError::DuplicateTensor { blob, .. }
            | FormatError::MissingTensor { blob, .. }
            | FormatError::UnexpectedTensor { blob, .. }
            | FormatError::WrongShape { blob, .. }
            | FormatError::DTypeNotAllowed { blob, .. }
            | FormatError::TensorWrite { blob, .. } => vec![blob.as_str()],
            FormatError::MetadataChanged { .. } => vec![crate::METADATA_FILE],
            FormatError::Io { path, .. }
            | FormatError::MissingFile { path, .. }
            | FormatError::NotRegularFile { path, .. }
            | FormatError::OutsideModelDir { path, .. }
            | FormatError::TooLarge { path, .. } => path
                .file_name()
                .and_then(|n| n.to_str())
                .into_iter()
                .collect(),
            _ => Vec::new(),
        }
    }
}
