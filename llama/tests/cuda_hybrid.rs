//! The hybrid split on a GPU (issue 24): a synthetic model whose layers stream from the pinned
//! host tier, opened with `--placement auto` and a forced CPU share (the CUDA backend computes
//! rows `[k, n)` of each streamed layer's matmuls from device memory, the CPU backend rows
//! `[0, k)` straight from the host tier's pinned RAM), gives the logits of the same model all
//! on the GPU, and each side computes exactly its share; after decode steps at that share, a
//! chunk of more rows than it is forced for (as the planner gives a prefill chunk no share)
//! has the CPU compute none of its rows, the blobs prefetched at the decode share completed
//! when the chunk acquires them. Opt-in: `GDSLLM_GPU_TESTS=1` (then a
//! machine without a usable GPU FAILS this test instead of skipping it). Needs `cuda`. Also
//! the calibration's concurrent probe (the CPU's matmul beside pinned host→device copies).
//!
//! Tolerance: 1e-2 of the logits' scale. The two sides compute the same dot products with
//! different kernels (the GPU's f16 GEMM for the prompt, its matvec kernels for decode; the
//! CPU's f32 kernels in exact mode), whose roundings differ by up to ~1e-3 per matmul and
//! compound over the layers.
#![cfg(feature = "cuda")]

mod support;

use std::path::Path;

use gdsllm_convert::synth::{SynthOptions, SynthShape, synth};
use llama::hybrid::{HybridOptions, helper_rows};
use residency::{Budget, HostCache, Placement, ResidencyOptions};
use support::max_rel_diff;
use weights_format::{DType, Model};

const CONTEXT: usize = 64;
const TOLERANCE: f32 = 1e-2;
const CPU_FRACTION: f64 = 0.5;

fn synth_model(dir: &Path, dtype: DType) {
    let shape = SynthShape::new(6, 256, 512, 4, 2, 512, CONTEXT as u32);
    let opts = SynthOptions {
        shape,
        dtype,
        seed: 24,
        threads: 1,
        shape_name: "cuda-hybrid-test".into(),
    };
    synth(dir, &opts, &mut |_| {}).expect("synth");
}

/// Layer 0 resident, the other 5 streamed from the pinned host tier (more than the ring's 3
/// slots, so residency may copy up only the GPU's share of each); `hybrid`: `--placement
/// auto` with the CPU forced to [`CPU_FRACTION`] of every split matmul.
fn options(hybrid: bool) -> llama::OpenOptions {
    options_up_to(hybrid, None)
}

/// [`options`], the forced share given only to passes of at most `max_rows` rows.
fn options_up_to(hybrid: bool, max_rows: Option<usize>) -> llama::OpenOptions {
    llama::OpenOptions {
        residency: ResidencyOptions {
            resident_layers: Some(1),
            host_cache: HostCache::Bytes(1 << 30),
            device_budget: Budget::Bytes(2 << 30),
            ..ResidencyOptions::default()
        },
        context: CONTEXT,
        cpu_exact: true,
        hybrid: hybrid.then(|| HybridOptions {
            calibrate: None,
            force_cpu_fraction: Some(CPU_FRACTION),
            force_max_rows: max_rows,
        }),
        ..llama::OpenOptions::default()
    }
}

/// Logits of a 12-token prompt, then of `steps` decode steps fed `tokens` (the reference's
/// greedy tokens, so that both runs see the same inputs).
fn run<B: llama::Backend, W: llama::WeightSource>(
    model: &mut llama::Llama<B, W>,
    tokens: &[u32],
) -> Vec<Vec<f32>> {
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..12).map(|i| (i * 7919 + 11) % vocab).collect();
    let mut all = vec![model.forward(&prompt).unwrap().to_vec()];
    for &t in tokens {
        all.push(model.forward(&[t]).unwrap().to_vec());
    }
    all
}

/// The model in `dir` all on the GPU (`--placement gpu`): the reference.
fn all_gpu(dir: &Path) -> llama::Llama<llama::CudaBackend, llama::backend::cuda::CudaWeights> {
    let reference = llama::open(dir, llama::Device::Cuda { ordinal: 0 }, &options(false))
        .unwrap()
        .into_cuda()
        .expect("--placement gpu opens the CUDA model");
    reference.session.into_parts().0
}

