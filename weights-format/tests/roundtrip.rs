mod common;

use common::{
    super_block_config, tensor_bytes, tiny_config, write_model, write_tiny, written_tensor,
};
use weights_format::layout;
use weights_format::{ALIGNMENT, DType, FormatError, Model, ModelWriter, names};

#[test]
fn round_trip_every_dtype_bit_exact() {
    for dtype in DType::ALL {
        for tied in [false, true] {
            let tmp = tempfile::tempdir().unwrap();
            let out = tmp.path().join("m");
            // 256-value super-block dtypes need rows of a multiple of 256 values.
            let config = if dtype.is_super_block() {
                super_block_config(tied)
            } else {
                tiny_config(tied)
            };
            let written = write_model(&out, config.clone(), dtype);
            assert_eq!(written.dir(), out);
            let model = Model::open(&out).unwrap();
            assert_eq!(model.metadata(), written.metadata());
            assert_eq!(model.blob_count(), 4);
            // The oldest version that has the family fields and the dtype, so older readers
            // keep reading models without the k-quant-era dtypes.
            assert_eq!(
                model.metadata().format_version,
                dtype
                    .format_version()
                    .max(weights_format::FAMILY_FORMAT_VERSION),
                "{dtype}"
            );
            for (i, file) in layout::blob_files(config.n_layers).iter().enumerate() {
                assert_eq!(&model.blob(i).file, file);
                assert_eq!(model.blob(i).length % ALIGNMENT, 0);
                let kind = layout::blob_kind(file).unwrap();
                for (j, spec) in layout::blob_tensors(&config, kind).iter().enumerate() {
                    let (dt, expected) = written_tensor(spec, dtype, i, j);
                    let got = model.read_tensor(i, spec.name).unwrap();
                    assert!(got == expected, "{file}/{} differs ({dtype})", spec.name);
                    let t = model.tensor(i, spec.name).unwrap();
                    assert_eq!(t.offset % ALIGNMENT, 0);
                    assert_eq!(t.dtype, dt);
                }
            }
            assert_eq!(
                model.lm_head_blob().1,
                if tied {
                    names::TOKEN_EMBD
                } else {
                    names::OUTPUT
                }
            );
            let report = model.verify().unwrap();
            assert_eq!(report.blobs, 4);
            assert_eq!(report.bytes, model.total_bytes());
            // No temp directory is left beside the output.
            let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(leftovers, vec![std::ffi::OsString::from("m")]);
        }
    }
}

#[test]
fn writer_is_deterministic() {
    let tmp = tempfile::tempdir().unwrap();
    write_tiny(&tmp.path().join("a"), DType::Q4_1, false);
    write_tiny(&tmp.path().join("b"), DType::Q4_1, false);
    let mut names: Vec<_> = std::fs::read_dir(tmp.path().join("a"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names.len(), 8, "{names:?}");
    for n in names {
        let a = std::fs::read(tmp.path().join("a").join(&n)).unwrap();
        let b = std::fs::read(tmp.path().join("b").join(&n)).unwrap();
        assert!(a == b, "{n:?} differs between two identical writes");
    }
}

#[test]
fn chunked_tensor_equals_whole_tensor_and_blobs_sort() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tiny_config(true);
    let whole = write_tiny(&tmp.path().join("whole"), DType::Q8_0, true);
    let out = tmp.path().join("chunked");
    let mut w = ModelWriter::create(&out).unwrap();
    // Reverse order: the writer must list blobs in streaming order anyway.
    let files = layout::blob_files(config.n_layers);
    for (i, file) in files.iter().enumerate().rev() {
        let kind = layout::blob_kind(file).unwrap();
        let mut blob = w.begin_blob(file).unwrap();
        for (j, spec) in layout::blob_tensors(&config, kind).iter().enumerate() {
            let (dt, data) = written_tensor(spec, DType::Q8_0, i, j);
            let mut t = blob.begin_tensor(spec.name, dt, &spec.shape).unwrap();
            for piece in data.chunks(1000) {
                t.write_bytes(piece).unwrap();
            }
            assert_eq!(t.remaining(), 0);
            t.finish().unwrap();
        }
        blob.finish().unwrap();
    }
    w.add_file("tokenizer.json", b"{}").unwrap();
    w.add_file("chat_template.jinja", b"{{ messages }}")
        .unwrap();
    let mut source = serde_json::Map::new();
    source.insert("test".into(), "tiny".into());
    let chunked = w
        .finish(
            config,
            "tokenizer.json",
            whole.metadata().chat_template.clone(),
            source,
        )
        .unwrap();
    assert_eq!(chunked.metadata(), whole.metadata());
}

