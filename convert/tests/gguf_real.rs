//! Converting the real SmolLM2 Q4_1 GGUF: quantized tensors carried over bit for bit (apart
//! from the documented Q/K row move), dequantizing to the DESIGN.md formulas, and converting
//! twice giving identical directories.

mod common;

use std::path::Path;

use gdsllm_convert::convert::{ConvertOptions, NoProgress, convert};
use gdsllm_convert::gguf::GgufFile;
use gdsllm_convert::gguf_writer::permute_rows_like_llama_cpp;
use half::f16;
use weights_format::{DType, Model, names, quant};

/// DESIGN.md's Q4_1 formula, written out independently of `weights_format::quant`.
fn q4_1_by_formula(block: &[u8]) -> [f32; 32] {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
    let mut x = [0f32; 32];
    for j in 0..16 {
        x[j] = (block[4 + j] & 0xF) as f32 * d + m;
        x[j + 16] = (block[4 + j] >> 4) as f32 * d + m;
    }
    x
}

/// DESIGN.md's Q8_0 formula.
fn q8_0_by_formula(block: &[u8]) -> [f32; 32] {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    std::array::from_fn(|j| block[2 + j] as i8 as f32 * d)
}

fn max_diff_to_formula(dtype: DType, bytes: &[u8]) -> f32 {
    let values = bytes.len() / dtype.block_bytes() * 32;
    let mut decoded = vec![0f32; values];
    quant::dequantize(dtype, bytes, &mut decoded).unwrap();
    let mut max = 0f32;
    for (block, out) in bytes
        .chunks_exact(dtype.block_bytes())
        .zip(decoded.chunks_exact(32))
    {
        let expected = match dtype {
            DType::Q4_1 => q4_1_by_formula(block),
            DType::Q8_0 => q8_0_by_formula(block),
            _ => unreachable!(),
        };
        for (a, b) in expected.iter().zip(out) {
            max = max.max((a - b).abs());
        }
    }
    max
}

fn gguf_bytes(gguf: &GgufFile, name: &str) -> Vec<u8> {
    let mut buf = Vec::new();
    gguf.read_tensor(gguf.tensor(name).unwrap(), &mut buf)
        .unwrap();
    buf
}

fn dir_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn real_gguf_converts_bit_exact_and_reproducibly() {
    let Some(path) = common::model_path("GDSLLM_TEST_GGUF") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smollm2");
    let report = convert(&path, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    let model = Model::open(&out).unwrap();
    let gguf = GgufFile::open(&path).unwrap();
    let config = model.config();
    assert_eq!(
        (
            config.n_layers,
            config.hidden_size,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim
        ),
        (30, 576, 9, 3, 64)
    );
    assert_eq!((config.ffn_dim, config.vocab_size), (1536, 49152));
    assert!(config.tie_word_embeddings);
    assert_eq!(
        (config.bos_token_id, config.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    assert!(!config.add_bos_token);
    assert_eq!(report.tensors, 1 + 30 * 9 + 1);

    // Every tensor, byte for byte; Q and K after re-applying llama.cpp's permutation.
    let mut quantized = 0;
    for layer in 0..30usize {
        let blob = model.layer_blob(layer);
        for name in [
            names::ATTN_NORM,
            names::ATTN_Q,
            names::ATTN_K,
            names::ATTN_V,
            names::ATTN_OUTPUT,
            names::FFN_NORM,
            names::FFN_GATE,
            names::FFN_UP,
            names::FFN_DOWN,
        ] {
            let ours = model.read_tensor(blob, name).unwrap();
            let meta = model.tensor(blob, name).unwrap();
            let theirs = gguf_bytes(&gguf, &format!("blk.{layer}.{name}.weight"));
            let heads = match name {
                names::ATTN_Q => Some(config.n_heads),
                names::ATTN_K => Some(config.n_kv_heads),
                _ => None,
            };
            let comparable = match heads {
                Some(h) => {
                    let row_bytes = ours.len() / meta.shape[0] as usize;
                    // The move really happened: raw bytes differ from the GGUF's order.
                    assert_ne!(ours, theirs, "layer {layer} {name}: rows were not moved");
                    permute_rows_like_llama_cpp(&ours, h as usize, row_bytes)
                }
                None => ours.clone(),
            };
            assert!(
                comparable == theirs,
                "layer {layer} {name}: bytes differ from the GGUF"
            );
            if meta.dtype == DType::Q4_1 {
                quantized += 1;
                let diff = max_diff_to_formula(DType::Q4_1, &ours);
                assert_eq!(diff, 0.0, "layer {layer} {name}: Q4_1 max diff {diff}");
            }
        }
    }
    assert_eq!(quantized, 210, "the file has 210 Q4_1 tensors");
    let embed = model
        .read_tensor(model.embed_blob(), names::TOKEN_EMBD)
        .unwrap();
    assert_eq!(
        model
            .tensor(model.embed_blob(), names::TOKEN_EMBD)
            .unwrap()
            .dtype,
        DType::Q8_0
    );
    assert!(embed == gguf_bytes(&gguf, "token_embd.weight"));
    let diff = max_diff_to_formula(DType::Q8_0, &embed);
    println!("Q4_1 and Q8_0: max |quant::dequantize - formula| = {diff} (tolerance 0)");
    assert_eq!(diff, 0.0);

    // Converting again gives the same bytes in every file.
    let again = tmp.path().join("again");
    convert(&path, &again, &ConvertOptions::default(), &NoProgress).unwrap();
    let (a, b) = (dir_files(&out), dir_files(&again));
    assert_eq!(
        a.iter().map(|f| &f.0).collect::<Vec<_>>(),
        b.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name} differs between two conversions");
    }
    assert!(a.iter().any(|(n, _)| n == "chat_template.jinja"));
}
