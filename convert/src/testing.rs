//! Test support: a tiny random LLaMA that can be written both as a Hugging Face directory
//! (safetensors + config.json) and as a GGUF laid out the way llama.cpp's converter lays it
//! out (Q/K rows permuted), so tests can check that both convert to the same model; a model of
//! any family's config with pseudo-random weights written straight into our format
//! ([`write_random_model`]), for tests that compare backends on every family; and small models
//! in a llama.cpp-style k-quant mix with their f32 twins, for the kernels' tests.

use std::path::{Path, PathBuf};

use serde_json::json;
use weights_format::{DType, quant};

use crate::gguf::{GgufValue, GgufValueType};
use crate::gguf_writer::{GgufBuilder, permute_rows_like_llama_cpp};

/// A xorshift64 stream of deterministic test values, one stream per seed: test inputs and
/// fuzz cases are reproducible from their seed.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> XorShift {
        // Never 0, which xorshift would keep forever.
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The next value in `0 .. n` (0 for `n` = 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// The next value in [-0.5, 0.5).
    pub fn centered(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    /// The next value in (0, 1): never 0, so that its logarithm is finite.
    pub fn open_unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
}

/// `n` deterministic values in [-0.5, 0.5) for test weights, a stream per `seed`.
pub fn pseudo_random(seed: u64, n: u64) -> Vec<f32> {
    let mut rng = XorShift::new(seed);
    (0..n).map(|_| rng.centered()).collect()
}

/// Writes a model of `config` (any family) at `dir` with deterministic pseudo-random weights
/// (stream `seed`): matrices in ±0.5·`1/√cols` stored as `matrix_dtype`, norm weights 1 ± 0.25
/// and biases in ±0.25 as f32, every tensor the format lays out for the config, and the
/// synthetic byte-level tokenizer of `gdsllm synth` (the vocabulary must hold its
/// [`crate::synth::MIN_VOCAB`] tokens). Not meant to say anything: only to make every step of
/// a family's pass matter numerically.
pub fn write_random_model(
    dir: &Path,
    config: &weights_format::ModelConfig,
    matrix_dtype: DType,
    seed: u64,
) -> Result<weights_format::Model, weights_format::FormatError> {
    use weights_format::layout::{self, TensorRole};
    let mut writer = weights_format::ModelWriter::create(dir)?;
    let mut stream = 0u64;
    for file in layout::blob_files(config.n_layers) {
        let kind = layout::blob_kind(&file).expect("layout names its blobs");
        let mut blob = writer.begin_blob(&file)?;
        for spec in layout::blob_tensors(config, kind) {
            stream += 1;
            let n: u64 = spec.shape.iter().product();
            let values = pseudo_random(seed.wrapping_mul(1000).wrapping_add(stream), n);
            let (dtype, values): (DType, Vec<f32>) = match spec.role {
                TensorRole::Norm => (DType::F32, values.iter().map(|v| 1.0 + v / 2.0).collect()),
                TensorRole::Bias => (DType::F32, values.iter().map(|v| v / 2.0).collect()),
                TensorRole::Matrix => {
                    let cols = *spec.shape.last().expect("matrices have columns") as f32;
                    (
                        matrix_dtype,
                        values.iter().map(|v| v / cols.sqrt()).collect(),
                    )
                }
            };
            let mut bytes = Vec::new();
            quant::quantize(dtype, &values, &mut bytes).map_err(|e| {
                weights_format::FormatError::Writer {
                    reason: format!("{}: {e}", spec.name),
                }
            })?;
            blob.write_tensor(spec.name, dtype, &spec.shape, &bytes)?;
        }
        blob.finish()?;
    }
    writer.add_file(
        "tokenizer.json",
        crate::synth::tokenizer_json(config.vocab_size).as_bytes(),
    )?;
    let mut source = serde_json::Map::new();
    source.insert(
        "generator".into(),
        "gdsllm_convert::testing::write_random_model".into(),
    );
    source.insert("seed".into(), seed.into());
    writer.finish(config.clone(), "tokenizer.json", None, source)
}

/// A small LLaMA with deterministic pseudo-random f32 weights, named as in Hugging Face.
#[derive(Debug, Clone)]
pub struct TinyLlama {
    pub hidden_size: u32,
    pub n_layers: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub ffn_dim: u32,
    pub vocab_size: u32,
    pub tied: bool,
    /// (Hugging Face name, row-major shape, values)
    pub tensors: Vec<(String, Vec<u64>, Vec<f32>)>,
}

impl TinyLlama {
    /// dim 64, 2 layers, 4 heads of 16, 2 KV heads, FFN 96, vocab 48.
    pub fn new(seed: u64, tied: bool) -> TinyLlama {
        TinyLlama::with_dims(seed, tied, 64, 96)
    }

    /// [`TinyLlama::new`] with another width and FFN size (4 heads of `dim / 4`): dim 256 and
    /// FFN 512 make every row whole 256-value super-blocks, for the k-quants.
    pub fn with_dims(seed: u64, tied: bool, dim: u64, ffn: u64) -> TinyLlama {
        let (layers, heads, kv_heads, vocab) = (2u32, 4u64, 2u64, 48u64);
        let head_dim = dim / heads;
        let mut rng = XorShift::new(seed);
        let mut random = |shape: &[u64], scale: f32| -> Vec<f32> {
            let n: u64 = shape.iter().product();
            (0..n).map(|_| rng.centered() * scale).collect()
        };
        let mut tensors = Vec::new();
        let mut add = |name: String, shape: Vec<u64>, scale: f32, offset: f32| {
            let values = random(&shape, scale)
                .into_iter()
                .map(|v| v + offset)
                .collect();
            tensors.push((name, shape, values));
        };
        add(
            "model.embed_tokens.weight".into(),
            vec![vocab, dim],
            1.0,
            0.0,
        );
        for l in 0..layers {
            let p = format!("model.layers.{l}");
            add(format!("{p}.input_layernorm.weight"), vec![dim], 0.2, 1.0);
            add(
                format!("{p}.self_attn.q_proj.weight"),
                vec![heads * head_dim, dim],
                0.25,
                0.0,
            );
            add(
                format!("{p}.self_attn.k_proj.weight"),
                vec![kv_heads * head_dim, dim],
                0.25,
                0.0,
            );
            add(
                format!("{p}.self_attn.v_proj.weight"),
                vec![kv_heads * head_dim, dim],
                0.25,
                0.0,
            );
            add(
                format!("{p}.self_attn.o_proj.weight"),
                vec![dim, heads * head_dim],
                0.25,
                0.0,
            );
            add(
                format!("{p}.post_attention_layernorm.weight"),
                vec![dim],
                0.2,
                1.0,
            );
            add(
                format!("{p}.mlp.gate_proj.weight"),
                vec![ffn, dim],
                0.25,
                0.0,
            );
            add(format!("{p}.mlp.up_proj.weight"), vec![ffn, dim], 0.25, 0.0);
            add(
                format!("{p}.mlp.down_proj.weight"),
                vec![dim, ffn],
                0.25,
                0.0,
            );
        }
        add("model.norm.weight".into(), vec![dim], 0.2, 1.0);
        if !tied {
            add("lm_head.weight".into(), vec![vocab, dim], 1.0, 0.0);
        }
        TinyLlama {
            hidden_size: dim as u32,
            n_layers: layers,
            n_heads: heads as u32,
            n_kv_heads: kv_heads as u32,
            ffn_dim: ffn as u32,
            vocab_size: vocab as u32,
            tied,
            tensors,
        }
    }

    /// The vocabulary both tokenizers use: `<unk>`, `<s>`, `</s>`, then plain pieces.
    pub fn tokens(&self) -> Vec<String> {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        tokens.extend((3..self.vocab_size).map(|i| format!("w{i}")));
        tokens
    }

    pub fn chat_template(&self) -> &'static str {
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    }

    /// Writes config.json, tokenizer.json, tokenizer_config.json and the weights as F32
    /// safetensors, split into `shards` files with an index when `shards > 1`.
    pub fn write_hf(&self, dir: &Path, shards: usize) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let config = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tied,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        });
        std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config)?)?;
        let vocab: serde_json::Map<String, serde_json::Value> = self
            .tokens()
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t, json!(i)))
            .collect();
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
        });
        std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tokenizer)?)?;
        let tokenizer_config = json!({
            "add_bos_token": false,
            "chat_template": [{"name": "default", "template": self.chat_template()}],
        });
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::to_vec(&tokenizer_config)?,
        )?;

        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = self
            .tensors
            .iter()
            .map(|(name, shape, values)| {
                let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                (
                    name.clone(),
                    shape.iter().map(|&d| d as usize).collect(),
                    data,
                )
            })
            .collect();
        let shards = shards.max(1);
        let per_shard = bytes.len().div_ceil(shards);
        let mut weight_map = serde_json::Map::new();
        for (i, chunk) in bytes.chunks(per_shard).enumerate() {
            let file = if shards == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
            };
            let views = chunk.iter().map(|(name, shape, data)| {
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape.clone(),
                    data,
                )
                .expect("shape matches data");
                weight_map.insert(name.clone(), json!(file));
                (name.clone(), view)
            });
            let views: Vec<_> = views.collect();
            safetensors::serialize_to_file(views, None, &dir.join(&file))
                .map_err(std::io::Error::other)?;
        }
        if shards > 1 {
            let index = json!({"metadata": {}, "weight_map": weight_map});
            std::fs::write(
                dir.join("model.safetensors.index.json"),
                serde_json::to_vec_pretty(&index)?,
            )?;
        }
        Ok(())
    }

    /// The same model as llama.cpp would write it: GGUF names, Q/K rows permuted, 2-D
    /// matrices stored as `matrix_dtype` (norms f32).
    pub fn gguf(&self, matrix_dtype: DType) -> GgufBuilder {
        let mut b = GgufBuilder::new();
        let string = |s: &str| GgufValue::String(s.to_string());
        b.kv("general.architecture", string("llama"))
            .kv("general.name", string("tiny"))
            .kv("llama.block_count", GgufValue::U32(self.n_layers))
            .kv("llama.context_length", GgufValue::U32(256))
            .kv("llama.embedding_length", GgufValue::U32(self.hidden_size))
            .kv("llama.feed_forward_length", GgufValue::U32(self.ffn_dim))
            .kv("llama.attention.head_count", GgufValue::U32(self.n_heads))
            .kv(
                "llama.attention.head_count_kv",
                GgufValue::U32(self.n_kv_heads),
            )
            .kv("llama.rope.freq_base", GgufValue::F32(10000.0))
            .kv(
                "llama.attention.layer_norm_rms_epsilon",
                GgufValue::F32(1e-5),
            )
            .kv("llama.vocab_size", GgufValue::U32(self.vocab_size))
            .kv(
                "llama.rope.dimension_count",
                GgufValue::U32(self.hidden_size / self.n_heads),
            )
            .kv("tokenizer.ggml.model", string("gpt2"))
            .kv("tokenizer.ggml.pre", string("default"))
            .kv(
                "tokenizer.ggml.tokens",
                GgufValue::Array(
                    GgufValueType::String,
                    self.tokens().iter().map(|t| string(t)).collect(),
                ),
            )
            .kv(
                "tokenizer.ggml.token_type",
                GgufValue::Array(
                    GgufValueType::I32,
                    (0..self.vocab_size)
                        .map(|i| GgufValue::I32(if i < 3 { 3 } else { 1 }))
                        .collect(),
                ),
            )
            .kv(
                "tokenizer.ggml.merges",
                GgufValue::Array(GgufValueType::String, Vec::new()),
            )
            .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1))
            .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2))
            .kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(false))
            .kv("tokenizer.chat_template", string(self.chat_template()));
        for (hf_name, shape, values) in &self.tensors {
            let name = gguf_name_of(hf_name);
            let mut f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let heads = if hf_name.ends_with("q_proj.weight") {
                Some(self.n_heads)
            } else if hf_name.ends_with("k_proj.weight") {
                Some(self.n_kv_heads)
            } else {
                None
            };
            if let Some(h) = heads {
                let row_bytes = shape[1] as usize * 4;
                f32_bytes = permute_rows_like_llama_cpp(&f32_bytes, h as usize, row_bytes);
            }
            let dtype = if shape.len() == 2 {
                matrix_dtype
            } else {
                DType::F32
            };
            let mut data = Vec::new();
            let permuted: Vec<f32> = f32_bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            quant::quantize(dtype, &permuted, &mut data).expect("rows are whole blocks");
            b.tensor(&name, dtype, shape, data);
        }
        b
    }
}

