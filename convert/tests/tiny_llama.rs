//! A tiny LLaMA written by the test as Hugging Face safetensors and as a llama.cpp-style GGUF
//! converts to the same tensors, with the same config, whichever way it arrives.

use std::path::Path;

use gdsllm_convert::convert::{ConvertOptions, NoProgress, TargetDType, convert, open_source};
use gdsllm_convert::lossless::compare_with_source;
use gdsllm_convert::testing::TinyLlama;
use weights_format::{DType, Model, quant};

/// Every tensor of two models, compared byte for byte; returns the number compared.
fn assert_same_tensors(a: &Model, b: &Model) -> usize {
    assert_eq!(a.blob_count(), b.blob_count());
    let mut compared = 0;
    for i in 0..a.blob_count() {
        let (ba, bb) = (a.blob(i), b.blob(i));
        assert_eq!(ba.file, bb.file);
        assert_eq!(ba.tensors.len(), bb.tensors.len(), "{}", ba.file);
        for (ta, tb) in ba.tensors.iter().zip(&bb.tensors) {
            assert_eq!(
                (&ta.name, ta.dtype, &ta.shape),
                (&tb.name, tb.dtype, &tb.shape)
            );
            let (xa, xb) = (
                a.read_tensor(i, &ta.name).unwrap(),
                b.read_tensor(i, &tb.name).unwrap(),
            );
            assert!(xa == xb, "{} {} differs", ba.file, ta.name);
            compared += 1;
        }
    }
    compared
}

fn convert_both(
    tiny: &TinyLlama,
    gguf_dtype: DType,
    target: TargetDType,
    root: &Path,
) -> (Model, Model) {
    let hf_dir = root.join("hf");
    if !hf_dir.exists() {
        tiny.write_hf(&hf_dir, 2).unwrap();
    }
    let gguf_path = root.join(format!("tiny-{gguf_dtype}.gguf"));
    tiny.gguf(gguf_dtype).write_to(&gguf_path).unwrap();
    let options = ConvertOptions {
        dtype: target,
        force: false,
    };
    let from_hf = root.join(format!("from-hf-{target}"));
    let from_gguf = root.join(format!("from-gguf-{gguf_dtype}-{target}"));
    convert(&hf_dir, &from_hf, &options, &NoProgress).unwrap();
    convert(&gguf_path, &from_gguf, &options, &NoProgress).unwrap();
    (
        Model::open(&from_hf).unwrap(),
        Model::open(&from_gguf).unwrap(),
    )
}

#[test]
fn hf_and_gguf_of_the_same_weights_convert_identically() {
    for tied in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let tiny = TinyLlama::new(7, tied);
        let (hf, gguf) = convert_both(&tiny, DType::F32, TargetDType::Keep, tmp.path());
        assert_eq!(hf.config(), gguf.config(), "tied={tied}");
        assert_eq!(hf.config().tie_word_embeddings, tied);
        let n = assert_same_tensors(&hf, &gguf);
        assert_eq!(n, 1 + 2 * 9 + 1 + usize::from(!tied));
        // The values themselves are the test's weights, Q/K in Hugging Face order.
        let q = hf.read_tensor(hf.layer_blob(1), "attn_q").unwrap();
        let expected = &tiny
            .tensors
            .iter()
            .find(|t| t.0 == "model.layers.1.self_attn.q_proj.weight")
            .unwrap()
            .2;
        let got: Vec<f32> = q
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert!(&got == expected);
        // Both carry the chat template (GGUF key / tokenizer_config list entry "default").
        for m in [&hf, &gguf] {
            let t = std::fs::read_to_string(m.dir().join("chat_template.jinja")).unwrap();
            assert_eq!(t, tiny.chat_template());
        }

        // Re-encoding gives the same bytes from both sources, and those are the reference
        // quantizer's output of the original weights.
        let (hf8, gguf8) = convert_both(&tiny, DType::F32, TargetDType::Q8_0, tmp.path());
        assert_same_tensors(&hf8, &gguf8);
        let k = hf8.read_tensor(hf8.layer_blob(0), "attn_k").unwrap();
        let original = &tiny
            .tensors
            .iter()
            .find(|t| t.0 == "model.layers.0.self_attn.k_proj.weight")
            .unwrap()
            .2;
        let mut reference = Vec::new();
        quant::quantize(DType::Q8_0, original, &mut reference).unwrap();
        assert!(k == reference);
        assert_eq!(
            hf8.tensor(hf8.layer_blob(0), "attn_norm").unwrap().dtype,
            DType::F32
        );
    }
}

