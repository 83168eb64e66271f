//! The streaming writer. Bytes are hashed as they arrive and staged in a few 4 KiB-aligned
//! buffers that a background thread writes to the blob files while the caller produces the
//! next ones, so memory use is bounded and reading the source overlaps writing the output.
//! Everything is written into a hidden sibling directory that is renamed to the output only
//! after every write has completed and metadata.json has been written, validated and synced:
//! a crash or an error never leaves a directory at `out`.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, mpsc};

use xxhash_rust::xxh3::Xxh3;

use crate::layout::{self, BlobKind};
use crate::model::{Model, is_plain_file_name};
use crate::{
    ALIGNMENT, BlobMeta, ChatTemplateRef, DType, FORMAT_VERSION, FormatError,
    METADATA_CHECKSUM_FILE, METADATA_FILE, Metadata, ModelConfig, TensorMeta,
};

static ZEROS: [u8; ALIGNMENT as usize] = [0; ALIGNMENT as usize];

/// Writes a model directory. See the module docs for the crash-safety guarantee.
#[derive(Debug)]
pub struct ModelWriter {
    out: PathBuf,
    temp: PathBuf,
    blobs: Vec<BlobMeta>,
    files: Vec<String>,
    pipeline: WritePipeline,
    finished: bool,
}

