//! Which blobs a model of a given config has, and which tensors (with which shapes) each holds.
//! The reader checks a directory against this; writers (converter, synth) use it to know what
//! to produce.

use crate::{ModelConfig, names};

/// What a tensor is for, which decides the dtypes it may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// An RMSNorm weight vector: any float dtype (f32, f16, bf16), never quantized.
    Norm,
    /// A bias vector: any float dtype, never quantized.
    Bias,
    /// A weight matrix or the embedding table: any dtype.
    Matrix,
}

impl TensorRole {
    /// Norms and biases are vectors kept in a float dtype; only matrices may be quantized.
    pub fn is_float_only(self) -> bool {
        matches!(self, TensorRole::Norm | TensorRole::Bias)
    }
}

/// One tensor a blob must contain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: &'static str,
    /// Row-major, outermost first.
    pub shape: Vec<u64>,
    pub role: TensorRole,
}

/// What kind of blob sits at a position of `metadata.blobs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobKind {
    Embed,
    Layer(usize),
    Output,
}

/// Blob file names in the order of `metadata.blobs`: `embed.bin`, `layer_000.bin` …, `output.bin`.
pub fn blob_files(n_layers: u32) -> Vec<String> {
    let mut files = Vec::with_capacity(n_layers as usize + 2);
    files.push(names::EMBED_BLOB.to_string());
    files.extend((0..n_layers as usize).map(names::layer_blob));
    files.push(names::OUTPUT_BLOB.to_string());
    files
}

/// The kind of blob a file name denotes, if it is a canonical blob name. Layer numbers are
/// three digits or more (`layer_007.bin`, `layer_1000.bin`) with no superfluous leading zeros.
pub fn blob_kind(file: &str) -> Option<BlobKind> {
    if file == names::EMBED_BLOB {
        return Some(BlobKind::Embed);
    }
    if file == names::OUTPUT_BLOB {
        return Some(BlobKind::Output);
    }
    let digits = file.strip_prefix("layer_")?.strip_suffix(".bin")?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let layer: usize = digits.parse().ok()?;
    (names::layer_blob(layer) == file).then_some(BlobKind::Layer(layer))
}

/// Position of a blob in `metadata.blobs` for a model of `n_layers` layers.
pub fn blob_index(kind: BlobKind, n_layers: u32) -> usize {
    match kind {
        BlobKind::Embed => 0,
        BlobKind::Layer(i) => 1 + i,
        BlobKind::Output => n_layers as usize + 1,
    }
}

/// The tensors a blob of `kind` holds for `config`, in the order writers put them. The layer's
/// optional tensors follow the config's feature flags (`attention_bias`, `qk_norm`,
/// `post_norms`).
pub fn blob_tensors(config: &ModelConfig, kind: BlobKind) -> Vec<TensorSpec> {
    let dim = u64::from(config.hidden_size);
    let vocab = u64::from(config.vocab_size);
    let head_dim = u64::from(config.head_dim);
    let q_rows = u64::from(config.n_heads) * head_dim;
    let kv_rows = u64::from(config.n_kv_heads) * head_dim;
    let ffn = u64::from(config.ffn_dim);
    let vector = |name, len, role| TensorSpec {
        name,
        shape: vec![len],
        role,
    };
    let norm = |name| vector(name, dim, TensorRole::Norm);
    let matrix = |name, rows, cols| TensorSpec {
        name,
        shape: vec![rows, cols],
        role: TensorRole::Matrix,
    };
    match kind {
        BlobKind::Embed => vec![matrix(names::TOKEN_EMBD, vocab, dim)],
        BlobKind::Layer(_) => {
            let mut specs = vec![
                norm(names::ATTN_NORM),
                matrix(names::ATTN_Q, q_rows, dim),
                matrix(names::ATTN_K, kv_rows, dim),
                matrix(names::ATTN_V, kv_rows, dim),
            ];
            if config.attention_bias {
                specs.extend([
                    vector(names::ATTN_Q_BIAS, q_rows, TensorRole::Bias),
                    vector(names::ATTN_K_BIAS, kv_rows, TensorRole::Bias),
                    vector(names::ATTN_V_BIAS, kv_rows, TensorRole::Bias),
                ]);
            }
            if config.qk_norm {
                specs.extend([
                    vector(names::ATTN_Q_NORM, head_dim, TensorRole::Norm),
                    vector(names::ATTN_K_NORM, head_dim, TensorRole::Norm),
                ]);
            }
            specs.push(matrix(names::ATTN_OUTPUT, dim, q_rows));
            if config.post_norms {
                specs.push(norm(names::ATTN_POST_NORM));
            }
            specs.extend([
                norm(names::FFN_NORM),
                matrix(names::FFN_GATE, ffn, dim),
                matrix(names::FFN_UP, ffn, dim),
                matrix(names::FFN_DOWN, dim, ffn),
            ]);
            if config.post_norms {
                specs.push(norm(names::FFN_POST_NORM));
            }
            specs
        }
        BlobKind::Output => {
            let mut specs = vec![norm(names::OUTPUT_NORM)];
            if !config.tie_word_embeddings {
                specs.push(matrix(names::OUTPUT, vocab, dim));
            }
            specs
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_names_round_trip() {
        for (i, f) in blob_files(12).iter().enumerate() {
            let kind = blob_kind(f).unwrap();
            assert_eq!(blob_index(kind, 12), i, "{f}");
        }
        assert_eq!(blob_kind("layer_1000.bin"), Some(BlobKind::Layer(1000)));
        for bad in [
            "layer_7.bin",
            "layer_0007.bin",
            "layer_+07.bin",
            "layer_abc.bin",
            "embed.BIN",
            "../embed.bin",
        ] {
            assert_eq!(blob_kind(bad), None, "{bad}");
        }
    }
}
