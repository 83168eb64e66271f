//! The device: the one stream every op is queued on ([`Queue`]), cuBLAS on it, the compiled
//! kernels ([`Kernels`]) and the weight dtype codes they share with the `.cu` files.
//!
//! Every piece of work that reaches the device — a launch, a copy, an allocation, a GEMM, a
//! graph replay — goes through a [`Queue`] method, and each one counts itself
//! ([`Queue::issued`]). The raw stream is private to this module, so the count cannot be
//! bypassed: `scratch`'s memo of quantized activations relies on it to know that nothing ran
//! between the op that wrote them and the matmul that reads them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DeviceRepr, DriverError, LaunchConfig, PinnedHostSlice, ValidAsZeroBits,
};
use weights_format::DType;

use crate::LlamaError;
use crate::backend::BackendError;

use super::compile;
use super::profile::Profile;

/// Threads per block of elementwise kernels.
pub(super) const ELEMENT_THREADS: u32 = 256;

/// A launch configuration of one thread per element, `n` elements.
pub(super) fn elementwise(n: usize) -> LaunchConfig {
    blocks(((n as u32).div_ceil(ELEMENT_THREADS), 1), ELEMENT_THREADS)
}

/// The dtype codes of the kernels: the position in [`DType::ALL`] (0–5 in `common.cuh`,
/// 6–14, the dtypes added with the k-quants, in `kquants.cu`, whose `KQ_*` defines match).
pub(super) fn dtype_code(dtype: DType) -> i32 {
    DType::ALL
        .iter()
        .position(|d| *d == dtype)
        .expect("DType::ALL has every dtype") as i32
}

/// Whether `dtype`'s kernels are those of `kernels/kquants.cu` (its embedding lookup is
/// `kq_embed_rows`).
pub(super) fn kq_kernels(dtype: DType) -> bool {
    dtype_code(dtype) >= 6
}

pub(super) fn device_error(message: impl Into<String>) -> LlamaError {
    LlamaError::Device {
        message: message.into(),
    }
}

/// The device's streaming multiprocessors, and whether it has the tensor-core instructions the
/// mma kernels use (`mma.sync` with 8-bit integers and bf16: compute capability 8.0 and later).
pub(super) fn capabilities(ctx: &Arc<CudaContext>) -> Result<(u32, bool), LlamaError> {
    use cudarc::driver::sys::CUdevice_attribute;
    let sms = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| device_error(format!("cuDeviceGetAttribute(multiprocessors): {e}")))?;
    let (major, _) = ctx
        .compute_capability()
        .map_err(|e| device_error(format!("cuDeviceGetAttribute(compute capability): {e}")))?;
    Ok((sms.max(1) as u32, major >= 8))
}

/// Opens device `ordinal` after checking that the driver and NVRTC libraries load (cudarc
/// panics on the first call into a missing library, so this comes before any other call).
pub(super) fn open_context(ordinal: usize) -> Result<Arc<CudaContext>, LlamaError> {
    let library_path = || std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "<unset>".into());
    // SAFETY: `is_culib_present` only tries to dlopen the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(device_error(format!(
            "the CUDA driver library (libcuda.so.1) is not loadable (LD_LIBRARY_PATH={})",
            library_path()
        )));
    }
    // SAFETY: as above, for libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(device_error(format!(
            "the NVRTC library (libnvrtc.so) is not loadable; it ships with the CUDA \
             toolkit, e.g. LD_LIBRARY_PATH=/usr/local/cuda/lib64 (now {})",
            library_path()
        )));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| device_error(format!("cannot open CUDA device {ordinal}: {e}")))?;
    // SAFETY: nothing has been allocated or launched on this context object yet. Every op
    // runs on the one stream of the `Queue`, so the per-buffer events that cudarc would record
    // to order several streams are unnecessary, and raw device pointers are passed to kernels.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