/// llama.cpp's name for a Hugging Face LLaMA tensor name.
fn gguf_name_of(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (layer, what) = rest.split_once('.').expect("layer.name");
    let ours = match what {
        "input_layernorm.weight" => "attn_norm",
        "self_attn.q_proj.weight" => "attn_q",
        "self_attn.k_proj.weight" => "attn_k",
        "self_attn.v_proj.weight" => "attn_v",
        "self_attn.o_proj.weight" => "attn_output",
        "post_attention_layernorm.weight" => "ffn_norm",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        "mlp.down_proj.weight" => "ffn_down",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{ours}.weight")
}

/// llama.cpp's dtype for a tensor of a `Q4_K_M` file of a dense llama without an importance
/// matrix: q6_k for the LM head (`output`) and for `attn_v` and `ffn_down` of the layers its
/// `use_more_bits` picks (the first and last eighth, and every third layer between), q4_k for
/// the other matrices (the embedding included); a row that is not whole 256-value super-blocks
/// falls back as llama.cpp falls back (q4_k → q5_0, q6_k → q8_0). Norms are f32. (On a 12-layer
/// model llama-quantize gives exactly this: q6_k for output and the attn_v/ffn_down of layers
/// 0, 3, 6, 9, 10, 11.)
pub fn q4_k_m_dtype(name: &str, layer: Option<usize>, n_layers: usize, cols: u64) -> DType {
    use weights_format::names::*;
    let more_bits = |i: usize| {
        let n = n_layers;
        i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
    };
    let wanted = match (name, layer) {
        (ATTN_NORM | FFN_NORM | OUTPUT_NORM, _) => return DType::F32,
        (OUTPUT, _) => DType::Q6K,
        (ATTN_V | FFN_DOWN, Some(i)) if more_bits(i) => DType::Q6K,
        _ => DType::Q4K,
    };
    match wanted.row_error(cols) {
        None => wanted,
        Some(_) if wanted == DType::Q6K => DType::Q8_0,
        Some(_) => DType::Q5_0,
    }
}

/// A small llama config for k-quant tests: width 256 (whole super-blocks), 4 heads of 64 over 2
/// KV heads, FFN 640 (2.5 super-blocks, so `ffn_down` falls back to a 32-value dtype in the
/// [`q4_k_m_dtype`] mix), vocabulary 512, untied LM head.
pub fn small_kquant_config(n_layers: u32) -> weights_format::ModelConfig {
    weights_format::ModelConfig {
        n_layers,
        hidden_size: 256,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        ffn_dim: 640,
        vocab_size: 512,
        context_length: 256,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        ..weights_format::ModelConfig::default()
    }
}

/// Writes a llama model of `config` at `dir` in the [`q4_k_m_dtype`] mix: normal random weights
/// (std `std`; norms 1), the byte-level tokenizer of `gdsllm synth`. A small stand-in for a
/// llama.cpp Q4_K_M file: every tensor type such a file has, chosen by the same rules.
pub fn write_q4_k_m_model(
    dir: &Path,
    config: &weights_format::ModelConfig,
    std: f32,
    seed: u64,
) -> Result<weights_format::Model, weights_format::FormatError> {
    let mut rng = XorShift::new(seed);
    let mut uniform = move || rng.open_unit();
    let mut normal = move || {
        let (u1, u2) = (uniform(), uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    };
    write_model_like(dir, config, "q4_k_m", |name, layer, shape| {
        let cols = *shape.last().expect("tensors have a shape");
        let dtype = q4_k_m_dtype(name, layer, config.n_layers as usize, cols);
        let n: u64 = shape.iter().product();
        let values: Vec<f32> = if dtype == DType::F32 {
            vec![1.0; n as usize]
        } else {
            (0..n).map(|_| normal() * std).collect()
        };
        let mut bytes = Vec::new();
        quant::quantize(dtype, &values, &mut bytes).expect("rows are whole blocks");
        (dtype, bytes)
    })
}

/// `model` with every tensor decoded to f32 (same config and tokenizer) at `dir`: the twin a
/// quantized model's kernels are compared with.
pub fn write_f32_twin(
    model: &weights_format::Model,
    dir: &Path,
) -> Result<weights_format::Model, weights_format::FormatError> {
    let mut failure = None;
    let twin = write_model_like(dir, model.config(), "f32 twin", |name, layer, shape| {
        let blob = match layer {
            Some(l) => model.layer_blob(l),
            None if name == weights_format::names::TOKEN_EMBD => 0,
            None => model.blob_count() - 1,
        };
        let t = model.tensor(blob, name).expect("same layout");
        let n: u64 = shape.iter().product();
        let mut values = vec![0f32; n as usize];
        match model.read_tensor(blob, name) {
            Ok(bytes) => quant::dequantize(t.dtype, &bytes, &mut values).expect("valid tensor"),
            Err(e) => failure = Some(e),
        }
        (
            DType::F32,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    })?;
    match failure {
        Some(e) => Err(e),
        None => Ok(twin),
    }
}

/// Writes every tensor of `config`'s layout with the dtype and bytes `tensor(name, layer,
/// shape)` gives, plus the synth tokenizer and chat template.
fn write_model_like(
    dir: &Path,
    config: &weights_format::ModelConfig,
    what: &str,
    mut tensor: impl FnMut(&str, Option<usize>, &[u64]) -> (DType, Vec<u8>),
) -> Result<weights_format::Model, weights_format::FormatError> {
    use weights_format::layout::{self, BlobKind};
    let mut writer = weights_format::ModelWriter::create(dir)?;
    for file in layout::blob_files(config.n_layers) {
        let kind = layout::blob_kind(&file).expect("canonical blob name");
        let layer = match kind {
            BlobKind::Layer(l) => Some(l),
            _ => None,
        };
        let mut blob = writer.begin_blob(&file)?;
        for spec in layout::blob_tensors(config, kind) {
            let (dtype, bytes) = tensor(spec.name, layer, &spec.shape);
            blob.write_tensor(spec.name, dtype, &spec.shape, &bytes)?;
        }
        blob.finish()?;
    }
    let tokenizer = crate::synth::tokenizer_json(config.vocab_size);
    writer.add_file("tokenizer.json", tokenizer.as_bytes())?;
    let mut source = serde_json::Map::new();
    source.insert(
        "generator".into(),
        format!("gdsllm-convert testing ({what})").into(),
    );
    writer.finish(config.clone(), "tokenizer.json", None, source)
}

/// Byte offsets of the f16 fields (scales, mins) in a block of each quantized dtype.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        _ => &[0],
    }
}

/// `n_blocks` blocks of a quantized `dtype` with random levels and sub-block scales and
/// ordinary f16 fields (uniform in ±0.01; random bytes there could be NaN or huge): test
/// inputs for the decoders and kernels of every layout, the decode-only ones included.
pub fn random_blocks(dtype: DType, n_blocks: usize, seed: u64) -> Vec<u8> {
    let mut rng = XorShift::new(seed);
    let mut bytes: Vec<u8> = (0..n_blocks * dtype.block_bytes())
        .map(|_| (rng.next_u64() >> 56) as u8)
        .collect();
    for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
        for &at in f16_fields(dtype) {
            let v = rng.centered() * 0.02;
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    bytes
}

/// Where one tensor info's fields lie in a GGUF file's bytes, for tests that corrupt the
/// tensor table the way an attacker (or a broken writer) would.
#[derive(Debug, Clone)]
pub struct TensorInfoAt {
    pub name: String,
    pub n_dims_at: usize,
    pub n_dims: u32,
    pub dims_at: usize,
    pub type_at: usize,
    pub offset_at: usize,
    pub offset: u64,
}

/// Finds the tensor infos of `names` in `bytes` (a GGUF written by [`GgufBuilder`]), by their
/// length-prefixed names. Panics if one is missing: test data only.
pub fn tensor_infos_at(bytes: &[u8], names: &[String]) -> Vec<TensorInfoAt> {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    names
        .iter()
        .map(|name| {
            let mut key = (name.len() as u64).to_le_bytes().to_vec();
            key.extend_from_slice(name.as_bytes());
            let start = bytes
                .windows(key.len())
                .rposition(|w| w == key)
                .unwrap_or_else(|| panic!("tensor info of {name} not found"));
            let n_dims_at = start + key.len();
            let n_dims = u32_at(n_dims_at);
            let dims_at = n_dims_at + 4;
            let type_at = dims_at + 8 * n_dims as usize;
            let offset_at = type_at + 4;
            TensorInfoAt {
                name: name.clone(),
                n_dims_at,
                n_dims,
                dims_at,
                type_at,
                offset_at,
                offset: u64_at(offset_at),
            }
        })
        .collect()
}

/// One corruption of a GGUF tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableMutation {
    Offset {
        tensor: usize,
        value: u64,
    },
    Type {
        tensor: usize,
        value: u32,
    },
    Dim {
        tensor: usize,
        dim: usize,
        value: u64,
    },
    NDims {
        tensor: usize,
        value: u32,
    },
    TensorCount(u64),
    /// Cut this many bytes off the end of the file.
    Truncate(usize),
    /// Append this many zero bytes.
    Append(usize),
}

impl TableMutation {
    /// A mutation chosen by `seed`: field and value, with the values that break parsers most
    /// often (0, 1, alignment ± 1, type boundaries, u32/u64 extremes, another tensor's offset)
    /// more likely than random ones.
    pub fn from_seed(seed: u64, infos: &[TensorInfoAt]) -> TableMutation {
        let mut rng = XorShift::new(seed);
        let mut next = || rng.next_u64();
        let tensor = (next() % infos.len() as u64) as usize;
        let info = &infos[tensor];
        let other = infos[(next() % infos.len() as u64) as usize].offset;
        let interesting_u64 = [
            0,
            1,
            31,
            32,
            33,
            4096,
            u64::from(u32::MAX),
            u64::MAX,
            u64::MAX - 31,
            other,
            info.offset.wrapping_add(32),
            info.offset.wrapping_sub(32),
            info.offset.wrapping_mul(2),
            next(),
        ];
        let pick = |r: u64, values: &[u64]| values[(r % values.len() as u64) as usize];
        match next() % 7 {
            0 | 1 => TableMutation::Offset {
                tensor,
                value: pick(next(), &interesting_u64),
            },
            2 => TableMutation::Type {
                tensor,
                value: pick(
                    next(),
                    &[
                        0,
                        1,
                        2,
                        3,
                        6,
                        8,
                        10,
                        12,
                        30,
                        39,
                        40,
                        u64::from(u32::MAX),
                        next() % 64,
                    ],
                ) as u32,
            },
            3 => TableMutation::Dim {
                tensor,
                dim: (next() % u64::from(info.n_dims.max(1))) as usize,
                value: pick(
                    next(),
                    &[0, 1, 2, 16, 31, 33, 64, 1 << 32, u64::MAX, next() % 256],
                ),
            },
            4 => TableMutation::NDims {
                tensor,
                value: pick(next(), &[0, 1, 2, 3, 4, 5, u64::from(u32::MAX)]) as u32,
            },
            5 => TableMutation::TensorCount(pick(
                next(),
                &[
                    0,
                    1,
                    infos.len() as u64 - 1,
                    infos.len() as u64 + 1,
                    u64::MAX,
                ],
            )),
            _ => {
                if next() % 2 == 0 {
                    TableMutation::Truncate(pick(next(), &[1, 31, 32, 4096]) as usize)
                } else {
                    TableMutation::Append(pick(next(), &[1, 32, 4096]) as usize)
                }
            }
        }
    }

    /// Applies the mutation to `bytes`, whose tensor infos are `infos`.
    pub fn apply(&self, bytes: &mut Vec<u8>, infos: &[TensorInfoAt]) {
        let put = |bytes: &mut Vec<u8>, at: usize, value: &[u8]| {
            bytes[at..at + value.len()].copy_from_slice(value);
        };
        match *self {
            TableMutation::Offset { tensor, value } => {
                put(bytes, infos[tensor].offset_at, &value.to_le_bytes())
            }
            TableMutation::Type { tensor, value } => {
                put(bytes, infos[tensor].type_at, &value.to_le_bytes())
            }
            TableMutation::Dim { tensor, dim, value } => {
                put(bytes, infos[tensor].dims_at + 8 * dim, &value.to_le_bytes())
            }
            TableMutation::NDims { tensor, value } => {
                put(bytes, infos[tensor].n_dims_at, &value.to_le_bytes())
            }
            // Magic (4) and version (4) precede the tensor count.
            TableMutation::TensorCount(value) => put(bytes, 8, &value.to_le_bytes()),
            TableMutation::Truncate(n) => bytes.truncate(bytes.len().saturating_sub(n)),
            TableMutation::Append(n) => bytes.resize(bytes.len() + n, 0),
        }
    }
}

/// The path in environment variable `var` (the real SmolLM2 model: GDSLLM_TEST_GGUF or
/// GDSLLM_TEST_MODEL), or `None` when model tests are skipped (`GDSLLM_SKIP_MODEL_TESTS=1`).
/// Fails the test with instructions otherwise.
pub fn model_path(var: &str) -> Option<PathBuf> {
    env_path(
        var,
        "run `gdsllm pull smollm2 --json` and set GDSLLM_TEST_GGUF to its \"gguf\" path and \
         GDSLLM_TEST_MODEL to its \"dir\"",
    )
}

/// The path in environment variable `var` (a file or directory the tests need, made by CI),
/// or `None` (after saying so) when model tests are skipped (`GDSLLM_SKIP_MODEL_TESTS=1`).
/// Fails the test with `how` (how to make it) otherwise.
pub fn env_path(var: &str, how: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var("GDSLLM_SKIP_MODEL_TESTS").as_deref() == Ok("1") => {
            eprintln!("skipped: {var} is unset and GDSLLM_SKIP_MODEL_TESTS=1");
            None
        }
        None => panic!(
            "{var} is unset: {how} (or set GDSLLM_SKIP_MODEL_TESTS=1 to skip tests that need \
             the real model)"
        ),
    }
}

/// The golden reference outputs of the real SmolLM2 model (tokens, logits, texts):
/// `$GDSLLM_GOLDEN`, or `shared/reference/smollm2-golden.json` beside the checkout.
pub fn golden() -> serde_json::Value {
    let path = std::env::var_os("GDSLLM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../shared/reference/smollm2-golden.json")
        });
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set GDSLLM_GOLDEN)", path.display()));
    serde_json::from_str(&text).expect("the golden file is JSON")
}

/// Every file of a (model) directory, sorted by name, with its bytes: for comparing two
/// conversions byte for byte.
pub fn dir_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("readable directory")
        .map(|e| e.expect("directory entry"))
        .map(|e| {
            let bytes = std::fs::read(e.path()).expect("readable file");
            (e.file_name().to_string_lossy().into_owned(), bytes)
        })
        .collect();
    files.sort();
    files
}