impl ModelWriter {
    /// Starts a model at `out`, which must not exist yet (callers decide about overwriting).
    /// The work happens in `.<name>.partial-<pid>` next to `out`. Such directories left by
    /// writers that were killed (their process is gone) are removed first.
    pub fn create(out: impl AsRef<Path>) -> Result<ModelWriter, FormatError> {
        let out = out.as_ref().to_path_buf();
        if out.symlink_metadata().is_ok() {
            return Err(FormatError::OutputExists { path: out });
        }
        let name = out
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| FormatError::Writer {
                reason: format!(
                    "{}: output needs a UTF-8 final path component",
                    out.display()
                ),
            })?;
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if let Err(e) = std::fs::metadata(&parent) {
            return Err(FormatError::io(parent, e));
        }
        crate::files::remove_stale_partials(&parent, name);
        let temp = parent.join(format!(".{name}.partial-{}", std::process::id()));
        // Only a previous run with our pid can have left this; it is garbage by construction.
        if temp.symlink_metadata().is_ok() {
            std::fs::remove_dir_all(&temp).map_err(|e| FormatError::io(&temp, e))?;
        }
        std::fs::create_dir(&temp).map_err(|e| FormatError::io(&temp, e))?;
        Ok(ModelWriter {
            out,
            temp,
            blobs: Vec::new(),
            files: Vec::new(),
            pipeline: WritePipeline::default(),
            finished: false,
        })
    }

    /// The final directory, which exists only after [`ModelWriter::finish`].
    pub fn out(&self) -> &Path {
        &self.out
    }

    /// The hidden directory being written.
    pub fn temp_dir(&self) -> &Path {
        &self.temp
    }

    /// Opens blob `file` (a canonical name: `embed.bin`, `layer_NNN.bin`, `output.bin`).
    /// Blobs may be written in any order; `finish` lists them in streaming order.
    pub fn begin_blob(&mut self, file: &str) -> Result<BlobWriter<'_>, FormatError> {
        if layout::blob_kind(file).is_none() {
            return Err(FormatError::Writer {
                reason: format!(
                    "{file:?} is not a blob name (embed.bin, layer_NNN.bin or output.bin)"
                ),
            });
        }
        self.claim_name(file)?;
        let path = self.temp.join(file);
        self.pipeline.check()?;
        let handle = BlobSink::create(&path).map_err(|e| FormatError::io(&path, e))?;
        Ok(BlobWriter {
            model: self,
            file: file.to_string(),
            path,
            handle,
            hasher: Xxh3::new(),
            pos: 0,
            tensors: Vec::new(),
            poisoned: None,
            done: false,
        })
    }

    /// Writes a small side file such as `tokenizer.json` or `chat_template.jinja`.
    pub fn add_file(&mut self, name: &str, bytes: &[u8]) -> Result<(), FormatError> {
        if !is_plain_file_name(name)
            || name == METADATA_FILE
            || name == METADATA_CHECKSUM_FILE
            || layout::blob_kind(name).is_some()
        {
            return Err(FormatError::Writer {
                reason: format!(
                    "{name:?} cannot be added: not a plain file name, or reserved for metadata.json/blobs"
                ),
            });
        }
        self.claim_name(name)?;
        let path = self.temp.join(name);
        let mut f = File::create_new(&path).map_err(|e| FormatError::io(&path, e))?;
        f.write_all(bytes).map_err(|e| FormatError::io(&path, e))?;
        Ok(())
    }

    fn claim_name(&mut self, name: &str) -> Result<(), FormatError> {
        if self.files.iter().any(|f| f == name) {
            return Err(FormatError::Writer {
                reason: format!("{name} was already written"),
            });
        }
        self.files.push(name.to_string());
        Ok(())
    }

    /// Waits for every blob write, writes metadata.json, validates the directory as
    /// [`Model::open`] would, syncs every file and the directory, and renames it to `out`. On
    /// error nothing appears at `out`.
    pub fn finish(
        mut self,
        config: ModelConfig,
        tokenizer: &str,
        chat_template: Option<ChatTemplateRef>,
        source: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Model, FormatError> {
        let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
        let started = std::time::Instant::now();
        self.pipeline.drain()?;
        tracing::debug!("blob writes completed after {:.1} ms", ms(started));
        let started = std::time::Instant::now();
        let n_layers = config.n_layers;
        let mut blobs = std::mem::take(&mut self.blobs);
        blobs.sort_by_key(|b| layout::blob_kind(&b.file).map(|k| blob_sort_key(k, n_layers)));
        let mut metadata = Metadata {
            format_version: FORMAT_VERSION,
            config,
            blobs,
            tokenizer: tokenizer.to_string(),
            chat_template,
            source,
        };
        metadata.format_version = metadata.required_version();
        let mut json =
            serde_json::to_string_pretty(&metadata).map_err(|e| FormatError::Writer {
                reason: format!("cannot serialize metadata.json: {e}"),
            })?;
        json.push('\n');
        let meta_path = self.temp.join(METADATA_FILE);
        std::fs::write(&meta_path, &json).map_err(|e| FormatError::io(&meta_path, e))?;
        let sum_path = self.temp.join(METADATA_CHECKSUM_FILE);
        let sum = format!(
            "xxh3:{:016x}\n",
            xxhash_rust::xxh3::xxh3_64(json.as_bytes())
        );
        std::fs::write(&sum_path, sum).map_err(|e| FormatError::io(&sum_path, e))?;

        tracing::debug!("metadata.json written in {:.1} ms", ms(started));
        let started = std::time::Instant::now();
        let staged = Model::open(&self.temp)?;
        tracing::debug!("staged model validated in {:.1} ms", ms(started));
        let started = std::time::Instant::now();

        let paths: Vec<PathBuf> = self
            .files
            .iter()
            .map(String::as_str)
            .chain([METADATA_FILE, METADATA_CHECKSUM_FILE])
            .map(|name| self.temp.join(name))
            .collect();
        sync_files(&paths)?;
        sync_dir(&self.temp)?;
        tracing::debug!("{} files synced in {:.1} ms", paths.len(), ms(started));
        let started = std::time::Instant::now();
        // rename(2) silently replaces an empty directory; refuse that as `create` did.
        if self.out.symlink_metadata().is_ok() {
            return Err(FormatError::OutputExists {
                path: self.out.clone(),
            });
        }
        std::fs::rename(&self.temp, &self.out).map_err(|e| FormatError::io(&self.out, e))?;
        self.finished = true;
        let parent = self.temp.parent().unwrap_or(Path::new("."));
        sync_dir(parent)?;
        tracing::debug!("renamed into place in {:.1} ms", ms(started));
        Ok(staged.moved_to(self.out.clone()))
    }
}

fn blob_sort_key(kind: BlobKind, n_layers: u32) -> (u8, usize) {
    match kind {
        BlobKind::Embed => (0, 0),
        BlobKind::Layer(i) => (1, i),
        BlobKind::Output => (2, n_layers as usize),
    }
}

