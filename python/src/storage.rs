//! The memory behind exported tensors: one aligned host buffer or one gds-io device buffer per
//! read, shared (`Arc`) by every tensor viewing it and every DLPack capsule handed out, and
//! freed when the last of them goes. Live buffers and bytes are counted, so that tests can see
//! that memory comes back.

use std::ffi::c_void;
use std::sync::atomic::{AtomicI64, Ordering};

use cudarc::driver::{result, sys};
use dlpark::ffi::DLDevice;
use gds_io::{AlignedBuf, GdsBuffer};

static HOST_BUFFERS: AtomicI64 = AtomicI64::new(0);
static HOST_BYTES: AtomicI64 = AtomicI64::new(0);
static DEVICE_BUFFERS: AtomicI64 = AtomicI64::new(0);
static DEVICE_BYTES: AtomicI64 = AtomicI64::new(0);

/// Buffers and bytes alive now, host and device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveMemory {
    pub host_buffers: i64,
    pub host_bytes: i64,
    pub device_buffers: i64,
    pub device_bytes: i64,
}

pub fn live_memory() -> LiveMemory {
    LiveMemory {
        host_buffers: HOST_BUFFERS.load(Ordering::SeqCst),
        host_bytes: HOST_BYTES.load(Ordering::SeqCst),
        device_buffers: DEVICE_BUFFERS.load(Ordering::SeqCst),
        device_bytes: DEVICE_BYTES.load(Ordering::SeqCst),
    }
}

enum Memory {
    /// Held only to be freed with the Storage; `Storage::data` points into it.
    Host(
        #[expect(
            dead_code,
            reason = "owned for its Drop; accessed through Storage::data"
        )]
        AlignedBuf,
    ),
    Device(GdsBuffer),
}

/// One buffer that reads landed in. `data` is taken once, from exclusive access, when the
/// buffer is wrapped; Rust never reads or writes the memory through a reference afterwards,
/// so consumers may write through the exported pointer.
pub struct Storage {
    memory: Option<Memory>,
    data: *mut u8,
    len: usize,
    device: DLDevice,
}

// SAFETY: `data` points into memory owned by `memory` (an AlignedBuf, which is Send + Sync like
// Vec<u8>, or a GdsBuffer, which gds-io declares Send + Sync); Storage itself never dereferences
// it, so sharing or moving it across threads adds no data race of its own.
unsafe impl Send for Storage {}
// SAFETY: as above; `&Storage` only hands out the address.
unsafe impl Sync for Storage {}

impl Storage {
    pub fn host(mut buffer: AlignedBuf) -> Storage {
        let (len, data) = (buffer.len(), buffer.as_mut_ptr());
        Storage::counted(Memory::Host(buffer), data, len, DLDevice::CPU)
    }

    pub fn device(buffer: GdsBuffer, ordinal: usize) -> Storage {
        let (len, data) = (buffer.len(), buffer.device_ptr() as usize as *mut u8);
        Storage::counted(
            Memory::Device(buffer),
            data,
            len,
            DLDevice::cuda(ordinal as i32),
        )
    }

    fn counted(memory: Memory, data: *mut u8, len: usize, device: DLDevice) -> Storage {
        let (buffers, bytes) = counters(&memory);
        buffers.fetch_add(1, Ordering::SeqCst);
        bytes.fetch_add(len as i64, Ordering::SeqCst);
        Storage {
            memory: Some(memory),
            data,
            len,
            device,
        }
    }

    /// The address `offset` bytes into the buffer (a device address for GPU memory).
    ///
    /// # Panics
    /// If `offset > len()` (callers check ranges when they build a view).
    pub fn address(&self, offset: usize) -> *mut c_void {
        assert!(offset <= self.len, "offset {offset} beyond {}", self.len);
        self.data.wrapping_add(offset).cast()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn dl_device(&self) -> DLDevice {
        self.device
    }

    /// Whether this is device memory registered with cuFile.
    pub fn is_registered(&self) -> bool {
        matches!(&self.memory, Some(Memory::Device(buffer)) if buffer.is_registered())
    }

    /// Copies `range` back into host memory (after any pending read into it lands).
    pub fn copy_to_host(&self, range: std::ops::Range<usize>) -> Result<Vec<u8>, gds_io::GdsError> {
        match &self.memory {
            Some(Memory::Device(buffer)) => {
                let _restore = CurrentContext::save();
                buffer.copy_to_host(range)
            }
            Some(Memory::Host(_)) => {
                if range.start > range.end || range.end > self.len {
                    return Err(gds_io::GdsError::RangeOutsideBuffer {
                        start: range.start,
                        end: range.end,
                        buffer_len: self.len,
                    });
                }
                // SAFETY: the range lies inside the live host allocation (checked above); the
                // copy is a plain read of initialised bytes. A consumer writing the same bytes
                // concurrently would race, as with any shared DLPack memory.
                Ok(
                    unsafe { std::slice::from_raw_parts(self.data.add(range.start), range.len()) }
                        .to_vec(),
                )
            }
            None => unreachable!("memory is only taken in Drop"),
        }
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        let Some(memory) = self.memory.take() else {
            return;
        };
        let (buffers, bytes) = counters(&memory);
        // The deleter may run on any thread, including one where PyTorch has a context
        // current: GdsBuffer's Drop binds ours, so put theirs back afterwards.
        let restore = matches!(memory, Memory::Device(_)).then(CurrentContext::save);
        drop(memory);
        drop(restore);
        buffers.fetch_sub(1, Ordering::SeqCst);
        bytes.fetch_sub(self.len as i64, Ordering::SeqCst);
    }
}

/// The live-buffer and live-byte counters of `memory`'s kind.
fn counters(memory: &Memory) -> (&'static AtomicI64, &'static AtomicI64) {
    match memory {
        Memory::Host(_) => (&HOST_BUFFERS, &HOST_BYTES),
        Memory::Device(_) => (&DEVICE_BUFFERS, &DEVICE_BYTES),
    }
}

/// Puts back, on drop, the CUDA context that was current on this thread when it was made.
/// gds-io makes its context current (`cuCtxSetCurrent`) on the calling thread; the CUDA runtime
/// (PyTorch, CuPy) derives its "current device" from that, so leaving ours current would move a
/// caller working on another GPU. Only made once libcuda is known to be loadable.
pub struct CurrentContext {
    /// `None` without libcuda; `Some(None)` when no context was current (then none is left
    /// current either).
    saved: Option<Option<sys::CUcontext>>,
}

impl CurrentContext {
    pub fn save() -> CurrentContext {
        let saved = if gds_io::cuda_driver_present() {
            result::ctx::get_current().ok()
        } else {
            None
        };
        CurrentContext { saved }
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        if let Some(ctx) = self.saved {
            let ctx = ctx.unwrap_or(std::ptr::null_mut());
            // SAFETY: `ctx` is null (no context current) or was current on this thread moments
            // ago; the context it names is a primary context retained by whoever made it
            // current (PyTorch or us), so it is still alive. cuCtxSetCurrent has no other
            // precondition.
            let _ = unsafe { result::ctx::set_current(ctx) };
        }
    }
}
