//! The model families against llama.cpp, on the files `scripts/families/` makes:
//! - the random-weight GGUF of each family converts, with the config and tensors its family
//!   implies (the files are checked to be the very bytes llama.cpp's references were made on);
//! - each family's tokenizer, built from GGUF metadata, gives llama.cpp's token ids on a fixed
//!   multilingual text set;
//! - the real Gemma 3 270M GGUF is recognised as gemma3 and every tensor type it has that the
//!   converter cannot carry is named with its count, in one message.
//!
//! The files come from `GDSLLM_FAMILY_INPUTS` (what `fetch_inputs.py` fetches) and
//! `GDSLLM_FAMILY_GGUFS` (what `make_family_gguf.py` writes); `cargo xtask ci` makes both.

mod common;

use std::path::{Path, PathBuf};

use gdsllm_convert::convert::{ConvertError, ConvertOptions, NoProgress, convert};
use gdsllm_convert::gguf::{GgufError, GgufFile, dtype_from_ggml};
use gdsllm_convert::tokenizer::tokenizer_json_from_gguf;
use serde_json::Value;
use sha2::{Digest, Sha256};
use weights_format::{Activation, Architecture, Model, names};

fn reference() -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/families/llamacpp-reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn sha256(path: &Path) -> String {
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = std::io::Read::read(&mut f, &mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
}

fn dir(var: &str) -> Option<PathBuf> {
    common::model_path(var)
}

#[test]
fn family_ggufs_convert_with_their_config_and_tensors() {
    let Some(models) = dir("GDSLLM_FAMILY_GGUFS") else {
        return;
    };
    let reference = reference();
    let families = reference["models"].as_object().unwrap();
    assert_eq!(families.len(), 6);
    let tmp = tempfile::tempdir().unwrap();
    for (family, expected) in families {
        let gguf_path = models.join(format!("{family}.gguf"));
        assert_eq!(
            sha256(&gguf_path),
            expected["sha256"].as_str().unwrap(),
            "{family}.gguf is not the file the references were made on (regenerate it with \
             scripts/families/make_family_gguf.py, same gguf package version)"
        );
        let out = tmp.path().join(family);
        convert(&gguf_path, &out, &ConvertOptions::default(), &NoProgress)
            .unwrap_or_else(|e| panic!("{family}: {e}"));
        let model = Model::open(&out).unwrap();
        let c = model.config();
        let arch = c.family().unwrap();
        println!(
            "{family}: {arch}, {} layers, {:?}",
            c.n_layers, c.sliding_window
        );
        assert_eq!(
            (
                c.hidden_size,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                c.ffn_dim
            ),
            (64, 4, 2, 16, 128),
            "{family}"
        );
        let gguf = GgufFile::open(&gguf_path).unwrap();
        let layer1 = model.layer_blob(1);
        match family.as_str() {
            "llama" => {
                assert_eq!(arch, Architecture::Llama);
                assert!(c.rope_scaling.is_none());
            }
            "llama3-rope" => {
                assert_eq!(arch, Architecture::Llama);
                let s = c.rope_scaling.as_ref().unwrap();
                assert_eq!(s.rope_type, "freq_factors");
                let mut raw = Vec::new();
                gguf.read_tensor(gguf.tensor("rope_freqs.weight").unwrap(), &mut raw)
                    .unwrap();
                let factors: Vec<f32> = raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(s.freq_factors.as_ref().unwrap(), &factors);
                assert!(
                    factors.contains(&1.0) && factors.contains(&8.0),
                    "{factors:?}"
                );
            }
            "qwen2" => {
                assert_eq!(arch, Architecture::Qwen2);
                assert!(c.attention_bias && c.tie_word_embeddings);
                assert_eq!(
                    model.read_tensor(layer1, names::ATTN_K_BIAS).unwrap(),
                    gguf_bytes(&gguf, "blk.1.attn_k.bias")
                );
            }
            "qwen3" => {
                assert_eq!(arch, Architecture::Qwen3);
                assert!(c.qk_norm && !c.attention_bias);
                assert_eq!(
                    model.read_tensor(layer1, names::ATTN_Q_NORM).unwrap(),
                    gguf_bytes(&gguf, "blk.1.attn_q_norm.weight")
                );
                // NEOX-style RoPE families are not permuted: Q rows are the file's rows.
                assert_eq!(
                    model.read_tensor(layer1, names::ATTN_Q).unwrap(),
                    gguf_bytes(&gguf, "blk.1.attn_q.weight")
                );
            }
            "gemma3" => {
                assert_eq!(arch, Architecture::Gemma3);
                assert!(c.qk_norm && c.post_norms && c.tie_word_embeddings);
                assert_eq!(c.activation, Activation::GeluTanh);
                assert_eq!(c.embedding_scale, 8.0);
                assert_eq!(c.attention_scale, None);
                let w = c.sliding_window.as_ref().unwrap();
                // Pattern 3: two windowed layers, then a global one.
                assert_eq!(
                    (w.size, w.layers.clone(), w.rope_theta),
                    (8, vec![0, 1, 3, 4], 1e4)
                );
                assert_eq!(c.rope_theta, 1e6);
                assert_eq!(
                    model.read_tensor(layer1, names::FFN_POST_NORM).unwrap(),
                    gguf_bytes(&gguf, "blk.1.post_ffw_norm.weight")
                );
                assert_eq!(
                    model.read_tensor(layer1, names::ATTN_POST_NORM).unwrap(),
                    gguf_bytes(&gguf, "blk.1.post_attention_norm.weight")
                );
            }
            "phi3" => {
                assert_eq!(arch, Architecture::Phi3);
                let s = c.rope_scaling.as_ref().unwrap();
                assert_eq!(s.rope_type, "longrope");
                assert_eq!(s.original_max_position_embeddings, Some(64));
                assert_eq!(s.factor, 4096.0 / 64.0);
                assert!(s.attention_factor.unwrap() > 1.0);
                // The fused tensors split by rows: q (64), k (32), v (32); gate (128), up (128).
                let qkv = gguf_bytes(&gguf, "blk.1.attn_qkv.weight");
                let row = 64 * 4;
                let q = model.read_tensor(layer1, names::ATTN_Q).unwrap();
                let k = model.read_tensor(layer1, names::ATTN_K).unwrap();
                let v = model.read_tensor(layer1, names::ATTN_V).unwrap();
                assert_eq!(q, &qkv[..64 * row]);
                assert_eq!(k, &qkv[64 * row..96 * row]);
                assert_eq!(v, &qkv[96 * row..]);
                let gate_up = gguf_bytes(&gguf, "blk.1.ffn_up.weight");
                let gate = model.read_tensor(layer1, names::FFN_GATE).unwrap();
                let up = model.read_tensor(layer1, names::FFN_UP).unwrap();
                assert_eq!(gate, &gate_up[..128 * row]);
                assert_eq!(up, &gate_up[128 * row..]);
            }
            other => panic!("no checks for {other}"),
        }
    }
}

fn gguf_bytes(gguf: &GgufFile, name: &str) -> Vec<u8> {
    let mut buf = Vec::new();
    gguf.read_tensor(gguf.tensor(name).unwrap(), &mut buf)
        .unwrap();
    buf
}

#[test]
fn tokenizers_give_llama_cpp_ids_on_the_text_set() {
    let Some(inputs) = dir("GDSLLM_FAMILY_INPUTS") else {
        return;
    };
    let reference = reference();
    let texts: Vec<&str> = reference["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let mut failures = Vec::new();
    for (vocab, expected) in reference["tokenizers"].as_object().unwrap() {
        let path = inputs.join(vocab);
        assert_eq!(
            sha256(&path),
            expected["sha256"].as_str().unwrap(),
            "{vocab}"
        );
        let json = tokenizer_json_from_gguf(&GgufFile::open(&path).unwrap())
            .unwrap_or_else(|e| panic!("{vocab}: {e}"));
        let tokenizer = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
        let mut equal = 0;
        for (text, ids) in texts.iter().zip(expected["ids"].as_array().unwrap()) {
            let want: Vec<u32> = ids
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect();
            let got = tokenizer.encode(*text, false).unwrap().get_ids().to_vec();
            if got == want {
                equal += 1;
            } else {
                failures.push(format!(
                    "{vocab}: {text:?}: ours {got:?}, llama.cpp {want:?}"
                ));
            }
        }
        println!("{vocab}: {equal}/{} texts equal", texts.len());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The real Gemma 3 270M Q4_K_M file: a gemma3 model; its k-quant tensors are either carried
/// (once the k-quant dtypes exist) or all named, with their counts, in one error.
#[test]
fn real_gemma3_file_is_recognised_and_its_types_are_listed_at_once() {
    let Some(inputs) = dir("GDSLLM_FAMILY_INPUTS") else {
        return;
    };
    let path = inputs.join("gemma-3-270m-q4_k_m.gguf");
    let gguf = GgufFile::open(&path).unwrap();
    let config = gdsllm_convert::gguf_map::config_from_gguf(&gguf).unwrap();
    assert_eq!(config.family(), Some(Architecture::Gemma3));
    assert_eq!(
        (
            config.n_layers,
            config.hidden_size,
            config.head_dim,
            config.n_kv_heads
        ),
        (18, 640, 256, 1)
    );
    // <eos>, and <end_of_turn> (106), which ends a chat turn, found by its text.
    assert_eq!(config.eos_token_ids, vec![1, 106]);
    let w = config.sliding_window.as_ref().unwrap();
    assert_eq!(w.size, 512);
    assert_eq!(w.layers.len(), 15, "pattern 6: every sixth layer is global");
    assert!(!w.layers.contains(&5) && !w.layers.contains(&17));
    config.validate().unwrap();

    // The file's types: Q5_0 ×81, Q4_K ×27, Q6_K ×9 besides F32 and Q8_0.
    let expected: Vec<(u32, &str, usize)> = [(6, "Q5_0", 81), (12, "Q4_K", 27), (14, "Q6_K", 9)]
        .into_iter()
        .filter(|&(id, _, _)| dtype_from_ggml(id).is_none())
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    match convert(
        &path,
        &tmp.path().join("g"),
        &ConvertOptions::default(),
        &NoProgress,
    ) {
        Err(ConvertError::Gguf(GgufError::UnsupportedTensorTypes { tensors, .. })) => {
            let got: Vec<(u32, &str, usize)> = tensors.iter().map(|t| (t.0, t.1, t.2)).collect();
            assert_eq!(got, expected);
        }
        Ok(_) => {
            assert!(
                expected.is_empty(),
                "converted although {expected:?} are unsupported"
            );
            let model = Model::open(tmp.path().join("g")).unwrap();
            assert_eq!(model.config(), &config);
        }
        Err(e) => panic!("{e}"),
    }
}
