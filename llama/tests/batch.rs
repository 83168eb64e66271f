//! Batched decoding (issue 7): every sequence of a batch gives exactly the tokens it gives alone,
//! whatever it is batched with and whenever it joins; a pass streams the same bytes whatever
//! the batch size; the scheduler makes requests wait (never fail) when the KV budget is full,
//! frees a cancelled sequence's cache at once and keeps decoding while prompts are prefilled.

mod common;
#[cfg(feature = "cuda")]
mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gdsllm_convert::synth::{SynthOptions, SynthShape, synth};
use llama::{
    Backend, BatchConfig, Batcher, Choosing, CpuBackend, GenerateOptions, InMemoryWeights, Llama,
    SamplerConfig, Scores, SeqEnd, SeqId, Session, Tokenizer, WeightSource, generate_batch,
};
use residency::{HostCache, Residency, ResidencyOptions};
use weights_format::{DType, Model};

/// A small model with random weights: tiny logit margins, so any difference in rounding
/// between a batch and a sequence alone would show up as a different token.
fn synth_model(dir: &Path, dtype: DType, tied: bool) {
    synth_layers(dir, dtype, tied, 3)
}

fn synth_layers(dir: &Path, dtype: DType, tied: bool, n_layers: u32) {
    let shape = SynthShape {
        tie_word_embeddings: tied,
        ..SynthShape::new(n_layers, 128, 320, 4, 2, 512, 256)
    };
    let opts = SynthOptions {
        shape,
        dtype,
        seed: 11,
        threads: 1,
        shape_name: "batch-test".into(),
    };
    synth(dir, &opts, &mut |_| {}).expect("synth");
}

fn in_memory(dir: &Path, context: usize, max_rows: usize) -> Llama<CpuBackend, InMemoryWeights> {
    let model = Model::open(dir).unwrap();
    let meta = model.metadata().clone();
    let weights = InMemoryWeights::read_dir(dir, &meta).unwrap();
    Llama::new(CpuBackend::new(), weights, meta, context, max_rows).unwrap()
}

/// `check` on the in-memory CPU model of each synthetic `(dtype, tied)` case, labelled
/// `cpu {dtype} tied={tied}`.
fn on_cpu_models(
    cases: &[(DType, bool)],
    mut check: impl FnMut(&mut Llama<CpuBackend, InMemoryWeights>, &str),
) {
    let tmp = tempfile::tempdir().unwrap();
    for &(dtype, tied) in cases {
        let dir = tmp.path().join(format!("{dtype}-{tied}"));
        synth_model(&dir, dtype, tied);
        check(
            &mut in_memory(&dir, 256, 256),
            &format!("cpu {dtype} tied={tied}"),
        );
    }
}

/// A synthetic model in a temporary directory (kept while the first value lives), in memory.
fn synth_in_memory(
    name: &str,
    dtype: DType,
    tied: bool,
) -> (tempfile::TempDir, Llama<CpuBackend, InMemoryWeights>) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    synth_model(&dir, dtype, tied);
    let model = in_memory(&dir, 256, 256);
    (tmp, model)
}

/// First index of the largest logit.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy tokens of `prompt` alone, the way `Session::generate` drives the model: the whole
/// prompt in one pass, then one pass per token.
fn solo_greedy<B: Backend, W: WeightSource>(
    model: &mut Llama<B, W>,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    model.truncate(0);
    let mut logits = model.forward(prompt).unwrap().to_vec();
    let mut out = Vec::new();
    loop {
        let t = argmax(&logits);
        out.push(t);
        if out.len() == n {
            return out;
        }
        logits = model.forward(&[t]).unwrap().to_vec();
    }
}

/// Each request's greedy tokens alone on `model`.
fn solo_runs<B: Backend, W: WeightSource>(model: &mut Llama<B, W>, reqs: &[Req]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| solo_greedy(model, &r.prompt, r.max_new))
        .collect()
}

/// The batcher of the ragged workloads: 4 sequences at a time, prefill chunks of 8.
fn ragged_config<B: Backend, W: WeightSource>(model: &Llama<B, W>) -> BatchConfig {
    BatchConfig {
        max_batch: 4,
        prefill_chunk: 8,
        ..BatchConfig::for_model(model, 4)
    }
}

fn prompt(seed: u32, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (seed * 131 + i * 7919) % (vocab - 3))
        .collect()
}

/// A request of the ragged workload: arrives before step `at`.
struct Req {
    at: usize,
    prompt: Vec<u32>,
    max_new: usize,
}

/// Runs `reqs` through a batcher with greedy sampling; returns each request's tokens and how
/// it ended, and the most sequences seen running at once.
fn run_batched<B: Backend, W: WeightSource>(
    model: &mut Llama<B, W>,
    config: BatchConfig,
    reqs: &[Req],
) -> (Vec<(Vec<u32>, SeqEnd)>, usize) {
    run_batched_seeing_logits(model, config, reqs, |_, _| {})
}

