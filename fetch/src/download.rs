//! A whole file to disk: into `<dest>.partial` (with `<dest>.partial.json` saying which URL and
//! ETag its bytes belong to, so that the next run resumes it), hashed with sha256 on the way,
//! its length and checksum checked, then renamed to `dest`. A file that fails its checksum, or
//! a disk that fills up, leaves nothing behind; a dropped connection leaves the partial file
//! for the next run to resume.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::client::{Client, ExpectedSize, Piece, RemoteFile, Sink};
use crate::error::FetchError;

/// Progress hooks; the library never prints, callers plug in a progress bar.
pub trait Progress: Sync {
    /// A transfer of `total` bytes (0: unknown) starts, `done` of them already on disk.
    fn start(&self, _total: u64, _done: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;
impl Progress for NoProgress {}

/// What [`download`] checks, besides what the server itself announces.
#[derive(Debug, Clone, Default)]
pub struct DownloadOptions {
    /// The sha256 the file must have (lowercase hex) and who says so; without it, a sha256 the
    /// server gives in its headers is checked, if any.
    pub sha256: Option<(String, String)>,
    /// The length the file must have.
    pub size: Option<ExpectedSize>,
    /// For tests: writing fails as on a full disk once this many bytes are in the partial file.
    pub write_limit: Option<u64>,
}

/// What [`download`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Downloaded {
    pub path: PathBuf,
    pub size: u64,
    /// Bytes that crossed the network in this run.
    pub fetched: u64,
    /// Bytes a partial download of an earlier run already held.
    pub resumed_from: u64,
    pub sha256: String,
    /// Who vouched for the sha256 it was checked against; None when nobody gave one.
    pub sha256_checked_against: Option<String>,
    pub etag: Option<String>,
}

/// The side file of a partial download.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct PartialRecord {
    url: String,
    etag: Option<String>,
    size: Option<u64>,
}

/// `<dest>.partial`
pub fn partial_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    dest.with_file_name(name)
}

fn record_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".partial.json");
    dest.with_file_name(name)
}

/// Removes a partial download of `dest` and its side file.
pub fn remove_partial(dest: &Path) {
    for path in [partial_path(dest), record_path(dest)] {
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!("cannot remove {}: {e}", path.display()),
        }
    }
}

/// Downloads `url` to `dest` (see the module documentation). An existing `dest` is replaced
/// only once the new file is complete and checked.
pub fn download(
    client: &Client,
    url: &str,
    dest: &Path,
    options: &DownloadOptions,
    progress: &dyn Progress,
) -> Result<Downloaded, FetchError> {
    let partial = partial_path(dest);
    let record = record_path(dest);
    let held = resumable_bytes(url, &partial, &record, options);
    let (mut sink, validator) = match &held {
        Some((bytes, etag)) => (
            FileSink::resume(&partial, *bytes, options.write_limit)?,
            etag.clone(),
        ),
        None => {
            remove_partial(dest);
            (FileSink::create(&partial, options.write_limit)?, None)
        }
    };
    let resumed_from = sink.written;
    if resumed_from > 0 {
        tracing::info!(
            "{url}: resuming a partial download at byte {resumed_from} ({})",
            partial.display()
        );
    }
    write_record(
        &record,
        &PartialRecord {
            url: url.to_string(),
            etag: validator.clone(),
            size: options.size.map(|s| s.bytes),
        },
    )?;
    progress.start(options.size.map_or(0, |s| s.bytes), resumed_from);
    sink.progress = Some(progress);
    sink.record = Some((record.clone(), url.to_string()));
    let result = client.transfer(
        url,
        resumed_from,
        validator.as_deref(),
        options.size,
        &mut sink,
    );
    let transfer = match result {
        Ok(t) => t,
        Err(err) => {
            let err = sink.own_error(err);
            if matches!(err, FetchError::DiskFull { .. }) || !err.is_resumable() {
                drop(sink);
                remove_partial(dest);
            }
            progress.finish();
            return Err(err);
        }
    };
    progress.finish();
    let sha256 = sink.finish();
    let checked_against = match (&options.sha256, &transfer.remote.sha256) {
        (Some((hex, who)), _) => Some((hex.clone(), who.clone())),
        (None, Some((hex, who))) => Some((hex.clone(), who.to_string())),
        (None, None) => None,
    };
    if let Some((expected, who)) = &checked_against
        && *expected != sha256
    {
        remove_partial(dest);
        return Err(FetchError::Checksum {
            url: url.to_string(),
            algorithm: "sha256",
            expected: expected.clone(),
            actual: sha256,
            source_of_checksum: who.clone(),
        });
    }
    std::fs::rename(&partial, dest).map_err(|e| FetchError::io(dest, e))?;
    remove_partial(dest);
    Ok(Downloaded {
        path: dest.to_path_buf(),
        size: transfer.size,
        fetched: transfer.fetched,
        resumed_from,
        sha256,
        sha256_checked_against: checked_against.map(|(_, who)| who),
        etag: transfer.remote.etag,
    })
}

