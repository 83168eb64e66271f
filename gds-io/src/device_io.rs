//! Putting it together: open the GPU, probe cuFile, pick an I/O path, open files for it.

use std::path::Path;
use std::sync::Arc;

use crate::bounce::{BounceConfig, BounceReader};
use crate::cufile_reader::{CufileConfig, CufileReader};
use crate::driver::Driver;
use crate::error::GdsError;
use crate::file::GdsFile;
use crate::gpu::{GdsBuffer, Gpu};
use crate::host::ReadRecord;
use crate::io_path::{Capabilities, DeviceReader, IoChoice, IoPath, choose_io_path};
use crate::staged::{HostStagedConfig, HostStagedReader};

/// A GPU, the cuFile driver if it opened, and the I/O path reads go through.
pub struct DeviceIo {
    gpu: Gpu,
    driver: Option<Arc<Driver>>,
    capabilities: Capabilities,
    reader: Box<dyn DeviceReader>,
}

impl DeviceIo {
    /// Opens GPU `ordinal` and the I/O path `choice` asks for (see [`choose_io_path`]).
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
        let kind = choose_io_path(&capabilities, choice)?;
        let reader = build_reader(kind, &gpu, driver.as_ref())?;
        tracing::info!(io_path = %kind, "device reads use the {kind} I/O path");
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

    pub fn kind(&self) -> IoPath {
        self.reader.kind()
    }

    /// Opens `path` for the current I/O path. With `cufile`, a failed registration (such as the
    /// missing udev record) switches this `DeviceIo` to the bounce path with a log line
    /// that explains why and how to fix it, instead of failing.
    pub fn open_file(&mut self, path: impl AsRef<Path>) -> Result<GdsFile, GdsError> {
        let mut file = GdsFile::open(path)?;
        if self.reader.kind() == IoPath::Cufile
            && let Some(driver) = &self.driver
            && let Err(err) = file.register(driver)
        {
            tracing::warn!("{err}; falling back to the bounce path");
            self.reader = build_reader(IoPath::Bounce, &self.gpu, None)?;
        }
        Ok(file)
    }

    /// Allocates a device buffer, registered with cuFile when the cufile path is in use.
    pub fn alloc(&self, len: usize) -> Result<GdsBuffer, GdsError> {
        match (&self.driver, self.reader.kind()) {
            (Some(driver), IoPath::Cufile) => GdsBuffer::alloc_registered(&self.gpu, driver, len),
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

/// Builds one I/O path with default tuning.
pub fn build_reader(
    kind: IoPath,
    gpu: &Gpu,
    driver: Option<&Arc<Driver>>,
) -> Result<Box<dyn DeviceReader>, GdsError> {
    Ok(match kind {
        IoPath::Cufile => {
            let driver = match driver {
                Some(driver) => driver.clone(),
                None => Driver::open()?,
            };
            Box::new(CufileReader::new(gpu, &driver, CufileConfig::default()))
        }
        IoPath::Bounce => Box::new(BounceReader::new(gpu, BounceConfig::default())?),
        IoPath::Host => Box::new(HostStagedReader::new(gpu, HostStagedConfig::default())),
    })
}
