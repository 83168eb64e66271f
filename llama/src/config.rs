//! The model's hyper-parameters as the forward pass uses them, validated from `metadata.json`.

use weights_format::{ModelConfig, RopeScaling};

use crate::LlamaError;

/// Validated hyper-parameters (all sizes as `usize`).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub n_layers: usize,
    /// Hidden size.
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub context_length: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub add_bos_token: bool,
    /// RoPE inverse frequencies, `head_dim / 2` of them, scaling applied.
    pub rope_inv_freq: Vec<f32>,
}

impl LlamaConfig {
    /// Checks the config (the same rules `weights_format::Model::open` applies, so a config
    /// built by hand gets them too) and precomputes the RoPE frequencies.
    pub fn from_model_config(c: &ModelConfig) -> Result<LlamaConfig, LlamaError> {
        c.validate()?;
        let head_dim = c.head_dim as usize;
        Ok(LlamaConfig {
            n_layers: c.n_layers as usize,
            dim: c.hidden_size as usize,
            n_heads: c.n_heads as usize,
            n_kv_heads: c.n_kv_heads as usize,
            head_dim,
            ffn_dim: c.ffn_dim as usize,
            vocab_size: c.vocab_size as usize,
            rms_norm_eps: c.rms_norm_eps,
            context_length: c.context_length as usize,
            tie_word_embeddings: c.tie_word_embeddings,
            bos_token_id: c.bos_token_id,
            eos_token_ids: c.eos_token_ids.clone(),
            add_bos_token: c.add_bos_token,
            rope_inv_freq: rope_inv_freq(head_dim, c.rope_theta, c.rope_scaling.as_ref()),
        })
    }

    /// Width of the query projection (`n_heads · head_dim`).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of the key and value projections (`n_kv_heads · head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Inverse RoPE frequencies `theta^(-2i/head_dim)`, `i < head_dim/2`, with Llama-3 style
/// scaling applied when configured (as in Hugging Face `_compute_llama3_parameters`).
pub fn rope_inv_freq(head_dim: usize, theta: f32, scaling: Option<&RopeScaling>) -> Vec<f32> {
    let mut inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    if let Some(s) = scaling {
        match s.rope_type.as_str() {
            "linear" => inv.iter_mut().for_each(|f| *f /= s.factor),
            "llama3" => {
                let low = s.low_freq_factor.unwrap_or(1.0);
                let high = s.high_freq_factor.unwrap_or(4.0);
                let old_ctx = s.original_max_position_embeddings.unwrap_or(8192) as f32;
                let low_wavelen = old_ctx / low;
                let high_wavelen = old_ctx / high;
                for f in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= s.factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old_ctx / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                    }
                }
            }
            _ => {}
        }
    }
    inv
}