/// The stream every op of the backend is queued on, cuBLAS bound to it, and the count of the
/// work queued so far.
pub(super) struct Queue {
    stream: Arc<CudaStream>,
    /// "NVIDIA H100 80GB HBM3 (0)", for errors.
    device: String,
    issued: AtomicU64,
    /// Kernels (launches and GEMMs) that ran or are queued to run, those of each graph replay
    /// included ([`Queue::kernels_run`]).
    kernels_run: AtomicU64,
    /// Kernels queued since the current recording began (they run when it is replayed).
    kernels_recorded: AtomicU64,
    /// cuBLAS on the same stream, when libcublas loads.
    blas: Option<cudarc::cublas::CudaBlas>,
    /// GPU time per op, when asked for (see [`super::profile`]).
    profile: Option<Profile>,
    /// Whether a graph is being recorded (then nothing is timed).
    capturing: AtomicBool,
    /// Whether kernels are launched with programmatic stream serialization (programmatic
    /// dependent launch): see [`pdl_supported`].
    pdl: bool,
}

/// The environment variable that turns programmatic dependent launch off (`0`), for
/// comparisons.
pub const PDL_ENV: &str = "GDSLLM_CUDA_PDL";

/// Whether kernels on `ctx`'s device are launched with programmatic dependent launch: the next
/// kernel's blocks are scheduled while the current one finishes, and wait in `pdl_begin`
/// (common.cuh), which every kernel calls before touching memory, until it has. That needs
/// compute capability 9.0 (`griddepcontrol`, which the kernels are compiled with there: NVRTC
/// targets the device's own architecture) and a driver of CUDA 12.3 or later (which records such
/// launches into CUDA graphs). `GDSLLM_CUDA_PDL=0` turns it off.
fn pdl_supported(ctx: &Arc<CudaContext>) -> bool {
    if std::env::var(PDL_ENV).is_ok_and(|v| v == "0") {
        return false;
    }
    let Ok((major, _)) = ctx.compute_capability() else {
        return false;
    };
    let mut driver = 0;
    // SAFETY: writes one int to a live local; the driver library is loaded (a context exists).
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    major >= 9 && status.result().is_ok() && driver >= 12030
}

impl Queue {
    pub fn new(ctx: &Arc<CudaContext>, device: String) -> Result<Queue, LlamaError> {
        let stream = ctx
            .new_stream()
            .map_err(|e| device_error(format!("cuStreamCreate: {e}")))?;
        // SAFETY: only tries to dlopen libcublas; cudarc panics on a call into a missing library.
        let blas = if unsafe { cudarc::cublas::sys::is_culib_present() } {
            match cudarc::cublas::CudaBlas::new(stream.clone()) {
                Ok(b) => Some(b),
                Err(e) => {
                    tracing::warn!(
                        "cuBLAS did not initialise ({e}); f16/bf16 prefill uses the built-in matmul kernel"
                    );
                    None
                }
            }
        } else {
            tracing::info!(
                "libcublas is not loadable; f16/bf16 prefill uses the built-in matmul kernel"
            );
            None
        };
        let pdl = pdl_supported(ctx);
        tracing::debug!(
            pdl,
            "programmatic dependent launch ({PDL_ENV}=0 turns it off)"
        );
        Ok(Queue {
            stream,
            device,
            issued: AtomicU64::new(0),
            kernels_run: AtomicU64::new(0),
            kernels_recorded: AtomicU64::new(0),
            blas,
            profile: Profile::from_env(),
            capturing: AtomicBool::new(false),
            pdl,
        })
    }

