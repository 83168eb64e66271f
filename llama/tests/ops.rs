//! Every fast CPU op against its slow reference on random inputs and random quantized blocks,
//! with the max difference printed and a stated tolerance.

mod support;

use gdsllm_convert::testing::random_blocks;
use llama::backend::{AttentionParams, AttentionShape, NormInto, RowGroup};
use llama::{Backend, CpuBackend, PassInfo, ReferenceBackend, WeightView, rope_inv_freq};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use support::{ALL, attention, attention_with, matmul, max_rel_diff, random, weights};
use weights_format::DType;

/// f32 accumulation in a different order than the f64 reference: a few ulps of the scale.
const TOL: f32 = 2e-5;

/// The default mode's q4_0/q4_1/q8_0 rows dot 8-bit activations (`|x − x̂| ≤ max|x|/254` per
/// 32 values; decode rows always, a prompt's rows where the CPU has AVX2): relative to the
/// largest output, a few thousandths (the kernels' own tests check the per-row bound exactly).
const INT8_TOL: f32 = 1e-2;

#[test]
fn matmul_matches_reference_for_every_dtype_and_row_count() {
    let mut rng = StdRng::seed_from_u64(1);
    for dtype in ALL {
        // Odd row counts, a column count that is not a multiple of 64, and both the decode (1
        // row) and the decode-once (>= 4 rows) paths.
        for (m, k) in [(77, 96), (256, 576), (33, 1536)] {
            let w = weights(&mut rng, dtype, m, k);
            let view = WeightView::host(dtype, m, k, &w);
            for rows in [1, 2, 5, 17] {
                let x = random(&mut rng, rows * k);
                let (mut fast, mut slow) = (vec![0f32; rows * m], vec![0f32; rows * m]);
                matmul(&CpuBackend::exact(), &x, rows, view, &mut fast);
                matmul(&ReferenceBackend, &x, rows, view, &mut slow);
                let d = max_rel_diff(&fast, &slow);
                println!(
                    "matmul {dtype} [{m}x{k}] rows {rows}: max rel diff {d:.2e} (tol {TOL:.0e})"
                );
                assert!(d <= TOL, "{dtype} [{m}x{k}] rows {rows}: {d}");
                let mut default = vec![0f32; rows * m];
                matmul(&CpuBackend::new(), &x, rows, view, &mut default);
                let d = max_rel_diff(&default, &slow);
                let int8 = matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0);
                let tol = if int8 { INT8_TOL } else { TOL };
                println!("  default mode: max rel diff {d:.2e} (tol {tol:.0e})");
                assert!(d <= tol, "default mode {dtype} [{m}x{k}] rows {rows}: {d}");
            }
        }
    }
}

