//! Raw bindings to NVIDIA's cuFile library (`libcufile.so`), loaded at run time.
//!
//! This crate is for: the bindgen output for `cufile.h`, checked in, and a loader that opens
//! the library with `libloading` so that everything builds and runs where CUDA is absent.
//!
//! It is not for: safety, ownership or policy. Callers should use `gds-io`, which wraps these
//! functions in owning types.
//!
//! Loading never panics: a missing library or symbol is a [`LoadError`] that names every file
//! tried and the `LD_LIBRARY_PATH` in effect.
//!
//! ```no_run
//! let api = cufile_sys::api().expect("libcufile");
//! // SAFETY: no preconditions; the driver is reference counted by libcufile.
//! let status = unsafe { (api.driver_open)() };
//! println!("cuFileDriverOpen: {}", cufile_sys::status_message(status.err));
//! ```

mod bindings;

pub use bindings::*;

use std::path::PathBuf;
use std::sync::OnceLock;

/// Names of the library tried by [`api`], after `$GDSLLM_CUFILE_LIB` when that is set.
pub const LIBRARY_NAMES: &[&str] = &["libcufile.so.0", "libcufile.so"];

/// Directories tried after the plain names, for machines where the CUDA lib dir is not on the
/// loader path. `$CUDA_HOME/lib64` and `$CUDA_PATH/lib64` are added at run time.
pub const CUDA_LIB_DIRS: &[&str] = &[
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/lib/x86_64-linux-gnu",
];

/// Why libcufile could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "libcufile not found: tried {tried} (LD_LIBRARY_PATH={ld_library_path}); last error: {last_error}. \
         Install the CUDA toolkit's cuFile (libcufile.so.0) or point GDSLLM_CUFILE_LIB at it"
    )]
    LibraryNotFound {
        tried: String,
        ld_library_path: String,
        last_error: String,
    },
    #[error(
        "{library} lacks the required symbol {symbol}: {reason} (LD_LIBRARY_PATH={ld_library_path})"
    )]
    MissingSymbol {
        library: String,
        symbol: &'static str,
        reason: String,
        ld_library_path: String,
    },
}

/// The functions of libcufile, resolved once. Required functions are plain pointers; functions
/// added in later releases are `Option`s.
pub struct CuFileApi {
    /// The file name that was opened (as given to `dlopen`).
    pub library: String,
    pub driver_open: PFN_cuFileDriverOpen,
    /// `cuFileDriverClose_v2` where present, else the original `cuFileDriverClose`.
    pub driver_close: PFN_cuFileDriverClose,
    pub driver_get_properties: PFN_cuFileDriverGetProperties,
    pub handle_register: PFN_cuFileHandleRegister,
    pub handle_deregister: PFN_cuFileHandleDeregister,
    pub buf_register: PFN_cuFileBufRegister,
    pub buf_deregister: PFN_cuFileBufDeregister,
    pub read: PFN_cuFileRead,
    pub write: PFN_cuFileWrite,
    pub use_count: Option<PFN_cuFileUseCount>,
    pub get_version: Option<PFN_cuFileGetVersion>,
    pub read_async: Option<PFN_cuFileReadAsync>,
    pub write_async: Option<PFN_cuFileWriteAsync>,
    pub stream_register: Option<PFN_cuFileStreamRegister>,
    pub stream_deregister: Option<PFN_cuFileStreamDeregister>,
    pub batch_io_set_up: Option<PFN_cuFileBatchIOSetUp>,
    pub batch_io_submit: Option<PFN_cuFileBatchIOSubmit>,
    pub batch_io_get_status: Option<PFN_cuFileBatchIOGetStatus>,
    pub batch_io_cancel: Option<PFN_cuFileBatchIOCancel>,
    pub batch_io_destroy: Option<PFN_cuFileBatchIODestroy>,
    pub get_parameter_size_t: Option<PFN_cuFileGetParameterSizeT>,
    pub get_parameter_bool: Option<PFN_cuFileGetParameterBool>,
    pub set_parameter_size_t: Option<PFN_cuFileSetParameterSizeT>,
    pub set_parameter_bool: Option<PFN_cuFileSetParameterBool>,
    pub set_parameter_string: Option<PFN_cuFileSetParameterString>,
    // Declared last so that it is dropped after nothing can call through the pointers above.
    _lib: libloading::Library,
}