    /// Queues `kernel` with `args` (pointers to the argument values, in order) on the stream,
    /// with programmatic stream serialization where the device has it.
    ///
    /// # Safety
    ///
    /// As [`Launch::run`]: the arguments must be what the kernel expects, every address valid
    /// for what it reads and writes with `cfg`, and every pointer in `args` live until this
    /// returns.
    unsafe fn launch_raw(
        &self,
        kernel: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), DriverError> {
        use cudarc::driver::sys;
        self.stream.context().bind_to_thread()?;
        if !self.pdl {
            // SAFETY: the caller vouches for the kernel, its arguments and the grid.
            return unsafe {
                cudarc::driver::result::launch_kernel(
                    kernel.cu_function(),
                    cfg.grid_dim,
                    cfg.block_dim,
                    cfg.shared_mem_bytes,
                    self.stream.cu_stream(),
                    args,
                )
            };
        }
        // SAFETY: an all-zero attribute is a valid value of this plain C struct.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: `config` and `attr` live across the call; the caller vouches for the kernel,
        // its arguments and the grid; every kernel of this backend calls `pdl_begin` before it
        // touches memory, which is what makes the relaxed serialization safe.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                kernel.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }

    /// Queues `op` through `queue_it`, timed when profiling (and not recording).
    fn timed<R>(&self, op: &'static str, queue_it: impl FnOnce() -> R) -> R {
        match &self.profile {
            Some(p) if !self.capturing.load(Ordering::Relaxed) => {
                p.time(&self.stream, op, queue_it)
            }
            _ => queue_it(),
        }
    }

    /// Work queued so far: launches, copies, allocations, GEMMs, graph replays.
    pub fn issued(&self) -> u64 {
        self.issued.load(Ordering::Relaxed)
    }

    fn issue(&self) {
        self.issued.fetch_add(1, Ordering::Relaxed);
    }

    /// Kernel launches and GEMMs run so far, counting each replay of a recording as the
    /// kernels recorded in it (a GEMM counts as one, whatever cuBLAS launches for it).
    pub fn kernels_run(&self) -> u64 {
        self.kernels_run.load(Ordering::Relaxed)
    }

    /// Counts one kernel (or GEMM): run now, or part of the recording under way.
    fn count_kernel(&self) {
        if self.capturing.load(Ordering::Relaxed) {
            self.kernels_recorded.fetch_add(1, Ordering::Relaxed);
        } else {
            self.kernels_run.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The error of `op` failing with `source`.
    pub fn error(&self, op: &'static str, source: DriverError) -> BackendError {
        BackendError::Cuda {
            device: self.device.clone(),
            op,
            source,
        }
    }

    /// Whether cuBLAS is there.
    pub fn has_blas(&self) -> bool {
        self.blas.is_some()
    }

    /// A launch of `kernel` (the arguments follow), reported as `op` if it fails.
    pub fn kernel<'a>(&'a self, kernel: &'a CudaFunction, op: &'static str) -> Launch<'a> {
        Launch {
            kernel,
            args: Vec::new(),
            queue: self,
            op,
        }
    }

    /// `len` zeroed values.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        op: &'static str,
    ) -> Result<CudaSlice<T>, BackendError> {
        self.issue();
        self.stream
            .alloc_zeros(len.max(1))
            .map_err(|e| self.error(op, e))
    }

    /// `len` values, not initialised.
    ///
    /// # Safety
    ///
    /// Nothing may read the values before a queued op has written them.
    pub unsafe fn alloc<T: DeviceRepr>(
        &self,
        len: usize,
        op: &'static str,
    ) -> Result<CudaSlice<T>, BackendError> {
        self.issue();
        // SAFETY: the caller writes before reading.
        unsafe { self.stream.alloc(len.max(1)) }.map_err(|e| self.error(op, e))
    }

    /// A new device copy of `data`.
    pub fn upload<T: DeviceRepr>(
        &self,
        data: &[T],
        op: &'static str,
    ) -> Result<CudaSlice<T>, BackendError> {
        self.issue();
        self.stream.clone_htod(data).map_err(|e| self.error(op, e))
    }

    /// `data` into the start of `dst`.
    pub fn write<T: DeviceRepr>(
        &self,
        data: &[T],
        dst: &mut CudaSlice<T>,
        op: &'static str,
    ) -> Result<(), BackendError> {
        self.issue();
        self.stream
            .memcpy_htod(data, dst)
            .map_err(|e| self.error(op, e))
    }

