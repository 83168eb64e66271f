//! Bad input gives an error naming the file and the offset or key, never a panic, and leaves
//! nothing at the output path.

use std::path::Path;

use gdsllm_convert::ConvertError;
use gdsllm_convert::convert::{ConvertOptions, NoProgress, convert};
use gdsllm_convert::gguf::{GgufFile, GgufValue, GgufValueType};
use gdsllm_convert::gguf_writer::GgufBuilder;
use gdsllm_convert::testing::TinyLlama;
use weights_format::DType;

fn convert_err(input: &Path, out: &Path) -> String {
    let err = convert(input, out, &ConvertOptions::default(), &NoProgress)
        .expect_err("conversion should fail");
    assert!(
        !out.exists(),
        "{} was left behind after: {err}",
        out.display()
    );
    // No hidden partial directories either.
    let parent = out.parent().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().into_string().unwrap())
        .filter(|n| n.starts_with(".out"))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    err.to_string()
}

#[test]
fn truncated_gguf_names_file_and_offset_at_every_cut() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = TinyLlama::new(1, true).gguf(DType::Q8_0).to_bytes();
    let path = tmp.path().join("cut.gguf");
    let out = tmp.path().join("out");
    let data_start = {
        std::fs::write(&path, &bytes).unwrap();
        GgufFile::open(&path).unwrap().data_offset() as usize
    };
    // Every cut inside the header, then a few inside the tensor data.
    let cuts = (0..data_start).chain((data_start..bytes.len()).step_by(997));
    let mut checked = 0;
    for cut in cuts {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let msg = convert_err(&path, &out);
        assert!(msg.contains(path.to_str().unwrap()), "cut {cut}: {msg}");
        assert!(
            msg.contains("offset") || msg.contains("lies outside the file"),
            "cut {cut}: {msg}"
        );
        checked += 1;
    }
    std::fs::write(&path, &bytes[..100]).unwrap();
    println!(
        "{checked} truncations rejected; e.g.: {}",
        convert_err(&path, &out)
    );
}

#[test]
fn wrong_magic_and_version_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let mut bytes = TinyLlama::new(1, true).gguf(DType::F32).to_bytes();
    let path = tmp.path().join("bad.gguf");
    let out = tmp.path().join("out");
    bytes[..4].copy_from_slice(b"GGML");
    std::fs::write(&path, &bytes).unwrap();
    let msg = convert_err(&path, &out);
    assert!(
        msg.contains("bad.gguf") && msg.contains("magic") && msg.contains("offset 0"),
        "{msg}"
    );
    bytes[..4].copy_from_slice(b"GGUF");
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let msg = convert_err(&path, &out);
    assert!(
        msg.contains("version 1") && msg.contains("offset 4"),
        "{msg}"
    );
}

#[test]
fn absurd_counts_and_lengths_are_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("absurd.gguf");
    let header = |tensors: u64, kvs: u64| {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&tensors.to_le_bytes());
        b.extend_from_slice(&kvs.to_le_bytes());
        b
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (header(0, 1 << 60), "offset 16"),
        (header(1 << 61, 0), "offset 8"),
        (
            {
                // A key whose length field claims 2^62 bytes.
                let mut b = header(0, 1);
                b.extend_from_slice(&(1u64 << 62).to_le_bytes());
                b.extend_from_slice(&[0; 64]);
                b
            },
            "offset 32",
        ),
        (
            {
                // An array of 2^59 u32 values.
                let mut b = header(0, 1);
                b.extend_from_slice(&1u64.to_le_bytes());
                b.push(b'k');
                b.extend_from_slice(&9u32.to_le_bytes());
                b.extend_from_slice(&4u32.to_le_bytes());
                b.extend_from_slice(&(1u64 << 59).to_le_bytes());
                b.extend_from_slice(&[0; 64]);
                b
            },
            "metadata key k",
        ),
        (
            {
                // A KV value type outside 0-12.
                let mut b = header(0, 1);
                b.extend_from_slice(&1u64.to_le_bytes());
                b.push(b'k');
                b.extend_from_slice(&13u32.to_le_bytes());
                b.extend_from_slice(&[0; 64]);
                b
            },
            "value type 13",
        ),
    ];
    for (bytes, expected) in cases {
        std::fs::write(&path, &bytes).unwrap();
        let err = GgufFile::open(&path)
            .expect_err("must be rejected")
            .to_string();
        assert!(
            err.contains("absurd.gguf") && err.contains(expected),
            "expected {expected:?} in: {err}"
        );
    }
}

