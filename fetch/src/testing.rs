//! A loopback HTTP server for tests: static files with Range support, a Hugging Face-style
//! layout (`/OWNER/REPO/resolve/main/FILE` with the headers hf-hub reads, and the API's file
//! list `/api/models/OWNER/REPO[/revision/main]`), and faults injected per path: a connection
//! dropped mid-file, Range ignored, a length that lies, a wrong checksum, an error status.
//! It counts the body bytes it sends per path, so tests can see what a resume fetched.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use sha2::{Digest, Sha256};

/// The bytes of a served file.
#[derive(Debug, Clone)]
pub enum Content {
    Bytes(Arc<Vec<u8>>),
    /// Streamed from disk (large files).
    File(PathBuf),
}

impl Content {
    fn len(&self) -> u64 {
        match self {
            Content::Bytes(b) => b.len() as u64,
            Content::File(p) => std::fs::metadata(p).map(|m| m.len()).unwrap_or(0),
        }
    }

    fn read_all(&self) -> Vec<u8> {
        match self {
            Content::Bytes(b) => b.to_vec(),
            Content::File(p) => std::fs::read(p).unwrap_or_default(),
        }
    }
}

/// What goes wrong with a path's responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The connection closes after this many body bytes of a response (responses no longer
    /// than that are not affected, and do not count).
    DropAfter(u64),
    /// Range requests get `200` and the whole file.
    IgnoreRange,
    /// Every length the server announces for the file (Content-Length, Content-Range,
    /// X-Linked-Size) is this many bytes more than it has, so the body ends early.
    WrongLength(u64),
    /// The sha256 the server announces for the file (ETag / X-Linked-Etag, Repr-Digest) is not
    /// the file's.
    WrongChecksum,
    /// The response is this status, without a body.
    Status(u16),
}

struct Served {
    content: Content,
    /// Headers sent with every response for this path (ETag, X-Repo-Commit, ...).
    headers: Vec<(String, String)>,
    /// sha256 of the content, for the faults that falsify it.
    sha256: String,
}

#[derive(Default)]
struct ServerState {
    files: parking_lot::Mutex<HashMap<String, Arc<Served>>>,
    /// path → [(fault, responses it still applies to)]
    faults: parking_lot::Mutex<HashMap<String, Vec<(Fault, u64)>>>,
    bytes: parking_lot::Mutex<HashMap<String, Arc<AtomicU64>>>,
    requests: parking_lot::Mutex<Vec<Request>>,
}

/// One request the server saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub range: Option<String>,
    pub status: u16,
}