/// [`run_batched`] with every request submitted as [`Choosing::Greedy`]: each step must hand
/// over the greedy ids the backend took ([`Scores::Greedy`]), never the logits.
fn run_batched_greedy_ids<B: Backend, W: WeightSource>(
    model: &mut Llama<B, W>,
    config: BatchConfig,
    reqs: &[Req],
) -> (Vec<(Vec<u32>, SeqEnd)>, usize) {
    let batcher = Batcher::new(model, config).unwrap();
    let (out, most, _) = run_choosing(batcher, model, reqs, Choosing::Greedy, |_, _| {});
    (out, most)
}

/// [`run_batched`], showing `seen` each request's logits (request index, logits) as sampled.
fn run_batched_seeing_logits<B: Backend, W: WeightSource>(
    model: &mut Llama<B, W>,
    config: BatchConfig,
    reqs: &[Req],
    seen: impl FnMut(usize, &[f32]),
) -> (Vec<(Vec<u32>, SeqEnd)>, usize) {
    let batcher = Batcher::new(model, config).unwrap();
    let (out, most, _) = run_on(batcher, model, reqs, seen);
    (out, most)
}

/// [`run_batched_seeing_logits`] on a given batcher, returned at the end.
#[allow(clippy::type_complexity)]
fn run_on<B: Backend, W: WeightSource>(
    batcher: Batcher<B>,
    model: &mut Llama<B, W>,
    reqs: &[Req],
    seen: impl FnMut(usize, &[f32]),
) -> (Vec<(Vec<u32>, SeqEnd)>, usize, Batcher<B>) {
    run_choosing(batcher, model, reqs, Choosing::FromLogits, seen)
}

/// [`run_on`] with the requests submitted as `choosing` says (`seen` sees the logits only
/// when they are handed over).
#[allow(clippy::type_complexity)]
fn run_choosing<B: Backend, W: WeightSource>(
    mut batcher: Batcher<B>,
    model: &mut Llama<B, W>,
    reqs: &[Req],
    choosing: Choosing,
    mut seen: impl FnMut(usize, &[f32]),
) -> (Vec<(Vec<u32>, SeqEnd)>, usize, Batcher<B>) {
    let mut ids: HashMap<SeqId, usize> = HashMap::new();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
    let mut ends: Vec<Option<SeqEnd>> = vec![None; reqs.len()];
    let mut most = 0;
    let mut step = 0;
    while ends.iter().any(Option::is_none) {
        for (i, r) in reqs.iter().enumerate() {
            if r.at == step {
                let id = batcher
                    .submit_choosing(r.prompt.clone(), r.max_new, choosing)
                    .unwrap();
                ids.insert(id, i);
            }
        }
        let finished = batcher
            .step(model, |id, scores| {
                let t = match scores {
                    Scores::Logits(logits) => {
                        assert_eq!(choosing, Choosing::FromLogits, "logits for greedy ids");
                        seen(ids[&id], logits);
                        argmax(logits)
                    }
                    Scores::Greedy(t) => {
                        assert_eq!(choosing, Choosing::Greedy, "greedy ids for logits");
                        t
                    }
                };
                tokens[ids[&id]].push(t);
                Some(t)
            })
            .unwrap();
        most = most.max(batcher.running() + finished.len());
        for f in finished {
            assert!(ends[ids[&f.id]].replace(f.end).is_none(), "ended twice");
        }
        step += 1;
        assert!(step < 10_000, "the batch never finished");
    }
    let out = tokens
        .into_iter()
        .zip(ends)
        .map(|(t, e)| (t, e.unwrap()))
        .collect();
    (out, most, batcher)
}

fn ragged_requests(vocab: u32) -> Vec<Req> {
    // Prompt lengths on both sides of the CPU kernel's 4-row threshold and longer than the
    // prefill chunk; different lengths of output; arrivals while others run.
    [
        (0, 1, 12),
        (0, 3, 7),
        (0, 23, 15),
        (2, 4, 5),
        (3, 9, 10),
        (5, 40, 9),
        (9, 2, 6),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (at, len, max_new))| Req {
        at,
        prompt: prompt(i as u32, len, vocab),
        max_new,
    })
    .collect()
}

/// Every sequence of a batch ran to its length and gave exactly its tokens alone.
fn assert_tokens_as_alone(batched: &[(Vec<u32>, SeqEnd)], solo: &[Vec<u32>], label: &str) {
    for (i, ((tokens, end), want)) in batched.iter().zip(solo).enumerate() {
        assert_eq!(*end, SeqEnd::Length, "{label}: sequence {i}");
        assert_eq!(tokens, want, "{label}: sequence {i} differs from alone");
    }
}

