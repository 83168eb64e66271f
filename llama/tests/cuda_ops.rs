//! Every CUDA op against the slow reference backend on random inputs and random quantized
//! blocks (max difference printed, tolerance stated), and whole synthetic models on CUDA against
//! the CPU backend. Opt-in: `GDSLLM_GPU_TESTS=1` (then a machine without a usable GPU FAILS
//! these tests instead of skipping them). Needs the `cuda` feature.
#![cfg(feature = "cuda")]

mod support;

use llama::backend::DeviceWeights;
use llama::backend::cuda::{CudaBuf, CudaKvBuf, CudaPaths};
use llama::backend::{
    Activation, AttentionParams, AttentionSeq, AttentionShape, GatedWeights, KvStoreSeq, NormInto,
    RowGroup,
};
use llama::load::open_uploaded;
use llama::{
    Backend, CpuBackend, CudaBackend, InMemoryWeights, Llama, ReferenceBackend, WeightView,
    rope_inv_freq,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use support::cuda::{
    MATMUL_TOL, alloc, check_matmul, check_mma_batches, check_two_weights_and_add, down, down_kv,
    gpu, gpu_new_and_old, on_device, up, via_f16, view,
};
use support::{ALL, attention, matmul, max_rel_diff, random, weights};
use weights_format::DType;

/// Elementwise ops and row reductions in f32.
const ELEMENT_TOL: f32 = 1e-5;

#[test]
fn matmul_matches_reference_for_every_dtype_and_row_count() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    for dtype in ALL {
        for (m, k) in [(77, 96), (256, 576), (33, 1536)] {
            let w = weights(&mut rng, dtype, m, k);
            for rows in [1, 3, 8, 9, 33, 70] {
                check_matmul(&be, dtype, m, k, &w, rows, &mut rng);
            }
        }
    }
}

/// `argmax_rows` (greedy sampling where the logits are) against the host's
/// `sampling::argmax` of each row, exactly: random rows of SmolLM2's and Gemma 3's vocabulary
/// sizes, ties far apart (the lowest id wins), ±0, ±inf, NaNs of both signs, rows of one value,
/// a ragged width, and no columns.
#[test]
fn argmax_rows_equals_the_host_argmax() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(19);
    for cols in [49_152usize, 262_144, 1000, 7, 1, 0] {
        let rows = 33;
        let mut x: Vec<f32> = random(&mut rng, rows * cols)
            .into_iter()
            .map(|v| 8.0 * v)
            .collect();
        for (r, row) in x.chunks_exact_mut(cols.max(1)).enumerate().take(rows) {
            if cols < 8 {
                continue;
            }
            let at = |k: usize| (r * 7919 + k * 104_729) % cols;
            match r % 6 {
                1 => {
                    for k in 0..4 {
                        row[at(k)] = 50.0; // ties: the lowest of four ids
                    }
                }
                2 => {
                    row.iter_mut().for_each(|v| *v = -v.abs() - 1.0);
                    row[at(0)] = -0.0;
                    row[at(1)] = 0.0; // +0 above -0 in `total_cmp`'s order
                }
                3 => {
                    row[at(0)] = f32::from_bits(0xffc0_0000); // a negative NaN: below every number
                    row[at(1)] = f32::INFINITY;
                    row[at(2)] = f32::NAN; // above +inf
                }
                4 => row.iter_mut().for_each(|v| *v = 1.25), // all equal: id 0
                5 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                _ => {}
            }
        }
        let buf = up(&be, if x.is_empty() { &[0.0] } else { &x }); // no empty allocation
        let mut got = vec![u32::MAX; rows];
        be.argmax_rows(&buf, cols, &mut got).unwrap();
        let want: Vec<u32> = (0..rows)
            .map(|r| llama::sampling::argmax(&x[r * cols..(r + 1) * cols]))
            .collect();
        println!("argmax_rows, {rows} rows of {cols}: ids {:?}…", &got[..6]);
        assert_eq!(
            got, want,
            "{cols} columns: the device's greedy ids differ from the host's"
        );
    }
}

#[test]
fn embed_rows_and_rmsnorm_match_reference() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(12);
    let (vocab, dim) = (300, 576);
    let ids = [0u32, 299, 17, 17, 150];
    for dtype in ALL {
        let table = weights(&mut rng, dtype, vocab, dim);
        let host = WeightView::host(dtype, vocab, dim, &table);
        let dev = on_device(&be, &table);
        let mut want = vec![0f32; ids.len() * dim];
        ReferenceBackend.embed_rows(host, &ids, &mut want).unwrap();
        let mut out = alloc(&be, ids.len() * dim);
        be.embed_rows(view(&dev, dtype, vocab, dim), &ids, &mut out)
            .unwrap();
        let d = max_rel_diff(&down(&be, &out, ids.len() * dim), &want);
        println!("embed_rows {dtype:?}: max rel diff {d:.2e} (tol 0: same dequantization)");
        assert!(d == 0.0, "embed_rows {dtype:?}: {d}");

        // The same rows read into host memory and copied up by `embed_host_rows`.
        let rb = host.row_bytes();
        let picked: Vec<u8> = ids
            .iter()
            .flat_map(|&id| table[id as usize * rb..(id as usize + 1) * rb].to_vec())
            .collect();
        let mut out = alloc(&be, ids.len() * dim);
        be.embed_host_rows(WeightView::host(dtype, ids.len(), dim, &picked), &mut out)
            .unwrap();
        let d = max_rel_diff(&down(&be, &out, ids.len() * dim), &want);
        println!("embed_host_rows {dtype:?}: max rel diff {d:.2e} (tol 0)");
        assert!(d == 0.0, "embed_host_rows {dtype:?}: {d}");

        let rows = 5;
        let x = random(&mut rng, rows * dim);
        let norm = weights(&mut rng, dtype, 1, dim);
        let nv = WeightView::host(dtype, 1, dim, &norm);
        let nd = on_device(&be, &norm);
        let mut want = vec![0f32; rows * dim];
        ReferenceBackend
            .rmsnorm(&x, rows, nv, 1e-5, &mut want, NormInto::Write)
            .unwrap();
        let xd = up(&be, &x);
        let mut out = alloc(&be, rows * dim);
        be.rmsnorm(
            &xd,
            rows,
            view(&nd, dtype, 1, dim),
            1e-5,
            &mut out,
            NormInto::Write,
        )
        .unwrap();
        let d = max_rel_diff(&down(&be, &out, rows * dim), &want);
        println!("rmsnorm weight {dtype:?}: max rel diff {d:.2e} (tol {ELEMENT_TOL:.0e})");
        assert!(d < ELEMENT_TOL, "rmsnorm {dtype:?}: {d}");
    }
}