    /// The first `values` values of `src` into the start of `dst`, on the stream.
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut CudaSlice<T>,
        values: usize,
        op: &'static str,
    ) -> Result<(), BackendError> {
        self.issue();
        self.stream
            .memcpy_dtod(&src.slice(0..values), &mut dst.slice_mut(0..values))
            .map_err(|e| self.error(op, e))
    }

    /// The first `out.len()` values of `src`, once everything queued before has run.
    pub fn read<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        out: &mut [T],
        op: &'static str,
    ) -> Result<(), BackendError> {
        self.issue();
        self.stream
            .memcpy_dtoh(&src.slice(0..out.len()), out)
            .map_err(|e| self.error(op, e))?;
        self.synchronize()?;
        if let Some(p) = &self.profile {
            p.settle();
        }
        Ok(())
    }

    pub fn synchronize(&self) -> Result<(), BackendError> {
        self.stream
            .synchronize()
            .map_err(|e| self.error("synchronising the stream", e))
    }

    /// The device address of `s`.
    pub fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    /// One cuBLAS `gemm_ex` on this stream; `false` when there is no cuBLAS.
    ///
    /// # Safety
    ///
    /// Every pointer of `args` must be a live device allocation of the extent the GEMM's
    /// dimensions and leading dimensions give it.
    pub unsafe fn gemm(&self, args: GemmArgs) -> Result<(), BackendError> {
        let Some(blas) = &self.blas else {
            return Err(BackendError::Unsupported {
                op: "cublasGemmEx",
                message: "cuBLAS is not loaded".into(),
            });
        };
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
        self.issue();
        self.count_kernel();
        // SAFETY: the handle runs on this queue's stream; the caller vouches for the pointers.
        let r = self.timed("cublasGemmEx", || unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                args.m,
                args.n,
                args.k,
                (&args.alpha as *const f32).cast(),
                args.a as *const std::ffi::c_void,
                args.ab_type,
                args.k,
                args.b as *const std::ffi::c_void,
                args.ab_type,
                args.k,
                (&args.beta as *const f32).cast(),
                args.c as *mut std::ffi::c_void,
                cudarc::cublas::sys::cudaDataType::CUDA_R_32F,
                args.m,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        });
        r.map_err(|source| BackendError::Cublas {
            device: self.device.clone(),
            op: "cublasGemmEx",
            source,
        })
    }

    /// Starts recording what is queued into a graph instead of running it. Thread-local: the
    /// residency reader's driver calls on other threads stay legal.
    pub fn begin_capture(&self) -> Result<(), DriverError> {
        self.kernels_recorded.store(0, Ordering::Relaxed);
        self.capturing.store(true, Ordering::Relaxed);
        let r = self
            .stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        if r.is_err() {
            self.capturing.store(false, Ordering::Relaxed);
        }
        r
    }

    /// Ends the recording: the graph of what was queued since [`Queue::begin_capture`], and
    /// how many kernels (launches and GEMMs) were queued into it.
    pub fn end_capture(&self) -> Result<(Option<CudaGraph>, u64), DriverError> {
        let r = self.stream.end_capture(CUgraphInstantiate_flags(0));
        self.capturing.store(false, Ordering::Relaxed);
        r.map(|graph| (graph, self.kernels_recorded.load(Ordering::Relaxed)))
    }

    /// Queues a recorded graph of `kernels` kernels (as [`Queue::end_capture`] counted them).
    pub fn launch_graph(&self, graph: &CudaGraph, kernels: u64) -> Result<(), BackendError> {
        self.issue();
        self.kernels_run.fetch_add(kernels, Ordering::Relaxed);
        self.timed("graph replay", || graph.launch())
            .map_err(|e| self.error("cuGraphLaunch", e))
    }

    /// An event after everything queued so far, whose `synchronize` blocks the calling
    /// thread (it sleeps instead of spinning a core). Writes nothing.
    pub fn record_blocking_event(&self) -> Result<CudaEvent, DriverError> {
        self.stream
            .record_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
    }

    /// `len` f32 values of page-locked host memory mapped into the device's address space, and
    /// the device address of its first value: kernels read it over PCIe themselves, without a
    /// copy-engine transfer (which would queue behind the residency ring's streamed copies).
    /// The memory is zeroed.
    pub fn alloc_mapped(
        &self,
        len: usize,
        op: &'static str,
    ) -> Result<(PinnedHostSlice<f32>, u64), BackendError> {
        use cudarc::driver::sys;
        let ctx = self.stream.context();
        // SAFETY: `alloc_pinned_with_flags` leaves the memory uninitialised; it is zeroed below
        // before anything reads it.
        let mut host = unsafe {
            ctx.alloc_pinned_with_flags::<f32>(len.max(1), sys::CU_MEMHOSTALLOC_DEVICEMAP)
        }
        .map_err(|e| self.error(op, e))?;
        let values = host.as_mut_slice().map_err(|e| self.error(op, e))?;
        values.fill(0.0);
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `values` is the start of a live allocation made with
        // CU_MEMHOSTALLOC_DEVICEMAP in this context (bound to this thread by the allocation);
        // the call writes one device pointer to a live local.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, values.as_mut_ptr().cast(), 0) }
            .result()
            .map_err(|e| self.error(op, e))?;
        Ok((host, dev))
    }

    /// An event that [`Queue::record`] places on the stream and [`Queue::wait_for`] waits for
    /// (spinning: it guards microseconds of work).
    pub fn new_event(&self, op: &'static str) -> Result<CudaEvent, BackendError> {
        self.stream
            .context()
            .new_event(None)
            .map_err(|e| self.error(op, e))
    }

    /// Records `event` after everything queued so far.
    pub fn record(&self, event: &CudaEvent, op: &'static str) -> Result<(), BackendError> {
        self.issue();
        event.record(&self.stream).map_err(|e| self.error(op, e))
    }

    /// Blocks until the work before the last [`Queue::record`] of `event` has run (at once if
    /// it was never recorded).
    pub fn wait_for(&self, event: &CudaEvent, op: &'static str) -> Result<(), BackendError> {
        event.synchronize().map_err(|e| self.error(op, e))
    }

    /// Device-to-device copy speed over `bytes`-byte buffers: (bytes read, bytes read + bytes
    /// written) per second, in GB/s, best of a few copies.
    pub fn measure_copy_gbps(&self, bytes: usize) -> Result<(f64, f64), BackendError> {
        let src = self.alloc_zeros::<u8>(bytes, "copy benchmark")?;
        let mut dst = self.alloc_zeros::<u8>(bytes, "copy benchmark")?;
        let best = self.best_of(
            6,
            || self.stream.memcpy_dtod(&src, &mut dst),
            "copy benchmark",
        )?;
        let read = bytes as f64 / best / 1e9;
        Ok((read, 2.0 * read))
    }

    /// Host-to-device copy speed from page-locked memory over `bytes` bytes, GB/s, best of a
    /// few copies.
    pub fn measure_pinned_h2d_gbps(&self, bytes: usize) -> Result<f64, BackendError> {
        // SAFETY: `alloc_pinned` leaves the memory uninitialised; it is only ever a copy source
        // and every byte pattern is a valid u8.
        let host = unsafe { self.stream.context().alloc_pinned::<u8>(bytes) }
            .map_err(|e| self.error("H2D benchmark", e))?;
        let mut dst = self.alloc_zeros::<u8>(bytes, "H2D benchmark")?;
        let best = self.best_of(
            4,
            || self.stream.memcpy_htod(&host, &mut dst),
            "H2D benchmark",
        )?;
        Ok(bytes as f64 / best / 1e9)
    }

    /// Pinned host→device copies to run beside other work ([`PinnedCopies::during`]): a
    /// pinned buffer of `bytes` (sized by the caller above the CPU's caches, so that the copies
    /// read DRAM), copied in pieces of `piece` bytes into one device buffer on a stream of
    /// their own, as the residency ring's reader copies the host tier.
    pub fn pinned_copies(&self, bytes: usize, piece: usize) -> Result<PinnedCopies, BackendError> {
        const OP: &str = "concurrent H2D benchmark";
        let (bytes, piece) = (bytes.max(1), piece.clamp(1, bytes.max(1)));
        let ctx = self.stream.context().clone();
        let stream = ctx.new_stream().map_err(|e| self.error(OP, e))?;
        // SAFETY: `alloc_pinned` leaves the memory uninitialised; it is filled below before
        // any byte of it is read.
        let mut host = unsafe { ctx.alloc_pinned::<u8>(bytes) }.map_err(|e| self.error(OP, e))?;
        host.as_mut_slice()
            .map_err(|e| self.error(OP, e))?
            .fill(0x5a);
        let dst = stream
            .alloc_zeros::<u8>(piece)
            .map_err(|e| self.error(OP, e))?;
        stream.synchronize().map_err(|e| self.error(OP, e))?;
        Ok(PinnedCopies {
            ctx,
            stream,
            host,
            dst,
            piece,
            device: self.device.clone(),
        })
    }

    /// The shortest of `n` timed runs of `copy`, each from an idle stream to its completion.
    fn best_of(
        &self,
        n: usize,
        mut copy: impl FnMut() -> Result<(), DriverError>,
        op: &'static str,
    ) -> Result<f64, BackendError> {
        let mut best = f64::MAX;
        for _ in 0..n {
            self.synchronize()?;
            let t = std::time::Instant::now();
            self.issue();
            copy().map_err(|e| self.error(op, e))?;
            self.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    }
}