impl FetchError {
    /// Whether the partial file is worth keeping for the next run.
    fn is_resumable(&self) -> bool {
        matches!(
            self,
            FetchError::Truncated { .. }
                | FetchError::Disconnected { .. }
                | FetchError::Unreachable { .. }
                | FetchError::Status { .. }
                | FetchError::RangeIgnored { .. }
        )
    }
}

/// The bytes of an earlier partial download of the same URL (and their ETag), when they can be
/// resumed.
fn resumable_bytes(
    url: &str,
    partial: &Path,
    record: &Path,
    options: &DownloadOptions,
) -> Option<(u64, Option<String>)> {
    let held = std::fs::metadata(partial).ok()?.len();
    let text = std::fs::read(record).ok()?;
    let saved: PartialRecord = serde_json::from_slice(&text).ok()?;
    let expected = options.size.map(|s| s.bytes);
    if saved.url != url
        || held == 0
        || (expected.is_some() && saved.size.is_some() && saved.size != expected)
    {
        return None;
    }
    if expected.is_some_and(|size| held > size) {
        return None;
    }
    Some((held, saved.etag))
}

fn write_record(path: &Path, record: &PartialRecord) -> Result<(), FetchError> {
    let bytes = serde_json::to_vec(record).expect("a record serializes");
    std::fs::write(path, bytes).map_err(|e| FetchError::io(path, e))
}

/// The partial file: appended to, hashed on the way.
struct FileSink<'a> {
    path: PathBuf,
    file: File,
    hasher: BackgroundHasher,
    written: u64,
    limit: Option<u64>,
    progress: Option<&'a dyn Progress>,
    /// (record path, url): rewritten with the ETag and size the server names, so that an
    /// interrupted transfer resumes with If-Range.
    record: Option<(PathBuf, String)>,
}

impl<'a> FileSink<'a> {
    fn create(path: &Path, limit: Option<u64>) -> Result<FileSink<'a>, FetchError> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| FetchError::io(parent, e))?;
        }
        let file = File::create(path).map_err(|e| FetchError::io(path, e))?;
        Ok(FileSink {
            path: path.to_path_buf(),
            file,
            hasher: BackgroundHasher::start(Sha256::new()),
            written: 0,
            limit,
            progress: None,
            record: None,
        })
    }

    /// Opens the first `held` bytes of `path` for appending, hashing them first.
    fn resume(path: &Path, held: u64, limit: Option<u64>) -> Result<FileSink<'a>, FetchError> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .open(path)
            .map_err(|e| FetchError::io(path, e))?;
        file.set_len(held).map_err(|e| FetchError::io(path, e))?;
        let hasher = hash_all(&mut file, path)?;
        Ok(FileSink {
            path: path.to_path_buf(),
            file,
            hasher: BackgroundHasher::start(hasher),
            written: held,
            limit,
            progress: None,
            record: None,
        })
    }

    /// The sink's own write errors come back from the transfer as `Io` with the URL as path;
    /// give them this file's path, and a full disk its own error.
    fn own_error(&self, err: FetchError) -> FetchError {
        match err {
            FetchError::Io { error, .. } if is_disk_full(&error) => FetchError::DiskFull {
                path: self.path.clone(),
                written: self.written,
            },
            FetchError::Io { error, .. } => FetchError::Io {
                path: self.path.clone(),
                error,
            },
            err => err,
        }
    }

    /// The sha256 of everything written. The file is not fsynced: a download is an
    /// intermediate (what the store keeps is converted from it by a writer that syncs), and a
    /// kept download is checked against its sha256 again before it is used.
    fn finish(self) -> String {
        self.hasher.finish()
    }
}

