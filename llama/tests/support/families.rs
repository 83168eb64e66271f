//! One small config per model family, each turning on every step its family has (biases, Q/K
//! head norms, post-norms, the GeLU gate, the embedding scale, sliding-window layers with their
//! own RoPE base, a final soft-cap, Llama 3.1's `freq_factors` and Phi-3's `longrope`), for
//! tests that compare backends on whole models written by
//! `gdsllm_convert::testing::write_random_model`.

use std::path::{Path, PathBuf};

use weights_format::{Activation, DType, ModelConfig, RopeScaling, SlidingWindow};

/// (name, config) of every family; contexts of 128 positions.
pub fn configs() -> Vec<(&'static str, ModelConfig)> {
    let base = ModelConfig {
        n_layers: 3,
        hidden_size: 128,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 32,
        ffn_dim: 256,
        vocab_size: 512,
        context_length: 128,
        rope_theta: 10000.0,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        ..ModelConfig::default()
    };
    let freq_factors: Vec<f32> = (0..16).map(|i| 1.0 + (i as f32 * 0.5)).collect();
    let mut longrope = RopeScaling::new("longrope", 2.0);
    longrope.original_max_position_embeddings = Some(64);
    longrope.short_factor = Some((0..16).map(|i| 1.0 + i as f32 * 0.1).collect());
    longrope.long_factor = Some((0..16).map(|i| 1.0 + i as f32 * 0.7).collect());
    longrope.attention_factor = Some(1.19);
    vec![
        (
            "llama3-freq-factors",
            ModelConfig {
                rope_theta: 500000.0,
                rope_scaling: Some(RopeScaling {
                    freq_factors: Some(freq_factors),
                    ..RopeScaling::new("freq_factors", 1.0)
                }),
                ..base.clone()
            },
        ),
        (
            "qwen2",
            ModelConfig {
                architecture: "qwen2".into(),
                attention_bias: true,
                tie_word_embeddings: true,
                rms_norm_eps: 1e-6,
                ..base.clone()
            },
        ),
        (
            "qwen3",
            ModelConfig {
                architecture: "qwen3".into(),
                qk_norm: true,
                // head_dim · heads ≠ hidden size, as in Qwen3.
                head_dim: 64,
                rms_norm_eps: 1e-6,
                ..base.clone()
            },
        ),
        (
            "gemma3",
            ModelConfig {
                architecture: "gemma3".into(),
                n_layers: 6,
                n_kv_heads: 1,
                // Gemma 3 270M's head_dim, 4 heads on a narrower stream.
                head_dim: 256,
                qk_norm: true,
                post_norms: true,
                activation: Activation::GeluTanh,
                tie_word_embeddings: true,
                embedding_scale: (128f32).sqrt(),
                attention_scale: Some(0.07),
                final_logit_softcap: Some(5.0),
                rms_norm_eps: 1e-6,
                rope_theta: 1e6,
                sliding_window: Some(SlidingWindow {
                    size: 8,
                    layers: vec![0, 1, 3, 4],
                    rope_theta: 1e4,
                }),
                ..base.clone()
            },
        ),
        (
            "phi3",
            ModelConfig {
                architecture: "phi3".into(),
                rope_scaling: Some(longrope),
                ..base
            },
        ),
    ]
}

/// Writes family model `name` (of [`configs`]) with matrices of `dtype` into `dir`.
pub fn write(dir: &Path, config: &ModelConfig, dtype: DType) {
    gdsllm_convert::testing::write_random_model(dir, config, dtype, 5).unwrap();
}

/// Writes the model of family `name` (of [`configs`]) with matrices of `dtype` into
/// `root/name` and returns that directory.
pub fn write_named(root: &Path, name: &str, dtype: DType) -> PathBuf {
    let (_, config) = configs()
        .into_iter()
        .find(|(family, _)| *family == name)
        .unwrap_or_else(|| panic!("no family {name} in configs()"));
    let dir = root.join(name);
    write(&dir, &config, dtype);
    dir
}