#[test]
fn rope_swiglu_add_match_reference() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(13);
    let (rows, heads, hd) = (7, 9, 64);
    let shape = AttentionShape {
        n_heads: heads,
        n_kv_heads: 3,
        head_dim: hd,
    };
    let (q_w, kv_w, ctx, pos0) = (heads * hd, 3 * hd, 64, 37);
    let inv = rope_inv_freq(hd, 100000.0, None, 0);
    let (x, k, v) = (
        random(&mut rng, rows * q_w),
        random(&mut rng, rows * kv_w),
        random(&mut rng, rows * kv_w),
    );
    let (mut want, mut want_k) = (x.clone(), k.clone());
    let (mut rkc, mut rvc) = (vec![0f32; ctx * kv_w], vec![0f32; ctx * kv_w]);
    ReferenceBackend
        .rope_store_kv(
            &mut want,
            &mut want_k,
            &v,
            0,
            rows,
            pos0,
            shape,
            &inv,
            &mut rkc,
            &mut rvc,
        )
        .unwrap();
    let (mut xd, mut kd) = (up(&be, &x), up(&be, &k));
    let (mut kc, mut vc) = (
        be.alloc_kv(ctx * kv_w).unwrap(),
        be.alloc_kv(ctx * kv_w).unwrap(),
    );
    be.rope_store_kv(
        &mut xd,
        &mut kd,
        &up(&be, &v),
        0,
        rows,
        pos0,
        shape,
        &up(&be, &inv),
        &mut kc,
        &mut vc,
    )
    .unwrap();
    let d = max_rel_diff(&down(&be, &xd, x.len()), &want);
    // The angle is pos·inv_freq in f32 on the device, in f64 in the reference.
    println!("rope: max rel diff {d:.2e} (tol 1e-5)");
    assert!(d < 1e-5, "rope: {d}");

    // Four values per thread (3008 = 94 blocks: also written quantized), four per thread
    // without, and one per thread.
    for n in [3008, 3000, 3001] {
        let (g, u) = (random(&mut rng, n), random(&mut rng, n));
        let mut want = g.clone();
        ReferenceBackend.swiglu(&mut want, &u, n).unwrap();
        let mut gd = up(&be, &g);
        be.swiglu(&mut gd, &up(&be, &u), n).unwrap();
        let d = max_rel_diff(&down(&be, &gd, n), &want);
        println!("swiglu n={n}: max rel diff {d:.2e} (tol {ELEMENT_TOL:.0e})");
        assert!(d < ELEMENT_TOL, "swiglu n={n}: {d}");
    }

    // The residual add (`matmul_add_batch`): base + x·Wᵀ.
    let (m, k) = (3000, 32);
    let (base, x) = (random(&mut rng, m), random(&mut rng, k));
    let w = weights(&mut rng, DType::F32, m, k);
    let wd = on_device(&be, &w);
    let mut product = vec![0f32; m];
    matmul(
        &ReferenceBackend,
        &x,
        1,
        WeightView::host(DType::F32, m, k, &w),
        &mut product,
    );
    let want: Vec<f32> = base.iter().zip(&product).map(|(a, b)| a + b).collect();
    let mut acc = up(&be, &base);
    let mut scratch = alloc(&be, m);
    be.matmul_add_batch(
        &up(&be, &x),
        &[RowGroup::solo(1)],
        view(&wd, DType::F32, m, k),
        &mut scratch,
        &mut acc,
    )
    .unwrap();
    let d = max_rel_diff(&down(&be, &acc, m), &want);
    println!("add: max rel diff {d:.2e} (tol {ELEMENT_TOL:.0e})");
    assert!(d < ELEMENT_TOL, "add: {d}");
}

/// rmsnorm and the gated activations (swiglu, geglu) also write their output in the quantized matmuls' input format, and the
/// quantized matmul reading that output next uses it instead of converting x itself: it must
/// give the bits of a matmul over the same values uploaded afresh (converted by
/// `quantize_x16`), and any op in between must make it convert again.
#[test]
fn quantized_inputs_written_by_rmsnorm_and_gated_activations_are_exact() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(31);
    let (rows, dim, ffn, m) = (3, 576, 1536, 40);
    let norm = weights(&mut rng, DType::F32, 1, dim);
    let norm_dev = on_device(&be, &norm);
    let nv = view(&norm_dev, DType::F32, 1, dim);
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        let (w1, w2) = (
            weights(&mut rng, dtype, m, dim),
            weights(&mut rng, dtype, m, ffn),
        );
        let (d1, d2) = (on_device(&be, &w1), on_device(&be, &w2));
        let (v1, v2) = (view(&d1, dtype, m, dim), view(&d2, dtype, m, ffn));
        // The same values through quantize_x16.
        let fresh = |x: &[f32], k: usize, w: WeightView<'_>| {
            let before = be.x16_launches();
            let mut o = alloc(&be, rows * m);
            matmul(&be, &up(&be, x), rows, w, &mut o);
            let got = down(&be, &o, rows * m);
            assert_eq!(
                be.x16_launches(),
                before + 1,
                "{dtype:?} k={k}: quantize_x16 ran"
            );
            got
        };

        // The matmul right after a producer: no conversion of its own, and fresh's bits.
        let check_used =
            |label: &str, x: &CudaBuf, k: usize, w: WeightView<'_>, o: &mut CudaBuf| {
                let before = be.x16_launches();
                matmul(&be, x, rows, w, o);
                assert_eq!(
                    be.x16_launches(),
                    before,
                    "{dtype:?}: {label}'s quantized output used"
                );
                let values = down(&be, x, rows * k);
                assert_eq!(
                    down(&be, o, rows * m),
                    fresh(&values, k, w),
                    "{dtype:?} after {label}"
                );
            };
        // (An allocation between them would count as an op: `o` comes first.)
        let x = random(&mut rng, rows * dim);
        let (mut h, mut o) = (alloc(&be, rows * dim), alloc(&be, rows * m));
        be.rmsnorm(&up(&be, &x), rows, nv, 1e-5, &mut h, NormInto::Write)
            .unwrap();
        check_used("rmsnorm", &h, dim, v1, &mut o);

        let (g, u) = (random(&mut rng, rows * ffn), random(&mut rng, rows * ffn));
        let (mut gd, mut o) = (up(&be, &g), alloc(&be, rows * m));
        be.swiglu(&mut gd, &up(&be, &u), rows * ffn).unwrap();
        check_used("swiglu", &gd, ffn, v2, &mut o);
        let (mut gd, mut o) = (up(&be, &g), alloc(&be, rows * m));
        be.geglu(&mut gd, &up(&be, &u), rows * ffn).unwrap();
        check_used("geglu", &gd, ffn, v2, &mut o);

        // An op between the producer and the matmul (one that rewrites the producer's
        // output): the stale quantized copy is not used.
        let y = random(&mut rng, rows * dim);
        let (mut h, mut o, yd) = (alloc(&be, rows * dim), alloc(&be, rows * m), up(&be, &y));
        be.rmsnorm(&up(&be, &x), rows, nv, 1e-5, &mut h, NormInto::Write)
            .unwrap();
        be.copy_rows(&yd, 0, &mut h, 0, rows, dim).unwrap();
        let before = be.x16_launches();
        matmul(&be, &h, rows, v1, &mut o);
        assert_eq!(
            be.x16_launches(),
            before + 1,
            "{dtype:?}: converted again after copy_rows"
        );
        let h_values = down(&be, &h, rows * dim);
        let mut want = vec![0f32; rows * m];
        let host1 = WeightView::host(dtype, m, dim, &w1);
        matmul(&ReferenceBackend, &h_values, rows, host1, &mut want);
        let d = max_rel_diff(&down(&be, &o, rows * m), &want);
        assert!(d < MATMUL_TOL, "{dtype:?} after rmsnorm + copy_rows: {d}");
    }
    println!(
        "quantized matmul inputs written by rmsnorm, swiglu and geglu: the bits of quantize_x16's, and not reused after another op"
    );
}

