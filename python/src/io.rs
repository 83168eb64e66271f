//! Reading a file region into memory the package owns: aligned host memory (`device="cpu"`,
//! the host I/O path's O_DIRECT reads) or a gds-io device buffer (`device="cuda:N"`, through
//! the cufile, bounce or host I/O path), kept open per GPU between calls so that the bounce
//! ring's pinned memory and the cuFile driver are set up once per process.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

use gds_io::{
    AlignedBuf, Capabilities, DeviceRead, DeviceReader, DirectFile, Driver, GdsBuffer, GdsFile,
    Gpu, IO_ALIGN, IoChoice, IoPath, LiveRegistrations, ParallelRead,
};

use crate::errors::BridgeError;
use crate::storage::{CurrentContext, Storage};

/// Where a tensor's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Cpu,
    Cuda(usize),
}

impl Placement {
    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    pub fn parse(device: &str) -> Result<Placement, BridgeError> {
        let device = device.trim().to_ascii_lowercase();
        match device.as_str() {
            "cpu" => Ok(Placement::Cpu),
            "cuda" => Ok(Placement::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Placement::Cuda)
                .ok_or_else(|| {
                    BridgeError::Invalid(format!(
                        "unknown device {device:?}: expected \"cpu\", \"cuda\" or \"cuda:N\""
                    ))
                }),
        }
    }

    /// `cpu` or `cuda:N`, as PyTorch names devices.
    pub fn name(self) -> String {
        match self {
            Placement::Cpu => "cpu".into(),
            Placement::Cuda(n) => format!("cuda:{n}"),
        }
    }
}

/// Parses the `io` argument: `auto`, `cufile`, `bounce` or `host`.
pub fn parse_io(io: &str) -> Result<IoChoice, BridgeError> {
    io.parse::<IoChoice>().map_err(BridgeError::Invalid)
}

/// A region read into a buffer of its own.
pub struct Region {
    pub storage: Arc<Storage>,
    /// Where the requested bytes start inside the buffer (the read starts at the aligned
    /// offset below the requested one).
    pub data_offset: usize,
    /// The I/O path that did the read: `host`, `cufile`, `bounce`.
    pub io_path: &'static str,
    /// Set when `io="auto"` had to leave its first choice (cuFile could not register the file).
    pub note: Option<String>,
}

/// An opened GPU, the cuFile driver if it opened there, and the readers built so far.
struct DeviceState {
    gpu: Gpu,
    driver: Result<Arc<Driver>, String>,
    readers: Mutex<BTreeMap<&'static str, Arc<dyn DeviceReader>>>,
}

static DEVICES: Mutex<BTreeMap<usize, Arc<DeviceState>>> = Mutex::new(BTreeMap::new());
/// The cuFile driver this package opened, watched (not kept alive) for [`live_registrations`].
static DRIVER: Mutex<Weak<Driver>> = Mutex::new(Weak::new());

fn device_state(ordinal: usize) -> Result<Arc<DeviceState>, BridgeError> {
    let mut devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(state) = devices.get(&ordinal) {
        return Ok(Arc::clone(state));
    }
    let gpu = Gpu::open(ordinal)?;
    let driver = Driver::open().map_err(|err| err.to_string());
    if let Ok(driver) = &driver {
        *DRIVER.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(driver);
    } else if let Err(reason) = &driver {
        tracing::info!("cuFile unavailable, reads use the bounce/host paths: {reason}");
    }
    let state = Arc::new(DeviceState {
        gpu,
        driver,
        readers: Mutex::new(BTreeMap::new()),
    });
    devices.insert(ordinal, Arc::clone(&state));
    Ok(state)
}

impl DeviceState {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            gpu: true,
            cufile: self.driver.is_ok(),
            gds_dma: self
                .driver
                .as_ref()
                .is_ok_and(|driver| driver.properties().gds_dma()),
            bounce_gbps: None,
            host_gbps: None,
        }
    }

    fn reader(&self, kind: IoPath) -> Result<Arc<dyn DeviceReader>, BridgeError> {
        let mut readers = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reader) = readers.get(kind.name()) {
            return Ok(Arc::clone(reader));
        }
        let reader: Arc<dyn DeviceReader> = Arc::from(gds_io::build_reader(
            kind,
            &self.gpu,
            self.driver.as_ref().ok(),
        )?);
        readers.insert(kind.name(), Arc::clone(&reader));
        Ok(reader)
    }

    fn driver(&self, kind: IoPath) -> Result<&Arc<Driver>, BridgeError> {
        self.driver.as_ref().map_err(|reason| {
            BridgeError::Gds(gds_io::GdsError::IoPathUnavailable {
                io_path: kind.name(),
                reason: reason.clone(),
            })
        })
    }
}

/// cuFile registrations (files and buffers) in force now; zero when the driver is not open.
pub fn live_registrations() -> LiveRegistrations {
    DRIVER
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .upgrade()
        .map(|driver| driver.live_registrations())
        .unwrap_or(LiveRegistrations {
            file_handles: 0,
            buffers: 0,
        })
}

/// Drops the per-GPU state: the bounce rings' pinned memory, the cached readers and this
/// package's hold on the cuFile driver (buffers still alive keep what they need).
pub fn release() {
    let states = std::mem::take(&mut *DEVICES.lock().unwrap_or_else(|p| p.into_inner()));
    let _restore = CurrentContext::save();
    drop(states);
}

