//! Downloads against the loopback test server, with each fault it can inject: the bytes that
//! arrive, what a resume fetches, and the error (and what is left on disk) when it fails.

use std::path::Path;
use std::sync::Arc;

use gdsllm_fetch::testing::{Content, Fault, TestServer};
use gdsllm_fetch::{
    Client, ClientOptions, DownloadOptions, Downloaded, ExpectedSize, FetchError, NoProgress,
    download, partial_path,
};

/// 3 MiB + 17 bytes of a pattern no two offsets share locally.
fn payload() -> Arc<Vec<u8>> {
    Arc::new(
        (0..(3u64 << 20) + 17)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
            .collect(),
    )
}

fn client(retries: u32) -> Client {
    Client::new(ClientOptions {
        retries,
        ..ClientOptions::default()
    })
}

/// `download` with default options and `retries` retries.
fn fetch_default(retries: u32, url: &str, dest: &Path) -> Result<Downloaded, FetchError> {
    download(
        &client(retries),
        url,
        dest,
        &DownloadOptions::default(),
        &NoProgress,
    )
}

fn served(content: &Arc<Vec<u8>>) -> (TestServer, String) {
    let server = TestServer::start();
    server.add_file_with_digest("files/model.gguf", Content::Bytes(content.clone()));
    let url = format!("{}/files/model.gguf", server.url());
    (server, url)
}

fn leftovers(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn assert_nothing_left(dir: &Path) {
    let left = leftovers(dir);
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_whole_file_arrives_and_its_digest_header_is_checked() {
    let content = payload();
    let (_server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("model.gguf");
    let got = fetch_default(0, &url, &dest).unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), *content);
    assert_eq!(got.size, content.len() as u64);
    assert_eq!(got.fetched, content.len() as u64);
    assert_eq!(got.resumed_from, 0);
    assert_eq!(
        got.sha256_checked_against.as_deref(),
        Some("the Repr-Digest header")
    );
    assert_eq!(leftovers(dir.path()), vec!["model.gguf"]);
}

#[test]
fn an_interrupted_download_resumes_where_it_stopped() {
    let content = payload();
    let (server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("model.gguf");
    let cut = 1_300_000;
    server.inject("files/model.gguf", Fault::DropAfter(cut), 1);
    let err = fetch_default(0, &url, &dest).unwrap_err();
    assert!(
        matches!(err, FetchError::Truncated { .. }) && err.to_string().contains("again to resume"),
        "{err}"
    );
    assert!(!dest.exists());
    let held = std::fs::metadata(partial_path(&dest)).unwrap().len();
    assert!(held > 0 && held <= cut, "{held} bytes kept of {cut} sent");

    server.reset_counts();
    let got = fetch_default(0, &url, &dest).unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), *content);
    assert_eq!(got.resumed_from, held);
    assert_eq!(got.fetched, content.len() as u64 - held);
    assert!(
        server.bytes_served("files/model.gguf") < content.len() as u64,
        "the second run fetched {} of {} bytes",
        server.bytes_served("files/model.gguf"),
        content.len()
    );
    let ranged = server
        .requests()
        .iter()
        .any(|r| r.range.as_deref() == Some(&format!("bytes={held}-")) && r.status == 206);
    assert!(ranged, "{:?}", server.requests());
    assert_eq!(leftovers(dir.path()), vec!["model.gguf"]);
}

#[test]
fn a_dropped_connection_is_retried_from_where_it_stopped_in_the_same_run() {
    let content = payload();
    let (server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("model.gguf");
    server.inject("files/model.gguf", Fault::DropAfter(1 << 20), 2);
    let got = fetch_default(3, &url, &dest).unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), *content);
    // Two drops after at most 1 MiB each, then the rest: never the whole file again.
    assert_eq!(got.fetched, content.len() as u64);
    assert!(server.bytes_served("files/model.gguf") <= content.len() as u64);
}

#[test]
fn a_server_that_ignores_ranges_restarts_the_file_and_the_result_is_still_right() {
    let content = payload();
    let (server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("model.gguf");
    server.inject("files/model.gguf", Fault::DropAfter(1 << 20), 1);
    fetch_default(0, &url, &dest).unwrap_err();
    server.inject("files/model.gguf", Fault::IgnoreRange, u64::MAX);
    let got = fetch_default(0, &url, &dest).unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), *content);
    assert_eq!(got.fetched, content.len() as u64, "started over");

    // Ignoring ranges *and* dropping every time: no retry can make progress, and the error
    // says why.
    server.inject("files/model.gguf", Fault::DropAfter(1 << 20), u64::MAX);
    let dest = dir.path().join("again.gguf");
    let err = fetch_default(2, &url, &dest).unwrap_err();
    assert!(
        matches!(err, FetchError::RangeIgnored { .. })
            && err.to_string().contains("ignored the Range request"),
        "{err}"
    );
}

