//! Pulls over loopback HTTP from the test server: a Hugging Face-style repository through
//! `HF_ENDPOINT` (here the option that stands for it), a GGUF by URL, and a GdsLLM model
//! directory served over HTTP; each fault the server can inject, and what the store holds
//! afterwards. The real SmolLM2 GGUF (`GDSLLM_TEST_GGUF`) is used where the result is compared
//! with converting the local file; the tiny model elsewhere, to keep CI time small.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gdsllm_convert::testing::{TinyLlama, model_path};
use gdsllm_fetch::testing::{Content, Fault, TestServer};
use gdsllm_store::{PullOptions, Quiet, Resolution, Store, StoreError, pull, resolve};

const REAL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Every file of a model directory, by name (hidden work files excluded).
fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| e.file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            (n, bytes)
        })
        .collect();
    files.sort();
    files
}

/// Asserts that two model directories hold the same files with the same bytes.
fn assert_same_model(pulled: &Path, local: &Path) {
    let (a, b) = (files_of(pulled), files_of(local));
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&a), names(&b));
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(
            x == y,
            "{name} differs between {} and {}",
            pulled.display(),
            local.display()
        );
    }
}

/// The local file converted the ordinary way, for comparison.
fn converted_locally(gguf: &Path, out: &Path) -> PathBuf {
    gdsllm_convert::convert(gguf, out, &Default::default(), &gdsllm_convert::NoProgress).unwrap();
    out.to_path_buf()
}

struct Hub {
    server: TestServer,
    home: tempfile::TempDir,
}

