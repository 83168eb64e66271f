use serde::{Deserialize, Serialize};

use crate::DType;

/// The newest `metadata.json` format version this build reads and writes. Readers accept
/// [`OLDEST_FORMAT_VERSION`]..=this and refuse any other. A writer stamps each model with the
/// oldest version that describes it ([`Metadata::required_version`]): version 2 (the family
/// fields) for every model, version 3 when a tensor uses a dtype added with the k-quants (see
/// [`crate::DType::format_version`]), so a build that predates them refuses such a file by its
/// version instead of failing on an unknown dtype name.
pub const FORMAT_VERSION: u32 = 3;
/// Version 1 files (llama only, before the family fields) still open: every field added in
/// version 2 has a default that describes a plain llama model.
pub const OLDEST_FORMAT_VERSION: u32 = 1;
/// The version that added the family fields (architecture, norms, RoPE kinds ...): the least a
/// writer stamps, whatever dtypes the model uses.
pub const FAMILY_FORMAT_VERSION: u32 = 2;

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
    /// The oldest format version that has the family fields and every dtype these blobs use:
    /// what a writer stamps into `format_version`.
    pub fn required_version(&self) -> u32 {
        self.blobs
            .iter()
            .flat_map(|b| &b.tensors)
            .map(|t| t.dtype.format_version())
            .fold(FAMILY_FORMAT_VERSION, u32::max)
    }
}

/// Where the chat template lives (a Jinja file in the model directory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatTemplateRef {
    pub file: String,
}

/// The model's hyper-parameters.
///
/// The fields after `add_bos_token` were added in format version 2 for the model families
/// beyond llama; each defaults to what a llama model has, so version 1 files read unchanged.
/// Which values each architecture allows is checked by [`ModelConfig::validate`]
/// (see `FORMAT.md`, "Architectures").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model family: one of [`crate::Architecture`]'s names (`"llama"`, `"qwen2"`,
    /// `"qwen3"`, `"gemma3"`, `"phi3"`). Absent in the oldest files, which are all llama.
    #[serde(default = "default_architecture")]
    pub architecture: String,
    pub n_layers: u32,
    /// Hidden size (`dim`).
    pub hidden_size: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Intermediate size of the gated FFN.
    pub ffn_dim: u32,
    pub vocab_size: u32,
    /// RoPE base of every layer (of the full-attention layers when some use a sliding window).
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
    /// The Q, K and V projections add a bias (`attn_q_bias`, `attn_k_bias`, `attn_v_bias`).
    #[serde(default)]
    pub attention_bias: bool,
    /// Q and K are RMS-normalised per head (`attn_q_norm`, `attn_k_norm`, `[head_dim]`)
    /// before RoPE.
    #[serde(default)]
    pub qk_norm: bool,
    /// The attention and FFN outputs are RMS-normalised (`attn_post_norm`, `ffn_post_norm`)
    /// before they are added to the residual stream.
    #[serde(default)]
    pub post_norms: bool,
    /// The gate's activation in `down(act(gate(x)) * up(x))`.
    #[serde(default)]
    pub activation: Activation,
    /// The embedding rows are multiplied by this before the first layer (Gemma: √dim).
    #[serde(default = "one")]
    pub embedding_scale: f32,
    /// Multiplier of `q·k` in attention; `null`: `1/sqrt(head_dim)`.
    #[serde(default)]
    pub attention_scale: Option<f32>,
    /// `null`, or `c`: logits become `c·tanh(logits/c)`.
    #[serde(default)]
    pub final_logit_softcap: Option<f32>,
    /// `null`: every layer attends to the whole context.
    #[serde(default)]
    pub sliding_window: Option<SlidingWindow>,
}

fn default_architecture() -> String {
    crate::Architecture::Llama.name().to_string()
}

fn one() -> f32 {
    1.0
}

/// The FFN gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `x·sigmoid(x)` (llama, qwen, phi3).
    #[default]
    Silu,
    /// GeLU with the tanh approximation (`gelu_pytorch_tanh`; gemma).
    GeluTanh,
}

