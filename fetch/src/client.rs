//! The HTTP client and the one transfer loop every download goes through: a GET (with
//! `Range: bytes=N-` when resuming), the status and `Content-Range` checked, the body streamed
//! into a [`Sink`], and transient failures (a dropped or stalled connection, a busy server)
//! retried from where the bytes stopped.

use std::io::Read;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::time::Duration;

use crate::error::FetchError;

/// How a [`Client`] behaves.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Transient failures (a connection dropped or stalled mid-transfer, HTTP 5xx/429) retried
    /// per transfer, each resuming where the bytes stopped.
    pub retries: u32,
    /// Time allowed to connect (DNS included).
    pub connect_timeout: Duration,
    /// A response whose next bytes take longer than this counts as dropped.
    pub stall_timeout: Duration,
    /// Sent as `Authorization: Bearer …` (never logged).
    pub bearer_token: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            retries: 3,
            connect_timeout: Duration::from_secs(20),
            stall_timeout: Duration::from_secs(60),
            bearer_token: None,
        }
    }
}

/// A blocking HTTP(S) client (ureq, the one hf-hub's sync API uses). Cheap to clone; clones
/// share connections.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    options: ClientOptions,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("retries", &self.options.retries)
            .field("has_token", &self.options.bearer_token.is_some())
            .finish()
    }
}

/// Where the bytes of a transfer go, in order.
pub trait Sink {
    /// The server has answered (before the first byte of each response): what it says about
    /// the file.
    fn begin(&mut self, _remote: &RemoteFile) -> std::io::Result<()> {
        Ok(())
    }
    /// Everything written so far is void: the transfer starts again at byte 0 (the server
    /// answered a Range request with the whole file).
    fn restart(&mut self) -> std::io::Result<()>;
    /// The next bytes of the file.
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()>;
    /// The next bytes of the file, as the socket reader's buffer: a sink that hands the bytes
    /// to another thread (a hasher) keeps a clone instead of copying them.
    fn write_piece(&mut self, piece: &Piece) -> std::io::Result<()> {
        self.write(piece)
    }
}

/// A piece of a transfer's body, shared by whoever still needs it (a sink's file write, its
/// hasher on another thread); its buffer goes back to the socket reader for the next piece
/// when the last holder drops it, so a transfer copies each byte once, socket to buffer.
#[derive(Clone)]
pub struct Piece(Arc<PieceBuffer>);

struct PieceBuffer {
    bytes: Vec<u8>,
    /// The socket reader's pool of empty buffers (None: freed when dropped).
    home: Option<Sender<Vec<u8>>>,
}

impl Piece {
    /// A piece not drawn from a reader's pool.
    pub(crate) fn new(bytes: Vec<u8>) -> Piece {
        Piece(Arc::new(PieceBuffer { bytes, home: None }))
    }

    fn pooled(bytes: Vec<u8>, home: Sender<Vec<u8>>) -> Piece {
        Piece(Arc::new(PieceBuffer {
            bytes,
            home: Some(home),
        }))
    }
}

impl std::fmt::Debug for Piece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Piece({} bytes)", self.len())
    }
}

impl std::ops::Deref for Piece {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0.bytes
    }
}

impl Drop for PieceBuffer {
    fn drop(&mut self) {
        if let Some(home) = self.home.take() {
            // The reader may have finished and gone; then the buffer is simply freed.
            let _ = home.send(std::mem::take(&mut self.bytes));
        }
    }
}

/// What a server says about a file in its response headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoteFile {
    /// The whole file's length (`Content-Range` total, else `Content-Length` of a 200).
    pub size: Option<u64>,
    /// `ETag`, as sent (quotes included), for `If-Range` when resuming.
    pub etag: Option<String>,
    /// A sha256 the server vouches for, lowercase hex, and the header it came from.
    pub sha256: Option<(String, &'static str)>,
}

/// The result of [`Client::transfer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// The file's length: every byte of it has gone to the sink.
    pub size: u64,
    /// Bytes that crossed the network in this call (retries and restarts included).
    pub fetched: u64,
    /// Whether the server ignored a Range request, so the sink was restarted at byte 0.
    pub restarted: bool,
    pub remote: RemoteFile,
}

/// A length the file must have, and who says so (for the error when it differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedSize {
    pub bytes: u64,
    pub according_to: &'static str,
}

/// Bytes handed from the socket reader to the sink at a time: large enough that the hand-over
/// costs nothing next to the copies, small enough that the pieces in flight stay in the CPU's
/// cache while the sink writes and hashes them.
const READ_CHUNK: usize = 256 << 10;
/// Pieces read ahead of the sink.
const PIPELINE_DEPTH: usize = 8;