#[test]
fn a_wrong_checksum_is_an_error_and_leaves_nothing() {
    let content = payload();
    let (server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("model.gguf");
    server.inject("files/model.gguf", Fault::WrongChecksum, 1);
    let err = fetch_default(0, &url, &dest).unwrap_err();
    assert!(
        matches!(err, FetchError::Checksum { .. }) && err.to_string().contains("was removed"),
        "{err}"
    );
    assert_nothing_left(dir.path());

    // The user's sha256 wins over the server's, and is checked too.
    let options = DownloadOptions {
        sha256: Some(("00".repeat(32), "--sha256".into())),
        ..DownloadOptions::default()
    };
    let err = download(&client(0), &url, &dest, &options, &NoProgress).unwrap_err();
    assert!(err.to_string().contains("--sha256"), "{err}");
    assert_nothing_left(dir.path());
}

#[test]
fn a_length_that_lies_is_an_error_not_a_short_file() {
    let content = payload();
    let (server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("model.gguf");
    server.inject("files/model.gguf", Fault::WrongLength(100), u64::MAX);
    let err = fetch_default(1, &url, &dest).unwrap_err();
    let expected = content.len() as u64 + 100;
    assert!(
        matches!(err, FetchError::Truncated { expected: e, .. } if e == expected),
        "{err}"
    );
    assert!(!dest.exists());

    // A size known beforehand (a repository's file list) is compared before any byte lands.
    server.clear_faults();
    let options = DownloadOptions {
        size: Some(ExpectedSize {
            bytes: content.len() as u64 - 1,
            according_to: "the file list",
        }),
        ..DownloadOptions::default()
    };
    let err = download(
        &client(0),
        &url,
        &dir.path().join("b.gguf"),
        &options,
        &NoProgress,
    )
    .unwrap_err();
    assert!(
        matches!(err, FetchError::WrongSize { .. }) && err.to_string().contains("the file list"),
        "{err}"
    );
}

#[test]
fn missing_files_unreachable_hosts_and_bad_urls_say_so() {
    let content = payload();
    let (server, _) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("x.gguf");
    let err = download(
        &client(0),
        &format!("{}/nope.gguf", server.url()),
        &dest,
        &DownloadOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    assert!(err.to_string().contains("HTTP 404"), "{err}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let err = download(
        &client(2),
        &format!("http://127.0.0.1:{port}/x.gguf"),
        &dest,
        &DownloadOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    assert!(
        matches!(err, FetchError::Unreachable { .. })
            && err.to_string().contains("cannot reach the server"),
        "{err}"
    );

    let err = download(
        &client(0),
        "ftp://example/x.gguf",
        &dest,
        &DownloadOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    assert!(matches!(err, FetchError::BadUrl { .. }), "{err}");
    assert_nothing_left(dir.path());
}

#[test]
fn a_full_disk_is_an_error_and_the_partial_file_is_removed() {
    let content = payload();
    let (_server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("model.gguf");
    let options = DownloadOptions {
        write_limit: Some(2 << 20),
        ..DownloadOptions::default()
    };
    let err = download(&client(3), &url, &dest, &options, &NoProgress).unwrap_err();
    assert!(
        matches!(err, FetchError::DiskFull { .. }) && err.to_string().contains("no space left"),
        "{err}"
    );
    assert_nothing_left(dir.path());
}

#[test]
fn a_busy_server_is_retried() {
    let content = payload();
    let (server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("model.gguf");
    server.inject("files/model.gguf", Fault::Status(503), 1);
    fetch_default(1, &url, &dest).unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), *content);
    server.inject("files/model.gguf", Fault::Status(503), 5);
    let err = fetch_default(1, &url, &dest).unwrap_err();
    assert!(err.to_string().contains("HTTP 503"), "{err}");
}

#[test]
fn fetch_into_file_fills_an_existing_file_in_place() {
    let content = payload();
    let (server, url) = served(&content);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blob");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    file.set_len(content.len() as u64).unwrap();
    let reader = std::fs::File::open(&path).unwrap();
    server.inject("files/model.gguf", Fault::DropAfter(1 << 20), 1);
    let expected = ExpectedSize {
        bytes: content.len() as u64,
        according_to: "metadata.json",
    };
    let got = gdsllm_fetch::fetch_into_file(&client(2), &url, &file, &path, expected).unwrap();
    assert_eq!(got.size, content.len() as u64);
    // A reader opened before the fetch sees the bytes: same inode.
    let mut seen = Vec::new();
    std::io::Read::read_to_end(&mut &reader, &mut seen).unwrap();
    assert_eq!(seen, *content);
}
