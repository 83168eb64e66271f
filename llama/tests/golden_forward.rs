//! The forward pass on the real SmolLM2-135M against the Hugging Face float reference.
mod common;

use common::*;
use llama::{CpuBackend, InMemoryWeights, Llama};
use weights_format::Metadata;

/// Logit tolerance against the f32 reference: our weights are the same quantized values, but
/// summation order differs over 30 layers.
const LOGIT_TOL: f32 = 0.05;

fn load(dir: &std::path::Path, context: usize) -> Llama<CpuBackend, InMemoryWeights> {
    let meta: Metadata =
        serde_json::from_str(&std::fs::read_to_string(dir.join("metadata.json")).unwrap()).unwrap();
    let weights = InMemoryWeights::read_dir(dir, &meta).unwrap();
    Llama::new(CpuBackend::new(), weights, meta, context, context).unwrap()
}

#[test]
fn prompts_match_reference_top5_and_greedy() {
    let Some(dir) = model_dir() else { return };
    let golden = golden();
    let mut model = load(&dir, 256);
    for case in golden["prompts"].as_array().unwrap() {
        let prompt = ids(&case["input_ids"]);
        let want_greedy = ids(&case["greedy_ids"]);
        let margins = floats(&case["margins"]);
        let want_top5 = ids(&case["last_top5_ids"]);
        let want_top5_logits = floats(&case["last_top5_logits"]);
        model.truncate(0);
        let logits = model.forward(&prompt).unwrap().to_vec();
        let top5 = top_k(&logits, 5);
        let got: Vec<f32> = want_top5.iter().map(|&i| logits[i as usize]).collect();
        let max_diff = got
            .iter()
            .zip(&want_top5_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{:?}: top5 {top5:?} (want {want_top5:?}) logits {got:?} vs {want_top5_logits:?}, \
             max diff {max_diff:.5} (tolerance {LOGIT_TOL})",
            case["prompt"].as_str().unwrap()
        );
        assert_eq!(top5, want_top5);
        assert!(
            max_diff <= LOGIT_TOL,
            "max logit diff {max_diff} > {LOGIT_TOL}"
        );

        // Greedy must agree at least until the reference's top-2 gap drops below 0.05.
        let must_match = margins
            .iter()
            .position(|&m| m < 0.05)
            .unwrap_or(margins.len());
        let mut next = argmax(&logits);
        let mut got_ids = vec![next];
        for _ in 1..want_greedy.len() {
            next = argmax(model.forward(&[next]).unwrap());
            got_ids.push(next);
        }
        let agree = got_ids
            .iter()
            .zip(&want_greedy)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "  greedy agrees for {agree}/{} steps (must: {must_match})",
            want_greedy.len()
        );
        assert!(
            agree >= must_match,
            "greedy {got_ids:?} vs reference {want_greedy:?}"
        );
    }
}
