//! Putting it together: open the GPU, probe cuFile, pick a backend, open files for it.

use std::path::Path;
use std::sync::Arc;

use crate::backend::{BackendKind, Capabilities, DeviceReader, IoChoice, choose_backend};
use crate::bounce::{BounceBackend, BounceConfig};
use crate::cufile_backend::{CufileBackend, CufileConfig};
use crate::driver::Driver;
use crate::error::GdsError;
use crate::file::GdsFile;
use crate::gpu::{GdsBuffer, Gpu};
use crate::host::ReadRecord;
use crate::staged::{HostStagedBackend, HostStagedConfig};

/// A GPU, the cuFile driver if it opened, and the backend reads go through.
pub struct DeviceIo {
    gpu: Gpu,
    driver: Option<Arc<Driver>>,
    capabilities: Capabilities,
    reader: Box<dyn DeviceReader>,
}

impl DeviceIo {
    /// Opens GPU `ordinal` and the backend `choice` asks for (see [`choose_backend`]).
    pub fn open(ordinal: usize, choice: IoChoice) -> Result<DeviceIo, GdsError> {
        let gpu = Gpu::open(ordinal)?;
        let driver = match Driver::open() {
            Ok(driver) => Some(driver),
            Err(err) => {
                tracing::info!("cuFile unavailable, using the bounce/host paths: {err}");
                None
            }
        };
        let capabilities = Capabilities {
            gpu: true,
            cufile: driver.is_some(),
            gds_dma: driver.as_ref().is_some_and(|d| d.properties().gds_dma()),
            bounce_gbps: None,
            host_gbps: None,
        };
        let kind = choose_backend(&capabilities, choice)?;
        let reader = build_reader(kind, &gpu, driver.as_ref())?;
        tracing::info!(backend = %kind, "device reads use the {kind} backend");
        Ok(DeviceIo {
            gpu,
            driver,
            capabilities,
            reader,
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn driver(&self) -> Option<&Arc<Driver>> {
        self.driver.as_ref()
    }

    pub fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    pub fn reader(&self) -> &dyn DeviceReader {
        self.reader.as_ref()
    }

    pub fn kind(&self) -> BackendKind {
        self.reader.kind()
    }

    /// Opens `path` for the current backend. With `cufile`, a failed registration (such as the
    /// missing udev record) switches this `DeviceIo` to the bounce backend with a log line
    /// that explains why and how to fix it, instead of failing.
    pub fn open_file(&mut self, path: impl AsRef<Path>) -> Result<GdsFile, GdsError> {
        let mut file = GdsFile::open(path)?;
        if self.reader.kind() == BackendKind::Cufile
            && let Some(driver) = &self.driver
            && let Err(err) = file.register(driver)
        {
            tracing::warn!("{err}; falling back to the bounce backend");
            self.reader = build_reader(BackendKind::Bounce, &self.gpu, None)?;
        }
        Ok(file)
    }

    /// Allocates a device buffer, registered with cuFile when the cufile backend is in use.
    pub fn alloc(&self, len: usize) -> Result<GdsBuffer, GdsError> {
        match (&self.driver, self.reader.kind()) {
            (Some(driver), BackendKind::Cufile) => {
                GdsBuffer::alloc_registered(&self.gpu, driver, len)
            }
            _ => GdsBuffer::alloc(&self.gpu, len),
        }
    }

    /// Reads `len` bytes at `offset` of `file` into `dst[dst_offset..]`.
    pub fn read(
        &self,
        file: &GdsFile,
        offset: u64,
        len: usize,
        dst: &GdsBuffer,
        dst_offset: usize,
    ) -> Result<ReadRecord, GdsError> {
        self.reader.read(file, offset, len, dst, dst_offset)
    }
}

/// Builds one backend with default tuning.
pub fn build_reader(
    kind: BackendKind,
    gpu: &Gpu,
    driver: Option<&Arc<Driver>>,
) -> Result<Box<dyn DeviceReader>, GdsError> {
    Ok(match kind {
        BackendKind::Cufile => {
            let driver = match driver {
                Some(driver) => driver.clone(),
                None => Driver::open()?,
            };
            Box::new(CufileBackend::new(gpu, &driver, CufileConfig::default()))
        }
        BackendKind::Bounce => Box::new(BounceBackend::new(gpu, BounceConfig::default())?),
        BackendKind::Host => Box::new(HostStagedBackend::new(gpu, HostStagedConfig::default())),
    })
}
