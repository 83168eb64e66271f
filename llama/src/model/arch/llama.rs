//! LLaMA (1–3.x, dense Mistral, SmolLM2, ...): RMSNorm before attention and FFN, Q/K/V
//! projections without bias, RoPE (Llama 3.x: scaled, `llama3` or a GGUF's `freq_factors`),
//! grouped-query attention, SiLU-gated FFN.

use super::{Activation, Family, Norm};

/// The llama family.
pub const LLAMA: Family = Family {
    architecture: "llama",
    layer: llama_layer_with![],
    norm: Norm::Rms,
    activation: Activation::Silu,
};