impl Hub {
    fn new() -> Hub {
        Hub {
            server: TestServer::start(),
            home: tempfile::tempdir().unwrap(),
        }
    }
    fn store(&self) -> Store {
        Store::at(self.home.path().join("store"))
    }
    fn options(&self) -> PullOptions {
        PullOptions {
            retries: 0,
            hf_endpoint: Some(self.server.url()),
            hf_cache: Some(self.home.path().join("hf")),
            ..PullOptions::default()
        }
    }
    /// The error of a pull of `spec` that must fail, as text.
    fn pull_error(&self, store: &Store, spec: &str) -> String {
        match pull(store, spec, &self.options(), &Quiet) {
            Ok(pulled) => panic!("pulling {spec} succeeded: {:?}", pulled.dir),
            Err(err) => err.to_string(),
        }
    }
    /// A hub with one repository, o/Tiny-GGUF, holding one tiny GGUF (made from `seed`),
    /// Tiny-Q8_0.gguf; returns its bytes.
    fn with_tiny_repo(seed: u64) -> (Hub, Arc<Vec<u8>>) {
        let hub = Hub::new();
        let bytes = tiny_gguf_bytes(seed);
        hub.server.add_hf_repo(
            "o/Tiny-GGUF",
            vec![("Tiny-Q8_0.gguf".into(), Content::Bytes(bytes.clone()))],
        );
        (hub, bytes)
    }
    fn models(&self) -> Vec<String> {
        std::fs::read_dir(self.store().models_dir())
            .map(|d| {
                d.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn tiny_gguf_bytes(seed: u64) -> Arc<Vec<u8>> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    TinyLlama::new(seed, true)
        .gguf(weights_format::DType::Q8_0)
        .write_to(&path)
        .unwrap();
    Arc::new(std::fs::read(path).unwrap())
}

#[test]
fn a_hugging_face_gguf_repo_pulls_the_quant_asked_for_identical_to_the_local_conversion() {
    let Some(gguf) = model_path("GDSLLM_TEST_GGUF") else {
        return;
    };
    let hub = Hub::new();
    hub.server.add_hf_repo(
        "test-org/SmolLM2-GGUF",
        vec![
            (REAL.into(), Content::File(gguf.clone())),
            ("tiny-Q8_0.gguf".into(), Content::Bytes(tiny_gguf_bytes(1))),
            (
                "README.md".into(),
                Content::Bytes(Arc::new(b"# test\n".to_vec())),
            ),
        ],
    );
    let store = hub.store();
    let err = hub.pull_error(&store, "hf.co/test-org/SmolLM2-GGUF");
    assert!(
        err.contains("no GGUF file for quant \"Q4_K_M\"") && err.contains("available: Q4_1, Q8_0"),
        "{err}"
    );
    let err = hub.pull_error(&store, "hf.co/test-org/SmolLM2-GGUF:IQ2_XS");
    assert!(
        err.contains("\"IQ2_XS\"") && err.contains("Q4_1, Q8_0"),
        "{err}"
    );

    let pulled = pull(
        &store,
        "hf.co/test-org/SmolLM2-GGUF:q4_1",
        &hub.options(),
        &Quiet,
    )
    .unwrap();
    assert_eq!(pulled.name, "smollm2:q4_1");
    assert_eq!(pulled.source, "hf.co/test-org/SmolLM2-GGUF:Q4_1");
    let size = std::fs::metadata(&gguf).unwrap().len();
    assert_eq!(pulled.fetched_bytes, size);
    assert_eq!(
        pulled.sha256.as_deref(),
        Some(gdsllm_fetch::sha256_file(&gguf).unwrap().as_str())
    );
    // In hf-hub's cache layout: blobs by ETag, the snapshot of the commit pointing at them.
    let cached = pulled.gguf.as_ref().unwrap();
    assert!(
        cached.starts_with(
            hub.home
                .path()
                .join("hf/models--test-org--SmolLM2-GGUF/snapshots")
        )
    );
    let local = converted_locally(&gguf, &hub.home.path().join("local"));
    assert_same_model(&pulled.dir, &local);

    // Again: up to date, nothing fetched; `-m` finds it without asking the server.
    hub.server.reset_counts();
    let again = pull(
        &store,
        "hf.co/test-org/SmolLM2-GGUF:Q4_1",
        &hub.options(),
        &Quiet,
    )
    .unwrap();
    assert!(again.up_to_date);
    assert_eq!(
        hub.server
            .bytes_served(&format!("test-org/SmolLM2-GGUF/resolve/main/{REAL}")),
        0
    );
    let resolved = resolve(
        &store,
        Some("test-org/SmolLM2-GGUF:Q4_1"),
        &hub.options(),
        &Quiet,
    )
    .unwrap();
    assert!(
        matches!(resolved.how, Resolution::Reused { .. }),
        "{:?}",
        resolved.how
    );
    assert_eq!(resolved.dir, pulled.dir);
}

#[test]
fn an_interrupted_hugging_face_pull_resumes_and_fetches_less_than_the_file() {
    let (hub, bytes) = Hub::with_tiny_repo(2);
    let path = "o/Tiny-GGUF/resolve/main/Tiny-Q8_0.gguf";
    let store = hub.store();
    hub.server
        .inject(path, Fault::DropAfter(bytes.len() as u64 / 2), 1);
    // No quant given and one in the repository: that one.
    let err = hub.pull_error(&store, "hf.co/o/Tiny-GGUF");
    assert!(
        err.contains("run the same command again to resume"),
        "{err}"
    );
    assert!(hub.models().is_empty(), "{:?}", hub.models());
    assert!(store.index().unwrap().names.is_empty());

    hub.server.reset_counts();
    let pulled = pull(&store, "hf.co/o/Tiny-GGUF", &hub.options(), &Quiet).unwrap();
    let second = hub.server.bytes_served(path);
    assert!(
        second < bytes.len() as u64,
        "the resumed pull fetched {second} of {} bytes",
        bytes.len()
    );
    assert_eq!(pulled.name, "tiny:q8_0");
    let local_gguf = hub.home.path().join("Tiny-Q8_0.gguf");
    std::fs::write(&local_gguf, bytes.as_slice()).unwrap();
    assert_same_model(
        &pulled.dir,
        &converted_locally(&local_gguf, &hub.home.path().join("local")),
    );
}

#[test]
fn hugging_face_faults_are_clear_errors_that_leave_nothing_in_the_store() {
    let (hub, _) = Hub::with_tiny_repo(3);
    let path = "o/Tiny-GGUF/resolve/main/Tiny-Q8_0.gguf";
    let store = hub.store();
    let cases: [(Fault, &str); 3] = [
        (Fault::WrongChecksum, "was removed"),
        (Fault::WrongLength(10), "the repository's file list"),
        (Fault::Status(500), "HTTP 500"),
    ];
    for (fault, expected) in cases {
        hub.server.clear_faults();
        hub.server.inject(path, fault, u64::MAX);
        let err = hub.pull_error(&store, "hf.co/o/Tiny-GGUF:Q8_0");
        assert!(err.contains(expected), "{fault:?}: {err}");
        assert!(hub.models().is_empty(), "{fault:?}: {:?}", hub.models());
        assert!(store.index().unwrap().models.is_empty());
    }
    let err = hub.pull_error(&store, "hf.co/o/No-Such-Repo");
    assert!(err.contains("no such repository"), "{err}");
    let unreachable = PullOptions {
        hf_endpoint: Some(format!("http://127.0.0.1:{}", closed_port())),
        ..hub.options()
    };
    let err = pull(&store, "hf.co/o/Tiny-GGUF", &unreachable, &Quiet)
        .unwrap_err()
        .to_string();
    assert!(err.contains("listing its files failed"), "{err}");
}

fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[test]
fn a_safetensors_repo_pulls_config_weights_and_tokenizer_and_converts() {
    let hub = Hub::new();
    let tiny = TinyLlama::new(4, false);
    let local = hub.home.path().join("hf-local");
    tiny.write_hf(&local, 2).unwrap();
    let files: Vec<(String, Content)> = std::fs::read_dir(&local)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            let name = e.file_name().into_string().unwrap();
            (name, Content::File(e.path()))
        })
        .collect();
    hub.server.add_hf_repo("o/tiny-llama", files);
    let store = hub.store();
    let pulled = pull(&store, "o/tiny-llama:q8_0", &hub.options(), &Quiet).unwrap();
    assert_eq!(pulled.name, "tiny-llama:q8_0");
    let expected = hub.home.path().join("local-q8");
    let options = gdsllm_convert::ConvertOptions {
        dtype: gdsllm_convert::TargetDType::Q8_0,
        force: false,
    };
    gdsllm_convert::convert(&local, &expected, &options, &gdsllm_convert::NoProgress).unwrap();
    // The provenance names the directory converted (a snapshot here); the rest is identical.
    let blobs = |dir: &Path| {
        files_of(dir)
            .into_iter()
            .filter(|(n, _)| !n.starts_with("metadata.json"))
            .collect::<Vec<_>>()
    };
    assert!(blobs(&pulled.dir) == blobs(&expected));
    let err = hub.pull_error(&store, "o/tiny-llama:q3_k");
    assert!(err.contains("keep, f16, bf16, q8_0 or q4_1"), "{err}");
}

#[test]
fn a_gguf_by_url_pulls_identical_to_the_local_conversion_and_resumes() {
    let Some(gguf) = model_path("GDSLLM_TEST_GGUF") else {
        return;
    };
    let hub = Hub::new();
    hub.server
        .add_file_with_digest(&format!("files/{REAL}"), Content::File(gguf.clone()));
    let url = format!("{}/files/{REAL}", hub.server.url());
    let size = std::fs::metadata(&gguf).unwrap().len();
    let store = hub.store();
    hub.server
        .inject(&format!("files/{REAL}"), Fault::DropAfter(size / 3), 1);
    let err = hub.pull_error(&store, &url);
    assert!(err.contains("again to resume"), "{err}");
    assert!(hub.models().is_empty());

    hub.server.reset_counts();
    let pulled = pull(&store, &url, &hub.options(), &Quiet).unwrap();
    let second = hub.server.bytes_served(&format!("files/{REAL}"));
    assert!(
        second < size,
        "the resumed pull fetched {second} of {size} bytes"
    );
    assert_eq!(pulled.fetched_bytes, second);
    assert_eq!(pulled.name, "smollm2-135m-instruct:q4_1");
    assert_same_model(
        &pulled.dir,
        &converted_locally(&gguf, &hub.home.path().join("local")),
    );
    // The download is gone once converted; nothing else is left beside it.
    let left: Vec<_> = std::fs::read_dir(store.downloads_dir()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn url_faults_are_clear_errors_that_leave_nothing_in_the_store() {
    let hub = Hub::new();
    let bytes = tiny_gguf_bytes(5);
    hub.server
        .add_file_with_digest("f/Tiny-Q8_0.gguf", Content::Bytes(bytes.clone()));
    hub.server
        .add_file("plain/Tiny-Q8_0.gguf", Content::Bytes(bytes.clone()));
    let url = format!("{}/f/Tiny-Q8_0.gguf", hub.server.url());
    let store = hub.store();
    let leftovers = |store: &Store| -> Vec<String> {
        let mut names = Vec::new();
        for dir in [store.models_dir(), store.downloads_dir()] {
            if let Ok(entries) = std::fs::read_dir(&dir) {
                names.extend(entries.map(|e| e.unwrap().file_name().into_string().unwrap()));
            }
        }
        names
    };

    hub.server
        .inject("f/Tiny-Q8_0.gguf", Fault::WrongChecksum, 1);
    let err = hub.pull_error(&store, &url);
    assert!(
        err.contains("sha256") && err.contains("Repr-Digest"),
        "{err}"
    );
    assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));

    let wrong = PullOptions {
        sha256: Some("ab".repeat(32)),
        ..hub.options()
    };
    let plain = format!("{}/plain/Tiny-Q8_0.gguf", hub.server.url());
    let err = pull(&store, &plain, &wrong, &Quiet)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--sha256"), "{err}");
    assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));

    let full = PullOptions {
        write_limit: Some(bytes.len() as u64 / 2),
        ..hub.options()
    };
    let err = pull(&store, &url, &full, &Quiet).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Fetch(gdsllm_fetch::FetchError::DiskFull { .. })
        ),
        "{err}"
    );
    assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));

    let err = hub.pull_error(&store, &format!("{}/f/none.gguf", hub.server.url()));
    assert!(err.contains("HTTP 404"), "{err}");
    let err = hub.pull_error(
        &store,
        &format!("http://127.0.0.1:{}/x.gguf", closed_port()),
    );
    assert!(err.contains("cannot reach the server"), "{err}");

    // A server that ignores Range: the resume starts over and the result is still right.
    hub.server.inject(
        "f/Tiny-Q8_0.gguf",
        Fault::DropAfter(bytes.len() as u64 / 2),
        1,
    );
    pull(&store, &url, &hub.options(), &Quiet).unwrap_err();
    hub.server
        .inject("f/Tiny-Q8_0.gguf", Fault::IgnoreRange, u64::MAX);
    let pulled = pull(&store, &url, &hub.options(), &Quiet).unwrap();
    assert_eq!(pulled.fetched_bytes, bytes.len() as u64);
    // A valid URL whose file is not a GGUF: the conversion's error, and nothing kept.
    hub.server.add_file(
        "f/junk.gguf",
        Content::Bytes(Arc::new(b"not a gguf".to_vec())),
    );
    let err = hub.pull_error(&store, &format!("{}/f/junk.gguf", hub.server.url()));
    assert!(err.contains("junk.gguf"), "{err}");
    assert_eq!(
        hub.models(),
        vec![
            pulled
                .dir
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        ]
    );
}

