//! One test per validation rule of `Model::open`: each corrupts a good tiny model in exactly one
//! way and checks that the error names the right blob and tensor.

mod common;

use std::path::Path;

use common::write_tiny;
use serde_json::{Value, json};
use weights_format::{DType, FormatError, Model};

fn tiny(tied: bool) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    write_tiny(&dir, DType::Q8_0, tied);
    (tmp, dir)
}

fn edit(dir: &Path, f: impl FnOnce(&mut Value)) {
    let path = dir.join("metadata.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Opens after `f` edits metadata.json and returns the error, printing it.
fn open_err(tied: bool, f: impl FnOnce(&mut Value)) -> FormatError {
    let (_tmp, dir) = tiny(tied);
    edit(&dir, f);
    let err = Model::open(&dir).expect_err("corrupted model must not open");
    println!("{err}");
    err
}

fn tensor<'a>(v: &'a mut Value, blob: usize, name: &str) -> &'a mut Value {
    v["blobs"][blob]["tensors"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|t| t["name"] == name)
        .unwrap()
}

#[test]
fn good_model_opens() {
    let (_tmp, dir) = tiny(false);
    Model::open(&dir).unwrap();
}

#[test]
fn malformed_json_names_line_and_column() {
    let (_tmp, dir) = tiny(false);
    let path = dir.join("metadata.json");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.insert_str(text.find("\"blobs\"").unwrap(), "oops ");
    std::fs::write(&path, &text).unwrap();
    let err = Model::open(&dir).unwrap_err();
    let line = text[..text.find("oops").unwrap()].lines().count();
    match &err {
        FormatError::Json {
            path: p,
            line: l,
            column,
            ..
        } => {
            assert_eq!(p, &path);
            assert_eq!(*l, line);
            assert!(*column > 0);
        }
        other => panic!("expected Json, got {other}"),
    }
    assert!(err.to_string().contains("metadata.json: line"), "{err}");
}

#[test]
fn unknown_field_is_a_json_error_with_position() {
    let err = open_err(false, |v| v["config"]["mystery"] = json!(1));
    assert!(
        matches!(&err, FormatError::Json { line, .. } if *line > 1),
        "{err}"
    );
    assert!(err.to_string().contains("mystery"));
}

#[test]
fn missing_metadata() {
    let (_tmp, dir) = tiny(false);
    std::fs::remove_file(dir.join("metadata.json")).unwrap();
    assert!(matches!(
        Model::open(&dir),
        Err(FormatError::MissingFile { .. })
    ));
}

