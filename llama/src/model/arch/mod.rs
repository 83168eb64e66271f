//! Model families as data: which tensors each blob holds, with their shapes in terms of the
//! config, and the choices a layer makes (its norm, its FFN activation). One file per family
//! ([`llama`]) holds a [`Family`]; [`ModelTable::resolve`] checks a model's metadata against it
//! once at load and keeps, per layer, where each tensor lies in its blob — so a pass never looks
//! a tensor up by name, and the pass itself ([`crate::model`], through the blocks of
//! `model/graph.rs`) is the same for every family.
//!
//! Adding a family: a file with its `Family` (a new tensor gets a [`LayerRole`], a new choice a
//! variant of [`Norm`] or [`Activation`], handled in `graph.rs`), one line in [`FAMILIES`].

/// Llama's layer (the attention norm, Q, K, V, the attention output, the FFN norm and the gated
/// FFN) with the tensors `$extra` (names of [`tensors`]) that a family applies to the
/// projections (Qwen2's biases, Qwen3's head norms) between V and the attention output, the
/// order in which `weights_format::layout::blob_tensors` writes them. A macro because a const
/// slice cannot be built from two others.
macro_rules! llama_layer_with {
    ($($extra:ident),* $(,)?) => {{
        use $crate::model::arch::tensors::*;
        &[ATTN_NORM, Q, K, V, $($extra,)* ATTN_OUTPUT, FFN_NORM, GATE, UP, DOWN]
    }};
}

pub mod gemma3;
pub mod llama;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;

use weights_format::{BlobMeta, DType, Metadata, names};

use crate::LlamaError;
use crate::config::LlamaConfig;
use crate::weights::{WeightBytes, WeightView};

/// Every family the forward pass knows, looked up by `config.architecture`.
pub const FAMILIES: &[&Family] = &[
    &llama::LLAMA,
    &qwen2::QWEN2,
    &qwen3::QWEN3,
    &gemma3::GEMMA3,
    &phi3::PHI3,
];

/// A size in a tensor's shape, in terms of the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// The hidden size.
    Model,
    /// `n_heads · head_dim`.
    Q,
    /// `n_kv_heads · head_dim`.
    Kv,
    /// One attention head (`head_dim`): the per-head norms of Q and K.
    Head,
    /// The FFN's intermediate size.
    Ffn,
    Vocab,
}

impl Dim {
    pub fn of(self, c: &LlamaConfig) -> usize {
        match self {
            Dim::Model => c.dim,
            Dim::Q => c.q_dim(),
            Dim::Kv => c.kv_dim(),
            Dim::Head => c.head_dim,
            Dim::Ffn => c.ffn_dim,
            Dim::Vocab => c.vocab_size,
        }
    }
}

/// What a layer's tensor is for: the blocks ask the resolved table by role. The roles after
/// `Down` are optional steps: a block takes them when its family's layer has the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerRole {
    AttnNorm,
    Q,
    K,
    V,
    AttnOutput,
    FfnNorm,
    Gate,
    Up,
    Down,
    /// Added to the Q/K/V projections (Qwen2): `[q]`, `[kv]`, `[kv]`.
    QBias,
    KBias,
    VBias,
    /// RMSNorm of each Q/K head before RoPE (Qwen3, Gemma 3): `[head_dim]`.
    QNorm,
    KNorm,
    /// RMSNorm of the attention / FFN output before the residual add (Gemma 3): `[dim]`.
    AttnPostNorm,
    FfnPostNorm,
}

impl LayerRole {
    /// How many roles there are (the size of a [`LayerTable`]).
    pub const COUNT: usize = 16;

    fn index(self) -> usize {
        self as usize
    }
}

/// One tensor a layer blob holds: `[rows, cols]`, or `[len]` for a vector.
#[derive(Debug, Clone, Copy)]
pub struct TensorSpec {
    pub role: LayerRole,
    pub name: &'static str,
    pub shape: &'static [Dim],
}

impl TensorSpec {
    pub const fn new(role: LayerRole, name: &'static str, shape: &'static [Dim]) -> TensorSpec {
        TensorSpec { role, name, shape }
    }
}

