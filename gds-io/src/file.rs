//! A file opened for device reads: O_DIRECT for the bounce and host paths, plus an optional
//! cuFile handle (registered on its own O_DIRECT descriptor, deregistered on Drop).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use crate::driver::{Driver, explain_registration_failure};
use crate::error::GdsError;
use crate::host::{DirectFile, HostIoError};
use crate::io_path::IoPath;

/// A file ready for device reads through any I/O path.
#[derive(Debug)]
pub struct GdsFile {
    direct: DirectFile,
    cufile: Option<CuFileHandle>,
}

/// A registered cuFile handle and the O_DIRECT descriptor it was registered on.
#[derive(Debug)]
pub(crate) struct CuFileHandle {
    raw: cufile_sys::CUfileHandle_t,
    driver: Arc<Driver>,
    // Dropped after deregistration (Drop below runs first), so the fd outlives the handle.
    _fd: File,
}

// SAFETY: a cuFile handle is an opaque token that libcufile allows to be used from any thread
// (cuFileRead is thread-safe); we never mutate it after registration.
unsafe impl Send for CuFileHandle {}
// SAFETY: as above.
unsafe impl Sync for CuFileHandle {}

impl Drop for CuFileHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` was returned by a successful cuFileHandleRegister and is deregistered
        // exactly once; the driver is kept open by `self.driver`.
        unsafe { (self.driver.api().handle_deregister)(self.raw) };
        self.driver.count_file_handle(-1);
    }
}

impl GdsFile {
    /// Opens `path` for O_DIRECT reads (buffered where the filesystem refuses O_DIRECT).
    pub fn open(path: impl AsRef<Path>) -> Result<GdsFile, GdsError> {
        Ok(GdsFile {
            direct: DirectFile::open(path)?,
            cufile: None,
        })
    }

    /// Opens `path` and registers it with cuFile.
    pub fn open_registered(
        path: impl AsRef<Path>,
        driver: &Arc<Driver>,
    ) -> Result<GdsFile, GdsError> {
        let mut file = GdsFile::open(path)?;
        file.register(driver)?;
        Ok(file)
    }

    /// Opens `path` to be read with `io_path`: registered with cuFile for
    /// [`IoPath::Cufile`] (an error when there is no `driver`), as [`GdsFile::open`] otherwise.
    pub fn open_for(
        path: impl AsRef<Path>,
        io_path: IoPath,
        driver: Option<&Arc<Driver>>,
    ) -> Result<GdsFile, GdsError> {
        let mut file = GdsFile::open(path)?;
        if io_path == IoPath::Cufile {
            let driver = driver.ok_or_else(|| GdsError::IoPathUnavailable {
                io_path: "cufile",
                reason: "libcufile could not be loaded or opened".into(),
            })?;
            file.register(driver)?;
        }
        Ok(file)
    }

    /// Registers the file with cuFile (idempotent). A failure explains why, including the
    /// missing udev `ID_FS_USAGE` record and the command that fixes it.
    pub fn register(&mut self, driver: &Arc<Driver>) -> Result<(), GdsError> {
        if self.cufile.is_some() {
            return Ok(());
        }
        let path = self.direct.path().to_path_buf();
        let fd = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .map_err(|source| HostIoError::Open {
                path: path.clone(),
                source,
            })?;
        let mut descr = cufile_sys::CUfileDescr_t {
            type_: cufile_sys::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            ..Default::default()
        };
        descr.handle.fd = fd.as_raw_fd();
        let mut raw: cufile_sys::CUfileHandle_t = std::ptr::null_mut();
        // SAFETY: `descr` describes an open O_DIRECT descriptor that lives as long as the
        // handle (it is stored beside it); `raw` is a valid out pointer.
        let status = unsafe { (driver.api().handle_register)(&mut raw, &mut descr) };
        if status.err != cufile_sys::CU_FILE_SUCCESS {
            return Err(GdsError::Register {
                explanation: explain_registration_failure(&path, status.err),
                path,
                code: status.err,
                message: cufile_sys::status_message(status.err),
            });
        }
        driver.count_file_handle(1);
        self.cufile = Some(CuFileHandle {
            raw,
            driver: driver.clone(),
            _fd: fd,
        });
        Ok(())
    }

    pub fn path(&self) -> &Path {
        self.direct.path()
    }

    pub fn len(&self) -> u64 {
        self.direct.len()
    }

    pub fn is_empty(&self) -> bool {
        self.direct.is_empty()
    }

    /// Whether host-side reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_direct()
    }

    pub fn is_registered(&self) -> bool {
        self.cufile.is_some()
    }

    pub fn direct_file(&self) -> &DirectFile {
        &self.direct
    }

    pub(crate) fn cufile_handle(&self) -> Option<cufile_sys::CUfileHandle_t> {
        self.cufile.as_ref().map(|h| h.raw)
    }
}
