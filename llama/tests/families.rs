//! Every model family's forward pass against llama.cpp on identical weights: the random-weight
//! GGUF of each family (`scripts/families/make_family_gguf.py`, in `GDSLLM_FAMILY_GGUFS`) is
//! converted, opened on the CPU backend with `-c 128`, fed llama.cpp's own prompt ids, and
//! decoded for the 24 steps llama.cpp's references hold (`llamacpp-reference.json`, made by
//! llama-cpp-python on the same files: CPU, F32 weights and KV cache). Each step is fed
//! llama.cpp's token, so every step's logits are compared, not only those before the first
//! near-tie: our greedy token must be llama.cpp's wherever its top-2 margin is at least
//! [`MARGIN`], and our logits of its top 8 tokens within [`LOGIT_TOL`] of its own.
//!
//! Also on the CPU backend: a windowed family (gemma3) batched equals each sequence alone, bit
//! for bit; a sliding-window model's prefix reuse gives the logits of a fresh run; and a small
//! model of every family (`support::families`, every step of the family switched on, quantized
//! matrices) gives the reference backend's logits.

mod common;
mod support;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use gdsllm_convert::convert::{ConvertOptions, NoProgress, TargetDType, convert};
use llama::{BatchConfig, Batcher, CpuBackend, Device, Llama, OpenOptions, SeqEnd};
use residency::Residency;
use serde_json::Value;

/// Top-2 margin (logits) from which our greedy token must be llama.cpp's.
const MARGIN: f32 = 0.05;
/// Largest difference allowed between our logit and llama.cpp's for its top 8 tokens of a
/// step (logits of about ±5; f32 throughout on both sides, summed in different orders). The
/// families without a GeLU agree to ~2e-5; gemma3 to ~1.2e-3, because llama.cpp's CPU GeLU
/// reads a table of f16 values at f16 inputs (rounding the gate's input and output to f16 here
/// brings it to ~3.4e-4).
const LOGIT_TOL: f32 = 2e-3;
/// The context the references were made with.
const CONTEXT: usize = 128;

fn reference() -> &'static Value {
    static R: OnceLock<Value> = OnceLock::new();
    R.get_or_init(|| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../scripts/families/llamacpp-reference.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    })
}

/// Each family's GGUF converted once for every test of this binary: `(dir holding one model
/// directory per family)`, or `None` when the files are not there and model tests are skipped.
fn converted() -> Option<&'static Path> {
    static DIR: OnceLock<Option<tempfile::TempDir>> = OnceLock::new();
    DIR.get_or_init(|| {
        let ggufs = common::env_path(
            "GDSLLM_FAMILY_GGUFS",
            "run `python3 scripts/families/fetch_inputs.py IN && python3 \
             scripts/families/make_family_gguf.py IN DIR` and set it to DIR",
        )?;
        let tmp = tempfile::tempdir().unwrap();
        for family in reference()["models"].as_object().unwrap().keys() {
            convert(
                &ggufs.join(format!("{family}.gguf")),
                &tmp.path().join(family),
                &ConvertOptions::default(),
                &NoProgress,
            )
            .unwrap_or_else(|e| panic!("{family}: {e}"));
        }
        // The windowed family once more with q8_0 matrices, whose CPU kernels round
        // differently for 1–3 rows than for 4 or more (what `BatchSeq::solo_rows` is about).
        let options = ConvertOptions {
            dtype: TargetDType::Q8_0,
            ..ConvertOptions::default()
        };
        convert(
            &ggufs.join("gemma3.gguf"),
            &tmp.path().join("gemma3-q8_0"),
            &options,
            &NoProgress,
        )
        .unwrap();
        Some(tmp)
    })
    .as_ref()
    .map(|t| t.path())
}

fn open_cpu(dir: &Path, context: usize) -> Llama<CpuBackend, Arc<Residency>> {
    let options = OpenOptions {
        context,
        ..OpenOptions::default()
    };
    let loaded = llama::open(dir, Device::Cpu, &options)
        .unwrap()
        .into_cpu()
        .unwrap();
    loaded.session.into_parts().0
}

fn ids(v: &Value) -> Vec<u32> {
    common::ids(v)
}

/// (argmax, top-2 margin) of `logits`.
fn argmax_margin(logits: &[f32]) -> (u32, f32) {
    let top = common::top_k(logits, 2);
    (top[0], logits[top[0] as usize] - logits[top[1] as usize])
}

/// What one family's comparison found.
struct Agreement {
    steps: usize,
    /// Steps whose llama.cpp margin is at least MARGIN (where tokens must agree).
    decisive: usize,
    /// Steps where our greedy token is llama.cpp's.
    same_token: usize,
    max_logit_err: f32,
}