/// The layer tensors of every family, each with its role, name and shape; a family's layer
/// lists the ones it has, in the order `weights_format::layout::blob_tensors` writes them.
pub mod tensors {
    use super::{Dim, LayerRole, TensorSpec};
    use weights_format::names;

    pub const ATTN_NORM: TensorSpec =
        TensorSpec::new(LayerRole::AttnNorm, names::ATTN_NORM, &[Dim::Model]);
    pub const Q: TensorSpec = TensorSpec::new(LayerRole::Q, names::ATTN_Q, &[Dim::Q, Dim::Model]);
    pub const K: TensorSpec = TensorSpec::new(LayerRole::K, names::ATTN_K, &[Dim::Kv, Dim::Model]);
    pub const V: TensorSpec = TensorSpec::new(LayerRole::V, names::ATTN_V, &[Dim::Kv, Dim::Model]);
    pub const Q_BIAS: TensorSpec = TensorSpec::new(LayerRole::QBias, names::ATTN_Q_BIAS, &[Dim::Q]);
    pub const K_BIAS: TensorSpec =
        TensorSpec::new(LayerRole::KBias, names::ATTN_K_BIAS, &[Dim::Kv]);
    pub const V_BIAS: TensorSpec =
        TensorSpec::new(LayerRole::VBias, names::ATTN_V_BIAS, &[Dim::Kv]);
    pub const Q_NORM: TensorSpec =
        TensorSpec::new(LayerRole::QNorm, names::ATTN_Q_NORM, &[Dim::Head]);
    pub const K_NORM: TensorSpec =
        TensorSpec::new(LayerRole::KNorm, names::ATTN_K_NORM, &[Dim::Head]);
    pub const ATTN_OUTPUT: TensorSpec = TensorSpec::new(
        LayerRole::AttnOutput,
        names::ATTN_OUTPUT,
        &[Dim::Model, Dim::Q],
    );
    pub const ATTN_POST_NORM: TensorSpec = TensorSpec::new(
        LayerRole::AttnPostNorm,
        names::ATTN_POST_NORM,
        &[Dim::Model],
    );
    pub const FFN_NORM: TensorSpec =
        TensorSpec::new(LayerRole::FfnNorm, names::FFN_NORM, &[Dim::Model]);
    pub const GATE: TensorSpec =
        TensorSpec::new(LayerRole::Gate, names::FFN_GATE, &[Dim::Ffn, Dim::Model]);
    pub const UP: TensorSpec =
        TensorSpec::new(LayerRole::Up, names::FFN_UP, &[Dim::Ffn, Dim::Model]);
    pub const DOWN: TensorSpec =
        TensorSpec::new(LayerRole::Down, names::FFN_DOWN, &[Dim::Model, Dim::Ffn]);
    pub const FFN_POST_NORM: TensorSpec =
        TensorSpec::new(LayerRole::FfnPostNorm, names::FFN_POST_NORM, &[Dim::Model]);
}

/// How a block normalises its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// `x / sqrt(mean(x²) + eps) · w`.
    Rms,
}

/// The gate's activation in the FFN `down(act(gate(x)) · up(x))` (a backend op's argument).
pub use crate::backend::Activation;

/// A model family as the forward pass sees it.
#[derive(Debug)]
pub struct Family {
    /// `config.architecture` of its models.
    pub architecture: &'static str,
    /// The tensors of every layer blob.
    pub layer: &'static [TensorSpec],
    pub norm: Norm,
    pub activation: Activation,
}