#[test]
fn a_served_model_directory_is_cached_and_works_offline_once_complete() {
    let hub = Hub::new();
    let gguf = hub.home.path().join("t.gguf");
    std::fs::write(&gguf, tiny_gguf_bytes(6).as_slice()).unwrap();
    let served = converted_locally(&gguf, &hub.home.path().join("served"));
    hub.server.add_dir("models/tiny", &served);
    let url = format!("{}/models/tiny", hub.server.url());
    let store = hub.store();
    let resolved = resolve(&store, Some(&url), &hub.options(), &Quiet).unwrap();
    let Resolution::Remote {
        local_bytes,
        total_bytes,
        ..
    } = resolved.how
    else {
        panic!("{:?}", resolved.how);
    };
    assert_eq!(local_bytes, 0);
    assert!(total_bytes > 0);
    weights_format::Model::open(&resolved.dir).unwrap();
    // `pull URL/` fetches every blob; then the cache holds the model, byte for byte.
    let pulled = pull(&store, &url, &hub.options(), &Quiet).unwrap();
    assert_eq!(pulled.fetched_bytes, total_bytes);
    let blobs = |dir: &Path| {
        files_of(dir)
            .into_iter()
            .filter(|(n, _)| n != "origin.json")
            .collect::<Vec<_>>()
    };
    assert!(blobs(&resolved.dir) == blobs(&served));
    let listed = store.list().unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].remote && listed[0].name.ends_with("/models/tiny/"));

    let options = hub.options();
    let Hub {
        server,
        home: _home,
    } = hub;
    drop(server);
    let offline = resolve(&store, Some(&url), &options, &Quiet).unwrap();
    assert_eq!(offline.dir, resolved.dir);
    let removed = store.remove(&format!("{url}/")).unwrap();
    assert!(removed.deleted.is_some() && !resolved.dir.exists());
}