impl Sink for FileSink<'_> {
    fn begin(&mut self, remote: &RemoteFile) -> std::io::Result<()> {
        if let Some((path, url)) = &self.record {
            let record = PartialRecord {
                url: url.clone(),
                etag: remote.etag.clone(),
                size: remote.size,
            };
            std::fs::write(path, serde_json::to_vec(&record)?)?;
        }
        Ok(())
    }

    fn restart(&mut self) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.hasher.reset();
        self.written = 0;
        if let Some(progress) = self.progress {
            progress.start(0, 0);
        }
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.write_piece(&Piece::new(bytes.to_vec()))
    }

    fn write_piece(&mut self, piece: &Piece) -> std::io::Result<()> {
        let n = piece.len() as u64;
        if self.limit.is_some_and(|limit| self.written + n > limit) {
            return Err(std::io::Error::from(std::io::ErrorKind::StorageFull));
        }
        // The hasher reads the piece while it is written, both from the buffer the socket
        // reader has just filled.
        self.hasher.update(piece.clone());
        self.file.write_all(piece)?;
        self.written += n;
        if let Some(progress) = self.progress {
            progress.advance(n);
        }
        Ok(())
    }
}

/// sha256 on a thread of its own, fed with the pieces as they are written: hashing costs
/// about as much as the write, and the download runs at the slower of the two instead of their
/// sum.
struct BackgroundHasher {
    send: Option<std::sync::mpsc::SyncSender<HashInput>>,
    thread: Option<std::thread::JoinHandle<Sha256>>,
}

enum HashInput {
    Bytes(Piece),
    Reset,
}

/// Pieces queued for the hasher before the writer waits for it.
const HASH_QUEUE: usize = 8;

impl BackgroundHasher {
    fn start(mut hasher: Sha256) -> BackgroundHasher {
        let (send, receive) = std::sync::mpsc::sync_channel::<HashInput>(HASH_QUEUE);
        let thread = std::thread::spawn(move || {
            for input in receive {
                match input {
                    HashInput::Bytes(piece) => hasher.update(&piece[..]),
                    HashInput::Reset => hasher = Sha256::new(),
                }
            }
            hasher
        });
        BackgroundHasher {
            send: Some(send),
            thread: Some(thread),
        }
    }

    fn feed(&self, input: HashInput) {
        if let Some(send) = &self.send {
            // Only a panicked hasher thread hangs up; `finish` reports it.
            let _ = send.send(input);
        }
    }

    fn update(&self, piece: Piece) {
        self.feed(HashInput::Bytes(piece));
    }

    fn reset(&self) {
        self.feed(HashInput::Reset);
    }

    fn finish(mut self) -> String {
        self.send.take();
        let hasher = self
            .thread
            .take()
            .expect("joined once")
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        hex(&hasher.finalize())
    }
}

fn is_disk_full(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A sha256 hasher fed with everything `reader` (the file at `path`) has left.
fn hash_all(reader: &mut impl Read, path: &Path) -> Result<Sha256, FetchError> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf).map_err(|e| FetchError::io(path, e))?;
        if n == 0 {
            return Ok(hasher);
        }
        hasher.update(&buf[..n]);
    }
}

/// sha256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut file = File::open(path).map_err(|e| FetchError::io(path, e))?;
    Ok(hex(&hash_all(&mut file, path)?.finalize()))
}

/// Fetches `url` whole into the existing file `file` (at `path`, for messages), writing each
/// byte at its own offset, so that the file keeps its inode (readers that opened it before, a
/// registered cuFile handle among them, see the bytes). Nothing is verified but the length:
/// the caller knows what the bytes must hash to.
pub fn fetch_into_file(
    client: &Client,
    url: &str,
    file: &File,
    path: &Path,
    expected: ExpectedSize,
) -> Result<crate::client::Transfer, FetchError> {
    struct AtOffset<'a> {
        file: &'a File,
        offset: u64,
    }
    impl Sink for AtOffset<'_> {
        fn restart(&mut self) -> std::io::Result<()> {
            self.offset = 0;
            Ok(())
        }
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            std::os::unix::fs::FileExt::write_all_at(self.file, bytes, self.offset)?;
            self.offset += bytes.len() as u64;
            Ok(())
        }
    }
    let mut sink = AtOffset { file, offset: 0 };
    client
        .transfer(url, 0, None, Some(expected), &mut sink)
        .map_err(|err| match err {
            FetchError::Io { error, .. } if is_disk_full(&error) => FetchError::DiskFull {
                path: path.to_path_buf(),
                written: sink.offset,
            },
            FetchError::Io { error, .. } => FetchError::io(path, error),
            err => err,
        })
}
