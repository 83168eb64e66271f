//! Hugging Face directory (`config.json`, `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, `tokenizer.json`, `tokenizer_config.json`) →
//! [`SourceModel`]. Only safetensors headers are read here; tensor bytes are read later with
//! positioned reads, so shards are never loaded whole.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::Path;

use serde_json::{Map, Value};
use weights_format::{Architecture, DType, ModelConfig, RopeScaling, SlidingWindow};

use crate::error::ConvertError;
use crate::family::{self, FamilyTable, source_name};
use crate::source::{
    PlannedTensor, SourceModel, TokenizerSource, Transform, plan_blobs, take_rows,
};
use crate::tokenizer::chat_template_from_tokenizer_config;

/// safetensors refuses headers above 100 MB; so do we, before allocating.
const MAX_HEADER_LEN: u64 = 100_000_000;

fn read_json(path: &Path) -> Result<Value, ConvertError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConvertError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ConvertError::BadInput {
        path: path.to_path_buf(),
        reason: format!("not valid JSON: {e}"),
    })
}

/// The family of a `config.json`: from `architectures` (the model class), else from
/// `model_type`, else llama (the oldest configs name neither).
pub fn family_of(path: &Path, config: &Value) -> Result<&'static FamilyTable, ConvertError> {
    let bad = |key: &str, reason: String| ConvertError::BadKey {
        path: path.to_path_buf(),
        key: key.to_string(),
        reason,
    };
    let supported = || {
        family::FAMILIES
            .iter()
            .flat_map(|t| t.hf_classes)
            .copied()
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(classes) = config.get("architectures").and_then(Value::as_array)
        && let Some(class) = classes.first().and_then(Value::as_str)
    {
        return family::from_hf_class(class).ok_or_else(|| {
            bad(
                "architectures",
                format!("{class:?} is not supported (supported: {})", supported()),
            )
        });
    }
    let arch = match config.get("model_type").and_then(Value::as_str) {
        None | Some("llama" | "mistral") => Architecture::Llama,
        Some("qwen2") => Architecture::Qwen2,
        Some("qwen3") => Architecture::Qwen3,
        Some("gemma3" | "gemma3_text") => Architecture::Gemma3,
        Some("phi3") => Architecture::Phi3,
        Some(other) => {
            return Err(bad(
                "model_type",
                format!("{other:?} is not supported (supported: {})", supported()),
            ));
        }
    };
    Ok(family::table(arch))
}