/// The FFN's gate/up products and gated activation in one launch (`gated` path: a decoding
/// row of f16/bf16 weights) give the bits of the two matmuls and `gated_act` (the backend
/// without the path), and agree with the reference within 2·MATMUL_TOL (two products, each
/// within MATMUL_TOL, multiplied); ragged weight rows (not a multiple of the kernel's two rows
/// a block), a row length that is not whole 16-byte loads (the kernel's tail loop), both
/// activations. Several rows and other dtypes take the unfused path: the same bits too.
#[test]
fn gated_matmul_in_one_launch_equals_the_matmuls_and_the_activation() {
    let Some((be, old)) = gpu_new_and_old(CudaPaths {
        gated: true,
        ..CudaPaths::none()
    }) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(47);
    for dtype in [DType::F16, DType::Bf16, DType::Q4_1] {
        // (37, 100): rows of whole 16-byte loads no more (f16/bf16 only: the quantized dtypes
        // have whole 32-value blocks).
        for (m, k) in [(77, 96), (301, 576), (37, 100), (130, 4096)] {
            if dtype.is_quantized() && k % 32 != 0 {
                continue;
            }
            let (gate, up_w) = (
                weights(&mut rng, dtype, m, k),
                weights(&mut rng, dtype, m, k),
            );
            let (gd, ud) = (on_device(&be, &gate), on_device(&be, &up_w));
            let (gd_old, ud_old) = (on_device(&old, &gate), on_device(&old, &up_w));
            for act in [Activation::Silu, Activation::GeluTanh] {
                for rows in [1, 3] {
                    let x = random(&mut rng, rows * k);
                    let groups = vec![RowGroup::solo(1); rows];
                    let run = |be: &CudaBackend, g: &DeviceWeights, u: &DeviceWeights| {
                        let (mut out, mut up_out) = (alloc(be, rows * m), alloc(be, rows * m));
                        let ffn = GatedWeights {
                            gate: view(g, dtype, m, k),
                            up: view(u, dtype, m, k),
                            act,
                        };
                        be.matmul_gated_batch(&up(be, &x), &groups, ffn, &mut out, &mut up_out)
                            .unwrap();
                        down(be, &out, rows * m)
                    };
                    let got = run(&be, &gd, &ud);
                    let unfused = run(&old, &gd_old, &ud_old);
                    let (mut want, mut want_up) = (vec![0f32; rows * m], vec![0f32; rows * m]);
                    ReferenceBackend
                        .matmul_gated_batch(
                            &x,
                            &groups,
                            GatedWeights {
                                gate: WeightView::host(dtype, m, k, &gate),
                                up: WeightView::host(dtype, m, k, &up_w),
                                act,
                            },
                            &mut want,
                            &mut want_up,
                        )
                        .unwrap();
                    let d = max_rel_diff(&got, &want);
                    let label = format!("{} {m}x{k} {act:?} rows {rows}", dtype.name());
                    println!(
                        "gated {label}: max rel diff {d:.2e} (tol {:.0e})",
                        2.0 * MATMUL_TOL
                    );
                    assert!(d < 2.0 * MATMUL_TOL, "gated {label}: {d}");
                    let same = got
                        .iter()
                        .zip(&unfused)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "gated {label}: not the bits of the unfused launches");
                }
            }
        }
    }
    println!("gated: the same bits as the matmuls and gated_act");
}