#[test]
fn a_length_that_lies_or_a_hub_that_ignores_ranges_on_resume_leaves_nothing_half_written() {
    let hub = Hub::new();
    let bytes = tiny_gguf_bytes(7);
    let store = hub.store();
    let no_model_kept = |store: &Store, fault: &str| {
        assert!(hub.models().is_empty(), "{fault}: {:?}", hub.models());
        assert!(store.index().unwrap().models.is_empty(), "{fault}");
    };

    // By URL: the server announces 10 bytes more than it sends, which to a client is a
    // connection that closed early (before the answer's head, for a file this small): an error
    // naming the URL, and the store holds no model.
    hub.server
        .add_file_with_digest("f/Tiny-Q8_0.gguf", Content::Bytes(bytes.clone()));
    let url = format!("{}/f/Tiny-Q8_0.gguf", hub.server.url());
    hub.server
        .inject("f/Tiny-Q8_0.gguf", Fault::WrongLength(10), u64::MAX);
    let err = pull(&store, &url, &hub.options(), &Quiet).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Fetch(gdsllm_fetch::FetchError::Disconnected { .. })
                | StoreError::Fetch(gdsllm_fetch::FetchError::Truncated { .. })
        ) && err.to_string().contains(&url),
        "{err}"
    );
    no_model_kept(&store, "wrong length by URL");
    hub.server.clear_faults();
    let pulled = pull(&store, &url, &hub.options(), &Quiet).unwrap();
    assert_eq!(pulled.fetched_bytes, bytes.len() as u64);
    assert!(store.remove(&pulled.name).unwrap().deleted.is_some());

    // From the hub: a dropped connection leaves a partial download in the Hugging Face cache;
    // a server that then ignores the Range of the resume is refused by hf-hub with a message
    // that says so, the partial download stays, and the next pull resumes it.
    hub.server.add_hf_repo(
        "o/Tiny-GGUF",
        vec![("Tiny-Q8_0.gguf".into(), Content::Bytes(bytes.clone()))],
    );
    let path = "o/Tiny-GGUF/resolve/main/Tiny-Q8_0.gguf";
    hub.server
        .inject(path, Fault::DropAfter(bytes.len() as u64 / 2), 1);
    pull(&store, "hf.co/o/Tiny-GGUF:Q8_0", &hub.options(), &Quiet).unwrap_err();
    no_model_kept(&store, "dropped from the hub");
    hub.server.inject(path, Fault::IgnoreRange, u64::MAX);
    let err = hub.pull_error(&store, "hf.co/o/Tiny-GGUF:Q8_0");
    assert!(
        err.contains("ignores Range") && err.contains("Tiny-Q8_0.gguf"),
        "{err}"
    );
    no_model_kept(&store, "hub ignoring Range");
    hub.server.clear_faults();
    hub.server.reset_counts();
    let pulled = pull(&store, "hf.co/o/Tiny-GGUF:Q8_0", &hub.options(), &Quiet).unwrap();
    let second = hub.server.bytes_served(path);
    assert!(
        second < bytes.len() as u64,
        "the resumed pull fetched {second} of {} bytes",
        bytes.len()
    );
    assert_eq!(pulled.name, "tiny:q8_0");
    let local_gguf = hub.home.path().join("Tiny-Q8_0.gguf");
    std::fs::write(&local_gguf, bytes.as_slice()).unwrap();
    let dir = store.find("tiny:q8_0").unwrap().expect("stored");
    assert_same_model(
        &dir,
        &converted_locally(&local_gguf, &hub.home.path().join("local")),
    );
}