/// The greedy tokens of `steps` decode steps after [`run`]'s prompt; the model is left empty.
fn greedy_tokens<B: llama::Backend, W: llama::WeightSource>(
    model: &mut llama::Llama<B, W>,
    steps: usize,
) -> Vec<u32> {
    let vocab = model.config().vocab_size as u32;
    let mut tokens = Vec::new();
    let mut logits = model
        .forward(&(0..12).map(|i| (i * 7919 + 11) % vocab).collect::<Vec<_>>())
        .unwrap()
        .to_vec();
    for _ in 0..steps {
        let t = argmax(&logits);
        tokens.push(t);
        logits = model.forward(&[t]).unwrap().to_vec();
    }
    model.truncate(0);
    tokens
}

fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

fn split_gives_the_gpu_logits(dtype: DType) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth_model(&dir, dtype);
    let steps = 8;

    // All on the GPU: the reference, and its greedy tokens.
    let mut gpu = all_gpu(&dir);
    let tokens = greedy_tokens(&mut gpu, steps);
    let want = run(&mut gpu, &tokens);
    let whole = gpu.weights().residency().stats().total;
    drop(gpu);

    let hybrid = llama::open(&dir, llama::Device::Cuda { ordinal: 0 }, &options(true))
        .unwrap()
        .into_hybrid()
        .expect("--placement auto with a host tier opens the split model");
    let (mut split, _) = hybrid.session.into_parts();
    let got = run(&mut split, &tokens);
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| max_rel_diff(g, w))
        .fold(0f32, f32::max);
    let counts = split.backend().stats().counts();
    println!(
        "{dtype:?}: split (CPU share {CPU_FRACTION}) vs all-GPU logits over {} passes: max rel \
         diff {worst:.2e} (tol {TOLERANCE:.0e}); {counts:?}",
        got.len()
    );
    assert!(worst < TOLERANCE, "{dtype:?}: {worst}");

    // Each side computed its share: the CPU rows [0, k) of every matmul weight of every blob
    // streamed from the host tier, in every pass but the first (which reads every blob from
    // disk, whole); the GPU the rest and every resident blob's.
    let model = Model::open(&dir).unwrap();
    let meta = model.metadata();
    let plan = split.weights().residency().plan();
    let passes = got.len() as u64;
    let (mut cpu_rows, mut all_rows, mut cpu_bytes) = (0u64, 0u64, 0u64);
    let mut split_blobs = 0;
    for (b, blob) in meta.blobs.iter().enumerate() {
        if blob.file == weights_format::names::EMBED_BLOB {
            continue; // the untied embedding table is looked up, not multiplied
        }
        let host = plan.placement(b) == Placement::HostCached;
        split_blobs += usize::from(host);
        for t in blob.tensors.iter().filter(|t| t.shape.len() == 2) {
            let rows = t.shape[0] as usize;
            all_rows += rows as u64;
            if host {
                let k = helper_rows(rows, CPU_FRACTION);
                cpu_rows += k as u64;
                cpu_bytes += t.length / rows as u64 * k as u64;
            }
        }
    }
    assert!(
        split_blobs >= 5,
        "{split_blobs} blobs streamed from the host tier: {plan}"
    );
    assert_eq!(counts.helper_rows, cpu_rows * (passes - 1), "{counts:?}");
    assert_eq!(counts.helper_bytes, cpu_bytes * (passes - 1), "{counts:?}");
    assert_eq!(
        counts.helper_rows + counts.primary_rows,
        all_rows * passes,
        "{counts:?}"
    );
    assert!(counts.splits > 0 && counts.primary_rows > counts.helper_rows);

    // Residency copied up only the GPU's share of each split blob: fewer bytes per host-tier
    // copy than the all-GPU run's whole blobs.
    let parts = split.weights().residency().stats().total;
    let per_copy = |s: &residency::PassStats| s.host_copy_bytes as f64 / s.host_copies as f64;
    println!(
        "host-tier bytes per copy: all-GPU {:.0}, split {:.0} ({} streamed blobs, {} ring slots)",
        per_copy(&whole),
        per_copy(&parts),
        split_blobs,
        plan.ring_slots
    );
    assert!(
        split_blobs > plan.ring_slots,
        "partial fills need more blobs than slots"
    );
    assert!(
        per_copy(&parts) < (1.0 - CPU_FRACTION / 2.0) * per_copy(&whole),
        "{parts:?} vs {whole:?}"
    );
}