#[test]
fn quantized_gguf_rows_move_without_requantizing() {
    // A quantized GGUF (as llama.cpp writes it, Q/K rows permuted): after un-permuting, Q and K
    // equal the reference quantization of the Hugging Face rows (quantization is per row, so
    // row moves commute with it). The k-quants need rows of whole 256-value super-blocks.
    for dtype in [
        DType::Q8_0,
        DType::Q4_1,
        DType::Q4K,
        DType::Q6K,
        DType::Q5_0,
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let tiny = if dtype.is_super_block() {
            TinyLlama::with_dims(12, true, 256, 512)
        } else {
            TinyLlama::new(11, true)
        };
        let path = tmp.path().join("q.gguf");
        tiny.gguf(dtype).write_to(&path).unwrap();
        let out = tmp.path().join("out");
        convert(&path, &out, &ConvertOptions::default(), &NoProgress).unwrap();
        let model = Model::open(&out).unwrap();
        assert_eq!(
            model.metadata().format_version,
            dtype
                .format_version()
                .max(weights_format::FAMILY_FORMAT_VERSION)
        );
        for (name, hf) in [
            ("attn_q", "model.layers.1.self_attn.q_proj.weight"),
            ("attn_k", "model.layers.1.self_attn.k_proj.weight"),
            ("ffn_down", "model.layers.1.mlp.down_proj.weight"),
        ] {
            let t = model.tensor(model.layer_blob(1), name).unwrap();
            assert_eq!(t.dtype, dtype);
            let ours = model.read_tensor(model.layer_blob(1), name).unwrap();
            let values = &tiny.tensors.iter().find(|t| t.0 == hf).unwrap().2;
            let mut reference = Vec::new();
            quant::quantize(dtype, values, &mut reference).unwrap();
            assert!(ours == reference, "{dtype} {name}");
        }
        // The lossless check (`gdsllm verify --against`) finds every tensor equal once the
        // row move is undone, and exactly the moved ones (Q and K) different without.
        let source = open_source(&path).unwrap();
        let report = compare_with_source(&model, &source, true).unwrap();
        assert!(report.all_equal(), "{dtype}: {:?}", report.by_dtype);
        let as_stored = compare_with_source(&model, &source, false).unwrap();
        for t in &as_stored.tensors {
            let moved = t.tensor == "attn_q" || t.tensor == "attn_k";
            assert_eq!(t.equal, !moved, "{dtype} {}/{}", t.blob, t.tensor);
        }
    }
}

#[test]
fn the_lossless_check_reports_a_re_encoded_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("f32.gguf");
    TinyLlama::new(11, true)
        .gguf(DType::F32)
        .write_to(&path)
        .unwrap();
    let out = tmp.path().join("q8");
    let options = ConvertOptions {
        dtype: TargetDType::Q8_0,
        ..ConvertOptions::default()
    };
    convert(&path, &out, &options, &NoProgress).unwrap();
    let model = Model::open(&out).unwrap();
    let report = compare_with_source(&model, &open_source(&path).unwrap(), true).unwrap();
    assert!(!report.all_equal());
    // The matrices became q8_0 (different bytes and length); the f32 norms stayed as they were.
    for t in &report.tensors {
        assert_eq!(
            t.equal,
            t.dtype == DType::F32,
            "{}/{}: {t:?}",
            t.blob,
            t.tensor
        );
    }
}

#[test]
fn k_quant_targets_need_whole_super_blocks() {
    // dim 64: no row of this model is a whole 256-value super-block.
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    TinyLlama::new(3, false).write_hf(&hf, 1).unwrap();
    let err = convert(
        &hf,
        &tmp.path().join("out"),
        &ConvertOptions {
            dtype: TargetDType::Q4K,
            force: false,
        },
        &NoProgress,
    )
    .unwrap_err()
    .to_string();
    println!("{err}");
    assert!(
        err.contains("embed_tokens") && err.contains("256-value super-blocks"),
        "{err}"
    );
}

/// Converts `tiny` (written as a Hugging Face directory) with each `(target, dtype, tol)` and
/// checks layer 0's `ffn_up` against the original values: max |w − deq(w)| ≤ tol.
fn conversions_have_bounded_error(tiny: &TinyLlama, cases: &[(TargetDType, DType, f32)]) {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    tiny.write_hf(&hf, 1).unwrap();
    let original = &tiny
        .tensors
        .iter()
        .find(|t| t.0 == "model.layers.0.mlp.up_proj.weight")
        .unwrap()
        .2;
    for &(target, dtype, tol) in cases {
        let out = tmp.path().join(target.name());
        let options = ConvertOptions {
            dtype: target,
            force: false,
        };
        convert(&hf, &out, &options, &NoProgress).unwrap();
        let model = Model::open(&out).unwrap();
        let t = model.tensor(model.layer_blob(0), "ffn_up").unwrap();
        assert_eq!(t.dtype, dtype);
        let bytes = model.read_tensor(model.layer_blob(0), "ffn_up").unwrap();
        let mut got = vec![0f32; original.len()];
        quant::dequantize(dtype, &bytes, &mut got).unwrap();
        let max = original
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{target}: max |w - deq(w)| = {max:.6} (tolerance {tol}, |w| <= 0.125)");
        assert!(max <= tol, "{target}: {max} > {tol}");
    }
}

#[test]
fn k_quant_conversions_from_hf_have_bounded_error() {
    // Weights uniform in ±0.125 (range 0.25). Tolerances: q4_k and q5_k 1.25 steps of a
    // 32-value sub-block's range (0.25 / 15 and 0.25 / 31: the levels are refitted to scales
    // rounded to 6 bits, which can push an extreme past half a step); q6_k and q5_0 one step
    // (the value of largest magnitude maps to −32 resp. −16, so the opposite extreme clamps at
    // +31 / +15: 0.125 / 32 and 0.125 / 16); q5_1 half a step (0.25 / 31 / 2) plus the f16
    // rounding of its scale and min.
    conversions_have_bounded_error(
        &TinyLlama::with_dims(5, false, 256, 512),
        &[
            (TargetDType::Q4K, DType::Q4K, 0.021),
            (TargetDType::Q5K, DType::Q5K, 0.0101),
            (TargetDType::Q6K, DType::Q6K, 0.0040),
            (TargetDType::Q5_0, DType::Q5_0, 0.0079),
            (TargetDType::Q5_1, DType::Q5_1, 0.0045),
        ],
    );
}

#[test]
fn dtype_conversions_from_hf_have_bounded_error() {
    conversions_have_bounded_error(
        &TinyLlama::new(3, false),
        &[
            (TargetDType::F16, DType::F16, 2e-4),
            (TargetDType::Bf16, DType::Bf16, 2e-3),
            (TargetDType::Q8_0, DType::Q8_0, 4e-3),
            (TargetDType::Q4_1, DType::Q4_1, 4e-2),
        ],
    );
}