/// The ragged workload through a batcher (4 at a time, prefill chunks of 8) against each
/// request alone on the same model.
fn ragged_batch_equals_solo<B: Backend, W: WeightSource>(model: &mut Llama<B, W>, label: &str) {
    let vocab = model.config().vocab_size as u32;
    let reqs = ragged_requests(vocab);
    let solo = solo_runs(model, &reqs);
    let config = ragged_config(model);
    let (batched, most) = run_batched(model, config, &reqs);
    println!("{label}: up to {most} sequences per pass");
    assert!(most >= 3, "the sequences did not overlap");
    assert_tokens_as_alone(&batched, &solo, label);
    // The same with the backend taking the argmax (`Choosing::Greedy`).
    let (by_ids, _) = run_batched_greedy_ids(model, config, &reqs);
    assert_tokens_as_alone(&by_ids, &solo, &format!("{label} (greedy ids)"));
    println!("{label}: the greedy ids the backend took gave the same tokens");
}

#[test]
fn batched_greedy_equals_solo_for_ragged_sequences_that_join_late() {
    on_cpu_models(
        &[
            (DType::Q4_1, true),
            (DType::Q8_0, false),
            (DType::F16, true),
        ],
        ragged_batch_equals_solo,
    );
}

#[test]
fn batched_greedy_equals_solo_for_a_q4_k_m_mix() {
    // The k-quant kernels on 8-bit activations (four weight rows at a time where the task
    // boundaries allow): a sequence's tokens must not depend on what it is batched with.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("q4km");
    let config = gdsllm_convert::testing::small_kquant_config(3);
    gdsllm_convert::testing::write_q4_k_m_model(&dir, &config, 0.05, 3).unwrap();
    ragged_batch_equals_solo(&mut in_memory(&dir, 256, 256), "cpu q4_k_m mix");
}

/// The top logit's index and its margin over the second.
#[cfg(feature = "cuda")]
fn top2(logits: &[f32]) -> (u32, f32) {
    let best = argmax(logits);
    let second = logits
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u32 != best)
        .map(|(_, l)| *l)
        .fold(f32::NEG_INFINITY, f32::max);
    (best, logits[best as usize] - second)
}

/// The ragged workload batched (4 at a time, prefill chunks of 8), recording every step's
/// logits and greedy token, against each request alone fed the tokens the batch chose: at every
/// step the logits within `tol` relative L2 error of the solo ones, and the batch's greedy token
/// the solo argmax wherever the solo top-2 margin is at least 0.05 (issue 23: a batched row may
/// differ from its solo run in rounding, not in any token that is not a near tie).
#[cfg(feature = "cuda")]
fn ragged_batch_close_to_solo<B: Backend, W: WeightSource>(
    model: &mut Llama<B, W>,
    label: &str,
    tol: f32,
) {
    let vocab = model.config().vocab_size as u32;
    let reqs = ragged_requests(vocab);
    let config = ragged_config(model);
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); reqs.len()];
    let (batched, most) =
        run_batched_seeing_logits(model, config, &reqs, |i, l| logits[i].push(l.to_vec()));
    assert!(most >= 3, "{label}: the sequences did not overlap");
    let (mut worst, mut compared, mut decided) = (0f32, 0, 0);
    for (i, r) in reqs.iter().enumerate() {
        model.truncate(0);
        let mut solo = model.forward(&r.prompt).unwrap().to_vec();
        let (tokens, end) = &batched[i];
        assert_eq!(*end, SeqEnd::Length, "{label}: sequence {i}");
        assert_eq!(logits[i].len(), tokens.len(), "{label}: sequence {i}");
        for (s, (step_logits, token)) in logits[i].iter().zip(tokens).enumerate() {
            let err = solo
                .iter()
                .zip(step_logits)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
                .sqrt()
                / solo.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
            let err = err as f32;
            worst = worst.max(err);
            compared += 1;
            assert!(
                err <= tol,
                "{label}: sequence {i} step {s}: logits {err:.2e} (relative L2) from alone, tol {tol:.0e}"
            );
            let (best, margin) = top2(&solo);
            if margin >= 0.05 {
                decided += 1;
                assert_eq!(
                    *token, best,
                    "{label}: sequence {i} step {s}: greedy token differs from alone (margin {margin:.3})"
                );
            }
            solo = model.forward(&[*token]).unwrap().to_vec();
        }
    }
    println!(
        "{label}: {compared} steps, logits at most {worst:.2e} relative L2 from alone (tol {tol:.0e}); \
         greedy tokens equal at all {decided} steps with a top-2 margin >= 0.05"
    );
    // The same batches with the backend taking the argmax: the same logits, so the same
    // tokens, near ties included.
    let (by_ids, _) = run_batched_greedy_ids(model, config, &reqs);
    for (i, ((tokens, _), (want, _))) in by_ids.iter().zip(&batched).enumerate() {
        assert_eq!(
            tokens, want,
            "{label}: sequence {i}: the greedy ids differ from the argmax of the logits"
        );
    }
    println!("{label}: the greedy ids the backend took equal the host's argmax at every step");
}