#[test]
fn matmul_of_resident_weights_matches_reference_and_each_sequence_alone() {
    // With resident weights the CPU backend repacks the matrices it reads on 8-bit activations
    // (interleaved rows: sixteen with AVX-512 VNNI, eight with AVX2) and computes whole groups
    // of rows from the copy, the rows after the last group from the stored ones; q5_1 and the
    // q2_k/q3_k/q5_k dtypes are never repacked. Against the
    // reference: within the 8-bit tolerance (f32 rows of the exact mode within TOL); every
    // sequence of a batch mixing decode rows and prompts bit for bit what it gives alone.
    let mut rng = StdRng::seed_from_u64(7);
    let dtypes = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q4K,
        DType::Q6K,
        // Never repacked: every row on 8-bit activations in the default mode, as above.
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q5K,
    ];
    let stable = PassInfo {
        rows: 1,
        sequence: Some(0),
        pos: 0,
        weights_stable: true,
        generation: 0,
    };
    for dtype in dtypes {
        for (m, k) in [(77, 512), (40, 256), (256, 768)] {
            // The reference quantizer makes the first six dtypes; the decode-only ones are
            // random blocks.
            let w = if matches!(dtype, DType::Q5_1 | DType::Q2K | DType::Q3K | DType::Q5K) {
                random_blocks(dtype, m * k / dtype.block_len(), rng.random())
            } else {
                weights(&mut rng, dtype, m, k)
            };
            let view = WeightView::host(dtype, m, k, &w);
            for cpu in [CpuBackend::new(), CpuBackend::exact()] {
                cpu.begin_pass(&stable).unwrap();
                let int8 =
                    !cpu.is_exact() || !matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0);
                let mode = if cpu.is_exact() { "exact" } else { "default" };
                for rows in [1, 2, 5, 17] {
                    let x = random(&mut rng, rows * k);
                    let (mut fast, mut slow) = (vec![0f32; rows * m], vec![0f32; rows * m]);
                    matmul(&cpu, &x, rows, view, &mut fast);
                    matmul(&ReferenceBackend, &x, rows, view, &mut slow);
                    let d = max_rel_diff(&fast, &slow);
                    // Prompt rows of the k-quant-era dtypes decode the weights to f32 in the
                    // exact mode (in the default mode they take 8-bit activations where the
                    // matrix is repacked, which depends on the CPU: the 8-bit bound).
                    let f32_rows = cpu.is_exact()
                        && rows >= 4
                        && !matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0);
                    let tol = if int8 && !f32_rows { INT8_TOL } else { TOL };
                    println!(
                        "resident {dtype} [{m}x{k}] {mode} rows {rows}: max rel diff {d:.2e} (tol {tol:.0e})"
                    );
                    assert!(d <= tol, "{dtype} [{m}x{k}] {mode} rows {rows}: {d}");
                }
                // Decode rows and prompts in one batch: each as alone.
                let groups = [RowGroup::solo(1), RowGroup::solo(5), RowGroup::solo(2)];
                let total: usize = groups.iter().map(|g| g.rows).sum();
                let x = random(&mut rng, total * k);
                let mut batched = vec![0f32; total * m];
                cpu.matmul_batch(&x, &groups, &[view], &mut [&mut batched])
                    .unwrap();
                let mut row0 = 0;
                for g in &groups {
                    let mut alone = vec![0f32; g.rows * m];
                    matmul(
                        &cpu,
                        &x[row0 * k..(row0 + g.rows) * k].to_vec(),
                        g.rows,
                        view,
                        &mut alone,
                    );
                    assert_eq!(
                        &batched[row0 * m..(row0 + g.rows) * m],
                        &alone[..],
                        "{dtype} [{m}x{k}] {mode}: the sequence of {} rows",
                        g.rows
                    );
                    row0 += g.rows;
                }
                println!("resident {dtype} [{m}x{k}] {mode}: a batch's sequences as alone (tol 0)");
                if !cpu.is_exact() {
                    // A prompt long enough that its rows are split into spans among the
                    // threads as well as its weight rows (`activation_span_rows`): every row bit
                    // for bit as alone.
                    let rows = 40;
                    let x = random(&mut rng, rows * k);
                    let mut together = vec![0f32; rows * m];
                    matmul(&cpu, &x, rows, view, &mut together);
                    for r in 0..rows {
                        let mut alone = vec![0f32; m];
                        matmul(&cpu, &x[r * k..(r + 1) * k].to_vec(), 1, view, &mut alone);
                        assert_eq!(
                            &together[r * m..(r + 1) * m],
                            &alone[..],
                            "{dtype} [{m}x{k}]: row {r} of a {rows}-row prompt"
                        );
                    }
                    println!(
                        "resident {dtype} [{m}x{k}]: a {rows}-row prompt's rows as alone (tol 0)"
                    );
                }
            }
        }
    }
}