/// Feeds llama.cpp's prompt and tokens to `model` and compares every step.
fn compare_with_llamacpp(model: &mut Llama<CpuBackend, Arc<Residency>>, family: &str) -> Agreement {
    let mut a = Agreement {
        steps: 0,
        decisive: 0,
        same_token: 0,
        max_logit_err: 0.0,
    };
    for run in reference()["models"][family]["runs"].as_array().unwrap() {
        model.truncate(0);
        let mut logits = model.forward(&ids(&run["prompt_ids"])).unwrap().to_vec();
        for (i, step) in run["steps"].as_array().unwrap().iter().enumerate() {
            let want = step["token"].as_u64().unwrap() as u32;
            let margin = step["margin"].as_f64().unwrap() as f32;
            let (ours, our_margin) = argmax_margin(&logits);
            for pair in step["top"].as_array().unwrap() {
                let id = pair[0].as_u64().unwrap() as usize;
                let theirs = pair[1].as_f64().unwrap() as f32;
                let err = (logits[id] - theirs).abs();
                a.max_logit_err = a.max_logit_err.max(err);
                assert!(
                    err <= LOGIT_TOL,
                    "{family} {:?} step {i}: logit of token {id}: ours {} vs llama.cpp {theirs} \
                     (diff {err:.2e} > {LOGIT_TOL:.0e})",
                    run["prompt"],
                    logits[id]
                );
            }
            if margin >= MARGIN {
                a.decisive += 1;
                assert_eq!(
                    ours, want,
                    "{family} {:?} step {i}: greedy token {ours} (margin {our_margin:.3}) vs \
                     llama.cpp {want} (margin {margin:.3} >= {MARGIN})",
                    run["prompt"]
                );
            }
            a.same_token += usize::from(ours == want);
            a.steps += 1;
            logits = model.forward(&[want]).unwrap().to_vec();
        }
    }
    a
}

#[test]
fn every_family_matches_llamacpp_logits_and_greedy_tokens() {
    let Some(models) = converted() else {
        return;
    };
    let families = reference()["models"].as_object().unwrap();
    assert_eq!(families.len(), 6);
    for family in families.keys() {
        let mut model = open_cpu(&models.join(family), CONTEXT);
        let a = compare_with_llamacpp(&mut model, family);
        println!(
            "{family}: {} steps; greedy token = llama.cpp's on {}/{} (all {} with margin >= \
             {MARGIN}); max |logit - llama.cpp's| over the top 8 {:.2e} (tol {LOGIT_TOL:.0e})",
            a.steps, a.same_token, a.steps, a.decisive, a.max_logit_err
        );
    }
}

/// Greedy logits of `prompt` alone for `n` steps, the way `Session::generate` drives a model.
fn solo_logits(
    model: &mut Llama<CpuBackend, Arc<Residency>>,
    prompt: &[u32],
    n: usize,
) -> Vec<Vec<f32>> {
    model.truncate(0);
    let mut out = vec![model.forward(prompt).unwrap().to_vec()];
    while out.len() < n {
        let (t, _) = argmax_margin(out.last().unwrap());
        out.push(model.forward(&[t]).unwrap().to_vec());
    }
    out
}

/// gemma3 with q8_0 matrices (window 8 on four of its six layers, so every prompt longer than 8
/// is computed in several passes and its rings wrap) through the continuous batcher, sequences
/// joining while others decode: every logit of every step is bit for bit the one the sequence
/// gets alone.
#[test]
fn windowed_family_batched_equals_each_sequence_alone() {
    let Some(models) = converted() else {
        return;
    };
    let mut model = open_cpu(&models.join("gemma3-q8_0"), CONTEXT);
    let window = model.config().smallest_window().unwrap();
    assert_eq!((window, model.max_rows_per_sequence()), (8, 8));
    let vocab = model.config().vocab_size as u32;
    // (prompt length, tokens to generate): both sides of the CPU's 4-row kernel switch, and
    // prompts of several windows.
    let reqs = [
        (1, 12),
        (3, 20),
        (9, 6),
        (23, 10),
        (2, 16),
        (30, 7),
        (17, 9),
    ];
    let prompts: Vec<Vec<u32>> = reqs
        .iter()
        .enumerate()
        .map(|(i, &(len, _))| {
            (0..len as u32)
                .map(|j| 2 + (i as u32 * 7919 + j * 104_729) % (vocab - 2))
                .collect()
        })
        .collect();
    let solo: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .zip(&reqs)
        .map(|(p, &(_, n))| solo_logits(&mut model, p, n))
        .collect();
    let config = BatchConfig {
        max_batch: 4,
        prefill_chunk: 16,
        ..BatchConfig::for_model(&model, 4)
    };
    let mut batcher = Batcher::new(&model, config).unwrap();
    let mut index = HashMap::new();
    let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); reqs.len()];
    let mut ended = 0;
    let mut step = 0;
    while ended < reqs.len() {
        // Two sequences at first, then one more every other step.
        if step == 0 || (step % 2 == 0 && index.len() < reqs.len()) {
            for i in index.len()..(index.len() + if step == 0 { 2 } else { 1 }) {
                index.insert(batcher.submit(prompts[i].clone(), reqs[i].1).unwrap(), i);
            }
        }
        let finished = batcher
            .step(&mut model, |id, scores| {
                let logits = scores.logits().expect("submitted for logits");
                got[index[&id]].push(logits.to_vec());
                Some(argmax_margin(logits).0)
            })
            .unwrap();
        for f in finished {
            assert_eq!(f.end, SeqEnd::Length);
            ended += 1;
        }
        step += 1;
        assert!(step < 1000, "the batch never finished");
    }
    for (i, (g, s)) in got.iter().zip(&solo).enumerate() {
        assert_eq!(g.len(), s.len(), "sequence {i}");
        for (t, (a, b)) in g.iter().zip(s).enumerate() {
            assert!(
                a == b,
                "sequence {i} (prompt {} tokens) step {t}: batched logits differ from alone",
                prompts[i].len()
            );
        }
    }
    println!(
        "gemma3 q8_0: {} sequences batched ({} passes): every step's logits identical to each alone (tol 0)",
        reqs.len(),
        step
    );
}