#[test]
fn tensor_byte_count_is_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = ModelWriter::create(tmp.path().join("m")).unwrap();
    let mut blob = w.begin_blob(names::EMBED_BLOB).unwrap();
    let mut t = blob
        .begin_tensor(names::TOKEN_EMBD, DType::F32, &[4, 4])
        .unwrap();
    t.write_bytes(&[0u8; 60]).unwrap();
    let err = t.finish().unwrap_err();
    assert!(
        matches!(&err, FormatError::TensorWrite { blob, tensor, .. } if blob == "embed.bin" && tensor == "token_embd"),
        "{err}"
    );
    // The blob refuses further use after a bad tensor.
    assert!(blob.write_tensor("x", DType::F32, &[1], &[0; 4]).is_err());
    assert!(blob.finish().is_err());

    let mut blob = w.begin_blob(names::EMBED_BLOB).unwrap();
    let mut t = blob
        .begin_tensor(names::TOKEN_EMBD, DType::F32, &[4])
        .unwrap();
    let err = t.write_bytes(&[0u8; 17]).unwrap_err();
    assert!(err.to_string().contains("exceed"), "{err}");
    drop(t);
    let err = blob.begin_tensor("y", DType::Q4_0, &[33]).unwrap_err();
    assert!(err.to_string().contains("unusable"), "{err}");
    drop(blob);
    let mut blob = w.begin_blob(names::EMBED_BLOB).unwrap();
    let err = blob.write_tensor("z", DType::Q4_0, &[33], &[]).unwrap_err();
    assert!(err.to_string().contains("whole number"), "{err}");
}

#[test]
fn writer_rejects_bad_names_and_existing_output() {
    let tmp = tempfile::tempdir().unwrap();
    let existing = tmp.path().join("exists");
    std::fs::create_dir(&existing).unwrap();
    assert!(matches!(
        ModelWriter::create(&existing),
        Err(FormatError::OutputExists { .. })
    ));
    let mut w = ModelWriter::create(tmp.path().join("m")).unwrap();
    assert!(w.begin_blob("layer_7.bin").is_err());
    assert!(w.begin_blob("../embed.bin").is_err());
    assert!(w.add_file("../tokenizer.json", b"").is_err());
    assert!(w.add_file("metadata.json", b"").is_err());
    assert!(w.add_file("output.bin", b"").is_err());
    w.add_file("tokenizer.json", b"{}").unwrap();
    assert!(w.add_file("tokenizer.json", b"{}").is_err());
}

#[test]
fn incomplete_model_is_refused_at_finish_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let config = tiny_config(true);
    let mut w = ModelWriter::create(&out).unwrap();
    let data = tensor_bytes(DType::F32, &[128, 64], 0);
    let mut blob = w.begin_blob(names::EMBED_BLOB).unwrap();
    blob.write_tensor(names::TOKEN_EMBD, DType::F32, &[128, 64], &data)
        .unwrap();
    blob.finish().unwrap();
    w.add_file("tokenizer.json", b"{}").unwrap();
    let err = w
        .finish(config, "tokenizer.json", None, Default::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            FormatError::BlobCount {
                found: 1,
                expected: 4,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn interrupted_writer_leaves_nothing_openable() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let config = tiny_config(false);
    {
        let mut w = ModelWriter::create(&out).unwrap();
        let temp = w.temp_dir().to_path_buf();
        assert!(
            temp.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(".m.partial-")
        );
        for file in layout::blob_files(config.n_layers) {
            let kind = layout::blob_kind(&file).unwrap();
            let mut blob = w.begin_blob(&file).unwrap();
            for spec in layout::blob_tensors(&config, kind) {
                let data = tensor_bytes(DType::F16, &spec.shape, 1);
                blob.write_tensor(spec.name, DType::F16, &spec.shape, &data)
                    .unwrap();
            }
            blob.finish().unwrap();
        }
        // Everything but finish(): the writer is dropped here, as on a crash or an error path.
        assert!(temp.is_dir());
        assert!(
            Model::open(&temp).is_err(),
            "no metadata.json yet, so not a model"
        );
    }
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "temp dir removed"
    );
    assert!(matches!(
        Model::open(&out),
        Err(FormatError::MissingFile { .. })
    ));
}