#[test]
fn embed_rows_and_rmsnorm_match_reference() {
    let mut rng = StdRng::seed_from_u64(2);
    for dtype in ALL {
        let (vocab, dim) = (50, 128);
        let t = weights(&mut rng, dtype, vocab, dim);
        let table = WeightView::host(dtype, vocab, dim, &t);
        let ids = [3u32, 49, 0, 3, 17];
        let (mut fast, mut slow) = (vec![0f32; ids.len() * dim], vec![0f32; ids.len() * dim]);
        CpuBackend::new()
            .embed_rows(table, &ids, &mut fast)
            .unwrap();
        ReferenceBackend.embed_rows(table, &ids, &mut slow).unwrap();
        let d = max_rel_diff(&fast, &slow);
        println!("embed_rows {dtype}: max rel diff {d:.2e} (tol 0: both decode exactly)");
        assert_eq!(d, 0.0);

        let nw = weights(&mut rng, dtype, 1, dim);
        let norm = WeightView::host(dtype, 1, dim, &nw);
        let (mut a, mut b) = (vec![0f32; ids.len() * dim], vec![0f32; ids.len() * dim]);
        CpuBackend::new()
            .rmsnorm(&fast, ids.len(), norm, 1e-5, &mut a, NormInto::Write)
            .unwrap();
        ReferenceBackend
            .rmsnorm(&slow, ids.len(), norm, 1e-5, &mut b, NormInto::Write)
            .unwrap();
        let d = max_rel_diff(&a, &b);
        println!("rmsnorm {dtype}: max rel diff {d:.2e} (tol {TOL:.0e})");
        assert!(d <= TOL);
    }
}

#[test]
fn rope_attention_swiglu_add_match_reference() {
    let mut rng = StdRng::seed_from_u64(3);
    let shape = AttentionShape {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 32,
    };
    let inv = rope_inv_freq(shape.head_dim, 10000.0, None, 0);
    let (ctx, pos0, rows) = (40, 11, 7);
    let q_w = shape.n_heads * shape.head_dim;
    let kv_w = shape.n_kv_heads * shape.head_dim;
    let cpu = CpuBackend::new();

    // RoPE (of q and k, with k and v stored in the caches at the same positions).
    let (q0, k0, v0) = (
        random(&mut rng, rows * q_w),
        random(&mut rng, rows * kv_w),
        random(&mut rng, rows * kv_w),
    );
    let (mut qf, mut qs, mut kf, mut ks) = (q0.clone(), q0.clone(), k0.clone(), k0.clone());
    let mut caches = [(); 4].map(|_| vec![0f32; ctx * kv_w]);
    let [kcf, vcf, kcs, vcs] = &mut caches;
    cpu.rope_store_kv(&mut qf, &mut kf, &v0, 0, rows, pos0, shape, &inv, kcf, vcf)
        .unwrap();
    ReferenceBackend
        .rope_store_kv(&mut qs, &mut ks, &v0, 0, rows, pos0, shape, &inv, kcs, vcs)
        .unwrap();
    let d = max_rel_diff(&qf, &qs).max(max_rel_diff(&kf, &ks));
    println!(
        "rope: max rel diff {d:.2e} (tol 1e-5: f32 vs f64 sin/cos of angles up to {})",
        pos0 + rows
    );
    assert!(d <= 1e-5);
    let stored = pos0 * kv_w..(pos0 + rows) * kv_w;
    assert_eq!(&kcf[stored.clone()], &kf[..]);
    assert_eq!(&vcf[stored.clone()], &v0[..]);
    assert!(
        kcf[..stored.start]
            .iter()
            .chain(&kcf[stored.end..])
            .all(|&x| x == 0.0)
    );

    let k = random(&mut rng, ctx * kv_w);
    let v = random(&mut rng, ctx * kv_w);
    let (mut of, mut os) = (vec![0f32; rows * q_w], vec![0f32; rows * q_w]);
    attention(&cpu, &qs, rows, &k, &v, pos0, shape, &mut of);
    attention(&ReferenceBackend, &qs, rows, &k, &v, pos0, shape, &mut os);
    let d = max_rel_diff(&of, &os);
    println!("attention: max rel diff {d:.2e} (tol {TOL:.0e})");
    assert!(d <= TOL);

    let mut kc = vec![0f32; ctx * kv_w];
    cpu.copy_rows(&k, 2, &mut kc, 5, 3, kv_w).unwrap();
    assert_eq!(&kc[5 * kv_w..8 * kv_w], &k[2 * kv_w..5 * kv_w]);
    assert!(
        kc[..5 * kv_w]
            .iter()
            .chain(&kc[8 * kv_w..])
            .all(|&x| x == 0.0)
    );

    let g = random(&mut rng, 1000);
    let u = random(&mut rng, 1000);
    let (mut gf, mut gs) = (g.clone(), g.clone());
    cpu.swiglu(&mut gf, &u, 1000).unwrap();
    ReferenceBackend.swiglu(&mut gs, &u, 1000).unwrap();
    let d = max_rel_diff(&gf, &gs);
    println!("swiglu: max rel diff {d:.2e} (tol {TOL:.0e})");
    assert!(d <= TOL);

    // The residual add of `matmul_add_batch`: exactly the product of `matmul_batch` added to
    // what `out` held, on both backends.
    let (m, k) = (40, 25);
    let w = weights(&mut rng, DType::F32, m, k);
    let view = WeightView::host(DType::F32, m, k, &w);
    let x = random(&mut rng, 2 * k);
    let base = random(&mut rng, 2 * m);
    fn add_check<B: Backend<Buf = Vec<f32>>>(
        be: &B,
        x: &Vec<f32>,
        w: WeightView<'_>,
        base: &[f32],
    ) {
        let mut product = vec![0f32; base.len()];
        matmul(be, x, 2, w, &mut product);
        let want: Vec<f32> = base.iter().zip(&product).map(|(a, b)| a + b).collect();
        let (mut got, mut scratch) = (base.to_vec(), vec![0f32; base.len()]);
        be.matmul_add_batch(x, &[RowGroup::solo(2)], w, &mut scratch, &mut got)
            .unwrap();
        assert_eq!(got, want, "{}", be.name());
    }
    add_check(&cpu, &x, view, &base);
    add_check(&ReferenceBackend, &x, view, &base);
}

