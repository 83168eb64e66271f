//! The GdsLLM on-disk model format.
//!
//! This crate is for: the types of `metadata.json` (format version, model config, blobs and
//! their tensors), the dtypes and their block layouts, a validating reader and a streaming
//! writer that never leaves a half-written directory that looks valid. The format is specified
//! in `FORMAT.md` beside this crate.
//!
//! It is not for: converting from other formats (`gdsllm-convert`), deciding what to keep in
//! memory (`residency`), or doing arithmetic on the weights (`llama`).

mod architecture;
mod dtype;
mod error;
mod files;
pub mod layout;
mod metadata;
mod model;
pub mod quant;
mod writer;

pub use architecture::{Architecture, FamilyRules};
pub use dtype::DType;
pub use error::FormatError;
pub use files::{remove_stale_partials, stale_work_dirs};
pub use metadata::{
    Activation, BlobMeta, ChatTemplateRef, FAMILY_FORMAT_VERSION, FORMAT_VERSION, Metadata,
    ModelConfig, OLDEST_FORMAT_VERSION, RopeScaling, SlidingWindow, TensorMeta,
};
pub use model::{Model, VerifyProgress, VerifyReport, is_plain_file_name};
pub use writer::{BlobWriter, ModelWriter, TensorWriter};

/// Every tensor offset inside a blob, and every blob file length, is a multiple of this.
pub const ALIGNMENT: u64 = 4096;

/// The model description inside a model directory.
pub const METADATA_FILE: &str = "metadata.json";
/// `xxh3:<hex16>` of metadata.json's bytes. A file cannot hold its own hash, so it sits
/// beside it; `Model::open` and `Model::verify` check it (a deliberate hand edit is accepted
/// with `Model::update_metadata_checksum`).
pub const METADATA_CHECKSUM_FILE: &str = "metadata.json.xxh3";

/// Canonical tensor names inside each blob. One convention everywhere: Hugging Face row order
/// for Q/K (no llama.cpp RoPE permutation), row-major `[out_features, in_features]` matrices,
/// norm weights as the multiplier itself (Gemma's `1 + w` is stored as `1 + w`).
pub mod names {
    /// In `embed.bin`: `[vocab, dim]`. Also the LM head when `tie_word_embeddings`.
    pub const TOKEN_EMBD: &str = "token_embd";
    /// In `output.bin`: `[dim]`, the final RMSNorm weight.
    pub const OUTPUT_NORM: &str = "output_norm";
    /// In `output.bin` when not tied: `[vocab, dim]`.
    pub const OUTPUT: &str = "output";
    /// In `layer_NNN.bin`: `[dim]`.
    pub const ATTN_NORM: &str = "attn_norm";
    /// `[n_heads * head_dim, dim]`.
    pub const ATTN_Q: &str = "attn_q";
    /// `[n_kv_heads * head_dim, dim]`.
    pub const ATTN_K: &str = "attn_k";
    /// `[n_kv_heads * head_dim, dim]`.
    pub const ATTN_V: &str = "attn_v";
    /// `[dim, n_heads * head_dim]`.
    pub const ATTN_OUTPUT: &str = "attn_output";
    /// `[dim]`.
    pub const FFN_NORM: &str = "ffn_norm";
    /// `[ffn_dim, dim]`.
    pub const FFN_GATE: &str = "ffn_gate";
    /// `[ffn_dim, dim]`.
    pub const FFN_UP: &str = "ffn_up";
    /// `[dim, ffn_dim]`.
    pub const FFN_DOWN: &str = "ffn_down";
    /// With `attention_bias`: `[n_heads * head_dim]`, added to `attn_q`'s output.
    pub const ATTN_Q_BIAS: &str = "attn_q_bias";
    /// With `attention_bias`: `[n_kv_heads * head_dim]`.
    pub const ATTN_K_BIAS: &str = "attn_k_bias";
    /// With `attention_bias`: `[n_kv_heads * head_dim]`.
    pub const ATTN_V_BIAS: &str = "attn_v_bias";
    /// With `qk_norm`: `[head_dim]`, RMSNorm weight applied to each query head before RoPE.
    pub const ATTN_Q_NORM: &str = "attn_q_norm";
    /// With `qk_norm`: `[head_dim]`, the same for each key head.
    pub const ATTN_K_NORM: &str = "attn_k_norm";
    /// With `post_norms`: `[dim]`, RMSNorm of the attention output before the residual add.
    pub const ATTN_POST_NORM: &str = "attn_post_norm";
    /// With `post_norms`: `[dim]`, RMSNorm of the FFN output before the residual add.
    pub const FFN_POST_NORM: &str = "ffn_post_norm";

    /// File name of layer `i`'s blob.
    pub fn layer_blob(i: usize) -> String {
        format!("layer_{i:03}.bin")
    }
    /// File name of the embedding blob.
    pub const EMBED_BLOB: &str = "embed.bin";
    /// File name of the output blob (final norm, and LM head when not tied).
    pub const OUTPUT_BLOB: &str = "output.bin";
}
