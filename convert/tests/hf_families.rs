//! Hugging Face checkpoints of each family (written here as transformers names them, f32
//! safetensors) convert to the tensors and config our format describes: Qwen2's biases,
//! Qwen3's Q/K norms, Gemma 3's norms as `1 + w` and its windowed layers, Phi-3's fused
//! projections split by rows and its longrope, Llama 3.1's rope_scaling.

use std::path::Path;

use gdsllm_convert::convert::{ConvertError, ConvertOptions, NoProgress, convert};
use serde_json::{Value, json};
use weights_format::{Activation, Architecture, Model, names};

const DIM: u64 = 64;
const HEADS: u64 = 4;
const KV_HEADS: u64 = 2;
const HEAD_DIM: u64 = 16;
const FFN: u64 = 96;
const VOCAB: u64 = 40;
const LAYERS: u64 = 2;

/// Deterministic values for tensor number `seed`.
fn values(seed: u64, n: u64) -> Vec<f32> {
    gdsllm_convert::testing::pseudo_random(seed, n)
}

/// A checkpoint: config.json, a WordLevel tokenizer.json and one f32 safetensors file with
/// `tensors` (name, shape).
fn write_hf(dir: &Path, config: Value, tensors: &[(String, Vec<u64>)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let vocab: serde_json::Map<String, Value> =
        (0..VOCAB).map(|i| (format!("w{i}"), json!(i))).collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let bytes = values(i as u64 + 1, shape.iter().product())
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            (
                name.clone(),
                shape.iter().map(|&d| d as usize).collect(),
                bytes,
            )
        })
        .collect();
    let views: Vec<_> = data
        .iter()
        .map(|(name, shape, bytes)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn base_config(class: &str, model_type: &str) -> Value {
    json!({
        "architectures": [class],
        "model_type": model_type,
        "hidden_size": DIM,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_theta": 10000.0,
    })
}

/// The tensors of a layer as transformers names them (`{l}` = layer), with shapes.
fn layer_tensors(names: &[(&str, Vec<u64>)]) -> Vec<(String, Vec<u64>)> {
    let mut out = vec![
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, DIM]),
        ("model.norm.weight".to_string(), vec![DIM]),
    ];
    for l in 0..LAYERS {
        for (name, shape) in names {
            out.push((format!("model.layers.{l}.{name}"), shape.clone()));
        }
    }
    out
}

const Q: u64 = HEADS * HEAD_DIM;
const KV: u64 = KV_HEADS * HEAD_DIM;

