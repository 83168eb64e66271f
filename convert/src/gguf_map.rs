//! GGUF (llama.cpp's `llama`, `qwen2`, `qwen3`, `gemma3` and `phi3` architectures) →
//! [`SourceModel`]: config from the `<arch>.*` and `tokenizer.ggml.*` keys, tensors through the
//! family's table in [`crate::family`].
//!
//! The order of the checks is the one a user wants: the architecture first (a file of a
//! family we do not know fails on that, not on a detail of it), then every tensor type we
//! cannot carry, all in one message, then the config and the tensors.

use std::fs::File;
use std::path::Path;

use serde_json::{Map, Value};
use weights_format::{
    Activation, Architecture, DType, ModelConfig, RopeScaling, SlidingWindow, names,
};

use crate::error::ConvertError;
use crate::family::{self, FamilyTable, source_name};
use crate::gguf::{GgufError, GgufFile};
use crate::source::{
    PlannedTensor, SourceModel, TokenizerSource, Transform, plan_blobs, take_rows,
};

/// llama.cpp's per-frequency RoPE divisors (Llama 3.1 scaling).
const ROPE_FREQS: &str = "rope_freqs.weight";
/// Phi-3's longrope factors.
const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";
const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";
/// llama.cpp's default for Gemma 3 files without `sliding_window_pattern`: five windowed
/// layers, then one global.
const GEMMA3_SWA_PATTERN: u32 = 6;
/// GGUF `tokenizer.ggml.token_type` of control tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// Texts of control tokens that end a turn (llama.cpp's end-of-generation list, the entries
/// of the families converted here).
const END_OF_TURN_TEXTS: [&str; 6] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<｜end▁of▁sentence｜>",
];
/// llama.cpp's default RoPE base of the windowed layers (`rope_freq_base_train_swa`).
const DEFAULT_SWA_ROPE_THETA: f32 = 10000.0;

/// The GGUF tensor name of one of our llama tensors (kept for tools and tests).
pub fn gguf_tensor_name(name: &str, layer: Option<u32>) -> String {
    match layer {
        Some(l) => format!("blk.{l}.{name}.weight"),
        None => format!("{name}.weight"),
    }
}

/// The family of `general.architecture`; anything else is an error naming what is supported.
pub fn architecture_of(gguf: &GgufFile) -> Result<Architecture, ConvertError> {
    let name = gguf.require_str("general.architecture")?;
    Architecture::from_name(name).ok_or_else(|| ConvertError::BadKey {
        path: gguf.path().to_path_buf(),
        key: "general.architecture".into(),
        reason: format!(
            "{name:?} is not supported (supported: {})",
            Architecture::names()
        ),
    })
}