/// Pinned host→device copies that run beside other work: [`Queue::pinned_copies`].
pub struct PinnedCopies {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    host: cudarc::driver::PinnedHostSlice<u8>,
    dst: CudaSlice<u8>,
    piece: usize,
    /// "NVIDIA H100 80GB HBM3 (0)", for errors.
    device: String,
}

impl PinnedCopies {
    /// Runs the copies on a thread of their own, walking the pinned buffer piece by piece,
    /// each piece synchronised like a ring's fill, from before `work` starts on this thread
    /// until it returns (or unwinds): the GB/s of the pieces completed over that time, and
    /// `work`'s result.
    pub fn during<R>(&mut self, work: impl FnOnce() -> R) -> Result<(f64, R), BackendError> {
        const OP: &str = "concurrent H2D benchmark";
        let error = |source| BackendError::Cuda {
            device: self.device.clone(),
            op: OP,
            source,
        };
        let host = self.host.as_slice().map_err(error)?;
        let (ctx, stream, dst, piece) = (&self.ctx, &self.stream, &mut self.dst, self.piece);
        let stop = AtomicBool::new(false);
        /// Stops the copies when `work` returns or unwinds (the scope would wait for them).
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let (copied, result) = std::thread::scope(|scope| {
            let copier = scope.spawn(|| -> Result<(u64, f64), DriverError> {
                ctx.bind_to_thread()?;
                let started = std::time::Instant::now();
                let (mut copied, mut offset) = (0u64, 0usize);
                while !stop.load(Ordering::Relaxed) {
                    let len = piece.min(host.len() - offset);
                    stream.memcpy_htod(&host[offset..offset + len], dst)?;
                    stream.synchronize()?;
                    copied += len as u64;
                    offset = if offset + len >= host.len() {
                        0
                    } else {
                        offset + len
                    };
                }
                Ok((copied, started.elapsed().as_secs_f64()))
            });
            let result = {
                let _stop = StopOnDrop(&stop);
                work()
            };
            (copier.join(), result)
        });
        let (copied, seconds) = match copied {
            Ok(done) => done.map_err(error)?,
            Err(_) => {
                return Err(BackendError::Unsupported {
                    op: OP,
                    message: "the copy thread panicked".into(),
                });
            }
        };
        Ok((copied as f64 / seconds.max(1e-9) / 1e9, result))
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            tracing::info!("{}", p.report());
        }
    }
}

