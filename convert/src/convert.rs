//! The conversion driver shared by every source format: a source is first turned into a
//! [`SourceModel`] (by `hf` or `gguf_map`), which is then streamed into a [`ModelWriter`] one
//! tensor at a time.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::Value;
use weights_format::{ChatTemplateRef, DType, Model, ModelWriter, quant};

// Re-exported where it used to live, so `convert::ConvertError` keeps working for callers.
pub use crate::error::ConvertError;
use crate::source::{SourceModel, TokenizerSource, Transform};
use crate::tokenizer::{GgufTokenizer, check_chat_template, check_tokenizer_json};

/// File name of the tokenizer inside a converted model.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// File name of the chat template inside a converted model.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// What to store the 2-D weight matrices as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TargetDType {
    /// Every tensor bit for bit as in the source (apart from the Q/K row order of GGUF).
    #[default]
    Keep,
    F16,
    Bf16,
    Q8_0,
    Q4_1,
    Q5_0,
    Q5_1,
    /// 256-value super-blocks: every matrix row must be a multiple of 256 values.
    Q4K,
    Q5K,
    Q6K,
}

impl TargetDType {
    /// Every target, for `--help` texts and messages.
    pub const ALL: [TargetDType; 10] = [
        TargetDType::Keep,
        TargetDType::F16,
        TargetDType::Bf16,
        TargetDType::Q8_0,
        TargetDType::Q4_1,
        TargetDType::Q5_0,
        TargetDType::Q5_1,
        TargetDType::Q4K,
        TargetDType::Q5K,
        TargetDType::Q6K,
    ];

    /// The target names joined for messages: "keep, f16, bf16, …".
    pub fn names() -> String {
        TargetDType::ALL.map(TargetDType::name).join(", ")
    }

    pub fn from_name(name: &str) -> Option<TargetDType> {
        TargetDType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    pub fn name(self) -> &'static str {
        self.dtype().map_or("keep", DType::name)
    }

    fn dtype(self) -> Option<DType> {
        match self {
            TargetDType::Keep => None,
            TargetDType::F16 => Some(DType::F16),
            TargetDType::Bf16 => Some(DType::Bf16),
            TargetDType::Q8_0 => Some(DType::Q8_0),
            TargetDType::Q4_1 => Some(DType::Q4_1),
            TargetDType::Q5_0 => Some(DType::Q5_0),
            TargetDType::Q5_1 => Some(DType::Q5_1),
            TargetDType::Q4K => Some(DType::Q4K),
            TargetDType::Q5K => Some(DType::Q5K),
            TargetDType::Q6K => Some(DType::Q6K),
        }
    }
}

impl std::fmt::Display for TargetDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name as [`TargetDType::from_name`] takes it; an unknown one gets a message listing the
/// names (what `gdsllm convert --dtype` and `cargo xtask convert --dtype` print).
impl std::str::FromStr for TargetDType {
    type Err = String;

    fn from_str(name: &str) -> Result<TargetDType, String> {
        TargetDType::from_name(name)
            .ok_or_else(|| format!("{name:?}: expected one of {}", TargetDType::names()))
    }
}

/// Options of [`convert`].
#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    pub dtype: TargetDType,
    /// Replace an existing output directory, once the new one is complete.
    pub force: bool,
}

