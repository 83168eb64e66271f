//! `-m SPEC` of `run`, `bench` and `serve` (and `plan`, `verify`, `show`): whatever SPEC names,
//! a local model directory to open. A GGUF file or a Hugging Face source is converted (or
//! pulled) into the store the first time and found there after; a model served over HTTP gets
//! a local cache whose blobs residency fetches on first use.

use std::path::PathBuf;

use serde::Serialize;

use crate::catalog::{DEFAULT_MODEL, known_model};
use crate::error::StoreError;
use crate::layout::{Store, model_dirs};
use crate::pull::{PullOptions, PullProgress, import_local, pull, stored_from};
use crate::spec::ModelSpec;

/// How a spec became a directory, for the line `-m` prints on stderr.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Resolution {
    /// A model directory given as a path.
    Directory,
    /// A model in the store, by name.
    Stored { name: String },
    /// A source converted or pulled earlier, found in the store.
    Reused { name: String, source: String },
    /// A source converted or pulled into the store just now.
    Added {
        name: String,
        source: String,
        fetched_bytes: u64,
    },
    /// A model served over HTTP, through its local cache.
    Remote {
        url: String,
        local_bytes: u64,
        total_bytes: u64,
    },
}

impl std::fmt::Display for Resolution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Resolution::Directory => write!(f, "a model directory"),
            Resolution::Stored { name } => write!(f, "{name} from the store"),
            Resolution::Reused { name, source } => write!(
                f,
                "{name} from the store (converted from {source} on an earlier run)"
            ),
            Resolution::Added {
                name,
                source,
                fetched_bytes,
            } => {
                write!(f, "{source} converted into the store as {name}")?;
                if *fetched_bytes > 0 {
                    write!(f, " ({fetched_bytes} bytes downloaded)")?;
                }
                write!(f, "; later runs reuse it (`-m {name}`)")
            }
            Resolution::Remote {
                url,
                local_bytes,
                total_bytes,
            } => write!(
                f,
                "{url} served over HTTP: {local_bytes} of {total_bytes} blob bytes on local disk \
                 already; the rest are fetched as they are first needed"
            ),
        }
    }
}

/// What `-m` resolved to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Resolved {
    pub dir: PathBuf,
    pub how: Resolution,
}

/// Resolves `spec` (see [`crate::error::ACCEPTED_FORMS`]) to a model directory, converting or
/// pulling it into `store` when it is not there yet. `None` is the default model, pulled on
/// first use.
pub fn resolve(
    store: &Store,
    spec: Option<&str>,
    options: &PullOptions,
    progress: &dyn PullProgress,
) -> Result<Resolved, StoreError> {
    let spec = spec.unwrap_or(DEFAULT_MODEL);
    let parsed = ModelSpec::parse(spec)?;
    match &parsed {
        ModelSpec::Dir(dir) => Ok(Resolved {
            dir: dir.clone(),
            how: Resolution::Directory,
        }),
        ModelSpec::Name(name) => {
            if let Some(dir) = store.find(name)? {
                return Ok(Resolved {
                    dir,
                    how: Resolution::Stored { name: name.clone() },
                });
            }
            if known_model(name).is_some() {
                tracing::info!("{name} is not in {}; pulling it", store.home().display());
                let pulled = pull(store, name, options, progress)?;
                return Ok(Resolved {
                    dir: pulled.dir,
                    how: Resolution::Added {
                        name: pulled.name,
                        source: pulled.source,
                        fetched_bytes: pulled.fetched_bytes,
                    },
                });
            }
            Err(not_found(store, name)?)
        }
        ModelSpec::GgufFile(_) | ModelSpec::HfDir(_) => {
            let pulled = import_local(store, &parsed, options, progress)?;
            Ok(Resolved {
                dir: pulled.dir,
                how: if pulled.up_to_date {
                    Resolution::Reused {
                        name: pulled.name,
                        source: pulled.source,
                    }
                } else {
                    Resolution::Added {
                        name: pulled.name,
                        source: pulled.source,
                        fetched_bytes: 0,
                    }
                },
            })
        }
        ModelSpec::HuggingFace { .. } | ModelSpec::GgufUrl(_) => {
            let source = parsed.source_key().expect("a remote source has a key");
            // Found in the store: no network at all (it works offline).
            if let Some((name, dir, _)) = stored_from(store, &source)? {
                return Ok(Resolved {
                    dir,
                    how: Resolution::Reused { name, source },
                });
            }
            let pulled = pull(store, spec, options, progress)?;
            Ok(Resolved {
                dir: pulled.dir,
                how: Resolution::Added {
                    name: pulled.name,
                    source: pulled.source,
                    fetched_bytes: pulled.fetched_bytes,
                },
            })
        }
        ModelSpec::RemoteDir(url) => {
            let remote = crate::remote::open_remote(store, url, options.retries)?;
            Ok(Resolved {
                dir: remote.dir,
                how: Resolution::Remote {
                    url: remote.url,
                    local_bytes: remote.local_bytes,
                    total_bytes: remote.total_bytes,
                },
            })
        }
    }
}

/// The error for a name the store does not have, listing what it has.
fn not_found(store: &Store, name: &str) -> Result<StoreError, StoreError> {
    let mut names: Vec<String> = store.index()?.names.keys().cloned().collect();
    for dir in model_dirs(&store.models_dir())? {
        if !store.index()?.models.contains_key(&dir) && !names.contains(&dir) {
            names.push(dir);
        }
    }
    names.sort();
    Ok(StoreError::NotFound {
        spec: name.to_string(),
        models_dir: store.models_dir(),
        available: if names.is_empty() {
            "it is empty".into()
        } else {
            format!("models: {}", names.join(", "))
        },
    })
}