/// The ops the families beyond llama add (biases, per-head norms, post-norms, the tanh-GeLU
/// gate, the embedding scale, the logit soft-cap), CPU against reference.
#[test]
fn family_ops_match_reference() {
    let mut rng = StdRng::seed_from_u64(6);
    let cpu = CpuBackend::new();
    let (rows, width) = (5, 96);
    let x = random(&mut rng, rows * width);
    let check = |name: &str, fast: &[f32], slow: &[f32], tol: f32| {
        let d = max_rel_diff(fast, slow);
        println!("{name}: max rel diff {d:.2e} (tol {tol:.0e})");
        assert!(d <= tol, "{name}: {d}");
    };
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let b = weights(&mut rng, dtype, 1, width);
        let bias = WeightView::host(dtype, 1, width, &b);
        let (mut fast, mut slow) = (x.clone(), x.clone());
        cpu.add_bias(&mut fast, rows, bias).unwrap();
        ReferenceBackend.add_bias(&mut slow, rows, bias).unwrap();
        check(&format!("add_bias {dtype}"), &fast, &slow, 0.0);

        // Per-head norms: 6 heads of 16 in each row.
        let nw = weights(&mut rng, dtype, 1, 16);
        let head_norm = WeightView::host(dtype, 1, 16, &nw);
        let (mut fast, mut slow) = (x.clone(), x.clone());
        cpu.rmsnorm_pieces(&mut fast, rows * 6, head_norm, 1e-6)
            .unwrap();
        ReferenceBackend
            .rmsnorm_pieces(&mut slow, rows * 6, head_norm, 1e-6)
            .unwrap();
        check(&format!("rmsnorm_pieces {dtype}"), &fast, &slow, TOL);
        // ... which is the plain rmsnorm of the rows seen as [rows·6, 16].
        let mut plain = vec![0f32; x.len()];
        cpu.rmsnorm(&x, rows * 6, head_norm, 1e-6, &mut plain, NormInto::Write)
            .unwrap();
        assert_eq!(fast, plain);

        let pw = weights(&mut rng, dtype, 1, width);
        let post = WeightView::host(dtype, 1, width, &pw);
        let base = random(&mut rng, rows * width);
        let (mut fast, mut slow) = (base.clone(), base.clone());
        cpu.rmsnorm(&x, rows, post, 1e-6, &mut fast, NormInto::Add)
            .unwrap();
        ReferenceBackend
            .rmsnorm(&x, rows, post, 1e-6, &mut slow, NormInto::Add)
            .unwrap();
        check(&format!("add_rmsnorm {dtype}"), &fast, &slow, TOL);
    }

    let g: Vec<f32> = random(&mut rng, 1000).iter().map(|v| 8.0 * v).collect();
    let u = random(&mut rng, 1000);
    let (mut gf, mut gs) = (g.clone(), g.clone());
    cpu.geglu(&mut gf, &u, 1000).unwrap();
    ReferenceBackend.geglu(&mut gs, &u, 1000).unwrap();
    check("geglu", &gf, &gs, TOL);
    // The tanh approximation against values computed by hand (x = 1, -2: 0.841192, -0.045402).
    let mut two = vec![1.0f32, -2.0];
    cpu.geglu(&mut two, &vec![1.0, 1.0], 2).unwrap();
    assert!((two[0] - 0.841_192).abs() < 1e-5 && (two[1] + 0.045_402).abs() < 1e-5);

    let (mut fast, mut slow) = (x.clone(), x.clone());
    cpu.scale(&mut fast, x.len(), 25.3).unwrap();
    ReferenceBackend.scale(&mut slow, x.len(), 25.3).unwrap();
    check("scale", &fast, &slow, 0.0);

    let big: Vec<f32> = x.iter().map(|v| 100.0 * v).collect();
    let (mut fast, mut slow) = (big.clone(), big.clone());
    cpu.softcap(&mut fast, big.len(), 30.0).unwrap();
    ReferenceBackend
        .softcap(&mut slow, big.len(), 30.0)
        .unwrap();
    check("softcap", &fast, &slow, TOL);
    assert!(fast.iter().all(|v| v.abs() < 30.0));
}