#[test]
fn every_kv_type_round_trips_including_nested_arrays() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("kv.gguf");
    let values = vec![
        GgufValue::U8(200),
        GgufValue::I8(-100),
        GgufValue::U16(60000),
        GgufValue::I16(-30000),
        GgufValue::U32(4_000_000_000),
        GgufValue::I32(-2_000_000_000),
        GgufValue::F32(1.5),
        GgufValue::Bool(true),
        GgufValue::String("héllo".into()),
        GgufValue::Array(
            GgufValueType::Array,
            vec![
                GgufValue::Array(
                    GgufValueType::I16,
                    vec![GgufValue::I16(1), GgufValue::I16(-2)],
                ),
                GgufValue::Array(GgufValueType::I16, vec![]),
            ],
        ),
        GgufValue::U64(u64::MAX),
        GgufValue::I64(i64::MIN),
        GgufValue::F64(-2.25),
    ];
    let mut b = GgufBuilder::new();
    for (i, v) in values.iter().enumerate() {
        b.kv(&format!("k{i}"), v.clone());
    }
    b.kv("general.alignment", GgufValue::U32(64));
    b.tensor("t", DType::F32, &[2, 3], vec![0; 24]);
    b.write_to(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    for (i, v) in values.iter().enumerate() {
        assert_eq!(f.get(&format!("k{i}")), Some(v));
    }
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor("t").unwrap().shape, vec![2, 3]);
    assert_eq!(f.tensor("t").unwrap().file_offset, f.data_offset());
}

#[test]
fn every_unsupported_tensor_type_is_listed_with_its_count() {
    let tmp = tempfile::tempdir().unwrap();
    let mut b = TinyLlama::new(1, true).gguf(DType::F32);
    // IQ2_XXS (16, 66 bytes per 256 values) twice, IQ3_S (21, 110 bytes) once.
    b.tensor_raw("blk.0.extra_a.weight", 16, &[2, 256], vec![0; 66 * 2]);
    b.tensor_raw("blk.0.extra_b.weight", 16, &[2, 256], vec![0; 66 * 2]);
    b.tensor_raw("blk.1.extra_c.weight", 21, &[1, 256], vec![0; 110]);
    let path = tmp.path().join("iq.gguf");
    b.write_to(&path).unwrap();
    let msg = convert_err(&path, &tmp.path().join("out"));
    for part in [
        "iq.gguf",
        "3 tensors have ggml types",
        "IQ2_XXS (type 16) ×2 (e.g. blk.0.extra_a.weight)",
        "IQ3_S (type 21) ×1 (e.g. blk.1.extra_c.weight)",
        "Q4_K",
    ] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
}

#[test]
fn a_k_quant_row_that_is_not_whole_super_blocks_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let mut b = TinyLlama::new(1, true).gguf(DType::F32);
    // 576 values per row cannot be Q4_K (ggml type 12): 2.25 super-blocks.
    b.tensor_raw("blk.0.odd.weight", 12, &[2, 576], vec![0; 2 * 324]);
    let path = tmp.path().join("odd.gguf");
    b.write_to(&path).unwrap();
    let msg = convert_err(&path, &tmp.path().join("out"));
    assert!(
        msg.contains("blk.0.odd.weight") && msg.contains("256-value super-blocks"),
        "{msg}"
    );
}