/// The same on the CUDA backend (weights resident). With no new kernel path (`CudaPaths::none`) every row of
/// a batch is computed as alone, bit for bit; with the new ones (issue 23: tensor-core batched
/// matmuls, one launch for a batch's attention steps, flash attention for prompts) the logits
/// stay within 1e-3 relative L2 of alone and the greedy tokens agree wherever the margin is
/// >= 0.05. Opt-in like `cuda_ops`: `GDSLLM_GPU_TESTS=1` and the `cuda` feature (`cargo test
/// -p llama --features cuda --test batch cuda`).
#[cfg(feature = "cuda")]
#[test]
fn cuda_batched_greedy_equals_solo_for_ragged_sequences_that_join_late() {
    if !support::cuda::enabled() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (dtype, tied) in [
        (DType::Q4_1, true),
        (DType::F16, false),
        (DType::Q8_0, true),
    ] {
        let dir = tmp.path().join(format!("{dtype}-{tied}"));
        synth_model(&dir, dtype, tied);
        cuda_ragged_batches_match_solo(&dir, 256, &format!("cuda {dtype} tied={tied}"));
    }
    // A Q4_K_M mix (q4_k, q6_k and the 32-value types it uses): bit for bit alone with no new
    // path, and with all of them its batched matmuls on the tensor cores of `kquants_mma.cu`,
    // within the tolerance above.
    let dir = tmp.path().join("q4km");
    let config = gdsllm_convert::testing::small_kquant_config(3);
    gdsllm_convert::testing::write_q4_k_m_model(&dir, &config, 0.05, 3).unwrap();
    cuda_ragged_batches_match_solo(&dir, 256, "cuda q4_k_m mix");
}

/// Several prompts long enough for cuBLAS prefilled in one step (each quantized weight converted
/// to f16 once for all of their GEMMs, and each prompt's x rounded to f16 once for all the
/// weights that read it): every sequence's greedy tokens exactly its tokens alone, on the
/// kernels whose batched rows equal their solo rows (`CudaPaths::none`). Opt-in as above.
#[cfg(feature = "cuda")]
#[test]
fn cuda_prompts_prefilled_in_one_step_equal_solo() {
    use llama::backend::cuda::CudaPaths;
    if !support::cuda::enabled() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for dtype in [DType::Q4_1, DType::Q8_0] {
        let dir = tmp.path().join(format!("{dtype}"));
        synth_model(&dir, dtype, true);
        let be = llama::CudaBackend::with_paths(0, CudaPaths::none()).unwrap();
        let mut model = llama::load::open_uploaded_on(&dir, be, 256).unwrap();
        let vocab = model.config().vocab_size as u32;
        // Every prompt past `CUBLAS_MIN_ROWS` (16), all arriving at once, one step's chunk for
        // all of them.
        let reqs: Vec<Req> = [20, 17, 33]
            .into_iter()
            .enumerate()
            .map(|(i, len)| Req {
                at: 0,
                prompt: prompt(40 + i as u32, len, vocab),
                max_new: 6,
            })
            .collect();
        let solo = solo_runs(&mut model, &reqs);
        let config = BatchConfig {
            max_batch: 4,
            prefill_chunk: 96,
            ..BatchConfig::for_model(&model, 4)
        };
        let (batched, most) = run_batched(&mut model, config, &reqs);
        assert_eq!(most, 3, "{dtype}: the prompts did not share a step");
        assert_tokens_as_alone(&batched, &solo, &format!("cuda {dtype}"));
        println!("cuda {dtype}: 3 prompts of 17-33 tokens prefilled in one step, tokens as alone");
    }
}

/// The ragged workload on CUDA on the model at `dir` (a context of `context`): each sequence's
/// tokens alone with the default kernel paths, and close to alone with all the new ones.
#[cfg(feature = "cuda")]
fn cuda_ragged_batches_match_solo(dir: &Path, context: usize, label: &str) {
    use llama::backend::cuda::CudaPaths;
    let be = llama::CudaBackend::with_paths(0, CudaPaths::none()).unwrap();
    let mut model = llama::load::open_uploaded_on(dir, be, context).unwrap();
    ragged_batch_equals_solo(&mut model, label);
    drop(model);
    let be = llama::CudaBackend::with_paths(0, CudaPaths::all()).unwrap();
    let mut model = llama::load::open_uploaded_on(dir, be, context).unwrap();
    ragged_batch_close_to_solo(
        &mut model,
        &format!("{label}, paths {}", CudaPaths::all()),
        1e-3,
    );
}

