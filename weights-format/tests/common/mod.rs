//! A tiny model written through the public writer, shared by the integration tests.
#![allow(dead_code)]

use std::path::Path;

use weights_format::layout::{self, BlobKind, TensorSpec};
use weights_format::{ChatTemplateRef, DType, Model, ModelConfig, ModelWriter, quant};

pub fn tiny_config(tied: bool) -> ModelConfig {
    ModelConfig {
        n_layers: 2,
        hidden_size: 64,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        ffn_dim: 96,
        vocab_size: 128,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-5,
        context_length: 256,
        tie_word_embeddings: tied,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        add_bos_token: false,
        ..ModelConfig::default()
    }
}

/// A xorshift64 stream, one per seed (no RNG dependency needed for tests).
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Deterministic pseudo-random values.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut next = xorshift(seed);
    (0..n)
        .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1)
        .collect()
}

/// A config whose rows are whole 256-value super-blocks, for the k-quant dtypes.
pub fn super_block_config(tied: bool) -> ModelConfig {
    ModelConfig {
        hidden_size: 256,
        head_dim: 64,
        ffn_dim: 512,
        vocab_size: 96,
        ..tiny_config(tied)
    }
}

pub fn tensor_bytes(dtype: DType, shape: &[u64], seed: u64) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let mut out = Vec::new();
    if quant::can_quantize(dtype) {
        quant::quantize(dtype, &values(seed, n as usize), &mut out).unwrap();
    } else {
        // Decode-only dtypes: arbitrary bytes are valid blocks.
        let len = dtype.byte_len(shape).unwrap() as usize;
        let mut next = xorshift(seed);
        out.extend((0..len).map(|_| (next() >> 56) as u8));
    }
    out
}

/// The dtype and bytes [`write_model`] writes for tensor `j` (`spec`) of blob `i` when the
/// matrices use `dtype`: f32 for the float-only tensors.
pub fn written_tensor(spec: &TensorSpec, dtype: DType, i: usize, j: usize) -> (DType, Vec<u8>) {
    let dt = if spec.role.is_float_only() {
        DType::F32
    } else {
        dtype
    };
    (dt, tensor_bytes(dt, &spec.shape, (i * 100 + j) as u64))
}

/// Writes a complete tiny model at `out`; matrices use `dtype`, norms f32.
pub fn write_tiny(out: &Path, dtype: DType, tied: bool) -> Model {
    write_model(out, tiny_config(tied), dtype)
}

/// Writes a complete model of `config` at `out`; matrices use `dtype`, norms and biases f32.
pub fn write_model(out: &Path, config: ModelConfig, dtype: DType) -> Model {
    let mut w = ModelWriter::create(out).unwrap();
    for (i, file) in layout::blob_files(config.n_layers).iter().enumerate() {
        let kind = layout::blob_kind(file).unwrap();
        let mut blob = w.begin_blob(file).unwrap();
        for (j, spec) in layout::blob_tensors(&config, kind).iter().enumerate() {
            let (dt, data) = written_tensor(spec, dtype, i, j);
            blob.write_tensor(spec.name, dt, &spec.shape, &data)
                .unwrap();
        }
        blob.finish().unwrap();
        let _ = BlobKind::Embed;
    }
    w.add_file("tokenizer.json", b"{}").unwrap();
    w.add_file("chat_template.jinja", b"{{ messages }}")
        .unwrap();
    let mut source = serde_json::Map::new();
    source.insert("test".into(), "tiny".into());
    w.finish(
        config,
        "tokenizer.json",
        Some(ChatTemplateRef {
            file: "chat_template.jinja".into(),
        }),
        source,
    )
    .unwrap()
}
