//! The hybrid split (issue 24) without a GPU: a model whose matmuls are split between two
//! backends gives the logits of one backend alone, and each side computes exactly the rows
//! and bytes its share plans.
//!
//! Tolerance: the CPU backend on both sides computes every output element from the same
//! activation row and weight row whichever side computes it, so the logits must agree to
//! 1e-6 of their scale (in practice bit for bit). The reference backend as primary with the
//! CPU backend as helper mixes two kernels' roundings: 1e-3 of the scale.

mod support;

use std::path::Path;

use gdsllm_convert::synth::{SynthOptions, SynthShape, synth};
use llama::hybrid::{SplitBackend, SplitCounts, SplitTarget, helper_rows};
use support::max_rel_diff;

use llama::{Backend, BatchSeq, CpuBackend, InMemoryWeights, Llama, ReferenceBackend};
use weights_format::{DType, Metadata, Model};

const CONTEXT: usize = 64;

fn synth_model(dir: &Path, dtype: DType) {
    let shape = SynthShape::new(3, 128, 320, 4, 2, 512, CONTEXT as u32);
    let opts = SynthOptions {
        shape,
        dtype,
        seed: 24,
        threads: 1,
        shape_name: "hybrid-test".into(),
    };
    synth(dir, &opts, &mut |_| {}).expect("synth");
}

/// The plan under test: layer 0 stays whole on the primary (a resident layer), the other
/// layers and the LM head give the helper half their rows in passes of up to 4 rows (decode)
/// and a quarter in wider ones (prefill).
fn plan(meta: &Metadata) -> Vec<(f64, f64)> {
    meta.blobs
        .iter()
        .map(|b| match b.file.as_str() {
            "layer_000.bin" | "embed.bin" => (0.0, 0.0),
            _ => (0.5, 0.25),
        })
        .collect()
}

fn fraction(plan: &[(f64, f64)], blob: usize, rows: usize) -> f64 {
    let (decode, prefill) = plan[blob];
    if rows <= 4 { decode } else { prefill }
}

/// Rows and bytes each side computes in one pass of `rows` rows under `plan` (the LM head
/// counted only when `logits`), from the tensors' shapes: every 2-D tensor of a layer or
/// output blob is one matmul weight.
fn expected_pass(meta: &Metadata, plan: &[(f64, f64)], rows: usize, logits: bool) -> SplitCounts {
    let mut c = SplitCounts::default();
    for (i, blob) in meta.blobs.iter().enumerate() {
        let is_layer = blob.file.starts_with("layer_");
        let is_output = blob.file == "output.bin";
        if !(is_layer || (is_output && logits)) {
            continue;
        }
        let f = fraction(plan, i, if is_output { 1 } else { rows });
        let mut split = false;
        for t in blob.tensors.iter().filter(|t| t.shape.len() == 2) {
            let n = t.shape[0] as usize;
            let row_bytes = t.length / n as u64;
            let k = helper_rows(n, f);
            split |= k > 0;
            c.helper_rows += k as u64;
            c.helper_bytes += k as u64 * row_bytes;
            c.primary_rows += (n - k) as u64;
            c.primary_bytes += (n - k) as u64 * row_bytes;
        }
        if split {
            // Q/K/V, output, gate/up, down per layer; the head alone.
            c.splits += if is_layer { 4 } else { 1 };
        }
    }
    c
}

fn add(a: SplitCounts, b: SplitCounts) -> SplitCounts {
    SplitCounts {
        helper_rows: a.helper_rows + b.helper_rows,
        helper_bytes: a.helper_bytes + b.helper_bytes,
        primary_rows: a.primary_rows + b.primary_rows,
        primary_bytes: a.primary_bytes + b.primary_bytes,
        splits: a.splits + b.splits,
    }
}

