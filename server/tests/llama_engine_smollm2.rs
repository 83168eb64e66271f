//! The real engine on SmolLM2: hidden states against the LM head, log-probabilities against
//! an independent log-softmax of the model's logits, and cancellation.

use std::ops::ControlFlow;
use std::path::PathBuf;

use gdsllm_server::{CancelToken, Engine, EngineFinish, GenerationRequest, SamplingParams};
use llama::{CpuBackend, InMemoryWeights, Llama};
use weights_format::{Model, names};

fn model_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("GDSLLM_TEST_MODEL") {
        return Some(PathBuf::from(dir));
    }
    if std::env::var("GDSLLM_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("skipped: GDSLLM_SKIP_MODEL_TESTS=1 and GDSLLM_TEST_MODEL is unset");
        return None;
    }
    panic!(
        "GDSLLM_TEST_MODEL is not set: run `gdsllm pull smollm2` and set GDSLLM_TEST_MODEL to the \
         converted model directory (or set GDSLLM_SKIP_MODEL_TESTS=1 to skip model tests)"
    );
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// The last row of `forward_hidden` times the (tied) embedding table must give the logits of
/// `forward`: an independent check that the hidden states are the model's final ones.
#[test]
fn final_hidden_state_reproduces_the_logits() {
    let Some(dir) = model_dir() else { return };
    let model = Model::open(&dir).unwrap();
    let meta = model.metadata().clone();
    assert!(meta.config.tie_word_embeddings, "SmolLM2 ties its LM head");
    let weights = InMemoryWeights::read_dir(&dir, &meta).unwrap();
    let embed_blob = std::fs::read(model.blob_path(model.embed_blob())).unwrap();
    let mut llama = Llama::new(CpuBackend::new(), weights, meta.clone(), 64, 64).unwrap();
    let tokens = [504u32, 3575, 282, 4649, 314];
    let logits = llama.forward(&tokens).unwrap().to_vec();
    llama.truncate(0);
    let hidden = llama.forward_hidden(&tokens).unwrap();
    let dim = meta.config.hidden_size as usize;
    assert_eq!(hidden.len(), tokens.len() * dim);
    let last = &hidden[(tokens.len() - 1) * dim..];

    let t = meta.blobs[model.embed_blob()]
        .tensor(names::TOKEN_EMBD)
        .unwrap();
    let row_bytes = dim / t.dtype.block_len() * t.dtype.block_bytes();
    let mut row = vec![0f32; dim];
    let mut max_diff = 0f32;
    for id in [0usize, 1, 2, 504, 3575, 10_000, 49_151] {
        let start = t.offset as usize + id * row_bytes;
        weights_format::quant::dequantize(t.dtype, &embed_blob[start..start + row_bytes], &mut row)
            .unwrap();
        let dot: f32 = row.iter().zip(last).map(|(a, b)| a * b).sum();
        max_diff = max_diff.max((dot - logits[id]).abs());
    }
    println!("max |E·h_last - logits| over 7 ids: {max_diff:e} (tolerance 1e-3)");
    assert!(max_diff < 1e-3);
}

#[test]
fn logprobs_are_the_log_softmax_of_the_logits_and_cancel_stops() {
    let Some(dir) = model_dir() else { return };
    let engine =
        gdsllm_server::open_cpu(&dir, "smol", &residency::ResidencyOptions::default(), 128)
            .unwrap();
    let prompt = engine.tokenize("The capital of France is", true).unwrap();

    // Independent reference: the prompt's logits straight from the model, log-softmax in f64.
    let model = Model::open(&dir).unwrap();
    let meta = model.metadata().clone();
    let weights = InMemoryWeights::read_dir(&dir, &meta).unwrap();
    let mut llama = Llama::new(CpuBackend::new(), weights, meta, 128, 128).unwrap();
    let logits = llama.forward(&prompt).unwrap().to_vec();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));

    let request = GenerationRequest {
        prompt: prompt.clone(),
        max_tokens: 3,
        sampling: greedy(),
        logprobs: Some(4),
    };
    let mut tokens = Vec::new();
    let finish = engine
        .generate(&request, &CancelToken::new(), &mut |t| {
            tokens.push(t);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(finish, EngineFinish::MaxTokens);
    let first = &tokens[0];
    assert_eq!(first.id as usize, order[0], "greedy picks the argmax");
    let mut max_diff = 0f64;
    for (alt, &id) in first.top_logprobs.iter().zip(&order) {
        assert_eq!(alt.id as usize, id);
        max_diff = max_diff.max((alt.logprob as f64 - (logits[id] as f64 - lse)).abs());
    }
    println!("max logprob difference from the f64 log-softmax: {max_diff:e} (tolerance 1e-4)");
    assert!(max_diff < 1e-4);
    assert_eq!(
        first.logprob.as_ref().unwrap().logprob,
        first.top_logprobs[0].logprob
    );

    // A cancelled token stops the sequence before max_tokens; a Break from the sink does too.
    let cancel = CancelToken::new();
    let mut n = 0;
    let long = GenerationRequest {
        max_tokens: 50,
        logprobs: None,
        ..request
    };
    let finish = engine
        .generate(&long, &cancel, &mut |_| {
            n += 1;
            if n == 2 {
                cancel.cancel();
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!((finish, n), (EngineFinish::Stopped, 2));
    let mut m = 0;
    let finish = engine
        .generate(&long, &CancelToken::new(), &mut |_| {
            m += 1;
            ControlFlow::Break(())
        })
        .unwrap();
    assert_eq!((finish, m), (EngineFinish::Stopped, 1));
}