/// fsyncs every file. One at a time, a model of ~30 small blobs spends most of its conversion
/// waiting on the disk's flush latency; issued from several threads the flushes overlap.
fn sync_files(paths: &[PathBuf]) -> Result<(), FormatError> {
    const SYNC_THREADS: usize = 8;
    let per_thread = paths.len().div_ceil(SYNC_THREADS).max(1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = paths
            .chunks(per_thread)
            .map(|chunk| {
                scope.spawn(move || {
                    for path in chunk {
                        File::open(path)
                            .and_then(|f| f.sync_all())
                            .map_err(|e| FormatError::io(path, e))?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| {
            w.join().unwrap_or_else(|_| {
                Err(FormatError::Writer {
                    reason: "a file-sync thread panicked".into(),
                })
            })
        })
    })
}

fn sync_dir(dir: &Path) -> Result<(), FormatError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| FormatError::io(dir, e))
}

impl Drop for ModelWriter {
    fn drop(&mut self) {
        if self.finished {
            // Every write completed in finish(): the idle thread exits on its own.
            self.pipeline.jobs = None;
        } else {
            // No write may land after the directory is gone.
            self.pipeline.shut_down();
            let _ = std::fs::remove_dir_all(&self.temp);
        }
    }
}

/// Writes one blob file. Each tensor starts at the next multiple of [`ALIGNMENT`]; the file is
/// zero-padded to a multiple of it. Dropped without [`BlobWriter::finish`], the file is removed
/// and the blob is not recorded.
pub struct BlobWriter<'m> {
    model: &'m mut ModelWriter,
    file: String,
    path: PathBuf,
    handle: BlobSink,
    hasher: Xxh3,
    pos: u64,
    tensors: Vec<TensorMeta>,
    /// Set once a tensor went wrong; the blob can then only be dropped.
    poisoned: Option<String>,
    done: bool,
}

impl<'m> BlobWriter<'m> {
    /// The blob's file name.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// Bytes written so far, padding included.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Writes a whole tensor. `data` must be exactly `dtype.byte_len(shape)` bytes.
    pub fn write_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        data: &[u8],
    ) -> Result<(), FormatError> {
        let mut t = self.begin_tensor(name, dtype, shape)?;
        t.write_bytes(data)?;
        t.finish()
    }

    /// Starts a tensor whose bytes are then handed over in pieces with
    /// [`TensorWriter::write_bytes`]; [`TensorWriter::finish`] checks that exactly
    /// `dtype.byte_len(shape)` bytes arrived.
    pub fn begin_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
    ) -> Result<TensorWriter<'_, 'm>, FormatError> {
        self.check_usable()?;
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(self.tensor_error(name, "written twice".into()));
        }
        let length = dtype.byte_len(shape).ok_or_else(|| {
            self.tensor_error(
                name,
                format!("shape {shape:?} is not a whole number of {dtype} blocks, or too large"),
            )
        })?;
        self.pad_to_alignment()?;
        Ok(TensorWriter {
            offset: self.pos,
            blob: self,
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            length,
            written: 0,
            finished: false,
        })
    }

    /// Pads the file, records the blob (length, checksum, tensors) in the model being written.
    pub fn finish(mut self) -> Result<(), FormatError> {
        self.check_usable()?;
        self.pad_to_alignment()?;
        if let Err(e) = self.handle.flush(&mut self.model.pipeline) {
            self.poisoned = Some(format!("write failed: {e}"));
            return Err(e);
        }
        let checksum = format!("xxh3:{:016x}", self.hasher.digest());
        self.model.blobs.push(BlobMeta {
            file: self.file.clone(),
            length: self.pos,
            checksum,
            tensors: std::mem::take(&mut self.tensors),
        });
        self.done = true;
        Ok(())
    }

    fn check_usable(&self) -> Result<(), FormatError> {
        match &self.poisoned {
            Some(why) => Err(FormatError::Writer {
                reason: format!("{}: unusable after an earlier error: {why}", self.file),
            }),
            None => Ok(()),
        }
    }

    fn tensor_error(&self, tensor: &str, reason: String) -> FormatError {
        FormatError::TensorWrite {
            blob: self.file.clone(),
            tensor: tensor.to_string(),
            reason,
        }
    }

    fn write_raw(&mut self, mut data: &[u8]) -> Result<(), FormatError> {
        while !data.is_empty() {
            let n = self.fill_raw(data.len() as u64, |piece: &mut [u8]| {
                piece.copy_from_slice(&data[..piece.len()]);
                Ok::<(), FormatError>(())
            })?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Lets `fill` write up to `len` bytes straight into the staging buffer, hashes them and
    /// hands a full buffer to the write thread. Returns how many bytes were filled.
    fn fill_raw<E: From<FormatError>>(
        &mut self,
        len: u64,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<usize, E> {
        let piece = match self.handle.space(&mut self.model.pipeline, len) {
            Ok(piece) => piece,
            Err(e) => {
                self.poisoned = Some(format!("write failed: {e}"));
                return Err(e.into());
            }
        };
        if let Err(e) = fill(piece) {
            self.poisoned = Some("filling a tensor failed".into());
            return Err(e);
        }
        self.hasher.update(piece);
        let n = piece.len();
        self.pos += n as u64;
        if let Err(e) = self.handle.commit(&mut self.model.pipeline, n) {
            self.poisoned = Some(format!("write failed: {e}"));
            return Err(e.into());
        }
        Ok(n)
    }

    fn pad_to_alignment(&mut self) -> Result<(), FormatError> {
        let rem = self.pos % ALIGNMENT;
        if rem != 0 {
            self.write_raw(&ZEROS[..(ALIGNMENT - rem) as usize])?;
        }
        Ok(())
    }
}

/// Bytes per disk write, a multiple of [`ALIGNMENT`]. With writes overlapping the reads, 2 MiB
/// keeps the disk as busy as 8 MiB did, starts it sooner and touches less fresh memory.
const CHUNK: usize = 2 << 20;
/// Staging buffers: one being filled while the others wait for or are in a disk write.
const STAGES: usize = 4;

/// A [`CHUNK`]-byte buffer starting at a 4 KiB boundary, as O_DIRECT requires.
struct Stage {
    buf: Vec<u8>,
    start: usize,
}

impl Stage {
    fn new() -> Stage {
        let align = ALIGNMENT as usize;
        let buf = vec![0u8; CHUNK + align];
        let start = (align - buf.as_ptr() as usize % align) % align;
        Stage { buf, start }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + CHUNK]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + CHUNK]
    }
}

