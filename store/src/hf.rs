//! Hugging Face repositories through the `hf-hub` crate: its endpoint (`HF_ENDPOINT`), token
//! (`HF_TOKEN`, else the token file under `HF_HOME`) and cache layout (`HF_HOME/hub`, shared
//! with every other tool that uses it), resuming a partial download where it stopped.
//!
//! A GGUF repository gives the file of the quant asked for (`OWNER/REPO:Q4_K_M`, the default);
//! a safetensors repository gives config.json, the weights and the tokenizer files, and its
//! tag, if any, is the storage type to convert to. A quant split into parts (llama.cpp's
//! gguf-split) gives every part, converted as one model. hf-hub resolves each file (its
//! commit, ETag and size) and names its place in the cache; the bytes come through
//! `gdsllm-fetch`, like those of a URL pull: resumed where an earlier run stopped, and a full
//! disk is an error that leaves no partial file. Every file is checked: its length against
//! the repository's file list, its bytes against the ETag (the sha256 of a Git LFS file, the
//! git object id of any other), and removed from the cache when they differ.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{Api, ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo};
use serde_json::Value;

use gdsllm_convert::TargetDType;
use gdsllm_fetch::{Client, ClientOptions, DownloadOptions, ExpectedSize};

use crate::error::{StoreError, io};
use crate::index::Record;
use crate::layout::Store;
use crate::names::{name_with_tag, quant_of_file_name, split_part};
use crate::pull::{
    PartsProgress, PullOptions, PullProgress, Pulled, convert_into_store, stored_from,
};

/// The quant pulled when the user names none (llama.cpp's `-hf` default too).
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// The files of a safetensors repository a conversion reads (weights aside).
const HF_SIDE_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
];

/// One file of the repository's listing.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RepoFile {
    name: String,
    size: Option<u64>,
    /// sha256 of a Git LFS file, from the listing.
    lfs_sha256: Option<String>,
}