impl std::fmt::Debug for CuFileApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CuFileApi")
            .field("library", &self.library)
            .field("read_async", &self.read_async.is_some())
            .field("batch_io", &self.batch_io_submit.is_some())
            .finish_non_exhaustive()
    }
}

fn ld_library_path() -> String {
    std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "<unset>".to_string())
}

/// Every candidate [`api`] tries, in order.
pub fn default_candidates() -> Vec<String> {
    let mut candidates = Vec::new();
    if let Ok(explicit) = std::env::var("GDSLLM_CUFILE_LIB")
        && !explicit.is_empty()
    {
        candidates.push(explicit);
    }
    candidates.extend(LIBRARY_NAMES.iter().map(|name| name.to_string()));
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(root) = std::env::var(var) {
            dirs.push(PathBuf::from(root).join("lib64"));
        }
    }
    dirs.extend(CUDA_LIB_DIRS.iter().map(PathBuf::from));
    for dir in dirs {
        for name in LIBRARY_NAMES {
            candidates.push(dir.join(name).to_string_lossy().into_owned());
        }
    }
    candidates.dedup();
    candidates
}

/// The process-wide libcufile, loaded on first use from [`default_candidates`].
pub fn api() -> Result<&'static CuFileApi, &'static LoadError> {
    static API: OnceLock<Result<CuFileApi, LoadError>> = OnceLock::new();
    API.get_or_init(|| load_from(&default_candidates()))
        .as_ref()
}

/// Loads libcufile from the first of `candidates` that opens (a file name for the dynamic
/// loader's search, or a path).
pub fn load_from<S: AsRef<str>>(candidates: &[S]) -> Result<CuFileApi, LoadError> {
    let mut last_error = String::from("no candidates given");
    for candidate in candidates {
        let name = candidate.as_ref();
        // SAFETY: opening libcufile runs its initialisers, which only set up internal state;
        // loading it has no preconditions on our side.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return resolve(lib, name),
            Err(err) => last_error = err.to_string(),
        }
    }
    Err(LoadError::LibraryNotFound {
        tried: candidates
            .iter()
            .map(|c| c.as_ref())
            .collect::<Vec<_>>()
            .join(", "),
        ld_library_path: ld_library_path(),
        last_error,
    })
}

fn resolve(lib: libloading::Library, name: &str) -> Result<CuFileApi, LoadError> {
    macro_rules! required {
        ($symbol:literal, $ty:ty) => {{
            // SAFETY: the symbol's type is the bindgen type generated from cufile.h for it.
            match unsafe { lib.get::<$ty>(concat!($symbol, "\0").as_bytes()) } {
                Ok(f) => *f,
                Err(err) => {
                    return Err(LoadError::MissingSymbol {
                        library: name.to_string(),
                        symbol: $symbol,
                        reason: err.to_string(),
                        ld_library_path: ld_library_path(),
                    });
                }
            }
        }};
    }
    macro_rules! optional {
        ($symbol:literal, $ty:ty) => {{
            // SAFETY: as above; an absent symbol is simply not used.
            unsafe { lib.get::<$ty>(concat!($symbol, "\0").as_bytes()) }
                .ok()
                .map(|f| *f)
        }};
    }
    let driver_close = match optional!("cuFileDriverClose_v2", PFN_cuFileDriverClose_v2) {
        Some(f) => f,
        None => required!("cuFileDriverClose", PFN_cuFileDriverClose),
    };
    Ok(CuFileApi {
        library: name.to_string(),
        driver_open: required!("cuFileDriverOpen", PFN_cuFileDriverOpen),
        driver_close,
        driver_get_properties: required!(
            "cuFileDriverGetProperties",
            PFN_cuFileDriverGetProperties
        ),
        handle_register: required!("cuFileHandleRegister", PFN_cuFileHandleRegister),
        handle_deregister: required!("cuFileHandleDeregister", PFN_cuFileHandleDeregister),
        buf_register: required!("cuFileBufRegister", PFN_cuFileBufRegister),
        buf_deregister: required!("cuFileBufDeregister", PFN_cuFileBufDeregister),
        read: required!("cuFileRead", PFN_cuFileRead),
        write: required!("cuFileWrite", PFN_cuFileWrite),
        use_count: optional!("cuFileUseCount", PFN_cuFileUseCount),
        get_version: optional!("cuFileGetVersion", PFN_cuFileGetVersion),
        read_async: optional!("cuFileReadAsync", PFN_cuFileReadAsync),
        write_async: optional!("cuFileWriteAsync", PFN_cuFileWriteAsync),
        stream_register: optional!("cuFileStreamRegister", PFN_cuFileStreamRegister),
        stream_deregister: optional!("cuFileStreamDeregister", PFN_cuFileStreamDeregister),
        batch_io_set_up: optional!("cuFileBatchIOSetUp", PFN_cuFileBatchIOSetUp),
        batch_io_submit: optional!("cuFileBatchIOSubmit", PFN_cuFileBatchIOSubmit),
        batch_io_get_status: optional!("cuFileBatchIOGetStatus", PFN_cuFileBatchIOGetStatus),
        batch_io_cancel: optional!("cuFileBatchIOCancel", PFN_cuFileBatchIOCancel),
        batch_io_destroy: optional!("cuFileBatchIODestroy", PFN_cuFileBatchIODestroy),
        get_parameter_size_t: optional!("cuFileGetParameterSizeT", PFN_cuFileGetParameterSizeT),
        get_parameter_bool: optional!("cuFileGetParameterBool", PFN_cuFileGetParameterBool),
        set_parameter_size_t: optional!("cuFileSetParameterSizeT", PFN_cuFileSetParameterSizeT),
        set_parameter_bool: optional!("cuFileSetParameterBool", PFN_cuFileSetParameterBool),
        set_parameter_string: optional!("cuFileSetParameterString", PFN_cuFileSetParameterString),
        _lib: lib,
    })
}

