//! Gemma 3 (text): Q/K head norms as Qwen3, the attention and FFN outputs RMS-normalised
//! again before each residual add, a tanh-GeLU-gated FFN. Its norms multiply by `1 + w`,
//! which the converter stored as the weight, so they are plain RMSNorms here.
//!
//! What Gemma 3 has beyond its layer's tensors is config, applied by the pass for any family
//! whose config says so: the embedding scale (√dim), the sliding-window layers with their own
//! RoPE base (and their ring KV caches), the attention scale, the tied head and the optional
//! final soft-cap.

use super::tensors::*;
use super::{Activation, Family, Norm};

/// The gemma3 family.
pub const GEMMA3: Family = Family {
    architecture: "gemma3",
    layer: &[
        ATTN_NORM,
        Q,
        K,
        V,
        Q_NORM,
        K_NORM,
        ATTN_OUTPUT,
        ATTN_POST_NORM,
        FFN_NORM,
        GATE,
        UP,
        DOWN,
        FFN_POST_NORM,
    ],
    norm: Norm::Rms,
    activation: Activation::GeluTanh,
};
