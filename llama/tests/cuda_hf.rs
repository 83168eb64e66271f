//! Whole model against Hugging Face transformers: `scripts/hf_reference.py` builds a model with
//! transformers' own class (LlamaForCausalLM, or the family's: Qwen2, Qwen3, Gemma3, Phi3,
//! Llama 3.1 rope) with random weights on the device, saves it (f16 or bf16) and writes the
//! float32 reference of the same weights; `gdsllm convert` turns the directory into our format;
//! this test loads it on the GPU through `llama::open` and compares.
//!
//! Opt-in: `GDSLLM_HF_CASES=DIR[:DIR…]`, each DIR holding `model/` (converted) and
//! `reference.json`. Checks: last-position logits of the prompt within 1e-2 relative error
//! (‖ours − ref‖₂ / ‖ref‖₂; the stricter max |ours − ref| / max |ref| is printed beside it),
//! and our greedy tokens equal the reference's for every step
//! until the first one whose reference top-2 margin is below `MARGIN` (there either token is
//! numerically right, f16 KV cache and f32 accumulation order included, and the sequences may
//! part). Needs the `cuda` feature.
#![cfg(feature = "cuda")]

use llama::{Device, OpenOptions};

const LOGITS_TOL: f32 = 1e-2;
/// Top-2 margin (in logits) below which a differing greedy token is not a failure.
const MARGIN: f32 = 0.05;

#[derive(serde::Deserialize)]
struct Reference {
    shape: String,
    dtype: String,
    prompt: Vec<u32>,
    last_logits: Vec<f32>,
    greedy_tokens: Vec<u32>,
    greedy_margins: Vec<f32>,
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

#[test]
fn converted_transformers_models_match_their_float32_reference() {
    let Ok(cases) = std::env::var("GDSLLM_HF_CASES") else {
        eprintln!("skipped: set GDSLLM_HF_CASES (see scripts/gpu-check.sh)");
        return;
    };
    for case in cases.split(':').filter(|c| !c.is_empty()) {
        let dir = std::path::Path::new(case);
        let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
        let r: Reference = serde_json::from_str(&text).unwrap();
        let label = format!("{} {}", r.shape, r.dtype);
        let context = r.prompt.len() + r.greedy_tokens.len() + 1;
        let options = OpenOptions {
            context,
            ..OpenOptions::default()
        };
        let loaded = llama::open(dir.join("model"), Device::Cuda { ordinal: 0 }, &options)
            .unwrap()
            .into_cuda()
            .unwrap();
        let (mut llama, _) = loaded.session.into_parts();
        let got = llama.forward(&r.prompt).unwrap().to_vec();
        let scale = r.last_logits.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let max_abs = got
            .iter()
            .zip(&r.last_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let max_rel = max_abs / scale;
        let norm =
            |v: &mut dyn Iterator<Item = f32>| v.map(|x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let rel = (norm(&mut got.iter().zip(&r.last_logits).map(|(a, b)| a - b))
            / norm(&mut r.last_logits.iter().copied())) as f32;
        println!(
            "{label}: last-position logits of a {}-token prompt: relative error {rel:.2e} \
             (L2, tol {LOGITS_TOL:.0e}); max abs diff {max_abs:.3e}, max abs diff / max |ref| \
             {max_rel:.2e}",
            r.prompt.len()
        );
        assert!(rel < LOGITS_TOL, "{label}: logits relative error {rel}");
        let mut logits = got;
        let mut identical = 0;
        let mut compared = 0;
        for (step, (&want, &margin)) in r.greedy_tokens.iter().zip(&r.greedy_margins).enumerate() {
            let ours = argmax(&logits);
            if ours != want {
                assert!(
                    margin < MARGIN,
                    "{label}: step {step}: greedy token {ours} != reference {want} with \
                     reference margin {margin:.3e} >= {MARGIN}"
                );
                println!(
                    "{label}: step {step}: tokens part ({ours} vs {want}) at reference margin \
                     {margin:.3e} < {MARGIN}; comparison stops"
                );
                break;
            }
            identical += 1;
            compared = step + 1;
            logits = llama.forward(&[want]).unwrap().to_vec();
        }
        println!(
            "{label}: greedy tokens identical for {identical}/{} steps (compared {compared})",
            r.greedy_tokens.len()
        );
    }
}
