//! A model in llama.cpp's Q4_K_M mix (q4_k, q6_k, and the q5_0/q8_0 fallbacks for rows that are
//! not whole super-blocks) on the CPU backend against its f32 twin (every tensor decoded with
//! `weights_format::quant`): decoding (the k-quant kernels, on activations rounded to 8 bits per
//! 32 or 256 values) gives the twin's greedy tokens wherever the twin's top-2 margin is at least 0.05,
//! with logits within 5 % of the largest: the rounding (at most 1/254 of each block's largest
//! activation) enters every matmul of every layer and the residual stream carries it on, and a
//! logit, a sum with much cancellation (random weights), is ~16× smaller than the sum of its
//! terms' magnitudes that the rounding scales with.

use gdsllm_convert::testing::{small_kquant_config, write_f32_twin, write_q4_k_m_model};
use llama::{CpuBackend, InMemoryWeights, Llama};
use weights_format::{DType, Model};

fn open(dir: &std::path::Path) -> Llama<CpuBackend, InMemoryWeights> {
    let meta = Model::open(dir).unwrap().metadata().clone();
    let weights = InMemoryWeights::read_dir(dir, &meta).unwrap();
    Llama::new(CpuBackend::new(), weights, meta, 64, 64).unwrap()
}

/// The largest logit's index and its lead over the second.
fn top2(logits: &[f32]) -> (u32, f32) {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    (idx[0] as u32, logits[idx[0]] - logits[idx[1]])
}

#[test]
fn q4_k_m_mix_decodes_the_greedy_tokens_of_its_f32_twin() {
    let tmp = tempfile::tempdir().unwrap();
    let mixed =
        write_q4_k_m_model(&tmp.path().join("q4km"), &small_kquant_config(4), 0.05, 9).unwrap();
    let twin = write_f32_twin(&mixed, &tmp.path().join("f32")).unwrap();
    assert_eq!(twin.metadata().format_version, 2);
    let mut dtypes: Vec<DType> = mixed
        .metadata()
        .blobs
        .iter()
        .flat_map(|b| b.tensors.iter().map(|t| t.dtype))
        .collect();
    dtypes.sort_by_key(|d| d.name());
    dtypes.dedup();
    println!("dtypes in the mix: {dtypes:?}");
    for d in [DType::Q4K, DType::Q6K, DType::Q5_0, DType::Q8_0] {
        assert!(dtypes.contains(&d), "no {d} tensor in the mix");
    }

    let (mut ours, mut reference) = (open(mixed.dir()), open(twin.dir()));
    let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 512).collect();
    // The prompt's rows dot weight rows decoded to f32 (the twin's weights bit for bit); the
    // LM head of its last position is a one-row matmul, on 8-bit activations.
    let mut got = ours.forward(&prompt).unwrap().to_vec();
    let mut want = reference.forward(&prompt).unwrap().to_vec();

    // Then decode, each step fed the twin's token so both stay on one sequence.
    let (steps, mut compared, mut agreed, mut worst) = (32, 0, 0, 0f32);
    for step in 0..=steps {
        if step > 0 {
            let (token, _) = top2(&want);
            got = ours.forward(&[token]).unwrap().to_vec();
            want = reference.forward(&[token]).unwrap().to_vec();
        }
        let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
            / largest;
        assert!(
            diff <= 5e-2,
            "step {step}: logits {diff} (relative) from the twin's"
        );
        worst = worst.max(diff);
        let (ours_tok, _) = top2(&got);
        let (twin_tok, margin) = top2(&want);
        if margin >= 0.05 {
            compared += 1;
            assert_eq!(
                ours_tok, twin_tok,
                "step {step}: greedy token {ours_tok} vs the twin's {twin_tok} (margin {margin:.3})"
            );
        }
        agreed += usize::from(ours_tok == twin_tok);
    }
    println!(
        "prefill + {steps} decode steps: {agreed}/{} greedy tokens equal the twin's, all {compared} \
         with a top-2 margin >= 0.05 among them; max |logit - twin's| / max |logit| {worst:.2e} \
         (tolerance 5e-2)",
        steps + 1
    );
    // The check must have had something to check.
    assert!(
        compared >= steps / 4,
        "only {compared} steps had a margin >= 0.05"
    );
}
