//! The CUDA backend (feature `cuda`): f32 activations in device memory, an f16 KV cache, and
//! kernels compiled by NVRTC from `kernels/ops.cu` and `kernels/kquants.cu` on first use (see
//! [`compile`]).
//!
//! Weights: ops receive [`WeightView`]s over host bytes (the trait is shared with the CPU
//! backend). [`CudaBackend::upload_weights`] copies every blob to device memory once and
//! returns a [`DeviceWeights`] weight source; while it lives, a view into its host bytes is
//! resolved to the device copy (device pointer + the same offset), so no weight crosses PCIe
//! during a forward pass. A view over any other host memory is uploaded for that one op (the
//! op tests, the rows of an untied embedding table).
//!
//! Streaming: [`load_cuda`] gives views whose `device` address points into residency's
//! device memory (see `streamed.rs` for the release fences that let a slot be refilled).
//!
//! Decoding with every weight resident records the step after the embedding once as a CUDA
//! graph and replays it ([`Backend::begin_step_capture`]): the kernels that depend on the
//! position read it from device memory, so one recording serves every position.
//!
//! Launch failures cannot be returned through the infallible [`Backend`] ops: the first one is
//! recorded, every later op becomes a no-op, and [`Backend::status`] reports it after the pass.

mod compile;
mod streamed;

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use weights_format::DType;

use super::{AttentionShape, Backend, WeightView};
use crate::LlamaError;
use crate::weights::WeightSource;

pub use compile::kernel_cache_dir;
pub use streamed::{
    CudaBlobGuard, CudaModel, CudaWeights, GPU_MAX_ROWS, device_reserved_bytes, load_cuda,
};

/// Threads per block of the row-wise kernels (rmsnorm, attention): the kernels assume 256.
const ROW_THREADS: u32 = 256;
/// Threads per block of elementwise kernels.
const ELEMENT_THREADS: u32 = 256;
/// The most activations rmsnorm and swiglu also write quantized (see `x16_memo`): decoding
/// batches of up to 64 sequences of a 16384-wide FFN; long prompts go to cuBLAS and do not
/// read them.
const X16_FUSED_MAX: usize = 1 << 20;
/// Threads per block of `rmsnorm` (must match RMS_THREADS in ops.cu).
const RMS_THREADS: u32 = 1024;
/// Warps per block (they split the columns), weight rows per block (`MM_WROWS`), input rows
/// per block (`MM_ROWS`) and weights per launch (`MM_MAX_JOBS`) of the matmul kernels.
const MM_WARPS: u32 = 4;
const MM_WROWS: u32 = 4;
const MM_ROWS: u32 = 8;
const MM_MAX_JOBS: usize = 3;

/// The weights one matmul launch multiplies the same input with: must match `MatmulJobs` in
/// ops.cu (three pointers, three pointers, five ints; 72 bytes with padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MatmulJobs {
    w: [u64; MM_MAX_JOBS],
    out: [u64; MM_MAX_JOBS],
    m: [i32; MM_MAX_JOBS],
    n_jobs: i32,
    accumulate: i32,
}

/// What a matmul kernel reads as x: f32 rows, or (quantized weights) `quantize_x16`'s
/// integers and block records, by device address.
#[derive(Clone, Copy)]
enum MatmulInput {
    F32(u64),
    Int16 { xq: u64, xs: u64 },
}

/// `n` f32 values at device address `x`, quantized at `xq`/`xs` by the op that wrote them (see
/// `x16_memo`); valid while `ops_issued` is still `at`.
#[derive(Clone, Copy, Debug)]
struct X16Memo {
    x: u64,
    n: usize,
    xq: u64,
    xs: u64,
    at: u64,
}

// SAFETY: plain data with the C layout of the kernel's by-value parameter (`repr(C)`, no
// pointers the host dereferences, every bit pattern valid).
unsafe impl cudarc::driver::DeviceRepr for MatmulJobs {}

/// Matmuls of at least this many input rows go to cuBLAS (tensor cores; prefill is
/// compute-bound there): f16 weights as they are; bf16 and quantized ones converted to f16 one
/// matrix at a time into a temporary (as llama.cpp does for large batches). bf16 is not fed as
/// bf16 because x would then be rounded to 8 mantissa bits: on a 7B-shaped model that put the
/// prefill logits 3.3e-2 (relative) from the float32 reference, against 5e-3 with f16. Fewer rows —
/// decoding — stay on `matmul_*`, which reads the stored blocks once at full bandwidth and keeps
/// the activations in f32.
pub const CUBLAS_MIN_ROWS: usize = 16;

/// Positions per chunk of the decode attention kernel: a 4096-token context is 32 chunks per
/// head, so even 8 heads fill the GPU.
const ATT_SPLIT: usize = 128;

/// The dtype codes of the kernels: the position in [`DType::ALL`] (0–5 in `kernels/ops.cu`,
/// 6–14 in `kernels/kquants.cu`).
fn dtype_code(dtype: DType) -> i32 {
    DType::ALL
        .iter()
        .position(|d| *d == dtype)
        .expect("DType::ALL has every dtype") as i32
}

/// Whether `dtype`'s embedding lookup is `kq_embed_rows` of `kernels/kquants.cu`.
fn kq_kernels(dtype: DType) -> bool {
    dtype_code(dtype) >= 6
}

/// Whether this machine can run the CUDA backend at all (driver and NVRTC libraries loadable
/// and at least one device), with the reason when it cannot.
pub fn cuda_usable() -> Result<(), LlamaError> {
    cuda_usable_on(0)
}

/// [`cuda_usable`] for device `ordinal`.
pub fn cuda_usable_on(ordinal: usize) -> Result<(), LlamaError> {
    CudaBackend::new(ordinal).map(|_| ())
}

fn device_error(message: impl Into<String>) -> LlamaError {
    LlamaError::Device {
        message: message.into(),
    }
}

/// An activation buffer in device memory: f32, or f16 for the KV cache.
#[derive(Debug)]
pub enum CudaBuf {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
    /// What an allocation that failed returns; the backend is poisoned by then and never
    /// launches a kernel on it.
    Failed,
}

struct Kernels {
    embed_rows: CudaFunction,
    rmsnorm: CudaFunction,
    rope: CudaFunction,
    rope_store_kv: CudaFunction,
    copy_f32: CudaFunction,
    copy_f32_to_f16: CudaFunction,
    copy_f32_to_bf16: CudaFunction,
    copy_f16_to_f32: CudaFunction,
    swiglu: CudaFunction,
    add: CudaFunction,
    attention: CudaFunction,
    attention_decode: CudaFunction,
    attention_combine: CudaFunction,
    dequant_f16: CudaFunction,
    dequant_f32: CudaFunction,
    quantize_x16: CudaFunction,
    /// `embed_rows` for the dtypes of `kquants.cu`.
    kq_embed_rows: CudaFunction,
    /// Per dtype code: the kernel for one input row per block, and for [`MM_ROWS`].
    matmul: [[CudaFunction; 2]; 15],
}

