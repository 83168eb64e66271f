//! The GPU side: a context handle, device buffers that cuFile may register, pinned host memory.
//!
//! Device memory is allocated with plain `cuMemAlloc` rather than cudarc's stream-ordered
//! allocator: cuFile registers and DMAs into ordinary device allocations, and a buffer that
//! outlives streams is what a residency slot needs.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result, sys};

use crate::driver::Driver;
use crate::error::{GdsError, check};

/// Whether the CUDA driver library (libcuda.so) can be loaded at all. Checked before any
/// cudarc call, because cudarc panics when the library is missing.
pub fn cuda_driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; no other preconditions.
    unsafe { sys::is_culib_present() }
}

/// A CUDA device's primary context. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    /// The non-blocking stream that host-to-device copies run on (made on first use, shared
    /// by the clones).
    copies: Arc<Mutex<Option<Arc<CudaStream>>>>,
}

impl Gpu {
    /// Opens GPU `ordinal`, or explains why there is none (no libcuda, no device, driver error).
    pub fn open(ordinal: usize) -> Result<Gpu, GdsError> {
        if !cuda_driver_present() {
            return Err(GdsError::NoGpu {
                reason: format!(
                    "the CUDA driver library (libcuda.so.1) is not loadable (LD_LIBRARY_PATH={})",
                    std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "<unset>".into())
                ),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|err| GdsError::NoGpu {
            reason: format!("cannot open CUDA device {ordinal}: {err}"),
        })?;
        Ok(Gpu {
            ctx,
            copies: Arc::new(Mutex::new(None)),
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Device name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> Result<String, GdsError> {
        self.ctx.name().map_err(GdsError::cuda("cuDeviceGetName"))
    }

    /// A new non-blocking stream on this GPU.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, GdsError> {
        self.ctx
            .new_stream()
            .map_err(GdsError::cuda("cuStreamCreate"))
    }

    /// (free, total) bytes of device memory now.
    pub fn memory_info(&self) -> Result<(u64, u64), GdsError> {
        self.bind()?;
        let (free, total) = result::mem_get_info().map_err(GdsError::cuda("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }

    pub(crate) fn bind(&self) -> Result<(), GdsError> {
        self.ctx
            .bind_to_thread()
            .map_err(GdsError::cuda("cuCtxSetCurrent"))
    }

    /// The stream of [`GdsBuffer::copy_from_host`]. A copy on the legacy default stream (what
    /// the synchronous `cuMemcpyHtoD` uses) is ordered against every blocking stream of the
    /// context; on a non-blocking stream of its own it only waits for itself, so it overlaps
    /// whatever compute the other streams run.
    fn copy_stream(&self) -> Result<Arc<CudaStream>, GdsError> {
        let mut slot = self.copies.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(stream) = slot.as_ref() {
            return Ok(Arc::clone(stream));
        }
        let stream = self.new_stream()?;
        *slot = Some(Arc::clone(&stream));
        Ok(stream)
    }

    pub(crate) fn new_event(&self) -> Result<CudaEvent, GdsError> {
        self.ctx
            .new_event(None)
            .map_err(GdsError::cuda("cuEventCreate"))
    }
}

/// A block of device memory that reads land in. Optionally registered with cuFile
/// ([`GdsBuffer::register`]); registration is undone before the memory is freed, and the
/// memory is not freed while an asynchronous read into it is still pending.
pub struct GdsBuffer {
    gpu: Gpu,
    ptr: sys::CUdeviceptr,
    len: usize,
    registered_with: Option<Arc<Driver>>,
    /// Completion of the last asynchronous write into this buffer.
    pub(crate) pending: Mutex<Option<CudaEvent>>,
}

impl std::fmt::Debug for GdsBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GdsBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("registered", &self.registered_with.is_some())
            .finish()
    }
}

impl GdsBuffer {
    /// Allocates `len` bytes of device memory (contents undefined until read into).
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<GdsBuffer, GdsError> {
        if len == 0 {
            return Err(GdsError::EmptyAllocation);
        }
        gpu.bind()?;
        // SAFETY: the context is current on this thread; the pointer is owned by the returned
        // value and freed exactly once in Drop.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(GdsError::cuda("cuMemAlloc"))?;
        Ok(GdsBuffer {
            gpu: gpu.clone(),
            ptr,
            len,
            registered_with: None,
            pending: Mutex::new(None),
        })
    }

    /// Allocates and registers with cuFile; registration failure is logged and the buffer is
    /// returned unregistered (cuFile then stages through its own internal buffers).
    pub fn alloc_registered(
        gpu: &Gpu,
        driver: &Arc<Driver>,
        len: usize,
    ) -> Result<GdsBuffer, GdsError> {
        let mut buffer = GdsBuffer::alloc(gpu, len)?;
        if let Err(err) = buffer.register(driver) {
            tracing::warn!("{err}; reads into this buffer go through cuFile's bounce buffers");
        }
        Ok(buffer)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The raw device address, for kernels and copies.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The whole buffer as a borrowed device range.
    pub fn as_device_ptr(&self) -> crate::DevicePtr<'_> {
        // SAFETY: the buffer owns `len` bytes at `ptr` and frees them only in Drop, which the
        // borrow keeps from running.
        unsafe { crate::DevicePtr::from_raw(self.ptr, self.len) }
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn is_registered(&self) -> bool {
        self.registered_with.is_some()
    }

    /// Registers the whole buffer (`len` bytes) with cuFile for direct DMA. Idempotent.
    pub fn register(&mut self, driver: &Arc<Driver>) -> Result<(), GdsError> {
        if self.registered_with.is_some() {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: `ptr` is a live device allocation of exactly `len` bytes owned by self; it
        // stays allocated until Drop, which deregisters first.
        let status =
            unsafe { (driver.api().buf_register)(self.ptr as *const libc::c_void, self.len, 0) };
        check("cuFileBufRegister", status)?;
        driver.count_buffer(1);
        self.registered_with = Some(driver.clone());
        Ok(())
    }

    /// Waits until every asynchronous read into this buffer has landed.
    pub fn wait_pending(&self) -> Result<(), GdsError> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(event) = pending {
            event
                .synchronize()
                .map_err(GdsError::cuda("cuEventSynchronize"))?;
        }
        Ok(())
    }

    /// Copies `range` of the buffer back to host memory (after pending reads land).
    pub fn copy_to_host(&self, range: std::ops::Range<usize>) -> Result<Vec<u8>, GdsError> {
        if range.start > range.end || range.end > self.len {
            return Err(GdsError::RangeOutsideBuffer {
                start: range.start,
                end: range.end,
                buffer_len: self.len,
            });
        }
        self.wait_pending()?;
        self.gpu.bind()?;
        let mut host = vec![0u8; range.len()];
        // SAFETY: the source range lies inside this live allocation and `host` has room for it.
        unsafe { result::memcpy_dtoh_sync(&mut host, self.ptr + range.start as u64) }
            .map_err(GdsError::cuda("cuMemcpyDtoH"))?;
        Ok(host)
    }

    /// Shows `range` of the buffer to `visit` in order, `staging.piece_bytes()` at a time, from
    /// page-locked memory: piece i+1 is copied back over PCIe while `visit` reads piece i, so a
    /// checksum of device-resident bytes runs at the slower of the copy and the hash instead of
    /// their sum (and without allocating pageable memory per piece, as `copy_to_host` does).
    pub fn visit_on_host(
        &self,
        range: std::ops::Range<usize>,
        staging: &mut HostStaging,
        mut visit: impl FnMut(&[u8]),
    ) -> Result<(), GdsError> {
        if range.start > range.end || range.end > self.len {
            return Err(GdsError::RangeOutsideBuffer {
                start: range.start,
                end: range.end,
                buffer_len: self.len,
            });
        }
        if range.is_empty() {
            return Ok(());
        }
        self.wait_pending()?;
        self.gpu.bind()?;
        let piece = staging.piece_bytes();
        let pieces: Vec<std::ops::Range<usize>> = range
            .clone()
            .step_by(piece)
            .map(|start| start..(start + piece).min(range.end))
            .collect();
        let mut copied: [Option<CudaEvent>; 2] = [None, None];
        copied[0] = Some(staging.copy_back(&self.gpu, 0, self.ptr, &pieces[0])?);
        for i in 0..pieces.len() {
            if let Some(next) = pieces.get(i + 1) {
                // The other buffer held piece i-1, which `visit` has finished with.
                copied[(i + 1) % 2] =
                    Some(staging.copy_back(&self.gpu, (i + 1) % 2, self.ptr, next)?);
            }
            if let Some(event) = copied[i % 2].take() {
                event
                    .synchronize()
                    .map_err(GdsError::cuda("cuEventSynchronize"))?;
            }
            visit(&staging.bufs[i % 2].as_slice()[..pieces[i].len()]);
        }
        Ok(())
    }

    /// Copies `bytes` into the buffer at `offset` and returns once they are in device memory
    /// (after pending reads into the buffer land). From pinned memory ([`PinnedHostBuf`]) the
    /// copy runs at full PCIe speed; from pageable memory the driver stages it.
    pub fn copy_from_host(&self, offset: usize, bytes: &[u8]) -> Result<(), GdsError> {
        let end = offset.checked_add(bytes.len()).filter(|&e| e <= self.len);
        let Some(_) = end else {
            return Err(GdsError::RangeOutsideBuffer {
                start: offset,
                end: offset.saturating_add(bytes.len()),
                buffer_len: self.len,
            });
        };
        if bytes.is_empty() {
            return Ok(());
        }
        self.wait_pending()?;
        self.gpu.bind()?;
        let stream = self.gpu.copy_stream()?;
        // SAFETY: the destination range lies inside this live allocation (checked above) and
        // `bytes` is a live host slice of exactly that length, borrowed until the stream has
        // finished the copy below.
        unsafe { result::memcpy_htod_async(self.ptr + offset as u64, bytes, stream.cu_stream()) }
            .map_err(GdsError::cuda("cuMemcpyHtoDAsync"))?;
        stream
            .synchronize()
            .map_err(GdsError::cuda("cuStreamSynchronize"))
    }

    pub(crate) fn set_pending(&self, event: CudaEvent) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(event);
    }
}

impl Drop for GdsBuffer {
    fn drop(&mut self) {
        if let Err(err) = self.wait_pending() {
            tracing::error!("pending read into a device buffer failed at drop: {err}");
        }
        if self.gpu.bind().is_err() {
            return;
        }
        if let Some(driver) = self.registered_with.take() {
            // SAFETY: `ptr` was registered by `register` and is still allocated.
            let status = unsafe { (driver.api().buf_deregister)(self.ptr as *const libc::c_void) };
            match check("cuFileBufDeregister", status) {
                Ok(()) => driver.count_buffer(-1),
                Err(err) => tracing::warn!("{err}"),
            }
        }
        // SAFETY: allocated by cuMemAlloc in `alloc`, no pending work (waited above), no longer
        // registered, freed once.
        if let Err(err) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!("cuMemFree failed: {err}");
        }
    }
}

// SAFETY: the buffer is a device address plus owned bookkeeping; CUDA allows any thread with
// the context current to use it, and every method binds the context first.
unsafe impl Send for GdsBuffer {}
// SAFETY: `&GdsBuffer` methods only read the address or go through the Mutex.
unsafe impl Sync for GdsBuffer {}

/// Page-locked host memory that a caller owns: the pinned host tier of the residency cache,
/// whose copies to the device must run at full PCIe speed. Page aligned, so O_DIRECT reads
/// can land in it directly.
pub struct PinnedHostBuf {
    inner: PinnedBuf,
}

impl PinnedHostBuf {
    /// `len` bytes of page-locked memory, rounded up to a multiple of 4096; the contents are
    /// zeroed.
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<PinnedHostBuf, GdsError> {
        let len = len.max(1).next_multiple_of(crate::aligned::IO_ALIGN);
        let mut inner = PinnedBuf::alloc(gpu, len)?;
        inner.as_mut_slice().fill(0);
        Ok(PinnedHostBuf { inner })
    }
}

impl std::ops::Deref for PinnedHostBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.inner.as_slice()
    }
}

impl std::ops::DerefMut for PinnedHostBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.inner.as_mut_slice()
    }
}