/// A sequence alone in the batcher decodes through the recorded pass of one sequence (its
/// cache named by its number, `PassInfo::sequence`), as `Llama::forward` does: two requests one
/// after the other (the second with a cache of its own, so a recording of its own; prompts of
/// at most one prefill chunk, so that they are computed as alone), each
/// giving exactly its tokens alone, and most of their decode steps replayed. Opt-in as above
/// (`cargo test -p llama --features cuda --test batch cuda`).
#[cfg(feature = "cuda")]
#[test]
fn cuda_a_lone_batched_sequence_replays_its_decode_steps() {
    if !support::cuda::enabled() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (dtype, tied) in [(DType::Q4_1, true), (DType::F16, false)] {
        let dir = tmp.path().join(format!("{dtype}-{tied}"));
        synth_model(&dir, dtype, tied);
        let be = llama::CudaBackend::new(0).unwrap();
        let mut model = llama::load::open_uploaded_on(&dir, be, 256).unwrap();
        let vocab = model.config().vocab_size as u32;
        let reqs: Vec<Req> = [(0, 5, 40), (45, 7, 40)]
            .into_iter()
            .enumerate()
            .map(|(i, (at, len, max_new))| Req {
                at,
                prompt: prompt(20 + i as u32, len, vocab),
                max_new,
            })
            .collect();
        let solo = solo_runs(&mut model, &reqs);
        let before = model.backend().step_replays();
        let config = ragged_config(&model);
        let (batched, most) = run_batched(&mut model, config, &reqs);
        let replayed = model.backend().step_replays() - before;
        let label = format!("cuda {dtype} tied={tied}, one sequence at a time");
        println!("{label}: {replayed} of 80 decode steps replayed from a recording");
        assert_eq!(most, 1, "{label}: the requests overlapped");
        assert_tokens_as_alone(&batched, &solo, &label);
        assert!(
            replayed >= 60,
            "{label}: only {replayed} decode steps were replayed"
        );
    }
}

/// A windowed family on CUDA (support::families' gemma3: window 8, rings of 16 slots, Q/K
/// head norms, post-norms, the GeLU gate, a soft-cap): the ragged workload, prompts of up to 40
/// tokens and outputs past the window, gives each sequence its tokens alone with the default
/// kernel paths, and stays close to alone (as above) with the new ones. Opt-in as above
/// (`cargo test -p llama --features cuda --test batch cuda`).
#[cfg(feature = "cuda")]
#[test]
fn cuda_windowed_family_batched_equals_solo() {
    if !support::cuda::enabled() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = support::families::write_named(tmp.path(), "gemma3", DType::Q4_1);
    // The new paths send the windowed layers (ring caches) to the kernels that know windows,
    // the global ones to the one-launch kernels.
    cuda_ragged_batches_match_solo(&dir, 128, "cuda gemma3 q4_1 (window 8)");
}

/// Total weight bytes residency has brought in, once its reader has stopped (the ring is full
/// of the next pass's blobs), so that a window between two calls covers whole passes.
fn settled_bytes(r: &Residency) -> u64 {
    let total = |r: &Residency| {
        let t = r.stats().total;
        t.disk_bytes + t.host_copy_bytes + t.on_demand_bytes
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = total(r);
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = total(r);
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

#[test]
fn bytes_streamed_per_decode_step_do_not_grow_with_the_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("streamed");
    // More layers than the staging ring has slots, so every pass reads every layer again; a
    // tied embedding table is one blob per pass (an untied one is read row by row, 80 bytes
    // per token here, which is per token by nature).
    synth_layers(&dir, DType::Q4_1, true, 8);
    let options = ResidencyOptions {
        resident_layers: Some(0),
        host_cache: HostCache::Off,
        ..ResidencyOptions::default()
    };
    let steps = 6;
    let mut per_step = Vec::new();
    for batch in [1usize, 4, 8] {
        let model_files = Model::open(&dir).unwrap();
        let residency = Residency::open_host(&model_files, &options).unwrap();
        assert_eq!(residency.plan().resident_layers, 0);
        let meta = model_files.metadata().clone();
        let mut model = Llama::new(CpuBackend::new(), residency, meta, 64, 64).unwrap();
        let vocab = model.config().vocab_size as u32;
        let mut batcher = Batcher::new(&model, BatchConfig::for_model(&model, batch)).unwrap();
        for i in 0..batch {
            batcher.submit(prompt(i as u32, 5, vocab), 40).unwrap();
        }
        // The first step prefills every prompt; from then on each step decodes every sequence.
        batcher.step(&mut model, |_, s| Some(s.greedy())).unwrap();
        let before = settled_bytes(model.weights());
        let mut tokens = 0;
        for _ in 0..steps {
            let ended = batcher
                .step(&mut model, |_, s| {
                    tokens += 1;
                    Some(s.greedy())
                })
                .unwrap();
            assert!(ended.is_empty());
        }
        let bytes = settled_bytes(model.weights()) - before;
        assert_eq!(tokens, batch * steps);
        println!(
            "batch {batch}: {} bytes streamed per decode step, {} per generated token",
            bytes / steps as u64,
            bytes / tokens as u64
        );
        per_step.push(bytes / steps as u64);
    }
    assert!(per_step[0] > 0, "nothing was streamed");
    assert!(
        per_step.iter().all(|&b| b == per_step[0]),
        "bytes per step changed with the batch size: {per_step:?}"
    );
}

#[test]
fn kv_budget_exhaustion_makes_requests_wait_and_they_complete_later() {
    let (_tmp, mut model) = synth_in_memory("budget", DType::Q4_1, true);
    let vocab = model.config().vocab_size as u32;
    // Five requests of 10 + 8 - 1 = 17 positions each; room for two at a time.
    let reqs: Vec<Req> = (0..5)
        .map(|i| Req {
            at: 0,
            prompt: prompt(i, 10, vocab),
            max_new: 8,
        })
        .collect();
    let per_seq = model.kv_cache_bytes(17);
    let config = BatchConfig {
        max_batch: 8,
        prefill_chunk: 64,
        kv_budget: 2 * per_seq + per_seq / 2,
    };
    let mut batcher = Batcher::new(&model, config).unwrap();
    for r in &reqs {
        batcher.submit(r.prompt.clone(), r.max_new).unwrap();
    }
    batcher.step(&mut model, |_, s| Some(s.greedy())).unwrap();
    assert_eq!((batcher.running(), batcher.waiting()), (2, 3));
    assert_eq!(batcher.kv_used(), 2 * per_seq);
    drop(batcher);

    let solo: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| solo_greedy(&mut model, &r.prompt, r.max_new))
        .collect();
    let (batched, most) = run_batched(&mut model, config, &reqs);
    assert_eq!(most, 2, "the budget admits two at a time");
    assert_tokens_as_alone(&batched, &solo, "kv budget");

    // A request that could never fit is refused at once; the others are not disturbed.
    let mut batcher = Batcher::new(&model, config).unwrap();
    let err = batcher.submit(prompt(9, 10, vocab), 200).unwrap_err();
    assert!(matches!(err, llama::LlamaError::KvBudget { .. }), "{err}");
    assert!(err.to_string().contains("KV budget"), "{err}");
    assert!(batcher.submit(Vec::new(), 4).is_err());
    assert!(batcher.submit(vec![vocab], 4).is_err());
    assert!(batcher.submit(prompt(1, 300, vocab), 4).is_err());
    assert!(batcher.is_idle());
}