/// One staged piece of a blob on its way to the disk.
struct WriteJob {
    file: Arc<File>,
    path: Arc<Path>,
    offset: u64,
    len: usize,
    stage: Stage,
}

/// What the write thread hands back: the buffer, free again, and how its write went.
struct WriteDone {
    stage: Stage,
    result: Result<(), (Arc<Path>, std::io::Error)>,
    /// How long the write took.
    busy: std::time::Duration,
}

/// The blob write thread and the staging buffers shared by all blobs of a model. Writes are
/// done in submission order; errors come back with the buffers and are reported by the next
/// call, and at the latest by [`WritePipeline::drain`] in [`ModelWriter::finish`].
#[derive(Default)]
struct WritePipeline {
    jobs: Option<mpsc::Sender<WriteJob>>,
    done: Option<mpsc::Receiver<WriteDone>>,
    thread: Option<std::thread::JoinHandle<()>>,
    free: Vec<Stage>,
    allocated: usize,
    in_flight: usize,
    /// For the debug log: writes done, time spent in them, and time the producer waited for
    /// a free buffer (high when the disk is the bottleneck).
    writes: usize,
    write_busy: std::time::Duration,
    waited: std::time::Duration,
    /// The first failed write, reported once in full and then by name.
    failed: Option<String>,
    unreported: Option<FormatError>,
}

