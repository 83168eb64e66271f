//! The model families in the format: each family's tensors, its rules, and version 1 files
//! still opening as llama.

mod common;

use common::{tiny_config, write_model, write_tiny};
use serde_json::{Value, json};
use weights_format::{
    Activation, Architecture, DType, FormatError, Model, ModelConfig, RopeScaling, SlidingWindow,
    layout::{self, BlobKind},
};

/// A tiny config of `arch` with the feature fields the family has.
fn family_config(arch: Architecture) -> ModelConfig {
    let base = ModelConfig {
        architecture: arch.name().into(),
        ..tiny_config(false)
    };
    match arch {
        Architecture::Llama | Architecture::Phi3 => base,
        Architecture::Qwen2 => ModelConfig {
            attention_bias: true,
            ..base
        },
        Architecture::Qwen3 => ModelConfig {
            qk_norm: true,
            ..base
        },
        Architecture::Gemma3 => ModelConfig {
            qk_norm: true,
            post_norms: true,
            activation: Activation::GeluTanh,
            embedding_scale: 8.0,
            attention_scale: Some(0.25),
            tie_word_embeddings: true,
            sliding_window: Some(SlidingWindow {
                size: 16,
                layers: vec![0],
                rope_theta: 10000.0,
            }),
            rope_theta: 1e6,
            ..base
        },
    }
}

/// The tensors of a layer blob, per family, in writing order.
const LAYER_TENSORS: [(Architecture, &[&str]); 5] = [
    (
        Architecture::Llama,
        &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
    ),
    (
        Architecture::Qwen2,
        &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_bias",
            "attn_k_bias",
            "attn_v_bias",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
    ),
    (
        Architecture::Qwen3,
        &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
    ),
    (
        Architecture::Gemma3,
        &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_output",
            "attn_post_norm",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "ffn_post_norm",
        ],
    ),
    (
        Architecture::Phi3,
        &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
    ),
];

#[test]
fn every_family_writes_and_opens_with_its_tensors() {
    for (arch, expected) in LAYER_TENSORS {
        let tmp = tempfile::tempdir().unwrap();
        let config = family_config(arch);
        let model = write_model(&tmp.path().join("m"), config.clone(), DType::Q8_0);
        let reopened = Model::open(model.dir()).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(reopened.config(), &config, "{arch}");
        let names: Vec<&str> = reopened
            .blob(1)
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, expected, "{arch}");
        let specs = layout::blob_tensors(&config, BlobKind::Layer(0));
        let shape = |name: &str| &specs.iter().find(|s| s.name == name).unwrap().shape;
        let (q, kv, hd) = (4 * 16, 2 * 16, 16);
        if config.attention_bias {
            assert_eq!(shape("attn_q_bias"), &vec![q]);
            assert_eq!(shape("attn_k_bias"), &vec![kv]);
        }
        if config.qk_norm {
            assert_eq!(shape("attn_q_norm"), &vec![hd]);
        }
    }
}

#[test]
fn version_1_metadata_without_the_new_fields_opens_as_llama() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    write_tiny(&dir, DType::F16, false);
    edit(&dir, |v| {
        v["format_version"] = json!(1);
        let config = v["config"].as_object_mut().unwrap();
        for key in [
            "architecture",
            "attention_bias",
            "qk_norm",
            "post_norms",
            "activation",
            "embedding_scale",
            "attention_scale",
            "final_logit_softcap",
            "sliding_window",
        ] {
            config.remove(key).expect(key);
        }
    });
    // The hand edit is accepted the documented way (open checks metadata.json's checksum).
    let model = Model::update_metadata_checksum(&dir).unwrap();
    assert_eq!(Model::open(&dir).unwrap().metadata(), model.metadata());
    assert_eq!(model.metadata().format_version, 1);
    assert_eq!(model.config(), &tiny_config(false));
    assert_eq!(model.config().family(), Some(Architecture::Llama));

    // A family other than llama cannot be a version 1 file.
    edit(&dir, |v| v["config"]["architecture"] = json!("phi3"));
    let err = Model::open(&dir).unwrap_err();
    assert!(
        matches!(&err, FormatError::Config { key, .. } if key == "architecture"),
        "{err}"
    );
}

