//! Errors of the GPU side of gds-io. Each names the file, offset or setting involved.

use std::path::PathBuf;

use crate::host::HostIoError;

/// Why a device read, registration or GPU set-up failed.
#[derive(Debug, thiserror::Error)]
pub enum GdsError {
    #[error("no usable GPU: {reason}")]
    NoGpu { reason: String },
    #[error("CUDA driver call {call} failed: {source}")]
    Cuda {
        call: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error(transparent)]
    Library(#[from] &'static cufile_sys::LoadError),
    #[error("{call} failed: cuFile error {code} ({message}){cuda}", cuda = cuda_suffix(*.cuda_error))]
    CuFile {
        call: &'static str,
        code: u32,
        message: &'static str,
        cuda_error: u32,
    },
    #[error(
        "cuFileHandleRegister of {path} failed: cuFile error {code} ({message}). {explanation}"
    )]
    Register {
        path: PathBuf,
        code: u32,
        message: &'static str,
        explanation: String,
    },
    #[error(
        "unaligned device read of {path}: file offset {offset} and buffer offset {dst_offset} \
         must be multiples of {align}"
    )]
    Misaligned {
        path: PathBuf,
        offset: u64,
        dst_offset: usize,
        align: usize,
    },
    #[error("{path}: range {offset}..{end} lies beyond the end of the file ({file_len} bytes)")]
    PastEndOfFile {
        path: PathBuf,
        offset: u64,
        end: u64,
        file_len: u64,
    },
    #[error(
        "device buffer of {buffer_len} bytes cannot take {len} bytes at offset {dst_offset} \
         (reading {path})"
    )]
    BufferTooSmall {
        path: PathBuf,
        buffer_len: usize,
        dst_offset: usize,
        len: usize,
    },
    #[error("cuFileRead of {path} at offset {offset} ({len} bytes) failed: {reason}")]
    Read {
        path: PathBuf,
        offset: u64,
        len: usize,
        reason: String,
    },
    #[error("invalid I/O path {value:?} in {setting}: expected one of cufile, bounce, host, auto")]
    BadIoPathName { setting: String, value: String },
    #[error("I/O path {io_path} is not available here: {reason}")]
    IoPathUnavailable {
        io_path: &'static str,
        reason: String,
    },
    #[error("range {start}..{end} lies outside the device buffer of {buffer_len} bytes")]
    RangeOutsideBuffer {
        start: usize,
        end: usize,
        buffer_len: usize,
    },
    #[error("zero-length device allocation requested")]
    EmptyAllocation,
    #[error(transparent)]
    Host(#[from] HostIoError),
}

fn cuda_suffix(cuda_error: u32) -> String {
    if cuda_error == 0 {
        String::new()
    } else {
        format!(", CUDA driver error {cuda_error}")
    }
}

impl GdsError {
    pub(crate) fn cuda(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GdsError {
        move |source| GdsError::Cuda { call, source }
    }

    pub(crate) fn cufile(call: &'static str, status: cufile_sys::CUfileError_t) -> GdsError {
        GdsError::CuFile {
            call,
            code: status.err,
            message: cufile_sys::status_message(status.err),
            cuda_error: status.cu_err,
        }
    }
}

/// Turns a cuFile status into `Ok(())` or a [`GdsError::CuFile`].
pub(crate) fn check(call: &'static str, status: cufile_sys::CUfileError_t) -> Result<(), GdsError> {
    if status.err == cufile_sys::CU_FILE_SUCCESS {
        Ok(())
    } else {
        Err(GdsError::cufile(call, status))
    }
}