/// Rounds through f16, as the device's KV cache stores values.
/// The fused launches against the separate reference ops: Q/K/V-style weights sharing one
/// matmul launch, the matmul that accumulates into the residual stream, and RoPE with the KV
/// cache stores in one kernel. Also: a row's matmul result does not depend on how many rows
/// share the launch (batched decoding relies on it), bit for bit.
#[test]
fn fused_launches_match_reference() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(21);
    for dtype in ALL {
        let (m1, m2, k) = (40, 72, 576);
        let (w1, w2) = (
            weights(&mut rng, dtype, m1, k),
            weights(&mut rng, dtype, m2, k),
        );
        let (h1, h2) = (
            WeightView::host(dtype, m1, k, &w1),
            WeightView::host(dtype, m2, k, &w2),
        );
        let (d1, d2) = (on_device(&be, &w1), on_device(&be, &w2));
        let (v1, v2) = (view(&d1, dtype, m1, k), view(&d2, dtype, m2, k));
        for rows in [1, 5, 9] {
            let x = random(&mut rng, rows * k);
            let base = random(&mut rng, rows * m1);
            let (mut want1, mut want2) = (vec![0f32; rows * m1], vec![0f32; rows * m2]);
            matmul(&ReferenceBackend, &x, rows, h1, &mut want1);
            matmul(&ReferenceBackend, &x, rows, h2, &mut want2);
            let xd = up(&be, &x);
            let (mut o1, mut o2) = (alloc(&be, rows * m1), alloc(&be, rows * m2));
            be.matmul_batch(
                &xd,
                &[RowGroup::solo(rows)],
                &[v1, v2],
                &mut [&mut o1, &mut o2],
            )
            .unwrap();
            let d = max_rel_diff(&down(&be, &o1, rows * m1), &want1)
                .max(max_rel_diff(&down(&be, &o2, rows * m2), &want2));
            println!(
                "matmul_many {dtype:?} 2 weights rows={rows}: max rel diff {d:.2e} (tol {MATMUL_TOL:.0e})"
            );
            assert!(d < MATMUL_TOL, "matmul_many {dtype:?} rows={rows}: {d}");

            let groups = [RowGroup {
                rows,
                solo_rows: rows,
            }];
            let mut acc = up(&be, &base);
            let mut scratch = alloc(&be, rows * m1);
            be.matmul_add_batch(&xd, &groups, v1, &mut scratch, &mut acc)
                .unwrap();
            let want: Vec<f32> = base.iter().zip(&want1).map(|(a, b)| a + b).collect();
            let d = max_rel_diff(&down(&be, &acc, rows * m1), &want);
            println!(
                "matmul_add_batch {dtype:?} rows={rows}: max rel diff {d:.2e} (tol {MATMUL_TOL:.0e})"
            );
            assert!(
                d < MATMUL_TOL,
                "matmul_add_batch {dtype:?} rows={rows}: {d}"
            );

            // Row by row alone: the same bits through the eight-row kernel; within f32
            // summation order through the tensor-core kernels (`mma` path, issue 23).
            let all = down(&be, &o1, rows * m1);
            for r in 0..rows {
                let xr = up(&be, &x[r * k..(r + 1) * k]);
                let mut o = alloc(&be, m1);
                matmul(&be, &xr, 1, v1, &mut o);
                let alone = down(&be, &o, m1);
                if be.paths().mma && rows > 1 {
                    let d = max_rel_diff(&all[r * m1..(r + 1) * m1], &alone);
                    assert!(d < 1e-5, "{dtype:?}: row {r} of {rows}: {d} from alone");
                } else {
                    assert_eq!(
                        alone,
                        all[r * m1..(r + 1) * m1],
                        "{dtype:?}: row {r} of {rows} differs from the row alone"
                    );
                }
            }
        }
    }
    println!(
        "matmul (paths {}): every row of 5- and 9-row launches equals the row alone{}",
        be.paths(),
        if be.paths().mma {
            " within 1e-5"
        } else {
            ", bit for bit"
        }
    );

    let shape = AttentionShape {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 32,
    };
    let (total_rows, row0, rows, pos0, capacity) = (5, 1, 3, 40, 64);
    let (q_dim, kv_dim) = (8 * 32, 2 * 32);
    let inv = rope_inv_freq(32, 10000.0, None, 0);
    let (q, k, v) = (
        random(&mut rng, total_rows * q_dim),
        random(&mut rng, total_rows * kv_dim),
        random(&mut rng, total_rows * kv_dim),
    );
    let (mut rq, mut rk) = (q.clone(), k.clone());
    let (mut rkc, mut rvc) = (vec![0f32; capacity * kv_dim], vec![0f32; capacity * kv_dim]);
    ReferenceBackend
        .rope_store_kv(
            &mut rq, &mut rk, &v, row0, rows, pos0, shape, &inv, &mut rkc, &mut rvc,
        )
        .unwrap();
    let (mut dq, mut dk, dv) = (up(&be, &q), up(&be, &k), up(&be, &v));
    let (mut kc, mut vc) = (
        be.alloc_kv(capacity * kv_dim).unwrap(),
        be.alloc_kv(capacity * kv_dim).unwrap(),
    );
    be.rope_store_kv(
        &mut dq,
        &mut dk,
        &dv,
        row0,
        rows,
        pos0,
        shape,
        &up(&be, &inv),
        &mut kc,
        &mut vc,
    )
    .unwrap();
    let d = max_rel_diff(&down(&be, &dq, q.len()), &rq)
        .max(max_rel_diff(&down(&be, &dk, k.len()), &rk));
    println!("rope_store_kv q and k: max rel diff {d:.2e} (tol {ELEMENT_TOL:.0e})");
    assert!(d < ELEMENT_TOL, "rope_store_kv q/k: {d}");
    // The caches are f16: compare with the reference's rounded to f16 (the same rounding).
    let d = max_rel_diff(&down_kv(&be, &kc, capacity * kv_dim), &via_f16(&rkc)).max(max_rel_diff(
        &down_kv(&be, &vc, capacity * kv_dim),
        &via_f16(&rvc),
    ));
    println!("rope_store_kv f16 caches: max rel diff {d:.2e} (tol 1e-3: one f16 rounding)");
    assert!(d < 1e-3, "rope_store_kv caches: {d}");
}

#[test]
fn attention_over_f16_cache_matches_reference_for_decode_and_prefill() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(14);
    let shape = AttentionShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let kv_width = shape.n_kv_heads * shape.head_dim;
    let q_width = shape.n_heads * shape.head_dim;
    // decode; prefill from 0; prefill after a cached prefix; a context longer than one tile.
    // One row goes through the chunked decode kernel (1 and 12 chunks of 128 positions).
    for (rows, pos0) in [
        (1, 0),
        (1, 100),
        (1, 1500),
        (1, 255),
        (40, 0),
        (13, 50),
        (3, 1500),
    ] {
        let ctx = pos0 + rows;
        let k = random(&mut rng, ctx * kv_width);
        let v = random(&mut rng, ctx * kv_width);
        let q: Vec<f32> = random(&mut rng, rows * q_width)
            .iter()
            .map(|x| x * 4.0)
            .collect();
        let mut want = vec![0f32; rows * q_width];
        let (k16, v16) = (via_f16(&k), via_f16(&v));
        attention(
            &ReferenceBackend,
            &q,
            rows,
            &k16,
            &v16,
            pos0,
            shape,
            &mut want,
        );

        let kc = be.upload_kv(&k).unwrap();
        let vc = be.upload_kv(&v).unwrap();
        let mut out = alloc(&be, rows * q_width);
        attention(&be, &up(&be, &q), rows, &kc, &vc, pos0, shape, &mut out);
        let d = max_rel_diff(&down(&be, &out, rows * q_width), &want);
        println!(
            "attention rows={rows} pos0={pos0}: max rel diff {d:.2e} (tol {MATMUL_TOL:.0e}, cache rounded to f16 on both sides)"
        );
        assert!(d < MATMUL_TOL, "attention rows={rows} pos0={pos0}: {d}");
    }
}

/// The tensor-core matmuls (`mma` path) of a decode batch against the reference, against each
/// row alone through the one-row kernel (within f32 summation order: the quantized products are
/// the same integers), and a row's bits the same whatever the batch size; with the column
/// slices summed by the last block of each tile and by their own kernel (`slicesum`).
#[test]
fn mma_matmul_matches_reference_and_the_row_alone() {
    for slicesum in [false, true] {
        let Some((be, old)) = gpu_new_and_old(CudaPaths {
            mma: true,
            slicesum,
            ..CudaPaths::none()
        }) else {
            return;
        };
        println!("paths {}", be.paths());
        let mut rng = StdRng::seed_from_u64(41);
        for dtype in ALL {
            // Ragged weight rows (blocks of 128), several column splits, rows across blocks of 64.
            for (m, k) in [(77, 96), (300, 576), (1000, 1536), (130, 4096)] {
                let w = weights(&mut rng, dtype, m, k);
                check_mma_batches(&be, &old, dtype, (m, k), &w, &mut rng);
            }
        }
        println!("mma matmul: rows 0-1 the same bits in batches of 2 to 70 rows");

        // Q/K/V-style weights in one launch, and the residual add, on the mma path.
        for dtype in [DType::F16, DType::Q4_1, DType::Q8_0] {
            let (m1, m2, k) = (200, 72, 576);
            let (w1, w2) = (
                weights(&mut rng, dtype, m1, k),
                weights(&mut rng, dtype, m2, k),
            );
            check_two_weights_and_add(&be, dtype, (m1, m2, k), (&w1, &w2), &mut rng);
        }
    }
}

