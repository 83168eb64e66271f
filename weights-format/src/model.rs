//! The validating reader. `Model::open` checks everything that can be checked without reading
//! the weights (it stats the blobs, never reads them), so it is cheap enough to run on every
//! load; `Model::verify` re-reads every byte and compares checksums.

use std::collections::HashSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use xxhash_rust::xxh3::Xxh3;

use crate::files;
use crate::layout::{self, BlobKind};
use crate::{
    ALIGNMENT, Architecture, BlobMeta, FORMAT_VERSION, FormatError, METADATA_CHECKSUM_FILE,
    METADATA_FILE, Metadata, ModelConfig, OLDEST_FORMAT_VERSION, TensorMeta,
};

/// metadata.json of an 80-layer model is ~100 KB; anything near this limit is not ours.
const MAX_METADATA_BYTES: u64 = 64 << 20;
/// `xxh3:<16 hex>` and a newline is 22 bytes; a larger side file is not one of ours.
const MAX_CHECKSUM_FILE_BYTES: u64 = 64;
/// Large sequential reads keep `verify` at disk speed; three buffers let reading and hashing
/// overlap.
const VERIFY_CHUNK: usize = 8 << 20;
const VERIFY_BUFFERS: usize = 3;

/// An opened, validated model directory.
#[derive(Debug, Clone)]
pub struct Model {
    dir: PathBuf,
    metadata: Metadata,
    /// metadata.json exactly as read, for its checksum.
    metadata_bytes: Vec<u8>,
}

/// What [`Model::verify_with`] reports while it runs.
#[derive(Debug)]
pub enum VerifyProgress<'a> {
    /// This many more bytes were read and hashed.
    Bytes(u64),
    /// A blob is done; `result` is `Ok` when its checksum and length match.
    BlobDone {
        index: usize,
        file: &'a str,
        bytes: u64,
        result: &'a Result<(), FormatError>,
    },
}

/// Summary of a successful [`Model::verify`].
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyReport {
    pub blobs: usize,
    pub bytes: u64,
    pub seconds: f64,
}

impl VerifyReport {
    pub fn gb_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

impl Model {
    /// Opens `dir` and validates everything but the checksums: format version, config
    /// consistency, blob list, file sizes, tensor bounds, alignment, overlaps, dtype × shape
    /// = length, the tensors and shapes the config implies, tokenizer and chat template files.
    ///
    /// Last, metadata.json's bytes are checked against `metadata.json.xxh3`: a metadata.json
    /// changed after it was written is refused (after a deliberate edit, write its new checksum
    /// with [`Model::update_metadata_checksum`], `gdsllm verify --update-metadata-checksum`).
    /// Structural errors are reported first because they say more than "changed".
    pub fn open(dir: impl AsRef<Path>) -> Result<Model, FormatError> {
        let model = Model::open_unchecked_sidecar(dir.as_ref())?;
        model.check_metadata_bytes(&model.metadata_bytes)?;
        Ok(model)
    }

    /// Validates `dir` like [`Model::open`], then writes `metadata.json.xxh3` for the
    /// metadata.json that is there now: the way to accept a deliberate hand edit.
    pub fn update_metadata_checksum(dir: impl AsRef<Path>) -> Result<Model, FormatError> {
        let model = Model::open_unchecked_sidecar(dir.as_ref())?;
        let sum_path = model.dir.join(METADATA_CHECKSUM_FILE);
        let temp = model
            .dir
            .join(format!(".{METADATA_CHECKSUM_FILE}.{}", std::process::id()));
        std::fs::write(&temp, format!("{}\n", xxh3_text(&model.metadata_bytes)))
            .map_err(|e| FormatError::io(&temp, e))?;
        std::fs::rename(&temp, &sum_path).map_err(|e| FormatError::io(&sum_path, e))?;
        Ok(model)
    }

