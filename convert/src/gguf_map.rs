//! GGUF (llama.cpp's `llama` architecture) → [`SourceModel`]: config from the `llama.*` and
//! `tokenizer.ggml.*` keys, tensors from the `blk.N.*` names.

use std::fs::File;
use std::path::Path;

use serde_json::{Map, Value};
use weights_format::{ModelConfig, RopeScaling, names};

use crate::error::ConvertError;
use crate::gguf::{GgufError, GgufFile};
use crate::source::{PlannedTensor, SourceModel, TokenizerSource, plan_blobs};

/// The GGUF tensor name of one of our tensors.
pub fn gguf_tensor_name(name: &str, layer: Option<u32>) -> String {
    match layer {
        Some(l) => format!("blk.{l}.{name}.weight"),
        None => format!("{name}.weight"),
    }
}

/// Reads the model config from GGUF metadata. A missing required key is an error naming it.
pub fn config_from_gguf(gguf: &GgufFile) -> Result<ModelConfig, ConvertError> {
    let arch = gguf.require_str("general.architecture")?;
    if arch != "llama" {
        return Err(ConvertError::BadKey {
            path: gguf.path().to_path_buf(),
            key: "general.architecture".into(),
            reason: format!("{arch:?} is not supported (only llama)"),
        });
    }
    let key = |k: &str| format!("llama.{k}");
    let n_layers = gguf.require_u32(&key("block_count"))?;
    let hidden_size = gguf.require_u32(&key("embedding_length"))?;
    let ffn_dim = gguf.require_u32(&key("feed_forward_length"))?;
    let n_heads = gguf.require_u32(&key("attention.head_count"))?;
    // llama.cpp's own default: no KV key means no grouped-query attention.
    let n_kv_heads = gguf
        .opt_u32(&key("attention.head_count_kv"))?
        .unwrap_or(n_heads);
    let bad = |k: &str, reason: String| ConvertError::BadKey {
        path: gguf.path().to_path_buf(),
        key: k.to_string(),
        reason,
    };
    if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        return Err(bad(
            &key("attention.head_count_kv"),
            format!("{n_kv_heads} KV heads do not divide {n_heads} heads"),
        ));
    }
    let head_dim = match gguf.opt_u32(&key("attention.key_length"))? {
        Some(d) => d,
        None if hidden_size % n_heads == 0 => hidden_size / n_heads,
        None => {
            return Err(bad(
                &key("attention.head_count"),
                format!("{n_heads} heads do not divide embedding_length {hidden_size}"),
            ));
        }
    };
    if let Some(rot) = gguf.opt_u32(&key("rope.dimension_count"))?
        && rot != head_dim
    {
        return Err(bad(
            &key("rope.dimension_count"),
            format!("partial rotary embedding ({rot} of {head_dim} dims) is not supported"),
        ));
    }
    let rope_theta = gguf.opt_f32(&key("rope.freq_base"))?.unwrap_or(10000.0);
    let rms_norm_eps = gguf.require_f32(&key("attention.layer_norm_rms_epsilon"))?;
    let context_length = gguf.require_u32(&key("context_length"))?;
    let rope_scaling = match gguf.opt_str(&key("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") => Some(RopeScaling {
            rope_type: "linear".into(),
            factor: gguf.require_f32(&key("rope.scaling.factor"))?,
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: gguf
                .opt_u32(&key("rope.scaling.original_context_length"))?,
        }),
        Some(other) => {
            return Err(bad(
                &key("rope.scaling.type"),
                format!("{other:?} is not supported (none, linear)"),
            ));
        }
    };
    if gguf.tensor("rope_freqs.weight").is_some() {
        return Err(ConvertError::BadTensor {
            path: gguf.path().to_path_buf(),
            tensor: "rope_freqs.weight".into(),
            reason: "per-frequency RoPE factors (Llama 3.1 scaling) are not supported".into(),
        });
    }
    let vocab_size = match gguf.opt_u32(&key("vocab_size"))? {
        Some(v) => v,
        None => match gguf.opt_str_array("tokenizer.ggml.tokens")? {
            Some(tokens) => tokens.len() as u32,
            None => {
                return Err(ConvertError::MissingKey {
                    path: gguf.path().to_path_buf(),
                    key: "llama.vocab_size (or tokenizer.ggml.tokens)".into(),
                });
            }
        },
    };
    let tokenizer_model = gguf.opt_str("tokenizer.ggml.model")?;
    let add_bos_token = gguf
        .opt_bool("tokenizer.ggml.add_bos_token")?
        // llama.cpp's defaults: SentencePiece vocabularies add BOS, byte-level BPE ones do not.
        .unwrap_or(tokenizer_model == Some("llama"));
    let bos_token_id = gguf.opt_u32("tokenizer.ggml.bos_token_id")?;
    let mut eos_token_ids: Vec<u32> = gguf
        .opt_u32("tokenizer.ggml.eos_token_id")?
        .into_iter()
        .collect();
    if let Some(eot) = gguf.opt_u32("tokenizer.ggml.eot_token_id")?
        && !eos_token_ids.contains(&eot)
    {
        eos_token_ids.push(eot);
    }
    let tie_word_embeddings = gguf.tensor("output.weight").is_none();
    Ok(ModelConfig {
        architecture: "llama".into(),
        n_layers,
        hidden_size,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn_dim,
        vocab_size,
        rope_theta,
        rope_scaling,
        rms_norm_eps,
        context_length,
        tie_word_embeddings,
        bos_token_id,
        eos_token_ids,
        add_bos_token,
    })
}

