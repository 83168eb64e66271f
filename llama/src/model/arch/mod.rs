//! Model families as data: which tensors each blob holds, with their shapes in terms of the
//! config, and the choices a layer makes (its norm, its FFN activation). One file per family
//! ([`llama`]) holds a [`Family`]; [`ModelTable::resolve`] checks a model's metadata against it
//! once at load and keeps, per layer, where each tensor lies in its blob — so a pass never looks
//! a tensor up by name, and the pass itself ([`crate::model`], through the blocks of
//! `model/graph.rs`) is the same for every family.
//!
//! Adding a family: a file with its `Family` (a new tensor gets a [`LayerRole`], a new choice a
//! variant of [`Norm`] or [`Activation`], handled in `graph.rs`), one line in [`FAMILIES`].

pub mod llama;

use weights_format::{BlobMeta, DType, Metadata, names};

use crate::LlamaError;
use crate::config::LlamaConfig;
use crate::weights::{WeightBytes, WeightView};

/// Every family the forward pass knows, looked up by `config.architecture`.
pub const FAMILIES: &[&Family] = &[&llama::LLAMA];

/// A size in a tensor's shape, in terms of the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// The hidden size.
    Model,
    /// `n_heads · head_dim`.
    Q,
    /// `n_kv_heads · head_dim`.
    Kv,
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
            Dim::Ffn => c.ffn_dim,
            Dim::Vocab => c.vocab_size,
        }
    }
}

/// What a layer's tensor is for: the blocks ask the resolved table by role.
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
}

impl LayerRole {
    /// How many roles there are (the size of a [`LayerTable`]).
    pub const COUNT: usize = 9;

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

/// How a block normalises its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// `x / sqrt(mean(x²) + eps) · w`.
    Rms,
}

/// The gate's activation in the FFN `down(act(gate(x)) · up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
}

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
            meta.blobs
                .iter()
                .position(|b| b.file == file)
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