/// A tiny model's GGUF, whole and split into `parts` parts the way gguf-split splits it.
fn tiny_split(seed: u64, parts: usize) -> (Arc<Vec<u8>>, Vec<Arc<Vec<u8>>>) {
    let whole = TinyLlama::new(seed, true).gguf(weights_format::DType::Q8_0);
    let split = whole
        .split(parts)
        .iter()
        .map(|part| Arc::new(part.to_bytes()))
        .collect();
    (Arc::new(whole.to_bytes()), split)
}

fn part_name(number: usize, count: usize) -> String {
    format!("Tiny-Q8_0-{number:05}-of-{count:05}.gguf")
}

/// What a pull reported: the bars it named, their starts (total, done) and the bytes advanced.
#[derive(Default)]
struct Recorded {
    phases: std::sync::Mutex<Vec<String>>,
    starts: std::sync::Mutex<Vec<(u64, u64)>>,
    advanced: std::sync::atomic::AtomicU64,
}
impl gdsllm_fetch::Progress for Recorded {
    fn start(&self, total: u64, done: u64) {
        self.starts.lock().unwrap().push((total, done));
    }
    fn advance(&self, bytes: u64) {
        self.advanced
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}
impl gdsllm_convert::Progress for Recorded {}
impl gdsllm_store::PullProgress for Recorded {
    fn phase(&self, what: &str) {
        self.phases.lock().unwrap().push(what.to_string());
    }
}

/// Files left in the store's models/ and downloads/.
fn leftovers(store: &Store) -> Vec<String> {
    let mut names = Vec::new();
    for dir in [store.models_dir(), store.downloads_dir()] {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            names.extend(entries.map(|e| e.unwrap().file_name().into_string().unwrap()));
        }
    }
    names
}