impl std::fmt::Debug for WritePipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WritePipeline")
            .field("allocated", &self.allocated)
            .field("in_flight", &self.in_flight)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl WritePipeline {
    /// A free staging buffer, waiting for a write to complete if all are in use.
    fn stage(&mut self) -> Result<Stage, FormatError> {
        self.check()?;
        if let Some(stage) = self.free.pop() {
            return Ok(stage);
        }
        if self.allocated < STAGES || self.in_flight == 0 {
            self.allocated += 1;
            return Ok(Stage::new());
        }
        let started = std::time::Instant::now();
        self.wait_one()?;
        self.waited += started.elapsed();
        self.check()?;
        Ok(self.free.pop().expect("a completed write frees its buffer"))
    }

    /// Queues `len` bytes of `stage` to be written at `offset` of `file`.
    fn submit(
        &mut self,
        file: &Arc<File>,
        path: &Arc<Path>,
        offset: u64,
        len: usize,
        stage: Stage,
    ) -> Result<(), FormatError> {
        if self.jobs.is_none() {
            let (jobs, job_rx) = mpsc::channel::<WriteJob>();
            let (done_tx, done) = mpsc::channel();
            let thread = std::thread::Builder::new()
                .name("blob-writer".into())
                .spawn(move || {
                    for job in job_rx {
                        let started = std::time::Instant::now();
                        let result = job
                            .file
                            .write_all_at(&job.stage.bytes()[..job.len], job.offset)
                            .map_err(|e| (job.path, e));
                        let busy = started.elapsed();
                        if done_tx
                            .send(WriteDone {
                                stage: job.stage,
                                result,
                                busy,
                            })
                            .is_err()
                        {
                            break;
                        }
                    }
                })
                .map_err(|e| FormatError::Writer {
                    reason: format!("cannot start the blob write thread: {e}"),
                })?;
            self.jobs = Some(jobs);
            self.done = Some(done);
            self.thread = Some(thread);
        }
        let job = WriteJob {
            file: Arc::clone(file),
            path: Arc::clone(path),
            offset,
            len,
            stage,
        };
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send(job).is_ok());
        if !sent {
            return Err(FormatError::Writer {
                reason: "the blob write thread stopped".into(),
            });
        }
        self.in_flight += 1;
        // Reap what has completed, so that an error shows up early.
        while let Some(done) = self.done.as_ref().and_then(|d| d.try_recv().ok()) {
            self.complete(done);
        }
        self.check()
    }

    fn wait_one(&mut self) -> Result<(), FormatError> {
        match self.done.as_ref().map(mpsc::Receiver::recv) {
            Some(Ok(done)) => {
                self.complete(done);
                Ok(())
            }
            _ => {
                self.in_flight = 0;
                Err(FormatError::Writer {
                    reason: "the blob write thread stopped".into(),
                })
            }
        }
    }

    fn complete(&mut self, done: WriteDone) {
        self.in_flight -= 1;
        self.writes += 1;
        self.write_busy += done.busy;
        self.free.push(done.stage);
        if let Err((path, e)) = done.result
            && self.failed.is_none()
        {
            self.failed = Some(format!("{}: {e}", path.display()));
            self.unreported = Some(FormatError::io(path.to_path_buf(), e));
        }
    }

    /// Fails if a write has failed.
    fn check(&mut self) -> Result<(), FormatError> {
        if let Some(e) = self.unreported.take() {
            return Err(e);
        }
        match &self.failed {
            Some(why) => Err(FormatError::Writer {
                reason: format!("an earlier blob write failed: {why}"),
            }),
            None => Ok(()),
        }
    }

    /// Waits for every queued write.
    fn drain(&mut self) -> Result<(), FormatError> {
        while self.in_flight > 0 {
            self.wait_one()?;
        }
        tracing::debug!(
            "{} blob writes took {:.1} ms; waited {:.1} ms for a free staging buffer",
            self.writes,
            self.write_busy.as_secs_f64() * 1e3,
            self.waited.as_secs_f64() * 1e3
        );
        self.check()
    }

    /// Stops the thread once the queued writes are done.
    fn shut_down(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Where a blob's bytes go: staging buffers written out in whole chunks with O_DIRECT by the
/// [`WritePipeline`]'s thread. Blobs are padded to 4 KiB and written once, front to back, so they
/// never need the page cache; writing through it costs a copy and then the kernel's writeback,
/// which measured well below `cp` for multi-GB models. Where the filesystem refuses O_DIRECT
/// (tmpfs, some overlays) the same chunks go through the page cache.
struct BlobSink {
    file: Arc<File>,
    path: Arc<Path>,
    stage: Option<Stage>,
    filled: usize,
    /// Where the staged bytes go in the file.
    offset: u64,
}

impl BlobSink {
    fn create(path: &Path) -> std::io::Result<BlobSink> {
        use std::os::unix::fs::OpenOptionsExt;
        let direct = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        let file = match direct {
            Ok(file) => file,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // Linux may create the file before refusing the flag.
                let _ = std::fs::remove_file(path);
                File::create_new(path)?
            }
            Err(e) => return Err(e),
        };
        Ok(BlobSink {
            file: Arc::new(file),
            path: Arc::from(path),
            stage: None,
            filled: 0,
            offset: 0,
        })
    }

    /// Free staging space for up to `len` more bytes (at least one byte, when `len > 0`).
    fn space(&mut self, pipeline: &mut WritePipeline, len: u64) -> Result<&mut [u8], FormatError> {
        if self.stage.is_none() {
            self.stage = Some(pipeline.stage()?);
        }
        let stage = self.stage.as_mut().expect("just set");
        let n = (CHUNK - self.filled).min(usize::try_from(len).unwrap_or(usize::MAX));
        Ok(&mut stage.bytes_mut()[self.filled..self.filled + n])
    }

    /// Marks `n` bytes of the space handed out by [`BlobSink::space`] as filled, and queues
    /// the buffer once it is full.
    fn commit(&mut self, pipeline: &mut WritePipeline, n: usize) -> Result<(), FormatError> {
        self.filled += n;
        if self.filled == CHUNK {
            self.flush(pipeline)?;
        }
        Ok(())
    }

    /// Queues what is staged. Called at chunk boundaries and once the blob is padded, so the
    /// length is always a multiple of [`ALIGNMENT`], as O_DIRECT requires.
    fn flush(&mut self, pipeline: &mut WritePipeline) -> Result<(), FormatError> {
        let Some(stage) = self.stage.take() else {
            return Ok(());
        };
        if self.filled == 0 {
            pipeline.free.push(stage);
            return Ok(());
        }
        let len = std::mem::take(&mut self.filled);
        let offset = self.offset;
        self.offset += len as u64;
        pipeline.submit(&self.file, &self.path, offset, len, stage)
    }

    /// Gives an unsubmitted buffer back to the pipeline.
    fn release(&mut self, pipeline: &mut WritePipeline) {
        if let Some(stage) = self.stage.take() {
            pipeline.free.push(stage);
        }
        self.filled = 0;
    }
}

