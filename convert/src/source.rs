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
    /// What to do to the bytes on the way.
    pub transform: Transform,
}

/// A change a tensor's values need on the way into our format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum Transform {
    /// None: the bytes are ours (bit for bit unless `--dtype` re-encodes them).
    #[default]
    Keep,
    /// The rows are in llama.cpp's interleaved RoPE order and go back into Hugging Face order
    /// with this many heads.
    UnpermuteHeads(u32),
    /// A Gemma norm weight `w` becomes `1 + w`, stored as f32 (see FORMAT.md).
    AddOne,
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

/// Arranges found tensors into the canonical blobs (the tensors `weights_format::layout` asks
/// of `config`), checking each shape. `find(our_name, layer)` returns the planned tensor for
/// that slot, or None if absent.
pub(crate) fn plan_blobs(
    config: &ModelConfig,
    path: &Path,
    mut find: impl FnMut(&str, Option<u32>) -> Result<Option<PlannedTensor>, ConvertError>,
) -> Result<Vec<PlannedBlob>, ConvertError> {
    use weights_format::layout::{self, BlobKind};
    let mut blobs = Vec::with_capacity(config.n_layers as usize + 2);
    for file in layout::blob_files(config.n_layers) {
        let kind = layout::blob_kind(&file).expect("layout names are canonical");
        let layer = match kind {
            BlobKind::Layer(l) => Some(l as u32),
            BlobKind::Embed | BlobKind::Output => None,
        };
        let mut tensors = Vec::new();
        for spec in layout::blob_tensors(config, kind) {
            let t = find(spec.name, layer)?.ok_or_else(|| ConvertError::MissingTensor {
                path: path.to_path_buf(),
                tensor: match layer {
                    Some(l) => format!("{} of layer {l}", spec.name),
                    None => spec.name.to_string(),
                },
            })?;
            if t.shape != spec.shape {
                return Err(ConvertError::BadTensor {
                    path: path.to_path_buf(),
                    tensor: t.source_name.clone(),
                    reason: format!(
                        "shape {:?} does not match the config (expected {:?})",
                        t.shape, spec.shape
                    ),
                });
            }
            tensors.push(t);
        }
        blobs.push(PlannedBlob { file, tensors });
    }
    Ok(blobs)
}

/// Narrows `t` to the rows `rows` picks of a fused tensor (a byte range: rows are contiguous),
/// after checking that the fused tensor has the rows the config implies.
pub(crate) fn take_rows(
    mut t: PlannedTensor,
    rows: crate::family::Rows,
    config: &ModelConfig,
    path: &Path,
) -> Result<PlannedTensor, ConvertError> {
    let (Some((first, count)), Some(total)) = (rows.range(config), rows.fused_rows(config)) else {
        return Ok(t);
    };
    if t.shape.len() != 2 || t.shape[0] != total {
        return Err(ConvertError::BadTensor {
            path: path.to_path_buf(),
            tensor: t.source_name,
            reason: format!(
                "shape {:?}: a fused tensor of {total} rows is expected from the config",
                t.shape
            ),
        });
    }
    let row_bytes = t.length / total;
    t.offset += first * row_bytes;
    t.length = count * row_bytes;
    t.shape[0] = count;
    t.source_name = format!("{} (rows {first}..{})", t.source_name, first + count);
    Ok(t)
}