/// A session reusing the cached prefix of its previous prompt on a sliding-window model: when
/// the prefix is within reach of the rings it is kept, when it is not (the rings have moved on)
/// the model starts over; either way the logits are those of a fresh run.
#[test]
fn windowed_prefix_reuse_gives_the_logits_of_a_fresh_run() {
    let Some(models) = converted() else {
        return;
    };
    let mut model = open_cpu(&models.join("gemma3"), CONTEXT);
    let long: Vec<u32> = (0..40).map(|i| 100 + i * 37).collect();
    model.forward(&long).unwrap();
    // Back 6 positions (within the ring: 16 slots, window 8): kept.
    model.truncate(34);
    assert_eq!(model.pos(), 34);
    let kept = model.forward(&[7, 8, 9]).unwrap().to_vec();
    let mut fresh_prompt = long[..34].to_vec();
    fresh_prompt.extend([7, 8, 9]);
    let fresh = solo_logits(&mut model, &fresh_prompt, 1).remove(0);
    assert!(
        kept == fresh,
        "a kept prefix gave other logits than a fresh run"
    );
    // Back 20 positions: the rings no longer hold the keys position 20 sees.
    model.truncate(0);
    model.forward(&long).unwrap();
    model.truncate(20);
    assert_eq!(model.pos(), 0, "a prefix the rings lost must not be reused");
    println!(
        "gemma3: prefix reuse within the rings identical to a fresh run; beyond them the model starts over"
    );
}

/// Every family's small config (`support::families`) with q8_0 and q4_1 matrices: the CPU
/// backend's logits after a prompt longer than gemma3's window and 6 decode steps (fed the
/// reference's greedy tokens) within `TOL` of the reference backend's (f64, whole tensors
/// dequantized).
#[test]
fn random_family_models_match_the_reference_backend() {
    /// f32 sums in another order than the reference's f64, through every layer.
    const TOL: f32 = 1e-4;
    let tmp = tempfile::tempdir().unwrap();
    for (name, config) in support::families::configs() {
        for dtype in [weights_format::DType::Q8_0, weights_format::DType::Q4_1] {
            let dir = tmp.path().join(format!("{name}-{dtype}"));
            support::families::write(&dir, &config, dtype);
            let meta = weights_format::Model::open(&dir)
                .unwrap()
                .metadata()
                .clone();
            let weights = || llama::InMemoryWeights::read_dir(&dir, &meta).unwrap();
            // The exact mode: f32 activations, as the reference (the default 8-bit ones are
            // checked against the float reference in `ops.rs` and `smollm2.rs`).
            let mut cpu = Llama::new(CpuBackend::exact(), weights(), meta.clone(), 64, 64).unwrap();
            let mut slow =
                Llama::new(llama::ReferenceBackend, weights(), meta.clone(), 64, 64).unwrap();
            let prompt: Vec<u32> = (0..13).map(|i| 3 + (i * 97) % 500).collect();
            let (mut a, mut b) = (
                cpu.forward(&prompt).unwrap().to_vec(),
                slow.forward(&prompt).unwrap().to_vec(),
            );
            let mut worst = 0f32;
            for step in 0..=6 {
                let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
                let d = a
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max)
                    / scale;
                worst = worst.max(d);
                assert!(d <= TOL, "{name} {dtype} step {step}: max rel diff {d:.2e}");
                if step == 6 {
                    break;
                }
                let (t, _) = argmax_margin(&b);
                a = cpu.forward(&[t]).unwrap().to_vec();
                b = slow.forward(&[t]).unwrap().to_vec();
            }
            println!(
                "{name} {dtype}: cpu vs reference backend, 7 steps: max rel diff {worst:.2e} (tol {TOL:.0e})"
            );
        }
    }
}