impl Client {
    pub fn new(options: ClientOptions) -> Client {
        let config = ureq::Agent::config_builder()
            // Statuses are read here, so that 404 and 416 become clear errors or a restart.
            .http_status_as_error(false)
            .timeout_connect(Some(options.connect_timeout))
            .timeout_recv_response(Some(options.stall_timeout))
            .timeout_per_read(Some(options.stall_timeout))
            // Model files are not compressible, and ranges must count bytes of the file.
            .accept_encoding("identity")
            .user_agent(concat!("gdsllm/", env!("CARGO_PKG_VERSION")))
            .build();
        Client {
            agent: config.into(),
            options,
        }
    }

    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    fn get(&self, url: &str) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        let request = self.agent.get(url);
        match &self.options.bearer_token {
            Some(token) => request.header("Authorization", format!("Bearer {token}")),
            None => request,
        }
    }

    /// GETs a small file whole (at most `limit` bytes), with the same retries as a transfer.
    pub fn get_bytes(&self, url: &str, limit: u64) -> Result<Vec<u8>, FetchError> {
        struct Buffer<'a>(&'a mut Vec<u8>, u64, &'a str);
        impl Sink for Buffer<'_> {
            fn restart(&mut self) -> std::io::Result<()> {
                self.0.clear();
                Ok(())
            }
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
                if (self.0.len() + bytes.len()) as u64 > self.1 {
                    return Err(std::io::Error::other(format!(
                        "{}: larger than the {} bytes such a file may have",
                        self.2, self.1
                    )));
                }
                self.0.extend_from_slice(bytes);
                Ok(())
            }
        }
        let mut bytes = Vec::new();
        self.transfer(url, 0, None, None, &mut Buffer(&mut bytes, limit, url))
            .map_err(|e| match e {
                FetchError::Io { error, .. } => FetchError::BadResponse {
                    url: url.to_string(),
                    reason: error.to_string(),
                },
                e => e,
            })?;
        Ok(bytes)
    }

    /// Streams `url` from byte `start` to its end into `sink`, retrying transient failures
    /// from where the bytes stopped. `validator` (the ETag of the bytes already held) goes out
    /// as `If-Range`, so a file changed since makes the server send it whole, which restarts
    /// the sink. `expected` is checked against what the server announces before any byte is
    /// written.
    pub fn transfer(
        &self,
        url: &str,
        start: u64,
        validator: Option<&str>,
        expected: Option<ExpectedSize>,
        sink: &mut dyn Sink,
    ) -> Result<Transfer, FetchError> {
        check_url(url)?;
        let mut state = TransferState {
            offset: start,
            fetched: 0,
            restarted: false,
            range_ignored_at: None,
            size: expected.map(|e| e.bytes),
            remote: RemoteFile::default(),
        };
        let mut failures = 0;
        loop {
            match self.one_pass(url, validator, expected, &mut state, sink) {
                Ok(Pass::Again) => {}
                Ok(Pass::Done) => {
                    return Ok(Transfer {
                        size: state.offset,
                        fetched: state.fetched,
                        restarted: state.restarted,
                        remote: state.remote,
                    });
                }
                Err(err) if err.is_transient() && failures < self.options.retries => {
                    failures += 1;
                    let pause = Duration::from_millis(250 << failures.min(5));
                    tracing::warn!(
                        "{err}; retrying in {:.2} s ({failures} of {})",
                        pause.as_secs_f64(),
                        self.options.retries
                    );
                    std::thread::sleep(pause);
                }
                Err(FetchError::Truncated { .. } | FetchError::Disconnected { .. })
                    if state.range_ignored_at.is_some() =>
                {
                    return Err(FetchError::RangeIgnored {
                        url: url.to_string(),
                        offset: state.range_ignored_at.unwrap_or_default(),
                    });
                }
                // A retry that found the connection closed says less than where the bytes
                // stopped.
                Err(FetchError::Disconnected { reason, .. }) if state.size.is_some() => {
                    return Err(FetchError::Truncated {
                        url: url.to_string(),
                        received: state.offset,
                        expected: state.size.unwrap_or_default(),
                        reason,
                    });
                }
                Err(err) => return Err(err),
            }
        }
    }

    fn one_pass(
        &self,
        url: &str,
        validator: Option<&str>,
        expected: Option<ExpectedSize>,
        state: &mut TransferState,
        sink: &mut dyn Sink,
    ) -> Result<Pass, FetchError> {
        if state.size.is_some_and(|size| state.offset == size) && state.offset > 0 {
            // Everything is already there; a Range request for nothing would get a 416.
            return Ok(Pass::Done);
        }
        let mut request = self.get(url);
        if state.offset > 0 {
            request = request.header("Range", format!("bytes={}-", state.offset));
            // A weak validator may not be used with If-Range (RFC 9110 13.1.5).
            if let Some(etag) = validator.filter(|v| !v.starts_with("W/")) {
                request = request.header("If-Range", etag);
            }
        }
        let response = request.call().map_err(|e| call_error(url, e))?;
        let status = response.status().as_u16();
        let headers = response.headers();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let content_length = header("content-length").and_then(|v| v.trim().parse::<u64>().ok());
        state.remote.etag = header("etag");
        if let Some(sha) = crate::digest::sha256_from_headers(headers) {
            state.remote.sha256 = Some(sha);
        }
        let size = match status {
            206 => {
                let text = header("content-range").unwrap_or_default();
                let (first, total) =
                    parse_content_range(&text).ok_or_else(|| FetchError::BadResponse {
                        url: url.to_string(),
                        reason: format!("HTTP 206 with an unreadable Content-Range {text:?}"),
                    })?;
                if first != state.offset {
                    return Err(FetchError::WrongRange {
                        url: url.to_string(),
                        asked: state.offset,
                        got: first,
                        content_range: text,
                    });
                }
                total
            }
            200 => {
                if state.offset > 0 {
                    tracing::warn!(
                        "{url}: the server ignored the Range request for bytes {}- (or the file \
                         changed since the partial download); starting over",
                        state.offset
                    );
                    sink.restart().map_err(|e| sink_error(url, e))?;
                    state.range_ignored_at = Some(state.offset);
                    state.offset = 0;
                    state.restarted = true;
                }
                content_length
            }
            404 | 410 => {
                return Err(FetchError::NotFound {
                    url: url.to_string(),
                });
            }
            401 | 403 => {
                return Err(FetchError::Unauthorized {
                    url: url.to_string(),
                    status,
                });
            }
            416 if state.offset > 0 => {
                // The partial file is longer than the file now is: start over.
                tracing::warn!(
                    "{url}: the partial download is longer than the file; starting over"
                );
                sink.restart().map_err(|e| sink_error(url, e))?;
                state.offset = 0;
                state.restarted = true;
                return Ok(Pass::Again);
            }
            _ => {
                return Err(FetchError::Status {
                    url: url.to_string(),
                    status,
                });
            }
        };
        if let (Some(expected), Some(announced)) = (expected, size)
            && expected.bytes != announced
        {
            return Err(FetchError::WrongSize {
                url: url.to_string(),
                expected: expected.bytes,
                actual: announced,
                source_of_size: expected.according_to.to_string(),
            });
        }
        if size.is_some() {
            state.size = size;
        }
        state.remote.size = state.size;
        sink.begin(&state.remote).map_err(|e| sink_error(url, e))?;
        let body = response.into_body().into_reader();
        // The socket is read on its own thread, so that the network never waits for the sink
        // (a disk write, a hash) and the sink never waits for the network.
        std::thread::scope(|scope| -> Result<(), FetchError> {
            let (full_tx, full_rx) = std::sync::mpsc::sync_channel(PIPELINE_DEPTH);
            let (empty_tx, empty_rx) = std::sync::mpsc::channel::<Vec<u8>>();
            scope.spawn(move || read_pieces(body, &full_tx, &empty_tx, &empty_rx));
            for piece in full_rx {
                let piece = match piece {
                    Ok(piece) => piece,
                    Err(e) => {
                        return Err(FetchError::Truncated {
                            url: url.to_string(),
                            received: state.offset,
                            expected: state.size.unwrap_or(0),
                            reason: e.to_string(),
                        });
                    }
                };
                let n = piece.len() as u64;
                if let Some(size) = state.size
                    && state.offset + n > size
                {
                    return Err(FetchError::TooLong {
                        url: url.to_string(),
                        received: state.offset + n,
                        expected: size,
                    });
                }
                sink.write_piece(&piece).map_err(|e| sink_error(url, e))?;
                state.offset += n;
                state.fetched += n;
            }
            Ok(())
        })?;
        match state.size {
            Some(size) if state.offset < size => Err(FetchError::Truncated {
                url: url.to_string(),
                received: state.offset,
                expected: size,
                reason: "the connection closed early".into(),
            }),
            _ => Ok(Pass::Done),
        }
    }
}