/// A batch's RoPE/KV stores and decode attention in one launch each (`seqs` path) against the
/// launches per sequence: the same bits. More sequences than one launch takes (64), ragged
/// rows and positions, prompts among them.
#[test]
fn batch_attention_steps_in_one_launch_equal_per_sequence_launches() {
    let Some((new, old)) = gpu_new_and_old(CudaPaths {
        seqs: true,
        ..CudaPaths::none()
    }) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(42);
    let shape = AttentionShape {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let (q_w, kv_w) = (8 * 64, 2 * 64);
    // (rows, pos0, capacity): a few prompts, then one-row sequences at many positions.
    let mut specs = vec![
        (1, 0, 8),
        (3, 5, 16),
        (1, 200, 260),
        (1, 129, 140),
        (5, 0, 8),
    ];
    for i in 0..70 {
        let pos = (i * 37) % 300;
        specs.push((1, pos, pos + 1 + i % 3));
    }
    let total: usize = specs.iter().map(|s| s.0).sum();
    let inv = rope_inv_freq(64, 10000.0, None, 0);
    let (q, k, v) = (
        random(&mut rng, total * q_w),
        random(&mut rng, total * kv_w),
        random(&mut rng, total * kv_w),
    );
    let caches: Vec<(Vec<f32>, Vec<f32>)> = specs
        .iter()
        .map(|s| (random(&mut rng, s.2 * kv_w), random(&mut rng, s.2 * kv_w)))
        .collect();
    let run = |be: &CudaBackend| {
        let (mut qd, mut kd, vd) = (up(be, &q), up(be, &k), up(be, &v));
        let mut kv: Vec<(CudaKvBuf, CudaKvBuf)> = caches
            .iter()
            .map(|(kc, vc)| (be.upload_kv(kc).unwrap(), be.upload_kv(vc).unwrap()))
            .collect();
        let mut row0 = 0;
        let mut stores: Vec<KvStoreSeq<'_, CudaKvBuf>> = Vec::new();
        for (s, (kc, vc)) in specs.iter().zip(kv.iter_mut()) {
            stores.push(KvStoreSeq {
                row0,
                rows: s.0,
                pos0: s.1,
                k_cache: kc,
                v_cache: vc,
            });
            row0 += s.0;
        }
        be.rope_store_kv_batch(&mut qd, &mut kd, &vd, &mut stores, shape, &up(be, &inv))
            .unwrap();
        let seqs: Vec<AttentionSeq<'_, CudaKvBuf>> =
            stores.iter().map(KvStoreSeq::attention).collect();
        let mut out = alloc(be, total * q_w);
        be.attention_batch(&qd, &seqs, shape, AttentionParams::causal(shape), &mut out)
            .unwrap();
        // The caches are read back below.
        drop(seqs);
        drop(stores);
        let cache_values: Vec<Vec<f32>> = kv
            .iter()
            .zip(&specs)
            .flat_map(|((kc, vc), s)| [down_kv(be, kc, s.2 * kv_w), down_kv(be, vc, s.2 * kv_w)])
            .collect();
        (
            down(be, &qd, total * q_w),
            down(be, &kd, total * kv_w),
            cache_values,
            down(be, &out, total * q_w),
        )
    };
    let (a, b) = (run(&new), run(&old));
    assert_eq!(a.0, b.0, "roped q");
    assert_eq!(a.1, b.1, "roped k");
    assert_eq!(a.2, b.2, "KV caches");
    assert_eq!(a.3, b.3, "attention outputs");
    println!(
        "{} sequences ({total} rows): RoPE, KV stores and attention in one launch each equal the per-sequence launches bit for bit",
        specs.len()
    );
}

/// Prompt attention on tensor cores (`flash` path) against the reference and the f32 kernel:
/// GQA and not, head_dim 64 and 128, prompts across blocks of 64 rows, after a cached prefix.
#[test]
fn flash_attention_matches_reference() {
    let Some((be, old)) = gpu_new_and_old(CudaPaths {
        flash: true,
        ..CudaPaths::none()
    }) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(43);
    for (n_heads, n_kv_heads, head_dim, rows, pos0) in [
        (8, 2, 64, 2, 0),
        (9, 3, 64, 40, 50),
        (4, 4, 128, 70, 0),
        (32, 8, 128, 200, 13),
        (4, 1, 128, 3, 1500),
    ] {
        let shape = AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        let (q_w, kv_w) = (n_heads * head_dim, n_kv_heads * head_dim);
        let ctx = pos0 + rows;
        let (k, v) = (random(&mut rng, ctx * kv_w), random(&mut rng, ctx * kv_w));
        let q: Vec<f32> = random(&mut rng, rows * q_w)
            .iter()
            .map(|x| x * 4.0)
            .collect();
        let mut want = vec![0f32; rows * q_w];
        attention(
            &ReferenceBackend,
            &q,
            rows,
            &via_f16(&k),
            &via_f16(&v),
            pos0,
            shape,
            &mut want,
        );
        let mut results = Vec::new();
        for b in [&be, &old] {
            let (kc, vc) = (b.upload_kv(&k).unwrap(), b.upload_kv(&v).unwrap());
            let mut out = alloc(b, rows * q_w);
            attention(b, &up(b, &q), rows, &kc, &vc, pos0, shape, &mut out);
            results.push(down(b, &out, rows * q_w));
        }
        let d = max_rel_diff(&results[0], &want);
        let d_old = max_rel_diff(&results[0], &results[1]);
        println!(
            "flash attention {n_heads}/{n_kv_heads} heads hd={head_dim} rows={rows} pos0={pos0}: max rel diff {d:.2e} vs reference (tol {MATMUL_TOL:.0e}), {d_old:.2e} vs the f32 kernel"
        );
        assert!(
            d < MATMUL_TOL,
            "flash attention rows={rows} pos0={pos0}: {d}"
        );
    }
}

/// A synthetic model of `shape` in `dtype` in a temporary directory (kept alive by the returned
/// guard), or None when the GPU tests are not enabled.
fn gpu_test_model(
    shape: gdsllm_convert::synth::SynthShape,
    dtype: DType,
    shape_name: &str,
) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    gpu()?;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let opts = gdsllm_convert::synth::SynthOptions {
        shape,
        dtype,
        seed: 7,
        threads: 0,
        shape_name: shape_name.to_string(),
    };
    gdsllm_convert::synth::synth(&dir, &opts, &mut |_| {}).expect("synth");
    Some((tmp, dir))
}

fn smollm2_shape() -> gdsllm_convert::synth::SynthShape {
    gdsllm_convert::synth::SynthShape::preset("smollm2-135m").unwrap()
}

/// A small GQA model (8 query heads over 2 KV heads) with an untied LM head: the paths the
/// SmolLM2 shape does not exercise.
fn small_untied_shape(n_layers: usize) -> gdsllm_convert::synth::SynthShape {
    gdsllm_convert::synth::SynthShape::new(n_layers as _, 256, 704, 8, 2, 2048, 512)
}

fn argmax_and_margin(logits: &[f32]) -> (u32, f32) {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    (idx[0] as u32, logits[idx[0]] - logits[idx[1]])
}