/// A sliding-window layer's cache is a ring (position `p` in slot `p % slots`): attention over
/// it equals attention over a cache holding every position with the same window, bit for bit
/// on the CPU backend and within rounding on the reference, for prompts and decode rows that
/// wrap the ring; a cache too small for the rows is an error, not a wrong answer.
#[test]
fn windowed_attention_over_a_ring_equals_a_full_cache() {
    let mut rng = StdRng::seed_from_u64(7);
    let shape = AttentionShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
    };
    let (width, kv_width, window) = (64, 32, 5);
    let params = AttentionParams {
        scale: 0.3,
        window: Some(window),
    };
    let inv = rope_inv_freq(16, 10000.0, None, 0);
    let total = 23;
    let q = random(&mut rng, total * width);
    let k = random(&mut rng, total * kv_width);
    let v = random(&mut rng, total * kv_width);
    fn run<B: Backend<Buf = Vec<f32>, KvBuf = Vec<f32>>>(
        be: &B,
        slots: usize,
        chunks: &[usize],
        (q, k, v): (&[f32], &[f32], &[f32]),
        shape: AttentionShape,
        params: AttentionParams,
        inv: &Vec<f32>,
    ) -> Vec<f32> {
        let (width, kv_width) = (64, 32);
        let (mut kc, mut vc) = (vec![0f32; slots * kv_width], vec![0f32; slots * kv_width]);
        let mut out = Vec::new();
        let mut pos = 0;
        for &n in chunks {
            let mut qr = q[pos * width..(pos + n) * width].to_vec();
            let mut kr = k[pos * kv_width..(pos + n) * kv_width].to_vec();
            let vr = v[pos * kv_width..(pos + n) * kv_width].to_vec();
            be.rope_store_kv(
                &mut qr, &mut kr, &vr, 0, n, pos, shape, inv, &mut kc, &mut vc,
            )
            .unwrap();
            let mut o = vec![0f32; n * width];
            attention_with(be, &qr, n, (&kc, &vc), pos, shape, params, &mut o);
            out.extend(o);
            pos += n;
        }
        out
    }
    let inputs = (&q[..], &k[..], &v[..]);
    // A prompt of 5 (the window), then 3, 5, 1, ... up to 23 positions.
    let chunks = [5, 3, 5, 1, 1, 4, 1, 2, 1];
    let cpu = CpuBackend::new();
    let full = run(&cpu, total, &chunks, inputs, shape, params, &inv);
    let ring = run(&cpu, 2 * window, &chunks, inputs, shape, params, &inv);
    assert_eq!(ring, full, "cpu: ring of {} vs full cache", 2 * window);
    let slow = run(
        &ReferenceBackend,
        2 * window,
        &chunks,
        inputs,
        shape,
        params,
        &inv,
    );
    let d = max_rel_diff(&ring, &slow);
    println!(
        "windowed attention over a ring: cpu identical to a full cache; vs reference max rel diff {d:.2e} (tol {TOL:.0e})"
    );
    assert!(d <= TOL);
    // The window matters: without it the rows past the window differ.
    let unwindowed = AttentionParams {
        window: None,
        ..params
    };
    let all = run(&cpu, total, &chunks, inputs, shape, unwindowed, &inv);
    assert_eq!(all[..window * width], full[..window * width]);
    assert_ne!(all[window * width..], full[window * width..]);

    // 6 rows at positions 8..=13 see keys from 4 on: 10 positions, which 9 slots cannot hold.
    let (mut kc, vc) = (vec![0f32; 9 * kv_width], vec![0f32; 9 * kv_width]);
    kc.iter_mut().for_each(|x| *x = 0.5);
    let seq = llama::AttentionSeq {
        row0: 0,
        rows: 6,
        pos0: 8,
        k_cache: &kc,
        v_cache: &vc,
    };
    let mut o = vec![0f32; 6 * width];
    let err = cpu
        .attention_batch(&q, &[seq], shape, params, &mut o)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot serve rows at positions 8..=13"),
        "{err}"
    );
}

