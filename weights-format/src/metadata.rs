use serde::{Deserialize, Serialize};

use crate::DType;

/// The newest `metadata.json` format version this build reads and writes. Version 2 added the
/// k-quant dtypes (see [`crate::DType::format_version`]); a writer stamps each model with the
/// oldest version that describes it ([`Metadata::required_version`]), and readers accept
/// versions 1 to this one and refuse any other.
pub const FORMAT_VERSION: u32 = 2;

/// The whole of `metadata.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    pub format_version: u32,
    pub config: ModelConfig,
    /// In streaming order: `embed.bin`, `layer_000.bin` … `layer_NNN.bin`, `output.bin`.
    pub blobs: Vec<BlobMeta>,
    /// File name of the Hugging Face `tokenizer.json` in the model directory.
    pub tokenizer: String,
    /// The chat template, if the model has one.
    pub chat_template: Option<ChatTemplateRef>,
    /// Free-form provenance (source file, converter version); never interpreted.
    #[serde(default)]
    pub source: serde_json::Map<String, serde_json::Value>,
}

impl Metadata {
    /// The oldest format version that has every dtype these blobs use: what a writer stamps
    /// into `format_version`, and the least a reader requires of a file's.
    pub fn required_version(&self) -> u32 {
        self.blobs
            .iter()
            .flat_map(|b| &b.tensors)
            .map(|t| t.dtype.format_version())
            .fold(1, u32::max)
    }
}

/// Where the chat template lives (a Jinja file in the model directory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatTemplateRef {
    pub file: String,
}

/// The model's hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `"llama"` for every model this version handles.
    pub architecture: String,
    pub n_layers: u32,
    /// Hidden size (`dim`).
    pub hidden_size: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Intermediate size of the SiLU-gated FFN.
    pub ffn_dim: u32,
    pub vocab_size: u32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub rms_norm_eps: f32,
    /// Maximum context the model was trained for.
    pub context_length: u32,
    /// When true the LM head is `token_embd` and `output.bin` holds only the final norm.
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    /// End-of-sequence ids; generation stops at any of them.
    pub eos_token_ids: Vec<u32>,
    /// Whether the tokenizer user should prepend BOS to a raw prompt.
    #[serde(default)]
    pub add_bos_token: bool,
}

/// RoPE scaling as in Hugging Face `config.json` (`rope_type` "linear" or "llama3").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    pub rope_type: String,
    pub factor: f32,
    pub low_freq_factor: Option<f32>,
    pub high_freq_factor: Option<f32>,
    pub original_max_position_embeddings: Option<u32>,
}

/// One blob file: the unit of streaming.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobMeta {
    /// File name inside the model directory, e.g. `layer_007.bin`.
    pub file: String,
    /// File length in bytes, a multiple of [`crate::ALIGNMENT`].
    pub length: u64,
    /// `"xxh3:<16 hex digits>"`: XXH3-64 of the whole file, padding included.
    pub checksum: String,
    pub tensors: Vec<TensorMeta>,
}

/// One tensor inside a blob.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorMeta {
    /// Canonical name (see [`crate::names`]).
    pub name: String,
    pub dtype: DType,
    /// Row-major shape, outermost first.
    pub shape: Vec<u64>,
    /// Byte offset in the blob, a multiple of [`crate::ALIGNMENT`].
    pub offset: u64,
    /// Byte length; equals `dtype.byte_len(shape)`.
    pub length: u64,
}

impl Metadata {
    pub fn blob(&self, file: &str) -> Option<&BlobMeta> {
        self.blobs.iter().find(|b| b.file == file)
    }
}

impl BlobMeta {
    pub fn tensor(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors.iter().find(|t| t.name == name)
    }
}