fn edit(dir: &std::path::Path, f: impl FnOnce(&mut Value)) {
    let path = dir.join("metadata.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Nonsense in each new field gives a `Config` error naming it.
#[test]
fn nonsense_family_fields_are_refused_by_name() {
    let llama = || family_config(Architecture::Llama);
    let gemma = || family_config(Architecture::Gemma3);
    let rope = |s: RopeScaling| Some(s);
    let window = |size, layers: Vec<u32>, rope_theta| {
        Some(SlidingWindow {
            size,
            layers,
            rope_theta,
        })
    };
    let cases: Vec<(ModelConfig, &str)> = vec![
        (
            ModelConfig {
                architecture: "mistral".into(),
                ..llama()
            },
            "architecture",
        ),
        (
            ModelConfig {
                attention_bias: true,
                ..llama()
            },
            "attention_bias",
        ),
        (
            ModelConfig {
                attention_bias: false,
                ..family_config(Architecture::Qwen2)
            },
            "attention_bias",
        ),
        (
            ModelConfig {
                qk_norm: false,
                ..family_config(Architecture::Qwen3)
            },
            "qk_norm",
        ),
        (
            ModelConfig {
                post_norms: false,
                ..gemma()
            },
            "post_norms",
        ),
        (
            ModelConfig {
                activation: Activation::Silu,
                ..gemma()
            },
            "activation",
        ),
        (
            ModelConfig {
                embedding_scale: 2.0,
                ..llama()
            },
            "embedding_scale",
        ),
        (
            ModelConfig {
                embedding_scale: f32::NAN,
                ..gemma()
            },
            "embedding_scale",
        ),
        (
            ModelConfig {
                attention_scale: Some(0.0),
                ..gemma()
            },
            "attention_scale",
        ),
        (
            ModelConfig {
                final_logit_softcap: Some(-30.0),
                ..gemma()
            },
            "final_logit_softcap",
        ),
        (
            ModelConfig {
                sliding_window: window(16, vec![0], 1e4),
                ..llama()
            },
            "sliding_window",
        ),
        (
            ModelConfig {
                sliding_window: window(0, vec![0], 1e4),
                ..gemma()
            },
            "sliding_window.size",
        ),
        (
            ModelConfig {
                sliding_window: window(16, vec![2], 1e4),
                ..gemma()
            },
            "sliding_window.layers",
        ),
        (
            ModelConfig {
                sliding_window: window(16, vec![1, 0], 1e4),
                ..gemma()
            },
            "sliding_window.layers",
        ),
        (
            ModelConfig {
                sliding_window: window(16, vec![], 1e4),
                ..gemma()
            },
            "sliding_window.layers",
        ),
        (
            ModelConfig {
                sliding_window: window(16, vec![0], f32::INFINITY),
                ..gemma()
            },
            "sliding_window.rope_theta",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling {
                    freq_factors: Some(vec![1.0; 3]),
                    ..RopeScaling::new("freq_factors", 1.0)
                }),
                ..llama()
            },
            "rope_scaling.freq_factors",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling {
                    freq_factors: Some(vec![0.0; 8]),
                    ..RopeScaling::new("freq_factors", 1.0)
                }),
                ..llama()
            },
            "rope_scaling.freq_factors",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling::new("freq_factors", 1.0)),
                ..llama()
            },
            "rope_scaling.freq_factors",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling {
                    freq_factors: Some(vec![1.0; 8]),
                    ..RopeScaling::new("freq_factors", 8.0)
                }),
                ..llama()
            },
            "rope_scaling.factor",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling {
                    low_freq_factor: Some(4.0),
                    high_freq_factor: Some(1.0),
                    original_max_position_embeddings: Some(8192),
                    ..RopeScaling::new("llama3", 8.0)
                }),
                ..llama()
            },
            "rope_scaling.high_freq_factor",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling {
                    low_freq_factor: Some(1.0),
                    high_freq_factor: Some(4.0),
                    original_max_position_embeddings: Some(0),
                    ..RopeScaling::new("llama3", 8.0)
                }),
                ..llama()
            },
            "rope_scaling.original_max_position_embeddings",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling {
                    short_factor: Some(vec![1.0; 8]),
                    original_max_position_embeddings: Some(64),
                    ..RopeScaling::new("longrope", 4.0)
                }),
                ..family_config(Architecture::Phi3)
            },
            "rope_scaling.long_factor",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling {
                    short_factor: Some(vec![1.0; 8]),
                    long_factor: Some(vec![1.0; 8]),
                    original_max_position_embeddings: Some(64),
                    ..RopeScaling::new("longrope", 4.0)
                }),
                ..llama()
            },
            "rope_scaling.rope_type",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling::new("llama3", 8.0)),
                ..gemma()
            },
            "rope_scaling.low_freq_factor",
        ),
        (
            ModelConfig {
                rope_scaling: rope(RopeScaling::new("yarn", 4.0)),
                ..family_config(Architecture::Qwen2)
            },
            "rope_scaling.rope_type",
        ),
    ];
    for (config, key) in cases {
        match config.validate() {
            Err(FormatError::Config { key: k, reason }) => {
                println!("{k}: {reason}");
                assert_eq!(k, key, "{reason}");
            }
            other => panic!("{key}: expected a Config error, got {other:?}"),
        }
    }
}

#[test]
fn good_rope_scalings_validate() {
    let phi3 = ModelConfig {
        rope_scaling: Some(RopeScaling {
            short_factor: Some(vec![1.0; 8]),
            long_factor: Some(vec![1.5; 8]),
            original_max_position_embeddings: Some(64),
            attention_factor: Some(1.19),
            ..RopeScaling::new("longrope", 4.0)
        }),
        ..family_config(Architecture::Phi3)
    };
    phi3.validate().unwrap();
    let llama31 = ModelConfig {
        rope_scaling: Some(RopeScaling {
            freq_factors: Some(vec![1.0, 1.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]),
            ..RopeScaling::new("freq_factors", 1.0)
        }),
        ..family_config(Architecture::Llama)
    };
    llama31.validate().unwrap();
    assert!(family_config(Architecture::Gemma3).is_sliding_layer(0));
    assert!(!family_config(Architecture::Gemma3).is_sliding_layer(1));
    assert!(!llama31.is_sliding_layer(0));
}
