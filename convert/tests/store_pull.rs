//! The model store and `pull` without the network: name resolution, and a pull whose GGUF is
//! already in downloads/ (as after an earlier pull) converting without running pip.

mod common;

use gdsllm_convert::convert::NoProgress;
use gdsllm_convert::known_model;
use gdsllm_convert::pull::{PullOptions, pull_into, sha256_file};
use gdsllm_convert::store::{list_models, resolve_in};
use weights_format::Model;

#[test]
fn resolve_lists_available_models_and_suggests_pull() {
    let home = tempfile::tempdir().unwrap();
    let err = resolve_in(home.path(), "smollm2").unwrap_err().to_string();
    assert!(
        err.contains("it is empty") && err.contains("gdsllm pull NAME") && err.contains("smollm2"),
        "{err}"
    );
    // A directory path resolves to itself, whatever the store holds.
    assert_eq!(
        resolve_in(home.path(), home.path().to_str().unwrap()).unwrap(),
        home.path()
    );

    let tiny = home.path().join("tiny.gguf");
    gdsllm_convert::testing::TinyLlama::new(2, true)
        .gguf(weights_format::DType::F32)
        .write_to(&tiny)
        .unwrap();
    let dir = home.path().join("models/tiny");
    std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
    gdsllm_convert::convert(&tiny, &dir, &Default::default(), &NoProgress).unwrap();
    assert_eq!(list_models(home.path()).unwrap(), vec!["tiny".to_string()]);
    assert_eq!(resolve_in(home.path(), "tiny").unwrap(), dir);
    let err = resolve_in(home.path(), "other").unwrap_err().to_string();
    assert!(err.contains("available: tiny"), "{err}");
}

#[test]
fn pull_with_the_gguf_already_downloaded_converts_and_is_idempotent() {
    let Some(gguf) = common::model_path("GDSLLM_TEST_GGUF") else {
        return;
    };
    let known = known_model("smollm2").unwrap();
    assert_eq!(
        sha256_file(&gguf).unwrap(),
        known.sha256,
        "{} is not the expected file",
        gguf.display()
    );
    let home = tempfile::tempdir().unwrap();
    let downloads = home.path().join("downloads");
    std::fs::create_dir_all(&downloads).unwrap();
    std::fs::copy(&gguf, downloads.join(known.gguf_file_name())).unwrap();
    // The GGUF is present and verified, so pip is not needed (and not run).
    let pulled = pull_into(home.path(), "smollm2", &PullOptions::default(), &NoProgress).unwrap();
    assert_eq!(pulled.dir, home.path().join("models/smollm2"));
    assert_eq!(pulled.sha256, known.sha256);
    let model = Model::open(&pulled.dir).unwrap();
    assert_eq!(model.metadata().source["sha256"], known.sha256);
    let before = std::fs::metadata(pulled.dir.join("metadata.json"))
        .unwrap()
        .modified()
        .unwrap();
    let again = pull_into(home.path(), "smollm2", &PullOptions::default(), &NoProgress).unwrap();
    assert_eq!(again, pulled);
    let after = std::fs::metadata(pulled.dir.join("metadata.json"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(
        before, after,
        "an up-to-date model must not be converted again"
    );
    assert_eq!(resolve_in(home.path(), "smollm2").unwrap(), pulled.dir);
}