impl Kernels {
    fn load(module: &Arc<CudaModule>) -> Result<Kernels, LlamaError> {
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| device_error(format!("kernel `{name}` in ops.cu: {e}")))
        };
        Ok(Kernels {
            embed_rows: f("embed_rows")?,
            rmsnorm: f("rmsnorm")?,
            rope: f("rope")?,
            rope_store_kv: f("rope_store_kv")?,
            copy_f32: f("copy_f32")?,
            copy_f32_to_f16: f("copy_f32_to_f16")?,
            copy_f32_to_bf16: f("copy_f32_to_bf16")?,
            copy_f16_to_f32: f("copy_f16_to_f32")?,
            swiglu: f("swiglu")?,
            add: f("add")?,
            attention: f("attention")?,
            attention_decode: f("attention_decode")?,
            attention_combine: f("attention_combine")?,
            dequant_f16: f("dequant_f16")?,
            dequant_f32: f("dequant_f32")?,
            quantize_x16: f("quantize_x16")?,
            kq_embed_rows: f("kq_embed_rows")?,
            matmul: DType::ALL
                .iter()
                .map(|d| {
                    let name = format!("matmul_{}", d.name());
                    Ok([f(&format!("{name}_r1"))?, f(&format!("{name}_r8"))?])
                })
                .collect::<Result<Vec<_>, LlamaError>>()?
                .try_into()
                .unwrap_or_else(|_| unreachable!("one pair per dtype code")),
        })
    }
}

/// One blob of a [`DeviceWeights`] mirrored in device memory.
struct ResidentBlob {
    /// Keeps the host bytes (and so their address) alive as long as the mirror is used.
    host: Arc<Vec<Vec<u8>>>,
    index: usize,
    device: CudaSlice<u8>,
}

impl ResidentBlob {
    fn host_range(&self) -> std::ops::Range<usize> {
        let b = &self.host[self.index];
        let start = b.as_ptr() as usize;
        start..start + b.len()
    }
}

/// A weight's bytes in device memory: a pointer into a resident blob, or a temporary upload
/// that must stay alive until the kernel using it has been queued (its free is stream-ordered).
struct DeviceWeight {
    ptr: u64,
    _temporary: Option<CudaSlice<u8>>,
}

/// The CUDA backend on one device: one stream, kernels compiled for the device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    device_name: String,
    resident: Mutex<Vec<ResidentBlob>>,
    /// cuBLAS on the same stream, when libcublas loads.
    blas: Option<cudarc::cublas::CudaBlas>,
    /// The RoPE frequencies last used, on the device (they are the same for every call).
    inv_freq: Mutex<Option<(Vec<f32>, CudaSlice<f32>)>>,
    /// The first failure; later ops do nothing.
    error: Mutex<Option<String>>,
    /// Partial results of the split decode attention, sized for the largest cache seen (a
    /// recorded step keeps using it, so it is not reallocated per op).
    attention_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// The activations of the quantized matmuls as `quantize_x16_lanes` writes them, sized for
    /// the largest input seen (reused like `attention_scratch`).
    x16_scratch: Mutex<Option<CudaSlice<u8>>>,
    /// What the scratch holds when the last op was an rmsnorm or swiglu that also wrote its
    /// output there, so that the quantized matmul reading that output next skips
    /// `quantize_x16`.
    x16_memo: Mutex<Option<X16Memo>>,
    /// Counts every launch, copy and allocation on the stream (each passes [`Self::check`] or
    /// [`Self::alloc`]): an [`X16Memo`] holds while this has not moved since it was made.
    ops_issued: std::sync::atomic::AtomicU64,
    /// Launches of `quantize_x16` (the inputs that no producer had quantized).
    x16_launches: std::sync::atomic::AtomicU64,
    /// The recorded decode step and the state of a recording.
    step: Mutex<StepRecording>,
    /// Whether decode steps are recorded as CUDA graphs (`GDSLLM_CUDA_GRAPH=0` turns it off).
    graphs: bool,
    /// Decode steps replayed from the recording.
    replays: std::sync::atomic::AtomicU64,
}

/// A decode step recorded as a CUDA graph ([`Backend::begin_step_capture`]).
struct StepRecording {
    /// The position the recorded step runs at (one i32 in device memory), written before each
    /// replay: the kernels that depend on it read it there.
    pos: CudaSlice<i32>,
    capturing: bool,
    /// Set when an op could not be recorded; the recording is then discarded.
    broken: bool,
    graph: Option<StepGraph>,
}

/// A CUDA graph owned by the backend.
struct StepGraph(cudarc::driver::CudaGraph);