#[test]
fn f16_bit_conversion_is_exact_for_every_half() {
    let mut worst = 0u32;
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        let got = llama::backend::f16_bits_to_f32(h);
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#06x}");
        } else if got.to_bits() != want.to_bits() {
            worst += 1;
        }
    }
    println!("f16 -> f32: {worst} of 65536 bit patterns differ from `half` (tol 0)");
    assert_eq!(worst, 0);
}

#[test]
fn matmul_many_equals_separate_matmuls() {
    let mut rng = StdRng::seed_from_u64(4);
    let k = 192;
    let shapes = [(DType::Q4_1, 96), (DType::Q8_0, 40), (DType::F16, 33)];
    let bytes: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&(d, m)| weights(&mut rng, d, m, k))
        .collect();
    let views: Vec<WeightView> = shapes
        .iter()
        .zip(&bytes)
        .map(|(&(dtype, m), b)| WeightView::host(dtype, m, k, b))
        .collect();
    let cpu = CpuBackend::new();
    for rows in [1, 3] {
        let x = random(&mut rng, rows * k);
        let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(_, m)| vec![0f32; rows * m]).collect();
        let mut refs: Vec<&mut Vec<f32>> = outs.iter_mut().collect();
        cpu.matmul_batch(&x, &[RowGroup::solo(rows)], &views, &mut refs)
            .unwrap();
        for (v, got) in views.iter().zip(&outs) {
            let mut want = vec![0f32; rows * v.rows];
            matmul(&cpu, &x, rows, *v, &mut want);
            println!(
                "matmul_many {} rows {rows}: identical to matmul (tol 0)",
                v.dtype
            );
            assert_eq!(got, &want);
        }
    }
}