/// What `cuda_status()` reports: whether GPU `ordinal` opens, and what cuFile offers there.
/// Python gets it as a dict keyed by the field names.
#[derive(pyo3::IntoPyObject)]
pub struct CudaStatus {
    pub available: bool,
    pub reason: Option<String>,
    pub device_name: Option<String>,
    pub cufile: Option<String>,
    pub gds_dma: bool,
}

pub fn cuda_status(ordinal: usize) -> CudaStatus {
    let _restore = CurrentContext::save();
    match device_state(ordinal) {
        Err(err) => CudaStatus {
            available: false,
            reason: Some(err.to_string()),
            device_name: None,
            cufile: None,
            gds_dma: false,
        },
        Ok(state) => CudaStatus {
            available: true,
            reason: None,
            device_name: state.gpu.name().ok(),
            cufile: Some(match &state.driver {
                Ok(driver) if driver.properties().gds_dma() => "gds".into(),
                Ok(_) => "compat".into(),
                Err(reason) => format!("unavailable: {reason}"),
            }),
            gds_dma: state.capabilities().gds_dma,
        },
    }
}

/// The aligned read that covers `offset..offset+len`: where it starts, how far into it the
/// requested bytes begin, and how many bytes it reads.
fn covering_read(offset: u64, len: usize) -> (u64, usize, usize) {
    let start = offset / IO_ALIGN as u64 * IO_ALIGN as u64;
    let skip = (offset - start) as usize;
    (start, skip, skip + len)
}

fn check_file(path: &Path, file_len: u64, offset: u64, len: usize) -> Result<(), BridgeError> {
    let end = offset.checked_add(len as u64);
    if end.is_none_or(|end| end > file_len) {
        return Err(BridgeError::Invalid(format!(
            "{}: bytes {offset}..{} lie beyond the end of the file ({file_len} bytes)",
            path.display(),
            offset as u128 + len as u128
        )));
    }
    Ok(())
}

fn check_path(path: &Path) -> Result<(), BridgeError> {
    match std::fs::metadata(path) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Err(BridgeError::NotFound {
            path: path.to_path_buf(),
        }),
        Ok(meta) if meta.is_dir() => Err(BridgeError::Invalid(format!(
            "{} is a directory, not a file",
            path.display()
        ))),
        // Other errors (permissions) are reported by the open with their reason.
        _ => Ok(()),
    }
}

/// Reads `len` bytes at `offset` of `path` into a new buffer at `placement`.
///
/// `device="cpu"` reads with O_DIRECT into aligned host memory (`io` must be `auto` or
/// `host`). A GPU read allocates a device buffer (registered with cuFile when the cufile
/// I/O path reads it) and reads into it through the I/O path `io` names; `auto` takes cufile
/// where cuFile does real DMA, else the bounce ring, and leaves cufile for bounce (with a note)
/// when cuFile cannot register the file. A forced `cufile` fails instead.
pub fn read_region(
    path: &Path,
    offset: u64,
    len: usize,
    placement: Placement,
    choice: IoChoice,
) -> Result<Region, BridgeError> {
    check_path(path)?;
    let (start, skip, span) = covering_read(offset, len);
    // One aligned block at least, so that even an empty tensor has a real address.
    let alloc_len = span.next_multiple_of(IO_ALIGN).max(IO_ALIGN);
    match placement {
        Placement::Cpu => {
            if !matches!(choice, IoChoice::Auto | IoChoice::Force(IoPath::Host)) {
                return Err(BridgeError::Invalid(format!(
                    "io={:?} reads into GPU memory; device=\"cpu\" reads with io=\"host\" (or \
                     \"auto\")",
                    match choice {
                        IoChoice::Force(kind) => kind.name(),
                        IoChoice::Auto => "auto",
                    }
                )));
            }
            let file = DirectFile::open(path)?;
            check_file(path, file.len(), offset, len)?;
            let mut buffer = AlignedBuf::zeroed(alloc_len).map_err(gds_io::HostIoError::from)?;
            if len > 0 {
                let aligned = span.next_multiple_of(IO_ALIGN);
                file.read_into_parallel(start, &mut buffer[..aligned], ParallelRead::default())?;
            }
            Ok(Region {
                storage: Arc::new(Storage::host(buffer)),
                data_offset: skip,
                io_path: IoPath::Host.name(),
                note: None,
            })
        }
        Placement::Cuda(ordinal) => {
            let _restore = CurrentContext::save();
            let state = device_state(ordinal)?;
            let mut kind = gds_io::choose_io_path(&state.capabilities(), choice)?;
            let mut file = GdsFile::open(path)?;
            check_file(path, file.len(), offset, len)?;
            let mut note = None;
            if kind == IoPath::Cufile {
                let driver = state.driver(kind)?;
                if let Err(err) = file.register(driver) {
                    if choice != IoChoice::Auto {
                        return Err(err.into());
                    }
                    note = Some(format!("{err}; io=\"auto\" read it through bounce instead"));
                    kind = IoPath::Bounce;
                }
            }
            let buffer = match kind {
                IoPath::Cufile => {
                    GdsBuffer::alloc_registered(&state.gpu, state.driver(kind)?, alloc_len)?
                }
                _ => GdsBuffer::alloc(&state.gpu, alloc_len)?,
            };
            if len > 0 {
                state.reader(kind)?.read(&DeviceRead {
                    offset: start,
                    ..DeviceRead::from_start(&file, span, &buffer)
                })?;
            }
            Ok(Region {
                storage: Arc::new(Storage::device(buffer, ordinal)),
                data_offset: skip,
                io_path: kind.name(),
                note,
            })
        }
    }
}