#[test]
fn a_split_f16_model_gives_the_gpu_logits_and_each_side_its_share() {
    if support::cuda::gpu().is_none() {
        return;
    }
    split_gives_the_gpu_logits(DType::F16);
}

#[test]
fn a_split_q8_0_model_gives_the_gpu_logits_and_each_side_its_share() {
    if support::cuda::gpu().is_none() {
        return;
    }
    split_gives_the_gpu_logits(DType::Q8_0);
}

/// Decode steps at the forced share, then a chunk of more rows than the forced share is for
/// (as a prefill chunk gets none from the planner): the blobs prefetched at the decode share
/// during the last step are completed when the chunk acquires them, so the CPU computes no
/// row of the chunk, and every logit is the all-GPU run's; the decode step after it is split
/// again.
fn a_chunk_after_decode_steps_runs_on_the_gpu(dtype: DType) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth_model(&dir, dtype);
    let (steps, max_rows) = (6, 8);
    let chunk: Vec<u32> = (0..16).map(|i| (i * 31 + 5) % 512).collect();

    // All on the GPU: the reference's greedy tokens, then its logits over the same inputs.
    let mut gpu = all_gpu(&dir);
    let tokens = greedy_tokens(&mut gpu, steps);
    let mut want = run(&mut gpu, &tokens);
    want.push(gpu.forward(&chunk).unwrap().to_vec());
    want.push(gpu.forward(&[1]).unwrap().to_vec());
    drop(gpu);

    let hybrid = llama::open(
        &dir,
        llama::Device::Cuda { ordinal: 0 },
        &options_up_to(true, Some(max_rows)),
    )
    .unwrap()
    .into_hybrid()
    .expect("--placement auto with a host tier opens the split model");
    let (mut split, _) = hybrid.session.into_parts();
    let stats = split.backend().stats();
    let mut got = run(&mut split, &tokens);
    // The last step's prefetches of the next pass's first blobs (at the decode share) are
    // made by the residency reader; let it finish them before the chunk's pass starts, so that
    // the chunk finds them partial and must complete them.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let residency =
        llama::WeightSource::residency_handle(split.weights()).expect("through residency");
    let completions = || residency.stats().total.fill_completions;
    let (decoded, completed) = (stats.counts(), completions());
    got.push(split.forward(&chunk).unwrap().to_vec());
    let (chunked, completed_in_chunk) = (stats.counts(), completions() - completed);
    got.push(split.forward(&[1]).unwrap().to_vec());
    let after = stats.counts();
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| max_rel_diff(g, w))
        .fold(0f32, f32::max);
    println!(
        "{dtype:?}: {steps} decode steps at CPU share {CPU_FRACTION}, a {}-row chunk, a step: \
         max rel diff {worst:.2e} (tol {TOLERANCE:.0e}) over {} passes; CPU rows after the \
         steps {}, after the chunk {}, after the last step {}; fills completed by the chunk \
         {completed_in_chunk}",
        chunk.len(),
        got.len(),
        decoded.helper_rows,
        chunked.helper_rows,
        after.helper_rows
    );
    assert!(worst < TOLERANCE, "{dtype:?}: {worst}");
    assert!(
        decoded.helper_rows > 0,
        "the decode steps were split: {decoded:?}"
    );
    assert_eq!(
        chunked.helper_rows, decoded.helper_rows,
        "the CPU computed rows of the chunk: {decoded:?} then {chunked:?}"
    );
    assert!(
        completed_in_chunk > 0,
        "no blob prefetched at the decode share was completed for the chunk"
    );
    assert!(
        after.helper_rows > chunked.helper_rows,
        "the step after the chunk is split again: {after:?}"
    );
}

#[test]
fn an_f16_chunk_after_decode_steps_runs_on_the_gpu() {
    if support::cuda::gpu().is_none() {
        return;
    }
    a_chunk_after_decode_steps_runs_on_the_gpu(DType::F16);
}

