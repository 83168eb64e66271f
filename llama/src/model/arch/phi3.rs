//! Phi-3 / Phi-3.5 mini: llama's layer (the converter split the fused `qkv_proj` and
//! `gate_up_proj` into the llama tensors). Its `longrope` scaling is config, applied by the
//! RoPE frequencies and the attention scale (`crate::config`); its sliding window (2047) is
//! ignored, as llama.cpp ignores it, so the converter writes none.

use super::llama::LLAMA;
use super::{Family, Norm};

/// The phi3 family.
pub const PHI3: Family = Family {
    architecture: "phi3",
    layer: LLAMA.layer,
    norm: Norm::Rms,
    activation: LLAMA.activation,
};
