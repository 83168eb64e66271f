//! The network tier: a model directory whose blobs are fetched from the HTTP(S) server the
//! model is served from, each the first time it is needed, checked against its XXH3 and kept
//! on local disk for every later read. The first pass runs at network speed, later ones at
//! disk (or host-tier) speed.
//!
//! Such a directory is an ordinary model directory (metadata.json, tokenizer, template) whose
//! blob files are placeholders of the right length until fetched, plus `origin.json` (where
//! the model is served from) and `.fetched/<blob file>` for each blob whose bytes are here
//! and checked. `gdsllm-store` creates it; [`crate::Residency`] opens it like any other.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gds_io::ParallelRead;
use gdsllm_fetch::{Client, ClientOptions, ExpectedSize};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use weights_format::Metadata;

use crate::error::ResidencyError;
use crate::source::{BlobSource, HostFileSource};

/// The file that makes a model directory a cache of a model served over HTTP.
pub const ORIGIN_FILE: &str = "origin.json";
/// The directory of markers, one per blob fetched and checked.
pub const FETCHED_DIR: &str = ".fetched";

/// Where a model directory's blobs come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// The URL of the served model directory, ending in `/`.
    pub url: String,
}

impl Origin {
    pub fn new(url: &str) -> Origin {
        let mut url = url.trim().to_string();
        if !url.ends_with('/') {
            url.push('/');
        }
        Origin { url }
    }

    /// The origin of the model in `dir`, if it is a cache of a served model.
    pub fn read(dir: &Path) -> Result<Option<Origin>, ResidencyError> {
        let path = dir.join(ORIGIN_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(ResidencyError::Origin {
                    path,
                    reason: e.to_string(),
                });
            }
        };
        let origin: Origin =
            serde_json::from_slice(&bytes).map_err(|e| ResidencyError::Origin {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        if !(origin.url.starts_with("http://") || origin.url.starts_with("https://")) {
            return Err(ResidencyError::Origin {
                path,
                reason: format!("{:?} is not an http(s) URL", origin.url),
            });
        }
        Ok(Some(Origin::new(&origin.url)))
    }

    /// Writes `dir/origin.json` (through a temporary file and a rename).
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let temp = dir.join(format!(".{ORIGIN_FILE}.{}", std::process::id()));
        std::fs::write(&temp, serde_json::to_vec_pretty(self)?)?;
        std::fs::rename(&temp, dir.join(ORIGIN_FILE))
    }

    /// The URL of file `name` of the served directory.
    pub fn file_url(&self, name: &str) -> String {
        format!("{}{name}", self.url)
    }
}

fn marker(dir: &Path, file: &str) -> PathBuf {
    dir.join(FETCHED_DIR).join(file)
}

/// Whether blob file `file` of the cache in `dir` has been fetched and checked.
pub fn is_fetched(dir: &Path, file: &str) -> bool {
    marker(dir, file).is_file()
}

