//! LLaMA (1–3.x, dense Mistral, SmolLM2, ...): RMSNorm before attention and FFN, Q/K/V
//! projections without bias, RoPE, grouped-query attention, SiLU-gated FFN.

use weights_format::names;

use super::{Activation, Dim, Family, LayerRole, Norm, TensorSpec};

/// The llama family.
pub const LLAMA: Family = Family {
    architecture: "llama",
    layer: &[
        TensorSpec::new(LayerRole::AttnNorm, names::ATTN_NORM, &[Dim::Model]),
        TensorSpec::new(LayerRole::Q, names::ATTN_Q, &[Dim::Q, Dim::Model]),
        TensorSpec::new(LayerRole::K, names::ATTN_K, &[Dim::Kv, Dim::Model]),
        TensorSpec::new(LayerRole::V, names::ATTN_V, &[Dim::Kv, Dim::Model]),
        TensorSpec::new(
            LayerRole::AttnOutput,
            names::ATTN_OUTPUT,
            &[Dim::Model, Dim::Q],
        ),
        TensorSpec::new(LayerRole::FfnNorm, names::FFN_NORM, &[Dim::Model]),
        TensorSpec::new(LayerRole::Gate, names::FFN_GATE, &[Dim::Ffn, Dim::Model]),
        TensorSpec::new(LayerRole::Up, names::FFN_UP, &[Dim::Ffn, Dim::Model]),
        TensorSpec::new(LayerRole::Down, names::FFN_DOWN, &[Dim::Model, Dim::Ffn]),
    ],
    norm: Norm::Rms,
    activation: Activation::Silu,
};