/// Reads `config.json` into our config. Keys with a Hugging Face default may be absent.
pub fn config_from_hf(path: &Path, config: &Value) -> Result<ModelConfig, ConvertError> {
    let table = family_of(path, config)?;
    let arch = table.arch;
    // Gemma3ForConditionalGeneration keeps the language model's config in `text_config`.
    let config = match config.get("text_config") {
        Some(text) if text.is_object() => text,
        _ => config,
    };
    let missing = |key: &str| ConvertError::MissingKey {
        path: path.to_path_buf(),
        key: key.to_string(),
    };
    let bad = |key: &str, reason: &str| ConvertError::BadKey {
        path: path.to_path_buf(),
        key: key.to_string(),
        reason: reason.to_string(),
    };
    let opt_u32 = |key: &str| -> Result<Option<u32>, ConvertError> {
        match config.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| bad(key, "expected an integer in 0..2^32")),
        }
    };
    let req_u32 = |key: &str| opt_u32(key)?.ok_or_else(|| missing(key));
    let opt_f32 = |obj: &Value, key: &str| -> Result<Option<f32>, ConvertError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|v| Some(v as f32))
                .ok_or_else(|| bad(key, "expected a number")),
        }
    };
    let opt_bool = |key: &str| -> Result<Option<bool>, ConvertError> {
        match config.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(bad(key, "expected true or false")),
        }
    };
    let opt_factors = |obj: &Value, key: &str| -> Result<Option<Vec<f32>>, ConvertError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_f64().map(|v| v as f32))
                .collect::<Option<Vec<f32>>>()
                .map(Some)
                .ok_or_else(|| bad(key, "expected a list of numbers")),
            Some(_) => Err(bad(key, "expected a list of numbers")),
        }
    };

    let hidden_size = req_u32("hidden_size")?;
    let ffn_dim = req_u32("intermediate_size")?;
    let n_layers = req_u32("num_hidden_layers")?;
    let n_heads = req_u32("num_attention_heads")?;
    let n_kv_heads = opt_u32("num_key_value_heads")?.unwrap_or(n_heads);
    if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        return Err(bad(
            "num_key_value_heads",
            &format!("{n_kv_heads} KV heads do not divide {n_heads} heads"),
        ));
    }
    let head_dim = match opt_u32("head_dim")? {
        Some(d) => d,
        None if hidden_size % n_heads == 0 => hidden_size / n_heads,
        None => return Err(missing("head_dim")),
    };
    if let Some(p) = opt_f32(config, "partial_rotary_factor")?
        && p != 1.0
    {
        return Err(bad(
            "partial_rotary_factor",
            &format!("{p}: partial rotary embedding is not supported"),
        ));
    }
    // transformers 5 moved rope_theta and rope_scaling into `rope_parameters`, which for
    // models with two kinds of layers (Gemma 3) holds one entry per kind.
    let rope_parameters = config.get("rope_parameters").filter(|v| v.is_object());
    let global_rope = rope_parameters.map(|p| p.get("full_attention").unwrap_or(p));
    let local_rope = rope_parameters.and_then(|p| p.get("sliding_attention"));
    let rope_theta = match global_rope {
        Some(p) => opt_f32(p, "rope_theta")?,
        None => None,
    }
    .or(opt_f32(config, "rope_theta")?)
    .unwrap_or(if arch == Architecture::Gemma3 {
        1_000_000.0
    } else {
        10000.0
    });
    let scaling = global_rope
        .or(config.get("rope_scaling"))
        .filter(|v| v.is_object());
    let original_max = opt_u32("original_max_position_embeddings")?;
    let context_length = req_u32("max_position_embeddings")?;
    let rope_scaling = match scaling {
        None => None,
        Some(s) => {
            let rope_type = s
                .get("rope_type")
                .or(s.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            match rope_type {
                "default" => None,
                "linear" | "llama3" => Some(RopeScaling {
                    low_freq_factor: opt_f32(s, "low_freq_factor")?,
                    high_freq_factor: opt_f32(s, "high_freq_factor")?,
                    original_max_position_embeddings: match s
                        .get("original_max_position_embeddings")
                    {
                        None | Some(Value::Null) => None,
                        Some(v) => {
                            Some(v.as_u64().and_then(|v| u32::try_from(v).ok()).ok_or_else(
                                || {
                                    bad(
                                        "rope_scaling.original_max_position_embeddings",
                                        "expected an integer in 0..2^32",
                                    )
                                },
                            )?)
                        }
                    },
                    ..RopeScaling::new(
                        rope_type,
                        opt_f32(s, "factor")?.ok_or_else(|| missing("rope_scaling.factor"))?,
                    )
                }),
                // Phi-3's ("su" is its old name).
                "longrope" | "su" => {
                    let original = opt_u32("original_max_position_embeddings")?
                        .or(original_max)
                        .ok_or_else(|| missing("original_max_position_embeddings"))?;
                    let scale = context_length as f32 / original.max(1) as f32;
                    // Hugging Face's default when the config gives none.
                    let attention_factor = opt_f32(s, "attention_factor")?.unwrap_or_else(|| {
                        if scale <= 1.0 {
                            1.0
                        } else {
                            (1.0 + scale.ln() / (original as f32).ln()).sqrt()
                        }
                    });
                    Some(RopeScaling {
                        short_factor: opt_factors(s, "short_factor")?,
                        long_factor: opt_factors(s, "long_factor")?,
                        original_max_position_embeddings: Some(original),
                        attention_factor: Some(attention_factor),
                        ..RopeScaling::new("longrope", scale)
                    })
                }
                other => {
                    return Err(bad(
                        "rope_scaling.rope_type",
                        &format!("{other:?} is not supported (default, linear, llama3, longrope)"),
                    ));
                }
            }
        }
    };
    let rms_norm_eps = opt_f32(config, "rms_norm_eps")?
        .or(if arch == Architecture::Gemma3 {
            Some(1e-6)
        } else {
            None
        })
        .ok_or_else(|| missing("rms_norm_eps"))?;
    let vocab_size = req_u32("vocab_size")?;
    let tie_word_embeddings = opt_bool("tie_word_embeddings")?
        // Gemma's configs leave it out and mean true.
        .unwrap_or(arch == Architecture::Gemma3);
    let bos_token_id = opt_u32("bos_token_id")?;
    let eos_token_ids = token_ids(config.get("eos_token_id"))
        .ok_or_else(|| bad("eos_token_id", "expected an integer or a list of integers"))?;
    let rules = arch.rules();
    let mut out = ModelConfig {
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
        add_bos_token: false,
        ..ModelConfig::of_family(arch)
    };
    let window = opt_u32("sliding_window")?;
    match arch {
        Architecture::Llama | Architecture::Phi3 => {
            if let Some(w) = window {
                // llama.cpp converts these as full-attention models (Mistral 7B v0.1, Phi-3);
                // the two agree on every context up to the window.
                tracing::warn!(
                    "{}: sliding_window {w} is ignored, as llama.cpp does: contexts longer than \
                     {w} positions will differ from the original model",
                    path.display()
                );
            }
        }
        Architecture::Qwen2 | Architecture::Qwen3 => {
            if opt_bool("use_sliding_window")? == Some(true) {
                return Err(bad(
                    "use_sliding_window",
                    "sliding-window attention is not supported for this family",
                ));
            }
            if opt_bool("attention_bias")? == Some(!rules.attention_bias) {
                return Err(bad(
                    "attention_bias",
                    &format!(
                        "{} models have attention_bias {}",
                        arch, rules.attention_bias
                    ),
                ));
            }
        }
        Architecture::Gemma3 => {
            if let Some(act) = config
                .get("hidden_activation")
                .or(config.get("hidden_act"))
                .and_then(Value::as_str)
                && act != "gelu_pytorch_tanh"
            {
                return Err(bad(
                    "hidden_activation",
                    &format!("{act:?} is not supported (gelu_pytorch_tanh)"),
                ));
            }
            if config
                .get("attn_logit_softcapping")
                .is_some_and(|v| !v.is_null())
            {
                return Err(bad(
                    "attn_logit_softcapping",
                    "attention logit soft-capping is not supported (Gemma 3 has none)",
                ));
            }
            out.embedding_scale = (hidden_size as f32).sqrt();
            if let Some(q) = opt_f32(config, "query_pre_attn_scalar")?
                && q != head_dim as f32
            {
                out.attention_scale = Some(1.0 / q.sqrt());
            }
            out.final_logit_softcap = opt_f32(config, "final_logit_softcapping")?;
            if let Some(size) = window {
                let layers: Vec<u32> = match config.get("layer_types").and_then(Value::as_array) {
                    Some(types) => {
                        if types.len() != n_layers as usize {
                            return Err(bad(
                                "layer_types",
                                &format!("{} entries for {n_layers} layers", types.len()),
                            ));
                        }
                        (0..n_layers)
                            .filter(|&l| types[l as usize] == "sliding_attention")
                            .collect()
                    }
                    None => {
                        let n = opt_u32("sliding_window_pattern")?.unwrap_or(6);
                        (0..n_layers).filter(|&l| n == 0 || l % n < n - 1).collect()
                    }
                };
                let local_theta = match local_rope {
                    Some(p) => opt_f32(p, "rope_theta")?,
                    None => None,
                }
                .or(opt_f32(config, "rope_local_base_freq")?)
                .unwrap_or(10000.0);
                if !layers.is_empty() {
                    out.sliding_window = Some(SlidingWindow {
                        size,
                        layers,
                        rope_theta: local_theta,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// `eos_token_id` is an int, a list of ints, or absent.
fn token_ids(value: Option<&Value>) -> Option<Vec<u32>> {
    match value {
        None | Some(Value::Null) => Some(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
            .collect(),
        Some(v) => v
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .map(|v| vec![v]),
    }
}

/// One tensor found in a safetensors header.
#[derive(Debug, Clone)]
struct HfTensor {
    file: usize,
    dtype: DType,
    shape: Vec<u64>,
    offset: u64,
    length: u64,
}

/// Reads the header of one safetensors file and records its tensors.
fn read_safetensors_header(
    path: &Path,
    file_index: usize,
    tensors: &mut HashMap<String, HfTensor>,
) -> Result<File, ConvertError> {
    let bad = |reason: String| ConvertError::BadInput {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = File::open(path).map_err(|e| ConvertError::io(path, e))?;
    let file_len = file
        .metadata()
        .map_err(|e| ConvertError::io(path, e))?
        .len();
    if file_len < 8 {
        return Err(bad(format!(
            "truncated at offset 0: {file_len} bytes, a safetensors header length needs 8"
        )));
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|e| ConvertError::io(path, e))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_LEN || header_len > file_len - 8 {
        return Err(bad(format!(
            "offset 0: header length {header_len} exceeds the file ({file_len} bytes) or 100 MB"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| ConvertError::io(path, e))?;
    // Deserialising the crate's Metadata validates that offsets are contiguous and that each
    // tensor's byte range matches its dtype and shape.
    let metadata: safetensors::tensor::Metadata = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("offset 8: invalid safetensors header: {e}")))?;
    let data_start = 8 + header_len;
    if data_start + metadata.data_len() as u64 != file_len {
        return Err(bad(format!(
            "header describes {} bytes of data after offset {data_start}, the file has {}",
            metadata.data_len(),
            file_len - data_start
        )));
    }
    for (name, info) in metadata.tensors() {
        let dtype = match info.dtype {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::Bf16,
            other => {
                // Only tensors we use need a supported dtype; others are rejected later.
                tracing::debug!("{}: tensor {name} has dtype {other:?}", path.display());
                continue;
            }
        };
        let (start, end) = info.data_offsets;
        tensors.insert(
            name,
            HfTensor {
                file: file_index,
                dtype,
                shape: info.shape.iter().map(|&d| d as u64).collect(),
                offset: data_start + start as u64,
                length: (end - start) as u64,
            },
        );
    }
    Ok(file)
}

/// Tensor names present in the shards, including those with unsupported dtypes.
fn all_tensor_names(path: &Path) -> Result<Vec<String>, ConvertError> {
    let mut file = File::open(path).map_err(|e| ConvertError::io(path, e))?;
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|e| ConvertError::io(path, e))?;
    let mut header = vec![0u8; u64::from_le_bytes(len_bytes).min(MAX_HEADER_LEN) as usize];
    file.read_exact(&mut header)
        .map_err(|e| ConvertError::io(path, e))?;
    let map: BTreeMap<String, Value> =
        serde_json::from_slice(&header).map_err(|e| ConvertError::BadInput {
            path: path.to_path_buf(),
            reason: format!("offset 8: invalid safetensors header: {e}"),
        })?;
    Ok(map.into_keys().filter(|k| k != "__metadata__").collect())
}

/// Opens a Hugging Face LLaMA directory as a conversion source.
pub fn open_hf_dir(dir: &Path) -> Result<SourceModel, ConvertError> {
    let config_path = dir.join("config.json");
    let config_json = read_json(&config_path)?;
    let mut config = config_from_hf(&config_path, &config_json)?;

    // generation_config.json may list further stop ids (e.g. end-of-turn tokens).
    let generation_path = dir.join("generation_config.json");
    if generation_path.is_file() {
        let generation = read_json(&generation_path)?;
        for id in token_ids(generation.get("eos_token_id")).unwrap_or_default() {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
    }

    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer_json =
        std::fs::read(&tokenizer_path).map_err(|e| ConvertError::io(&tokenizer_path, e))?;
    let tokenizer_config_path = dir.join("tokenizer_config.json");
    let tokenizer_config = if tokenizer_config_path.is_file() {
        Some(read_json(&tokenizer_config_path)?)
    } else {
        None
    };
    if let Some(add_bos) = tokenizer_config
        .as_ref()
        .and_then(|c| c.get("add_bos_token"))
        .and_then(Value::as_bool)
    {
        config.add_bos_token = add_bos;
    }
    let template_file = dir.join("chat_template.jinja");
    let chat_template = if template_file.is_file() {
        Some(
            std::fs::read_to_string(&template_file)
                .map_err(|e| ConvertError::io(&template_file, e))?,
        )
    } else {
        tokenizer_config
            .as_ref()
            .and_then(chat_template_from_tokenizer_config)
    };

    // The shard list: from the index when sharded, else the single file.
    let index_path = dir.join("model.safetensors.index.json");
    let shard_names: Vec<String> = if index_path.is_file() {
        let index = read_json(&index_path)?;
        let map = index
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ConvertError::MissingKey {
                path: index_path.clone(),
                key: "weight_map".into(),
            })?;
        let mut shards: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        shards.sort();
        shards.dedup();
        shards
    } else {
        vec!["model.safetensors".to_string()]
    };
    let mut files = Vec::new();
    let mut tensors = HashMap::new();
    let mut names_seen = Vec::new();
    for (i, shard) in shard_names.iter().enumerate() {
        if shard.contains('/') || shard.contains("..") {
            return Err(ConvertError::BadInput {
                path: index_path.clone(),
                reason: format!("shard name {shard:?} is not a plain file name"),
            });
        }
        let path = dir.join(shard);
        let file = read_safetensors_header(&path, i, &mut tensors)?;
        names_seen.extend(all_tensor_names(&path)?);
        files.push((path, file));
    }

    let table = family_of(&config_path, &config_json)?;
    // Gemma3ForConditionalGeneration nests the language model: `language_model.model.*`
    // (transformers 4) or `model.language_model.*` (transformers 5); its vision tower and
    // projector are left out.
    let (prefix, lm_head) = if names_seen
        .iter()
        .any(|n| n.starts_with("language_model.model."))
    {
        ("language_model.model.", "language_model.lm_head.weight")
    } else if names_seen
        .iter()
        .any(|n| n.starts_with("model.language_model."))
    {
        ("model.language_model.", "lm_head.weight")
    } else {
        ("model.", "lm_head.weight")
    };
    let hf_name = |theirs: &str, layer: Option<u32>| -> String {
        let name = source_name(theirs, layer);
        if name == "lm_head.weight" {
            lm_head.to_string()
        } else {
            match name.strip_prefix("model.") {
                Some(rest) => format!("{prefix}{rest}"),
                None => name,
            }
        }
    };
    let is_vision = |n: &str| {
        [
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ]
        .iter()
        .any(|p| n.starts_with(p))
    };
    // The LM head absent means tied, whatever config.json says.
    if !names_seen.iter().any(|n| n == lm_head) {
        config.tie_word_embeddings = true;
    }
    let mut used = std::collections::HashSet::new();
    let blobs = plan_blobs(&config, dir, |name, layer| {
        let entry = FamilyTable::find(table.hf, name).ok_or_else(|| ConvertError::BadInput {
            path: dir.to_path_buf(),
            reason: format!(
                "the {} table has no Hugging Face name for {name}",
                table.arch
            ),
        })?;
        let hf = hf_name(entry.theirs, layer);
        let Some(t) = tensors.get(&hf) else {
            if names_seen.contains(&hf) {
                return Err(ConvertError::BadTensor {
                    path: dir.to_path_buf(),
                    tensor: hf,
                    reason: "dtype is not F32, F16 or BF16".into(),
                });
            }
            return Ok(None);
        };
        used.insert(hf.clone());
        // Every canonical norm name ends in `_norm`.
        let transform = if table.hf_norms_minus_one && name.ends_with("_norm") {
            Transform::AddOne
        } else {
            Transform::Keep
        };
        let planned = PlannedTensor {
            name: name.to_string(),
            source_name: hf,
            dtype: t.dtype,
            shape: t.shape.clone(),
            file: t.file,
            offset: t.offset,
            length: t.length,
            transform,
        };
        take_rows(planned, entry.rows, &config, dir).map(Some)
    })?;
    let mut unknown: Vec<&String> = names_seen
        .iter()
        .filter(|n| !used.contains(*n))
        // Precomputed RoPE tables and a tied head's duplicate carry nothing we need.
        .filter(|n| !n.ends_with("rotary_emb.inv_freq") && n.as_str() != lm_head)
        .filter(|n| !is_vision(n))
        .collect();
    unknown.sort();
    if let Some(extra) = unknown.first() {
        return Err(ConvertError::BadTensor {
            path: dir.to_path_buf(),
            tensor: extra.to_string(),
            reason: format!(
                "not part of a {} model this converter understands",
                table.arch
            ),
        });
    }

    let mut source = Map::new();
    source.insert("format".into(), Value::String("huggingface".into()));
    if let Some(name) = dir.file_name().and_then(|n| n.to_str()) {
        source.insert("directory".into(), Value::String(name.into()));
    }
    source.insert(
        "converter".into(),
        Value::String(concat!("gdsllm-convert ", env!("CARGO_PKG_VERSION")).into()),
    );
    Ok(SourceModel {
        config,
        tokenizer: TokenizerSource::Json(tokenizer_json),
        chat_template,
        source,
        blobs,
        files,
    })
}
