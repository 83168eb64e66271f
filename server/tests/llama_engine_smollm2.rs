//! The real engine on SmolLM2: hidden states against the LM head, log-probabilities against
//! an independent log-softmax of the model's logits, cancellation, and batched requests
//! against one-at-a-time ones; the memory it reports for the server's budgets.

mod common;

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use common::model_dir;
use gdsllm_server::{
    CancelToken, Engine, EngineFinish, GeneratedToken, GenerationRequest, GrammarSpec,
    SamplingParams, TierBytes,
};
use llama::{CpuBackend, InMemoryWeights, Llama};
use weights_format::{Model, names};

/// The engine `gdsllm serve` runs on the CPU, for batches of `max_batch` sequences of
/// `context` positions whose KV caches hold `kv_budget` bytes together (None: room for all).
fn open_cpu(
    dir: &Path,
    context: usize,
    max_batch: usize,
    kv_budget: Option<u64>,
) -> Arc<dyn Engine> {
    let options = llama::OpenOptions {
        context,
        sequences: max_batch,
        kv_budget,
        ..llama::OpenOptions::default()
    };
    gdsllm_server::open(dir, "smol", llama::Device::Cpu, &options).unwrap()
}

/// What the engine says it holds, against the model's own sizes: all of its weights and its
/// f32 KV caches when the budget has room, at most the budget when it streams.
#[test]
fn memory_is_the_weights_held_and_the_kv_caches() {
    let Some(dir) = model_dir() else { return };
    let model = Model::open(&dir).unwrap();
    let (context, max_batch) = (128, 2);
    let kv = residency::kv_cache_bytes(model.config(), context as u64, 4) * max_batch as u64;
    let open = |device: u64, host: residency::HostCache| {
        let options = llama::OpenOptions {
            context,
            sequences: max_batch,
            residency: residency::ResidencyOptions {
                device_budget: residency::Budget::Bytes(device),
                host_cache: host,
                ..Default::default()
            },
            ..llama::OpenOptions::default()
        };
        gdsllm_server::open(&dir, "smol", llama::Device::Cpu, &options).unwrap()
    };
    let roomy = 4u64 << 30;
    let memory = open(roomy, residency::HostCache::Off).memory().unwrap();
    assert_eq!(memory.backend, "cpu");
    assert_eq!(memory.budget, TierBytes::new(roomy, 0));
    // SmolLM2 ties its LM head: every blob is in the pass, all resident.
    assert_eq!(memory.held, TierBytes::new(kv + model.total_bytes(), 0));

    // Half the weights: the rest streams through the ring, and the host tier takes what
    // streams (up to its budget).
    let tight = kv + model.total_bytes() / 2;
    let host = 1u64 << 30;
    let engine = open(tight, residency::HostCache::Bytes(host));
    let memory = engine.memory().unwrap();
    println!("{memory:?} (budget {tight} + host {host})");
    assert_eq!(memory.budget, TierBytes::new(tight, host));
    assert!(
        memory.held.device <= tight && memory.held.device > kv,
        "{memory:?}"
    );
    // The device part is the KV caches and the weights `/api/ps` lists as resident and
    // staging; what is not resident is streamed, and the host tier keeps it all (1 GiB).
    let stats = engine.stats();
    let tier = |name: &str| {
        stats
            .held_by_tier
            .iter()
            .find(|(t, _)| *t == name)
            .map(|&(_, b)| b)
            .unwrap()
    };
    assert_eq!(
        memory.held.device,
        kv + tier("resident") + tier("staging"),
        "{stats:?}"
    );
    assert_eq!(
        memory.held.host,
        model.total_bytes() - tier("resident"),
        "{stats:?}"
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
    // The exact CPU mode: the LM head on f32 activations, as the f32 product checked here.
    let mut llama = Llama::new(CpuBackend::exact(), weights, meta.clone(), 64, 64).unwrap();
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
    let engine = open_cpu(&dir, 128, 1, None);
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
        grammar: None,
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

/// The engine's batch against its one-at-a-time `generate`: every request (greedy, penalised,
/// seeded sampling, with log-probabilities) gets the same tokens, text and log-probabilities
/// while batched with others; with a KV budget for two, the rest wait and complete later; a
/// cancelled request leaves at once.
#[test]
fn batched_requests_equal_generate_and_wait_for_the_kv_budget() {
    let Some(dir) = model_dir() else { return };
    let context = 128;
    let probe = open_cpu(&dir, context, 4, None);
    let texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "1, 2, 3, 4,",
        "The best way to learn a language is",
    ];
    let mut requests: Vec<GenerationRequest> = texts
        .iter()
        .map(|t| GenerationRequest {
            prompt: probe.tokenize(t, true).unwrap(),
            max_tokens: 10,
            sampling: greedy(),
            logprobs: None,
            grammar: None,
        })
        .collect();
    requests[1].logprobs = Some(3);
    requests[2].sampling.presence_penalty = 0.8;
    requests[2].sampling.frequency_penalty = 0.4;
    requests[3].sampling = SamplingParams {
        temperature: 0.9,
        seed: Some(3),
        ..SamplingParams::default()
    };
    requests[4].max_tokens = 14;
    // Structured output and logit biases are per sequence: each batched sequence keeps its own.
    requests[0].grammar = Some(GrammarSpec::JsonObject);
    requests[2].grammar = Some(GrammarSpec::Lark(r#"start: " yes" | " no""#.into()));
    requests[3].sampling.logit_bias = vec![(probe.tokenize(" the", false).unwrap()[0], -100.0)];
    let bad = GrammarSpec::JsonSchema(serde_json::json!({"type": "no-such-type"}));
    assert!(
        matches!(probe.check_grammar(&bad), Err(gdsllm_server::EngineError::InvalidInput(m)) if m.contains("no-such-type"))
    );
    let alone: Vec<(Vec<GeneratedToken>, EngineFinish)> = requests
        .iter()
        .map(|r| {
            let mut tokens = Vec::new();
            let finish = probe
                .generate(r, &CancelToken::new(), &mut |t| {
                    tokens.push(t);
                    ControlFlow::Continue(())
                })
                .unwrap();
            (tokens, finish)
        })
        .collect();

    // Room for two sequences of prompt + 13 positions at a time (the longest needs 24).
    let longest = requests
        .iter()
        .map(|r| r.prompt.len() + r.max_tokens)
        .max()
        .unwrap();
    let meta = Model::open(&dir).unwrap().metadata().clone();
    let per_position = residency::kv_cache_bytes(&meta.config, 1, 4);
    let engine = open_cpu(
        &dir,
        context,
        4,
        Some(per_position * (2 * longest as u64 + 1)),
    );
    let mut batch = engine.batch(4).unwrap().expect("the llama engine batches");
    let mut ids = Vec::new();
    for r in &requests {
        ids.push(batch.add(r).unwrap());
    }
    // One more that is cancelled once it runs.
    let doomed = batch
        .add(&GenerationRequest {
            max_tokens: 30,
            grammar: None,
            ..requests[0].clone()
        })
        .unwrap();
    // One that could never fit is refused at once (a 400 for the server).
    let too_big = batch.add(&GenerationRequest {
        max_tokens: 100,
        ..requests[0].clone()
    });
    assert!(
        matches!(&too_big, Err(gdsllm_server::EngineError::InvalidInput(m)) if m.contains("KV budget")),
        "{:?}",
        too_big.err()
    );
    let mut got: Vec<Vec<GeneratedToken>> = vec![Vec::new(); requests.len()];
    let mut ends: Vec<Option<EngineFinish>> = vec![None; requests.len()];
    let mut most = 0;
    let mut doomed_tokens = 0;
    let mut doomed_cancelled = false;
    while ends.iter().any(Option::is_none) || !doomed_cancelled {
        let ended = batch
            .step(&mut |id, t| {
                match ids.iter().position(|&i| i == id) {
                    Some(i) => got[i].push(t),
                    None => doomed_tokens += 1,
                }
                ControlFlow::Continue(())
            })
            .unwrap();
        most = most.max(batch.running() + ended.len());
        if !doomed_cancelled && batch.is_running(doomed) && doomed_tokens >= 2 {
            let before = batch.running();
            batch.cancel(doomed);
            doomed_cancelled = true;
            assert_eq!(batch.running(), before - 1, "cancel frees the slot at once");
        }
        for (id, finish) in ended {
            let i = ids
                .iter()
                .position(|&i| i == id)
                .expect("not the cancelled one");
            ends[i] = Some(finish.unwrap());
        }
    }
    assert!(most <= 2, "the KV budget admits two at a time, saw {most}");
    assert_eq!(doomed_tokens, 2, "nothing comes after the cancel");
    for (i, ((tokens, finish), (want, want_finish))) in
        got.iter().zip(&ends).zip(&alone).enumerate()
    {
        let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
        println!("request {i}: {text:?} ({finish:?})");
        assert_eq!(tokens, want, "request {i}");
        assert_eq!(finish.unwrap(), *want_finish, "request {i}");
    }
    let text = |i: usize| -> String { got[i].iter().map(|t| t.text.as_str()).collect() };
    assert!(text(0).starts_with('{'), "{:?}", text(0));
    assert!([" yes", " no"].contains(&text(2).as_str()), "{:?}", text(2));
    assert_eq!(ends[2], Some(EngineFinish::EndOfSequence));
    assert!(
        !got[3]
            .iter()
            .any(|t| t.id == requests[3].sampling.logit_bias[0].0)
    );
    assert_eq!((batch.running(), batch.waiting()), (0, 0));
}