#[test]
fn cancelling_a_sequence_frees_its_kv_at_once_and_lets_the_next_in() {
    let (_tmp, mut model) = synth_in_memory("cancel", DType::Q8_0, true);
    let vocab = model.config().vocab_size as u32;
    let per_seq = model.kv_cache_bytes(12 + 20 - 1);
    let config = BatchConfig {
        max_batch: 8,
        prefill_chunk: 64,
        kv_budget: 2 * per_seq,
    };
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(i, 12, vocab)).collect();
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| solo_greedy(&mut model, p, 20))
        .collect();
    let mut batcher = Batcher::new(&model, config).unwrap();
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| batcher.submit(p.clone(), 20).unwrap())
        .collect();
    let mut tokens: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut greedy = |batcher: &mut Batcher<CpuBackend>, model: &mut Llama<_, _>| {
        batcher
            .step(model, |id, s| {
                let t = s.greedy();
                tokens.entry(id).or_default().push(t);
                Some(t)
            })
            .unwrap()
    };
    for _ in 0..3 {
        assert!(greedy(&mut batcher, &mut model).is_empty());
    }
    assert_eq!((batcher.running(), batcher.waiting()), (2, 1));
    assert_eq!(batcher.kv_used(), 2 * per_seq);

    // Cancelling the first frees its cache before any further step.
    assert!(batcher.cancel(ids[0]));
    assert_eq!(batcher.kv_used(), per_seq);
    assert_eq!((batcher.running(), batcher.waiting()), (1, 1));
    assert!(!batcher.cancel(ids[0]), "cancelled twice");

    let mut ended = HashMap::new();
    while !batcher.is_idle() {
        for f in greedy(&mut batcher, &mut model) {
            ended.insert(f.id, f.end);
        }
        assert!(batcher.kv_used() <= config.kv_budget);
    }
    assert_eq!(batcher.kv_used(), 0);
    assert!(
        !ended.contains_key(&ids[0]),
        "a cancelled sequence is not reported"
    );
    assert_eq!(tokens[&ids[0]].len(), 3);
    assert_eq!(tokens[&ids[0]][..], solo[0][..3]);
    for i in 1..3 {
        assert_eq!(ended[&ids[i]], SeqEnd::Length);
        assert_eq!(tokens[&ids[i]], solo[i], "sequence {i}");
    }
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_while_running_sequences_keep_decoding() {
    let (_tmp, mut model) = synth_in_memory("chunks", DType::Q4_1, true);
    let vocab = model.config().vocab_size as u32;
    let short = prompt(1, 6, vocab);
    let long = prompt(2, 100, vocab);
    let solo_short = solo_greedy(&mut model, &short, 30);
    let solo_long = solo_greedy(&mut model, &long, 5);
    let config = BatchConfig {
        max_batch: 4,
        prefill_chunk: 16,
        ..BatchConfig::for_model(&model, 4)
    };
    let mut batcher = Batcher::new(&model, config).unwrap();
    let a = batcher.submit(short, 30).unwrap();
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut step = |batcher: &mut Batcher<CpuBackend>, model: &mut Llama<_, _>| {
        let mut this: HashMap<SeqId, usize> = HashMap::new();
        batcher
            .step(model, |id, s| {
                let t = s.greedy();
                got.entry(id).or_default().push(t);
                *this.entry(id).or_default() += 1;
                Some(t)
            })
            .unwrap();
        this
    };
    step(&mut batcher, &mut model);
    let b = batcher.submit(long, 5).unwrap();
    // 100 prompt tokens in chunks of 16 take 7 steps; the short sequence gets a token in each.
    let mut steps_to_first = 0;
    loop {
        let this = step(&mut batcher, &mut model);
        steps_to_first += 1;
        assert_eq!(this.get(&a), Some(&1), "the running sequence was held back");
        if this.contains_key(&b) {
            break;
        }
    }
    assert_eq!(steps_to_first, 100usize.div_ceil(16));
    while !batcher.is_idle() {
        step(&mut batcher, &mut model);
    }
    assert_eq!(got[&a], solo_short);
    assert_eq!(got[&b], solo_long);
}