#[test]
fn the_concurrent_probe_measures_the_cpu_and_the_copies_alone_and_at_once() {
    // The calibration's shared-DRAM probe on a real GPU: pinned host→device copies on a thread
    // and a stream of their own beside the CPU's matmul (a 64 MiB probe keeps the test short;
    // the calibration sizes it above the caches). The figures are printed for the record; the
    // planner's use of them is tested in residency::placement.
    let Some(be) = support::cuda::gpu() else {
        return;
    };
    let rates = llama::hybrid::calibrate::measure_concurrent(&be, DType::F16, 64 << 20).unwrap();
    let rows: Vec<usize> = rates.iter().map(|r| r.rows).collect();
    assert_eq!(rows, residency::GpuRates::CONCURRENT_ROWS);
    for r in &rates {
        println!(
            "F16 at {} rows: CPU {:.1} GB/s beside the copies ({:.1} alone), copies {:.1} GB/s \
             beside the CPU ({:.1} alone)",
            r.rows, r.cpu_gbps, r.cpu_alone_gbps, r.h2d_gbps, r.h2d_alone_gbps
        );
        for gbps in [r.cpu_alone_gbps, r.cpu_gbps, r.h2d_alone_gbps, r.h2d_gbps] {
            assert!(gbps.is_finite() && gbps > 0.0, "{r:?}");
        }
    }
    // The device is usable afterwards (the copy thread's stream and context binding left
    // nothing behind): a copy through the backend's own stream still round-trips.
    let up = support::cuda::up(&be, &[1.0, 2.0, 3.0]);
    assert_eq!(support::cuda::down(&be, &up, 3), [1.0, 2.0, 3.0]);
}

/// The merges of a split call on the GPU: a share's columns put into place for every row in
/// one launch, written and added, from a device buffer (`ColumnSource::Buffer`, the GPU's
/// share) and from host values (`ColumnSource::Host`, the CPU's share, read by the kernel from
/// mapped pinned staging buffers), against the CPU backend's loops, bit for bit. More merges
/// than the staging ring has buffers are queued before anything is read back, with the host
/// values overwritten right after each call, and shares larger than a staging buffer's first
/// size (so that buffers are replaced while the ring is in use).
#[test]
fn a_split_share_goes_into_its_columns_for_every_row() {
    use llama::backend::NormInto;
    use llama::hybrid::{ColumnPlacement, ColumnSource, SplitTarget};
    let Some(be) = support::cuda::gpu() else {
        return;
    };
    let cpu = llama::CpuBackend::new();
    // (rows, share columns, output columns, first column)
    let cases = [
        (1, 32, 96, 0),
        (8, 64, 160, 96),
        (5, 37, 101, 30),
        (32, 96, 200, 0),
        (32, 2240, 4096, 1856),
        (40, 2048, 4096, 0),
    ];
    let value = |seed: usize, i: usize| ((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0;
    for (rows, src_cols, dst_cols, col0) in cases {
        let start: Vec<f32> = (0..rows * dst_cols).map(|i| value(1, i)).collect();
        let mut want = start.clone();
        let mut dst = support::cuda::up(&be, &start);
        // Six merges, alternating write and add, from the device and from the host, before
        // one read: more than the ring's four staging buffers.
        for round in 0..6 {
            let into = if round % 2 == 0 {
                NormInto::Write
            } else {
                NormInto::Add
            };
            let at = ColumnPlacement {
                rows,
                src_cols,
                dst_cols,
                col0,
                into,
            };
            let mut src: Vec<f32> = (0..rows * src_cols).map(|i| value(round + 2, i)).collect();
            cpu.write_columns(ColumnSource::Buffer(&src), &mut want, at)
                .unwrap();
            if round % 3 == 2 {
                let dev = support::cuda::up(&be, &src);
                be.write_columns(ColumnSource::Buffer(&dev), &mut dst, at)
                    .unwrap();
            } else {
                be.write_columns(ColumnSource::Host(&src), &mut dst, at)
                    .unwrap();
                // The values were staged: the caller may reuse its buffer at once.
                src.fill(f32::NAN);
            }
        }
        let got = support::cuda::down(&be, &dst, rows * dst_cols);
        let same = got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits());
        println!(
            "{rows} rows, columns {col0}..{} of {dst_cols}: the CPU's bits: {same}",
            col0 + src_cols
        );
        assert!(
            same,
            "{rows} rows, {src_cols} columns at {col0} of {dst_cols}"
        );
        // Out of bounds: an error, nothing queued.
        let err = be
            .write_columns(
                ColumnSource::Host(&vec![0.0; rows * src_cols]),
                &mut dst,
                ColumnPlacement {
                    rows,
                    src_cols,
                    dst_cols,
                    col0: dst_cols - src_cols + 1,
                    into: NormInto::Write,
                },
            )
            .unwrap_err();
        assert!(err.to_string().contains("columns"), "{err}");
    }
}
