//! The model's hyper-parameters as the forward pass uses them, validated from `metadata.json`.

use weights_format::ModelConfig;

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

fn bad(setting: &'static str, message: impl Into<String>) -> LlamaError {
    LlamaError::Config {
        setting,
        message: message.into(),
    }
}

impl LlamaConfig {
    /// Checks what the forward pass relies on and precomputes the RoPE frequencies.
    pub fn from_model_config(c: &ModelConfig) -> Result<LlamaConfig, LlamaError> {
        if c.architecture != "llama" {
            return Err(bad(
                "architecture",
                format!("`{}` is not supported (only `llama`)", c.architecture),
            ));
        }
        for (setting, v) in [
            ("n_layers", c.n_layers),
            ("hidden_size", c.hidden_size),
            ("n_heads", c.n_heads),
            ("n_kv_heads", c.n_kv_heads),
            ("head_dim", c.head_dim),
            ("ffn_dim", c.ffn_dim),
            ("vocab_size", c.vocab_size),
            ("context_length", c.context_length),
        ] {
            if v == 0 {
                return Err(bad(setting, "must be positive"));
            }
        }
        if !c.n_heads.is_multiple_of(c.n_kv_heads) {
            return Err(bad(
                "n_kv_heads",
                format!("{} does not divide n_heads {}", c.n_kv_heads, c.n_heads),
            ));
        }
        if !c.head_dim.is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                format!("{} is odd; RoPE needs pairs", c.head_dim),
            ));
        }
        if c.rope_theta.is_nan() || c.rope_theta <= 0.0 {
            return Err(bad(
                "rope_theta",
                format!("{} must be positive", c.rope_theta),
            ));
        }
        if c.rms_norm_eps.is_nan() || c.rms_norm_eps < 0.0 {
            return Err(bad(
                "rms_norm_eps",
                format!("{} must be >= 0", c.rms_norm_eps),
            ));
        }
        if let Some(s) = &c.rope_scaling {
            if !matches!(s.rope_type.as_str(), "linear" | "llama3") {
                return Err(bad(
                    "rope_scaling.rope_type",
                    format!("`{}` is not supported (linear, llama3)", s.rope_type),
                ));
            }
            if s.factor.is_nan() || s.factor <= 0.0 {
                return Err(bad(
                    "rope_scaling.factor",
                    format!("{} must be positive", s.factor),
                ));
            }
        }
        for &id in c.eos_token_ids.iter().chain(c.bos_token_id.iter()) {
            if id >= c.vocab_size {
                return Err(bad(
                    "eos_token_ids/bos_token_id",
                    format!("token {id} is outside the vocabulary of {}", c.vocab_size),
                ));
            }
        }
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
            rope_inv_freq: crate::backend::rope_inv_freq(
                head_dim,
                c.rope_theta,
                c.rope_scaling.as_ref(),
            ),
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
