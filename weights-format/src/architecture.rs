//! The model families the format describes, and what each family's config may say.
//!
//! A family is a fixed shape of the decoder layer (which tensors it has, which norms, which
//! activation); the config's feature fields (`attention_bias`, `qk_norm`, ...) spell that
//! shape out so a reader need not know the family to lay out the blobs, and [`FamilyRules`]
//! keeps them consistent with the family's name so a forward pass written per family can
//! trust them.

use crate::Activation;

/// A model family (`config.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// Llama 1–3.x, and dense Mistral models (same tensors): RMSNorm, SiLU-gated FFN, RoPE
    /// ("rotate half" in our row order), grouped-query attention.
    Llama,
    /// Qwen2 / Qwen2.5 and the DeepSeek-R1 Qwen distills: llama plus Q/K/V biases.
    Qwen2,
    /// Qwen3 (dense): llama plus a per-head RMSNorm of Q and K before RoPE.
    Qwen3,
    /// Gemma 3 (text): Q/K norms, post-attention and post-FFN norms, tanh-GeLU gate, √dim
    /// embedding scale, sliding-window layers with their own RoPE base, tied embeddings.
    Gemma3,
    /// Phi-3 / Phi-3.5 mini: llama's layer (the fused QKV and gate/up are split on
    /// conversion), optionally Phi-3's "longrope" scaling.
    Phi3,
}

/// What a family's config must or may contain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FamilyRules {
    /// The value `attention_bias` must have.
    pub attention_bias: bool,
    /// The value `qk_norm` must have.
    pub qk_norm: bool,
    /// The value `post_norms` must have.
    pub post_norms: bool,
    /// The value `activation` must have.
    pub activation: Activation,
    /// Whether `embedding_scale` may differ from 1 and `attention_scale`,
    /// `final_logit_softcap` and `sliding_window` may be set (Gemma's extras).
    pub gemma_extras: bool,
    /// The `rope_scaling.rope_type`s the family may use (`null` is always allowed).
    pub rope_types: &'static [&'static str],
}

impl Architecture {
    pub const ALL: [Architecture; 5] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Gemma3,
        Architecture::Phi3,
    ];

    /// The name in `config.architecture` (and in GGUF's `general.architecture`).
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
            Architecture::Phi3 => "phi3",
        }
    }

    pub fn from_name(name: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The names of every family, for error messages: `llama, qwen2, ...`.
    pub fn names() -> String {
        Architecture::ALL.map(Architecture::name).join(", ")
    }

    /// What this family's config must or may contain.
    pub fn rules(self) -> FamilyRules {
        let llama = FamilyRules {
            attention_bias: false,
            qk_norm: false,
            post_norms: false,
            activation: Activation::Silu,
            gemma_extras: false,
            rope_types: &["linear", "llama3", "freq_factors"],
        };
        match self {
            Architecture::Llama => llama,
            Architecture::Qwen2 => FamilyRules {
                attention_bias: true,
                rope_types: &["linear"],
                ..llama
            },
            Architecture::Qwen3 => FamilyRules {
                qk_norm: true,
                rope_types: &["linear"],
                ..llama
            },
            Architecture::Gemma3 => FamilyRules {
                qk_norm: true,
                post_norms: true,
                activation: Activation::GeluTanh,
                gemma_extras: true,
                rope_types: &["linear"],
                ..llama
            },
            Architecture::Phi3 => FamilyRules {
                rope_types: &["longrope"],
                ..llama
            },
        }
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in Architecture::ALL {
            assert_eq!(Architecture::from_name(a.name()), Some(a));
        }
        assert_eq!(Architecture::from_name("mistral"), None);
        assert_eq!(Architecture::names(), "llama, qwen2, qwen3, gemma3, phi3");
    }
}