/// How one request of a transfer ended, when it did not fail.
enum Pass {
    Done,
    /// Ask again at once (the sink was restarted).
    Again,
}

/// Reads `body` into pieces of [`READ_CHUNK`] bytes (reusing the buffers that come back to
/// `empty` once their pieces are dropped) and sends them in order; ends after the last piece,
/// or an error, or when nobody listens any more.
fn read_pieces(
    mut body: impl Read,
    full: &SyncSender<std::io::Result<Piece>>,
    home: &Sender<Vec<u8>>,
    empty: &Receiver<Vec<u8>>,
) {
    loop {
        let mut buf = empty.try_recv().unwrap_or_default();
        buf.resize(READ_CHUNK, 0);
        let mut filled = 0;
        let mut failed = None;
        while filled < buf.len() {
            match body.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        buf.truncate(filled);
        let last = filled < READ_CHUNK;
        if filled > 0 && full.send(Ok(Piece::pooled(buf, home.clone()))).is_err() {
            return;
        }
        if let Some(e) = failed {
            let _ = full.send(Err(e));
            return;
        }
        if last {
            return;
        }
    }
}

struct TransferState {
    /// Bytes of the file the sink holds.
    offset: u64,
    fetched: u64,
    restarted: bool,
    /// The offset of a Range request the server answered with the whole file.
    range_ignored_at: Option<u64>,
    size: Option<u64>,
    remote: RemoteFile,
}

/// A sink's own failure; the caller knows its path and maps [`FetchError::Io`] to it (a full
/// disk in particular).
fn sink_error(url: &str, error: std::io::Error) -> FetchError {
    FetchError::Io {
        path: url.into(),
        error,
    }
}

fn check_url(url: &str) -> Result<(), FetchError> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| FetchError::BadUrl {
            url: url.to_string(),
            reason: "it must start with http:// or https://".into(),
        })?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(FetchError::BadUrl {
            url: url.to_string(),
            reason: "no host".into(),
        });
    }
    Ok(())
}