/// A launch configuration of `grid` blocks of `threads` threads.
pub(super) fn blocks(grid: (u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The operands of one [`Queue::gemm`]: `C[m, n] = α·Aᵀ·B + β·C` in cuBLAS's column-major
/// terms (A is `k×m`, B `k×n`, C `m×n`, leading dimensions k, k and m), A and B of `ab_type`,
/// C f32.
pub(super) struct GemmArgs {
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub ab_type: cudarc::cublas::sys::cudaDataType,
    pub alpha: f32,
    pub beta: f32,
}

/// A kernel launch being put together: its arguments, then [`Launch::run`].
pub(super) struct Launch<'a> {
    kernel: &'a CudaFunction,
    /// Pointers to the argument values, in order, as `cuLaunchKernel` takes them; each value is
    /// borrowed for `'a`, so it outlives the launch.
    args: Vec<*mut std::ffi::c_void>,
    queue: &'a Queue,
    op: &'static str,
}

impl<'a> Launch<'a> {
    /// The next argument, by value (device addresses as `u64`).
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut std::ffi::c_void);
        self
    }

    /// Queues the kernel.
    ///
    /// # Safety
    ///
    /// The arguments must be what the kernel expects, and every address it is given must be a
    /// live device allocation large enough for what the kernel reads and writes with `cfg`.
    pub unsafe fn run(mut self, cfg: LaunchConfig) -> Result<(), BackendError> {
        self.queue.issue();
        self.queue.count_kernel();
        let (queue, op, kernel, args) = (self.queue, self.op, self.kernel, &mut self.args);
        // SAFETY: the caller vouches for the arguments and the grid; the argument values are
        // borrowed for the launch's lifetime.
        queue
            .timed(op, || unsafe { queue.launch_raw(kernel, cfg, args) })
            .map_err(|e| queue.error(op, e))
    }
}