fn llama_layer() -> Vec<(&'static str, Vec<u64>)> {
    vec![
        ("input_layernorm.weight", vec![DIM]),
        ("self_attn.q_proj.weight", vec![Q, DIM]),
        ("self_attn.k_proj.weight", vec![KV, DIM]),
        ("self_attn.v_proj.weight", vec![KV, DIM]),
        ("self_attn.o_proj.weight", vec![DIM, Q]),
        ("post_attention_layernorm.weight", vec![DIM]),
        ("mlp.gate_proj.weight", vec![FFN, DIM]),
        ("mlp.up_proj.weight", vec![FFN, DIM]),
        ("mlp.down_proj.weight", vec![DIM, FFN]),
    ]
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The values `write_hf` gave the tensor `name` of `tensors`.
fn written(tensors: &[(String, Vec<u64>)], name: &str) -> Vec<f32> {
    let i = tensors.iter().position(|t| t.0 == name).unwrap();
    values(i as u64 + 1, tensors[i].1.iter().product())
}

fn convert_dir(dir: &Path) -> Result<Model, ConvertError> {
    let out = dir.with_extension("out");
    convert(dir, &out, &ConvertOptions::default(), &NoProgress)?;
    Ok(Model::open(&out).unwrap())
}

#[test]
fn qwen2_keeps_its_biases_and_qwen3_its_qk_norms() {
    let tmp = tempfile::tempdir().unwrap();
    let mut layer = llama_layer();
    layer.extend([
        ("self_attn.q_proj.bias", vec![Q]),
        ("self_attn.k_proj.bias", vec![KV]),
        ("self_attn.v_proj.bias", vec![KV]),
    ]);
    let tensors = layer_tensors(&layer);
    let mut config = base_config("Qwen2ForCausalLM", "qwen2");
    config["tie_word_embeddings"] = json!(true);
    config["use_sliding_window"] = json!(false);
    config["sliding_window"] = json!(32768);
    write_hf(&tmp.path().join("qwen2"), config, &tensors);
    let model = convert_dir(&tmp.path().join("qwen2")).unwrap();
    let c = model.config();
    assert_eq!(c.family(), Some(Architecture::Qwen2));
    assert!(c.attention_bias && c.tie_word_embeddings && c.sliding_window.is_none());
    let bias = f32s(&model.read_tensor(2, names::ATTN_V_BIAS).unwrap());
    assert_eq!(
        bias,
        written(&tensors, "model.layers.1.self_attn.v_proj.bias")
    );

    let mut layer = llama_layer();
    layer.extend([
        ("self_attn.q_norm.weight", vec![HEAD_DIM]),
        ("self_attn.k_norm.weight", vec![HEAD_DIM]),
    ]);
    let mut tensors = layer_tensors(&layer);
    tensors.push(("lm_head.weight".into(), vec![VOCAB, DIM]));
    let mut config = base_config("Qwen3ForCausalLM", "qwen3");
    config["attention_bias"] = json!(false);
    write_hf(&tmp.path().join("qwen3"), config, &tensors);
    let model = convert_dir(&tmp.path().join("qwen3")).unwrap();
    assert_eq!(model.config().family(), Some(Architecture::Qwen3));
    assert!(model.config().qk_norm && !model.config().tie_word_embeddings);
    let k_norm = f32s(&model.read_tensor(1, names::ATTN_K_NORM).unwrap());
    assert_eq!(
        k_norm,
        written(&tensors, "model.layers.0.self_attn.k_norm.weight")
    );
}

fn gemma3_layer() -> Vec<(&'static str, Vec<u64>)> {
    vec![
        ("input_layernorm.weight", vec![DIM]),
        ("self_attn.q_proj.weight", vec![Q, DIM]),
        ("self_attn.k_proj.weight", vec![KV, DIM]),
        ("self_attn.v_proj.weight", vec![KV, DIM]),
        ("self_attn.q_norm.weight", vec![HEAD_DIM]),
        ("self_attn.k_norm.weight", vec![HEAD_DIM]),
        ("self_attn.o_proj.weight", vec![DIM, Q]),
        ("post_attention_layernorm.weight", vec![DIM]),
        ("pre_feedforward_layernorm.weight", vec![DIM]),
        ("mlp.gate_proj.weight", vec![FFN, DIM]),
        ("mlp.up_proj.weight", vec![FFN, DIM]),
        ("mlp.down_proj.weight", vec![DIM, FFN]),
        ("post_feedforward_layernorm.weight", vec![DIM]),
    ]
}

fn gemma3_config() -> Value {
    let mut config = base_config("Gemma3ForCausalLM", "gemma3_text");
    config["hidden_activation"] = json!("gelu_pytorch_tanh");
    config["query_pre_attn_scalar"] = json!(32);
    config["sliding_window"] = json!(16);
    config["layer_types"] = json!(["sliding_attention", "full_attention"]);
    config["rope_theta"] = json!(1_000_000.0);
    config["rope_local_base_freq"] = json!(10000.0);
    config["final_logit_softcapping"] = Value::Null;
    config["attn_logit_softcapping"] = Value::Null;
    config
}

#[test]
fn gemma3_norms_become_one_plus_w_and_its_window_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = layer_tensors(&gemma3_layer());
    write_hf(&tmp.path().join("g"), gemma3_config(), &tensors);
    let model = convert_dir(&tmp.path().join("g")).unwrap();
    let c = model.config();
    assert_eq!(c.family(), Some(Architecture::Gemma3));
    assert!(c.qk_norm && c.post_norms && c.tie_word_embeddings);
    assert_eq!(c.activation, Activation::GeluTanh);
    assert_eq!(c.embedding_scale, 8.0);
    assert_eq!(c.attention_scale, Some(1.0 / 32f32.sqrt()));
    let w = c.sliding_window.as_ref().unwrap();
    assert_eq!(
        (w.size, w.layers.clone(), w.rope_theta),
        (16, vec![0], 10000.0)
    );
    assert_eq!(c.rope_theta, 1e6);
    for (ours, theirs) in [
        (names::ATTN_NORM, "input_layernorm.weight"),
        (names::ATTN_Q_NORM, "self_attn.q_norm.weight"),
        (names::ATTN_POST_NORM, "post_attention_layernorm.weight"),
        (names::FFN_NORM, "pre_feedforward_layernorm.weight"),
        (names::FFN_POST_NORM, "post_feedforward_layernorm.weight"),
    ] {
        let got = f32s(&model.read_tensor(2, ours).unwrap());
        let w = written(&tensors, &format!("model.layers.1.{theirs}"));
        let expected: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
        assert_eq!(got, expected, "{ours}");
    }
    let output_norm = f32s(&model.read_tensor(3, names::OUTPUT_NORM).unwrap());
    assert_eq!(
        output_norm[0],
        1.0 + written(&tensors, "model.norm.weight")[0]
    );
    // Matrices are carried as they are.
    let q = f32s(&model.read_tensor(1, names::ATTN_Q).unwrap());
    assert_eq!(
        q,
        written(&tensors, "model.layers.0.self_attn.q_proj.weight")
    );

    // The text part of Gemma3ForConditionalGeneration (transformers 5 names), vision left out.
    let prefixed: Vec<(String, Vec<u64>)> = tensors
        .iter()
        .map(|(n, s)| (n.replacen("model.", "model.language_model.", 1), s.clone()))
        .chain([
            (
                "model.vision_tower.vision_model.post_layernorm.weight".into(),
                vec![8],
            ),
            (
                "model.multi_modal_projector.mm_soft_emb_norm.weight".into(),
                vec![8],
            ),
        ])
        .collect();
    let mut config = json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": gemma3_config(),
        "vision_config": {"hidden_size": 8},
    });
    config["text_config"]["architectures"] = Value::Null;
    write_hf(&tmp.path().join("mm"), config, &prefixed);
    let mm = convert_dir(&tmp.path().join("mm")).unwrap();
    assert_eq!(mm.config(), c);
    assert_eq!(
        mm.read_tensor(2, names::FFN_POST_NORM).unwrap(),
        model.read_tensor(2, names::FFN_POST_NORM).unwrap()
    );
}

