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

/// The format describes more families (and RoPE scalings) than the forward pass runs yet; such
/// a model must fail here, by name, before anything is loaded, rather than run through another
/// family's layer. The families are those with a file in `model/arch` (adding one lifts this).
fn refuse_unimplemented(c: &ModelConfig) -> Result<(), LlamaError> {
    crate::model::arch::Family::named(&c.architecture)?;
    if let Some(s) = &c.rope_scaling
        && !matches!(s.rope_type.as_str(), "linear" | "llama3")
    {
        return Err(LlamaError::Config {
            setting: "rope_scaling",
            message: format!(
                "rope_type {:?} is not implemented by this build's forward pass (linear, llama3)",
                s.rope_type
            ),
        });
    }
    Ok(())
}

impl LlamaConfig {
    /// Checks the config (the same rules `weights_format::Model::open` applies, so a config
    /// built by hand gets them too) and precomputes the RoPE frequencies.
    pub fn from_model_config(c: &ModelConfig) -> Result<LlamaConfig, LlamaError> {
        c.validate()?;
        refuse_unimplemented(c)?;
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

/// The context a model opens with: `requested` positions, the model's whole context when 0,
/// and at most the model's context: more is clamped to it with a warning (a default `-c 4096`
/// must not stop a model trained on 2048 positions).
pub fn clamp_context(requested: usize, config: &ModelConfig) -> usize {
    let model = config.context_length as usize;
    if requested == 0 {
        model
    } else if requested > model {
        tracing::warn!(
            "--ctx-size {requested} is larger than the model's context length {model}; using {model}"
        );
        model
    } else {
        requested
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(architecture: &str) -> ModelConfig {
        ModelConfig {
            architecture: architecture.into(),
            n_layers: 1,
            hidden_size: 32,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 16,
            ffn_dim: 64,
            vocab_size: 16,
            context_length: 64,
            ..ModelConfig::default()
        }
    }

    /// A family the format knows but the pass does not run yet fails by name, never runs
    /// through the llama layer.
    #[test]
    fn families_without_a_forward_pass_are_refused_by_name() {
        LlamaConfig::from_model_config(&tiny("llama")).unwrap();
        let qwen3 = ModelConfig {
            qk_norm: true,
            ..tiny("qwen3")
        };
        let err = LlamaConfig::from_model_config(&qwen3)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"qwen3\" has no forward pass (known: llama)"),
            "{err}"
        );
        let llama31 = ModelConfig {
            rope_scaling: Some(weights_format::RopeScaling {
                freq_factors: Some(vec![1.0; 8]),
                ..weights_format::RopeScaling::new("freq_factors", 1.0)
            }),
            ..tiny("llama")
        };
        let err = LlamaConfig::from_model_config(&llama31)
            .unwrap_err()
            .to_string();
        assert!(err.contains("freq_factors"), "{err}");
    }
}