#[test]
fn a_split_gguf_pulls_from_a_hub_and_by_url_identical_to_the_merged_file() {
    const PARTS: usize = 3;
    let hub = Hub::new();
    let (whole, parts) = tiny_split(8, PARTS);
    let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let merged = hub.home.path().join("Tiny-Q8_0.gguf");
    std::fs::write(&merged, whole.as_slice()).unwrap();
    let local = converted_locally(&merged, &hub.home.path().join("local"));

    // From the hub: every part of the quant (in a directory of its own, as many repositories
    // keep them), one bar over all of them, converted as one model.
    let mut files: Vec<(String, Content)> = parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                format!("Q8_0/{}", part_name(i + 1, PARTS)),
                Content::Bytes(p.clone()),
            )
        })
        .collect();
    files.push(("Tiny-Q4_1.gguf".into(), Content::Bytes(tiny_gguf_bytes(9))));
    hub.server.add_hf_repo("o/Tiny-GGUF", files);
    let store = hub.store();
    let recorded = Recorded::default();
    let pulled = pull(&store, "hf.co/o/Tiny-GGUF:Q8_0", &hub.options(), &recorded).unwrap();
    assert_eq!(pulled.name, "tiny:q8_0");
    assert_eq!(pulled.fetched_bytes, total);
    assert_eq!(pulled.sha256, None);
    assert_same_model(&pulled.dir, &local);
    let phases = recorded.phases.lock().unwrap().clone();
    assert_eq!(
        phases[0],
        format!("Q8_0/{} ({PARTS} parts)", part_name(1, PARTS)),
        "{phases:?}"
    );
    let starts = recorded.starts.lock().unwrap().clone();
    assert!(
        starts.len() == PARTS && starts.iter().all(|&(t, _)| t == total),
        "{starts:?}"
    );
    assert_eq!(
        starts.last().unwrap().1,
        total - parts[PARTS - 1].len() as u64
    );
    assert_eq!(
        recorded.advanced.load(std::sync::atomic::Ordering::Relaxed),
        total
    );
    let again = pull(&store, "hf.co/o/Tiny-GGUF:Q8_0", &hub.options(), &Quiet).unwrap();
    assert!(again.up_to_date);

    // By URL: the first part's URL brings its siblings; the downloads are gone afterwards.
    for (i, part) in parts.iter().enumerate() {
        hub.server.add_file_with_digest(
            &format!("f/{}", part_name(i + 1, PARTS)),
            Content::Bytes(part.clone()),
        );
    }
    let url = format!("{}/f/{}", hub.server.url(), part_name(1, PARTS));
    let store = Store::at(hub.home.path().join("store-by-url"));
    let pulled = pull(&store, &url, &hub.options(), &Quiet).unwrap();
    assert_eq!(pulled.fetched_bytes, total);
    // Named like the file the parts merge into.
    assert_eq!(pulled.name, "tiny:q8_0");
    assert_same_model(&pulled.dir, &local);
    let downloads: Vec<_> = std::fs::read_dir(store.downloads_dir()).unwrap().collect();
    assert!(downloads.is_empty(), "{downloads:?}");
}

