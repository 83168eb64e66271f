use std::path::PathBuf;

/// Everything that can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum LlamaError {
    #[error("model config: {setting}: {message}")]
    Config {
        setting: &'static str,
        message: String,
    },
    #[error("{blob}: tensor `{name}` is missing")]
    MissingTensor { blob: String, name: String },
    #[error("{blob}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        blob: String,
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error(
        "{blob}: tensor `{name}` (offset {offset}, {length} bytes of {dtype}) does not fit the \
         {blob_len}-byte blob or its shape"
    )]
    TensorBounds {
        blob: String,
        name: String,
        dtype: weights_format::DType,
        offset: u64,
        length: u64,
        blob_len: usize,
    },
    #[error("blob `{file}` (expected in metadata.json) is missing")]
    MissingBlob { file: String },
    #[error("reading weights of blob {blob}: {message}")]
    Weights { blob: String, message: String },
    #[error("GPU: {message}")]
    Device { message: String },
    #[error("compute: {0}")]
    Backend(#[from] BackendError),
    #[error("reading weights: {0}")]
    Residency(#[from] residency::ResidencyError),
    #[error("model directory: {0}")]
    Format(#[from] weights_format::FormatError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("the prompt has {prompt} tokens but the context holds {context} (use a larger -c)")]
    ContextOverflow { prompt: usize, context: usize },
    #[error(
        "a sequence of up to {positions} positions needs {needed} bytes of KV cache, more than \
         the whole KV budget of {budget} bytes"
    )]
    KvBudget {
        positions: usize,
        needed: u64,
        budget: u64,
    },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("chat template {path}: {message}")]
    ChatTemplate { path: PathBuf, message: String },
    #[error("the model has no chat template (metadata.json `chat_template` is null)")]
    NoChatTemplate,
    #[error("grammar: {message}")]
    Grammar { message: String },
    #[error("sampling setting {setting} = {value}: {message}")]
    Sampling {
        setting: &'static str,
        value: f64,
        message: &'static str,
    },
}

/// What a backend op can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A weight is not in the memory this backend computes from (host bytes given to a device
    /// backend, or the reverse).
    #[error("the {backend} backend cannot compute from a weight in {found} memory")]
    WrongMemory {
        backend: &'static str,
        found: &'static str,
    },
    /// The device refused an operation (a launch, a copy, an allocation).
    #[cfg(feature = "cuda")]
    #[error("{device}: {op}: {source}")]
    Cuda {
        device: String,
        op: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// cuBLAS refused a GEMM.
    #[cfg(feature = "cuda")]
    #[error("{device}: {op}: {source}")]
    Cublas {
        device: String,
        op: &'static str,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    /// The op cannot handle these arguments (a shape beyond a kernel's limits).
    #[error("{op}: {message}")]
    Unsupported { op: &'static str, message: String },
    /// A pass the backend was recording could not be recorded, so none of its ops ran; running
    /// the pass again runs it op by op.
    #[error("the pass could not be recorded and did not run: {reason}")]
    PassNotRun { reason: String },
}
