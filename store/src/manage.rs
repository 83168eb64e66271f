//! `gdsllm list`, `rm NAME`, `tag NAME NEW`: what the store holds, under which names.
//!
//! The store holds the models named in the index, model directories from before the index
//! (answering to their directory name), and local caches of models served over HTTP
//! (answering to their URL).

use std::path::PathBuf;

use serde::Serialize;

use crate::error::{StoreError, io};
use crate::index::Index;
use crate::layout::{Store, disk_usage, model_dirs};
use crate::names::check_name;

/// One row of `gdsllm list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Listed {
    /// The name (or, for a cache of a served model, its URL).
    pub name: String,
    pub dir: PathBuf,
    /// The other names of the same model.
    pub aliases: Vec<String>,
    /// Where it came from, when the index knows.
    pub source: Option<String>,
    /// Bytes its files take on disk.
    pub disk_bytes: u64,
    /// Bytes of its blobs (all of them, fetched or not).
    pub model_bytes: u64,
    /// A cache of a model served over HTTP.
    pub remote: bool,
    /// When it was added (seconds since the Unix epoch), when the index knows.
    pub added_unix: Option<u64>,
}

impl Listed {
    /// A model directory the index has no record of (one from before the index, or a cache of
    /// a served model): no other names, source or date; its sizes measured on disk.
    fn unrecorded(name: String, dir: PathBuf, remote: bool) -> Listed {
        Listed {
            name,
            aliases: Vec::new(),
            source: None,
            disk_bytes: disk_usage(&dir),
            model_bytes: model_bytes(&dir),
            remote,
            added_unix: None,
            dir,
        }
    }
}

/// What `rm` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Removed {
    pub name: String,
    /// The directory deleted (None when other names still point at it).
    pub deleted: Option<PathBuf>,
    /// Names that still point at the model.
    pub remaining_names: Vec<String>,
    pub freed_bytes: u64,
}

fn model_bytes(dir: &std::path::Path) -> u64 {
    weights_format::Model::open(dir)
        .map(|m| m.metadata().blobs.iter().map(|b| b.length).sum())
        .unwrap_or(0)
}

impl Store {
    /// Every model, one row per name, sorted by name; remote caches last.
    pub fn list(&self) -> Result<Vec<Listed>, StoreError> {
        let index = self.index()?;
        let mut rows = Vec::new();
        for (name, dir_name) in &index.names {
            let dir = self.models_dir().join(dir_name);
            if !dir.join(weights_format::METADATA_FILE).is_file() {
                continue;
            }
            let record = index.models.get(dir_name);
            rows.push(Listed {
                name: name.clone(),
                aliases: index
                    .names_of(dir_name)
                    .into_iter()
                    .filter(|n| n != name)
                    .collect(),
                source: record.map(|r| r.source.clone()),
                disk_bytes: disk_usage(&dir),
                model_bytes: model_bytes(&dir),
                remote: false,
                added_unix: record.map(|r| r.added_unix),
                dir,
            });
        }
        for dir_name in model_dirs(&self.models_dir())? {
            let named = index.names.values().any(|d| *d == dir_name);
            if named || index.names.contains_key(&dir_name) {
                continue;
            }
            let dir = self.models_dir().join(&dir_name);
            rows.push(Listed::unrecorded(dir_name, dir, false));
        }
        rows.sort_by(|a, b| a.name.cmp(&b.name));
        for dir_name in model_dirs(&self.remote_dir())? {
            let dir = self.remote_dir().join(&dir_name);
            let Ok(Some(origin)) = residency::Origin::read(&dir) else {
                continue;
            };
            rows.push(Listed::unrecorded(origin.url, dir, true));
        }
        Ok(rows)
    }

    /// The directory of the model named `name` (an index name, a directory from before the
    /// index, or the URL of a cached served model), if the store has it.
    pub fn find(&self, name: &str) -> Result<Option<PathBuf>, StoreError> {
        let index = self.index()?;
        let candidates = [
            index.dir_of(name).map(|d| self.models_dir().join(d)),
            (!name.is_empty() && !name.contains(['/', '\\']) && !name.starts_with('.'))
                .then(|| self.models_dir().join(name)),
            (name.starts_with("http://") || name.starts_with("https://"))
                .then(|| crate::remote::cache_dir(self, &residency::Origin::new(name).url)),
        ];
        Ok(candidates
            .into_iter()
            .flatten()
            .find(|d| d.join(weights_format::METADATA_FILE).is_file()))
    }

    /// [`Store::find`], failing when the store does not have `name`; with the directory's own
    /// name.
    fn find_existing(&self, name: &str) -> Result<(PathBuf, String), StoreError> {
        let dir = self.find(name)?.ok_or_else(|| StoreError::NotFound {
            spec: name.to_string(),
            models_dir: self.models_dir(),
            available: "see `gdsllm list`".into(),
        })?;
        let dir_name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok((dir, dir_name))
    }

    /// Removes `name`; the model's directory goes with its last name.
    pub fn remove(&self, name: &str) -> Result<Removed, StoreError> {
        let (dir, dir_name) = self.find_existing(name)?;
        let in_models = dir.parent() == Some(self.models_dir().as_path());
        let remaining = self.update_index(|index: &mut Index| {
            if in_models {
                index.names.remove(name);
                let remaining = index.names_of(&dir_name);
                if remaining.is_empty() {
                    index.models.remove(&dir_name);
                }
                Ok(remaining)
            } else {
                Ok(Vec::new())
            }
        })?;
        if !remaining.is_empty() {
            return Ok(Removed {
                name: name.to_string(),
                deleted: None,
                remaining_names: remaining,
                freed_bytes: 0,
            });
        }
        let freed = disk_usage(&dir);
        // Renamed away first, so that a half-deleted model is never found under its name.
        let doomed = dir.with_file_name(format!(".{dir_name}.removing-{}", std::process::id()));
        std::fs::rename(&dir, &doomed).map_err(io(&dir))?;
        std::fs::remove_dir_all(&doomed).map_err(io(&doomed))?;
        Ok(Removed {
            name: name.to_string(),
            deleted: Some(dir),
            remaining_names: Vec::new(),
            freed_bytes: freed,
        })
    }

    /// Gives the model named `name` the further name `new`.
    pub fn tag(&self, name: &str, new: &str) -> Result<PathBuf, StoreError> {
        check_name(new)?;
        let (dir, dir_name) = self.find_existing(name)?;
        if dir.parent() != Some(self.models_dir().as_path()) {
            return Err(StoreError::NotAModel {
                path: dir,
                reason: format!(
                    "{name} is a cache of a model served over HTTP; only models in the store's \
                     models/ take names"
                ),
            });
        }
        let unnamed = model_dirs(&self.models_dir())?;
        self.update_index(|index| {
            let taken = index
                .dir_of(new)
                .map(str::to_string)
                .or_else(|| unnamed.iter().find(|d| d.as_str() == new).cloned());
            if let Some(other) = taken
                && other != dir_name
            {
                return Err(StoreError::NameTaken {
                    name: new.to_string(),
                    dir: other,
                });
            }
            // A directory from before the index gets its own name recorded too, so that it
            // keeps answering to it.
            if index.names_of(&dir_name).is_empty() {
                index.names.insert(dir_name.clone(), dir_name.clone());
            }
            index.names.insert(new.to_string(), dir_name.clone());
            Ok(())
        })?;
        Ok(dir)
    }
}