#[test]
fn phi3_fused_projections_are_split_and_longrope_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = {
        let mut t = layer_tensors(&[
            ("input_layernorm.weight", vec![DIM]),
            ("self_attn.qkv_proj.weight", vec![Q + 2 * KV, DIM]),
            ("self_attn.o_proj.weight", vec![DIM, Q]),
            ("post_attention_layernorm.weight", vec![DIM]),
            ("mlp.gate_up_proj.weight", vec![2 * FFN, DIM]),
            ("mlp.down_proj.weight", vec![DIM, FFN]),
        ]);
        t.push(("lm_head.weight".into(), vec![VOCAB, DIM]));
        t
    };
    let mut config = base_config("Phi3ForCausalLM", "phi3");
    config["max_position_embeddings"] = json!(1024);
    config["original_max_position_embeddings"] = json!(256);
    config["sliding_window"] = json!(255);
    let short: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 * 0.01).collect();
    let long: Vec<f32> = (0..8).map(|i| 1.0 + i as f32).collect();
    config["rope_scaling"] =
        json!({"type": "longrope", "short_factor": short, "long_factor": long});
    write_hf(&tmp.path().join("phi3"), config, &tensors);
    let model = convert_dir(&tmp.path().join("phi3")).unwrap();
    let c = model.config();
    assert_eq!(c.family(), Some(Architecture::Phi3));
    assert!(c.sliding_window.is_none(), "ignored, as llama.cpp does");
    let s = c.rope_scaling.as_ref().unwrap();
    assert_eq!(s.rope_type, "longrope");
    assert_eq!(s.short_factor.as_ref(), Some(&short));
    assert_eq!(s.long_factor.as_ref(), Some(&long));
    assert_eq!(s.original_max_position_embeddings, Some(256));
    assert_eq!(s.factor, 4.0);
    // Hugging Face's default: sqrt(1 + ln(4) / ln(256)).
    let expected = (1.0 + 4f32.ln() / 256f32.ln()).sqrt();
    assert!((s.attention_factor.unwrap() - expected).abs() < 1e-6);

    let qkv = written(&tensors, "model.layers.1.self_attn.qkv_proj.weight");
    let d = DIM as usize;
    let (q, kv) = (Q as usize * d, KV as usize * d);
    assert_eq!(
        f32s(&model.read_tensor(2, names::ATTN_Q).unwrap()),
        &qkv[..q]
    );
    assert_eq!(
        f32s(&model.read_tensor(2, names::ATTN_K).unwrap()),
        &qkv[q..q + kv]
    );
    assert_eq!(
        f32s(&model.read_tensor(2, names::ATTN_V).unwrap()),
        &qkv[q + kv..]
    );
    let gate_up = written(&tensors, "model.layers.1.mlp.gate_up_proj.weight");
    let f = FFN as usize * d;
    assert_eq!(
        f32s(&model.read_tensor(2, names::FFN_GATE).unwrap()),
        &gate_up[..f]
    );
    assert_eq!(
        f32s(&model.read_tensor(2, names::FFN_UP).unwrap()),
        &gate_up[f..]
    );
}