    fn open_unchecked_sidecar(dir: &Path) -> Result<Model, FormatError> {
        let dir = dir.to_path_buf();
        let (metadata, metadata_bytes) = read_metadata(&dir)?;
        validate(&dir, &metadata)?;
        Ok(Model {
            dir,
            metadata,
            metadata_bytes,
        })
    }

    pub(crate) fn moved_to(self, dir: PathBuf) -> Model {
        Model { dir, ..self }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub fn config(&self) -> &ModelConfig {
        &self.metadata.config
    }

    /// Number of blobs (`n_layers + 2`).
    pub fn blob_count(&self) -> usize {
        self.metadata.blobs.len()
    }

    /// The blob at `index` of `metadata().blobs`.
    ///
    /// # Panics
    /// If `index >= blob_count()`.
    pub fn blob(&self, index: usize) -> &BlobMeta {
        &self.metadata.blobs[index]
    }

    /// Path of the blob at `index` of `metadata().blobs`.
    ///
    /// # Panics
    /// If `index >= blob_count()`.
    pub fn blob_path(&self, index: usize) -> PathBuf {
        self.dir.join(&self.metadata.blobs[index].file)
    }

    pub fn embed_blob(&self) -> usize {
        0
    }

    /// # Panics
    /// If `layer >= n_layers`.
    pub fn layer_blob(&self, layer: usize) -> usize {
        assert!(
            layer < self.metadata.config.n_layers as usize,
            "layer {layer} out of range (model has {})",
            self.metadata.config.n_layers
        );
        1 + layer
    }

    pub fn output_blob(&self) -> usize {
        self.metadata.config.n_layers as usize + 1
    }

    /// The blob that holds the LM head: `output_blob()`, or `embed_blob()` when tied.
    pub fn lm_head_blob(&self) -> (usize, &'static str) {
        if self.metadata.config.tie_word_embeddings {
            (self.embed_blob(), crate::names::TOKEN_EMBD)
        } else {
            (self.output_blob(), crate::names::OUTPUT)
        }
    }

    /// A tensor of the blob at `blob`, by canonical name.
    pub fn tensor(&self, blob: usize, name: &str) -> Option<&TensorMeta> {
        self.metadata.blobs.get(blob)?.tensor(name)
    }

    /// Total bytes of all blob files.
    pub fn total_bytes(&self) -> u64 {
        self.metadata.blobs.iter().map(|b| b.length).sum()
    }

    /// Reads one tensor's bytes (a plain positioned read; for tools and tests, not the hot path).
    pub fn read_tensor(&self, blob: usize, name: &str) -> Result<Vec<u8>, FormatError> {
        let meta = self
            .metadata
            .blobs
            .get(blob)
            .ok_or_else(|| FormatError::Writer {
                reason: format!(
                    "blob index {blob} out of range ({} blobs)",
                    self.blob_count()
                ),
            })?;
        let t = meta
            .tensor(name)
            .ok_or_else(|| FormatError::MissingTensor {
                blob: meta.file.clone(),
                tensor: name.to_string(),
            })?;
        let path = self.blob_path(blob);
        let mut f = File::open(&path).map_err(|e| FormatError::io(&path, e))?;
        f.seek(SeekFrom::Start(t.offset))
            .map_err(|e| FormatError::io(&path, e))?;
        let len = usize::try_from(t.length).map_err(|_| FormatError::Writer {
            reason: format!("{}: tensor {name} does not fit in memory", meta.file),
        })?;
        let mut buf = vec![0u8; len];
        f.read_exact(&mut buf)
            .map_err(|e| FormatError::io(&path, e))?;
        Ok(buf)
    }

    /// Re-reads the blob at `index` sequentially and checks its length and checksum.
    pub fn verify_blob(&self, index: usize) -> Result<(), FormatError> {
        self.verify_one(index, &mut |_| {})
    }

    /// Checks metadata.json against `metadata.json.xxh3`, then re-reads every blob and checks
    /// its length and checksum. Fails with [`FormatError::VerifyFailed`] listing every bad
    /// file, not just the first.
    pub fn verify(&self) -> Result<VerifyReport, FormatError> {
        self.verify_with(|_| {})
    }

    /// [`Model::verify`] with a callback for progress bars and per-blob status lines.
    pub fn verify_with(
        &self,
        mut progress: impl FnMut(VerifyProgress<'_>),
    ) -> Result<VerifyReport, FormatError> {
        let start = Instant::now();
        let mut errors = Vec::new();
        if let Err(e) = self.verify_metadata_checksum() {
            errors.push(e);
        }
        let mut bytes = 0;
        for (index, blob) in self.metadata.blobs.iter().enumerate() {
            let mut read = 0u64;
            let result = self.verify_one(index, &mut |n| {
                read += n;
                progress(VerifyProgress::Bytes(n));
            });
            bytes += read;
            progress(VerifyProgress::BlobDone {
                index,
                file: &blob.file,
                bytes: read,
                result: &result,
            });
            if let Err(e) = result {
                errors.push(e);
            }
        }
        if !errors.is_empty() {
            return Err(FormatError::VerifyFailed {
                total: self.metadata.blobs.len() + 1,
                errors,
            });
        }
        Ok(VerifyReport {
            blobs: self.metadata.blobs.len(),
            bytes,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// Re-reads metadata.json and checks its bytes against `metadata.json.xxh3`.
    pub fn verify_metadata_checksum(&self) -> Result<(), FormatError> {
        let meta_path = self.dir.join(METADATA_FILE);
        let bytes = files::read_regular(&meta_path, "metadata.json", MAX_METADATA_BYTES)?;
        self.check_metadata_bytes(&bytes)
    }

    /// Checks `bytes` (metadata.json) against the side file: it must be a regular file
    /// holding `xxh3:<16 lowercase hex digits>` (and a newline) that matches.
    fn check_metadata_bytes(&self, bytes: &[u8]) -> Result<(), FormatError> {
        let sum_path = self.dir.join(METADATA_CHECKSUM_FILE);
        let raw = files::read_regular(
            &sum_path,
            "metadata.json.xxh3 (the checksum of metadata.json)",
            MAX_CHECKSUM_FILE_BYTES,
        )?;
        let text = String::from_utf8_lossy(&raw);
        let expected = text.strip_suffix('\n').unwrap_or(&text);
        if !is_checksum_syntax(expected) {
            return Err(FormatError::ChecksumSyntax {
                blob: METADATA_CHECKSUM_FILE.to_string(),
                value: expected.to_string(),
            });
        }
        let actual = xxh3_text(bytes);
        if actual != expected {
            return Err(FormatError::MetadataChanged {
                expected: expected.to_string(),
                actual,
            });
        }
        Ok(())
    }

    fn verify_one(&self, index: usize, on_bytes: &mut dyn FnMut(u64)) -> Result<(), FormatError> {
        let blob = &self.metadata.blobs[index];
        let path = self.blob_path(index);
        let file = files::open_regular(&path, "blob listed in metadata.json")?;
        let (digest, read) =
            hash_file(file, blob.length, on_bytes).map_err(|e| FormatError::io(&path, e))?;
        if read != blob.length {
            return Err(FormatError::ShortRead {
                blob: blob.file.clone(),
                read,
                expected: blob.length,
            });
        }
        let actual = format!("xxh3:{digest:016x}");
        if actual != blob.checksum {
            return Err(FormatError::BadChecksum {
                blob: blob.file.clone(),
                expected: blob.checksum.clone(),
                actual,
            });
        }
        Ok(())
    }
}

/// XXH3-64 of a whole file and its length. One thread reads big chunks while another hashes,
/// so the slower of the two (normally the disk) sets the pace.
fn hash_file(
    mut file: File,
    expected_len: u64,
    on_bytes: &mut dyn FnMut(u64),
) -> std::io::Result<(u64, u64)> {
    // Small blobs get small buffers; one spare byte lets a file that grew be noticed.
    let chunk = usize::try_from(expected_len.saturating_add(1))
        .unwrap_or(VERIFY_CHUNK)
        .clamp(64 << 10, VERIFY_CHUNK);
    let (full_tx, full_rx) = mpsc::sync_channel::<(Vec<u8>, usize)>(VERIFY_BUFFERS);
    let (empty_tx, empty_rx) = mpsc::channel::<Vec<u8>>();
    for _ in 0..VERIFY_BUFFERS {
        empty_tx.send(vec![0u8; chunk]).expect("receiver is alive");
    }
    std::thread::scope(|s| {
        let hasher = s.spawn(move || {
            let mut h = Xxh3::new();
            for (buf, n) in full_rx {
                h.update(&buf[..n]);
                // The reader may have stopped on an error; then nobody wants the buffer back.
                let _ = empty_tx.send(buf);
            }
            h.digest()
        });
        let mut total = 0u64;
        let read_result = (|| {
            while let Ok(mut buf) = empty_rx.recv() {
                let n = fill(&mut file, &mut buf)?;
                if n == 0 {
                    break;
                }
                total += n as u64;
                on_bytes(n as u64);
                if full_tx.send((buf, n)).is_err() || n < chunk {
                    break;
                }
            }
            Ok::<(), std::io::Error>(())
        })();
        drop(full_tx);
        let digest = hasher
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        read_result.map(|()| (digest, total))
    })
}

/// Reads until `buf` is full or the file ends.
fn fill(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn read_metadata(dir: &Path) -> Result<(Metadata, Vec<u8>), FormatError> {
    let path = dir.join(METADATA_FILE);
    let file = files::open_regular(&path, "metadata.json (is this a GdsLLM model directory?)")?;
    let mut bytes = Vec::new();
    file.take(MAX_METADATA_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| FormatError::io(&path, e))?;
    if bytes.len() as u64 > MAX_METADATA_BYTES {
        return Err(FormatError::Json {
            path,
            line: 0,
            column: 0,
            message: format!("larger than the {MAX_METADATA_BYTES}-byte limit"),
        });
    }
    let json_error = |e: serde_json::Error| FormatError::Json {
        path: path.clone(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    };
    // Look at the version first, so a newer file is reported as such rather than as a schema
    // error about whatever field it added.
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(json_error)?;
    match value
        .get("format_version")
        .and_then(serde_json::Value::as_u64)
    {
        Some(v) if (u64::from(OLDEST_FORMAT_VERSION)..=u64::from(FORMAT_VERSION)).contains(&v) => {}
        Some(v) => {
            return Err(FormatError::UnsupportedVersion {
                path,
                found: u32::try_from(v).unwrap_or(u32::MAX),
                supported: FORMAT_VERSION,
            });
        }
        None => {} // the typed parse below reports it with a position
    }
    let metadata = serde_json::from_slice(&bytes).map_err(json_error)?;
    Ok((metadata, bytes))
}

/// `xxh3:<16 hex>` of `bytes`, as blobs and the metadata side file record it.
fn xxh3_text(bytes: &[u8]) -> String {
    format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// Whether `value` is `xxh3:` and 16 lowercase hex digits.
pub(crate) fn is_checksum_syntax(value: &str) -> bool {
    value.strip_prefix("xxh3:").is_some_and(|hex| {
        hex.len() == 16 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// A name that stays inside the model directory: one path component, not `.`/`..`.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && Path::new(name).components().count() == 1
}

fn config_error(key: &str, reason: impl Into<String>) -> FormatError {
    FormatError::Config {
        key: key.to_string(),
        reason: reason.into(),
    }
}

impl ModelConfig {
    /// Checks the hyper-parameters alone (a known architecture, non-zero sizes, heads divisible
    /// by KV heads, even head dimension, finite positive RoPE bases, norm epsilon and scales,
    /// supported RoPE scaling with its fields, a sliding window inside the layers, the feature
    /// fields the family has, special token ids inside the vocabulary): what [`Model::open`]
    /// checks of the config.
    pub fn validate(&self) -> Result<(), FormatError> {
        validate_config(self)
    }

    /// The family; `None` when `architecture` names none (which [`ModelConfig::validate`]
    /// refuses).
    pub fn family(&self) -> Option<Architecture> {
        Architecture::from_name(&self.architecture)
    }

    /// Whether layer `layer` attends only to a sliding window (and so keeps only the window
    /// in its KV cache).
    pub fn is_sliding_layer(&self, layer: u32) -> bool {
        self.sliding_window
            .as_ref()
            .is_some_and(|w| w.layers.binary_search(&layer).is_ok())
    }
}

fn validate_config(c: &ModelConfig) -> Result<(), FormatError> {
    let Some(arch) = Architecture::from_name(&c.architecture) else {
        return Err(config_error(
            "architecture",
            format!(
                "{:?} is not supported ({})",
                c.architecture,
                Architecture::names()
            ),
        ));
    };
    for (key, v) in [
        ("n_layers", c.n_layers),
        ("hidden_size", c.hidden_size),
        ("n_heads", c.n_heads),
        ("n_kv_heads", c.n_kv_heads),
        ("head_dim", c.head_dim),
        ("ffn_dim", c.ffn_dim),
        ("vocab_size", c.vocab_size),
        ("context_length", c.context_length),
    ] {
        if v == 0 {
            return Err(config_error(key, "must not be 0"));
        }
    }
    if !c.n_heads.is_multiple_of(c.n_kv_heads) {
        return Err(config_error(
            "n_kv_heads",
            format!("{} does not divide n_heads {}", c.n_kv_heads, c.n_heads),
        ));
    }
    if !c.head_dim.is_multiple_of(2) {
        return Err(config_error(
            "head_dim",
            format!("{} is odd; RoPE rotates pairs", c.head_dim),
        ));
    }
    positive(&[
        ("rope_theta", Some(c.rope_theta)),
        ("rms_norm_eps", Some(c.rms_norm_eps)),
        ("embedding_scale", Some(c.embedding_scale)),
        ("attention_scale", c.attention_scale),
        ("final_logit_softcap", c.final_logit_softcap),
    ])?;
    if let Some(s) = &c.rope_scaling {
        validate_rope_scaling(c, s)?;
    }
    if let Some(w) = &c.sliding_window {
        if w.size == 0 {
            return Err(config_error("sliding_window.size", "must not be 0"));
        }
        if w.layers.is_empty() {
            return Err(config_error(
                "sliding_window.layers",
                "is empty (use \"sliding_window\": null)",
            ));
        }
        if let Some(pair) = w.layers.windows(2).find(|p| p[0] >= p[1]) {
            return Err(config_error(
                "sliding_window.layers",
                format!(
                    "must be ascending without repeats ({} then {})",
                    pair[0], pair[1]
                ),
            ));
        }
        if let Some(&l) = w.layers.iter().find(|&&l| l >= c.n_layers) {
            return Err(config_error(
                "sliding_window.layers",
                format!("layer {l} is not below n_layers {}", c.n_layers),
            ));
        }
        positive(&[("sliding_window.rope_theta", Some(w.rope_theta))])?;
    }
    validate_family(arch, c)?;
    if let Some(bos) = c.bos_token_id
        && bos >= c.vocab_size
    {
        return Err(config_error(
            "bos_token_id",
            format!("{bos} is not below vocab_size {}", c.vocab_size),
        ));
    }
    if let Some(&eos) = c.eos_token_ids.iter().find(|&&e| e >= c.vocab_size) {
        return Err(config_error(
            "eos_token_ids",
            format!("{eos} is not below vocab_size {}", c.vocab_size),
        ));
    }
    Ok(())
}

/// Each `Some` value must be finite and > 0.
fn positive(values: &[(&str, Option<f32>)]) -> Result<(), FormatError> {
    for &(key, v) in values {
        if let Some(v) = v
            && !(v.is_finite() && v > 0.0)
        {
            return Err(config_error(
                key,
                format!("{v} is not a finite positive number"),
            ));
        }
    }
    Ok(())
}

fn validate_rope_scaling(c: &ModelConfig, s: &crate::RopeScaling) -> Result<(), FormatError> {
    let key = |k: &str| format!("rope_scaling.{k}");
    // One factor per rotated pair, each finite and > 0.
    let factors = |name: &str, v: &Option<Vec<f32>>| -> Result<(), FormatError> {
        let Some(v) = v else { return Ok(()) };
        if v.len() != c.head_dim as usize / 2 {
            return Err(config_error(
                &key(name),
                format!("has {} values, head_dim/2 = {}", v.len(), c.head_dim / 2),
            ));
        }
        if let Some(x) = v.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
            return Err(config_error(
                &key(name),
                format!("{x} is not a finite positive number"),
            ));
        }
        Ok(())
    };
    // The optional fields, each with whether the config gives it.
    let low = ("low_freq_factor", s.low_freq_factor.is_some());
    let high = ("high_freq_factor", s.high_freq_factor.is_some());
    let original = (
        "original_max_position_embeddings",
        s.original_max_position_embeddings.is_some(),
    );
    let freq = ("freq_factors", s.freq_factors.is_some());
    let short = ("short_factor", s.short_factor.is_some());
    let long = ("long_factor", s.long_factor.is_some());
    // Those each rope type needs, and those it has no use for.
    type Given<'a> = &'a [(&'a str, bool)];
    let (required, unused): (Given, Given) = match s.rope_type.as_str() {
        "linear" => (&[], &[freq, short, long]),
        "llama3" => (&[low, high, original], &[freq]),
        "freq_factors" => (&[freq], &[]),
        "longrope" => (&[short, long, original], &[freq]),
        other => {
            return Err(config_error(
                &key("rope_type"),
                format!(
                    "{other:?} is not supported (\"linear\", \"llama3\", \"freq_factors\" or \"longrope\")"
                ),
            ));
        }
    };
    if let Some((name, _)) = required.iter().find(|(_, given)| !given) {
        return Err(config_error(
            &key(name),
            format!("required for rope_type {:?}", s.rope_type),
        ));
    }
    if let Some((name, _)) = unused.iter().find(|(_, given)| *given) {
        return Err(config_error(
            &key(name),
            format!("not used by rope_type {:?} (must be null)", s.rope_type),
        ));
    }
    if let (Some(low), Some(high)) = (s.low_freq_factor, s.high_freq_factor)
        && s.rope_type == "llama3"
        && low >= high
    {
        return Err(config_error(
            &key("high_freq_factor"),
            format!("{high} is not above low_freq_factor {low}"),
        ));
    }
    if s.rope_type == "freq_factors" && s.factor != 1.0 {
        return Err(config_error(
            &key("factor"),
            format!("{} must be 1 for rope_type \"freq_factors\"", s.factor),
        ));
    }
    if s.original_max_position_embeddings == Some(0) {
        return Err(config_error(
            &key("original_max_position_embeddings"),
            "must not be 0",
        ));
    }
    factors("freq_factors", &s.freq_factors)?;
    factors("short_factor", &s.short_factor)?;
    factors("long_factor", &s.long_factor)?;
    positive(&[
        ("rope_scaling.factor", Some(s.factor)),
        ("rope_scaling.low_freq_factor", s.low_freq_factor),
        ("rope_scaling.high_freq_factor", s.high_freq_factor),
        ("rope_scaling.attention_factor", s.attention_factor),
    ])
}

/// The feature fields must be the family's (see [`Architecture::rules`]).
fn validate_family(arch: Architecture, c: &ModelConfig) -> Result<(), FormatError> {
    let rules = arch.rules();
    let must = |key: &str, found: String, expected: String| {
        Err(config_error(
            key,
            format!("is {found}, but {arch} models have {expected}"),
        ))
    };
    for (key, found, expected) in [
        ("attention_bias", c.attention_bias, rules.attention_bias),
        ("qk_norm", c.qk_norm, rules.qk_norm),
        ("post_norms", c.post_norms, rules.post_norms),
    ] {
        if found != expected {
            return must(key, found.to_string(), expected.to_string());
        }
    }
    if c.activation != rules.activation {
        return must(
            "activation",
            format!("{:?}", c.activation),
            format!("{:?}", rules.activation),
        );
    }
    if !rules.gemma_extras {
        let only_gemma = |key: &str| {
            Err(config_error(
                key,
                format!("is set, which {arch} models do not use"),
            ))
        };
        if c.embedding_scale != 1.0 {
            return only_gemma("embedding_scale");
        }
        if c.attention_scale.is_some() {
            return only_gemma("attention_scale");
        }
        if c.final_logit_softcap.is_some() {
            return only_gemma("final_logit_softcap");
        }
        if c.sliding_window.is_some() {
            return only_gemma("sliding_window");
        }
    }
    if let Some(s) = &c.rope_scaling
        && !rules.rope_types.contains(&s.rope_type.as_str())
    {
        return Err(config_error(
            "rope_scaling.rope_type",
            format!(
                "{:?} is not used by {arch} models ({})",
                s.rope_type,
                rules.rope_types.join(", ")
            ),
        ));
    }
    Ok(())
}

fn validate(dir: &Path, m: &Metadata) -> Result<(), FormatError> {
    validate_config(&m.config)?;
    // Version 1 knew only llama; a version 1 file with a newer family is a hand edit gone wrong.
    if m.format_version < 2 && m.config.architecture != Architecture::Llama.name() {
        return Err(config_error(
            "architecture",
            format!(
                "{:?} needs format_version 2 (this file says {})",
                m.config.architecture, m.format_version
            ),
        ));
    }
    let n_layers = m.config.n_layers;

    for (field, name) in std::iter::once(("tokenizer", &m.tokenizer)).chain(
        m.chat_template
            .iter()
            .map(|t| ("chat_template.file", &t.file)),
    ) {
        if !is_plain_file_name(name) {
            return Err(FormatError::BadFileName {
                field: field.to_string(),
                name: name.clone(),
            });
        }
        files::file_inside(dir, name, &format!("{field} file named in metadata.json"))?;
    }

    // Compared before anything is built from n_layers: `n_layers: 4294967295` must be an
    // error here, not an allocation of four billion names.
    if m.blobs.len() as u64 != u64::from(n_layers) + 2 {
        return Err(FormatError::BlobCount {
            found: m.blobs.len(),
            expected: u64::from(n_layers) + 2,
            n_layers,
        });
    }
    let expected_files = layout::blob_files(n_layers);
    for (index, (blob, expected)) in m.blobs.iter().zip(&expected_files).enumerate() {
        if &blob.file != expected {
            return Err(FormatError::BlobOrder {
                index,
                expected: expected.clone(),
                found: blob.file.clone(),
            });
        }
    }

    for blob in &m.blobs {
        validate_blob(dir, &m.config, blob)?;
        if let Some(t) = blob
            .tensors
            .iter()
            .find(|t| t.dtype.format_version() > m.format_version)
        {
            return Err(FormatError::DTypeNeedsVersion {
                blob: blob.file.clone(),
                tensor: t.name.clone(),
                dtype: t.dtype,
                needed: t.dtype.format_version(),
                found: m.format_version,
            });
        }
    }
    Ok(())
}

fn validate_blob(dir: &Path, config: &ModelConfig, blob: &BlobMeta) -> Result<(), FormatError> {
    let file = &blob.file;
    let blob_err = || file.clone();
    if !is_checksum_syntax(&blob.checksum) {
        return Err(FormatError::ChecksumSyntax {
            blob: blob_err(),
            value: blob.checksum.clone(),
        });
    }
    if !blob.length.is_multiple_of(ALIGNMENT) {
        return Err(FormatError::BlobUnaligned {
            blob: blob_err(),
            length: blob.length,
            alignment: ALIGNMENT,
        });
    }

    let kind = layout::blob_kind(file).expect("blob names were checked against the layout");
    let mut seen = HashSet::new();
    for t in &blob.tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(FormatError::DuplicateTensor {
                blob: blob_err(),
                tensor: t.name.clone(),
            });
        }
        validate_tensor_bounds(blob, t)?;
    }
    let mut by_offset: Vec<&TensorMeta> = blob.tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        // Bounds were checked, so this sum cannot overflow.
        if pair[0].offset + pair[0].length > pair[1].offset {
            return Err(FormatError::Overlap {
                blob: blob_err(),
                tensor: pair[0].name.clone(),
                other: pair[1].name.clone(),
            });
        }
    }

    validate_expected_tensors(config, kind, blob)?;

    let path = files::file_inside(dir, file, "blob listed in metadata.json")?;
    let actual = std::fs::metadata(&path)
        .map_err(|e| FormatError::io(&path, e))?
        .len();
    if actual != blob.length {
        return Err(FormatError::BlobSize {
            blob: blob_err(),
            expected: blob.length,
            actual,
        });
    }
    Ok(())
}

fn validate_tensor_bounds(blob: &BlobMeta, t: &TensorMeta) -> Result<(), FormatError> {
    if !t.offset.is_multiple_of(ALIGNMENT) {
        return Err(FormatError::Misaligned {
            blob: blob.file.clone(),
            tensor: t.name.clone(),
            offset: t.offset,
            alignment: ALIGNMENT,
        });
    }
    let expected = t.dtype.byte_len(&t.shape);
    if expected != Some(t.length) {
        return Err(FormatError::SizeMismatch {
            blob: blob.file.clone(),
            tensor: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            length: t.length,
            expected,
        });
    }
    match t.offset.checked_add(t.length) {
        Some(end) if end <= blob.length => Ok(()),
        _ => Err(FormatError::TensorOutOfBounds {
            blob: blob.file.clone(),
            tensor: t.name.clone(),
            offset: t.offset,
            length: t.length,
            blob_length: blob.length,
        }),
    }
}

fn validate_expected_tensors(
    config: &ModelConfig,
    kind: BlobKind,
    blob: &BlobMeta,
) -> Result<(), FormatError> {
    let specs = layout::blob_tensors(config, kind);
    for spec in &specs {
        let t = blob
            .tensor(spec.name)
            .ok_or_else(|| FormatError::MissingTensor {
                blob: blob.file.clone(),
                tensor: spec.name.to_string(),
            })?;
        if t.shape != spec.shape {
            return Err(FormatError::WrongShape {
                blob: blob.file.clone(),
                tensor: t.name.clone(),
                expected: spec.shape.clone(),
                found: t.shape.clone(),
            });
        }
        if spec.role.is_float_only() && t.dtype.is_quantized() {
            return Err(FormatError::DTypeNotAllowed {
                blob: blob.file.clone(),
                tensor: t.name.clone(),
                dtype: t.dtype,
                reason: "norm and bias vectors must be f32, f16 or bf16",
            });
        }
    }
    if let Some(extra) = blob
        .tensors
        .iter()
        .find(|t| !specs.iter().any(|s| s.name == t.name))
    {
        return Err(FormatError::UnexpectedTensor {
            blob: blob.file.clone(),
            tensor: extra.name.clone(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelined_hash_equals_one_shot_hash() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        let len = 2 * VERIFY_CHUNK + 12_345;
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let expected = xxhash_rust::xxh3::xxh3_64(&bytes);
        // The buffer size follows the expected length; the result must not depend on it.
        for expected_len in [0, 100, len as u64, 10 * len as u64] {
            let mut seen = 0;
            let file = File::open(&path).unwrap();
            let (digest, read) = hash_file(file, expected_len, &mut |n| seen += n).unwrap();
            assert_eq!(digest, expected, "expected_len {expected_len}");
            assert_eq!(read, len as u64);
            assert_eq!(seen, len as u64);
        }
    }
}