fn tokenizer(dir: &Path) -> Tokenizer {
    let model = Model::open(dir).unwrap();
    Tokenizer::from_file(dir.join(&model.metadata().tokenizer)).unwrap()
}

fn greedy_options(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: n,
        sampler: SamplerConfig::greedy(),
        stop: Vec::new(),
    }
}

/// `generate_batch` against `Session::generate` on the same prompts one at a time: tokens,
/// text and finish reason.
fn batch_equals_session(
    dir: &Path,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
    config_batch: usize,
) {
    let mut session = Session::new(in_memory(dir, 256, 256), tokenizer(dir));
    let alone: Vec<_> = prompts
        .iter()
        .map(|p| session.generate(p, options, |_| {}).unwrap())
        .collect();
    let tokenizer = tokenizer(dir);
    let mut model = in_memory(dir, 256, 256);
    let config = BatchConfig {
        prefill_chunk: 7,
        ..BatchConfig::for_model(&model, config_batch)
    };
    let mut streamed = vec![String::new(); prompts.len()];
    let batched = generate_batch(
        &mut model,
        &tokenizer,
        prompts,
        options,
        config,
        |i, piece| streamed[i].push_str(piece),
    )
    .unwrap();
    for (i, (b, a)) in batched.iter().zip(&alone).enumerate() {
        println!("prompt {i}: {:?} ({:?})", b.text, b.finish_reason);
        assert_eq!(b.tokens, a.tokens, "prompt {i}");
        assert_eq!(b.text, a.text, "prompt {i}");
        assert_eq!(streamed[i], a.text, "prompt {i} streamed");
        assert_eq!(b.finish_reason, a.finish_reason, "prompt {i}");
        assert_eq!(b.prompt_tokens, prompts[i]);
    }
}

#[test]
fn generate_batch_equals_session_on_a_synthetic_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("text");
    synth_model(&dir, DType::Q4_1, true);
    let vocab = 512;
    let prompts: Vec<Vec<u32>> = [2usize, 17, 5, 30, 1]
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(i as u32 + 20, n, vocab))
        .collect();
    batch_equals_session(&dir, &prompts, &greedy_options(10), 3);
    // Seeded sampling too: each sequence has its own sampler with the same seed.
    let sampled = GenerateOptions {
        sampler: SamplerConfig {
            temperature: 0.9,
            seed: 5,
            ..SamplerConfig::greedy()
        },
        ..greedy_options(10)
    };
    batch_equals_session(&dir, &prompts, &sampled, 5);
}

/// `Llama::forward_greedy` (the backend's argmax of each step) gives the tokens of the argmax of
/// `forward`'s logits, a prompt longer than one pass included, and leaves no stale logits.
#[test]
fn forward_greedy_equals_the_argmax_of_forward() {
    let tmp = tempfile::tempdir().unwrap();
    for (dtype, tied) in [(DType::Q4_1, true), (DType::F16, false)] {
        let dir = tmp.path().join(format!("{dtype}-{tied}"));
        synth_model(&dir, dtype, tied);
        // Passes of at most 16 rows, so that a 21-token prompt takes two.
        let model = &mut in_memory(&dir, 256, 16);
        let label = format!("cpu {dtype} tied={tied}");
        let vocab = model.config().vocab_size as u32;
        let long = prompt(3, model.max_rows_per_sequence() + 5, vocab);
        for p in [prompt(1, 1, vocab), prompt(2, 9, vocab), long] {
            model.truncate(0);
            let mut want = vec![argmax(model.forward(&p).unwrap())];
            for _ in 0..12 {
                let t = *want.last().unwrap();
                want.push(argmax(model.forward(&[t]).unwrap()));
            }
            model.truncate(0);
            let mut got = vec![model.forward_greedy(&p).unwrap()];
            for _ in 0..12 {
                let t = *got.last().unwrap();
                got.push(model.forward_greedy(&[t]).unwrap());
            }
            assert_eq!(got, want, "{label}: prompt of {}", p.len());
            assert!(model.last_logits().is_empty(), "{label}: stale logits");
        }
        assert!(model.forward_greedy(&[]).is_err(), "{label}: no tokens");
    }
}