/// Prefill logits within 1e-2 relative error of the CPU backend on `cpu_dir` (the same model, or
/// its f32 twin), then 16 greedy steps fed the CPU's token: the device's argmax must agree
/// wherever the CPU's top-2 margin exceeds twice the logit difference seen at that step (below
/// that, either token is numerically right).
fn compare_model(dir: &std::path::Path, cpu_dir: &std::path::Path, label: &str) {
    let Some(be_check) = gpu() else { return };
    drop(be_check);
    let meta = weights_format::Model::open(cpu_dir)
        .unwrap()
        .metadata()
        .clone();
    let context = 128;
    let cpu_weights = InMemoryWeights::read_dir(cpu_dir, &meta).unwrap();
    // The CPU's exact mode (f32 activations) is the reference: its default 8-bit activations
    // round differently from the CUDA kernels' 16-bit ones, by more than this tolerance.
    let mut cpu = Llama::new(
        CpuBackend::exact(),
        cpu_weights,
        meta.clone(),
        context,
        context,
    )
    .unwrap();
    let mut cuda = open_uploaded(dir, 0, context).unwrap();
    let vocab = meta.config.vocab_size;
    let mut rng = StdRng::seed_from_u64(15);
    let prompt: Vec<u32> = (0..20).map(|_| rng.random_range(0..vocab)).collect();
    let want = cpu.forward(&prompt).unwrap().to_vec();
    let got = cuda.forward(&prompt).unwrap().to_vec();
    let d = max_rel_diff(&got, &want);
    println!(
        "{label}: prefill of {} tokens, last-position logits max rel diff {d:.2e} (tol 1e-2)",
        prompt.len()
    );
    assert!(d < 1e-2, "{label} prefill logits: {d}");
    let (mut token, _) = argmax_and_margin(&want);
    let mut agreed = 0;
    for step in 0..16 {
        let want = cpu.forward(&[token]).unwrap().to_vec();
        let got = cuda.forward(&[token]).unwrap().to_vec();
        let d = max_rel_diff(&got, &want);
        let abs = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let (cpu_tok, margin) = argmax_and_margin(&want);
        let (gpu_tok, _) = argmax_and_margin(&got);
        println!(
            "{label}: step {step}: cpu {cpu_tok} gpu {gpu_tok} margin {margin:.3e} max abs diff {abs:.3e} rel {d:.2e}"
        );
        assert!(d < 1e-2, "{label} step {step} logits: {d}");
        if margin > 2.0 * abs {
            assert_eq!(
                gpu_tok, cpu_tok,
                "{label} step {step}: greedy token differs"
            );
        }
        agreed += (gpu_tok == cpu_tok) as usize;
        token = cpu_tok;
    }
    println!("{label}: greedy tokens agreed at {agreed}/16 steps");
}

#[test]
fn smollm2_shaped_q4_1_model_matches_cpu() {
    let Some((_tmp, dir)) = gpu_test_model(smollm2_shape(), DType::Q4_1, "smollm2-135m") else {
        return;
    };
    compare_model(&dir, &dir, "smollm2-135m q4_1");
}

#[test]
fn small_untied_f16_model_matches_cpu() {
    let Some((_tmp, dir)) = gpu_test_model(small_untied_shape(4), DType::F16, "small-f16") else {
        return;
    };
    compare_model(&dir, &dir, "small f16 untied");
}

/// Without a GPU the backend is an error value, never a panic.
#[test]
fn new_without_cuda_is_an_error_not_a_panic() {
    if std::env::var("GDSLLM_GPU_TESTS").as_deref() == Ok("1") {
        return;
    }
    match CudaBackend::new(0) {
        Ok(be) => println!("CUDA is usable here ({})", be.device_name()),
        Err(e) => println!("CudaBackend::new(0) without CUDA: {e}"),
    }
}

/// Greedy tokens and every step's logits of `steps` decode steps after a 12-token prompt.
fn greedy_run<W: llama::WeightSource>(
    model: &mut Llama<CudaBackend, W>,
    steps: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..12).map(|i| (i * 7919 + 11) % vocab).collect();
    let mut logits = model.forward(&prompt).unwrap().to_vec();
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let (t, _) = argmax_and_margin(&logits);
        tokens.push(t);
        all.push(logits.clone());
        logits = model.forward(&[t]).unwrap().to_vec();
    }
    (tokens, all)
}

/// The tokens of [`greedy_run`] from the start of the sequence through `Llama::forward_greedy`
/// (the backend's argmax of each step's logits: only the id comes back).
fn greedy_ids_run<W: llama::WeightSource>(
    model: &mut Llama<CudaBackend, W>,
    steps: usize,
) -> Vec<u32> {
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..12).map(|i| (i * 7919 + 11) % vocab).collect();
    model.truncate(0);
    let mut token = model.forward_greedy(&prompt).unwrap();
    let mut tokens = Vec::new();
    for _ in 0..steps {
        tokens.push(token);
        token = model.forward_greedy(&[token]).unwrap();
    }
    assert!(
        model.last_logits().is_empty(),
        "stale logits after greedy steps"
    );
    tokens
}

/// `dir` on device 0 through the production path (`llama::open`: weights in device memory
/// through residency, read by gds-io).
fn open_cuda(
    dir: &std::path::Path,
    residency: residency::ResidencyOptions,
    context: usize,
) -> llama::CudaModel {
    let options = llama::OpenOptions {
        residency,
        context,
        ..llama::OpenOptions::default()
    };
    llama::open(dir, llama::Device::Cuda { ordinal: 0 }, &options)
        .unwrap()
        .into_cuda()
        .unwrap()
}

