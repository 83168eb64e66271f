//! Qwen2 / Qwen2.5 and the DeepSeek-R1 Qwen distills: llama's layer with a bias added to
//! each of the Q, K and V projections (before RoPE).

use super::{Activation, Family, Norm};

/// The qwen2 family.
pub const QWEN2: Family = Family {
    architecture: "qwen2",
    layer: llama_layer_with![Q_BIAS, K_BIAS, V_BIAS],
    norm: Norm::Rms,
    activation: Activation::Silu,
};
