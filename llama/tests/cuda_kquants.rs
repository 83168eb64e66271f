//! The CUDA kernels of the dtypes added with the k-quants (q5_0, q5_1, iq4_nl, q2_k … q6_k,
//! iq4_xs; `kernels/kquants.cu`) against the slow reference backend (weights decoded by
//! `weights_format::quant`) on random blocks: the matmul kernels at one row (decode), a few rows
//! (batched decode) and many rows (prefill through cuBLAS on a dequantized f16 copy), and the
//! embedding lookup. Max difference printed, tolerance stated. Opt-in: `GDSLLM_GPU_TESTS=1`
//! (then a machine without a usable GPU FAILS these tests instead of skipping them). Needs the
//! `cuda` feature. Whole models in a k-quant mix are in `cuda_ops.rs`.
#![cfg(feature = "cuda")]

use gdsllm_convert::testing::random_blocks;
use llama::{Backend, CudaBackend, ReferenceBackend, WeightView};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use weights_format::DType;

const KQUANT_DTYPES: [DType; 9] = [
    DType::Q5_0,
    DType::Q5_1,
    DType::Iq4Nl,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Iq4Xs,
];

/// The backend on device 0, `None` (after saying so) unless `GDSLLM_GPU_TESTS=1`.
fn gpu() -> Option<CudaBackend> {
    if std::env::var("GDSLLM_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set GDSLLM_GPU_TESTS=1 to run the CUDA tests (they need a GPU)");
        return None;
    }
    match CudaBackend::new(0) {
        Ok(be) => Some(be),
        Err(e) => panic!("GDSLLM_GPU_TESTS=1 but CUDA is not usable: {e}"),
    }
}

/// Max |a−b| relative to the largest |b|.
fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

fn down(be: &CudaBackend, buf: &llama::backend::cuda::CudaBuf, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    be.read(buf, &mut out);
    be.status().expect("CUDA ops succeeded");
    out
}

/// The kernels: exact integer sums of the levels with x as 16-bit integers per 32-value block
/// (each within 2^-16 of its block's largest), f32 scaling and accumulation: ~1e-5 of a dot
/// product here, against an f64 reference.
const KERNEL_TOL: f32 = 1e-4;
/// cuBLAS: each decoded weight and each activation rounded to f16 (x is rounded for the
/// reference too, so the weights' rounding, 2^-11 each, is what remains).
const GEMM_TOL: f32 = 2e-3;

#[test]
fn kquant_matmuls_match_the_reference_for_every_row_count() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(21);
    for dtype in KQUANT_DTYPES {
        // Weight-row counts that leave partial tiles (MM_WROWS = 4); widths of one and of
        // several blocks per lane.
        let shapes: &[(usize, usize)] = if dtype.is_super_block() {
            &[(67, 256), (130, 2048), (9, 5120)]
        } else {
            &[(67, 96), (130, 2048), (9, 576)]
        };
        for &(m, k) in shapes {
            let w = random_blocks(dtype, m * k / dtype.block_len(), rng.random());
            let view = WeightView::host(dtype, m, k, &w);
            for rows in [1, 3, 8, 9, 40] {
                let x: Vec<f32> = (0..rows * k)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let via_cublas = rows >= llama::backend::cuda::CUBLAS_MIN_ROWS;
                let x_ref: Vec<f32> = if via_cublas {
                    x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect()
                } else {
                    x.clone()
                };
                let tol = if via_cublas { GEMM_TOL } else { KERNEL_TOL };
                let mut want = vec![0f32; rows * m];
                ReferenceBackend.matmul(&x_ref, rows, view, &mut want);
                let xd = be.upload(&x).unwrap();
                let mut out = be.alloc(rows * m);
                be.matmul(&xd, rows, view, &mut out);
                let got = down(&be, &out, rows * m);
                let d = max_rel_diff(&got, &want);
                println!(
                    "matmul {dtype} [{m}x{k}] rows={rows}{}: max rel diff {d:.2e} (tol {tol:.0e})",
                    if via_cublas { " (cuBLAS)" } else { "" }
                );
                assert!(d < tol, "matmul {dtype} {m}x{k} rows={rows}: {d}");
            }
        }
    }
}

#[test]
fn kquant_embedding_rows_are_the_decoded_rows() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(22);
    let (vocab, dim) = (50, 512);
    for dtype in KQUANT_DTYPES {
        let table = random_blocks(dtype, vocab * dim / dtype.block_len(), rng.random());
        let view = WeightView::host(dtype, vocab, dim, &table);
        let ids: Vec<u32> = (0..7).map(|_| rng.random_range(0..vocab as u32)).collect();
        let mut want = vec![0f32; ids.len() * dim];
        ReferenceBackend.embed_rows(view, &ids, &mut want);
        let mut out = be.alloc(ids.len() * dim);
        be.embed_rows(view, &ids, &mut out);
        let got = down(&be, &out, ids.len() * dim);
        // The device may fuse a·level + c into one FMA: one rounding fewer than the reference.
        let d = max_rel_diff(&got, &want);
        println!("embed_rows {dtype}: max rel diff {d:.2e} (tol 1e-6)");
        assert!(d <= 1e-6, "embed_rows {dtype}: {d}");
    }
}
