//! LLaMA (1–3.x, dense Mistral, SmolLM2, ...): RMSNorm before attention and FFN, Q/K/V
//! projections without bias, RoPE (Llama 3.x: scaled, `llama3` or a GGUF's `freq_factors`),
//! grouped-query attention, SiLU-gated FFN.

use super::tensors::*;
use super::{Activation, Family, Norm};

/// The llama family.
pub const LLAMA: Family = Family {
    architecture: "llama",
    layer: &[ATTN_NORM, Q, K, V, ATTN_OUTPUT, FFN_NORM, GATE, UP, DOWN],
    norm: Norm::Rms,
    activation: Activation::Silu,
};