/// The server; it stops when dropped.
pub struct TestServer {
    addr: SocketAddr,
    state: Arc<ServerState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    /// Starts serving on 127.0.0.1 at a free port.
    pub fn start() -> TestServer {
        let state = Arc::new(ServerState::default());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let app_state = state.clone();
        let thread = std::thread::Builder::new()
            .name("test-http".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("a tokio runtime");
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                        .await
                        .expect("bind 127.0.0.1:0");
                    ready_tx
                        .send(listener.local_addr().expect("bound"))
                        .expect("the test waits");
                    let app = axum::Router::new().fallback(handle).with_state(app_state);
                    axum::serve(listener, app)
                        .with_graceful_shutdown(async move {
                            let _ = stopped.await;
                        })
                        .await
                        .expect("serving");
                });
            })
            .expect("spawn the test server");
        let addr = ready.recv().expect("the server started");
        TestServer {
            addr,
            state,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serves `content` at `/path` with only an ETag (not a checksum) in its headers.
    pub fn add_file(&self, path: &str, content: Content) {
        let sha256 = sha256_hex(&content.read_all());
        let etag = format!("\"{}-{}\"", content.len(), &sha256[..16]);
        self.insert(path, content, vec![("etag".into(), etag)], sha256);
    }

    /// Serves `content` at `/path` with its sha256 in a `Repr-Digest` header.
    pub fn add_file_with_digest(&self, path: &str, content: Content) {
        use base64::Engine;
        let bytes = Sha256::digest(content.read_all());
        let sha256 = crate::download::hex(&bytes);
        let digest = format!(
            "sha-256=:{}:",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        );
        self.insert(path, content, vec![("repr-digest".into(), digest)], sha256);
    }

    /// Serves every regular file of `dir` under `/prefix/`.
    pub fn add_dir(&self, prefix: &str, dir: &Path) {
        let entries = std::fs::read_dir(dir).expect("a readable directory");
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_file()) {
                let name = entry.file_name().to_string_lossy().into_owned();
                self.add_file(
                    &format!("{}/{name}", prefix.trim_matches('/')),
                    Content::File(entry.path()),
                );
            }
        }
    }

    /// A Hugging Face model repository `owner/repo` at revision main: each file at
    /// `/owner/repo/resolve/main/NAME` with ETag, X-Repo-Commit and, for LFS files (.gguf,
    /// .safetensors), X-Linked-Etag (their sha256) and X-Linked-Size; and the API's file list.
    pub fn add_hf_repo(&self, repo: &str, files: Vec<(String, Content)>) {
        let commit = sha256_hex(repo.as_bytes())[..40].to_string();
        let mut siblings = Vec::new();
        for (name, content) in files {
            let bytes = content.read_all();
            let sha256 = sha256_hex(&bytes);
            let size = bytes.len() as u64;
            let lfs = name.ends_with(".gguf") || name.ends_with(".safetensors");
            let mut headers = vec![("x-repo-commit".to_string(), commit.clone())];
            if lfs {
                headers.push(("etag".into(), format!("\"{sha256}\"")));
                headers.push(("x-linked-etag".into(), format!("\"{sha256}\"")));
                headers.push(("x-linked-size".into(), size.to_string()));
                siblings.push(serde_json::json!({
                    "rfilename": name, "size": size,
                    "lfs": {"sha256": sha256, "size": size},
                }));
            } else {
                headers.push((
                    "etag".into(),
                    format!("\"{}\"", crate::digest::git_blob_id(&bytes)),
                ));
                siblings.push(serde_json::json!({"rfilename": name, "size": size}));
            }
            self.insert(
                &format!("{repo}/resolve/main/{name}"),
                content,
                headers,
                sha256,
            );
        }
        let info = serde_json::json!({"id": repo, "sha": commit, "siblings": siblings});
        let info = Content::Bytes(Arc::new(serde_json::to_vec(&info).expect("json")));
        for path in [
            format!("api/models/{repo}"),
            format!("api/models/{repo}/revision/main"),
        ] {
            self.insert(&path, info.clone(), vec![], String::new());
        }
    }

    fn insert(&self, path: &str, content: Content, headers: Vec<(String, String)>, sha256: String) {
        self.state.files.lock().insert(
            path.trim_start_matches('/').to_string(),
            Arc::new(Served {
                content,
                headers,
                sha256,
            }),
        );
    }

    /// The next `times` responses for `/path` (or every one, with `u64::MAX`) have `fault`,
    /// besides the faults injected before.
    pub fn inject(&self, path: &str, fault: Fault, times: u64) {
        self.state
            .faults
            .lock()
            .entry(path.trim_start_matches('/').to_string())
            .or_default()
            .push((fault, times));
    }

    /// Removes every fault.
    pub fn clear_faults(&self) {
        self.state.faults.lock().clear();
    }

    /// Body bytes sent for `/path` since the start (or [`TestServer::reset_counts`]).
    pub fn bytes_served(&self, path: &str) -> u64 {
        self.state
            .bytes
            .lock()
            .get(path.trim_start_matches('/'))
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Body bytes sent for every path.
    pub fn total_bytes_served(&self) -> u64 {
        self.state
            .bytes
            .lock()
            .values()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// The requests seen so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.state.requests.lock().clone()
    }

    pub fn reset_counts(&self) {
        self.state.bytes.lock().clear();
        self.state.requests.lock().clear();
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    crate::download::hex(&Sha256::digest(bytes))
}

/// `bytes=A-B`, `bytes=A-`, `bytes=-N` over a file of `len` bytes → the inclusive range, or
/// Err(()) when it cannot be satisfied; None for a header this server does not honour (several
/// ranges, another unit), which gets the whole file.
fn parse_range(header: &str, len: u64) -> Option<Result<(u64, u64), ()>> {
    let spec = header.trim().strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    let range = match (first.trim(), last.trim()) {
        ("", n) => {
            let n: u64 = n.parse().ok()?;
            if n == 0 || len == 0 {
                return Some(Err(()));
            }
            (len.saturating_sub(n), len - 1)
        }
        (a, "") => (a.parse().ok()?, len.saturating_sub(1)),
        (a, b) => (
            a.parse().ok()?,
            b.parse::<u64>().ok()?.min(len.saturating_sub(1)),
        ),
    };
    if range.0 >= len || range.1 < range.0 {
        return Some(Err(()));
    }
    Some(Ok(range))
}

async fn handle(
    State(state): State<Arc<ServerState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let path = uri.path().trim_start_matches('/').to_string();
    let range_header = headers
        .get("range")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let response = respond(&state, &method, &path, range_header.as_deref());
    state.requests.lock().push(Request {
        method: method.to_string(),
        path,
        range: range_header,
        status: response.status().as_u16(),
    });
    response
}

fn respond(state: &Arc<ServerState>, method: &Method, path: &str, range: Option<&str>) -> Response {
    let status_only = |status: StatusCode| {
        Response::builder()
            .status(status)
            .body(Body::empty())
            .expect("a valid response")
    };
    if method != Method::GET && method != Method::HEAD {
        return status_only(StatusCode::METHOD_NOT_ALLOWED);
    }
    let Some(served) = state.files.lock().get(path).cloned() else {
        return status_only(StatusCode::NOT_FOUND);
    };
    let len = served.content.len();
    // A dropped connection needs a body longer than where it drops: probes (HEAD, a Range of
    // one byte) pass untouched and do not use up the fault.
    let body_len = match range.and_then(|r| parse_range(r, len)) {
        _ if method == Method::HEAD => 0,
        Some(Ok((first, last))) => last + 1 - first,
        _ => len,
    };
    let faults: Vec<Fault> = {
        let mut faults = state.faults.lock();
        faults
            .get_mut(path)
            .map(|list| {
                list.iter_mut()
                    .filter(|(fault, times)| {
                        *times > 0 && !matches!(fault, Fault::DropAfter(n) if body_len <= *n)
                    })
                    .map(|(fault, times)| {
                        *times -= 1;
                        *fault
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let has = |wanted: fn(&Fault) -> bool| faults.iter().find(|f| wanted(f)).copied();
    if let Some(Fault::Status(code)) = has(|f| matches!(f, Fault::Status(_))) {
        return status_only(
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        );
    }
    let len = served.content.len();
    let extra = match has(|f| matches!(f, Fault::WrongLength(_))) {
        Some(Fault::WrongLength(extra)) => extra,
        _ => 0,
    };
    let claimed = len + extra;
    let wrong_checksum = has(|f| matches!(f, Fault::WrongChecksum)).is_some();
    let honoured = match range {
        Some(r) if has(|f| matches!(f, Fault::IgnoreRange)).is_none() => parse_range(r, claimed),
        _ => None,
    };
    let (status, start, end) = match honoured {
        Some(Ok((a, b))) => (StatusCode::PARTIAL_CONTENT, a, b + 1),
        Some(Err(())) => {
            return Response::builder()
                .status(StatusCode::RANGE_NOT_SATISFIABLE)
                .header("content-range", format!("bytes */{claimed}"))
                .body(Body::empty())
                .expect("a valid response");
        }
        None => (StatusCode::OK, 0, claimed),
    };
    let mut builder = Response::builder()
        .status(status)
        .header("accept-ranges", "bytes")
        .header("content-length", (end - start).to_string());
    if status == StatusCode::PARTIAL_CONTENT {
        builder = builder.header(
            "content-range",
            format!("bytes {start}-{}/{claimed}", end - 1),
        );
    }
    for (name, value) in &served.headers {
        let value = match name.as_str() {
            "x-linked-size" if extra > 0 => (value.parse::<u64>().unwrap_or(0) + extra).to_string(),
            "etag" | "x-linked-etag" if wrong_checksum && value.contains(&served.sha256) => {
                format!("\"{}\"", "0".repeat(64))
            }
            "repr-digest" if wrong_checksum => format!("sha-256=:{}:", "A".repeat(43) + "="),
            _ => value.clone(),
        };
        builder = builder.header(name.as_str(), value);
    }
    if path.starts_with("api/") {
        builder = builder.header("content-type", "application/json");
    }
    if method == Method::HEAD {
        return builder.body(Body::empty()).expect("a valid response");
    }
    let counter = state
        .bytes
        .lock()
        .entry(path.to_string())
        .or_default()
        .clone();
    let drop_after = match has(|f| matches!(f, Fault::DropAfter(_))) {
        Some(Fault::DropAfter(n)) => Some(n),
        _ => None,
    };
    let end = end.min(len);
    builder
        .body(Body::from_stream(body_stream(
            served.content.clone(),
            start,
            end,
            drop_after,
            counter,
        )))
        .expect("a valid response")
}

/// The bytes `start..end` of `content` in pieces, failing (which drops the connection) after
/// `drop_after` bytes.
fn body_stream(
    content: Content,
    start: u64,
    end: u64,
    drop_after: Option<u64>,
    counter: Arc<AtomicU64>,
) -> impl futures::Stream<Item = Result<Vec<u8>, std::io::Error>> + Send {
    const PIECE: u64 = 1 << 20;
    let limit = drop_after.map_or(end, |n| (start + n).min(end));
    let file = match &content {
        Content::File(p) => std::fs::File::open(p).ok(),
        Content::Bytes(_) => None,
    };
    futures::stream::unfold(
        (content, file, start, false),
        move |(content, file, at, done)| {
            let counter = counter.clone();
            async move {
                if done {
                    return None;
                }
                if at >= limit {
                    if limit < end {
                        // Let the bytes before the drop reach the client first (hyper drops
                        // what it has not flushed when the body fails).
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        let err = std::io::Error::new(
                            std::io::ErrorKind::ConnectionAborted,
                            "injected fault: connection dropped",
                        );
                        return Some((Err(err), (content, file, at, true)));
                    }
                    return None;
                }
                let n = PIECE.min(limit - at);
                let piece = match (&content, &file) {
                    (Content::Bytes(b), _) => b[at as usize..(at + n) as usize].to_vec(),
                    (Content::File(_), Some(f)) => {
                        let mut buf = vec![0u8; n as usize];
                        if std::os::unix::fs::FileExt::read_exact_at(f, &mut buf, at).is_err() {
                            return None;
                        }
                        buf
                    }
                    (Content::File(_), None) => return None,
                };
                counter.fetch_add(n, Ordering::Relaxed);
                Some((Ok(piece), (content, file, at + n, false)))
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_like_rfc_9110() {
        assert_eq!(parse_range("bytes=0-9", 100), Some(Ok((0, 9))));
        assert_eq!(parse_range("bytes=90-", 100), Some(Ok((90, 99))));
        assert_eq!(parse_range("bytes=-10", 100), Some(Ok((90, 99))));
        assert_eq!(parse_range("bytes=95-200", 100), Some(Ok((95, 99))));
        assert_eq!(parse_range("bytes=100-", 100), Some(Err(())));
        assert_eq!(parse_range("bytes=0-1,5-6", 100), None);
        assert_eq!(parse_range("items=0-1", 100), None);
    }
}