/// The production path (`llama::open`: weights in device memory through residency, read by
/// gds-io) with everything resident, with every layer streamed through the staging ring, and
/// with streamed layers coming back from the pinned host tier gives exactly the tokens and
/// logits of the upload-once path: the kernels are the same, so the bytes must be too.
fn streamed_matches_resident(dir: &std::path::Path, label: &str) {
    use residency::{Budget, HostCache, ResidencyOptions};
    let context = 64;
    let steps = 24;
    let mut uploaded = open_uploaded(dir, 0, context).unwrap();
    let (want_tokens, want_logits) = greedy_run(&mut uploaded, steps);
    drop(uploaded);
    // (name, options, streams, uses the host tier)
    let variants = [
        ("resident", ResidencyOptions::default(), false, false),
        (
            "streamed (0 resident layers, no host tier)",
            ResidencyOptions {
                resident_layers: Some(0),
                host_cache: HostCache::Off,
                ..ResidencyOptions::default()
            },
            true,
            false,
        ),
        (
            "streamed through the pinned host tier",
            ResidencyOptions {
                resident_layers: Some(0),
                host_cache: HostCache::Bytes(1 << 30),
                device_budget: Budget::Bytes(2 << 30),
                ..ResidencyOptions::default()
            },
            true,
            true,
        ),
    ];
    for (name, options, streams, host_tier) in variants {
        let loaded = open_cuda(dir, options, context);
        let (mut llama, _) = loaded.session.into_parts();
        let (tokens, logits) = greedy_run(&mut llama, steps);
        let max_diff = logits
            .iter()
            .zip(&want_logits)
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
            .fold(0f32, f32::max);
        let stats = llama.weights().residency().stats();
        let replays = llama.backend().step_replays();
        println!(
            "{label} {name}: {steps} greedy tokens equal: {}; max logit diff vs upload-once {max_diff:.1e} (tol 0); \
             disk {} B, host tier {} B, io {}, {replays} decode steps replayed from a CUDA graph",
            tokens == want_tokens,
            stats.total.disk_bytes,
            stats.total.host_copy_bytes,
            llama.weights().memory().io_path()
        );
        if !streams {
            // Everything resident: every decode step after the first (op by op) is a replay,
            // the recording step included (a recording runs only when replayed).
            assert_eq!(
                replays,
                steps as u64 - 1,
                "{label} {name}: decode steps replayed from the CUDA graph"
            );
        }
        assert_eq!(tokens, want_tokens, "{label} {name}: tokens differ");
        assert_eq!(max_diff, 0.0, "{label} {name}: logits differ");
        if streams {
            // Every layer blob crosses into device memory once per pass.
            let layer_bytes: u64 = llama
                .metadata()
                .blobs
                .iter()
                .filter(|b| b.file.starts_with("layer_"))
                .map(|b| b.length)
                .sum();
            let streamed = stats.total.disk_bytes + stats.total.host_copy_bytes;
            assert!(
                streamed >= stats.passes_completed * layer_bytes,
                "{label} {name}: {streamed} bytes streamed in {} passes of {layer_bytes} layer bytes",
                stats.passes_completed
            );
        }
        if host_tier {
            assert!(
                stats.total.host_copy_bytes > 0,
                "{label} {name}: no host-tier copies"
            );
        }
        // The same steps with the backend taking each argmax (recorded and replayed as well).
        let ids = greedy_ids_run(&mut llama, steps);
        println!(
            "{label} {name}: the backend's greedy ids equal the argmax of the logits: {}",
            ids == want_tokens
        );
        assert_eq!(ids, want_tokens, "{label} {name}: greedy ids differ");
    }
}

#[test]
fn streamed_smollm2_shaped_q4_1_gives_the_resident_tokens() {
    let Some((_tmp, dir)) = gpu_test_model(smollm2_shape(), DType::Q4_1, "smollm2-135m") else {
        return;
    };
    streamed_matches_resident(&dir, "smollm2-135m q4_1");
}

#[test]
fn streamed_small_untied_f16_gives_the_resident_tokens() {
    let Some((_tmp, dir)) = gpu_test_model(small_untied_shape(6), DType::F16, "small-f16") else {
        return;
    };
    streamed_matches_resident(&dir, "small f16 untied");
}

/// The launch counts (`CudaBackend::launch_counts`) of decode steps: a step replayed from the
/// CUDA graph runs as many kernels as the same step op by op (the graph holds the whole pass),
/// with far fewer calls on the stream (the position write, the replay, the logits read).
#[test]
fn replayed_decode_steps_run_every_kernel_with_few_stream_calls() {
    let Some((_tmp, dir)) = gpu_test_model(smollm2_shape(), DType::Q4_1, "smollm2-135m") else {
        return;
    };
    // The production path with every weight resident: only then do a pass's weight addresses
    // stay put, which recording needs (the upload-once test path does not promise it).
    let (mut llama, _) = open_cuda(&dir, residency::ResidencyOptions::default(), 64)
        .session
        .into_parts();
    llama.forward(&[1, 2, 3, 4]).unwrap();
    // Step 1 runs op by op, step 2 is recorded and launched, the rest are replays.
    let mut per_step = Vec::new();
    for step in 0..6u32 {
        let before = llama.backend().launch_counts();
        llama.forward(&[10 + step]).unwrap();
        let after = llama.backend().launch_counts();
        per_step.push((
            after.kernels - before.kernels,
            after.stream_calls - before.stream_calls,
        ));
    }
    println!(
        "(kernels, stream calls) per decode step: {per_step:?}; {} steps replayed",
        llama.backend().step_replays()
    );
    assert!(
        llama.backend().step_replays() >= 4,
        "steps 2..6 were recorded or replayed"
    );
    let (eager_kernels, eager_calls) = per_step[0];
    assert!(eager_kernels > 0, "the op-by-op step ran kernels");
    for &(kernels, calls) in &per_step[2..] {
        assert_eq!(kernels, eager_kernels, "a replay runs the pass's kernels");
        assert!(
            calls < eager_calls / 4,
            "a replay makes {calls} stream calls, the op-by-op step {eager_calls}"
        );
    }
}

/// The ops of the families beyond llama (biases, per-head norms, post-norms, the tanh-GeLU gate,
/// the embedding scale, the logit soft-cap) on CUDA against the reference backend.
#[test]
fn family_ops_match_reference() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(41);
    // Gemma 3 270M's per-head norm width (256) and Qwen3's (128); 5 rows of 8 heads.
    let (rows, heads) = (5, 8);
    let check = |name: &str, got: &[f32], want: &[f32], tol: f32| {
        let d = max_rel_diff(got, want);
        println!("{name}: max rel diff {d:.2e} (tol {tol:.0e})");
        assert!(d <= tol, "{name}: {d}");
    };
    for hd in [256, 128] {
        let width = heads * hd;
        let x = random(&mut rng, rows * width);
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let b = weights(&mut rng, dtype, 1, width);
            let bd = on_device(&be, &b);
            let mut want = x.clone();
            ReferenceBackend
                .add_bias(&mut want, rows, WeightView::host(dtype, 1, width, &b))
                .unwrap();
            let mut xd = up(&be, &x);
            be.add_bias(&mut xd, rows, view(&bd, dtype, 1, width))
                .unwrap();
            check(
                &format!("add_bias {dtype} width {width}"),
                &down(&be, &xd, x.len()),
                &want,
                ELEMENT_TOL,
            );

            let nw = weights(&mut rng, dtype, 1, hd);
            let nd = on_device(&be, &nw);
            let mut want = x.clone();
            ReferenceBackend
                .rmsnorm_pieces(
                    &mut want,
                    rows * heads,
                    WeightView::host(dtype, 1, hd, &nw),
                    1e-6,
                )
                .unwrap();
            let mut xd = up(&be, &x);
            be.rmsnorm_pieces(&mut xd, rows * heads, view(&nd, dtype, 1, hd), 1e-6)
                .unwrap();
            check(
                &format!("rmsnorm_pieces {dtype} head_dim {hd}"),
                &down(&be, &xd, x.len()),
                &want,
                ELEMENT_TOL,
            );

            let pw = weights(&mut rng, dtype, 1, width);
            let pd = on_device(&be, &pw);
            let base = random(&mut rng, rows * width);
            let mut want = base.clone();
            ReferenceBackend
                .rmsnorm(
                    &x,
                    rows,
                    WeightView::host(dtype, 1, width, &pw),
                    1e-6,
                    &mut want,
                    NormInto::Add,
                )
                .unwrap();
            let mut acc = up(&be, &base);
            be.rmsnorm(
                &up(&be, &x),
                rows,
                view(&pd, dtype, 1, width),
                1e-6,
                &mut acc,
                NormInto::Add,
            )
            .unwrap();
            check(
                &format!("add_rmsnorm {dtype} width {width}"),
                &down(&be, &acc, x.len()),
                &want,
                ELEMENT_TOL,
            );
        }
    }
    // Four values per thread (also written quantized), four without, one per thread.
    for n in [3008, 3000, 3001] {
        let g: Vec<f32> = random(&mut rng, n).iter().map(|v| 8.0 * v).collect();
        let u = random(&mut rng, n);
        let mut want = g.clone();
        ReferenceBackend.geglu(&mut want, &u, n).unwrap();
        let mut gd = up(&be, &g);
        be.geglu(&mut gd, &up(&be, &u), n).unwrap();
        check(
            &format!("geglu n={n}"),
            &down(&be, &gd, n),
            &want,
            ELEMENT_TOL,
        );
    }
    let n = 5000;
    let x: Vec<f32> = random(&mut rng, n).iter().map(|v| 100.0 * v).collect();
    let mut want = x.clone();
    ReferenceBackend.scale(&mut want, n, 25.3).unwrap();
    let mut xd = up(&be, &x);
    be.scale(&mut xd, n, 25.3).unwrap();
    check("scale", &down(&be, &xd, n), &want, 0.0);
    let mut want = x.clone();
    ReferenceBackend.softcap(&mut want, n, 30.0).unwrap();
    let mut xd = up(&be, &x);
    be.softcap(&mut xd, n, 30.0).unwrap();
    let got = down(&be, &xd, n);
    check("softcap", &got, &want, ELEMENT_TOL);
    assert!(got.iter().all(|v| v.abs() <= 30.0));
}