impl Family {
    /// The family of `architecture`.
    pub fn named(architecture: &str) -> Result<&'static Family, LlamaError> {
        FAMILIES
            .iter()
            .copied()
            .find(|f| f.architecture == architecture)
            .ok_or_else(|| LlamaError::Config {
                setting: "architecture",
                message: format!(
                    "{architecture:?} has no forward pass (known: {})",
                    FAMILIES
                        .iter()
                        .map(|f| f.architecture)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }
}

/// Where one tensor lies in its blob, checked against the blob's length and the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRef {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Byte offset in the blob.
    pub offset: usize,
    pub len: usize,
}

impl TensorRef {
    /// The tensor inside `blob`, the bytes of the blob `file` it was resolved in.
    pub fn view<'a>(
        &self,
        blob: WeightBytes<'a>,
        file: &str,
    ) -> Result<WeightView<'a>, LlamaError> {
        let bytes = blob
            .slice(self.offset, self.len)
            .ok_or_else(|| LlamaError::Weights {
                blob: file.to_string(),
                message: format!(
                    "a tensor at {}+{} lies past the end of the {} bytes acquired",
                    self.offset,
                    self.len,
                    blob.len()
                ),
            })?;
        Ok(WeightView {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            bytes,
        })
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_len() * self.dtype.block_bytes()
    }
}

/// One layer's blob and the place of each of its tensors.
#[derive(Debug, Clone)]
pub struct LayerTable {
    pub blob: usize,
    pub file: String,
    tensors: [Option<TensorRef>; LayerRole::COUNT],
}

impl LayerTable {
    /// The tensor with `role` inside `blob` (this layer's acquired bytes); an error when the
    /// family has no such tensor.
    pub fn view<'a>(
        &self,
        role: LayerRole,
        blob: WeightBytes<'a>,
    ) -> Result<WeightView<'a>, LlamaError> {
        let t = self.tensors[role.index()].ok_or_else(|| LlamaError::MissingTensor {
            blob: self.file.clone(),
            name: format!("{role:?}"),
        })?;
        t.view(blob, &self.file)
    }

    /// The tensor with `role` inside `blob` when the family's layer has one (the optional
    /// steps), else `None`.
    pub fn view_if<'a>(
        &self,
        role: LayerRole,
        blob: WeightBytes<'a>,
    ) -> Result<Option<WeightView<'a>>, LlamaError> {
        match self.tensors[role.index()] {
            Some(t) => t.view(blob, &self.file).map(Some),
            None => Ok(None),
        }
    }
}

/// The embedding table, and its blob.
#[derive(Debug, Clone)]
pub struct EmbedTable {
    pub blob: usize,
    pub file: String,
    /// `[vocab, dim]`
    pub token_embd: TensorRef,
}

/// The final norm and the LM head, and their blob.
#[derive(Debug, Clone)]
pub struct OutputTable {
    pub blob: usize,
    pub file: String,
    /// `[dim]`
    pub output_norm: TensorRef,
    /// `[vocab, dim]`; `None` when the head is the (tied) embedding table.
    pub output: Option<TensorRef>,
}

/// Every tensor of a model resolved once: the blob indices in streaming order and the place of
/// each tensor in its blob.
#[derive(Debug, Clone)]
pub struct ModelTable {
    pub family: &'static Family,
    pub embed: EmbedTable,
    pub layers: Vec<LayerTable>,
    pub output: OutputTable,
}

impl ModelTable {
    /// Finds `embed.bin`, `layer_NNN.bin` and `output.bin` in `meta.blobs` and every tensor the
    /// family needs in them, checking shapes and extents.
    pub fn resolve(meta: &Metadata, c: &LlamaConfig) -> Result<ModelTable, LlamaError> {
        let family = Family::named(&meta.config.architecture)?;
        let find = |file: &str| {
            meta.blob_index(file)
                .ok_or_else(|| LlamaError::MissingBlob {
                    file: file.to_string(),
                })
        };
        let embed_blob = find(names::EMBED_BLOB)?;
        let embed = EmbedTable {
            blob: embed_blob,
            file: meta.blobs[embed_blob].file.clone(),
            token_embd: resolve(
                &meta.blobs[embed_blob],
                names::TOKEN_EMBD,
                &[c.vocab_size, c.dim],
            )?,
        };
        let layers = (0..c.n_layers)
            .map(|i| {
                let blob = find(&names::layer_blob(i))?;
                let b = &meta.blobs[blob];
                let mut tensors = [None; LayerRole::COUNT];
                for spec in family.layer {
                    let shape: Vec<usize> = spec.shape.iter().map(|d| d.of(c)).collect();
                    tensors[spec.role.index()] = Some(resolve(b, spec.name, &shape)?);
                }
                Ok(LayerTable {
                    blob,
                    file: b.file.clone(),
                    tensors,
                })
            })
            .collect::<Result<_, LlamaError>>()?;
        let output_blob = find(names::OUTPUT_BLOB)?;
        let ob = &meta.blobs[output_blob];
        let output = OutputTable {
            blob: output_blob,
            file: ob.file.clone(),
            output_norm: resolve(ob, names::OUTPUT_NORM, &[c.dim])?,
            output: if c.tie_word_embeddings {
                None
            } else {
                Some(resolve(ob, names::OUTPUT, &[c.vocab_size, c.dim])?)
            },
        };
        Ok(ModelTable {
            family,
            embed,
            layers,
            output,
        })
    }
}