#[test]
fn missing_parent_directory_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path().join("no-such-dir");
    let err = ModelWriter::create(parent.join("m")).unwrap_err();
    assert!(
        matches!(&err, FormatError::Io { path, .. } if path == &parent),
        "{err}"
    );
}

/// Writes a tiny model with a 40k-token vocabulary (a 10 MB embedding, several staging
/// buffers), every tensor either handed over whole or filled in place with `fill_with`.
fn write_wide(out: &std::path::Path, fill: bool) -> Model {
    let mut config = tiny_config(true);
    config.vocab_size = 40_000;
    let mut w = ModelWriter::create(out).unwrap();
    for (i, file) in layout::blob_files(config.n_layers).iter().enumerate() {
        let kind = layout::blob_kind(file).unwrap();
        let mut blob = w.begin_blob(file).unwrap();
        for (j, spec) in layout::blob_tensors(&config, kind).iter().enumerate() {
            let data = tensor_bytes(DType::F32, &spec.shape, (i * 100 + j) as u64);
            if !fill {
                blob.write_tensor(spec.name, DType::F32, &spec.shape, &data)
                    .unwrap();
                continue;
            }
            let mut t = blob
                .begin_tensor(spec.name, DType::F32, &spec.shape)
                .unwrap();
            let mut pos = 0;
            let mut pieces = 0;
            t.fill_with(|piece| {
                assert!(!piece.is_empty() && piece.len() <= 2 << 20);
                piece.copy_from_slice(&data[pos..pos + piece.len()]);
                pos += piece.len();
                pieces += 1;
                Ok::<(), FormatError>(())
            })
            .unwrap();
            assert_eq!(pos, data.len());
            if data.len() > 2 << 20 {
                assert!(pieces > 1, "a 10 MB tensor spans staging buffers");
            }
            t.finish().unwrap();
        }
        blob.finish().unwrap();
    }
    w.add_file("tokenizer.json", b"{}").unwrap();
    w.finish(config, "tokenizer.json", None, Default::default())
        .unwrap()
}

#[test]
fn tensor_filled_in_place_equals_tensor_written_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = write_wide(&tmp.path().join("whole"), false);
    let filled = write_wide(&tmp.path().join("filled"), true);
    assert_eq!(filled.metadata(), whole.metadata());
    assert!(whole.metadata().blobs[0].length > 2 << 20);
    for blob in &whole.metadata().blobs {
        let a = std::fs::read(tmp.path().join("whole").join(&blob.file)).unwrap();
        let b = std::fs::read(tmp.path().join("filled").join(&blob.file)).unwrap();
        assert!(a == b, "{} differs", blob.file);
    }
    filled.verify().unwrap();
}

#[test]
fn failed_fill_makes_the_blob_unusable_and_leaves_nothing() {
    #[derive(Debug)]
    enum SourceError {
        Read,
        Format,
    }
    impl From<FormatError> for SourceError {
        fn from(_: FormatError) -> SourceError {
            SourceError::Format
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let mut w = ModelWriter::create(&out).unwrap();
    let mut blob = w.begin_blob(names::EMBED_BLOB).unwrap();
    let mut t = blob
        .begin_tensor(names::TOKEN_EMBD, DType::F32, &[128, 64])
        .unwrap();
    let err = t.fill_with(|_| Err(SourceError::Read)).unwrap_err();
    assert!(matches!(err, SourceError::Read), "{err:?}");
    drop(t);
    let err = blob.finish().unwrap_err();
    assert!(err.to_string().contains("unusable"), "{err}");
    drop(w);
    assert!(!out.exists());
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn stale_partial_directories_of_dead_writers_are_removed() {
    let tmp = tempfile::tempdir().unwrap();
    // A pid that is certainly gone: a child that has exited and been reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = tmp.path().join(format!(".m.partial-{dead}"));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("layer_000.bin"), b"half a blob").unwrap();
    // pid 1 is alive: its directory may belong to a running writer and stays.
    let live = tmp.path().join(".m.partial-1");
    std::fs::create_dir(&live).unwrap();
    // Another model's leftovers are not ours to judge.
    let other = tmp.path().join(format!(".other.partial-{dead}"));
    std::fs::create_dir(&other).unwrap();

    write_tiny(&tmp.path().join("m"), DType::F32, true);
    assert!(
        !stale.exists(),
        "the dead writer's directory is still there"
    );
    assert!(live.exists());
    assert!(other.exists());
}
