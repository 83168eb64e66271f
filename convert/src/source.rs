//! What every source format is turned into before anything is written: a [`SourceModel`]
//! (config, tokenizer, and for every output tensor where its bytes lie in which input file),
//! and [`plan_blobs`], which arranges found tensors into the canonical blobs. The readers
//! (`hf`, `gguf_map`) produce it and the driver (`convert`) consumes it, so both depend on
//! this module and not on each other.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use weights_format::{DType, ModelConfig};

use crate::error::ConvertError;
use crate::gguf::GgufFile;

/// Where one output tensor's bytes come from.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTensor {
    /// Canonical name in the blob (`weights_format::names`).
    pub name: String,
    /// Name in the source, for messages.
    pub source_name: String,
    pub dtype: DType,
    /// Row-major shape.
    pub shape: Vec<u64>,
    /// Index into [`SourceModel::files`].
    pub file: usize,
    /// Absolute byte offset in that file.
    pub offset: u64,
    pub length: u64,
    /// Some(n_heads) when the rows are in llama.cpp's interleaved RoPE order and must be put
    /// back into Hugging Face order with `n_heads` heads.
    pub unpermute_heads: Option<u32>,
}

/// One output blob and its tensors in writing order.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedBlob {
    pub file: String,
    pub tensors: Vec<PlannedTensor>,
}

/// A source model ready to be written: everything but the tensor bytes is in memory.
#[derive(Debug)]
pub struct SourceModel {
    pub config: ModelConfig,
    pub tokenizer: TokenizerSource,
    pub chat_template: Option<String>,
    /// Provenance written into `metadata.json`; contains no absolute paths or times so that
    /// converting twice gives identical bytes.
    pub source: Map<String, Value>,
    pub blobs: Vec<PlannedBlob>,
    /// Input files the tensors are read from, with their paths.
    pub files: Vec<(PathBuf, File)>,
}

/// Where `tokenizer.json` comes from.
#[derive(Debug)]
pub enum TokenizerSource {
    /// The file as it is (Hugging Face directories ship one).
    Json(Vec<u8>),
    /// Built from the metadata of this GGUF file (`tokenizer::GgufTokenizer`) while `convert::write_model`
    /// writes the blobs.
    Gguf(Box<GgufFile>),
}

impl SourceModel {
    /// Bytes of tensor data read from the source.
    pub fn total_bytes(&self) -> u64 {
        self.blobs
            .iter()
            .flat_map(|b| &b.tensors)
            .map(|t| t.length)
            .sum()
    }
}

/// The shapes a LLaMA model's tensors must have, for checking sources against their config.
pub(crate) fn expected_shape(config: &ModelConfig, name: &str) -> Vec<u64> {
    use weights_format::names::*;
    let dim = config.hidden_size as u64;
    let q = (config.n_heads * config.head_dim) as u64;
    let kv = (config.n_kv_heads * config.head_dim) as u64;
    let ffn = config.ffn_dim as u64;
    let vocab = config.vocab_size as u64;
    match name {
        TOKEN_EMBD | OUTPUT => vec![vocab, dim],
        OUTPUT_NORM | ATTN_NORM | FFN_NORM => vec![dim],
        ATTN_Q => vec![q, dim],
        ATTN_K | ATTN_V => vec![kv, dim],
        ATTN_OUTPUT => vec![dim, q],
        FFN_GATE | FFN_UP => vec![ffn, dim],
        FFN_DOWN => vec![dim, ffn],
        _ => unreachable!("expected_shape called with non-canonical name {name}"),
    }
}

/// Which of our tensors a LLaMA layer has, in writing order.
pub(crate) const LAYER_TENSORS: [&str; 9] = {
    use weights_format::names::*;
    [
        ATTN_NORM,
        ATTN_Q,
        ATTN_K,
        ATTN_V,
        ATTN_OUTPUT,
        FFN_NORM,
        FFN_GATE,
        FFN_UP,
        FFN_DOWN,
    ]
};

/// Arranges found tensors into the canonical blobs, checking each shape against the config.
/// `find(our_name, layer)` returns the planned tensor for that slot, or None if absent.
pub(crate) fn plan_blobs(
    config: &ModelConfig,
    path: &Path,
    mut find: impl FnMut(&str, Option<u32>) -> Result<Option<PlannedTensor>, ConvertError>,
) -> Result<Vec<PlannedBlob>, ConvertError> {
    use weights_format::names::*;
    let mut require = |name: &str, layer: Option<u32>| -> Result<PlannedTensor, ConvertError> {
        let t = find(name, layer)?.ok_or_else(|| ConvertError::MissingTensor {
            path: path.to_path_buf(),
            tensor: match layer {
                Some(l) => format!("{name} of layer {l}"),
                None => name.to_string(),
            },
        })?;
        check_shape(config, path, &t)?;
        Ok(t)
    };
    let mut blobs = vec![PlannedBlob {
        file: EMBED_BLOB.to_string(),
        tensors: vec![require(TOKEN_EMBD, None)?],
    }];
    for layer in 0..config.n_layers {
        let tensors = LAYER_TENSORS
            .iter()
            .map(|name| require(name, Some(layer)))
            .collect::<Result<Vec<_>, _>>()?;
        blobs.push(PlannedBlob {
            file: layer_blob(layer as usize),
            tensors,
        });
    }
    let mut output = vec![require(OUTPUT_NORM, None)?];
    if !config.tie_word_embeddings {
        output.push(require(OUTPUT, None)?);
    }
    blobs.push(PlannedBlob {
        file: OUTPUT_BLOB.to_string(),
        tensors: output,
    });
    Ok(blobs)
}

fn check_shape(config: &ModelConfig, path: &Path, t: &PlannedTensor) -> Result<(), ConvertError> {
    let expected = expected_shape(config, &t.name);
    if t.shape != expected {
        return Err(ConvertError::BadTensor {
            path: path.to_path_buf(),
            tensor: t.source_name.clone(),
            reason: format!(
                "shape {:?} does not match the config (expected {expected:?})",
                t.shape
            ),
        });
    }
    Ok(())
}