#[test]
fn unsupported_version() {
    let err = open_err(false, |v| {
        v["format_version"] = json!(4);
        v["something_new"] = json!(true);
    });
    assert!(
        matches!(
            err,
            FormatError::UnsupportedVersion {
                found: 4,
                supported: 3,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_dtype_newer_than_the_files_version_is_refused() {
    // A version-2 file that claims a k-quant-era dtype: a version-2 reader would not know it,
    // so the file is inconsistent (tensor lengths of q4_1 and q5_1 differ, so the dtype change
    // comes with the length a q5_1 tensor of that shape has).
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    write_tiny(&dir, DType::Q5_1, false);
    edit(&dir, |v| {
        assert_eq!(v["format_version"], json!(3));
        v["format_version"] = json!(2);
    });
    let err = Model::open(&dir).expect_err("version 2 has no q5_1");
    println!("{err}");
    assert!(
        matches!(
            err,
            FormatError::DTypeNeedsVersion {
                needed: 3,
                found: 2,
                dtype: DType::Q5_1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn config_rules() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("architecture", json!("gpt2"), "architecture"),
        ("n_layers", json!(0), "n_layers"),
        ("hidden_size", json!(0), "hidden_size"),
        ("n_kv_heads", json!(3), "n_kv_heads"),
        ("head_dim", json!(15), "head_dim"),
        ("rope_theta", json!(-1.0), "rope_theta"),
        ("rms_norm_eps", json!(0.0), "rms_norm_eps"),
        ("rope_theta", json!(1e39), "rope_theta"),
        ("bos_token_id", json!(128), "bos_token_id"),
        ("eos_token_ids", json!([2, 500]), "eos_token_ids"),
        (
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 2.0, "low_freq_factor": null, "high_freq_factor": null, "original_max_position_embeddings": null}),
            "rope_scaling.rope_type",
        ),
        (
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": null}),
            "rope_scaling.original_max_position_embeddings",
        ),
        (
            "rope_scaling",
            json!({"rope_type": "linear", "factor": 0.0, "low_freq_factor": null, "high_freq_factor": null, "original_max_position_embeddings": null}),
            "rope_scaling.factor",
        ),
    ];
    for (key, value, expected_key) in cases {
        let err = open_err(false, |v| v["config"][key] = value.clone());
        match &err {
            FormatError::Config { key: k, .. } => assert_eq!(k, expected_key, "{err}"),
            other => panic!("{key}={value}: expected Config, got {other}"),
        }
    }
}

#[test]
fn config_that_changes_shapes_is_caught_by_tensor_shapes() {
    let err = open_err(false, |v| v["config"]["ffn_dim"] = json!(128));
    assert!(
        matches!(&err, FormatError::WrongShape { blob, tensor, expected, .. }
        if blob == "layer_000.bin" && tensor == "ffn_gate" && expected == &vec![128, 64]),
        "{err}"
    );
}

#[test]
fn tied_flag_must_match_output_blob() {
    let err = open_err(true, |v| v["config"]["tie_word_embeddings"] = json!(false));
    assert!(
        matches!(&err, FormatError::MissingTensor { blob, tensor } if blob == "output.bin" && tensor == "output"),
        "{err}"
    );
    let err = open_err(false, |v| v["config"]["tie_word_embeddings"] = json!(true));
    assert!(
        matches!(&err, FormatError::UnexpectedTensor { blob, tensor } if blob == "output.bin" && tensor == "output"),
        "{err}"
    );
}

#[test]
fn blob_list_count_and_order() {
    let err = open_err(false, |v| {
        v["blobs"].as_array_mut().unwrap().pop();
    });
    assert!(
        matches!(
            err,
            FormatError::BlobCount {
                found: 3,
                expected: 4,
                n_layers: 2
            }
        ),
        "{err}"
    );
    let err = open_err(false, |v| v["blobs"].as_array_mut().unwrap().swap(1, 2));
    assert!(
        matches!(&err, FormatError::BlobOrder { index: 1, expected, found } if expected == "layer_000.bin" && found == "layer_001.bin"),
        "{err}"
    );
    let err = open_err(false, |v| v["blobs"][0]["file"] = json!("../embed.bin"));
    assert!(
        matches!(err, FormatError::BlobOrder { index: 0, .. }),
        "{err}"
    );
}

#[test]
fn blob_file_rules() {
    let (_tmp, dir) = tiny(false);
    std::fs::remove_file(dir.join("layer_001.bin")).unwrap();
    let err = Model::open(&dir).unwrap_err();
    assert!(
        matches!(&err, FormatError::MissingFile { path, .. } if path.ends_with("layer_001.bin")),
        "{err}"
    );
    assert_eq!(err.blobs(), vec!["layer_001.bin"]);

    let (_tmp, dir) = tiny(false);
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("output.bin"))
        .unwrap();
    f.set_len(f.metadata().unwrap().len() + 4096).unwrap();
    let err = Model::open(&dir).unwrap_err();
    assert!(
        matches!(&err, FormatError::BlobSize { blob, .. } if blob == "output.bin"),
        "{err}"
    );

    let err = open_err(false, |v| {
        v["blobs"][1]["length"] = json!(v["blobs"][1]["length"].as_u64().unwrap() + 100)
    });
    assert!(
        matches!(&err, FormatError::BlobUnaligned { blob, .. } if blob == "layer_000.bin"),
        "{err}"
    );

    let err = open_err(false, |v| v["blobs"][2]["checksum"] = json!("crc32:1234"));
    assert!(
        matches!(&err, FormatError::ChecksumSyntax { blob, .. } if blob == "layer_001.bin"),
        "{err}"
    );
    let err = open_err(false, |v| {
        v["blobs"][2]["checksum"] = json!("xxh3:ABCDEF0123456789")
    });
    assert!(matches!(&err, FormatError::ChecksumSyntax { .. }), "{err}");
}

#[test]
fn tensor_misaligned() {
    let err = open_err(false, |v| {
        let t = tensor(v, 1, "attn_q");
        t["offset"] = json!(t["offset"].as_u64().unwrap() + 32);
    });
    assert!(
        matches!(&err, FormatError::Misaligned { blob, tensor, .. } if blob == "layer_000.bin" && tensor == "attn_q"),
        "{err}"
    );
}

#[test]
fn tensor_out_of_bounds_including_overflow() {
    let err = open_err(false, |v| {
        let len = v["blobs"][1]["length"].as_u64().unwrap();
        tensor(v, 1, "ffn_down")["offset"] = json!(len);
    });
    assert!(
        matches!(&err, FormatError::TensorOutOfBounds { blob, tensor, .. } if blob == "layer_000.bin" && tensor == "ffn_down"),
        "{err}"
    );
    let err = open_err(false, |v| {
        tensor(v, 1, "ffn_down")["offset"] = json!(u64::MAX - 4095);
    });
    assert!(
        matches!(&err, FormatError::TensorOutOfBounds { .. }),
        "{err}"
    );
}

#[test]
fn tensor_size_mismatch() {
    let err = open_err(false, |v| {
        let t = tensor(v, 2, "attn_k");
        t["length"] = json!(t["length"].as_u64().unwrap() - 34);
    });
    assert!(
        matches!(&err, FormatError::SizeMismatch { blob, tensor, expected: Some(_), .. } if blob == "layer_001.bin" && tensor == "attn_k"),
        "{err}"
    );
    // A shape that is not whole blocks of the dtype.
    let err = open_err(false, |v| tensor(v, 2, "attn_k")["shape"] = json!([32, 63]));
    assert!(
        matches!(&err, FormatError::SizeMismatch { expected: None, .. }),
        "{err}"
    );
    // A shape whose element count overflows u64.
    let err = open_err(false, |v| {
        tensor(v, 2, "attn_k")["shape"] = json!([u64::MAX, u64::MAX, 64])
    });
    assert!(
        matches!(&err, FormatError::SizeMismatch { expected: None, .. }),
        "{err}"
    );
    // dtype changed: q8_0 → f16 needs a different length.
    let err = open_err(false, |v| tensor(v, 2, "attn_k")["dtype"] = json!("f16"));
    assert!(matches!(&err, FormatError::SizeMismatch { .. }), "{err}");
}

#[test]
fn tensor_overlap() {
    let err = open_err(false, |v| {
        let q_off = tensor(v, 1, "attn_q")["offset"].clone();
        tensor(v, 1, "attn_k")["offset"] = q_off;
    });
    assert!(
        matches!(&err, FormatError::Overlap { blob, .. } if blob == "layer_000.bin"),
        "{err}"
    );
}

#[test]
fn tensor_duplicate_missing_unexpected() {
    let err = open_err(false, |v| {
        let t = tensor(v, 1, "attn_q").clone();
        v["blobs"][1]["tensors"].as_array_mut().unwrap().push(t);
    });
    assert!(
        matches!(&err, FormatError::DuplicateTensor { blob, tensor } if blob == "layer_000.bin" && tensor == "attn_q"),
        "{err}"
    );
    let err = open_err(false, |v| {
        v["blobs"][2]["tensors"]
            .as_array_mut()
            .unwrap()
            .retain(|t| t["name"] != "ffn_up");
    });
    assert!(
        matches!(&err, FormatError::MissingTensor { blob, tensor } if blob == "layer_001.bin" && tensor == "ffn_up"),
        "{err}"
    );
    let err = open_err(false, |v| {
        tensor(v, 0, "token_embd")["name"] = json!("tok_embeddings")
    });
    assert!(
        matches!(&err, FormatError::MissingTensor { blob, tensor } if blob == "embed.bin" && tensor == "token_embd"),
        "{err}"
    );
}

#[test]
fn norm_must_be_float() {
    let err = open_err(false, |v| {
        let t = tensor(v, 1, "attn_norm");
        t["dtype"] = json!("q8_0");
        t["length"] = json!(2 * 34);
    });
    assert!(
        matches!(&err, FormatError::DTypeNotAllowed { blob, tensor, dtype: DType::Q8_0, .. } if blob == "layer_000.bin" && tensor == "attn_norm"),
        "{err}"
    );
    // f16 norms are allowed.
    let (_tmp, dir) = tiny(false);
    edit(&dir, |v| {
        let t = tensor(v, 1, "attn_norm");
        t["dtype"] = json!("f16");
        t["length"] = json!(128);
    });
    // A deliberate edit is accepted once its checksum is rewritten.
    Model::update_metadata_checksum(&dir).unwrap();
    Model::open(&dir).unwrap();
}

#[test]
fn tokenizer_and_template_files() {
    let (_tmp, dir) = tiny(false);
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert!(
        matches!(Model::open(&dir), Err(FormatError::MissingFile { path, .. }) if path.ends_with("tokenizer.json"))
    );
    let (_tmp, dir) = tiny(false);
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    assert!(
        matches!(Model::open(&dir), Err(FormatError::MissingFile { path, .. }) if path.ends_with("chat_template.jinja"))
    );
    let err = open_err(false, |v| v["tokenizer"] = json!("../../etc/passwd"));
    assert!(
        matches!(&err, FormatError::BadFileName { field, .. } if field == "tokenizer"),
        "{err}"
    );
    let err = open_err(false, |v| {
        v["chat_template"] = json!({"file": "/abs.jinja"})
    });
    assert!(
        matches!(&err, FormatError::BadFileName { field, .. } if field == "chat_template.file"),
        "{err}"
    );
    // No chat template at all is fine.
    let (_tmp, dir) = tiny(false);
    edit(&dir, |v| v["chat_template"] = Value::Null);
    Model::update_metadata_checksum(&dir).unwrap();
    Model::open(&dir).unwrap();
}

#[test]
fn verify_reports_every_bad_blob() {
    let (_tmp, dir) = tiny(false);
    for (file, at) in [("layer_000.bin", 5000u64), ("output.bin", 10)] {
        let path = dir.join(file);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[at as usize] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
    }
    let model = Model::open(&dir).unwrap();
    let mut done = Vec::new();
    let err = model
        .verify_with(|p| {
            if let weights_format::VerifyProgress::BlobDone { file, result, .. } = p {
                done.push((file.to_string(), result.is_ok()));
            }
        })
        .unwrap_err();
    println!("{err}");
    assert!(
        matches!(&err, FormatError::VerifyFailed { total: 5, errors } if errors.len() == 2),
        "{err}"
    );
    assert_eq!(err.blobs(), vec!["layer_000.bin", "output.bin"]);
    assert_eq!(
        done,
        vec![
            ("embed.bin".to_string(), true),
            ("layer_000.bin".to_string(), false),
            ("layer_001.bin".to_string(), true),
            ("output.bin".to_string(), false)
        ]
    );
    assert!(model.verify_blob(0).is_ok());
    assert!(
        matches!(model.verify_blob(1), Err(FormatError::BadChecksum { blob, .. }) if blob == "layer_000.bin")
    );
}

#[test]
fn verify_notices_a_blob_truncated_after_open() {
    let (_tmp, dir) = tiny(false);
    let model = Model::open(&dir).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("embed.bin"))
        .unwrap();
    f.set_len(4096).unwrap();
    let err = model.verify().unwrap_err();
    assert_eq!(err.blobs(), vec!["embed.bin"], "{err}");
}

#[test]
fn verify_checks_metadata_checksum() {
    let (_tmp, dir) = tiny(false);
    let model = Model::open(&dir).unwrap();
    // A semantically harmless edit still counts as a change of metadata.json.
    edit(&dir, |v| v["source"]["note"] = json!("edited by hand"));
    let err = model.verify().unwrap_err();
    assert_eq!(err.blobs(), vec!["metadata.json"], "{err}");
    std::fs::remove_file(dir.join("metadata.json.xxh3")).unwrap();
    let err = model.verify().unwrap_err();
    assert_eq!(err.blobs(), vec!["metadata.json.xxh3"], "{err}");
}

#[test]
fn open_checks_the_metadata_side_file() {
    let (_tmp, dir) = tiny(false);
    edit(&dir, |v| v["source"]["note"] = json!("edited by hand"));
    let err = Model::open(&dir).unwrap_err();
    println!("{err}");
    assert!(matches!(err, FormatError::MetadataChanged { .. }), "{err}");
    assert!(
        err.to_string().contains("--update-metadata-checksum"),
        "{err}"
    );

    let sum = dir.join("metadata.json.xxh3");
    Model::update_metadata_checksum(&dir).unwrap();
    Model::open(&dir).unwrap();
    let good = std::fs::read(&sum).unwrap();

    std::fs::remove_file(&sum).unwrap();
    let err = Model::open(&dir).unwrap_err();
    println!("{err}");
    assert!(
        matches!(&err, FormatError::MissingFile { path, .. } if path.ends_with("metadata.json.xxh3")),
        "{err}"
    );
    for garbage in [
        &b"xxh3:nothex0000000000\n"[..],
        b"",
        b"\xff\xfe",
        &[b'x'; 4096],
    ] {
        std::fs::write(&sum, garbage).unwrap();
        let err = Model::open(&dir).unwrap_err();
        println!("{err}");
        assert!(
            matches!(
                err,
                FormatError::ChecksumSyntax { .. } | FormatError::TooLarge { .. }
            ),
            "{err}"
        );
    }
    std::fs::remove_file(&sum).unwrap();
    std::fs::create_dir(&sum).unwrap();
    let err = Model::open(&dir).unwrap_err();
    println!("{err}");
    assert!(
        matches!(
            err,
            FormatError::NotRegularFile {
                found: "a directory",
                ..
            }
        ),
        "{err}"
    );
    std::fs::remove_dir(&sum).unwrap();
    std::fs::write(&sum, good).unwrap();
    Model::open(&dir).unwrap();
}

/// A FIFO would block `open(2)` until a writer comes; none ever does here.
fn make_fifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo");
    assert!(status.success());
}

#[test]
fn special_files_are_refused_without_blocking() {
    for name in [
        "metadata.json",
        "metadata.json.xxh3",
        "tokenizer.json",
        "layer_001.bin",
    ] {
        let (_tmp, dir) = tiny(false);
        std::fs::remove_file(dir.join(name)).unwrap();
        make_fifo(&dir.join(name));
        let err = Model::open(&dir).unwrap_err();
        println!("{err}");
        assert!(
            matches!(&err, FormatError::NotRegularFile { path, found: "a FIFO" } if path.ends_with(name)),
            "{name}: {err}"
        );
    }
}

#[test]
fn symlinks_out_of_the_model_directory_are_refused() {
    for name in ["tokenizer.json", "chat_template.jinja", "embed.bin"] {
        let (tmp, dir) = tiny(false);
        let outside = tmp.path().join(format!("outside-{name}"));
        std::fs::rename(dir.join(name), &outside).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join(name)).unwrap();
        let err = Model::open(&dir).unwrap_err();
        println!("{err}");
        assert!(
            matches!(&err, FormatError::OutsideModelDir { path, .. } if path.ends_with(name)),
            "{name}: {err}"
        );
        // A link to a file inside the directory is fine.
        let inside = dir.join(format!("real-{name}"));
        std::fs::rename(&outside, &inside).unwrap();
        std::fs::remove_file(dir.join(name)).unwrap();
        std::os::unix::fs::symlink(format!("real-{name}"), dir.join(name)).unwrap();
        Model::open(&dir).unwrap();
    }
}

