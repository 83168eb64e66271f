//! The model's hyper-parameters as the forward pass uses them, validated from `metadata.json`.

use weights_format::{ModelConfig, RopeScaling, SlidingWindow};

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
    /// RoPE base of the layers that attend to the whole context.
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    /// The layers that attend to a window only, with their own RoPE base.
    pub sliding_window: Option<SlidingWindow>,
    /// The embedding rows are multiplied by this (Gemma: √dim; else 1).
    pub embedding_scale: f32,
    /// Multiplier of `q·k`: the config's `attention_scale`, else `1/√head_dim`; times the
    /// square of the RoPE scaling's `attention_factor` (Phi-3's longrope multiplies cos and
    /// sin by it, which is the same as scaling the scores by its square).
    pub attention_scale: f32,
    /// `c`: logits become `c·tanh(logits/c)`.
    pub final_logit_softcap: Option<f32>,
}

/// The format describes more families than the forward pass may run; such a model must fail
/// here, by name, before anything is loaded, rather than run through another family's layer.
/// The families are those with a file in `model/arch`.
fn refuse_unimplemented(c: &ModelConfig) -> Result<(), LlamaError> {
    crate::model::arch::Family::named(&c.architecture)?;
    Ok(())
}

impl LlamaConfig {
    /// Checks the config (the same rules `weights_format::Model::open` applies, so a config
    /// built by hand gets them too).
    pub fn from_model_config(c: &ModelConfig) -> Result<LlamaConfig, LlamaError> {
        c.validate()?;
        refuse_unimplemented(c)?;
        let head_dim = c.head_dim as usize;
        let attention_factor = c
            .rope_scaling
            .as_ref()
            .and_then(|s| s.attention_factor)
            .unwrap_or(1.0);
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
            rope_theta: c.rope_theta,
            rope_scaling: c.rope_scaling.clone(),
            sliding_window: c.sliding_window.clone(),
            embedding_scale: c.embedding_scale,
            attention_scale: c.attention_scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
                * attention_factor
                * attention_factor,
            final_logit_softcap: c.final_logit_softcap,
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

    /// The window of layer `layer` (query position `p` sees keys `p - window + 1 ..= p`), or
    /// `None` when it attends to the whole context.
    pub fn window(&self, layer: usize) -> Option<usize> {
        let w = self.sliding_window.as_ref()?;
        w.layers
            .binary_search(&(layer as u32))
            .is_ok()
            .then_some(w.size as usize)
    }

    /// The smallest window of any layer (`None`: no layer has one).
    pub fn smallest_window(&self) -> Option<usize> {
        self.sliding_window.as_ref().map(|w| w.size as usize)
    }

    /// RoPE inverse frequencies, `head_dim / 2` of them, of the windowed layers (`sliding`,
    /// their own base and no scaling) or of the others, for a model opened with `context`
    /// positions (Phi-3's longrope picks its factors by it, as llama.cpp does).
    pub fn rope_inv_freq(&self, sliding: bool, context: usize) -> Vec<f32> {
        match (&self.sliding_window, sliding) {
            (Some(w), true) => rope_inv_freq(self.head_dim, w.rope_theta, None, context),
            _ => rope_inv_freq(
                self.head_dim,
                self.rope_theta,
                self.rope_scaling.as_ref(),
                context,
            ),
        }
    }
}

/// Inverse RoPE frequencies `theta^(-2i/head_dim)`, `i < head_dim/2`, with the scaling applied:
/// `linear` divides each by `factor`; `llama3` as Hugging Face's `_compute_llama3_parameters`;
/// `freq_factors` (a Llama 3.1 GGUF's `rope_freqs`) divides frequency `i` by factor `i`;
/// `longrope` (Phi-3) by `long_factor[i]` when `context` exceeds
/// `original_max_position_embeddings`, else by `short_factor[i]` (its `attention_factor` is
/// in [`LlamaConfig::attention_scale`]).
pub fn rope_inv_freq(
    head_dim: usize,
    theta: f32,
    scaling: Option<&RopeScaling>,
    context: usize,
) -> Vec<f32> {
    let mut inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let Some(s) = scaling else {
        return inv;
    };
    let divide_by = |inv: &mut [f32], factors: Option<&Vec<f32>>| {
        for (f, d) in inv.iter_mut().zip(factors.into_iter().flatten()) {
            *f /= d;
        }
    };
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
        "freq_factors" => divide_by(&mut inv, s.freq_factors.as_ref()),
        "longrope" => {
            let original = s.original_max_position_embeddings.unwrap_or(0) as usize;
            let factors = if context > original {
                s.long_factor.as_ref()
            } else {
                s.short_factor.as_ref()
            };
            divide_by(&mut inv, factors);
        }
        _ => {}
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

    /// Llama 3.1 GGUFs carry their scaling as per-frequency divisors (`rope_freqs`), made by
    /// llama.cpp's converter from the `llama3` parameters: both give the same frequencies.
    #[test]
    fn freq_factors_give_the_llama3_frequencies_they_were_made_from() {
        let mut llama3 = RopeScaling::new("llama3", 8.0);
        llama3.low_freq_factor = Some(1.0);
        llama3.high_freq_factor = Some(4.0);
        llama3.original_max_position_embeddings = Some(64);
        let (head_dim, theta) = (16, 500000.0);
        let want = rope_inv_freq(head_dim, theta, Some(&llama3), 128);
        let plain = rope_inv_freq(head_dim, theta, None, 128);
        // llama.cpp's `LlamaModel.generate_extra_tensors`: 1, factor, or 1/((1-s)/factor + s).
        let factors: Vec<f32> = plain
            .iter()
            .map(|f| {
                let wavelen = 2.0 * std::f32::consts::PI / f;
                let (low_wavelen, high_wavelen) = (64.0 / 1.0, 64.0 / 4.0);
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    8.0
                } else {
                    let smooth = (64.0 / wavelen - 1.0) / (4.0 - 1.0);
                    1.0 / ((1.0 - smooth) / 8.0 + smooth)
                }
            })
            .collect();
        assert!(
            factors.contains(&1.0) && factors.contains(&8.0),
            "{factors:?}"
        );
        let scaling = RopeScaling {
            freq_factors: Some(factors),
            ..RopeScaling::new("freq_factors", 1.0)
        };
        let got = rope_inv_freq(head_dim, theta, Some(&scaling), 128);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w, "{got:?} vs {want:?}");
        }
    }

    /// Phi-3's longrope: the long factors once the context exceeds the original one, the
    /// short ones up to it; the attention factor squared in the score scale.
    #[test]
    fn longrope_picks_its_factors_by_the_context_and_scales_the_scores() {
        let mut s = RopeScaling::new("longrope", 2.0);
        s.original_max_position_embeddings = Some(64);
        s.short_factor = Some(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        s.long_factor = Some(vec![2.0; 8]);
        s.attention_factor = Some(1.5);
        let plain = rope_inv_freq(16, 10000.0, None, 64);
        let short = rope_inv_freq(16, 10000.0, Some(&s), 64);
        let long = rope_inv_freq(16, 10000.0, Some(&s), 65);
        for i in 0..8 {
            assert_eq!(short[i], plain[i] / (i + 1) as f32);
            assert_eq!(long[i], plain[i] / 2.0);
        }
        let c = LlamaConfig::from_model_config(&ModelConfig {
            rope_scaling: Some(s),
            context_length: 128,
            ..tiny("phi3")
        })
        .unwrap();
        assert_eq!(c.attention_scale, 1.5 * 1.5 / 4.0);
        assert_eq!(c.rope_inv_freq(false, 128), long);
    }
}