/// Forgets that `file` was fetched (its bytes will be fetched again).
pub fn forget_fetched(dir: &Path, file: &str) -> std::io::Result<()> {
    match std::fs::remove_file(marker(dir, file)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Makes `dir` (which holds metadata.json and its side files) a cache of the model served at
/// `origin`: writes origin.json, and for each blob not fetched yet a placeholder file of its
/// length (sparse: it takes no disk space until fetched), so that the directory opens like
/// any model.
pub fn init_cache(dir: &Path, meta: &Metadata, origin: &Origin) -> Result<(), ResidencyError> {
    let io_error = |path: &Path, e: std::io::Error| ResidencyError::Origin {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    for blob in &meta.blobs {
        let path = dir.join(&blob.file);
        let length = std::fs::metadata(&path).ok().map(|m| m.len());
        if is_fetched(dir, &blob.file) && length == Some(blob.length) {
            continue;
        }
        forget_fetched(dir, &blob.file).map_err(|e| io_error(&marker(dir, &blob.file), e))?;
        let file = File::create(&path).map_err(|e| io_error(&path, e))?;
        file.set_len(blob.length).map_err(|e| io_error(&path, e))?;
    }
    origin
        .write(dir)
        .map_err(|e| io_error(&dir.join(ORIGIN_FILE), e))
}

/// Bytes of the model's blobs in `dir` that are on local disk: all of them for an ordinary
/// model directory, the fetched ones for a cache of a served model.
pub fn local_blob_bytes(dir: &Path, meta: &Metadata) -> Result<u64, ResidencyError> {
    let remote = Origin::read(dir)?.is_some();
    Ok(meta
        .blobs
        .iter()
        .filter(|b| !remote || is_fetched(dir, &b.file))
        .map(|b| b.length)
        .sum())
}

/// Blobs read from local files, each fetched from the origin first if it is not there yet.
pub struct NetworkSource {
    local: HostFileSource,
    dir: PathBuf,
    origin: Origin,
    client: Client,
    files: Vec<String>,
    fetched: Vec<AtomicBool>,
    /// One fetch per blob at a time; the others wait for it.
    fetching: Vec<Mutex<()>>,
    network_bytes: AtomicU64,
}

impl std::fmt::Debug for NetworkSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetworkSource")
            .field("dir", &self.dir)
            .field("origin", &self.origin.url)
            .finish()
    }
}

impl NetworkSource {
    /// Opens the cache in `dir`: its blob files (placeholders until fetched) must exist with
    /// the lengths metadata.json gives.
    pub fn open(
        dir: &Path,
        meta: &Metadata,
        origin: Origin,
        how: ParallelRead,
    ) -> Result<NetworkSource, ResidencyError> {
        let local = HostFileSource::open(dir, meta, how)?;
        let files: Vec<String> = meta.blobs.iter().map(|b| b.file.clone()).collect();
        let fetched: Vec<AtomicBool> = files
            .iter()
            .map(|f| AtomicBool::new(is_fetched(dir, f)))
            .collect();
        let missing = fetched
            .iter()
            .filter(|f| !f.load(Ordering::Relaxed))
            .count();
        tracing::info!(
            dir = %dir.display(),
            origin = %origin.url,
            missing,
            "blobs not on local disk are fetched from the origin the first time they are needed"
        );
        Ok(NetworkSource {
            local,
            dir: dir.to_path_buf(),
            client: Client::new(ClientOptions::default()),
            fetching: files.iter().map(|_| Mutex::new(())).collect(),
            files,
            fetched,
            origin,
            network_bytes: AtomicU64::new(0),
        })
    }

    /// Bytes fetched from the origin since open.
    pub fn network_bytes(&self) -> u64 {
        self.network_bytes.load(Ordering::Relaxed)
    }

    fn fetch(&self, blob: usize) -> Result<u64, ResidencyError> {
        let name = &self.files[blob];
        let url = self.origin.file_url(name);
        let path = self.dir.join(name);
        let length = self.local.blob_len(blob);
        let fetch_error = |message: String| ResidencyError::Fetch {
            file: name.clone(),
            url: url.clone(),
            message,
        };
        let file = File::options()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| fetch_error(format!("{}: {e}", path.display())))?;
        let started = std::time::Instant::now();
        let expected = ExpectedSize {
            bytes: length,
            according_to: "metadata.json",
        };
        let transfer = gdsllm_fetch::fetch_into_file(&self.client, &url, &file, &path, expected)
            .map_err(|e| fetch_error(e.to_string()))?;
        if let Some(expected) = self.local.checksum(blob) {
            let actual = self.local.hash_blob(blob)?;
            if actual != expected {
                return Err(ResidencyError::FetchedChecksum {
                    file: name.clone(),
                    url,
                    expected,
                    actual,
                });
            }
        }
        // The marker promises bytes that survive a crash.
        file.sync_all()
            .map_err(|e| fetch_error(format!("{}: {e}", path.display())))?;
        let marker = marker(&self.dir, name);
        std::fs::create_dir_all(self.dir.join(FETCHED_DIR))
            .and_then(|()| File::create(&marker))
            .map_err(|e| fetch_error(format!("{}: {e}", marker.display())))?;
        let seconds = started.elapsed().as_secs_f64();
        tracing::info!(
            file = %name,
            bytes = transfer.fetched,
            gbps = transfer.fetched as f64 / seconds.max(1e-9) / 1e9,
            "fetched from {}",
            self.origin.url
        );
        self.network_bytes
            .fetch_add(transfer.fetched, Ordering::Relaxed);
        Ok(transfer.fetched)
    }
}

impl BlobSource for NetworkSource {
    fn blob_count(&self) -> usize {
        self.local.blob_count()
    }

    fn blob_name(&self, blob: usize) -> String {
        self.local.blob_name(blob)
    }

    fn ensure_local(&self, blob: usize) -> Result<u64, ResidencyError> {
        if self.fetched[blob].load(Ordering::Acquire) {
            return Ok(0);
        }
        let _only_one = self.fetching[blob].lock();
        if self.fetched[blob].load(Ordering::Acquire) {
            return Ok(0);
        }
        let bytes = self.fetch(blob)?;
        self.fetched[blob].store(true, Ordering::Release);
        Ok(bytes)
    }

    fn read_blob(&self, blob: usize, dst: &mut [u8]) -> Result<(), ResidencyError> {
        self.ensure_local(blob)?;
        self.local.read_blob(blob, dst)
    }

    fn read_range(&self, blob: usize, offset: u64, dst: &mut [u8]) -> Result<(), ResidencyError> {
        self.ensure_local(blob)?;
        self.local.read_range(blob, offset, dst)
    }

    fn checksum(&self, blob: usize) -> Option<u64> {
        self.local.checksum(blob)
    }

    fn blob_len(&self, blob: usize) -> u64 {
        self.local.blob_len(blob)
    }
}