impl std::fmt::Debug for PinnedHostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostBuf")
            .field("len", &self.inner.len)
            .finish()
    }
}

/// Two page-locked buffers and a stream for [`GdsBuffer::visit_on_host`]: kept by a caller
/// that reads device memory back often (the residency cache's checksums), so the pinned
/// allocation is paid once.
pub struct HostStaging {
    bufs: [PinnedBuf; 2],
    stream: Arc<CudaStream>,
}

impl HostStaging {
    /// Two pieces of `piece_bytes` (rounded up to 4096) of page-locked memory.
    pub fn alloc(gpu: &Gpu, piece_bytes: usize) -> Result<HostStaging, GdsError> {
        let len = piece_bytes
            .max(1)
            .next_multiple_of(crate::aligned::IO_ALIGN);
        Ok(HostStaging {
            bufs: [PinnedBuf::alloc(gpu, len)?, PinnedBuf::alloc(gpu, len)?],
            stream: gpu.new_stream()?,
        })
    }

    /// Starts copying `part` of the device allocation at `base` into buffer `which` on the
    /// staging stream; the returned event completes when the bytes are there.
    fn copy_back(
        &mut self,
        gpu: &Gpu,
        which: usize,
        base: sys::CUdeviceptr,
        part: &std::ops::Range<usize>,
    ) -> Result<CudaEvent, GdsError> {
        let dst = &mut self.bufs[which].as_mut_slice()[..part.len()];
        // SAFETY: the caller (`GdsBuffer::visit_on_host`) checked that `part` lies inside the
        // live allocation at `base`; `dst` is page-locked memory owned by `self`, borrowed
        // mutably by the caller for the whole visit, and read only after the event recorded
        // below has completed.
        unsafe {
            result::memcpy_dtoh_async(dst, base + part.start as u64, self.stream.cu_stream())
        }
        .map_err(GdsError::cuda("cuMemcpyDtoHAsync"))?;
        let event = gpu.new_event()?;
        event
            .record(&self.stream)
            .map_err(GdsError::cuda("cuEventRecord"))?;
        Ok(event)
    }

