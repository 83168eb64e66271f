//! Whether a converted model holds its source's tensors bit for bit: every tensor of the model
//! is compared with the bytes the converter's plan reads for it (the GGUF tensor, after the
//! same Q/K row move or `1 + w` the converter makes), byte for byte.
//! `gdsllm verify MODEL --against FILE.gguf` prints the result; it is how a llama.cpp k-quant
//! mix (Q4_K_M …) is shown to convert without re-encoding.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;

use serde::Serialize;
use weights_format::{DType, Model};

use crate::convert::{add_one, unpermute_rows};
use crate::error::ConvertError;
use crate::source::{SourceModel, Transform};

/// One tensor of the model against the GGUF's.
#[derive(Debug, Clone, Serialize)]
pub struct TensorComparison {
    pub blob: String,
    pub tensor: String,
    pub gguf_tensor: String,
    /// The model's dtype, and the GGUF's (equal when converted with `--dtype keep`).
    pub dtype: DType,
    pub gguf_dtype: DType,
    /// What the converter does to the source bytes on the way (see [`Transform`]).
    pub transform: Transform,
    pub bytes: u64,
    /// Whether every byte is equal (dtypes and lengths included).
    pub equal: bool,
    /// Offset of the first differing byte, when the lengths agree and a byte differs.
    pub first_difference: Option<u64>,
}

/// The comparison of every tensor, and per dtype how many tensors and bytes were equal.
#[derive(Debug, Clone, Serialize)]
pub struct LosslessReport {
    pub tensors: Vec<TensorComparison>,
    /// dtype → (tensors, equal tensors, bytes)
    pub by_dtype: BTreeMap<String, (usize, usize, u64)>,
}

impl LosslessReport {
    pub fn all_equal(&self) -> bool {
        self.tensors.iter().all(|t| t.equal)
    }
}

/// Compares every tensor of `model` with the tensor the converter planned for it from
/// `source` ([`crate::convert::open_source`] of the file the model was converted from). With
/// `undo_transforms`, the source bytes go through the plan's transform first (llama.cpp's
/// Q/K row order moved back, Gemma's norms as `1 + w`), as the converter does; without, they
/// are compared as stored (which shows that the transformed tensors really changed). A planned
/// tensor missing from the model is an error; one that differs is reported, not an error.
pub fn compare_with_source(
    model: &Model,
    source: &SourceModel,
    undo_transforms: bool,
) -> Result<LosslessReport, ConvertError> {
    let mut tensors = Vec::new();
    let mut raw = Vec::new();
    let mut moved = Vec::new();
    for planned_blob in &source.blobs {
        let index = model
            .metadata()
            .blob_index(&planned_blob.file)
            .ok_or_else(|| ConvertError::BadInput {
                path: model.dir().to_path_buf(),
                reason: format!("the model has no blob {}", planned_blob.file),
            })?;
        let blob = model.blob(index);
        for t in &planned_blob.tensors {
            let (path, file) = &source.files[t.file];
            let bad = |reason: String| ConvertError::BadTensor {
                path: path.clone(),
                tensor: t.source_name.clone(),
                reason,
            };
            let ours_meta = blob
                .tensor(&t.name)
                .ok_or_else(|| bad(format!("{} has no tensor {}", blob.file, t.name)))?;
            let ours = model.read_tensor(index, &t.name)?;
            raw.resize(t.length as usize, 0);
            file.read_exact_at(&mut raw, t.offset)
                .map_err(|e| ConvertError::io(path, e))?;
            let mut theirs: &[u8] = &raw;
            let mut their_dtype = t.dtype;
            if undo_transforms {
                match t.transform {
                    Transform::Keep => {}
                    Transform::UnpermuteHeads(heads) => {
                        unpermute_rows(&raw, &t.shape, heads, &mut moved).map_err(bad)?;
                        theirs = &moved;
                    }
                    Transform::AddOne => {
                        add_one(&raw, t.dtype, &mut moved).map_err(bad)?;
                        theirs = &moved;
                        their_dtype = DType::F32;
                    }
                }
            }
            let same_type = ours_meta.dtype == their_dtype && ours_meta.shape == t.shape;
            let first_difference = (same_type && ours.len() == theirs.len())
                .then(|| ours.iter().zip(theirs).position(|(a, b)| a != b))
                .flatten()
                .map(|p| p as u64);
            let equal = same_type && ours == theirs;
            tensors.push(TensorComparison {
                blob: blob.file.clone(),
                tensor: t.name.clone(),
                gguf_tensor: t.source_name.clone(),
                dtype: ours_meta.dtype,
                gguf_dtype: t.dtype,
                transform: t.transform,
                bytes: ours_meta.length,
                equal,
                first_difference,
            });
        }
    }
    let mut by_dtype = BTreeMap::new();
    for t in &tensors {
        let e = by_dtype
            .entry(t.dtype.name().to_string())
            .or_insert((0, 0, 0));
        e.0 += 1;
        e.1 += usize::from(t.equal);
        e.2 += t.bytes;
    }
    Ok(LosslessReport { tensors, by_dtype })
}
