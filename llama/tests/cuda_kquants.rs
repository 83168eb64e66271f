//! The CUDA kernels of the dtypes added with the k-quants (q5_0, q5_1, iq4_nl, q2_k … q6_k,
//! iq4_xs; `kernels/kquants.cu`) against the slow reference backend (weights decoded by
//! `weights_format::quant`) on random blocks: the matmul kernels at one row (decode), a few rows
//! (batched decode: the tensor-core kernels of `kernels/kquants_mma.cu` on the default paths)
//! and many rows (prefill through cuBLAS on a dequantized f16 copy), and the embedding lookup. Max difference printed, tolerance stated (the matmul tolerances are those of
//! `support::cuda::check_matmul`: 1e-4 relative on the kernels — exact integer sums of the levels
//! with x as 16-bit integers per 32 values, f32 scaling — and 2e-3 through cuBLAS). Opt-in: `GDSLLM_GPU_TESTS=1`
//! (then a machine without a usable GPU FAILS these tests instead of skipping them). Needs the
//! `cuda` feature. Whole models in a k-quant mix are in `cuda_ops.rs`.
#![cfg(feature = "cuda")]

mod support;

use gdsllm_convert::testing::random_blocks;
use llama::backend::RowGroup;
use llama::backend::cuda::CudaPaths;
use llama::{Backend, ReferenceBackend, WeightView};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use support::cuda::{
    alloc, check_matmul, check_mma_batches, check_two_weights_and_add, down, gpu, gpu_new_and_old,
    on_device, up, view,
};
use support::max_rel_diff;
use weights_format::DType;

/// The dtypes of `kernels/kquants.cu`: those format version 3 added.
fn kquant_dtypes() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|d| d.format_version() == 3)
}

#[test]
fn kquant_matmuls_match_the_reference_for_every_row_count() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(21);
    for dtype in kquant_dtypes() {
        // Weight-row counts that leave partial tiles (MM_WROWS = 4); widths of one and of
        // several blocks per lane.
        let shapes: &[(usize, usize)] = if dtype.is_super_block() {
            &[(67, 256), (130, 2048), (9, 5120)]
        } else {
            &[(67, 96), (130, 2048), (9, 576)]
        };
        for &(m, k) in shapes {
            let w = random_blocks(dtype, m * k / dtype.block_len(), rng.random());
            for rows in [1, 3, 8, 9, 40] {
                check_matmul(&be, dtype, m, k, &w, rows, &mut rng);
            }
        }
    }
}

#[test]
fn kquant_embedding_rows_are_the_decoded_rows() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(22);
    let (vocab, dim) = (50, 512);
    for dtype in kquant_dtypes() {
        let table = random_blocks(dtype, vocab * dim / dtype.block_len(), rng.random());
        let host = WeightView::host(dtype, vocab, dim, &table);
        let dev = on_device(&be, &table);
        let ids: Vec<u32> = (0..7).map(|_| rng.random_range(0..vocab as u32)).collect();
        let mut want = vec![0f32; ids.len() * dim];
        ReferenceBackend.embed_rows(host, &ids, &mut want).unwrap();
        let mut out = alloc(&be, ids.len() * dim);
        be.embed_rows(view(&dev, dtype, vocab, dim), &ids, &mut out)
            .unwrap();
        let got = down(&be, &out, ids.len() * dim);
        // The device may fuse a·level + c into one FMA: one rounding fewer than the reference.
        let d = max_rel_diff(&got, &want);
        println!("embed_rows {dtype}: max rel diff {d:.2e} (tol 1e-6)");
        assert!(d <= 1e-6, "embed_rows {dtype}: {d}");
    }
}

/// The `superblock` path's q4_k, q5_k and q6_k kernels (16 lanes per super-block) against the
/// reference at the decode row counts (odd super-block counts leave half-warps idle; partial
/// tiles of 4 weight rows), and a decode batch's rows the same bits as each row alone.
#[test]
fn superblock_kquant_matmuls_match_the_reference_and_the_row_alone() {
    let Some((be, _old)) = gpu_new_and_old(CudaPaths {
        superblock: true,
        ..CudaPaths::none()
    }) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(23);
    for dtype in [DType::Q4K, DType::Q5K, DType::Q6K] {
        for (m, k) in [(67, 256), (130, 2048), (9, 5120), (258, 11008)] {
            let w = random_blocks(dtype, m * k / dtype.block_len(), rng.random());
            for rows in [1, 3, 8, 9] {
                check_matmul(&be, dtype, m, k, &w, rows, &mut rng);
            }
            let rows = 9;
            let dev = on_device(&be, &w);
            let wd = view(&dev, dtype, m, k);
            let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut batch = alloc(&be, rows * m);
            be.matmul_batch(
                &up(&be, &x),
                &vec![RowGroup::solo(1); rows],
                &[wd],
                &mut [&mut batch],
            )
            .unwrap();
            let batch = down(&be, &batch, rows * m);
            let mut differing = 0;
            for r in 0..rows {
                let mut alone = alloc(&be, m);
                let xr = up(&be, &x[r * k..(r + 1) * k]);
                be.matmul_batch(&xr, &[RowGroup::solo(1)], &[wd], &mut [&mut alone])
                    .unwrap();
                let alone = down(&be, &alone, m);
                differing += (0..m)
                    .filter(|&i| alone[i].to_bits() != batch[r * m + i].to_bits())
                    .count();
            }
            println!(
                "superblock {dtype} [{m}x{k}] rows={rows}: {differing} values differ from the rows alone"
            );
            assert_eq!(differing, 0, "superblock {dtype} [{m}x{k}]");
        }
    }
}

/// The tensor-core matmuls of these dtypes (`mma` path, `kquants_mma.cu`) for decode batches of
/// 2 to 70 rows (one sequence a row): against the reference, against each row alone through the
/// one-row kernel, rows 0-1 the same bits whatever the batch size (`check_mma_batches`); then two
/// weights in one launch and the residual add; the column slices summed by their own kernel
/// (`slicesum`, the default; the last block of each tile's sum is checked in `cuda_ops`).
#[test]
fn mma_kquant_matmuls_match_the_reference_and_the_row_alone() {
    let Some((be, old)) = gpu_new_and_old(CudaPaths {
        mma: true,
        slicesum: true,
        ..CudaPaths::none()
    }) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(24);
    for dtype in kquant_dtypes() {
        // Ragged weight rows (blocks of 256), one to several column slices.
        let shapes: &[(usize, usize)] = if dtype.is_super_block() {
            &[(77, 256), (300, 2048), (130, 5120)]
        } else {
            &[(77, 96), (300, 576), (130, 4096)]
        };
        for &(m, k) in shapes {
            let w = random_blocks(dtype, m * k / dtype.block_len(), rng.random());
            check_mma_batches(&be, &old, dtype, (m, k), &w, &mut rng);
        }
        let (m1, m2, k) = (200, 72, if dtype.is_super_block() { 1024 } else { 576 });
        let w1 = random_blocks(dtype, m1 * k / dtype.block_len(), rng.random());
        let w2 = random_blocks(dtype, m2 * k / dtype.block_len(), rng.random());
        check_two_weights_and_add(&be, dtype, (m1, m2, k), (&w1, &w2), &mut rng);
    }
}
