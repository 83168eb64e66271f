//! Errors of the bindings and how each becomes a Python exception carrying the Rust message.
//!
//! | Rust error | Python exception |
//! |---|---|
//! | bad argument (shape, dtype, offset, range, device or io name) | `ValueError` |
//! | file or model directory missing | `FileNotFoundError` |
//! | no GPU, no libcuda, no libcufile, a CUDA or cuFile call failed | `gdsllm.CudaUnavailableError` (a `RuntimeError`) |
//! | a read failed | `gdsllm.ReadError` (an `OSError`) |
//! | the model directory is not a valid GdsLLM model | `gdsllm.ModelFormatError` (a `ValueError`) |

use gds_io::{GdsError, HostIoError};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use weights_format::FormatError;

pyo3::create_exception!(
    _gdsllm,
    CudaUnavailableError,
    PyRuntimeError,
    "No usable GPU for what was asked: no CUDA driver library, no such device, libcufile \
     missing, or a CUDA or cuFile call failed. The message says which."
);
pyo3::create_exception!(
    _gdsllm,
    ReadError,
    PyOSError,
    "A read of a file region failed; the message names the file and offset."
);
pyo3::create_exception!(
    _gdsllm,
    ModelFormatError,
    PyValueError,
    "The directory is not a valid GdsLLM model (metadata.json and blobs do not agree)."
);

/// Why a tensor or blob could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// A bad argument: the message says which and why.
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: no such file")]
    NotFound { path: std::path::PathBuf },
    #[error(transparent)]
    Gds(#[from] GdsError),
    #[error(transparent)]
    Host(#[from] HostIoError),
    #[error(transparent)]
    Format(#[from] FormatError),
}

fn is_not_found(err: &HostIoError) -> bool {
    matches!(err, HostIoError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

fn host_error(err: &HostIoError, message: String) -> PyErr {
    match err {
        _ if is_not_found(err) => PyFileNotFoundError::new_err(message),
        HostIoError::Unaligned { .. } | HostIoError::OutOfRange { .. } => {
            PyValueError::new_err(message)
        }
        _ => ReadError::new_err(message),
    }
}

impl From<BridgeError> for PyErr {
    fn from(err: BridgeError) -> PyErr {
        let message = err.to_string();
        match &err {
            BridgeError::Invalid(_) => PyValueError::new_err(message),
            BridgeError::NotFound { .. } => PyFileNotFoundError::new_err(message),
            BridgeError::Host(host) => host_error(host, message),
            BridgeError::Gds(GdsError::Host(host)) => host_error(host, message),
            BridgeError::Gds(
                GdsError::Misaligned { .. }
                | GdsError::PastEndOfFile { .. }
                | GdsError::BufferTooSmall { .. }
                | GdsError::RangeOutsideBuffer { .. }
                | GdsError::BadIoPathName { .. }
                | GdsError::EmptyAllocation,
            ) => PyValueError::new_err(message),
            BridgeError::Gds(GdsError::Read { .. }) => ReadError::new_err(message),
            BridgeError::Gds(_) => CudaUnavailableError::new_err(message),
            BridgeError::Format(FormatError::MissingFile { .. }) => {
                PyFileNotFoundError::new_err(message)
            }
            BridgeError::Format(FormatError::Io { .. }) => ReadError::new_err(message),
            BridgeError::Format(_) => ModelFormatError::new_err(message),
        }
    }
}

/// Adds the exception types to the module.
pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add(
        "CudaUnavailableError",
        py.get_type::<CudaUnavailableError>(),
    )?;
    module.add("ReadError", py.get_type::<ReadError>())?;
    module.add("ModelFormatError", py.get_type::<ModelFormatError>())?;
    Ok(())
}
