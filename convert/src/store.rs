//! The local model store: `$GDSLLM_HOME` (default `~/.cache/gdsllm`) with converted models in
//! `models/<name>/` and downloaded source files in `downloads/`.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot locate the model store: neither GDSLLM_HOME nor HOME is set")]
    NoHome,
    #[error(
        "model {spec:?} is neither a directory nor a model in {models_dir} ({available}); get one with `gdsllm pull NAME` (known: {known})"
    )]
    NotFound {
        spec: String,
        models_dir: PathBuf,
        /// "available: a, b" or "it is empty"
        available: String,
        known: String,
    },
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
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

/// Where converted models live: `<home>/models`.
pub fn models_dir(home: &Path) -> PathBuf {
    home.join("models")
}

/// Where downloads and extracted source files live: `<home>/downloads`.
pub fn downloads_dir(home: &Path) -> PathBuf {
    home.join("downloads")
}

/// Names of the models in the store (sorted; hidden work directories excluded).
pub fn list_models(home: &Path) -> Result<Vec<String>, StoreError> {
    let dir = models_dir(home);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(StoreError::Io {
                path: dir,
                error: source,
            });
        }
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().join("metadata.json").is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    Ok(names)
}

/// Resolves `-m SPEC`: an existing directory, or the name of a model in the store.
pub fn resolve_model(spec: &str) -> Result<PathBuf, StoreError> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let home = gdsllm_home()?;
    resolve_in(&home, spec)
}

/// [`resolve_model`] against an explicit store root.
pub fn resolve_in(home: &Path, spec: &str) -> Result<PathBuf, StoreError> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let is_name = !spec.is_empty() && !spec.contains('/') && !spec.starts_with('.');
    if is_name {
        let dir = models_dir(home).join(spec);
        if dir.join("metadata.json").is_file() {
            return Ok(dir);
        }
    }
    let available = list_models(home)?;
    Err(StoreError::NotFound {
        spec: spec.to_string(),
        models_dir: models_dir(home),
        available: if available.is_empty() {
            "it is empty".into()
        } else {
            format!("available: {}", available.join(", "))
        },
        known: crate::catalog::KNOWN_MODELS
            .iter()
            .map(|m| m.name)
            .collect::<Vec<_>>()
            .join(", "),
    })
}