#[test]
fn missing_keys_and_tensors_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    // GGUF without llama.block_count.
    let bytes = TinyLlama::new(1, true).gguf(DType::F32).to_bytes();
    let path = tmp.path().join("nokey.gguf");
    let needle = b"llama.block_count";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    let mut renamed = bytes.clone();
    renamed[at..at + needle.len()].copy_from_slice(b"llama.block_c0unt");
    std::fs::write(&path, &renamed).unwrap();
    let msg = convert_err(&path, &out);
    assert!(
        msg.contains("nokey.gguf") && msg.contains("missing metadata key llama.block_count"),
        "{msg}"
    );

    // HF config without hidden_size.
    let hf = tmp.path().join("hf");
    TinyLlama::new(1, true).write_hf(&hf, 1).unwrap();
    let config_path = hf.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let msg = convert_err(&hf, &out);
    assert!(
        msg.contains("config.json") && msg.contains("missing config key hidden_size"),
        "{msg}"
    );

    // HF directory missing a layer tensor (a shard rewritten without it).
    let hf2 = tmp.path().join("hf2");
    let mut tiny = TinyLlama::new(1, true);
    tiny.tensors
        .retain(|t| t.0 != "model.layers.1.mlp.up_proj.weight");
    tiny.write_hf(&hf2, 1).unwrap();
    let msg = convert_err(&hf2, &out);
    assert!(msg.contains("ffn_up of layer 1"), "{msg}");

    // A truncated safetensors shard.
    let hf3 = tmp.path().join("hf3");
    TinyLlama::new(1, true).write_hf(&hf3, 1).unwrap();
    let st = hf3.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&st)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let msg = convert_err(&hf3, &out);
    assert!(msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn tokenizer_that_cannot_be_built_fails_the_conversion_and_leaves_nothing() {
    // tokenizer.json is built while the blobs are written; its error must still stop the
    // conversion and clean up.
    let tmp = tempfile::tempdir().unwrap();
    let bytes = TinyLlama::new(2, true).gguf(DType::F32).to_bytes();
    let key = b"tokenizer.ggml.model";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    let value = at + bytes[at..].windows(4).position(|w| w == b"gpt2").unwrap();
    let mut renamed = bytes.clone();
    renamed[value..value + 4].copy_from_slice(b"gpt9");
    let path = tmp.path().join("badtok.gguf");
    std::fs::write(&path, &renamed).unwrap();
    let msg = convert_err(&path, &tmp.path().join("out"));
    assert!(
        msg.contains("badtok.gguf") && msg.contains("\"gpt9\" is not supported"),
        "{msg}"
    );
}

#[test]
fn unwritable_output_is_named_and_existing_output_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny.gguf");
    TinyLlama::new(1, true)
        .gguf(DType::F32)
        .write_to(&path)
        .unwrap();
    // The parent of the output is a regular file: not writable even for root.
    let blocker = tmp.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let out = blocker.join("out");
    let err = convert(&path, &out, &ConvertOptions::default(), &NoProgress).unwrap_err();
    assert!(err.to_string().contains("not-a-dir"), "{err}");
    assert!(!out.exists());

    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), b"mine").unwrap();
    let err = convert(&path, &out, &ConvertOptions::default(), &NoProgress).unwrap_err();
    assert!(matches!(err, ConvertError::OutputExists { .. }), "{err}");
    assert!(out.join("keep.txt").exists());
    // --force replaces it with a complete model.
    let forced = ConvertOptions {
        force: true,
        ..Default::default()
    };
    convert(&path, &out, &forced, &NoProgress).unwrap();
    assert!(!out.join("keep.txt").exists());
    weights_format::Model::open(&out).unwrap();
    // A failing forced conversion leaves the old model in place.
    std::fs::write(&path, b"GGUF").unwrap();
    convert(&path, &out, &forced, &NoProgress).unwrap_err();
    weights_format::Model::open(&out).unwrap();
}

