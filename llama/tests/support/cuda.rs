//! Helpers of the CUDA tests (`cuda_ops.rs`, `cuda_kquants.rs`): the opt-in backend, buffers
//! and weights on the device, and matmuls (one launch, tensor-core decode batches) checked
//! against the reference backend.

use llama::backend::RowGroup;
use llama::backend::cuda::{
    CUBLAS_MIN_ROWS, CudaBuf, CudaKvBuf, CudaPaths, DeviceWeights, mma_min_rows,
};
use llama::{Backend, CudaBackend, ReferenceBackend, WeightSource, WeightView};
use rand::rngs::StdRng;
use weights_format::DType;

use super::{matmul, max_rel_diff, random};

/// Whether the CUDA tests run (`GDSLLM_GPU_TESTS=1`: they need a GPU); says so when not.
pub fn enabled() -> bool {
    let on = std::env::var("GDSLLM_GPU_TESTS").as_deref() == Ok("1");
    if !on {
        eprintln!("skipped: set GDSLLM_GPU_TESTS=1 to run the CUDA tests (they need a GPU)");
    }
    on
}

/// The backend on device 0, `None` (after saying so) unless `GDSLLM_GPU_TESTS=1`.
pub fn gpu() -> Option<CudaBackend> {
    if !enabled() {
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

/// `rows` rows of a batch of one-row sequences (decoding): the rows the batched matmuls get.
pub fn decode_rows(rows: usize) -> Vec<RowGroup> {
    vec![RowGroup::solo(1); rows]
}

/// Decode batches of 2 to 70 rows times the `dtype` weight `w` [m, k] through `be`'s tensor-core
/// matmuls (`mma` path): against the reference (tol [`MATMUL_TOL`]), against each row alone
/// through `old`'s one-row kernel (within f32 summation order, the quantized products being the
/// same integers: tol 1e-5), and rows 0-1 the same bits whatever the batch size.
pub fn check_mma_batches(
    be: &CudaBackend,
    old: &CudaBackend,
    dtype: DType,
    (m, k): (usize, usize),
    w: &[u8],
    rng: &mut StdRng,
) {
    let host = WeightView::host(dtype, m, k, w);
    let dev = on_device(be, w);
    let wd = view(&dev, dtype, m, k);
    let dev_old = on_device(old, w);
    let wd_old = view(&dev_old, dtype, m, k);
    let x = random(rng, 70 * k);
    let mut first_rows: Option<Vec<f32>> = None;
    for rows in [2, 3, 8, 9, 16, 17, 33, 64, 70] {
        let x = x[..rows * k].to_vec();
        let mut want = vec![0f32; rows * m];
        matmul(&ReferenceBackend, &x, rows, host, &mut want);
        let xd = up(be, &x);
        let mut out = alloc(be, rows * m);
        be.matmul_batch(&xd, &decode_rows(rows), &[wd], &mut [&mut out])
            .unwrap();
        let got = down(be, &out, rows * m);
        let d = max_rel_diff(&got, &want);
        let mut alone = Vec::with_capacity(rows * m);
        for r in 0..rows {
            let xr = up(old, &x[r * k..(r + 1) * k]);
            let mut o = alloc(old, m);
            matmul(old, &xr, 1, wd_old, &mut o);
            alone.extend(down(old, &o, m));
        }
        let d_alone = max_rel_diff(&got, &alone);
        println!(
            "mma matmul {dtype} [{m}x{k}] rows={rows}: max rel diff {d:.2e} vs reference (tol {MATMUL_TOL:.0e}), {d_alone:.2e} vs each row alone (tol 1e-5)"
        );
        assert!(d < MATMUL_TOL, "mma {dtype} {m}x{k} rows={rows}: {d}");
        assert!(
            d_alone < 1e-5,
            "mma {dtype} {m}x{k} rows={rows} vs alone: {d_alone}"
        );
        // Batches below `mma_min_rows` run the row kernels (the one-row kernel's bits, checked
        // against each row alone above); from it on, rows 0-1 are the same bits in every batch.
        if rows < mma_min_rows(dtype) {
            continue;
        }
        match &first_rows {
            None => first_rows = Some(got[..2 * m].to_vec()),
            Some(f) => assert_eq!(
                &got[..2 * m],
                &f[..],
                "mma {dtype} {m}x{k}: rows 0-1 differ between the first batch and {rows}"
            ),
        }
    }
}

/// Q/K/V-style weights `w1` [m1, k] and `w2` [m2, k] of `dtype` in one launch of `be`'s batched
/// matmul, and the residual add, for a decode batch of 12 rows, against the reference (tol
/// [`MATMUL_TOL`]).
pub fn check_two_weights_and_add(
    be: &CudaBackend,
    dtype: DType,
    (m1, m2, k): (usize, usize, usize),
    (w1, w2): (&[u8], &[u8]),
    rng: &mut StdRng,
) {
    let rows = 12;
    let (d1, d2) = (on_device(be, w1), on_device(be, w2));
    let (v1, v2) = (view(&d1, dtype, m1, k), view(&d2, dtype, m2, k));
    let x = random(rng, rows * k);
    let base = random(rng, rows * m1);
    let (mut want1, mut want2) = (vec![0f32; rows * m1], vec![0f32; rows * m2]);
    matmul(
        &ReferenceBackend,
        &x,
        rows,
        WeightView::host(dtype, m1, k, w1),
        &mut want1,
    );
    matmul(
        &ReferenceBackend,
        &x,
        rows,
        WeightView::host(dtype, m2, k, w2),
        &mut want2,
    );
    let xd = up(be, &x);
    let (mut o1, mut o2) = (alloc(be, rows * m1), alloc(be, rows * m2));
    be.matmul_batch(&xd, &decode_rows(rows), &[v1, v2], &mut [&mut o1, &mut o2])
        .unwrap();
    let d = max_rel_diff(&down(be, &o1, rows * m1), &want1)
        .max(max_rel_diff(&down(be, &o2, rows * m2), &want2));
    let mut acc = up(be, &base);
    let mut scratch = alloc(be, rows * m1);
    be.matmul_add_batch(&xd, &decode_rows(rows), v1, &mut scratch, &mut acc)
        .unwrap();
    let want: Vec<f32> = base.iter().zip(&want1).map(|(a, b)| a + b).collect();
    let d_add = max_rel_diff(&down(be, &acc, rows * m1), &want);
    println!(
        "mma matmul {dtype}: two weights in one launch {d:.2e}, residual add {d_add:.2e} (tol {MATMUL_TOL:.0e})"
    );
    assert!(d < MATMUL_TOL && d_add < MATMUL_TOL, "{dtype}: {d} {d_add}");
}