/// Reads the model config from GGUF metadata. A missing required key is an error naming it.
pub fn config_from_gguf(gguf: &GgufFile) -> Result<ModelConfig, ConvertError> {
    let arch = architecture_of(gguf)?;
    let key = |k: &str| format!("{}.{k}", arch.name());
    let bad = |k: &str, reason: String| ConvertError::BadKey {
        path: gguf.path().to_path_buf(),
        key: k.to_string(),
        reason,
    };
    let n_layers = gguf.require_u32(&key("block_count"))?;
    let hidden_size = gguf.require_u32(&key("embedding_length"))?;
    let ffn_dim = gguf.require_u32(&key("feed_forward_length"))?;
    let n_heads = gguf.require_u32(&key("attention.head_count"))?;
    // llama.cpp's own default: no KV key means no grouped-query attention.
    let n_kv_heads = gguf
        .opt_u32(&key("attention.head_count_kv"))?
        .unwrap_or(n_heads);
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
    if let Some(v) = gguf.opt_u32(&key("attention.value_length"))?
        && v != head_dim
    {
        return Err(bad(
            &key("attention.value_length"),
            format!("{v} differs from the key length {head_dim}; both must be equal"),
        ));
    }
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
            original_max_position_embeddings: gguf
                .opt_u32(&key("rope.scaling.original_context_length"))?,
            ..RopeScaling::new("linear", gguf.require_f32(&key("rope.scaling.factor"))?)
        }),
        Some(other) => {
            return Err(bad(
                &key("rope.scaling.type"),
                format!("{other:?} is not supported (none, linear)"),
            ));
        }
    };
    let vocab_size = match gguf.opt_u32(&key("vocab_size"))? {
        Some(v) => v,
        None => match gguf.opt_str_array("tokenizer.ggml.tokens")? {
            Some(tokens) => tokens.len() as u32,
            None => {
                return Err(ConvertError::MissingKey {
                    path: gguf.path().to_path_buf(),
                    key: format!("{} (or tokenizer.ggml.tokens)", key("vocab_size")),
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
    if arch != Architecture::Llama {
        // Chat models of these families end a turn with a control token that the file does not
        // always name (Gemma 3's `<end_of_turn>`); llama.cpp finds such tokens by their text,
        // and so do we. (Llama files are left as they were converted before.)
        if let (Some(tokens), Some(types)) = (
            gguf.opt_str_array("tokenizer.ggml.tokens")?,
            gguf.opt_int_array("tokenizer.ggml.token_type")?,
        ) {
            for (id, (text, kind)) in tokens.iter().zip(&types).enumerate() {
                if *kind == TOKEN_TYPE_CONTROL
                    && END_OF_TURN_TEXTS.contains(text)
                    && !eos_token_ids.contains(&(id as u32))
                {
                    eos_token_ids.push(id as u32);
                }
            }
        }
    }
    let mut config = ModelConfig {
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
        tie_word_embeddings: gguf.tensor("output.weight").is_none()
            && !gguf
                .unsupported_tensors()
                .iter()
                .any(|t| t.0 == "output.weight"),
        bos_token_id,
        eos_token_ids,
        add_bos_token,
        ..ModelConfig::of_family(arch)
    };
    match arch {
        Architecture::Llama => {
            if let Some(factors) = read_f32_vector(gguf, ROPE_FREQS)? {
                if config.rope_scaling.is_some() {
                    return Err(bad(
                        &key("rope.scaling.type"),
                        format!("set together with the {ROPE_FREQS} tensor; expected one"),
                    ));
                }
                config.rope_scaling = Some(RopeScaling {
                    freq_factors: Some(factors),
                    ..RopeScaling::new("freq_factors", 1.0)
                });
            }
        }
        Architecture::Qwen2 | Architecture::Qwen3 => {}
        Architecture::Gemma3 => gemma3_config(gguf, &mut config)?,
        Architecture::Phi3 => {
            let long = read_f32_vector(gguf, ROPE_FACTORS_LONG)?;
            let short = read_f32_vector(gguf, ROPE_FACTORS_SHORT)?;
            if long.is_some() || short.is_some() {
                let original = gguf.require_u32(&key("rope.scaling.original_context_length"))?;
                config.rope_scaling = Some(RopeScaling {
                    short_factor: short,
                    long_factor: long,
                    original_max_position_embeddings: Some(original),
                    attention_factor: gguf.opt_f32(&key("rope.scaling.attn_factor"))?,
                    ..RopeScaling::new("longrope", context_length as f32 / original.max(1) as f32)
                });
            }
            // llama.cpp turns Phi-3's sliding window off (and warns); so do we, so that both
            // compute the same thing. It matters only beyond the window (2047 positions).
        }
    }
    Ok(config)
}

/// Gemma 3's extras, with llama.cpp's defaults where the file leaves them out.
fn gemma3_config(gguf: &GgufFile, config: &mut ModelConfig) -> Result<(), ConvertError> {
    let key = |k: &str| format!("gemma3.{k}");
    config.activation = Activation::GeluTanh;
    config.embedding_scale = (config.hidden_size as f32).sqrt();
    // llama.cpp: the 27B model (62 layers) scales queries by 1/sqrt(dim/heads) (its
    // query_pre_attn_scalar), the others by the default 1/sqrt(head_dim).
    if config.n_layers == 62 {
        config.attention_scale = Some(1.0 / ((config.hidden_size / config.n_heads) as f32).sqrt());
    }
    config.final_logit_softcap = gguf
        .opt_f32(&key("final_logit_softcapping"))?
        .filter(|&c| c != 0.0);
    let window = gguf.opt_u32(&key("attention.sliding_window"))?.unwrap_or(0);
    if window > 0 {
        let pattern_key = key("attention.sliding_window_pattern");
        let layers: Vec<u32> = match gguf.get(&pattern_key) {
            Some(crate::gguf::GgufValue::Array(_, items)) => {
                if items.len() != config.n_layers as usize {
                    return Err(ConvertError::BadKey {
                        path: gguf.path().to_path_buf(),
                        key: pattern_key,
                        reason: format!("{} entries for {} layers", items.len(), config.n_layers),
                    });
                }
                (0..config.n_layers)
                    .filter(|&l| matches!(items[l as usize], crate::gguf::GgufValue::Bool(true)))
                    .collect()
            }
            _ => {
                let n = gguf.opt_u32(&pattern_key)?.unwrap_or(GEMMA3_SWA_PATTERN);
                // llama.cpp's set_swa_pattern: windowed unless the last of each group of n.
                (0..config.n_layers)
                    .filter(|&l| n == 0 || l % n < n - 1)
                    .collect()
            }
        };
        if !layers.is_empty() {
            config.sliding_window = Some(SlidingWindow {
                size: window,
                layers,
                rope_theta: gguf
                    .opt_f32(&key("rope.freq_base_swa"))?
                    .unwrap_or(DEFAULT_SWA_ROPE_THETA),
            });
        }
    }
    Ok(())
}

/// A small f32 tensor's values (RoPE factors), or None when the file has no such tensor.
fn read_f32_vector(gguf: &GgufFile, name: &str) -> Result<Option<Vec<f32>>, ConvertError> {
    let Some(info) = gguf.tensor(name) else {
        return Ok(None);
    };
    if info.dtype != DType::F32 || info.shape.len() != 1 {
        return Err(ConvertError::BadTensor {
            path: gguf.path().to_path_buf(),
            tensor: name.into(),
            reason: format!("{} {:?}; expected a vector of f32", info.dtype, info.shape),
        });
    }
    let mut bytes = Vec::new();
    gguf.read_tensor(info, &mut bytes)?;
    Ok(Some(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
    ))
}

/// Opens a GGUF file as a conversion source: a single file, or the first part of a split
/// GGUF with its other parts ([`GgufFile::open_model`]).
pub fn open_gguf(path: &Path) -> Result<SourceModel, ConvertError> {
    let started = std::time::Instant::now();
    let gguf = GgufFile::open_model(path)?;
    tracing::debug!(
        "gguf header parsed in {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    let arch = architecture_of(&gguf)?;
    gguf.check_tensor_types()?;
    let config = config_from_gguf(&gguf)?;
    let table = family::table(arch);

    let mut used = std::collections::HashSet::new();
    for consumed in [ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT] {
        used.insert(consumed.to_string());
    }
    let blobs = plan_blobs(&config, path, |name, layer| {
        plan_gguf_tensor(&gguf, table, &config, name, layer, &mut used)
    })?;
    if let Some(extra) = gguf.tensors().iter().find(|t| !used.contains(&t.name)) {
        return Err(ConvertError::BadTensor {
            path: path.to_path_buf(),
            tensor: extra.name.clone(),
            reason: format!("not part of a {arch} model this converter understands"),
        });
    }

    let chat_template = gguf.opt_str("tokenizer.chat_template")?.map(str::to_string);
    let mut source = Map::new();
    source.insert("format".into(), Value::String("gguf".into()));
    if let Some(file_name) = path.file_name().and_then(|n| n.to_str()) {
        // A split GGUF is named as the file its parts merge into, so that both convert to
        // the same bytes.
        let file_name = match crate::gguf::split_name(file_name).filter(|_| gguf.is_split()) {
            Some(split) => split.merged(),
            None => file_name.to_string(),
        };
        source.insert("file".into(), Value::String(file_name));
    }
    if let Some(name) = gguf.opt_str("general.name")? {
        source.insert("name".into(), Value::String(name.into()));
    }
    source.insert(
        "converter".into(),
        Value::String(concat!("gdsllm-convert ", env!("CARGO_PKG_VERSION")).into()),
    );
    let files = gguf
        .part_paths()
        .map(|part| {
            File::open(part)
                .map(|file| (part.to_path_buf(), file))
                .map_err(|e| GgufError::Io {
                    path: part.to_path_buf(),
                    error: e,
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SourceModel {
        config,
        tokenizer: TokenizerSource::Gguf(Box::new(gguf)),
        chat_template,
        source,
        blobs,
        files,
    })
}

/// Where our tensor `name` of `layer` lies in the GGUF, by the family's table.
fn plan_gguf_tensor(
    gguf: &GgufFile,
    table: &FamilyTable,
    config: &ModelConfig,
    name: &str,
    layer: Option<u32>,
    used: &mut std::collections::HashSet<String>,
) -> Result<Option<PlannedTensor>, ConvertError> {
    let entry = FamilyTable::find(table.gguf, name).ok_or_else(|| ConvertError::BadInput {
        path: gguf.path().to_path_buf(),
        reason: format!("the {} table has no GGUF name for {name}", table.arch),
    })?;
    let gguf_name = source_name(entry.theirs, layer);
    let Some(info) = gguf.tensor(&gguf_name) else {
        return Ok(None);
    };
    used.insert(gguf_name.clone());
    let transform = match name {
        names::ATTN_Q if table.gguf_permutes_qk => Transform::UnpermuteHeads(config.n_heads),
        names::ATTN_K if table.gguf_permutes_qk => Transform::UnpermuteHeads(config.n_kv_heads),
        _ => Transform::Keep,
    };
    let planned = PlannedTensor {
        name: name.to_string(),
        source_name: gguf_name,
        dtype: info.dtype,
        shape: info.shape.clone(),
        file: info.part,
        offset: info.file_offset,
        length: info.length,
        transform,
    };
    take_rows(planned, entry.rows, config, gguf.path()).map(Some)
}