/// The Hugging Face cache: the one the options name, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (computed here: hf-hub's own default panics without a home
/// directory).
fn hf_cache(options: &PullOptions) -> Result<Cache, StoreError> {
    if let Some(dir) = &options.hf_cache {
        return Ok(Cache::new(dir.clone()));
    }
    if let Some(home) = std::env::var_os("HF_HOME").filter(|h| !h.is_empty()) {
        return Ok(Cache::new(PathBuf::from(home).join("hub")));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or(StoreError::NoHome)?;
    Ok(Cache::new(
        PathBuf::from(home).join(".cache/huggingface/hub"),
    ))
}

fn api(cache: &Cache, options: &PullOptions) -> Result<Api, StoreError> {
    let mut builder = ApiBuilder::from_cache(cache.clone())
        .with_progress(false)
        .with_retries(options.retries as usize);
    let endpoint = options
        .hf_endpoint
        .clone()
        .or_else(|| std::env::var("HF_ENDPOINT").ok())
        .filter(|e| !e.is_empty());
    if let Some(endpoint) = endpoint {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    builder = builder.with_token(hf_token(cache));
    builder.build().map_err(|e| StoreError::HfRepo {
        repo: "(client)".into(),
        reason: e.to_string(),
    })
}

/// The token sent to the hub: `HF_TOKEN`, else the one saved beside the cache (hf-hub's
/// rule).
fn hf_token(cache: &Cache) -> Option<String> {
    std::env::var("HF_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .or_else(|| cache.token())
}

/// The client that downloads the files' bytes (hf-hub finds where they are, and where they go
/// in its cache): resumable, retried, checked, and able to tell a full disk.
fn fetch_client(cache: &Cache, options: &PullOptions) -> Client {
    Client::new(ClientOptions {
        retries: options.retries,
        bearer_token: hf_token(cache),
        ..ClientOptions::default()
    })
}

/// hf-hub's error for `file` at `url`, said plainly.
fn download_error(url: &str, file: &str, error: ApiError) -> StoreError {
    let reason = match &error {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::StatusCode(404) => "not found (HTTP 404)".to_string(),
            ureq::Error::StatusCode(code @ (401 | 403)) => format!(
                "access refused (HTTP {code}); a private or gated repository needs a token in \
                 HF_TOKEN"
            ),
            ureq::Error::StatusCode(code) => format!("the server answered HTTP {code}"),
            e @ (ureq::Error::Io(_) | ureq::Error::Timeout(_) | ureq::Error::Protocol(_)) => {
                format!(
                    "the transfer stopped ({e}); run the same command again to resume (a \
                     partial download is kept in the Hugging Face cache)"
                )
            }
            other => other.to_string(),
        },
        ApiError::MissingHeader(header) => format!(
            "the server's answer has no {header} header (HF_ENDPOINT must be a Hugging Face \
             hub; a server that ignores Range requests gives no Content-Range)"
        ),
        ApiError::IoError(e) => format!(
            "the transfer stopped ({e}); run the same command again to resume (the partial \
             download is kept in the Hugging Face cache)"
        ),
        _ => error.to_string(),
    };
    StoreError::HfDownload {
        url: url.to_string(),
        file: file.to_string(),
        reason,
    }
}

/// The repository's files, with sizes and LFS sha256s (`?blobs=true`).
fn list_files(repo: &ApiRepo, repo_id: &str) -> Result<(Vec<RepoFile>, String), StoreError> {
    let repo_error = |reason: String| StoreError::HfRepo {
        repo: repo_id.to_string(),
        reason,
    };
    let mut response = repo
        .info_request()
        .query("blobs", "true")
        .call()
        .map_err(|e| {
            repo_error(match e {
                ureq::Error::StatusCode(404) => {
                    "no such repository (or it is private: set HF_TOKEN)".to_string()
                }
                ureq::Error::StatusCode(code @ (401 | 403)) => {
                    format!("access refused (HTTP {code}); set HF_TOKEN")
                }
                e => format!("listing its files failed: {e}"),
            })
        })?;
    let text = response
        .body_mut()
        .read_to_string()
        .map_err(|e| repo_error(format!("listing its files failed: {e}")))?;
    let info: Value = serde_json::from_str(&text)
        .map_err(|e| repo_error(format!("the file list is not JSON: {e}")))?;
    let revision = info["sha"].as_str().unwrap_or("").to_string();
    let siblings = info["siblings"]
        .as_array()
        .ok_or_else(|| repo_error("the file list has no `siblings`".into()))?;
    let files = siblings
        .iter()
        .filter_map(|s| {
            Some(RepoFile {
                name: s["rfilename"].as_str()?.to_string(),
                size: s["size"].as_u64(),
                lfs_sha256: s["lfs"]["sha256"].as_str().map(str::to_string),
            })
        })
        .collect();
    Ok((files, revision))
}

/// The GGUF files of `files` grouped by quant (a split file's parts together), sorted by
/// quant.
fn gguf_quants(files: &[RepoFile]) -> Vec<(String, Vec<RepoFile>)> {
    let mut groups: Vec<(String, Vec<RepoFile>)> = Vec::new();
    for file in files.iter().filter(|f| f.name.ends_with(".gguf")) {
        // Multimodal projectors ride along in many GGUF repositories; they are not a model.
        if file
            .name
            .rsplit('/')
            .next()
            .is_some_and(|n| n.starts_with("mmproj"))
        {
            continue;
        }
        let quant = quant_of_file_name(&file.name)
            .unwrap_or_else(|| split_part(file.name.rsplit('/').next().unwrap_or(&file.name)).0);
        match groups.iter_mut().find(|(q, _)| *q == quant) {
            Some((_, list)) => list.push(file.clone()),
            None => groups.push((quant, vec![file.clone()])),
        }
    }
    groups.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, list) in &mut groups {
        list.sort_by(|a, b| a.name.cmp(&b.name));
    }
    groups
}

/// Pulls `OWNER/REPO` (`tag`: the quant of a GGUF repository, or the storage type for a
/// safetensors one).
pub(crate) fn pull_repo(
    store: &Store,
    repo_id: &str,
    tag: Option<&str>,
    options: &PullOptions,
    progress: &dyn PullProgress,
) -> Result<Pulled, StoreError> {
    let cache = hf_cache(options)?;
    let api = api(&cache, options)?;
    let repo = api.model(repo_id.to_string());
    let (files, revision) = list_files(&repo, repo_id)?;
    let short = repo_id.rsplit('/').next().unwrap_or(repo_id);
    let quants = gguf_quants(&files);
    if !quants.is_empty() {
        let wanted = tag.unwrap_or(DEFAULT_QUANT);
        let found = quants
            .iter()
            .find(|(q, group)| {
                q.eq_ignore_ascii_case(wanted) || group.iter().any(|f| f.name == wanted)
            })
            // No tag and one quant only: that is the model.
            .or(match (tag, quants.as_slice()) {
                (None, [only]) => Some(only),
                _ => None,
            });
        let Some((quant, group)) = found else {
            return Err(StoreError::NoSuchQuant {
                repo: repo_id.to_string(),
                tag: wanted.to_string(),
                available: quants
                    .iter()
                    .map(|(q, _)| q.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        };
        check_parts(repo_id, group)?;
        let source = format!("hf.co/{repo_id}:{}", quant.to_ascii_uppercase());
        if let Some(pulled) = up_to_date(store, &source, &revision, options)? {
            return Ok(pulled);
        }
        let label = match group.len() {
            1 => group[0].name.clone(),
            n => format!("{} ({n} parts)", group[0].name),
        };
        let downloaded = download_all(
            &api, &cache, &repo, repo_id, group, &label, options, progress,
        )?;
        let (path, sha256) = downloaded.first.expect("a quant has a file");
        let name = options.name.clone().unwrap_or_else(|| {
            name_with_tag(
                short
                    .strip_suffix("-GGUF")
                    .or_else(|| short.strip_suffix("-gguf"))
                    .unwrap_or(short),
                Some(quant),
            )
        });
        // A split GGUF has no one sha256; its parts were each checked.
        let sha256 = (group.len() == 1).then_some(sha256);
        let record = Record::now(&source, sha256, Some(revision), None);
        return Ok(Pulled {
            gguf: Some(path.clone()),
            fetched_bytes: downloaded.fetched,
            ..convert_into_store(store, &path, &name, record, TargetDType::Keep, progress)?
        });
    }

    // A safetensors repository: the tag, if any, is what to store the matrices as.
    let has = |name: &str| files.iter().any(|f| f.name == name);
    let weights: Vec<&RepoFile> = files
        .iter()
        .filter(|f| !f.name.contains('/') && f.name.ends_with(".safetensors"))
        .collect();
    if !has("config.json") || weights.is_empty() {
        return Err(StoreError::HfRepo {
            repo: repo_id.to_string(),
            reason: "it has neither .gguf files nor config.json with .safetensors weights".into(),
        });
    }
    let dtype = match tag {
        None => TargetDType::Keep,
        Some(t) => TargetDType::from_name(t).ok_or_else(|| StoreError::HfRepo {
            repo: repo_id.to_string(),
            reason: format!(
                "it holds safetensors weights, so its tag is the type to store them as: \
                 keep, f16, bf16, q8_0 or q4_1, not {t:?}"
            ),
        })?,
    };
    let source = match tag {
        Some(_) => format!("hf.co/{repo_id}:{}", dtype.name().to_ascii_uppercase()),
        None => format!("hf.co/{repo_id}"),
    };
    if let Some(pulled) = up_to_date(store, &source, &revision, options)? {
        return Ok(pulled);
    }
    let wanted: Vec<RepoFile> = files
        .iter()
        .filter(|f| HF_SIDE_FILES.contains(&f.name.as_str()))
        .chain(weights)
        .cloned()
        .collect();
    let downloaded = download_all(
        &api, &cache, &repo, repo_id, &wanted, repo_id, options, progress,
    )?;
    let fetched = downloaded.fetched;
    let snapshot = downloaded
        .first
        .and_then(|(path, _)| path.parent().map(Path::to_path_buf))
        .expect("config.json was downloaded");
    let name = options
        .name
        .clone()
        .unwrap_or_else(|| name_with_tag(short, tag.map(|_| dtype.name())));
    let record = Record::now(&source, None, Some(revision), None);
    Ok(Pulled {
        fetched_bytes: fetched,
        ..convert_into_store(store, &snapshot, &name, record, dtype, progress)?
    })
}

/// The stored model, when the store has `source` at `revision` already (and no `--force`).
fn up_to_date(
    store: &Store,
    source: &str,
    revision: &str,
    options: &PullOptions,
) -> Result<Option<Pulled>, StoreError> {
    if options.force {
        return Ok(None);
    }
    Ok(stored_from(store, source)?
        .filter(|(_, _, record)| record.revision.as_deref() == Some(revision))
        .map(|(name, dir, record)| Pulled::stored(name, dir, record)))
}

/// A quant's files are one GGUF, or every part of one split GGUF (and nothing else).
fn check_parts(repo_id: &str, group: &[RepoFile]) -> Result<(), StoreError> {
    let first = &group[0].name;
    let (dir, base) = match first.rsplit_once('/') {
        Some((dir, base)) => (format!("{dir}/"), base),
        None => (String::new(), first.as_str()),
    };
    let error = |reason: String| StoreError::SplitGguf {
        origin: repo_id.to_string(),
        file: first.clone(),
        reason,
    };
    let names = || {
        group
            .iter()
            .map(|f| f.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(split) = gdsllm_convert::gguf::split_name(base) else {
        if group.len() == 1 {
            return Ok(());
        }
        return Err(error(format!(
            "the quant has {} files that are not the parts of one split: {}",
            group.len(),
            names()
        )));
    };
    for number in 1..=split.count {
        let part = format!("{dir}{}", split.part(number));
        if !group.iter().any(|f| f.name == part) {
            return Err(error(format!(
                "part {number} of {}, {part}, is not in the repository",
                split.count
            )));
        }
    }
    if group.len() != split.count as usize {
        return Err(error(format!(
            "the quant's files are the parts of more than one split: {}",
            names()
        )));
    }
    Ok(())
}

/// What [`download_all`] got.
struct Downloaded {
    /// The first file's path in the snapshot, and its sha256.
    first: Option<(PathBuf, String)>,
    /// Bytes that crossed the network.
    fetched: u64,
}

/// Downloads `files` (or finds them in the cache) with one progress bar named `label`.
#[allow(clippy::too_many_arguments)]
fn download_all(
    api: &Api,
    cache: &Cache,
    repo: &ApiRepo,
    repo_id: &str,
    files: &[RepoFile],
    label: &str,
    options: &PullOptions,
    progress: &dyn PullProgress,
) -> Result<Downloaded, StoreError> {
    let client = fetch_client(cache, options);
    let total = files.iter().filter_map(|f| f.size).sum();
    let bar = PartsProgress::new(progress, label, total);
    let mut downloaded = Downloaded {
        first: None,
        fetched: 0,
    };
    for file in files {
        let (path, sha256, fetched) =
            download_checked(api, cache, repo, repo_id, &client, file, options, &bar)?;
        bar.done_with(file.size.unwrap_or(0));
        downloaded.fetched += fetched;
        downloaded.first.get_or_insert((path, sha256));
    }
    bar.finish();
    Ok(downloaded)
}

/// Downloads `file` into the Hugging Face cache (or finds it there) and checks it; returns
/// its path in the snapshot, its sha256 and the bytes fetched.
#[allow(clippy::too_many_arguments)]
fn download_checked(
    api: &Api,
    cache: &Cache,
    repo: &ApiRepo,
    repo_id: &str,
    client: &Client,
    file: &RepoFile,
    options: &PullOptions,
    progress: &dyn PullProgress,
) -> Result<(PathBuf, String, u64), StoreError> {
    let url = repo.url(&file.name);
    let meta = api
        .metadata(&url)
        .map_err(|e| download_error(&url, &file.name, e))?;
    let size = meta.size() as u64;
    if let Some(listed) = file.size
        && listed != size
    {
        return Err(StoreError::Fetch(gdsllm_fetch::FetchError::WrongSize {
            url,
            expected: listed,
            actual: size,
            source_of_size: "the repository's file list".into(),
        }));
    }
    let cache_repo = cache.repo(Repo::model(repo_id.to_string()));
    let pointer = cache_repo.pointer_path(meta.commit_hash()).join(&file.name);
    let blob = cache_repo.blob_path(meta.etag());
    let etag = meta.etag().trim_matches('"').to_ascii_lowercase();
    // What the bytes must hash to, and who says so.
    let (expected, algorithm, according_to) =
        match (gdsllm_fetch::sha256_hex(&etag), &file.lfs_sha256) {
            (Some(hex), _) => (hex, "sha256", "the ETag (Git LFS sha256)"),
            (None, Some(lfs)) => (
                lfs.to_ascii_lowercase(),
                "sha256",
                "the file list (Git LFS sha256)",
            ),
            (None, None) => (etag, "git object id", "the ETag (git object id)"),
        };
    let according_to = format!("{according_to} of {url}");
    let remove = || {
        for path in [&blob, &pointer] {
            let _ = std::fs::remove_file(path);
        }
    };
    let mut fetched = 0;
    let sha256 = if std::fs::metadata(&pointer).is_ok_and(|m| m.len() == size) {
        tracing::info!("{}: in the Hugging Face cache already", file.name);
        gdsllm_fetch::sha256_file(&pointer)?
    } else {
        let download_options = DownloadOptions {
            sha256: (algorithm == "sha256").then(|| (expected.clone(), according_to.clone())),
            size: Some(ExpectedSize {
                bytes: size,
                according_to: "the repository's file list",
            }),
            write_limit: options.write_limit,
        };
        let done = gdsllm_fetch::download(client, &url, &blob, &download_options, progress)?;
        fetched = done.fetched;
        link_pointer(&pointer, &blob, &file.name)?;
        cache_repo.create_ref(meta.commit_hash()).map_err(|e| {
            let repo_dir = blob.parent().and_then(Path::parent).unwrap_or(&blob);
            StoreError::io(&repo_dir.join("refs"), e)
        })?;
        done.sha256
    };
    let actual = match algorithm {
        "sha256" => sha256.clone(),
        _ => git_blob_id(&pointer)?,
    };
    if expected != actual {
        remove();
        return Err(StoreError::Checksum {
            path: pointer,
            algorithm,
            expected,
            actual,
            according_to,
        });
    }
    Ok((pointer, sha256, fetched))
}

/// Points the snapshot's `file_name` at its blob, as hf-hub does: a relative symbolic link.
fn link_pointer(pointer: &Path, blob: &Path, file_name: &str) -> Result<(), StoreError> {
    let parent = pointer.parent().expect("a snapshot file has a directory");
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    match std::fs::remove_file(pointer) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(StoreError::io(pointer, e)),
    }
    // snapshots/COMMIT/[DIR/]FILE → ../../[../]blobs/ETAG
    let up = "../".repeat(file_name.split('/').count() + 1);
    let target = PathBuf::from(up)
        .join("blobs")
        .join(blob.file_name().expect("a blob has a name"));
    std::os::unix::fs::symlink(&target, pointer).map_err(io(pointer))
}

/// Git's object id of a file (the ETag of a file kept in git rather than LFS).
fn git_blob_id(path: &Path) -> Result<String, StoreError> {
    let bytes = std::fs::read(path).map_err(crate::error::io(path))?;
    Ok(gdsllm_fetch::git_blob_id(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str) -> RepoFile {
        RepoFile {
            name: name.into(),
            size: None,
            lfs_sha256: None,
        }
    }

    #[test]
    fn quants_group_split_parts_and_skip_projectors() {
        let files = [
            file("README.md"),
            file("m-Q8_0.gguf"),
            file("m-Q4_K_M.gguf"),
            file("mmproj-m-f16.gguf"),
            file("Q6_K/m-Q6_K-00002-of-00002.gguf"),
            file("Q6_K/m-Q6_K-00001-of-00002.gguf"),
        ];
        let quants = gguf_quants(&files);
        let names: Vec<&str> = quants.iter().map(|(q, _)| q.as_str()).collect();
        assert_eq!(names, ["Q4_K_M", "Q6_K", "Q8_0"]);
        assert_eq!(quants[1].1.len(), 2);
        assert_eq!(quants[1].1[0].name, "Q6_K/m-Q6_K-00001-of-00002.gguf");
    }
}
