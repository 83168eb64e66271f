//! Helpers of the CUDA tests (`cuda_ops.rs`, `cuda_kquants.rs`): the opt-in backend, buffers
//! and weights on the device, and a matmul checked against the reference backend.

use llama::backend::cuda::{CUBLAS_MIN_ROWS, CudaBuf, CudaKvBuf, CudaPaths, DeviceWeights};
use llama::{Backend, CudaBackend, ReferenceBackend, WeightSource, WeightView};
use rand::rngs::StdRng;
use weights_format::DType;

use super::{matmul, max_rel_diff, random};

/// The backend on device 0, `None` (after saying so) unless `GDSLLM_GPU_TESTS=1`.
pub fn gpu() -> Option<CudaBackend> {
    if std::env::var("GDSLLM_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set GDSLLM_GPU_TESTS=1 to run the CUDA tests (they need a GPU)");
        return None;
    }
    match CudaBackend::new(0) {
        Ok(be) => Some(be),
        Err(e) => panic!("GDSLLM_GPU_TESTS=1 but CUDA is not usable: {e}"),
    }
}

/// Two backends on device 0, one with the given new kernel paths (issue 23) and one with
/// none, `None` unless `GDSLLM_GPU_TESTS=1`.
pub fn gpu_new_and_old(paths: CudaPaths) -> Option<(CudaBackend, CudaBackend)> {
    gpu()?;
    let open = |paths| match CudaBackend::with_paths(0, paths) {
        Ok(be) => be,
        Err(e) => panic!("GDSLLM_GPU_TESTS=1 but CUDA is not usable: {e}"),
    };
    Some((open(paths), open(CudaPaths::none())))
}

pub fn up(be: &CudaBackend, data: &[f32]) -> CudaBuf {
    be.upload(data).expect("upload")
}

pub fn down(be: &CudaBackend, buf: &CudaBuf, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    be.read(buf, &mut out).expect("CUDA ops succeeded");
    out
}

pub fn down_kv(be: &CudaBackend, buf: &CudaKvBuf, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    be.read_kv(buf, &mut out).expect("CUDA ops succeeded");
    out
}

pub fn alloc(be: &CudaBackend, n: usize) -> CudaBuf {
    be.alloc(n).expect("alloc")
}

/// Weight bytes uploaded to the device (kernels take weights only from device memory).
pub fn on_device(be: &CudaBackend, bytes: &[u8]) -> DeviceWeights {
    be.upload_weights(vec![bytes.to_vec()])
        .expect("upload weights")
}

/// The uploaded weight as a `[rows, cols]` tensor of `dtype`.
pub fn view(w: &DeviceWeights, dtype: DType, rows: usize, cols: usize) -> WeightView<'_> {
    WeightView::device(dtype, rows, cols, w.acquire(0).unwrap().ptr())
}

pub fn via_f16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect()
}

/// f32 accumulation (in another order than the f64 reference) over up to 1536 products; for
/// quantized weights on the kernel path also x as 16-bit integers per 32-value block (each
/// value within 2^-16 of its block's largest, ~1e-5 of a dot product here).
pub const MATMUL_TOL: f32 = 1e-4;
/// Quantized weights through cuBLAS: each dequantized weight rounded to f16.
pub const QUANT_GEMM_TOL: f32 = 2e-3;

/// `x · Wᵀ` for `rows` random rows of x on the device (weights `bytes` of `dtype`, `[m, k]`)
/// against the reference backend, the max relative difference printed and checked against the
/// tolerance of the path the rows take: the matmul kernels, or from [`CUBLAS_MIN_ROWS`] rows
/// cuBLAS, which takes both operands in the weights' type: the reference gets x rounded the
/// same way, so the tolerance stays that of f32 accumulation. f16 and quantized weights go
/// there as f16 with x rounded to f16; bf16 ones as f32 with x as it is.
pub fn check_matmul(
    be: &CudaBackend,
    dtype: DType,
    m: usize,
    k: usize,
    bytes: &[u8],
    rows: usize,
    rng: &mut StdRng,
) {
    let host = WeightView::host(dtype, m, k, bytes);
    let dev = on_device(be, bytes);
    let wd = view(&dev, dtype, m, k);
    let x = random(rng, rows * k);
    let via_cublas = rows >= CUBLAS_MIN_ROWS && dtype != DType::F32;
    let x_ref: Vec<f32> = if via_cublas && dtype != DType::Bf16 {
        via_f16(&x)
    } else {
        x.clone()
    };
    // Dequantized weights rounded to f16 (2^-11 relative each) add error that f32
    // accumulation alone does not have (bf16 converts exactly).
    let tol = if via_cublas && !matches!(dtype, DType::F16 | DType::Bf16) {
        QUANT_GEMM_TOL
    } else {
        MATMUL_TOL
    };
    let mut want = vec![0f32; rows * m];
    matmul(&ReferenceBackend, &x_ref, rows, host, &mut want);
    let xd = up(be, &x);
    let mut out = alloc(be, rows * m);
    matmul(be, &xd, rows, wd, &mut out);
    let got = down(be, &out, rows * m);
    let d = max_rel_diff(&got, &want);
    println!(
        "matmul {dtype} [{m}x{k}] rows={rows}{}: max rel diff {d:.2e} (tol {tol:.0e})",
        if via_cublas { " (cuBLAS)" } else { "" }
    );
    assert!(d < tol, "matmul {dtype} {m}x{k} rows={rows}: {d}");
}
