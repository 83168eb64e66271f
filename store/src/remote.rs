//! `-m https://HOST/models/NAME/`: a GdsLLM model directory served over HTTP, used without
//! downloading it first. Its metadata.json and side files (checksum, tokenizer, chat template)
//! are fetched into `remote/<dir>/` on every open (so a changed model is noticed); its blobs
//! are left to residency's network tier, which fetches each the first time it is needed and
//! keeps it there. Blobs already fetched whose entry in metadata.json has not changed are kept.

use std::path::{Path, PathBuf};

use gdsllm_fetch::{Client, ClientOptions};
use residency::network::{FETCHED_DIR, Origin, forget_fetched, is_fetched};
use weights_format::{METADATA_CHECKSUM_FILE, METADATA_FILE, Metadata, Model};

use crate::error::{StoreError, io};
use crate::layout::Store;

/// metadata.json of an 80-layer model is ~100 KB; a tokenizer.json a few MB.
const MAX_SIDE_FILE_BYTES: u64 = 64 << 20;

/// A local cache of a model served over HTTP, ready to open.
#[derive(Debug, Clone)]
pub struct RemoteModel {
    pub url: String,
    pub dir: PathBuf,
    /// Blob bytes on local disk already, and in all.
    pub local_bytes: u64,
    pub total_bytes: u64,
}

/// The cache directory of `url`: `remote/HOST_PORT_PATH` with every other character `_`.
pub fn cache_dir(store: &Store, url: &str) -> PathBuf {
    let rest = url
        .split_once("://")
        .map_or(url, |(_, rest)| rest)
        .trim_end_matches('/');
    let key: String = rest
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    store.remote_dir().join(key)
}

/// Fetches the served model's metadata and side files into its cache directory and makes the
/// directory a cache of it; when the server cannot be reached, a cache that holds every blob
/// already is used as it is.
pub fn open_remote(store: &Store, url: &str, retries: u32) -> Result<RemoteModel, StoreError> {
    let origin = Origin::new(url);
    let dir = cache_dir(store, &origin.url);
    let client = Client::new(ClientOptions {
        retries,
        ..ClientOptions::default()
    });
    match client.get_bytes(&origin.file_url(METADATA_FILE), MAX_SIDE_FILE_BYTES) {
        Ok(bytes) => refresh(&client, &origin, &dir, &bytes)?,
        Err(err) => {
            let complete = Model::open(&dir)
                .is_ok_and(|m| m.metadata().blobs.iter().all(|b| is_fetched(&dir, &b.file)));
            if !complete {
                return Err(err.into());
            }
            tracing::warn!(
                "{err}; every blob of {} is on local disk already, so it is used as it is",
                origin.url
            );
        }
    }
    let model = Model::open(&dir)?;
    let meta = model.metadata();
    Ok(RemoteModel {
        url: origin.url.clone(),
        local_bytes: residency::network::local_blob_bytes(&dir, meta)?,
        total_bytes: meta.blobs.iter().map(|b| b.length).sum(),
        dir,
    })
}

/// A name that may be written into the cache directory: one plain component that is not one
/// of the cache's own files.
fn check_file_name(url: &str, field: &str, name: &str) -> Result<(), StoreError> {
    let ours = [
        METADATA_FILE,
        METADATA_CHECKSUM_FILE,
        residency::network::ORIGIN_FILE,
        FETCHED_DIR,
    ];
    if !weights_format::is_plain_file_name(name) || name.starts_with('.') || ours.contains(&name) {
        return Err(StoreError::NotAModel {
            path: PathBuf::from(url),
            reason: format!("metadata.json names {field} {name:?}, which is not a plain file name"),
        });
    }
    Ok(())
}

fn refresh(
    client: &Client,
    origin: &Origin,
    dir: &Path,
    meta_bytes: &[u8],
) -> Result<(), StoreError> {
    let meta_url = origin.file_url(METADATA_FILE);
    let meta: Metadata = serde_json::from_slice(meta_bytes).map_err(|e| StoreError::NotAModel {
        path: PathBuf::from(&meta_url),
        reason: format!("not a GdsLLM metadata.json: {e}"),
    })?;
    let mut side_files = vec![meta.tokenizer.clone()];
    side_files.extend(meta.chat_template.iter().map(|t| t.file.clone()));
    for (i, name) in side_files.iter().enumerate() {
        check_file_name(
            &meta_url,
            if i == 0 {
                "tokenizer"
            } else {
                "chat_template.file"
            },
            name,
        )?;
    }
    for blob in &meta.blobs {
        check_file_name(&meta_url, "blob file", &blob.file)?;
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // Blobs fetched under an older metadata.json stay only if their entry is unchanged.
    if let Ok(old) = std::fs::read(dir.join(METADATA_FILE))
        && old != meta_bytes
    {
        let old: Option<Metadata> = serde_json::from_slice(&old).ok();
        for blob in &meta.blobs {
            let same = old
                .as_ref()
                .and_then(|o| o.blob(&blob.file))
                .is_some_and(|b| b.length == blob.length && b.checksum == blob.checksum);
            if !same {
                forget_fetched(dir, &blob.file).map_err(io(dir))?;
            }
        }
        tracing::info!(
            "{}: the served model changed since it was cached",
            origin.url
        );
    }
    let mut files = Vec::new();
    for name in side_files
        .iter()
        .map(String::as_str)
        .chain([METADATA_CHECKSUM_FILE])
    {
        files.push((
            name,
            client.get_bytes(&origin.file_url(name), MAX_SIDE_FILE_BYTES)?,
        ));
    }
    // metadata.json last: what is there is always consistent with what came before it.
    files.push((METADATA_FILE, meta_bytes.to_vec()));
    for (name, bytes) in files {
        let temp = dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&temp, &bytes).map_err(io(&temp))?;
        std::fs::rename(&temp, dir.join(name)).map_err(io(dir))?;
    }
    residency::init_cache(dir, &meta, origin)?;
    Ok(())
}

impl RemoteModel {
    /// Fetches every blob not on local disk yet (`gdsllm pull URL/`); returns the bytes that
    /// crossed the network.
    pub fn fetch_all(&self) -> Result<u64, StoreError> {
        use residency::BlobSource;
        let model = Model::open(&self.dir)?;
        let source = residency::NetworkSource::open(
            &self.dir,
            model.metadata(),
            Origin::new(&self.url),
            Default::default(),
        )?;
        let mut fetched = 0;
        for blob in 0..source.blob_count() {
            fetched += source.ensure_local(blob)?;
        }
        Ok(fetched)
    }
}