    /// The bytes copied back per step.
    pub fn piece_bytes(&self) -> usize {
        self.bufs[0].len
    }
}

impl Drop for HostStaging {
    fn drop(&mut self) {
        // A visit that failed half way may leave a copy into the buffers in flight: let it
        // land before the page-locked memory is freed.
        if let Err(err) = self.stream.synchronize() {
            tracing::warn!("staging stream synchronize failed before freeing its buffers: {err}");
        }
    }
}

impl std::fmt::Debug for HostStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStaging")
            .field("piece_bytes", &self.piece_bytes())
            .finish()
    }
}

/// Page-locked host memory (page aligned, so usable for O_DIRECT) for async host→device copies.
pub(crate) struct PinnedBuf {
    gpu: Gpu,
    ptr: *mut u8,
    len: usize,
}

impl PinnedBuf {
    pub(crate) fn alloc(gpu: &Gpu, len: usize) -> Result<PinnedBuf, GdsError> {
        gpu.bind()?;
        // SAFETY: context is current; the pointer is owned and freed once in Drop.
        let ptr =
            unsafe { result::malloc_host(len, 0) }.map_err(GdsError::cuda("cuMemHostAlloc"))?;
        Ok(PinnedBuf {
            gpu: gpu.clone(),
            ptr: ptr.cast(),
            len,
        })
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` bytes owned by self; `&mut self` makes access exclusive.
        // cuMemHostAlloc memory may hold garbage but any byte pattern is a valid u8.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: as above, shared access.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `alloc`; callers synchronise the copies
            // reading from it before dropping (the bounce ring waits on its slot events).
            if let Err(err) = unsafe { result::free_host(self.ptr.cast()) } {
                tracing::warn!("cuMemFreeHost failed: {err}");
            }
        }
    }
}

// SAFETY: owned, exclusively accessed memory (like Vec<u8>).
unsafe impl Send for PinnedBuf {}
// SAFETY: shared access is read-only.
unsafe impl Sync for PinnedBuf {}