/// Finds tensor `name` in `blob` and checks its shape (`[rows, cols]` or `[len]`, row-major)
/// and that its bytes lie inside the blob.
fn resolve(blob: &BlobMeta, name: &str, expected: &[usize]) -> Result<TensorRef, LlamaError> {
    let t = blob.tensor(name).ok_or_else(|| LlamaError::MissingTensor {
        blob: blob.file.clone(),
        name: name.to_string(),
    })?;
    let expected_u64: Vec<u64> = expected.iter().map(|&d| d as u64).collect();
    if t.shape != expected_u64 {
        return Err(LlamaError::TensorShape {
            blob: blob.file.clone(),
            name: name.to_string(),
            found: t.shape.clone(),
            expected: expected_u64,
        });
    }
    let bounds = || LlamaError::TensorBounds {
        blob: blob.file.clone(),
        name: name.to_string(),
        dtype: t.dtype,
        offset: t.offset,
        length: t.length,
        blob_len: blob.length as usize,
    };
    if t.dtype.byte_len(&t.shape) != Some(t.length) {
        return Err(bounds());
    }
    let offset = usize::try_from(t.offset).map_err(|_| bounds())?;
    let len = usize::try_from(t.length).map_err(|_| bounds())?;
    if offset
        .checked_add(len)
        .is_none_or(|end| end as u64 > blob.length)
    {
        return Err(bounds());
    }
    let (rows, cols) = match expected {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        _ => return Err(bounds()),
    };
    Ok(TensorRef {
        dtype: t.dtype,
        rows,
        cols,
        offset,
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use weights_format::layout::{BlobKind, blob_tensors};
    use weights_format::{Architecture, ModelConfig};

    /// Every architecture the format describes has a family here, whose layer is exactly the
    /// tensors (names, shapes, order) the format lays out for a config of that family, and
    /// whose activation is the one the family's config must name.
    #[test]
    fn every_architecture_has_a_family_that_agrees_with_the_format_layout() {
        for arch in Architecture::ALL {
            let config = ModelConfig {
                n_layers: 2,
                hidden_size: 48,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 16,
                ffn_dim: 80,
                vocab_size: 32,
                context_length: 64,
                ..ModelConfig::of_family(arch)
            };
            let family = Family::named(arch.name()).unwrap();
            let c = LlamaConfig::from_model_config(&config).unwrap();
            let format: Vec<(&str, Vec<u64>)> = blob_tensors(&config, BlobKind::Layer(0))
                .into_iter()
                .map(|t| (t.name, t.shape))
                .collect();
            let ours: Vec<(&str, Vec<u64>)> = family
                .layer
                .iter()
                .map(|t| (t.name, t.shape.iter().map(|d| d.of(&c) as u64).collect()))
                .collect();
            assert_eq!(ours, format, "{arch}");
            let activation = match config.activation {
                weights_format::Activation::Silu => Activation::Silu,
                weights_format::Activation::GeluTanh => Activation::GeluTanh,
            };
            assert_eq!(family.activation, activation, "{arch}");
            let mut roles: Vec<usize> = family.layer.iter().map(|t| t.role.index()).collect();
            roles.sort_unstable();
            roles.dedup();
            assert_eq!(roles.len(), family.layer.len(), "{arch}: a role twice");
        }
    }
}