/// A sliding-window layer on CUDA: RoPE and the cache stores into a ring of twice the window
/// (position `p` in slot `p % slots`), then windowed attention with Gemma's head_dim of 256,
/// against the reference backend over a cache holding every position (f32): prompts of up to
/// a window of rows, and decode rows whose window spans several chunks of the split decode
/// kernel, over 700 positions (the ring wraps three times).
#[test]
fn family_windowed_attention_over_a_ring_matches_reference() {
    let Some(be) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(42);
    let shape = AttentionShape {
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 256,
    };
    let (width, kv_width, window) = (1024, 256, 200);
    let params = AttentionParams {
        scale: 0.0625,
        window: Some(window),
    };
    let inv = rope_inv_freq(256, 10000.0, None, 0);
    let chunks = [200, 150, 1, 1, 120, 1, 37, 1, 200, 1, 1, 1, 3];
    let total: usize = chunks.iter().sum();
    let (q, k, v) = (
        random(&mut rng, total * width)
            .iter()
            .map(|x| 4.0 * x)
            .collect::<Vec<f32>>(),
        random(&mut rng, total * kv_width),
        random(&mut rng, total * kv_width),
    );
    let slots = 2 * window;
    let (mut kc, mut vc) = (
        be.alloc_kv(slots * kv_width).unwrap(),
        be.alloc_kv(slots * kv_width).unwrap(),
    );
    let (mut rkc, mut rvc) = (vec![0f32; total * kv_width], vec![0f32; total * kv_width]);
    let invd = up(&be, &inv);
    let mut pos = 0;
    let mut worst = 0f32;
    for &n in &chunks {
        let (mut qr, mut kr, vr) = (
            q[pos * width..(pos + n) * width].to_vec(),
            k[pos * kv_width..(pos + n) * kv_width].to_vec(),
            v[pos * kv_width..(pos + n) * kv_width].to_vec(),
        );
        let (mut qd, mut kd) = (up(&be, &qr), up(&be, &kr));
        be.rope_store_kv(
            &mut qd,
            &mut kd,
            &up(&be, &vr),
            0,
            n,
            pos,
            shape,
            &invd,
            &mut kc,
            &mut vc,
        )
        .unwrap();
        let mut out = alloc(&be, n * width);
        support::attention_with(&be, &qd, n, (&kc, &vc), pos, shape, params, &mut out);
        ReferenceBackend
            .rope_store_kv(
                &mut qr, &mut kr, &vr, 0, n, pos, shape, &inv, &mut rkc, &mut rvc,
            )
            .unwrap();
        let mut want = vec![0f32; n * width];
        support::attention_with(
            &ReferenceBackend,
            &qr,
            n,
            (&rkc, &rvc),
            pos,
            shape,
            params,
            &mut want,
        );
        let d = max_rel_diff(&down(&be, &out, n * width), &want);
        worst = worst.max(d);
        assert!(d < 2e-3, "rows {pos}..{}: {d}", pos + n);
        pos += n;
    }
    println!(
        "windowed attention (window {window}, ring of {slots} slots, {total} positions): max rel diff {worst:.2e} (tol 2e-3: the cache is f16 on the device, f32 in the reference)"
    );
}

/// One small model of every family (`support::families`: biases, Q/K head norms, post-norms,
/// the GeLU gate, the embedding scale, sliding-window layers with their own RoPE base, a
/// soft-cap, freq_factors and longrope RoPE) on CUDA against the CPU backend: the prompt and
/// the decode steps run past gemma3's window of 8, so its rings wrap.
#[test]
fn family_models_match_cpu() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (name, config) in support::families::configs() {
        for dtype in [DType::Q4_1, DType::F16] {
            let dir = tmp.path().join(format!("{name}-{dtype}"));
            support::families::write(&dir, &config, dtype);
            compare_model(&dir, &dir, &format!("family {name} {dtype}"));
        }
    }
}

/// Gemma 3's windowed rings through the production path: resident (decode steps replayed
/// from a CUDA graph), streamed and through the host tier give the upload-once path's tokens
/// and logits exactly.
#[test]
fn family_gemma3_streamed_gives_the_resident_tokens() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = support::families::write_named(tmp.path(), "gemma3", DType::Q4_1);
    streamed_matches_resident(&dir, "family gemma3 q4_1");
}

/// A model in llama.cpp's Q4_K_M mix (q4_k, q6_k, and q5_0/q8_0 for ffn_down, whose 704-value
/// rows are not whole super-blocks) of the small untied shape, and its f32 twin.
fn gpu_q4_k_m_model(n_layers: usize) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    gpu()?;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("q4km");
    let config = small_untied_shape(n_layers).config();
    let model = gdsllm_convert::testing::write_q4_k_m_model(&dir, &config, 0.02, 7).unwrap();
    gdsllm_convert::testing::write_f32_twin(&model, &tmp.path().join("f32")).unwrap();
    Some((tmp, dir))
}

#[test]
fn q4_k_m_mix_model_matches_its_f32_twin_on_cpu() {
    let Some((tmp, dir)) = gpu_q4_k_m_model(4) else {
        return;
    };
    compare_model(&dir, &tmp.path().join("f32"), "small q4_k_m mix");
}

#[test]
fn streamed_q4_k_m_mix_gives_the_resident_tokens() {
    let Some((_tmp, dir)) = gpu_q4_k_m_model(6) else {
        return;
    };
    streamed_matches_resident(&dir, "small q4_k_m mix");
}