#[test]
fn a_split_gguf_with_a_part_missing_or_not_the_first_leaves_nothing_in_the_store() {
    const PARTS: usize = 3;
    let hub = Hub::new();
    let (_, parts) = tiny_split(10, PARTS);
    let store = hub.store();

    // A hub repository without part 2.
    hub.server.add_hf_repo(
        "o/Tiny-GGUF",
        [0, 2]
            .iter()
            .map(|&i| (part_name(i + 1, PARTS), Content::Bytes(parts[i].clone())))
            .collect(),
    );
    let err = hub.pull_error(&store, "hf.co/o/Tiny-GGUF:Q8_0");
    assert!(
        err.contains("part 2 of 3") && err.contains(&part_name(2, PARTS)),
        "{err}"
    );
    assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));

    // By URL: part 3 is not on the server (HTTP 404, naming it); the parts downloaded before
    // are removed.
    for (i, part) in parts.iter().take(2).enumerate() {
        hub.server.add_file_with_digest(
            &format!("f/{}", part_name(i + 1, PARTS)),
            Content::Bytes(part.clone()),
        );
    }
    let url = format!("{}/f/{}", hub.server.url(), part_name(1, PARTS));
    let err = hub.pull_error(&store, &url);
    assert!(
        err.contains(&part_name(3, PARTS)) && err.contains("HTTP 404"),
        "{err}"
    );
    assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));
    assert!(store.index().unwrap().models.is_empty());

    // The URL of a part other than the first.
    let err = hub.pull_error(
        &store,
        &format!("{}/f/{}", hub.server.url(), part_name(2, PARTS)),
    );
    assert!(
        err.contains("part 2 of 3")
            && err.contains(&format!("pull the first part, {}", part_name(1, PARTS))),
        "{err}"
    );
    // --sha256 cannot name the parts.
    let with_sha = PullOptions {
        sha256: Some("ab".repeat(32)),
        ..hub.options()
    };
    let err = pull(&store, &url, &with_sha, &Quiet)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--sha256 names one file"), "{err}");
    assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));
}

/// Partial downloads left anywhere under `dir`.
fn partial_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(partial_files(&path));
        } else if path.to_string_lossy().contains(".partial") {
            found.push(path);
        }
    }
    found
}

#[test]
fn a_full_disk_during_a_hugging_face_pull_is_a_clear_error_and_leaves_nothing_half_written() {
    let (hub, bytes) = Hub::with_tiny_repo(11);
    let store = hub.store();
    let full = PullOptions {
        write_limit: Some(bytes.len() as u64 / 2),
        ..hub.options()
    };
    let err = pull(&store, "hf.co/o/Tiny-GGUF:Q8_0", &full, &Quiet).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Fetch(gdsllm_fetch::FetchError::DiskFull { .. })
        ),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("no space left") && message.contains("partial download was removed"),
        "{message}"
    );
    assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));
    assert!(store.index().unwrap().models.is_empty());
    let cache = hub.home.path().join("hf");
    assert!(
        partial_files(&cache).is_empty(),
        "{:?}",
        partial_files(&cache)
    );
    // With room again, the same pull works.
    let pulled = pull(&store, "hf.co/o/Tiny-GGUF:Q8_0", &hub.options(), &Quiet).unwrap();
    assert_eq!(pulled.fetched_bytes, bytes.len() as u64);
}
