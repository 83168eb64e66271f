//! Where the store keeps things. `$GDSLLM_HOME` (default `~/.cache/gdsllm`) holds
//! `models/<dir>/` (converted models), `remote/<dir>/` (local caches of models served over
//! HTTP), `downloads/` (source files while they download and convert; a known model's GGUF
//! stays there) and `index.json` (the names, see [`crate::index`]).

use std::path::{Path, PathBuf};

use crate::error::StoreError;

/// A model store rooted at a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Store {
    home: PathBuf,
}

impl Store {
    /// The store at `$GDSLLM_HOME`, else `$HOME/.cache/gdsllm`.
    pub fn from_env() -> Result<Store, StoreError> {
        Ok(Store::at(gdsllm_home()?))
    }

    pub fn at(home: impl Into<PathBuf>) -> Store {
        Store { home: home.into() }
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    /// Converted models: `<home>/models`.
    pub fn models_dir(&self) -> PathBuf {
        self.home.join("models")
    }

    /// Downloads and extracted source files: `<home>/downloads`.
    pub fn downloads_dir(&self) -> PathBuf {
        self.home.join("downloads")
    }

    /// Local caches of models served over HTTP: `<home>/remote`.
    pub fn remote_dir(&self) -> PathBuf {
        self.home.join("remote")
    }

    /// The names of the models: `<home>/index.json`.
    pub fn index_path(&self) -> PathBuf {
        self.home.join("index.json")
    }
}

/// The store's root: `$GDSLLM_HOME`, else `$HOME/.cache/gdsllm`.
pub fn gdsllm_home() -> Result<PathBuf, StoreError> {
    if let Some(home) = std::env::var_os("GDSLLM_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(home));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("gdsllm"))
        .ok_or(StoreError::NoHome)
}

/// The model directories directly under `dir` (those with a metadata.json; hidden work
/// directories excluded), by name, sorted.
pub(crate) fn model_dirs(dir: &Path) -> Result<Vec<String>, StoreError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StoreError::io(dir, e)),
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().join(weights_format::METADATA_FILE).is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    Ok(names)
}

/// Bytes the files directly in `dir` take on disk (blocks allocated, so that the placeholders
/// of a remote cache count as what they take, nothing).
pub fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.blocks() * 512)
        .sum()
}