// SAFETY: the graph is a pair of driver handles with no thread affinity; the backend only
// touches it with the `step` mutex held, which serialises every call on it as the CUDA graph
// API requires.
unsafe impl Send for StepGraph {}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device_name)
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Opens device `ordinal` and loads (compiling on first use) the kernels. Fails with the
    /// reason — no driver library, no NVRTC library, no such device, compile log — and never
    /// panics when CUDA is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend, LlamaError> {
        // SAFETY: `is_culib_present` only tries to dlopen the libraries; cudarc panics on the
        // first call into a library that is missing, so this must come before any other call.
        let driver = unsafe { cudarc::driver::sys::is_culib_present() };
        if !driver {
            return Err(device_error(format!(
                "the CUDA driver library (libcuda.so.1) is not loadable (LD_LIBRARY_PATH={})",
                std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "<unset>".into())
            )));
        }
        // SAFETY: as above, for libnvrtc.
        let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !nvrtc {
            return Err(device_error(format!(
                "the NVRTC library (libnvrtc.so) is not loadable; it ships with the CUDA \
                 toolkit, e.g. LD_LIBRARY_PATH=/usr/local/cuda/lib64 (now {})",
                std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "<unset>".into())
            )));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| device_error(format!("cannot open CUDA device {ordinal}: {e}")))?;
        // SAFETY: nothing has been allocated or launched on this context object yet. Every op
        // runs on the one stream below, so the per-buffer events that cudarc would record to
        // order several streams are unnecessary, and raw device pointers are passed to kernels.
        unsafe { ctx.disable_event_tracking() };
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let stream = ctx
            .new_stream()
            .map_err(|e| device_error(format!("cuStreamCreate: {e}")))?;
        let module = compile::load_ops(&ctx)?;
        let kernels = Kernels::load(&module)?;
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
        let pos = stream
            .alloc_zeros::<i32>(1)
            .map_err(|e| device_error(format!("allocating the step parameters: {e}")))?;
        let graphs = std::env::var("GDSLLM_CUDA_GRAPH").map_or(true, |v| v != "0");
        Ok(CudaBackend {
            ctx,
            stream,
            kernels,
            device_name,
            resident: Mutex::new(Vec::new()),
            blas,
            inv_freq: Mutex::new(None),
            error: Mutex::new(None),
            attention_scratch: Mutex::new(None),
            x16_scratch: Mutex::new(None),
            x16_memo: Mutex::new(None),
            ops_issued: std::sync::atomic::AtomicU64::new(0),
            x16_launches: std::sync::atomic::AtomicU64::new(0),
            step: Mutex::new(StepRecording {
                pos,
                capturing: false,
                broken: false,
                graph: None,
            }),
            graphs,
            replays: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Copies every blob (in `metadata.blobs` order) to device memory once and returns the
    /// weight source whose views this backend resolves to those copies.
    pub fn upload_weights(&self, blobs: Vec<Vec<u8>>) -> Result<DeviceWeights, LlamaError> {
        let host = Arc::new(blobs);
        let mut uploaded = Vec::with_capacity(host.len());
        for (index, bytes) in host.iter().enumerate() {
            let device = self.stream.clone_htod(bytes.as_slice()).map_err(|e| {
                device_error(format!(
                    "uploading blob #{index} ({} bytes) to {}: {e}",
                    bytes.len(),
                    self.device_name
                ))
            })?;
            uploaded.push(ResidentBlob {
                host: Arc::clone(&host),
                index,
                device,
            });
        }
        self.stream
            .synchronize()
            .map_err(|e| device_error(format!("uploading weights: {e}")))?;
        self.resident.lock().expect("not poisoned").extend(uploaded);
        Ok(DeviceWeights { host })
    }

    /// A device buffer holding `data` (tests, and callers that bring their own activations).
    pub fn upload(&self, data: &[f32]) -> Result<CudaBuf, LlamaError> {
        self.ops_issued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.stream
            .clone_htod(data)
            .map(CudaBuf::F32)
            .map_err(|e| device_error(format!("uploading {} values: {e}", data.len())))
    }

    /// Device-to-device copy speed over `bytes`-byte buffers: (bytes read, bytes read + bytes
    /// written) per second, in GB/s, best of a few copies. The reference that the resident
    /// decode speed is compared with (decode reads each weight byte once).
    pub fn measure_copy_gbps(&self, bytes: usize) -> Result<(f64, f64), LlamaError> {
        let err = |e: cudarc::driver::DriverError| device_error(format!("copy benchmark: {e}"));
        let src = self.stream.alloc_zeros::<u8>(bytes).map_err(err)?;
        let mut dst = self.stream.alloc_zeros::<u8>(bytes).map_err(err)?;
        let mut best = f64::MAX;
        for _ in 0..6 {
            self.stream.synchronize().map_err(err)?;
            let t = std::time::Instant::now();
            self.stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
            self.stream.synchronize().map_err(err)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let read = bytes as f64 / best / 1e9;
        Ok((read, 2.0 * read))
    }

    /// Host-to-device copy speed from page-locked memory over `bytes` bytes, GB/s, best of a
    /// few copies: the reference for the pinned host tier.
    pub fn measure_pinned_h2d_gbps(&self, bytes: usize) -> Result<f64, LlamaError> {
        let err = |e: cudarc::driver::DriverError| device_error(format!("H2D benchmark: {e}"));
        // SAFETY: `alloc_pinned` leaves the memory uninitialised; it is only ever a copy source
        // and every byte pattern is a valid u8.
        let host = unsafe { self.ctx.alloc_pinned::<u8>(bytes) }.map_err(err)?;
        let mut dst = self.stream.alloc_zeros::<u8>(bytes).map_err(err)?;
        let mut best = f64::MAX;
        for _ in 0..4 {
            self.stream.synchronize().map_err(err)?;
            let t = std::time::Instant::now();
            self.stream.memcpy_htod(&host, &mut dst).map_err(err)?;
            self.stream.synchronize().map_err(err)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best / 1e9)
    }

    /// Decode steps run by replaying the recorded step (a CUDA graph) so far.
    pub fn step_replays(&self) -> u64 {
        self.replays.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Inputs of quantized matmuls converted by a `quantize_x16` launch of their own so far
    /// (those that rmsnorm or swiglu wrote in that form as they produced them are not counted).
    pub fn x16_launches(&self) -> u64 {
        self.x16_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes of weights held in device memory.
    pub fn resident_bytes(&self) -> usize {
        let resident = self.resident.lock().expect("not poisoned");
        resident.iter().map(|b| b.device.len()).sum()
    }

    fn failed(&self) -> bool {
        self.error.lock().expect("not poisoned").is_some()
    }

    fn fail(&self, what: &str, err: impl std::fmt::Display) {
        let mut slot = self.error.lock().expect("not poisoned");
        if slot.is_none() {
            *slot = Some(format!("{what}: {err}"));
        }
    }

    fn check<T, E: std::fmt::Display>(&self, what: &str, r: Result<T, E>) -> Option<T> {
        self.ops_issued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.fail(what, e);
                None
            }
        }
    }

    /// The device address of the recorded step's position while a step is being recorded
    /// (the kernels that depend on the position read it there), else None.
    fn step_pos_ptr(&self) -> Option<u64> {
        let step = self.step.lock().expect("not poisoned");
        step.capturing.then(|| step.pos.device_ptr(&self.stream).0)
    }

    /// Whether a step is being recorded.
    fn capturing(&self) -> bool {
        self.step.lock().expect("not poisoned").capturing
    }

    /// Abandons the recording in progress: `what` cannot be recorded (it would copy from host
    /// memory or allocate). The ops still go into the recording, which is then discarded.
    fn break_capture(&self, what: &str) {
        tracing::debug!("{what} cannot be recorded in a CUDA graph; decoding op by op");
        self.step.lock().expect("not poisoned").broken = true;
    }

    /// The device address of a buffer (+ `offset` elements).
    fn ptr(&self, buf: &CudaBuf, offset: usize) -> Option<u64> {
        match buf {
            CudaBuf::F32(s) => Some(s.device_ptr(&self.stream).0 + (offset * 4) as u64),
            CudaBuf::F16(s) => Some(s.device_ptr(&self.stream).0 + (offset * 2) as u64),
            CudaBuf::Failed => {
                self.fail("buffer", "used after its allocation failed");
                None
            }
        }
    }

    fn weight(&self, w: &WeightView<'_>) -> Option<DeviceWeight> {
        if let Some(ptr) = w.device {
            return Some(DeviceWeight {
                ptr,
                _temporary: None,
            });
        }
        let start = w.bytes.as_ptr() as usize;
        let end = start + w.bytes.len();
        {
            let resident = self.resident.lock().expect("not poisoned");
            for blob in resident.iter() {
                let range = blob.host_range();
                if range.start <= start && end <= range.end {
                    let (base, _) = blob.device.device_ptr(&self.stream);
                    return Some(DeviceWeight {
                        ptr: base + (start - range.start) as u64,
                        _temporary: None,
                    });
                }
            }
        }
        if self.capturing() {
            self.break_capture("a weight in host memory");
            return None;
        }
        let temp = self.check("uploading a weight", self.stream.clone_htod(w.bytes))?;
        let (ptr, _) = temp.device_ptr(&self.stream);
        Some(DeviceWeight {
            ptr,
            _temporary: Some(temp),
        })
    }

    fn inv_freq_ptr(&self, inv_freq: &[f32]) -> Option<u64> {
        let mut slot = self.inv_freq.lock().expect("not poisoned");
        if slot
            .as_ref()
            .is_none_or(|(host, _)| host.as_slice() != inv_freq)
        {
            if self.capturing() {
                self.break_capture("uploading RoPE frequencies");
                return None;
            }
            let dev = self.check(
                "uploading RoPE frequencies",
                self.stream.clone_htod(inv_freq),
            )?;
            *slot = Some((inv_freq.to_vec(), dev));
        }
        let (_, dev) = slot.as_ref().expect("set above");
        Some(dev.device_ptr(&self.stream).0)
    }

    fn elementwise(&self, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((n as u32).div_ceil(ELEMENT_THREADS), 1, 1),
            block_dim: (ELEMENT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `out (+)= x · Wᵀ` for each `(W, out)` of `jobs` (weights of the same input, so of the
    /// same column count), `rows` rows at device addresses `xp` and `out`; `solo_rows` is the
    /// row count whose numerics the rows must have (cuBLAS from [`CUBLAS_MIN_ROWS`] on, the
    /// matmul kernels below it). Consecutive weights of one dtype share a kernel launch; the
    /// quantized ones share one conversion of x (`quantize_x16`).
    fn matmul_jobs(
        &self,
        xp: u64,
        rows: usize,
        jobs: &[(&WeightView<'_>, u64)],
        solo_rows: usize,
        accumulate: bool,
    ) {
        let Some(&(first, _)) = jobs.first() else {
            return;
        };
        let blas = self.blas.as_ref().filter(|_| solo_rows >= CUBLAS_MIN_ROWS);
        let mut x16 = self.x16_memo_for(xp, rows * first.cols);
        let mut start = 0;
        while start < jobs.len() {
            let first = jobs[start].0;
            if let Some(blas) = blas
                && first.dtype != DType::F32
            {
                self.matmul_blas(blas, xp, rows, first, jobs[start].1, accumulate);
                start += 1;
                continue;
            }
            let mut end = start + 1;
            while end < jobs.len()
                && end - start < MM_MAX_JOBS
                && jobs[end].0.dtype == first.dtype
                && blas.is_none()
            {
                end += 1;
            }
            let x = if first.dtype.is_quantized() {
                if x16.is_none() {
                    x16 = self.quantize_x16(xp, rows * first.cols);
                }
                let Some((xq, xs)) = x16 else { return };
                MatmulInput::Int16 { xq, xs }
            } else {
                MatmulInput::F32(xp)
            };
            self.launch_matmul(x, rows, &jobs[start..end], accumulate);
            start = end;
        }
    }

    /// Room in the reused scratch buffer for `n` activations (a multiple of 32) in the format of
    /// `quantize_x16_lanes`: the device addresses of the 16-bit integers and of the per-block
    /// (scale, sum, integer sum) records. None while recording a step if the buffer would have
    /// to grow; that abandons the recording only when `needed` (the fused writes of rmsnorm
    /// and swiglu are optional).
    fn x16_scratch(&self, n: usize, needed: bool) -> Option<(u64, u64)> {
        let n_blocks = n / 32;
        let xq = self.reused_buffer(
            &self.x16_scratch,
            n_blocks * 80,
            "allocating quantized activations",
            needed,
        )?;
        Some((xq, xq + (n_blocks * 64) as u64))
    }

    /// The device address of the buffer in `slot`, grown to at least `len` elements first
    /// when it is smaller. Such buffers are reused by every layer and step (ops are
    /// stream-ordered); growing one drops a recorded step, which used the old one, and is not
    /// possible while recording: then None, and the recording is abandoned when `needed`.
    fn reused_buffer<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        slot: &Mutex<Option<CudaSlice<T>>>,
        len: usize,
        what: &str,
        needed: bool,
    ) -> Option<u64> {
        let mut slot = slot.lock().expect("not poisoned");
        if slot.as_ref().is_none_or(|b| b.len() < len) {
            if self.capturing() {
                if needed {
                    self.break_capture(what);
                }
                return None;
            }
            self.forget_step();
            *slot = Some(self.check(what, self.stream.alloc_zeros::<T>(len))?);
        }
        slot.as_ref().map(|b| b.device_ptr(&self.stream).0)
    }

    /// `n` activations at `xp` in the format of `quantize_x16_lanes`, in the scratch buffer.
    fn quantize_x16(&self, xp: u64, n: usize) -> Option<(u64, u64)> {
        let (xq, xs) = self.x16_scratch(n, true)?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.quantize_x16);
        b.arg(&xp).arg(&n64).arg(&xq).arg(&xs);
        // SAFETY: x holds n f32 values (n a multiple of 32; activation rows are 16-byte
        // aligned); the scratch holds n/32 64-byte blocks of integers at xq and n/32 16-byte
        // records at xs (16-byte aligned: n/32·64 is). One thread per 4 values.
        let r = unsafe { b.launch(self.elementwise(n / 4)) };
        self.check("quantize_x16 kernel", r)?;
        self.x16_launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some((xq, xs))
    }

    /// Where the op just before this one left `n` activations at `xp` quantized, if it did:
    /// the memo of an rmsnorm or swiglu when nothing was issued since, and `xp` lies in its
    /// output at a whole block.
    fn x16_memo_for(&self, xp: u64, n: usize) -> Option<(u64, u64)> {
        let memo = (*self.x16_memo.lock().expect("not poisoned"))?;
        let now = self.ops_issued.load(std::sync::atomic::Ordering::Relaxed);
        let offset = xp.checked_sub(memo.x)? / 4;
        let fits = now == memo.at
            && xp >= memo.x
            && (xp - memo.x).is_multiple_of(128)
            && offset as usize + n <= memo.n;
        fits.then(|| {
            let block = offset / 32;
            (memo.xq + block * 64, memo.xs + block * 16)
        })
    }

    /// The scratch addresses a producer of `n` activations at `xp` writes their quantized form
    /// to (when `n` is whole blocks and the scratch is there), or (0, 0): no fused write.
    fn x16_fused_target(&self, n: usize) -> (u64, u64) {
        if n == 0 || !n.is_multiple_of(32) || n > X16_FUSED_MAX {
            return (0, 0);
        }
        self.x16_scratch(n, false).unwrap_or((0, 0))
    }

    /// After a launch that wrote `n` activations at `x` and, unless `xq` is 0, their
    /// quantized form.
    fn remember_x16(&self, x: u64, n: usize, (xq, xs): (u64, u64)) {
        let at = self.ops_issued.load(std::sync::atomic::Ordering::Relaxed);
        *self.x16_memo.lock().expect("not poisoned") =
            (xq != 0).then_some(X16Memo { x, n, xq, xs, at });
    }

    /// One cuBLAS GEMM: f16 weights as they are, bf16 through an f32 copy, quantized ones
    /// through an f16 copy (see [`CUBLAS_MIN_ROWS`]).
    fn matmul_blas(
        &self,
        blas: &cudarc::cublas::CudaBlas,
        xp: u64,
        rows: usize,
        w: &WeightView<'_>,
        op: u64,
        accumulate: bool,
    ) {
        let Some(wd) = self.weight(w) else { return };
        let to = match w.dtype {
            DType::F16 => {
                return self.matmul_cublas(blas, xp, rows, w, wd.ptr, DType::F16, op, accumulate);
            }
            DType::Bf16 => DType::F32,
            _ => DType::F16,
        };
        let Some(tmp) = self.dequantize(w, wd.ptr, to) else {
            return;
        };
        let ptr = tmp.device_ptr(&self.stream).0;
        self.matmul_cublas(blas, xp, rows, w, ptr, to, op, accumulate);
        // Freed in stream order, after the GEMM that reads it.
        drop(tmp);
    }

    /// One launch of a matmul kernel over up to [`MM_MAX_JOBS`] weights of one dtype.
    fn launch_matmul(
        &self,
        x: MatmulInput,
        rows: usize,
        jobs: &[(&WeightView<'_>, u64)],
        accumulate: bool,
    ) {
        let mut params = MatmulJobs {
            n_jobs: jobs.len() as i32,
            accumulate: accumulate as i32,
            ..MatmulJobs::default()
        };
        // Keeps temporary uploads (op tests) alive until the launch is queued.
        let mut weights = Vec::with_capacity(jobs.len());
        let mut blocks = 0;
        for (i, (w, op)) in jobs.iter().enumerate() {
            let Some(wd) = self.weight(w) else { return };
            params.w[i] = wd.ptr;
            params.out[i] = *op;
            params.m[i] = w.rows as i32;
            blocks += (w.rows as u32).div_ceil(MM_WROWS);
            weights.push(wd);
        }
        let w = jobs[0].0;
        let (rows_i, k) = (rows as i32, w.cols as i32);
        // One input row per block when there is one: the kernel then keeps no accumulators
        // for rows that do not exist.
        let (variant, rows_per_block) = if rows == 1 { (0, 1) } else { (1, MM_ROWS) };
        let (x0, x1) = match x {
            MatmulInput::F32(xp) => (xp, None),
            MatmulInput::Int16 { xq, xs } => (xq, Some(xs)),
        };
        let mut b = self
            .stream
            .launch_builder(&self.kernels.matmul[dtype_code(w.dtype) as usize][variant]);
        b.arg(&x0);
        if let Some(xs) = &x1 {
            b.arg(xs);
        }
        b.arg(&rows_i).arg(&k).arg(&params);
        let cfg = LaunchConfig {
            grid_dim: (blocks, (rows as u32).div_ceil(rows_per_block), 1),
            block_dim: (MM_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds rows·k values (f32, or for quantized weights the 16-bit integers and
        // block records of `quantize_x16` over them); each job's weight has m rows of k values
        // in whole blocks of the shared dtype (checked when the views were made) and its output
        // rows·m values; the grid covers ceil(m / MM_WROWS) blocks per job and the rows in
        // groups of the variant's rows per block, as the kernel expects.
        let r = unsafe { b.launch(cfg) };
        self.check("matmul kernel", r);
        drop(weights);
    }

    /// [`Backend::matmul_batch`], accumulating into the outputs when `accumulate`.
    fn matmul_groups(
        &self,
        x: &CudaBuf,
        groups: &[crate::backend::RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut CudaBuf],
        accumulate: bool,
    ) {
        if self.failed() || ws.is_empty() {
            return;
        }
        let mut row0 = 0;
        let mut i = 0;
        while i < groups.len() {
            let kernel_rows = groups[i].solo_rows < CUBLAS_MIN_ROWS;
            let mut rows = 0;
            while i < groups.len() && (groups[i].solo_rows < CUBLAS_MIN_ROWS) == kernel_rows {
                rows += groups[i].rows;
                i += 1;
                if !kernel_rows {
                    break; // one GEMM per prefilling sequence
                }
            }
            if rows > 0 {
                let Some(xp) = self.ptr(x, row0 * ws[0].cols) else {
                    return;
                };
                let mut jobs = Vec::with_capacity(ws.len());
                for (w, out) in ws.iter().zip(outs.iter()) {
                    let Some(op) = self.ptr(out, row0 * w.rows) else {
                        return;
                    };
                    jobs.push((w, op));
                }
                let solo = if kernel_rows { 1 } else { CUBLAS_MIN_ROWS };
                self.matmul_jobs(xp, rows, &jobs, solo, accumulate);
            }
            row0 += rows;
        }
    }

    /// A bf16 or quantized weight matrix as f16 or f32 (`to`), in a temporary (stream-ordered)
    /// allocation of raw bytes.
    fn dequantize(&self, w: &WeightView<'_>, w_ptr: u64, to: DType) -> Option<CudaSlice<u8>> {
        let n = w.rows * w.cols;
        let (kernel, elem) = match to {
            DType::F32 => (&self.kernels.dequant_f32, 4),
            _ => (&self.kernels.dequant_f16, 2),
        };
        // Not zeroed first: that would be one more pass over the matrix.
        // SAFETY: the kernel below writes all n·elem bytes before the GEMM that reads them (and
        // if it fails to launch, the backend is poisoned and nothing reads them).
        let tmp = self.check("allocating a converted weight matrix", unsafe {
            self.stream.alloc::<u8>(n * elem)
        })?;
        let out = tmp.device_ptr(&self.stream).0;
        let (dtype, n_blocks) = (dtype_code(w.dtype), (n / 32) as u64);
        let mut b = self.stream.launch_builder(kernel);
        b.arg(&w_ptr).arg(&dtype).arg(&n_blocks).arg(&out);
        // SAFETY: the weight holds n_blocks·32 values in whole blocks of its dtype (checked when
        // the view was made: rows of 32-value block dtypes are multiples of 32, of super-block
        // dtypes multiples of 256) and `tmp` room for n_blocks·32 values of `to`; eight values
        // per thread.
        let r = unsafe { b.launch(self.elementwise(n / 8)) };
        self.check("dequant kernel", r)?;
        Some(tmp)
    }

    /// One query row: the positions in chunks of [`ATT_SPLIT`] over (head, chunk) blocks, then
    /// the chunks merged (see `attention_decode` in ops.cu). While a step is recorded the grid
    /// covers the whole cache (`capacity` positions) and the kernels read the position from the
    /// step parameters; the chunks past it come out empty and the merge skips them.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode(
        &self,
        qp: u64,
        kp: u64,
        vp: u64,
        pos0: usize,
        capacity: usize,
        shape: AttentionShape,
        scale: f32,
        op: u64,
    ) {
        let pos_dev = self.step_pos_ptr();
        let n_splits = if pos_dev.is_some() {
            capacity.max(pos0 + 1).div_ceil(ATT_SPLIT)
        } else {
            (pos0 + 1).div_ceil(ATT_SPLIT)
        };
        let Some(pp) = self.attention_partials(shape, capacity.max(pos0 + 1)) else {
            return;
        };
        let (p0, nh, nkv, hd, split) = (
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            ATT_SPLIT as i32,
        );
        let pos_ptr = pos_dev.unwrap_or(0);
        let mut b = self.stream.launch_builder(&self.kernels.attention_decode);
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&p0)
            .arg(&pos_ptr)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&scale)
            .arg(&split)
            .arg(&pp);
        let cfg = LaunchConfig {
            grid_dim: (shape.n_heads as u32, n_splits as u32, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: q holds n_heads·head_dim values, the caches `capacity` positions of
        // n_kv_heads·head_dim (the kernel reads only the first pos+1), the partials
        // n_heads·n_splits·(2+head_dim) (`attention_partials` sized them for the capacity);
        // ATT_SPLIT <= the kernel's tile of 1024.
        let r = unsafe { b.launch(cfg) };
        if self.check("attention_decode kernel", r).is_none() {
            return;
        }
        let n_splits_i = n_splits as i32;
        let mut b = self.stream.launch_builder(&self.kernels.attention_combine);
        b.arg(&pp).arg(&n_splits_i).arg(&hd).arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (shape.n_heads as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads the partials written above, writes n_heads·head_dim values of out.
        let r = unsafe { b.launch(cfg) };
        self.check("attention_combine kernel", r);
    }

    /// The device address of room for the partial results of `attention_decode` over a cache
    /// of `capacity` positions (a [`Self::reused_buffer`] sized for the largest cache seen).
    fn attention_partials(&self, shape: AttentionShape, capacity: usize) -> Option<u64> {
        let need = shape.n_heads * capacity.div_ceil(ATT_SPLIT) * (2 + shape.head_dim);
        self.reused_buffer(
            &self.attention_scratch,
            need,
            "allocating attention partials",
            true,
        )
    }

    /// `out[rows, m] = x[rows, k] · W[m, k]ᵀ` with cuBLAS, W of type `w_type` (f16 or bf16) at
    /// `w_ptr`: x is rounded to that type (tensor cores take both operands in one type),
    /// products accumulate in f32.
    #[allow(clippy::too_many_arguments)]
    fn matmul_cublas(
        &self,
        blas: &cudarc::cublas::CudaBlas,
        xp: u64,
        rows: usize,
        w: &WeightView<'_>,
        w_ptr: u64,
        w_type: DType,
        op: u64,
        accumulate: bool,
    ) {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
        };
        let (m, k) = (w.rows, w.cols);
        let n = rows * k;
        // x in the weights' type: f32 as it is, else a rounded copy.
        let (x_in, x16, data_type) = if w_type == DType::F32 {
            (xp, None, cudaDataType::CUDA_R_32F)
        } else {
            let Some(x16) = self.check(
                "allocating a half-precision copy of x",
                self.stream.alloc_zeros::<u16>(n),
            ) else {
                return;
            };
            let x16p = x16.device_ptr(&self.stream).0;
            let (convert, data_type) = match w_type {
                DType::F16 => (&self.kernels.copy_f32_to_f16, cudaDataType::CUDA_R_16F),
                _ => (&self.kernels.copy_f32_to_bf16, cudaDataType::CUDA_R_16BF),
            };
            let n64 = n as u64;
            let mut b = self.stream.launch_builder(convert);
            b.arg(&xp).arg(&x16p).arg(&n64);
            // SAFETY: x holds rows·k values and x16 was allocated with exactly that many.
            let r = unsafe { b.launch(self.elementwise(n)) };
            if self.check("f32 to half kernel", r).is_none() {
                return;
            }
            (x16p, Some(x16), data_type)
        };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: column-major view of the row-major operands: W is k×m (ld k) taken
        // transposed, x16 is k×rows (ld k), out is m×rows (ld m) = row-major [rows, m]. Every
        // pointer is a live device allocation of at least that extent (the weight view's
        // shape was checked when the view was made; x and out hold rows·k and rows·m values);
        // the handle runs on this backend's stream, so x16 outlives the queued GEMM (its free
        // is ordered on the same stream).
        let r = unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                rows as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                w_ptr as *const std::ffi::c_void,
                data_type,
                k as i32,
                x_in as *const std::ffi::c_void,
                data_type,
                k as i32,
                (&beta as *const f32).cast(),
                op as *mut std::ffi::c_void,
                cudaDataType::CUDA_R_32F,
                m as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        self.check("cublasGemmEx", r);
        drop(x16);
    }

    /// `kernel(x, y, len)` over `len` values, updating `x` from `y` in place (swiglu, add).
    fn in_place(
        &self,
        kernel: &CudaFunction,
        what: &str,
        x: &mut CudaBuf,
        y: &CudaBuf,
        len: usize,
    ) {
        if self.failed() || len == 0 {
            return;
        }
        let (Some(xp), Some(yp)) = (self.ptr(x, 0), self.ptr(y, 0)) else {
            return;
        };
        let n = len as u64;
        let mut b = self.stream.launch_builder(kernel);
        b.arg(&xp).arg(&yp).arg(&n);
        // SAFETY: both buffers hold at least len values; the kernels touch elements < n.
        let r = unsafe { b.launch(self.elementwise(len)) };
        self.check(what, r);
    }

    /// Converts `n` elements from `src` (+`src_off`) into `dst` (+`dst_off`), f32 or f16 each.
    fn copy(&self, src: &CudaBuf, src_off: usize, dst: &CudaBuf, dst_off: usize, n: usize) {
        let (Some(s), Some(d)) = (self.ptr(src, src_off), self.ptr(dst, dst_off)) else {
            return;
        };
        let k = match (src, dst) {
            (CudaBuf::F32(_), CudaBuf::F32(_)) => &self.kernels.copy_f32,
            (CudaBuf::F32(_), CudaBuf::F16(_)) => &self.kernels.copy_f32_to_f16,
            (CudaBuf::F16(_), CudaBuf::F32(_)) => &self.kernels.copy_f16_to_f32,
            _ => {
                self.fail("copy_rows", "f16 to f16 copies are not supported");
                return;
            }
        };
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(k);
        b.arg(&s).arg(&d).arg(&n64);
        // SAFETY: `copy_*` reads n elements at s and writes n at d; both pointers come from
        // live buffers of at least offset + n elements (the forward pass's contract).
        let r = unsafe { b.launch(self.elementwise(n)) };
        self.check("copy kernel", r);
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, len: usize) -> CudaBuf {
        // A new buffer may sit where a quantized one was.
        self.ops_issued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.stream.alloc_zeros::<f32>(len.max(1)) {
            Ok(s) => CudaBuf::F32(s),
            Err(e) => {
                self.fail(&format!("allocating {len} f32 values"), e);
                CudaBuf::Failed
            }
        }
    }

    /// The KV cache is f16 (see `alloc_kv`).
    fn kv_value_bytes(&self) -> usize {
        2
    }

    /// The KV cache is f16 on the device: half the memory and bandwidth of f32.
    fn alloc_kv(&self, len: usize) -> CudaBuf {
        match self.stream.alloc_zeros::<u16>(len.max(1)) {
            Ok(s) => CudaBuf::F16(s),
            Err(e) => {
                self.fail(&format!("allocating {len} f16 KV-cache values"), e);
                CudaBuf::Failed
            }
        }
    }

    fn read(&self, buf: &CudaBuf, out: &mut [f32]) {
        if self.failed() {
            return;
        }
        let n = out.len();
        let r = match buf {
            CudaBuf::F32(s) => self.stream.memcpy_dtoh(&s.slice(0..n), out),
            CudaBuf::F16(_) => {
                let tmp = self.alloc(n);
                self.copy(buf, 0, &tmp, 0, n);
                match &tmp {
                    CudaBuf::F32(t) => self.stream.memcpy_dtoh(&t.slice(0..n), out),
                    _ => return,
                }
            }
            CudaBuf::Failed => return self.fail("read", "buffer allocation had failed"),
        };
        self.check("copying results to the host", r);
        let r = self.stream.synchronize();
        self.check("synchronising the stream", r);
    }

    fn status(&self) -> Result<(), LlamaError> {
        match self.error.lock().expect("not poisoned").as_ref() {
            None => Ok(()),
            Some(message) => Err(device_error(format!(
                "{} ({}): {message}",
                self.device_name,
                self.ctx.ordinal()
            ))),
        }
    }

    fn embed_rows(&self, table: WeightView<'_>, ids: &[u32], out: &mut CudaBuf) {
        if self.failed() || ids.is_empty() {
            return;
        }
        let Some(w) = self.weight(&table) else { return };
        let Some(ids_dev) = self.check("uploading token ids", self.stream.clone_htod(ids)) else {
            return;
        };
        let Some(o) = self.ptr(out, 0) else { return };
        let ids_ptr = ids_dev.device_ptr(&self.stream).0;
        let (row_bytes, dtype, dim) = (
            table.row_bytes() as u64,
            dtype_code(table.dtype),
            table.cols as i32,
        );
        let kernel = if kq_kernels(table.dtype) {
            &self.kernels.kq_embed_rows
        } else {
            &self.kernels.embed_rows
        };
        let mut b = self.stream.launch_builder(kernel);
        b.arg(&w.ptr)
            .arg(&row_bytes)
            .arg(&dtype)
            .arg(&ids_ptr)
            .arg(&dim)
            .arg(&o);
        let cfg = LaunchConfig {
            grid_dim: (ids.len() as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ids are < the table's rows (checked by `Llama::forward`), the table holds
        // rows·row_bytes bytes, `out` holds ids.len()·dim values.
        let r = unsafe { b.launch(cfg) };
        self.check("embed_rows kernel", r);
    }

    fn rmsnorm(
        &self,
        x: &CudaBuf,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &mut CudaBuf,
    ) {
        if self.failed() || rows == 0 {
            return;
        }
        let Some(w) = self.weight(&weight) else {
            return;
        };
        let (Some(xp), Some(op)) = (self.ptr(x, 0), self.ptr(out, 0)) else {
            return;
        };
        let (dtype, dim) = (dtype_code(weight.dtype), weight.cols as i32);
        let n = rows * weight.cols;
        let (xq, xs) = self.x16_fused_target(n);
        let mut b = self.stream.launch_builder(&self.kernels.rmsnorm);
        b.arg(&xp)
            .arg(&w.ptr)
            .arg(&dtype)
            .arg(&dim)
            .arg(&eps)
            .arg(&op)
            .arg(&xq)
            .arg(&xs);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (RMS_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x and out hold rows·dim values, the weight dim values; xq/xs are null or
        // (dim a multiple of 32) the scratch's room for rows·dim quantized values.
        let r = unsafe { b.launch(cfg) };
        if self.check("rmsnorm kernel", r).is_some() {
            self.remember_x16(op, n, (xq, xs));
        }
    }

    fn matmul(&self, x: &CudaBuf, rows: usize, w: WeightView<'_>, out: &mut CudaBuf) {
        if self.failed() || rows == 0 {
            return;
        }
        let (Some(xp), Some(op)) = (self.ptr(x, 0), self.ptr(out, 0)) else {
            return;
        };
        self.matmul_jobs(xp, rows, &[(&w, op)], rows, false);
    }

    /// Q/K/V and gate/up share one launch of the matmul kernel.
    fn matmul_many(
        &self,
        x: &CudaBuf,
        rows: usize,
        ws: &[WeightView<'_>],
        outs: &mut [&mut CudaBuf],
    ) {
        let group = crate::backend::RowGroup {
            rows,
            solo_rows: rows,
        };
        self.matmul_groups(x, &[group], ws, outs, false);
    }

    /// One pass over each weight for a batch, every row computed as its sequence alone would
    /// compute it: runs of sequences whose solo pass has fewer than [`CUBLAS_MIN_ROWS`] rows
    /// (decoding) share one launch of the matmul kernel, whose result per row does not depend on
    /// the row count; a sequence prefilling a prompt of at least that many rows gets its own
    /// cuBLAS GEMM, as alone.
    fn matmul_batch(
        &self,
        x: &CudaBuf,
        groups: &[crate::backend::RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut CudaBuf],
    ) {
        self.matmul_groups(x, groups, ws, outs, false);
    }

    /// The kernel adds to `out` as it writes (cuBLAS: β = 1); `scratch` is not used.
    fn matmul_add_batch(
        &self,
        x: &CudaBuf,
        groups: &[crate::backend::RowGroup],
        w: WeightView<'_>,
        _scratch: &mut CudaBuf,
        out: &mut CudaBuf,
    ) {
        self.matmul_groups(x, groups, &[w], &mut [out], true);
    }

    fn rope(
        &self,
        x: &mut CudaBuf,
        rows: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        inv_freq: &[f32],
    ) {
        if self.failed() || rows == 0 {
            return;
        }
        let Some(f) = self.inv_freq_ptr(inv_freq) else {
            return;
        };
        let Some(xp) = self.ptr(x, 0) else { return };
        let (rows_i, heads, hd, p0) = (rows as i32, n_heads as i32, head_dim as i32, pos0 as i32);
        let mut b = self.stream.launch_builder(&self.kernels.rope);
        b.arg(&xp)
            .arg(&rows_i)
            .arg(&heads)
            .arg(&hd)
            .arg(&p0)
            .arg(&f);
        // SAFETY: x holds rows·n_heads·head_dim values, inv_freq head_dim/2.
        let r = unsafe { b.launch(self.elementwise(rows * n_heads * head_dim / 2)) };
        self.check("rope kernel", r);
    }

    fn copy_rows(
        &self,
        src: &CudaBuf,
        src_row: usize,
        dst: &mut CudaBuf,
        dst_row: usize,
        rows: usize,
        row_len: usize,
    ) {
        if self.failed() || rows == 0 {
            return;
        }
        self.copy(
            src,
            src_row * row_len,
            dst,
            dst_row * row_len,
            rows * row_len,
        );
    }

    fn attention(
        &self,
        q: &CudaBuf,
        rows: usize,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        pos0: usize,
        shape: AttentionShape,
        out: &mut CudaBuf,
    ) {
        if self.failed() || rows == 0 {
            return;
        }
        if shape.head_dim > ROW_THREADS as usize {
            return self.fail(
                "attention",
                format!("head_dim {} > {ROW_THREADS}", shape.head_dim),
            );
        }
        // The kernel reads an f16 cache; an f32 one (from `alloc`) is converted first.
        let as_f16 = |c: &CudaBuf| -> Option<Option<CudaBuf>> {
            match c {
                CudaBuf::F16(_) => Some(None),
                _ => {
                    let n = (pos0 + rows) * shape.n_kv_heads * shape.head_dim;
                    let tmp = self.alloc_kv(n);
                    self.copy(c, 0, &tmp, 0, n);
                    Some(Some(tmp))
                }
            }
        };
        let (Some(k16), Some(v16)) = (as_f16(k_cache), as_f16(v_cache)) else {
            return;
        };
        let kc = k16.as_ref().unwrap_or(k_cache);
        let vc = v16.as_ref().unwrap_or(v_cache);
        let (Some(qp), Some(kp), Some(vp), Some(op)) = (
            self.ptr(q, 0),
            self.ptr(kc, 0),
            self.ptr(vc, 0),
            self.ptr(out, 0),
        ) else {
            return;
        };
        let (p0, nh, nkv, hd) = (
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
        );
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        if rows == 1 {
            let capacity = match kc {
                CudaBuf::F16(c) => c.len() / (shape.n_kv_heads * shape.head_dim),
                _ => pos0 + 1,
            };
            return self.attention_decode(qp, kp, vp, pos0, capacity, shape, scale, op);
        }
        let mut b = self.stream.launch_builder(&self.kernels.attention);
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&p0)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&scale)
            .arg(&op);
        let cfg = LaunchConfig {
            grid_dim: ((rows * shape.n_heads) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: q and out hold rows·n_heads·head_dim values, the caches at least
        // (pos0+rows)·n_kv_heads·head_dim; head_dim <= 256 was checked above.
        let r = unsafe { b.launch(cfg) };
        self.check("attention kernel", r);
    }

    /// One launch: RoPE on the q and k rows, k and v stored in the f16 caches.
    fn rope_store_kv(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        row0: usize,
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        inv_freq: &[f32],
        k_cache: &mut CudaBuf,
        v_cache: &mut CudaBuf,
    ) {
        if self.failed() || rows == 0 {
            return;
        }
        let (hd, kv_dim) = (shape.head_dim, shape.n_kv_heads * shape.head_dim);
        if !matches!((&*k_cache, &*v_cache), (CudaBuf::F16(_), CudaBuf::F16(_))) {
            // f32 caches (from `alloc`): the separate ops convert as they copy.
            return crate::backend::rope_store_kv_separately(
                self, q, k, v, row0, rows, pos0, shape, inv_freq, k_cache, v_cache,
            );
        }
        let Some(f) = self.inv_freq_ptr(inv_freq) else {
            return;
        };
        let (Some(qp), Some(kp), Some(vp), Some(kc), Some(vc)) = (
            self.ptr(q, row0 * shape.n_heads * hd),
            self.ptr(k, row0 * kv_dim),
            self.ptr(v, row0 * kv_dim),
            self.ptr(k_cache, 0),
            self.ptr(v_cache, 0),
        ) else {
            return;
        };
        let pos_ptr = self.step_pos_ptr().unwrap_or(0);
        let (rows_i, nh, nkv, hd_i, p0) = (
            rows as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            hd as i32,
            pos0 as i32,
        );
        let mut b = self.stream.launch_builder(&self.kernels.rope_store_kv);
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&rows_i)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd_i)
            .arg(&p0)
            .arg(&pos_ptr)
            .arg(&f)
            .arg(&kc)
            .arg(&vc);
        // SAFETY: q holds rows·n_heads·head_dim values from row0, k and v rows·kv_dim; the
        // caches hold the positions pos0 .. pos0+rows (the forward pass checks the capacity),
        // inv_freq head_dim/2 values.
        let r = unsafe {
            b.launch(self.elementwise(rows * (shape.n_heads + shape.n_kv_heads) * hd / 2))
        };
        self.check("rope_store_kv kernel", r);
    }

    fn records_steps(&self) -> bool {
        self.graphs
    }

    fn begin_step_capture(&self, _pos: usize) -> bool {
        if !self.graphs || self.failed() {
            return false;
        }
        let mut step = self.step.lock().expect("not poisoned");
        step.graph = None;
        // Thread-local: the residency reader's driver calls on other threads stay legal.
        let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        match self.stream.begin_capture(mode) {
            Ok(()) => {
                step.capturing = true;
                step.broken = false;
                true
            }
            Err(e) => {
                tracing::debug!("cuStreamBeginCapture: {e}; decoding op by op");
                false
            }
        }
    }

    fn end_step_capture(&self) -> bool {
        let mut step = self.step.lock().expect("not poisoned");
        if !step.capturing {
            return false;
        }
        step.capturing = false;
        let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
        match self.stream.end_capture(flags) {
            Ok(Some(graph)) if !step.broken && !self.failed() => {
                step.graph = Some(StepGraph(graph));
                true
            }
            Ok(_) => false,
            Err(e) => {
                tracing::debug!("recording the decode step: {e}; decoding op by op");
                false
            }
        }
    }

    fn replay_step(&self, pos: usize) -> bool {
        if self.failed() {
            return false;
        }
        let mut step = self.step.lock().expect("not poisoned");
        let StepRecording {
            pos: param, graph, ..
        } = &mut *step;
        let Some(graph) = graph.as_ref() else {
            return false;
        };
        let r = self.stream.memcpy_htod(&[pos as i32], param);
        if self.check("writing the step position", r).is_none() {
            return false;
        }
        let ran = self.check("cuGraphLaunch", graph.0.launch()).is_some();
        self.replays
            .fetch_add(ran as u64, std::sync::atomic::Ordering::Relaxed);
        ran
    }

    fn forget_step(&self) {
        self.step.lock().expect("not poisoned").graph = None;
    }

    fn swiglu(&self, gate: &mut CudaBuf, up: &CudaBuf, len: usize) {
        if self.failed() || len == 0 {
            return;
        }
        let (Some(gp), Some(up)) = (self.ptr(gate, 0), self.ptr(up, 0)) else {
            return;
        };
        let (xq, xs) = self.x16_fused_target(len);
        let n = len as u64;
        let mut b = self.stream.launch_builder(&self.kernels.swiglu);
        b.arg(&gp).arg(&up).arg(&n).arg(&xq).arg(&xs);
        let threads = if len.is_multiple_of(4) { len / 4 } else { len };
        // SAFETY: both buffers hold at least len values; the kernel touches elements < n (four
        // per thread when n is a multiple of 4); xq/xs are null or (n a multiple of 32) the
        // scratch's room for n quantized values.
        let r = unsafe { b.launch(self.elementwise(threads)) };
        if self.check("swiglu kernel", r).is_some() {
            self.remember_x16(gp, len, (xq, xs));
        }
    }

    fn add(&self, x: &mut CudaBuf, y: &CudaBuf, len: usize) {
        self.in_place(&self.kernels.add, "add", x, y, len);
    }
}

/// Every blob of a model in host memory with a copy in device memory (see
/// [`CudaBackend::upload_weights`]). The forward pass reads views of the host bytes; the backend
/// that uploaded them maps those views to the device copies.
#[derive(Debug, Clone)]
pub struct DeviceWeights {
    host: Arc<Vec<Vec<u8>>>,
}

impl DeviceWeights {
    /// Bytes of all blobs.
    pub fn total_bytes(&self) -> usize {
        self.host.iter().map(Vec::len).sum()
    }
}

impl WeightSource for DeviceWeights {
    type Guard<'a> = &'a [u8];

    fn acquire(&self, index: usize) -> Result<&[u8], LlamaError> {
        self.host
            .get(index)
            .map(Vec::as_slice)
            .ok_or_else(|| LlamaError::MissingBlob {
                file: format!("#{index}"),
            })
    }

    fn read_range(&self, index: usize, offset: u64, len: usize) -> Result<Vec<u8>, LlamaError> {
        crate::weights::copy_range(self.acquire(index)?, index, offset, len)
    }

    fn end_pass(&self) {}
}

/// Opens the model directory `dir` on CUDA device `ordinal` with every blob resident in device
/// memory and a KV cache of `context` positions (0: the model's context length).
pub fn open_resident(
    dir: &std::path::Path,
    ordinal: usize,
    context: usize,
) -> Result<crate::Llama<CudaBackend, DeviceWeights>, LlamaError> {
    let model = weights_format::Model::open(dir)?;
    let metadata = model.metadata().clone();
    let context = if context == 0 {
        metadata.config.context_length as usize
    } else {
        context
    };
    let backend = CudaBackend::new(ordinal)?;
    let blobs = (0..metadata.blobs.len())
        .map(|i| {
            let path = model.blob_path(i);
            std::fs::read(&path).map_err(|source| LlamaError::Io { path, source })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let weights = backend.upload_weights(blobs)?;
    tracing::info!(
        device = backend.device_name(),
        bytes = weights.total_bytes(),
        "model weights resident in device memory"
    );
    crate::Llama::new(backend, weights, metadata, context, context)
}
