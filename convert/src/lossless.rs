//! Whether a converted model holds a GGUF file's tensors bit for bit: every tensor of the model
//! is compared with the tensor of the GGUF it came from (after the same Q/K row move the
//! converter makes), byte for byte. `gdsllm verify MODEL --against FILE.gguf` prints the result;
//! it is how a llama.cpp k-quant mix (Q4_K_M …) is shown to convert without re-encoding.

use std::collections::BTreeMap;

use serde::Serialize;
use weights_format::layout::{self, BlobKind};
use weights_format::{DType, Model, names};

use crate::convert::{ConvertError, unpermute_rows};
use crate::gguf::GgufFile;
use crate::gguf_map::gguf_tensor_name;

/// One tensor of the model against the GGUF's.
#[derive(Debug, Clone, Serialize)]
pub struct TensorComparison {
    pub blob: String,
    pub tensor: String,
    pub gguf_tensor: String,
    /// The model's dtype, and the GGUF's (equal when converted with `--dtype keep`).
    pub dtype: DType,
    pub gguf_dtype: DType,
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

/// Whether the converter moves the Q/K rows of this GGUF (llama.cpp permutes them for the
/// `llama` architecture only).
pub fn qk_rows_permuted(gguf: &GgufFile) -> bool {
    gguf.opt_str("general.architecture").ok().flatten() == Some("llama")
}

/// Compares every tensor of `model` with the GGUF tensor of the same name
/// (`blk.N.attn_q.weight` …). With `qk_permuted`, the GGUF's `attn_q`/`attn_k` rows are put in
/// Hugging Face order first, as the converter does. A tensor missing from the GGUF is an error;
/// one that differs is reported, not an error.
pub fn compare_with_gguf(
    model: &Model,
    gguf: &GgufFile,
    qk_permuted: bool,
) -> Result<LosslessReport, ConvertError> {
    let config = model.config();
    let mut tensors = Vec::new();
    let mut source = Vec::new();
    let mut moved = Vec::new();
    for i in 0..model.blob_count() {
        let blob = model.blob(i);
        let layer = match layout::blob_kind(&blob.file) {
            Some(BlobKind::Layer(l)) => Some(l as u32),
            _ => None,
        };
        for t in &blob.tensors {
            let gguf_name = gguf_tensor_name(&t.name, layer);
            let info = gguf
                .tensor(&gguf_name)
                .ok_or_else(|| ConvertError::MissingTensor {
                    path: gguf.path().to_path_buf(),
                    tensor: gguf_name.clone(),
                })?;
            let ours = model.read_tensor(i, &t.name)?;
            gguf.read_tensor(info, &mut source)?;
            let heads = match t.name.as_str() {
                names::ATTN_Q if qk_permuted => Some(config.n_heads),
                names::ATTN_K if qk_permuted => Some(config.n_kv_heads),
                _ => None,
            };
            let theirs: &[u8] = match heads {
                Some(h) => {
                    unpermute_rows(&source, &info.shape, h, &mut moved).map_err(|reason| {
                        ConvertError::BadTensor {
                            path: gguf.path().to_path_buf(),
                            tensor: gguf_name.clone(),
                            reason,
                        }
                    })?;
                    &moved
                }
                None => &source,
            };
            let same_type = t.dtype == info.dtype && t.shape == info.shape;
            let first_difference = (same_type && ours.len() == theirs.len())
                .then(|| ours.iter().zip(theirs).position(|(a, b)| a != b))
                .flatten()
                .map(|p| p as u64);
            let equal = same_type && ours == theirs;
            tensors.push(TensorComparison {
                blob: blob.file.clone(),
                tensor: t.name.clone(),
                gguf_tensor: gguf_name,
                dtype: t.dtype,
                gguf_dtype: info.dtype,
                bytes: t.length,
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