/// A GGUF with arrays large enough to be kept as bytes: a string array bigger than the 1 MiB
/// read buffer, so strings cross its end, and arrays of scalars.
fn large_arrays_gguf() -> (GgufBuilder, Vec<String>) {
    let strings: Vec<String> = (0..70_000)
        .map(|i| format!("tok{i}-é{}", "x".repeat(i % 23)))
        .collect();
    let array = |t, items: Vec<GgufValue>| GgufValue::Array(t, items);
    let mut b = GgufBuilder::new();
    b.kv(
        "strings",
        array(
            GgufValueType::String,
            strings
                .iter()
                .map(|s| GgufValue::String(s.clone()))
                .collect(),
        ),
    )
    .kv(
        "ints",
        array(
            GgufValueType::I32,
            (0..300).map(|i| GgufValue::I32(i * 7 - 1000)).collect(),
        ),
    )
    .kv(
        "floats",
        array(
            GgufValueType::F32,
            (0..300).map(|i| GgufValue::F32(i as f32 * 0.5)).collect(),
        ),
    )
    .kv(
        "bools.key",
        array(
            GgufValueType::Bool,
            (0..300).map(|i| GgufValue::Bool(i % 3 == 0)).collect(),
        ),
    )
    .kv(
        "huge",
        array(
            GgufValueType::U64,
            (0..300).map(|_| GgufValue::U64(u64::MAX)).collect(),
        ),
    );
    b.tensor("t", DType::F32, &[2, 3], vec![0; 24]);
    (b, strings)
}

#[test]
fn large_arrays_read_in_place_match_what_was_written() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("big.gguf");
    let (b, strings) = large_arrays_gguf();
    b.write_to(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let got = f.opt_str_array("strings").unwrap().unwrap();
    assert_eq!(got.len(), strings.len());
    assert!(got.iter().zip(&strings).all(|(a, b)| a == b));
    let GgufValue::Array(GgufValueType::String, items) = f.get("strings").unwrap() else {
        panic!("strings is not a string array");
    };
    assert_eq!(items[69_999], GgufValue::String(strings[69_999].clone()));
    let ints = f.opt_int_array("ints").unwrap().unwrap();
    assert_eq!(ints, (0..300).map(|i| i * 7 - 1000).collect::<Vec<i64>>());
    let floats = f.opt_f32_array("floats").unwrap().unwrap();
    assert_eq!(floats, (0..300).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
    assert_eq!(
        f.get("bools.key"),
        Some(&GgufValue::Array(
            GgufValueType::Bool,
            (0..300).map(|i| GgufValue::Bool(i % 3 == 0)).collect()
        ))
    );
    // The same type errors as for parsed arrays.
    let err = f.opt_int_array("huge").unwrap_err().to_string();
    assert!(
        err.contains("an array of 300 U64") && err.contains("expected an array of integers"),
        "{err}"
    );
    let err = f.opt_f32_array("strings").unwrap_err().to_string();
    assert!(err.contains("an array of 70000 String"), "{err}");
    let err = f.opt_str_array("ints").unwrap_err().to_string();
    assert!(err.contains("expected an array of strings"), "{err}");
    assert_eq!(f.metadata().count(), 5);
    assert_eq!(f.tensor("t").unwrap().shape, vec![2, 3]);
}

#[test]
fn large_arrays_are_checked_when_the_header_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("big.gguf");
    let (b, strings) = large_arrays_gguf();
    let bytes = b.to_bytes();
    let find = |needle: &[u8]| {
        bytes
            .windows(needle.len())
            .position(|w| w == needle)
            .unwrap()
    };

    // Invalid UTF-8 in a string past the first read buffer.
    let bad = find(strings[60_000].as_bytes());
    let mut broken = bytes.clone();
    broken[bad] = 0xff;
    std::fs::write(&path, &broken).unwrap();
    let err = GgufFile::open(&path).unwrap_err().to_string();
    assert!(
        err.contains(&format!("offset {bad}:")) && err.contains("strings is not valid UTF-8"),
        "{err}"
    );

    // A bool byte that is neither 0 nor 1: key, type, element type, count, then the bytes.
    let bools = find(b"bools.key") + "bools.key".len() + 4 + 4 + 8;
    let mut broken = bytes.clone();
    broken[bools + 150] = 2;
    std::fs::write(&path, &broken).unwrap();
    let err = GgufFile::open(&path).unwrap_err().to_string();
    assert!(
        err.contains(&format!("offset {}:", bools + 150)) && err.contains("bool byte 2"),
        "{err}"
    );

    // Cut inside each array.
    // (Past the smallest size 70k strings can have, so that the array header is accepted.)
    let array = find(b"strings") + "strings".len() + 4 + 4 + 8;
    for cut in (array + 70_000 * 8..bools).step_by(100_003) {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = GgufFile::open(&path).unwrap_err().to_string();
        assert!(
            err.contains("truncated at offset") && err.contains("key strings"),
            "cut {cut}: {err}"
        );
    }
    for cut in [bools + 1, bools + 299] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = GgufFile::open(&path).unwrap_err().to_string();
        assert!(
            err.contains("truncated at offset") && err.contains("bools.key"),
            "cut {cut}: {err}"
        );
    }
}