/// Opens a GGUF file as a conversion source.
pub fn open_gguf(path: &Path) -> Result<SourceModel, ConvertError> {
    let started = std::time::Instant::now();
    let gguf = GgufFile::open(path)?;
    tracing::debug!(
        "gguf header parsed in {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    let config = config_from_gguf(&gguf)?;

    let mut used = std::collections::HashSet::new();
    let blobs = plan_blobs(&config, path, |name, layer| {
        let gguf_name = gguf_tensor_name(name, layer);
        let Some(info) = gguf.tensor(&gguf_name) else {
            return Ok(None);
        };
        used.insert(gguf_name.clone());
        let unpermute_heads = match name {
            names::ATTN_Q => Some(config.n_heads),
            names::ATTN_K => Some(config.n_kv_heads),
            _ => None,
        };
        Ok(Some(PlannedTensor {
            name: name.to_string(),
            source_name: gguf_name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            file: 0,
            offset: info.file_offset,
            length: info.length,
            unpermute_heads,
        }))
    })?;
    if let Some(extra) = gguf.tensors().iter().find(|t| !used.contains(&t.name)) {
        return Err(ConvertError::BadTensor {
            path: path.to_path_buf(),
            tensor: extra.name.clone(),
            reason: "not part of a LLaMA model this converter understands".into(),
        });
    }

    let chat_template = gguf.opt_str("tokenizer.chat_template")?.map(str::to_string);
    let mut source = Map::new();
    source.insert("format".into(), Value::String("gguf".into()));
    if let Some(file_name) = path.file_name().and_then(|n| n.to_str()) {
        source.insert("file".into(), Value::String(file_name.into()));
    }
    if let Some(name) = gguf.opt_str("general.name")? {
        source.insert("name".into(), Value::String(name.into()));
    }
    source.insert(
        "converter".into(),
        Value::String(concat!("gdsllm-convert ", env!("CARGO_PKG_VERSION")).into()),
    );
    let file = File::open(path).map_err(|e| GgufError::Io {
        path: path.to_path_buf(),
        error: e,
    })?;
    Ok(SourceModel {
        config,
        tokenizer: TokenizerSource::Gguf(Box::new(gguf)),
        chat_template,
        source,
        blobs,
        files: vec![(path.to_path_buf(), file)],
    })
}