/// Progress reporting hooks; the library never prints, callers plug in a progress bar.
/// Byte counts are of the source data read.
pub trait Progress {
    fn start(&self, _total_bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;
impl Progress for NoProgress {}

/// Opens a source: a `.gguf` file or a Hugging Face directory, told apart by what `input` is.
/// The tokenizer.json and chat template a source brings are loaded as the runtime will load
/// them before anything is written (one built from GGUF metadata is checked once built).
pub fn open_source(input: &Path) -> Result<SourceModel, ConvertError> {
    let meta = std::fs::metadata(input).map_err(|e| ConvertError::io(input, e))?;
    let source = if meta.is_dir() {
        if !input.join("config.json").is_file() {
            return Err(ConvertError::UnknownInput {
                path: input.to_path_buf(),
            });
        }
        crate::hf::open_hf_dir(input)?
    } else {
        crate::gguf_map::open_gguf(input)?
    };
    if let TokenizerSource::Json(json) = &source.tokenizer {
        check_tokenizer_json(json).map_err(|reason| ConvertError::BadInput {
            path: input.join(TOKENIZER_FILE),
            reason,
        })?;
    }
    if let Some(template) = &source.chat_template {
        check_chat_template(template).map_err(|reason| ConvertError::BadInput {
            path: input.to_path_buf(),
            reason,
        })?;
    }
    Ok(source)
}

/// What [`convert`] did.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub out: PathBuf,
    pub tensors: usize,
    pub blobs: usize,
    /// Bytes read from the source.
    pub source_bytes: u64,
    /// Bytes of blob files written (padding included).
    pub written_bytes: u64,
}

/// Converts `input` (GGUF file or Hugging Face directory) into a model directory at `out`.
/// Nothing appears at `out` unless the whole conversion succeeded; with `force`, an existing
/// `out` is replaced only after the new model is complete.
pub fn convert(
    input: &Path,
    out: &Path,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertReport, ConvertError> {
    clean_stale_staging(out);
    let exists = out.symlink_metadata().is_ok();
    if exists && !options.force {
        return Err(ConvertError::OutputExists {
            path: out.to_path_buf(),
        });
    }
    let started = std::time::Instant::now();
    let source = open_source(input)?;
    tracing::debug!(
        "source opened in {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    if !exists {
        return write_model(&source, out, options.dtype, progress);
    }
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| ConvertError::BadInput {
            path: out.to_path_buf(),
            reason: "the output needs a UTF-8 final path component".into(),
        })?;
    let pid = std::process::id();
    let fresh = out.with_file_name(format!(".{name}.new-{pid}"));
    let old = out.with_file_name(format!(".{name}.old-{pid}"));
    let mut report = write_model(&source, &fresh, options.dtype, progress)?;
    std::fs::rename(out, &old).map_err(|e| ConvertError::io(out, e))?;
    if let Err(e) = std::fs::rename(&fresh, out) {
        // Put the old model back rather than leave nothing at `out`.
        let _ = std::fs::rename(&old, out);
        let _ = std::fs::remove_dir_all(&fresh);
        return Err(ConvertError::io(out, e));
    }
    remove_path(&old).map_err(|e| ConvertError::io(&old, e))?;
    report.out = out.to_path_buf();
    Ok(report)
}

/// A `convert --force` killed half-way leaves `.<name>.new-<pid>` (the new model, or its
/// `..<name>.new-<pid>.partial-<pid>`) and possibly `.<name>.old-<pid>` (the model it was
/// replacing) next to `out`. With their process gone, the new ones are removed and an old one
/// is put back at `out` when nothing is there (else removed), and the writer's own
/// `.<name>.partial-<pid>` go too.
pub fn clean_stale_staging(out: &Path) {
    let (Some(parent), Some(name)) = (out.parent(), out.file_name().and_then(|n| n.to_str()))
    else {
        return;
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let remove = |path: &Path| match remove_path(path) {
        Ok(()) => tracing::info!(
            "removed {}, left by an interrupted conversion",
            path.display()
        ),
        Err(e) => tracing::warn!("cannot remove stale {}: {e}", path.display()),
    };
    weights_format::remove_stale_partials(parent, name);
    for prefix in [format!(".{name}.new-"), format!("..{name}.new-")] {
        for path in weights_format::stale_work_dirs(parent, &prefix) {
            remove(&path);
        }
    }
    for old in weights_format::stale_work_dirs(parent, &format!(".{name}.old-")) {
        if out.symlink_metadata().is_err() && std::fs::rename(&old, out).is_ok() {
            tracing::warn!(
                "{} was moved aside by an interrupted `convert --force`; put it back",
                out.display()
            );
        } else {
            remove(&old);
        }
    }
}

fn remove_path(path: &Path) -> std::io::Result<()> {
    if path.symlink_metadata()?.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

/// Streams `source` into a new model directory at `out` (which must not exist).
pub fn write_model(
    source: &SourceModel,
    out: &Path,
    dtype: TargetDType,
    progress: &dyn Progress,
) -> Result<ConvertReport, ConvertError> {
    let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
    let started = std::time::Instant::now();
    let mut writer = ModelWriter::create(out)?;
    progress.start(source.total_bytes());
    // A tokenizer built from GGUF metadata takes tens of milliseconds of CPU, which another
    // core spends while the blobs stream. It is taken as soon as it is done, so that one that
    // cannot be built stops the conversion after at most one more blob.
    let (tensors, built) = std::thread::scope(|scope| {
        let mut building = match &source.tokenizer {
            TokenizerSource::Json(_) => None,
            TokenizerSource::Gguf(gguf) => Some(scope.spawn(move || {
                let started = std::time::Instant::now();
                let json = GgufTokenizer::from_gguf(gguf).map(|t| t.to_json());
                tracing::debug!("tokenizer.json built in {:.1} ms", ms(started));
                json
            })),
        };
        let join = |thread: std::thread::ScopedJoinHandle<'_, _>| {
            thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        };
        let mut built = None;
        let tensors = write_blobs(source, &mut writer, dtype, progress, &mut || {
            if let Some(thread) = building.take_if(|t| t.is_finished()) {
                built = Some(join(thread)?);
            }
            Ok(())
        });
        let built = match building {
            Some(thread) => Some(join(thread)),
            None => built.map(Ok),
        };
        (tensors, built)
    });
    let tensors = tensors?;
    tracing::debug!("blobs written in {:.1} ms", ms(started));
    let started = std::time::Instant::now();
    let tokenizer_json: std::borrow::Cow<[u8]> = match (&source.tokenizer, built) {
        (TokenizerSource::Gguf(gguf), Some(built)) => {
            let json = built?.into_bytes();
            check_tokenizer_json(&json).map_err(|reason| ConvertError::BadInput {
                path: gguf.path().to_path_buf(),
                reason: format!("the tokenizer built from its metadata: {reason}"),
            })?;
            json.into()
        }
        (_, Some(built)) => built?.into_bytes().into(),
        (TokenizerSource::Json(bytes), None) => bytes.into(),
        (TokenizerSource::Gguf(_), None) => unreachable!("a GGUF tokenizer is always built"),
    };
    writer.add_file(TOKENIZER_FILE, &tokenizer_json)?;
    let chat_template = match &source.chat_template {
        Some(template) => {
            writer.add_file(CHAT_TEMPLATE_FILE, template.as_bytes())?;
            Some(ChatTemplateRef {
                file: CHAT_TEMPLATE_FILE.to_string(),
            })
        }
        None => None,
    };
    let mut provenance = source.source.clone();
    provenance.insert("dtype".into(), Value::String(dtype.name().into()));
    let model: Model = writer.finish(
        source.config.clone(),
        TOKENIZER_FILE,
        chat_template,
        provenance,
    )?;
    tracing::debug!("side files and finish in {:.1} ms", ms(started));
    progress.finish();
    Ok(ConvertReport {
        out: out.to_path_buf(),
        tensors,
        blobs: model.metadata().blobs.len(),
        source_bytes: source.total_bytes(),
        written_bytes: model.metadata().blobs.iter().map(|b| b.length).sum(),
    })
}

/// Streams every planned tensor into `writer`; returns how many were written.
/// `between_blobs` runs after each blob; an error from it stops the conversion.
fn write_blobs(
    source: &SourceModel,
    writer: &mut ModelWriter,
    dtype: TargetDType,
    progress: &dyn Progress,
    between_blobs: &mut dyn FnMut() -> Result<(), ConvertError>,
) -> Result<usize, ConvertError> {
    let mut raw = Vec::new();
    let mut converted = Vec::new();
    let mut tensors = 0;
    for blob in &source.blobs {
        let mut blob_writer = writer.begin_blob(&blob.file)?;
        for t in &blob.tensors {
            let (path, file) = &source.files[t.file];
            let target = match dtype.dtype() {
                _ if t.transform == Transform::AddOne => DType::F32,
                // Norms and other vectors stay f32 whatever the matrices become.
                Some(_) if t.shape.len() == 1 => DType::F32,
                Some(d) => d,
                None => t.dtype,
            };
            if target == t.dtype && t.transform == Transform::Keep {
                // Bit for bit: read straight into the writer's staging buffer.
                let mut tensor = blob_writer.begin_tensor(&t.name, target, &t.shape)?;
                let mut offset = t.offset;
                tensor.fill_with(|piece| {
                    file.read_exact_at(piece, offset)
                        .map_err(|e| ConvertError::io(path, e))?;
                    offset += piece.len() as u64;
                    Ok::<(), ConvertError>(())
                })?;
                tensor.finish()?;
                tensors += 1;
                progress.advance(t.length);
                continue;
            }
            raw.resize(t.length as usize, 0);
            file.read_exact_at(&mut raw, t.offset)
                .map_err(|e| ConvertError::io(path, e))?;
            let bad = |reason: String| ConvertError::BadTensor {
                path: path.clone(),
                tensor: t.source_name.clone(),
                reason,
            };
            let mut data: &[u8] = &raw;
            if let Transform::UnpermuteHeads(n_heads) = t.transform {
                unpermute_rows(data, &t.shape, n_heads, &mut converted).map_err(bad)?;
                std::mem::swap(&mut raw, &mut converted);
                data = &raw;
            }
            if t.transform == Transform::AddOne {
                add_one(data, t.dtype, &mut converted).map_err(bad)?;
                data = &converted;
            } else if target != t.dtype {
                reencode(data, t.dtype, target, &t.shape, &mut converted).map_err(bad)?;
                data = &converted;
            }
            blob_writer.write_tensor(&t.name, target, &t.shape, data)?;
            tensors += 1;
            progress.advance(t.length);
        }
        blob_writer.finish()?;
        between_blobs()?;
    }
    Ok(tensors)
}

/// Undoes llama.cpp's Q/K row permutation. llama.cpp stored HF row `h*hd + j*hd/2 + i` at
/// `h*hd + 2*i + j` (per head `h`, rotary half `j`, index `i`); this moves each row back.
/// Rows move whole, so quantized blocks are untouched.
pub fn unpermute_rows(
    data: &[u8],
    shape: &[u64],
    n_heads: u32,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let rows = shape.first().copied().unwrap_or(0) as usize;
    let n_heads = n_heads as usize;
    if rows == 0
        || n_heads == 0
        || !rows.is_multiple_of(2 * n_heads)
        || !data.len().is_multiple_of(rows)
    {
        return Err(format!(
            "{rows} rows cannot be split into {n_heads} heads of two rotary halves"
        ));
    }
    let row_bytes = data.len() / rows;
    let head_rows = rows / n_heads;
    let half = head_rows / 2;
    out.clear();
    out.resize(data.len(), 0);
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                let hf = h * head_rows + j * half + i;
                let gguf = h * head_rows + 2 * i + j;
                out[hf * row_bytes..(hf + 1) * row_bytes]
                    .copy_from_slice(&data[gguf * row_bytes..(gguf + 1) * row_bytes]);
            }
        }
    }
    Ok(())
}

