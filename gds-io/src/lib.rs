//! Safe reads of file regions into GPU memory or aligned host memory.
//!
//! This crate is for: opening the cuFile driver once per process, registering files and
//! buffers with RAII ownership, and reading `(file, offset, len)` into memory through one of
//! three I/O paths — `cufile` (GPUDirect Storage, or its compatibility mode), `bounce`
//! (O_DIRECT into a ring of pinned host buffers, then an async host→device copy) and `host`
//! (O_DIRECT into aligned host memory, for the CPU I/O path). Every read is accounted.
//!
//! It is not for: deciding *what* to read or keep (that is `residency`), nor for knowing
//! anything about model formats.
//!
//! ```no_run
//! use gds_io::{DeviceIo, DeviceRead, IoChoice};
//!
//! # fn main() -> Result<(), gds_io::GdsError> {
//! // GPU 0; `cufile` where GDS DMA works, else the bounce ring (GDSLLM_IO / --io override).
//! let mut io = DeviceIo::open(0, IoChoice::Auto)?;
//! let file = io.open_file("model/layer_000.bin")?;
//! let buffer = io.alloc(file.len() as usize)?;
//! let record = io.read(&DeviceRead::from_start(&file, file.len() as usize, &buffer))?;
//! println!("{} bytes via {} at {:.2} GB/s", record.bytes, record.io_path, record.gbps());
//! # Ok(())
//! # }
//! ```
//!
//! Without a GPU, [`DirectFile`] (the `host` I/O path) reads into [`AlignedBuf`] host memory.

pub mod aligned;
pub mod host;

pub mod bounce;
pub mod cufile_reader;
pub mod device_io;
pub mod device_ptr;
pub mod driver;
pub mod error;
pub mod file;
pub mod gpu;
pub mod io_path;
pub mod probe;
pub mod staged;

pub use aligned::{AlignedBuf, AllocError, IO_ALIGN};
pub use bounce::{BounceConfig, BouncePipeline, BounceReader, BounceTicket};
pub use cufile_reader::{CufileConfig, CufileReader};
pub use device_io::{DeviceIo, build_reader};
pub use device_ptr::DevicePtr;
pub use driver::{Driver, DriverProperties, LiveRegistrations, UdevCheck, UdevStatus};
pub use error::GdsError;
pub use file::GdsFile;
pub use gpu::{GdsBuffer, Gpu, HostStaging, PinnedHostBuf, cuda_driver_present};
pub use host::{DirectFile, HostIoError, ParallelRead, ReadRecord};
pub use io_path::{
    Capabilities, DEVICE_READ_ALIGN, DeviceRead, DeviceReader, IO_ENV, IoChoice, IoPath, IoStats,
    IoTotals, ReadSpan, ReadTicket, choose_io_path, io_choice_from_env, resolve_io_choice,
};
pub use staged::{HostStagedConfig, HostStagedReader};