/// The kernels of every `.cu` file, loaded once.
pub(super) struct Kernels {
    pub embed_rows: CudaFunction,
    pub rmsnorm: CudaFunction,
    pub rope_store_kv: CudaFunction,
    pub rope_store_kv_seqs: CudaFunction,
    pub copy_f32: CudaFunction,
    pub copy_f32_to_f16: CudaFunction,
    pub copy_f16_to_f32: CudaFunction,
    pub gated_act: CudaFunction,
    pub rmsnorm_pieces: CudaFunction,
    pub add_rmsnorm: CudaFunction,
    pub add_bias: CudaFunction,
    /// A share of a split matmul's output columns put in place, all rows in one launch.
    pub write_columns: CudaFunction,
    pub scale_f32: CudaFunction,
    pub softcap: CudaFunction,
    /// The greedy id of each row of the logits (`sampling::argmax` on the device).
    pub argmax_rows: CudaFunction,
    pub attention: CudaFunction,
    pub attention_decode: CudaFunction,
    pub attention_decode_seqs: CudaFunction,
    /// Prompt attention on tensor cores for head_dim 64 and 128.
    pub attention_flash: [CudaFunction; 2],
    pub attention_combine_seqs: CudaFunction,
    pub dequant_f16: CudaFunction,
    /// `dequant_f16` for the dtypes of `kquants.cu`, a thread per 32-value block.
    pub kq_dequant_f16: CudaFunction,
    /// `dequant_f16` for q8_0, q4_0 and q4_1, a thread per 32-value block.
    pub dequant_blocks_f16: CudaFunction,
    pub dequant_f32: CudaFunction,
    pub quantize_x16: CudaFunction,
    /// `embed_rows` for the dtypes of `kquants.cu`.
    pub kq_embed_rows: CudaFunction,
    /// Per dtype code: the kernel for one input row per block, and for `MM_ROWS`.
    pub matmul: [[CudaFunction; 2]; DType::ALL.len()],
    /// The one-row FFN gate/up kernels that write `act(gate) · up` (`_r1_gated`), for f16 and
    /// bf16 weights.
    pub matmul_gated: [CudaFunction; 2],
    /// Per dtype code (none for f32): the tensor-core kernels for up to 8, 16 and 32 input rows
    /// per block (`matmul_mma.cu`), and 64 for the k-quant-era dtypes (`kquants_mma.cu`); more
    /// rows take more blocks.
    pub matmul_mma: [Option<Vec<CudaFunction>>; DType::ALL.len()],
    /// The block shape of the tensor-core kernels, as compiled (`mma_geometry` there).
    pub mma_geometry: MmaGeometry,
    /// The sum of a split tensor-core launch's column slices (the `slicesum` path).
    pub mma_sum_slices: CudaFunction,
    /// The `superblock` path's q4_k, q5_k and q6_k kernels (`matmul_sb_*` of `kquants.cu`), one
    /// row and `MM_ROWS` rows per block, as `matmul`.
    pub matmul_superblock: [[CudaFunction; 2]; 3],
}

/// The block shape of the tensor-core matmul kernels (`matmul_mma.cu`), read from the compiled
/// module, so that the host's grid always matches the kernels' (which a define can change).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmaGeometry {
    /// Threads a block.
    pub threads: u32,
    /// Weight rows a block.
    pub rows: usize,
    /// Blocks a multiprocessor the kernels are compiled to fit.
    pub blocks_per_sm: usize,
    /// Most column slices a launch is split into.
    pub split_max: usize,
}