#[test]
fn smollm2_batch_equals_each_prompt_alone() {
    let Some(dir) = common::model_dir() else {
        return;
    };
    let dir: PathBuf = dir;
    let golden = common::golden();
    let tokenizer = tokenizer(&dir);
    let mut prompts: Vec<Vec<u32>> = golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| common::ids(&c["input_ids"]))
        .collect();
    prompts.push(
        tokenizer
            .encode("Once upon a time, in a land far away,")
            .unwrap(),
    );
    prompts.push(tokenizer.encode("1, 2, 3,").unwrap());
    let options = GenerateOptions {
        stop: vec!["\n\n".into()],
        ..greedy_options(16)
    };
    batch_equals_session(&dir, &prompts, &options, 4);
}

/// Prefix caching (issue 19): prompts sharing a 48-token prefix, arriving while others run and
/// after they ended, give exactly their tokens alone, and the cache served the shared
/// positions (3 whole blocks each time); a prompt shorter than a block is never served.
fn prefix_cache_changes_no_token<B: Backend, W: WeightSource>(
    model: &mut Llama<B, W>,
    label: &str,
) {
    let vocab = model.config().vocab_size as u32;
    let shared = prompt(40, 48, vocab);
    let with = |seed: u32, len: usize| [shared.clone(), prompt(seed, len, vocab)].concat();
    let reqs = vec![
        Req {
            at: 0,
            prompt: with(1, 10),
            max_new: 6,
        },
        Req {
            at: 0,
            prompt: prompt(2, 5, vocab),
            max_new: 4,
        },
        // Joins while the first decodes, after its prompt was cached.
        Req {
            at: 12,
            prompt: with(3, 30),
            max_new: 7,
        },
        // The first prompt again, after both ended.
        Req {
            at: 40,
            prompt: with(1, 10),
            max_new: 6,
        },
    ];
    let solo = solo_runs(model, &reqs);
    let config = ragged_config(model);
    let batcher = Batcher::new(model, config)
        .unwrap()
        .with_prefix_cache(64 << 20);
    let (batched, _, batcher) = run_on(batcher, model, &reqs, |_, _| {});
    for (i, ((tokens, _), want)) in batched.iter().zip(&solo).enumerate() {
        assert_eq!(
            tokens, want,
            "{label}: sequence {i} differs with the prefix cache"
        );
    }
    let stats = batcher.prefix_cache_stats().unwrap();
    println!("{label}: {stats:?}");
    let queried: usize = reqs.iter().map(|r| r.prompt.len()).sum();
    assert_eq!(stats.queried_tokens, queried as u64, "{label}");
    assert_eq!(stats.hit_tokens, 2 * 48, "{label}");
    assert!(stats.bytes <= stats.budget, "{label}: {stats:?}");
}

#[test]
fn prefix_cached_greedy_equals_solo() {
    on_cpu_models(
        &[(DType::Q8_0, false), (DType::F16, true)],
        prefix_cache_changes_no_token,
    );
}

/// A budget of one entry keeps the most recently stored prefix and evicts the other.
#[test]
fn prefix_cache_evicts_the_least_recently_used_entry_within_its_budget() {
    let (_tmp, mut model) = synth_in_memory("lru", DType::Q8_0, true);
    let vocab = model.config().vocab_size as u32;
    let (a, b) = (prompt(7, 40, vocab), prompt(8, 40, vocab));
    let one_entry = model.kv_cache_bytes(32);
    let reqs = |at: usize, p: &Vec<u32>| Req {
        at,
        prompt: p.clone(),
        max_new: 2,
    };
    let config = BatchConfig::for_model(&model, 2);
    let batcher = Batcher::new(&model, config)
        .unwrap()
        .with_prefix_cache(one_entry);
    // a, then b (evicting a), then b again (a hit) and a again (a miss).
    let order = [reqs(0, &a), reqs(10, &b), reqs(20, &b), reqs(30, &a)];
    let (_, _, batcher) = run_on(batcher, &mut model, &order, |_, _| {});
    let stats = batcher.prefix_cache_stats().unwrap();
    assert_eq!(stats.hit_tokens, 32, "{stats:?}");
    assert_eq!(stats.entries, 1, "{stats:?}");
    assert_eq!(stats.bytes, one_entry, "{stats:?}");
}

/// [`prefix_cached_greedy_equals_solo`] on the GPU: the cached positions are copied between
/// f16 device caches and the prompts are wider than cuBLAS's row threshold. Opt-in
/// (`GDSLLM_GPU_TESTS=1 cargo test -p llama --features cuda --test batch prefix`).
#[cfg(feature = "cuda")]
#[test]
fn cuda_prefix_cached_greedy_equals_solo() {
    use llama::backend::cuda::CudaPaths;
    if !support::cuda::enabled() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (dtype, tied) in [(DType::Q8_0, false), (DType::F16, true)] {
        let dir = tmp.path().join(format!("{dtype}-{tied}"));
        synth_model(&dir, dtype, tied);
        let be = llama::CudaBackend::with_paths(0, CudaPaths::none()).unwrap();
        let mut model = llama::load::open_uploaded_on(&dir, be, 256).unwrap();
        prefix_cache_changes_no_token(&mut model, &format!("cuda {dtype} tied={tied}"));
    }
}