/// Layers that attend only to the last `size` positions (their own included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlidingWindow {
    /// Positions a windowed layer sees: query position `p` attends to keys `p-size+1 ..= p`.
    pub size: u32,
    /// The windowed layers, ascending; the others attend to the whole context.
    pub layers: Vec<u32>,
    /// RoPE base of the windowed layers; they take no `rope_scaling` (Gemma 3's local layers).
    pub rope_theta: f32,
}

/// RoPE scaling, after Hugging Face `config.json`'s `rope_scaling`.
///
/// `rope_type`:
/// - `"linear"`: every frequency divided by `factor`.
/// - `"llama3"`: Llama 3.1's smooth per-frequency scaling from `factor`, `low_freq_factor`,
///   `high_freq_factor` and `original_max_position_embeddings`.
/// - `"freq_factors"`: frequency `i` divided by `freq_factors[i]` (`head_dim/2` of them; what
///   a GGUF's `rope_freqs` tensor holds for Llama 3.1); `factor` is 1.
/// - `"longrope"`: Phi-3's: frequency `i` divided by `long_factor[i]` when the context exceeds
///   `original_max_position_embeddings`, else by `short_factor[i]`; cos and sin multiplied by
///   `attention_factor`; `factor` is `context_length / original_max_position_embeddings`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    pub rope_type: String,
    pub factor: f32,
    pub low_freq_factor: Option<f32>,
    pub high_freq_factor: Option<f32>,
    pub original_max_position_embeddings: Option<u32>,
    #[serde(default)]
    pub freq_factors: Option<Vec<f32>>,
    #[serde(default)]
    pub short_factor: Option<Vec<f32>>,
    #[serde(default)]
    pub long_factor: Option<Vec<f32>>,
    #[serde(default)]
    pub attention_factor: Option<f32>,
}

impl RopeScaling {
    /// A scaling of `rope_type` with only `factor` set (the other fields `None`).
    pub fn new(rope_type: &str, factor: f32) -> RopeScaling {
        RopeScaling {
            rope_type: rope_type.to_string(),
            factor,
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: None,
            freq_factors: None,
            short_factor: None,
            long_factor: None,
            attention_factor: None,
        }
    }
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
        self.blob_index(file).map(|i| &self.blobs[i])
    }

    /// The index in `blobs` of the blob stored in `file` (`embed.bin`, `layer_NNN.bin`, ...).
    pub fn blob_index(&self, file: &str) -> Option<usize> {
        self.blobs.iter().position(|b| b.file == file)
    }
}

impl BlobMeta {
    pub fn tensor(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

impl Default for ModelConfig {
    /// A llama config with every size zero (so not valid until the sizes are filled in), for
    /// struct-update syntax: `ModelConfig { n_layers: 2, ..ModelConfig::default() }`.
    fn default() -> ModelConfig {
        ModelConfig {
            architecture: default_architecture(),
            n_layers: 0,
            hidden_size: 0,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim: 0,
            ffn_dim: 0,
            vocab_size: 0,
            rope_theta: 10000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            context_length: 0,
            tie_word_embeddings: false,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            add_bos_token: false,
            attention_bias: false,
            qk_norm: false,
            post_norms: false,
            activation: Activation::Silu,
            embedding_scale: 1.0,
            attention_scale: None,
            final_logit_softcap: None,
            sliding_window: None,
        }
    }
}

impl ModelConfig {
    /// The default config (see [`ModelConfig::default`]) of family `arch`: its name and what
    /// its rules fix (Q/K/V biases, Q/K norms, post-norms, activation); the sizes are the
    /// caller's to fill in.
    pub fn of_family(arch: crate::Architecture) -> ModelConfig {
        let rules = arch.rules();
        ModelConfig {
            architecture: arch.name().into(),
            attention_bias: rules.attention_bias,
            qk_norm: rules.qk_norm,
            post_norms: rules.post_norms,
            activation: rules.activation,
            ..ModelConfig::default()
        }
    }
}