impl Drop for BlobWriter<'_> {
    fn drop(&mut self) {
        self.handle.release(&mut self.model.pipeline);
        if !self.done {
            let _ = std::fs::remove_file(&self.path);
            // The name may be reused by a retry.
            self.model.files.retain(|f| *f != self.file);
        }
    }
}

/// One tensor being streamed into a blob. Also an [`std::io::Write`], so `std::io::copy` from a
/// reader works. Dropped without [`TensorWriter::finish`], it makes the blob unusable.
pub struct TensorWriter<'b, 'm> {
    blob: &'b mut BlobWriter<'m>,
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    offset: u64,
    length: u64,
    written: u64,
    finished: bool,
}

impl TensorWriter<'_, '_> {
    /// Bytes this tensor still expects.
    pub fn remaining(&self) -> u64 {
        self.length - self.written
    }

    /// Appends bytes; more than the tensor's length is an error.
    pub fn write_bytes(&mut self, data: &[u8]) -> Result<(), FormatError> {
        if data.len() as u64 > self.remaining() {
            let reason = format!(
                "{} bytes would exceed its length {} ({} already written)",
                data.len(),
                self.length,
                self.written
            );
            self.blob.poisoned = Some(format!("tensor {}: {reason}", self.name));
            return Err(self.blob.tensor_error(&self.name, reason));
        }
        self.blob.write_raw(data)?;
        self.written += data.len() as u64;
        Ok(())
    }

    /// Produces the rest of the tensor in place: `fill` is handed successive pieces of the
    /// staging buffer (at most 2 MiB each, in order) and must fill each one completely, for
    /// example with a positioned read from the source file, so the bytes are not copied again.
    /// An error from `fill` makes the blob unusable and is returned as it is.
    pub fn fill_with<E: From<FormatError>>(
        &mut self,
        mut fill: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        self.blob.check_usable()?;
        while self.remaining() > 0 {
            let n = self.blob.fill_raw(self.remaining(), &mut fill)?;
            self.written += n as u64;
        }
        Ok(())
    }

    /// Checks the byte count and records the tensor in the blob.
    pub fn finish(mut self) -> Result<(), FormatError> {
        self.finished = true;
        if self.written != self.length {
            let reason = format!(
                "got {} bytes, {} {:?} needs {}",
                self.written, self.dtype, self.shape, self.length
            );
            self.blob.poisoned = Some(format!("tensor {}: {reason}", self.name));
            return Err(self.blob.tensor_error(&self.name, reason));
        }
        self.blob.tensors.push(TensorMeta {
            name: std::mem::take(&mut self.name),
            dtype: self.dtype,
            shape: std::mem::take(&mut self.shape),
            offset: self.offset,
            length: self.length,
        });
        Ok(())
    }
}

impl std::fmt::Debug for BlobWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobWriter")
            .field("file", &self.file)
            .field("pos", &self.pos)
            .field("tensors", &self.tensors)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for TensorWriter<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorWriter")
            .field("blob", &self.blob.file)
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("offset", &self.offset)
            .field("length", &self.length)
            .field("written", &self.written)
            .finish()
    }
}

impl Write for TensorWriter<'_, '_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_bytes(buf)
            .map(|()| buf.len())
            .map_err(std::io::Error::other)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for TensorWriter<'_, '_> {
    fn drop(&mut self) {
        if !self.finished && self.blob.poisoned.is_none() {
            self.blob.poisoned = Some(format!("tensor {} was not finished", self.name));
        }
    }
}