/// Batched ops (issue 7): each sequence's rows of `matmul_batch`, `rope_store_kv` and
/// `attention_batch` are bit for bit what the op gives that sequence alone, on the CPU backend
/// and on the reference backend.
fn batched_ops_equal_ops_alone<B: Backend<Buf = Vec<f32>, KvBuf = Vec<f32>>>(be: &B, name: &str) {
    let mut rng = StdRng::seed_from_u64(5);
    let (m, k) = (72, 128);
    // (rows in the batch, rows the sequence has alone): decode rows, a prompt chunk of a long
    // prompt, a short prompt; on both sides of the CPU's 4-row kernel switch.
    let groups = [
        (1, 1),
        (3, 40),
        (2, 2),
        (1, 1),
        (5, 5),
        (1, 1),
        (1, 1),
        (1, 1),
        (1, 1),
        (1, 1),
    ];
    let rows: usize = groups.iter().map(|g| g.0).sum();
    let x = random(&mut rng, rows * k);
    for dtype in ALL {
        let w = weights(&mut rng, dtype, m, k);
        let view = WeightView::host(dtype, m, k, &w);
        let row_groups: Vec<RowGroup> = groups
            .iter()
            .map(|&(rows, solo_rows)| RowGroup { rows, solo_rows })
            .collect();
        let mut got = vec![0f32; rows * m];
        be.matmul_batch(&x, &row_groups, &[view], &mut [&mut got])
            .unwrap();
        let mut r0 = 0;
        for &(n, solo) in &groups {
            // The group's rows inside a call of `solo` rows (the other rows are noise).
            let mut alone_x = random(&mut rng, solo * k);
            alone_x[..n * k].copy_from_slice(&x[r0 * k..(r0 + n) * k]);
            let mut want = vec![0f32; solo * m];
            matmul(be, &alone_x, solo, view, &mut want);
            assert_eq!(
                &got[r0 * m..(r0 + n) * m],
                &want[..n * m],
                "{name} matmul_batch {dtype}: rows {r0}..{} (alone: {solo} rows)",
                r0 + n
            );
            r0 += n;
        }
        println!("{name} matmul_batch {dtype}: every group identical to its solo matmul (tol 0)");
    }

    let shape = AttentionShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
    };
    let (width, kv_width) = (64, 32);
    let inv = rope_inv_freq(16, 10000.0, None, 0);
    // (rows, pos0) of three sequences, each with its own cache.
    let seqs = [(2usize, 5usize), (1, 0), (4, 9)];
    let total: usize = seqs.iter().map(|s| s.0).sum();
    let q = random(&mut rng, total * width);
    let kv = random(&mut rng, total * kv_width);
    let caches: Vec<(Vec<f32>, Vec<f32>)> = seqs
        .iter()
        .map(|&(n, p)| {
            (
                random(&mut rng, (n + p) * kv_width),
                random(&mut rng, (n + p) * kv_width),
            )
        })
        .collect();
    let (mut roped, mut roped_k) = (q.clone(), kv.clone());
    let mut row0 = 0;
    let mut attn = Vec::new();
    for (&(n, p), (kc, vc)) in seqs.iter().zip(&caches) {
        let (mut kc_w, mut vc_w) = (kc.clone(), vc.clone());
        be.rope_store_kv(
            &mut roped,
            &mut roped_k,
            &kv,
            row0,
            n,
            p,
            shape,
            &inv,
            &mut kc_w,
            &mut vc_w,
        )
        .unwrap();
        attn.push(llama::AttentionSeq {
            row0,
            rows: n,
            pos0: p,
            k_cache: kc,
            v_cache: vc,
        });
        row0 += n;
    }
    let mut out = vec![0f32; total * width];
    be.attention_batch(
        &roped,
        &attn,
        shape,
        AttentionParams::causal(shape),
        &mut out,
    )
    .unwrap();
    let mut row0 = 0;
    for (&(n, p), (kc, vc)) in seqs.iter().zip(&caches) {
        let mut alone = q[row0 * width..(row0 + n) * width].to_vec();
        let mut alone_k = kv[row0 * kv_width..(row0 + n) * kv_width].to_vec();
        let alone_v = alone_k.clone();
        let (mut kc_w, mut vc_w) = (kc.clone(), vc.clone());
        be.rope_store_kv(
            &mut alone,
            &mut alone_k,
            &alone_v,
            0,
            n,
            p,
            shape,
            &inv,
            &mut kc_w,
            &mut vc_w,
        )
        .unwrap();
        assert_eq!(&roped[row0 * width..(row0 + n) * width], &alone[..]);
        assert_eq!(
            &roped_k[row0 * kv_width..(row0 + n) * kv_width],
            &alone_k[..]
        );
        let mut want = vec![0f32; n * width];
        attention(be, &alone, n, kc, vc, p, shape, &mut want);
        assert_eq!(&out[row0 * width..(row0 + n) * width], &want[..]);
        row0 += n;
    }
    println!("{name} rope_store_kv and attention_batch: identical to each sequence alone (tol 0)");
}

#[test]
fn batched_ops_give_each_sequence_its_solo_result() {
    batched_ops_equal_ops_alone(&CpuBackend::new(), "cpu");
    batched_ops_equal_ops_alone(&ReferenceBackend, "reference");
}