#[test]
fn extreme_layer_counts_fail_before_allocating() {
    for n in [u32::MAX, u32::MAX - 1, 100_000_000, 3] {
        let err = open_err(false, |v| v["config"]["n_layers"] = json!(n));
        assert!(
            matches!(err, FormatError::BlobCount { found: 4, n_layers, .. } if n_layers == n),
            "{err}"
        );
    }
    let err = open_err(false, |v| v["config"]["n_layers"] = json!(u64::MAX));
    assert!(matches!(err, FormatError::Json { .. }), "{err}");
}

#[test]
fn rope_scaling_nonsense_is_refused() {
    let llama3 = |v: &mut Value| {
        v["config"]["rope_scaling"] = json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
        })
    };
    let (_tmp, dir) = tiny(false);
    edit(&dir, llama3);
    Model::update_metadata_checksum(&dir).unwrap();
    for (key, value) in [
        ("original_max_position_embeddings", json!(0)),
        ("high_freq_factor", json!(1.0)),
        ("high_freq_factor", json!(0.5)),
        ("factor", json!(0.0)),
        ("factor", json!(-2.0)),
        ("low_freq_factor", json!(1e39)),
    ] {
        let err = open_err(false, |v| {
            llama3(v);
            v["config"]["rope_scaling"][key] = value.clone();
        });
        assert!(
            matches!(&err, FormatError::Config { key: k, .. } if k.starts_with("rope_scaling."))
                || matches!(err, FormatError::Json { .. }),
            "{key}={value}: {err}"
        );
    }
    let err = open_err(false, |v| {
        v["config"]["rope_scaling"] = json!({"rope_type": "linear", "factor": 2.0,
            "original_max_position_embeddings": 0})
    });
    assert!(
        matches!(&err, FormatError::Config { key, .. } if key == "rope_scaling.original_max_position_embeddings"),
        "{err}"
    );
}