/// A vector `w` (any float dtype) as the f32 bytes of `1 + w`.
pub(crate) fn add_one(data: &[u8], from: DType, out: &mut Vec<u8>) -> Result<(), String> {
    if from.is_quantized() {
        return Err(format!(
            "a norm weight stored as {from}; expected a float dtype"
        ));
    }
    let n = data.len() / from.byte_len(&[1]).unwrap_or(4) as usize;
    let mut values = vec![0f32; n];
    quant::dequantize(from, data, &mut values).map_err(|e| e.to_string())?;
    out.clear();
    out.extend(values.iter().flat_map(|v| (1.0 + v).to_le_bytes()));
    Ok(())
}

/// Re-encodes a tensor row by row (dequantize to f32, quantize), so memory stays at one
/// source tensor plus one output tensor.
fn reencode(
    data: &[u8],
    from: DType,
    to: DType,
    shape: &[u64],
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let cols = shape.last().copied().unwrap_or(1) as usize;
    if let Some(why) = to.row_error(cols as u64) {
        return Err(why);
    }
    let row_bytes = from
        .byte_len(&[cols as u64])
        .ok_or_else(|| format!("rows of {cols} values are not whole {from} blocks"))?
        as usize;
    out.clear();
    let mut row = vec![0f32; cols];
    for src in data.chunks_exact(row_bytes) {
        quant::dequantize(from, src, &mut row).map_err(|e| e.to_string())?;
        quant::quantize(to, &row, out).map_err(|e| e.to_string())?;
    }
    Ok(())
}