impl MmaGeometry {
    fn read(ctx: &Arc<CudaContext>, module: &Arc<CudaModule>) -> Result<MmaGeometry, LlamaError> {
        let stream = ctx.default_stream();
        let symbol = module
            .get_global("mma_geometry", &stream)
            .map_err(|e| device_error(format!("symbol `mma_geometry`: {e}")))?;
        let bytes = stream
            .clone_dtoh(&symbol)
            .map_err(|e| device_error(format!("reading `mma_geometry`: {e}")))?;
        let field = |i: usize| {
            bytes
                .get(4 * i..4 * i + 4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .filter(|&v| v > 0)
                .ok_or_else(|| device_error(format!("`mma_geometry` field {i} of {bytes:?}")))
        };
        Ok(MmaGeometry {
            threads: field(0)? as u32,
            rows: field(1)? as usize,
            blocks_per_sm: field(2)? as usize,
            split_max: field(3)? as usize,
        })
    }
}

impl Kernels {
    /// Compiles (or loads from the cache) the kernel sources for `ctx`'s device and looks up
    /// every kernel.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, LlamaError> {
        let module: Arc<CudaModule> = compile::load_module(ctx)?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| device_error(format!("kernel `{name}`: {e}")))
        };
        // `MATMUL_MMA_KERNELS(matmul_mma_<dtype>, code)` stamps out `_n1`, `_n2` and `_n4`,
        // `MATMUL_MMA_KQ_KERNELS` also `_n8`.
        let mma = |dtype: &str, widest: usize| -> Result<Vec<CudaFunction>, LlamaError> {
            [1, 2, 4, 8]
                .into_iter()
                .take_while(|&nt| nt <= widest)
                .map(|nt| f(&format!("matmul_mma_{dtype}_n{nt}")))
                .collect()
        };
        let mma_geometry = MmaGeometry::read(ctx, &module)?;
        // `MATMUL_KQ_SB_KERNELS(matmul_sb_<dtype>, ..)` stamps out `_r1` and `_r8`.
        let sb = |dtype: &str| -> Result<[CudaFunction; 2], LlamaError> {
            Ok([
                f(&format!("matmul_sb_{dtype}_r1"))?,
                f(&format!("matmul_sb_{dtype}_r8"))?,
            ])
        };
        Ok(Kernels {
            embed_rows: f("embed_rows")?,
            rmsnorm: f("rmsnorm")?,
            rope_store_kv: f("rope_store_kv")?,
            rope_store_kv_seqs: f("rope_store_kv_seqs")?,
            copy_f32: f("copy_f32")?,
            copy_f32_to_f16: f("copy_f32_to_f16")?,
            copy_f16_to_f32: f("copy_f16_to_f32")?,
            gated_act: f("gated_act")?,
            rmsnorm_pieces: f("rmsnorm_pieces")?,
            add_rmsnorm: f("add_rmsnorm")?,
            add_bias: f("add_bias")?,
            write_columns: f("write_columns_f32")?,
            scale_f32: f("scale_f32")?,
            softcap: f("softcap")?,
            argmax_rows: f("argmax_rows")?,
            attention: f("attention")?,
            attention_decode: f("attention_decode")?,
            attention_decode_seqs: f("attention_decode_seqs")?,
            attention_flash: [f("attention_flash_hd64")?, f("attention_flash_hd128")?],
            attention_combine_seqs: f("attention_combine_seqs")?,
            dequant_f16: f("dequant_f16")?,
            kq_dequant_f16: f("kq_dequant_f16")?,
            dequant_blocks_f16: f("dequant_blocks_f16")?,
            dequant_f32: f("dequant_f32")?,
            quantize_x16: f("quantize_x16")?,
            kq_embed_rows: f("kq_embed_rows")?,
            mma_sum_slices: f("mma_sum_slices")?,
            // `matmul_<dtype>_r1` and `_r8`, in dtype-code order.
            matmul: DType::ALL
                .iter()
                .map(|d| {
                    let name = format!("matmul_{}", d.name());
                    Ok([f(&format!("{name}_r1"))?, f(&format!("{name}_r8"))?])
                })
                .collect::<Result<Vec<_>, LlamaError>>()?
                .try_into()
                .unwrap_or_else(|_| unreachable!("one pair per dtype code")),
            matmul_gated: [f("matmul_f16_r1_gated")?, f("matmul_bf16_r1_gated")?],
            // In dtype-code order (`DType::ALL`).
            matmul_mma: [
                None,
                Some(mma("f16", 4)?),
                Some(mma("bf16", 4)?),
                Some(mma("q8_0", 4)?),
                Some(mma("q4_0", 4)?),
                Some(mma("q4_1", 4)?),
                Some(mma("q5_0", 8)?),
                Some(mma("q5_1", 8)?),
                Some(mma("q2_k", 8)?),
                Some(mma("q3_k", 8)?),
                Some(mma("q4_k", 8)?),
                Some(mma("q5_k", 8)?),
                Some(mma("q6_k", 8)?),
                Some(mma("iq4_nl", 8)?),
                Some(mma("iq4_xs", 8)?),
            ],
            mma_geometry,
            matmul_superblock: [sb("q4_k")?, sb("q5_k")?, sb("q6_k")?],
        })
    }
}