/// `bytes FIRST-LAST/TOTAL` → (FIRST, Some(TOTAL)); `*` for an unknown total gives None.
fn parse_content_range(text: &str) -> Option<(u64, Option<u64>)> {
    let rest = text.trim().strip_prefix("bytes")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let first: u64 = first.trim().parse().ok()?;
    let last: u64 = last.trim().parse().ok()?;
    if last < first {
        return None;
    }
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    Some((first, total))
}

/// A failed request (no response) as an error saying what went wrong: the server could not be
/// reached at all, or it dropped the connection before answering (which a retry may fix).
fn call_error(url: &str, error: ureq::Error) -> FetchError {
    use std::io::ErrorKind;
    let unreachable = |reason: String| FetchError::Unreachable {
        url: url.to_string(),
        reason,
    };
    match &error {
        ureq::Error::BadUri(reason) => FetchError::BadUrl {
            url: url.to_string(),
            reason: reason.clone(),
        },
        ureq::Error::HostNotFound => unreachable("host not found".into()),
        ureq::Error::ConnectionFailed => unreachable("the connection failed".into()),
        ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => {
            unreachable(format!("timed out ({error})"))
        }
        ureq::Error::Io(e) if e.kind() == ErrorKind::ConnectionRefused => {
            unreachable("connection refused (is the server running on that port?)".into())
        }
        ureq::Error::Io(e)
            if matches!(
                e.kind(),
                ErrorKind::AddrNotAvailable
                    | ErrorKind::NetworkUnreachable
                    | ErrorKind::HostUnreachable
                    | ErrorKind::NotFound
            ) =>
        {
            unreachable(e.to_string())
        }
        ureq::Error::Tls(_) => unreachable(error.to_string()),
        _ => FetchError::Disconnected {
            url: url.to_string(),
            reason: error.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_parses_and_refuses_nonsense() {
        assert_eq!(
            parse_content_range("bytes 100-199/1000"),
            Some((100, Some(1000)))
        );
        assert_eq!(parse_content_range("bytes 0-0/*"), Some((0, None)));
        assert_eq!(parse_content_range("bytes 10-5/100"), None);
        assert_eq!(parse_content_range("items 0-1/2"), None);
        assert_eq!(parse_content_range(""), None);
    }

    #[test]
    fn urls_need_a_scheme_and_a_host() {
        assert!(check_url("http://127.0.0.1:1/x").is_ok());
        assert!(matches!(
            check_url("ftp://host/x"),
            Err(FetchError::BadUrl { .. })
        ));
        assert!(matches!(
            check_url("https:///x"),
            Err(FetchError::BadUrl { .. })
        ));
    }
}
