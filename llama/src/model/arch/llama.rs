//! LLaMA (1–3.x, dense Mistral, SmolLM2, ...): RMSNorm before attention and FFN, Q/K/V
//! projections without bias, RoPE, grouped-query attention, SiLU-gated FFN.

use weights_format::names;

use super::{Activation, Dim, Family, LayerRole, Norm, TensorSpec};

/// The llama family.
pub const LLAMA: Family = Family {
    architecture: "llama",
    layer: &[
        TensorSpec {
            role: LayerRole::AttnNorm,
            name: names::ATTN_NORM,
            shape: &[Dim::Model],
        },
        TensorSpec {
            role: LayerRole::Q,
            name: names::ATTN_Q,
            shape: &[Dim::Q, Dim::Model],
        },
        TensorSpec {
            role: LayerRole::K,
            name: names::ATTN_K,
            shape: &[Dim::Kv, Dim::Model],
        },
        TensorSpec {
            role: LayerRole::V,
            name: names::ATTN_V,
            shape: &[Dim::Kv, Dim::Model],
        },
        TensorSpec {
            role: LayerRole::AttnOutput,
            name: names::ATTN_OUTPUT,
            shape: &[Dim::Model, Dim::Q],
        },
        TensorSpec {
            role: LayerRole::FfnNorm,
            name: names::FFN_NORM,
            shape: &[Dim::Model],
        },
        TensorSpec {
            role: LayerRole::Gate,
            name: names::FFN_GATE,
            shape: &[Dim::Ffn, Dim::Model],
        },
        TensorSpec {
            role: LayerRole::Up,
            name: names::FFN_UP,
            shape: &[Dim::Ffn, Dim::Model],
        },
        TensorSpec {
            role: LayerRole::Down,
            name: names::FFN_DOWN,
            shape: &[Dim::Model, Dim::Ffn],
        },
    ],
    norm: Norm::Rms,
    activation: Activation::Silu,
};