/// A prompt of 9 tokens, then 4 decode steps of one token, on a single backend and on the
/// split; compares every step's logits and the split's counts with the plan.
fn split_matches_single<P, R>(dir: &Path, primary: P, reference: R, tolerance: f32, what: &str)
where
    P: SplitTarget,
    R: Backend,
{
    let model = Model::open(dir).unwrap();
    let meta = model.metadata().clone();
    let weights = InMemoryWeights::read_dir(dir, &meta).unwrap();
    let plan = plan(&meta);
    let shares = plan.clone();
    let split = SplitBackend::new(
        primary,
        CpuBackend::new(),
        Box::new(move |blob, rows| fraction(&shares, blob, rows)),
    );
    let stats = split.stats();
    let mut single = Llama::new(reference, weights.clone(), meta.clone(), CONTEXT, 16).unwrap();
    let mut hybrid = Llama::new(split, weights, meta.clone(), CONTEXT, 16).unwrap();

    let prompt: Vec<u32> = (0..9).map(|i| 5 + i * 37).collect();
    let mut expected = expected_pass(&meta, &plan, prompt.len(), true);
    let want = single.forward(&prompt).unwrap().to_vec();
    let got = hybrid.forward(&prompt).unwrap().to_vec();
    let mut worst = max_rel_diff(&got, &want);
    for step in 0..4u32 {
        let token = 7 + step * 101;
        let want = single.forward(&[token]).unwrap().to_vec();
        let got = hybrid.forward(&[token]).unwrap().to_vec();
        worst = worst.max(max_rel_diff(&got, &want));
        expected = add(expected, expected_pass(&meta, &plan, 1, true));
    }
    println!("{what}: max |split - single| / scale = {worst:.3e} (tolerance {tolerance:.0e})");
    assert!(worst <= tolerance, "{what}: {worst} > {tolerance}");
    let counts = stats.counts();
    println!("{what}: {counts:?}");
    assert_eq!(counts, expected, "{what}: rows and bytes per side");
    assert!(counts.helper_rows > 0 && counts.primary_rows > counts.helper_rows);

    // The time breakdown: one prefill of the prompt's rows and four one-row decode passes,
    // whose split calls and helper bytes add up to the counts.
    let times = stats.pass_times();
    println!("{what}: {times:?}");
    let rows: Vec<(usize, u64)> = times.iter().map(|(r, t)| (*r, t.passes)).collect();
    assert_eq!(rows, [(1, 4), (prompt.len(), 1)], "{what}: passes by rows");
    let splits: u64 = times.iter().map(|(_, t)| t.splits).sum();
    let bytes: u64 = times.iter().map(|(_, t)| t.helper_bytes).sum();
    assert_eq!(
        (splits, bytes),
        (counts.splits, counts.helper_bytes),
        "{what}"
    );
    for (rows, t) in &times {
        assert!(
            t.seconds > 0.0 && t.helper_seconds > 0.0 && t.helper_seconds <= t.seconds,
            "{what}, {rows} rows: {t:?}"
        );
    }
}

#[test]
fn cpu_split_with_cpu_gives_the_logits_of_one_cpu_backend() {
    for dtype in [DType::F16, DType::Q4_1, DType::F32] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        synth_model(&dir, dtype);
        split_matches_single(
            &dir,
            CpuBackend::new(),
            CpuBackend::new(),
            1e-6,
            &format!("cpu+cpu {dtype:?}"),
        );
    }
}

#[test]
fn reference_split_with_cpu_gives_the_reference_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth_model(&dir, DType::F16);
    split_matches_single(
        &dir,
        ReferenceBackend,
        ReferenceBackend,
        1e-3,
        "reference+cpu F16",
    );
}

/// Two sequences in one pass (rows of several sequences meet in the split's columns): each
/// sequence's logits are those of the single backend's batch.
#[test]
fn a_batch_of_two_sequences_splits_like_one_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth_model(&dir, DType::Q8_0);
    let model = Model::open(&dir).unwrap();
    let meta = model.metadata().clone();
    let weights = InMemoryWeights::read_dir(&dir, &meta).unwrap();
    let plan = plan(&meta);
    let shares = plan.clone();
    let split = SplitBackend::new(
        CpuBackend::new(),
        CpuBackend::new(),
        Box::new(move |blob, rows| fraction(&shares, blob, rows)),
    );
    let stats = split.stats();
    let mut single = Llama::new(
        CpuBackend::new(),
        weights.clone(),
        meta.clone(),
        CONTEXT,
        16,
    )
    .unwrap();
    let mut hybrid = Llama::new(split, weights, meta.clone(), CONTEXT, 16).unwrap();

    let prompts: [&[u32]; 2] = [&[3, 9, 27], &[11, 13]];
    let want = batch_logits(&mut single, &prompts);
    let got = batch_logits(&mut hybrid, &prompts);
    let diff = max_rel_diff(&got, &want);
    println!("batch of 2: max |split - single| / scale = {diff:.3e} (tolerance 1e-6)");
    assert!(diff <= 1e-6, "{diff}");
    // The 5 rows of the pass take the prefill share; the head's 2 rows the decode one.
    let layers = expected_pass(&meta, &plan, 5, false);
    let head = expected_pass(&meta, &plan, 1, true);
    let head_only = SplitCounts {
        helper_rows: head.helper_rows - expected_pass(&meta, &plan, 1, false).helper_rows,
        ..SplitCounts::default()
    };
    let counts = stats.counts();
    println!("batch of 2: {counts:?}");
    assert_eq!(
        counts.helper_rows,
        layers.helper_rows + head_only.helper_rows
    );
}

fn batch_logits<B: Backend>(model: &mut Llama<B, InMemoryWeights>, prompts: &[&[u32]]) -> Vec<f32> {
    let mut caches: Vec<_> = prompts
        .iter()
        .map(|_| model.new_kv_cache(CONTEXT).unwrap())
        .collect();
    let mut seqs: Vec<BatchSeq<'_, B>> = caches
        .iter_mut()
        .zip(prompts)
        .map(|(kv, tokens)| BatchSeq {
            kv,
            tokens,
            solo_rows: tokens.len(),
            logits: true,
        })
        .collect();
    model.forward_batch(&mut seqs).unwrap().to_vec()
}
