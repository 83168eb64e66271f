//! Qwen3 (dense): llama's layer with each Q and K head RMS-normalised (its own `[head_dim]`
//! weight, the layer's epsilon) after the projections and before RoPE; no biases.
//! `head_dim` need not be `dim / n_heads` (Qwen3-0.6B: 16 heads of 128 on a 1024-wide stream).

use super::{Activation, Family, Norm};

/// The qwen3 family.
pub const QWEN3: Family = Family {
    architecture: "qwen3",
    layer: llama_layer_with![Q_NORM, K_NORM],
    norm: Norm::Rms,
    activation: Activation::Silu,
};
