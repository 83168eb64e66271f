//! Safe reads of file regions into GPU memory or aligned host memory.
//!
//! This crate is for: opening the cuFile driver once per process, registering files and
//! buffers with RAII ownership, and reading `(file, offset, len)` into memory through one of
//! three backends — `cufile` (GPUDirect Storage, or its compatibility mode), `bounce`
//! (O_DIRECT into a ring of pinned host buffers, then an async host→device copy) and `host`
//! (O_DIRECT into aligned host memory, for the CPU backend). Every read is accounted.
//!
//! It is not for: deciding *what* to read or keep (that is `residency`), nor for knowing
//! anything about model formats.

pub mod aligned;
pub mod host;

pub use aligned::{AlignedBuf, AllocError, IO_ALIGN};
pub use host::{DirectFile, HostIoError, ParallelRead, ReadRecord};
