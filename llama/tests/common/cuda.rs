//! Helpers of the CUDA tests (`cuda_ops.rs`, `cuda_kquants.rs`).

use llama::backend::cuda::{CUBLAS_MIN_ROWS, CudaBuf};
use llama::{Backend, CudaBackend, ReferenceBackend, WeightView};
use rand::RngExt;
use rand::rngs::StdRng;
use weights_format::DType;

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

/// Max |a-b| relative to the largest |b|.
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

pub fn up(be: &CudaBackend, data: &[f32]) -> CudaBuf {
    be.upload(data).expect("upload")
}

pub fn down(be: &CudaBackend, buf: &CudaBuf, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    be.read(buf, &mut out);
    be.status().expect("CUDA ops succeeded");
    out
}

/// f32 accumulation (in another order than the f64 reference) over up to 1536 products; for
/// quantized weights on the kernel path also x as 16-bit integers per 32-value block (each
/// value within 2^-16 of its block's largest, ~1e-5 of a dot product here).
pub const MATMUL_TOL: f32 = 1e-4;
/// Quantized weights through cuBLAS: each dequantized weight rounded to f16.
pub const QUANT_GEMM_TOL: f32 = 2e-3;
/// `x · Wᵀ` for `rows` random rows of x on the device against the reference backend, the max
/// relative difference printed and checked against the tolerance of the path the rows take:
/// the matmul kernels, or from [`CUBLAS_MIN_ROWS`] rows cuBLAS, which takes both operands in
/// the weights' type: the reference gets x rounded the same way, so the tolerance stays that of
/// f32 accumulation. f16 and quantized weights go there as f16 with x rounded to f16; bf16 ones
/// as f32 with x as it is.
pub fn check_matmul(be: &CudaBackend, view: WeightView<'_>, rows: usize, rng: &mut StdRng) {
    let (dtype, m, k) = (view.dtype, view.rows, view.cols);
    let x: Vec<f32> = (0..rows * k)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
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
    ReferenceBackend.matmul(&x_ref, rows, view, &mut want);
    let xd = up(be, &x);
    let mut out = be.alloc(rows * m);
    be.matmul(&xd, rows, view, &mut out);
    let got = down(be, &out, rows * m);
    let d = max_rel_diff(&got, &want);
    println!(
        "matmul {dtype} [{m}x{k}] rows={rows}{}: max rel diff {d:.2e} (tol {tol:.0e})",
        if via_cublas { " (cuBLAS)" } else { "" }
    );
    assert!(d < tol, "matmul {dtype} {m}x{k} rows={rows}: {d}");
}

pub fn via_f16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect()
}