#[test]
fn llama3_rope_scaling_and_mistral_convert_as_llama() {
    let tmp = tempfile::tempdir().unwrap();
    let mut tensors = layer_tensors(&llama_layer());
    tensors.push(("lm_head.weight".into(), vec![VOCAB, DIM]));
    let mut config = base_config("LlamaForCausalLM", "llama");
    config["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128});
    write_hf(&tmp.path().join("l3"), config, &tensors);
    let model = convert_dir(&tmp.path().join("l3")).unwrap();
    let s = model.config().rope_scaling.as_ref().unwrap();
    assert_eq!(
        (
            s.rope_type.as_str(),
            s.factor,
            s.original_max_position_embeddings
        ),
        ("llama3", 8.0, Some(128))
    );

    let mut config = base_config("MistralForCausalLM", "mistral");
    config["sliding_window"] = Value::Null;
    write_hf(&tmp.path().join("mistral"), config, &tensors);
    let model = convert_dir(&tmp.path().join("mistral")).unwrap();
    assert_eq!(model.config().family(), Some(Architecture::Llama));
}

#[test]
fn unknown_classes_and_family_mismatches_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = layer_tensors(&llama_layer());
    let cases: Vec<(Value, &str)> = vec![
        (
            base_config("GPTNeoXForCausalLM", "gpt_neox"),
            "GPTNeoXForCausalLM",
        ),
        (
            {
                let mut c = base_config("Qwen2ForCausalLM", "qwen2");
                c["use_sliding_window"] = json!(true);
                c
            },
            "use_sliding_window",
        ),
        (
            {
                let mut c = gemma3_config();
                c["hidden_activation"] = json!("relu");
                c
            },
            "relu",
        ),
        (
            {
                let mut c = base_config("LlamaForCausalLM", "llama");
                c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
                c
            },
            "yarn",
        ),
        // A Qwen2 checkpoint without its biases.
        (
            base_config("Qwen2ForCausalLM", "qwen2"),
            "attn_q_bias of layer 0",
        ),
    ];
    for (i, (config, expected)) in cases.into_iter().enumerate() {
        let dir = tmp.path().join(format!("c{i}"));
        write_hf(&dir, config, &tensors);
        let msg = convert_dir(&dir).unwrap_err().to_string();
        println!("{msg}");
        assert!(msg.contains(expected), "expected {expected:?} in {msg}");
    }
}