#[test]
fn a_tokenizer_or_template_the_runtime_would_refuse_is_never_written() {
    let tmp = tempfile::tempdir().unwrap();
    // Hugging Face directories ship tokenizer.json as it is: one that does not load stops the
    // conversion before any blob is written.
    let hf = tmp.path().join("hf");
    TinyLlama::new(3, true).write_hf(&hf, 1).unwrap();
    std::fs::write(
        hf.join("tokenizer.json"),
        br#"{"model": {"type": "Nonsense"}}"#,
    )
    .unwrap();
    let msg = convert_err(&hf, &tmp.path().join("out"));
    println!("{msg}");
    assert!(
        msg.contains("tokenizer.json") && msg.contains("does not load"),
        "{msg}"
    );

    // A chat template that does not compile.
    let mut builder = TinyLlama::new(3, true).gguf(DType::F32);
    builder.set_kv(
        "tokenizer.chat_template",
        GgufValue::String("{% for message in messages %}{{ message".into()),
    );
    let bytes = builder.to_bytes();
    let path = tmp.path().join("badtemplate.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let err = convert(
        &path,
        &tmp.path().join("out"),
        &ConvertOptions::default(),
        &NoProgress,
    )
    .expect_err("a template that does not compile");
    println!("{err}");
    assert!(
        err.to_string().contains("chat template does not compile"),
        "{err}"
    );
}

#[test]
fn an_interrupted_forced_conversion_is_cleaned_up_on_the_next_one() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("tiny.gguf");
    TinyLlama::new(4, true)
        .gguf(DType::F32)
        .write_to(&input)
        .unwrap();
    let out = tmp.path().join("m");
    convert(&input, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    // What `convert --force` leaves when killed after moving the old model aside: the old
    // model, the new one, and the writer's partial directory, all of a process now gone.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    std::fs::rename(&out, tmp.path().join(format!(".m.old-{dead}"))).unwrap();
    for stale in [
        format!(".m.new-{dead}"),
        format!("..m.new-{dead}.partial-{dead}"),
        format!(".m.partial-{dead}"),
    ] {
        std::fs::create_dir(tmp.path().join(stale)).unwrap();
    }
    let force = ConvertOptions {
        force: true,
        ..Default::default()
    };
    convert(&input, &out, &force, &NoProgress).unwrap();
    weights_format::Model::open(&out).unwrap();
    let left: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