impl CuFileApi {
    /// libcufile's version as an integer (e.g. 1150 for 1.15), when the library reports it.
    pub fn version(&self) -> Option<i32> {
        let get_version = self.get_version?;
        let mut version = 0;
        // SAFETY: writes one int through a valid pointer; no other preconditions.
        let status = unsafe { get_version(&mut version) };
        (status.err == CU_FILE_SUCCESS).then_some(version)
    }
}

/// The text cufile.h gives for a `CUfileOpError` (the header's `cufileop_status_error`, which
/// is a static inline function and so is not in the library).
pub fn status_message(code: CUfileOpError) -> &'static str {
    match code {
        CU_FILE_SUCCESS => "cufile success",
        CU_FILE_DRIVER_NOT_INITIALIZED => {
            "nvidia-fs driver is not loaded. Set allow_compat_mode to true in cufile.json file to enable compatible mode"
        }
        CU_FILE_DRIVER_INVALID_PROPS => "invalid property",
        CU_FILE_DRIVER_UNSUPPORTED_LIMIT => "property range error",
        CU_FILE_DRIVER_VERSION_MISMATCH => "nvidia-fs driver version mismatch",
        CU_FILE_DRIVER_VERSION_READ_ERROR => "nvidia-fs driver version read error",
        CU_FILE_DRIVER_CLOSING => "driver shutdown in progress",
        CU_FILE_PLATFORM_NOT_SUPPORTED => "GPUDirect Storage not supported on current platform",
        CU_FILE_IO_NOT_SUPPORTED => "GPUDirect Storage not supported on current file",
        CU_FILE_DEVICE_NOT_SUPPORTED => "GPUDirect Storage not supported on current GPU",
        CU_FILE_NVFS_DRIVER_ERROR => "nvidia-fs driver ioctl error",
        CU_FILE_CUDA_DRIVER_ERROR => "CUDA Driver API error",
        CU_FILE_CUDA_POINTER_INVALID => "invalid device pointer",
        CU_FILE_CUDA_MEMORY_TYPE_INVALID => "invalid pointer memory type",
        CU_FILE_CUDA_POINTER_RANGE_ERROR => "pointer range exceeds allocated address range",
        CU_FILE_CUDA_CONTEXT_MISMATCH => "cuda context mismatch",
        CU_FILE_INVALID_MAPPING_SIZE => "access beyond maximum pinned size",
        CU_FILE_INVALID_MAPPING_RANGE => "access beyond mapped size",
        CU_FILE_INVALID_FILE_TYPE => "unsupported file type",
        CU_FILE_INVALID_FILE_OPEN_FLAG => "unsupported file open flags",
        CU_FILE_DIO_NOT_SET => "fd direct IO not set",
        CU_FILE_INVALID_VALUE => "invalid arguments",
        CU_FILE_MEMORY_ALREADY_REGISTERED => "device pointer already registered",
        CU_FILE_MEMORY_NOT_REGISTERED => "device pointer lookup failure",
        CU_FILE_PERMISSION_DENIED => "driver or file access error",
        CU_FILE_DRIVER_ALREADY_OPEN => "driver is already open",
        CU_FILE_HANDLE_NOT_REGISTERED => "file descriptor is not registered",
        CU_FILE_HANDLE_ALREADY_REGISTERED => "file descriptor is already registered",
        CU_FILE_DEVICE_NOT_FOUND => "GPU device not found",
        CU_FILE_INTERNAL_ERROR => "internal error",
        CU_FILE_GETNEWFD_FAILED => "failed to obtain new file descriptor",
        CU_FILE_NVFS_SETUP_ERROR => "NVFS driver initialization error",
        CU_FILE_IO_DISABLED => "GPUDirect Storage disabled by config on current file",
        CU_FILE_BATCH_SUBMIT_FAILED => "failed to submit batch operation",
        CU_FILE_GPU_MEMORY_PINNING_FAILED => "failed to allocate pinned GPU Memory",
        CU_FILE_BATCH_FULL => "queue full for batch operation",
        CU_FILE_ASYNC_NOT_SUPPORTED => "cuFile stream operation not supported",
        CU_FILE_INTERNAL_BATCH_SETUP_ERROR => "batch setup internal error - retry later",
        CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR => "batch submit internal error - retry later",
        CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR => "batch get status internal error - retry later",
        CU_FILE_INTERNAL_BATCH_CANCEL_ERROR => "batch cancel internal error - retry later",
        CU_FILE_NOMEM_ERROR => "cufile no memory error - retry later",
        CU_FILE_IO_ERROR => "cufile io error",
        CU_FILE_INTERNAL_BUF_REGISTER_ERROR => "cufile buf registration error",
        CU_FILE_HASH_OPR_ERROR => "cufile hash operation error",
        CU_FILE_INVALID_CONTEXT_ERROR => "cufile invalid context error",
        CU_FILE_NVFS_INTERNAL_DRIVER_ERROR => "nvfs internal driver error",
        CU_FILE_BATCH_NOCOMPAT_ERROR => "compat mode off error",
        CU_FILE_IO_MAX_ERROR => "GPUDirect Storage Max Error",
        _ => "unknown cufile error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_error_naming_files_and_ld_library_path() {
        let tried = [
            "/nonexistent/gdsllm/libcufile.so.0",
            "libcufile-gdsllm-absent.so",
        ];
        let err = load_from(&tried).expect_err("no such library exists");
        let message = err.to_string();
        for name in tried {
            assert!(message.contains(name), "{message} should name {name}");
        }
        assert!(message.contains("LD_LIBRARY_PATH="), "{message}");
        assert!(matches!(err, LoadError::LibraryNotFound { .. }));
    }

    #[test]
    fn library_without_cufile_symbols_is_a_missing_symbol_error() {
        // libc opens everywhere this runs and has none of cuFile's symbols.
        let err = load_from(&["libc.so.6"]).expect_err("libc is not libcufile");
        match &err {
            LoadError::MissingSymbol {
                library, symbol, ..
            } => {
                assert_eq!(library, "libc.so.6");
                assert!(symbol.starts_with("cuFile"), "{symbol}");
            }
            other => panic!("expected MissingSymbol, got {other}"),
        }
        assert!(err.to_string().contains("LD_LIBRARY_PATH="));
    }

    #[test]
    fn default_candidates_cover_names_and_cuda_dirs() {
        let candidates = default_candidates();
        assert!(candidates.iter().any(|c| c == "libcufile.so.0"));
        assert!(
            candidates
                .iter()
                .any(|c| c == "/usr/local/cuda/lib64/libcufile.so.0")
        );
    }

    #[test]
    fn status_messages_follow_the_header_and_accept_unknown_codes() {
        assert_eq!(
            status_message(CU_FILE_HANDLE_NOT_REGISTERED),
            "file descriptor is not registered"
        );
        assert_eq!(status_message(5027), "file descriptor is not registered");
        assert_eq!(status_message(4242), "unknown cufile error");
    }
}
