//! Synthetic models: a given LLaMA shape with random weights, written straight into the GdsLLM
//! format. This is how benchmarks get 7B/13B/70B-sized models on machines where nothing can be
//! downloaded. The text such a model produces is meaningless; only its shape, size and
//! numerics (finite activations) are realistic.
//!
//! Speed: values come from a 65,536-entry table of normal quantiles indexed by 16-bit slices of
//! a xoshiro256++ stream (four values per `next_u64`), so generating is far cheaper than
//! writing. Chunks of rows are generated and quantized on every core while one thread writes
//! them in order; each chunk has its own seed, so the bytes depend only on `--seed`, never on
//! the thread count.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{Rng, SeedableRng};
use weights_format::layout::{self, TensorRole, TensorSpec};
use weights_format::{ChatTemplateRef, DType, FormatError, Model, ModelConfig, ModelWriter, quant};

/// Rows are grouped into chunks of about this many output bytes (at least one row).
const CHUNK_BYTES: u64 = 4 << 20;
/// Chunks each worker may have finished ahead of the writer.
const WORKER_DEPTH: usize = 2;
/// Standard deviation of every weight matrix and of the embedding (as in GPT-2/LLaMA init).
const MATRIX_STD: f32 = 0.02;

const TOKENIZER_FILE: &str = "tokenizer.json";
const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
/// Token ids of the special tokens of the synthetic tokenizer.
const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const BOS_ID: u32 = 1;
const EOS_ID: u32 = 2;
/// Specials plus one token per byte.
pub const MIN_VOCAB: u32 = SPECIAL_TOKENS.len() as u32 + 256;

/// Why a synthetic model could not be written.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown shape {0:?} (known: {known})", known = PRESETS.join(", "))]
    UnknownShape(String),
    #[error("invalid shape: {0}")]
    InvalidShape(String),
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// The preset names accepted by [`SynthShape::preset`].
pub const PRESETS: [&str; 4] = ["llama-7b", "llama-13b", "llama-70b", "smollm2-135m"];

/// The hyper-parameters a synthetic model is made from.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthShape {
    pub n_layers: u32,
    pub hidden_size: u32,
    pub ffn_dim: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub vocab_size: u32,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub context_length: u32,
    pub tie_word_embeddings: bool,
}

impl SynthShape {
    /// A LLaMA-style shape: `head_dim` = `hidden_size / n_heads`, RoPE θ 10,000, RMSNorm ε 1e-5,
    /// an untied LM head (set the fields after it for anything else).
    pub fn new(
        n_layers: u32,
        hidden_size: u32,
        ffn_dim: u32,
        n_heads: u32,
        n_kv_heads: u32,
        vocab_size: u32,
        context_length: u32,
    ) -> SynthShape {
        SynthShape {
            n_layers,
            hidden_size,
            ffn_dim,
            n_heads,
            n_kv_heads,
            head_dim: hidden_size / n_heads,
            vocab_size,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            context_length,
            tie_word_embeddings: false,
        }
    }

    /// One of [`PRESETS`] (case-insensitive).
    pub fn preset(name: &str) -> Result<SynthShape, SynthError> {
        #[allow(clippy::too_many_arguments)]
        fn shape(
            n_layers: u32,
            dim: u32,
            ffn: u32,
            heads: u32,
            kv: u32,
            vocab: u32,
            theta: f32,
            ctx: u32,
            tied: bool,
        ) -> SynthShape {
            SynthShape {
                rope_theta: theta,
                tie_word_embeddings: tied,
                ..SynthShape::new(n_layers, dim, ffn, heads, kv, vocab, ctx)
            }
        }
        Ok(match name.to_ascii_lowercase().as_str() {
            "llama-7b" => shape(32, 4096, 11008, 32, 32, 32000, 10000.0, 4096, false),
            "llama-13b" => shape(40, 5120, 13824, 40, 40, 32000, 10000.0, 4096, false),
            "llama-70b" => shape(80, 8192, 28672, 64, 8, 32000, 500000.0, 4096, false),
            "smollm2-135m" => shape(30, 576, 1536, 9, 3, 49152, 100000.0, 8192, true),
            _ => return Err(SynthError::UnknownShape(name.to_string())),
        })
    }

    /// The model config written into metadata.json.
    pub fn config(&self) -> ModelConfig {
        ModelConfig {
            n_layers: self.n_layers,
            hidden_size: self.hidden_size,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            ffn_dim: self.ffn_dim,
            vocab_size: self.vocab_size,
            rope_theta: self.rope_theta,
            rope_scaling: None,
            rms_norm_eps: self.rms_norm_eps,
            context_length: self.context_length,
            tie_word_embeddings: self.tie_word_embeddings,
            bos_token_id: Some(BOS_ID),
            eos_token_ids: vec![EOS_ID],
            add_bos_token: false,
            ..ModelConfig::default()
        }
    }

    fn check(&self, dtype: DType) -> Result<(), SynthError> {
        let bad = |m: String| Err(SynthError::InvalidShape(m));
        if self.vocab_size < MIN_VOCAB {
            return bad(format!(
                "vocab {} is below {MIN_VOCAB} (3 special tokens + 256 byte tokens)",
                self.vocab_size
            ));
        }
        for (what, v) in [
            ("layers", self.n_layers),
            ("dim", self.hidden_size),
            ("ffn", self.ffn_dim),
            ("heads", self.n_heads),
            ("kv-heads", self.n_kv_heads),
            ("head-dim", self.head_dim),
            ("context", self.context_length),
        ] {
            if v == 0 {
                return bad(format!("{what} must not be 0"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "kv-heads {} does not divide heads {}",
                self.n_kv_heads, self.n_heads
            ));
        }
        if !quant::can_quantize(dtype) {
            return bad(format!(
                "{dtype} has no encoder (it is only carried over from GGUF files)"
            ));
        }
        let q_width = u64::from(self.n_heads) * u64::from(self.head_dim);
        for (what, cols) in [
            ("dim", u64::from(self.hidden_size)),
            ("ffn", u64::from(self.ffn_dim)),
            ("heads*head-dim", q_width),
        ] {
            if let Some(why) = dtype.row_error(cols) {
                return bad(format!("{what} {cols}: {why}"));
            }
        }
        Ok(())
    }
}

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub shape: SynthShape,
    /// dtype of every matrix (embedding and LM head included); norms are f32, or f16/bf16
    /// when `dtype` is that.
    pub dtype: DType,
    pub seed: u64,
    /// Generator threads; 0 = one per core.
    pub threads: usize,
    /// Recorded in `metadata.json` `source.shape`.
    pub shape_name: String,
}

/// What was written.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SynthReport {
    pub dir: PathBuf,
    /// Bytes of all blob files.
    pub bytes: u64,
    pub seconds: f64,
    pub gb_per_s: f64,
}

struct Job {
    spec_index: usize,
    /// Rows `rows.start..rows.end` of the tensor.
    rows: std::ops::Range<u64>,
    seed: u64,
}

struct TensorPlan {
    blob: usize,
    spec: TensorSpec,
    dtype: DType,
    std: f32,
    /// Index into the scaled tables built by `synth` (one per distinct dtype and std).
    table: usize,
}

fn norm_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::Bf16 => dtype,
        _ => DType::F32,
    }
}

fn plan(opts: &SynthOptions) -> (Vec<String>, Vec<TensorPlan>) {
    let config = opts.shape.config();
    let files = layout::blob_files(config.n_layers);
    // Residual-branch outputs are scaled down by 1/sqrt(2·layers) (GPT-2) so the residual
    // stream's variance stays bounded however deep the model is.
    let residual_std = MATRIX_STD / (2.0 * config.n_layers as f32).sqrt();
    let mut tensors = Vec::new();
    for (blob, file) in files.iter().enumerate() {
        let kind = layout::blob_kind(file).expect("layout produced a canonical name");
        for spec in layout::blob_tensors(&config, kind) {
            let (dtype, std) = match spec.role {
                TensorRole::Norm | TensorRole::Bias => (norm_dtype(opts.dtype), 0.0),
                TensorRole::Matrix
                    if spec.name == weights_format::names::ATTN_OUTPUT
                        || spec.name == weights_format::names::FFN_DOWN =>
                {
                    (opts.dtype, residual_std)
                }
                TensorRole::Matrix => (opts.dtype, MATRIX_STD),
            };
            tensors.push(TensorPlan {
                blob,
                spec,
                dtype,
                std,
                table: 0,
            });
        }
    }
    (files, tensors)
}

fn row_bytes(t: &TensorPlan) -> u64 {
    let cols = *t.spec.shape.last().expect("tensors have a shape");
    t.dtype.byte_len(&[cols]).expect("checked: whole blocks")
}

fn rows(t: &TensorPlan) -> u64 {
    t.spec.shape[..t.spec.shape.len() - 1].iter().product()
}

/// Total bytes of the blob files `synth` will write (padding included), for progress bars.
pub fn synth_bytes(opts: &SynthOptions) -> Result<u64, SynthError> {
    opts.shape.check(opts.dtype)?;
    let (files, tensors) = plan(opts);
    let align = weights_format::ALIGNMENT;
    let mut total = 0;
    for blob in 0..files.len() {
        let mut pos = 0u64;
        for t in tensors.iter().filter(|t| t.blob == blob) {
            pos = pos.next_multiple_of(align) + rows(t) * row_bytes(t);
        }
        total += pos.next_multiple_of(align);
    }
    Ok(total)
}

/// Writes a synthetic model at `out` (which must not exist). `progress` gets each number of
/// bytes as it is written.
pub fn synth(
    out: &Path,
    opts: &SynthOptions,
    progress: &mut dyn FnMut(u64),
) -> Result<SynthReport, SynthError> {
    opts.shape.check(opts.dtype)?;
    let start = Instant::now();
    let (files, tensors) = plan(opts);
    let jobs = jobs(opts.seed, &tensors);
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let (tensors, tables) = scaled_tables(tensors);

    let mut writer = ModelWriter::create(out)?;
    let written = std::thread::scope(|s| -> Result<u64, SynthError> {
        let mut results = Vec::with_capacity(threads);
        let mut recycle = Vec::with_capacity(threads);
        for worker in 0..threads {
            let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(WORKER_DEPTH);
            let (back_tx, back_rx) = mpsc::channel::<Vec<u8>>();
            results.push(rx);
            recycle.push(back_tx);
            let (jobs, tensors, tables) = (&jobs, &tensors, &tables);
            s.spawn(move || {
                for job in jobs.iter().skip(worker).step_by(threads) {
                    let mut buf = back_rx.try_recv().unwrap_or_default();
                    generate(&tensors[job.spec_index], job, tables, &mut buf);
                    if tx.send(buf).is_err() {
                        return; // the writer stopped on an error
                    }
                }
            });
        }

        let mut written = 0u64;
        let mut next_job = 0usize;
        for (blob_index, file) in files.iter().enumerate() {
            let mut blob = writer.begin_blob(file)?;
            for (spec_index, t) in tensors.iter().enumerate() {
                if t.blob != blob_index {
                    continue;
                }
                let before = blob.position();
                let mut tw = blob.begin_tensor(t.spec.name, t.dtype, &t.spec.shape)?;
                while next_job < jobs.len() && jobs[next_job].spec_index == spec_index {
                    let worker = next_job % threads;
                    let buf = results[worker]
                        .recv()
                        .expect("a worker only stops early when the writer has gone");
                    tw.write_bytes(&buf)?;
                    let _ = recycle[worker].send(buf);
                    next_job += 1;
                }
                tw.finish()?;
                let now = blob.position();
                progress(now - before);
                written += now - before;
            }
            let before = blob.position();
            blob.finish()?;
            // Trailing padding: recompute what finish added.
            let padded = before.next_multiple_of(weights_format::ALIGNMENT);
            progress(padded - before);
            written += padded - before;
        }
        Ok(written)
    })?;

    writer.add_file(
        TOKENIZER_FILE,
        tokenizer_json(opts.shape.vocab_size).as_bytes(),
    )?;
    writer.add_file(CHAT_TEMPLATE_FILE, CHAT_TEMPLATE.as_bytes())?;
    let mut source = serde_json::Map::new();
    source.insert("generator".into(), "gdsllm synth".into());
    source.insert("shape".into(), opts.shape_name.clone().into());
    source.insert("dtype".into(), opts.dtype.name().into());
    source.insert("seed".into(), opts.seed.into());
    source.insert(
        "note".into(),
        "synthetic: random weights, meaningless output".into(),
    );
    let model: Model = writer.finish(
        opts.shape.config(),
        TOKENIZER_FILE,
        Some(ChatTemplateRef {
            file: CHAT_TEMPLATE_FILE.into(),
        }),
        source,
    )?;
    debug_assert_eq!(written, model.total_bytes());
    let seconds = start.elapsed().as_secs_f64();
    Ok(SynthReport {
        dir: out.to_path_buf(),
        bytes: model.total_bytes(),
        seconds,
        gb_per_s: model.total_bytes() as f64 / seconds.max(1e-9) / 1e9,
    })
}

/// Builds one scaled table per distinct (dtype, std) of the random tensors.
fn scaled_tables(mut tensors: Vec<TensorPlan>) -> (Vec<TensorPlan>, Vec<ScaledTable>) {
    let normal = NormalTable::new();
    let mut keys: Vec<(DType, u32)> = Vec::new();
    let mut tables = Vec::new();
    for t in tensors
        .iter_mut()
        .filter(|t| t.spec.role == TensorRole::Matrix)
    {
        let key = (t.dtype, t.std.to_bits());
        t.table = match keys.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                keys.push(key);
                tables.push(ScaledTable::new(&normal, t.dtype, t.std));
                tables.len() - 1
            }
        };
    }
    (tensors, tables)
}

/// Splits every tensor into chunks of whole rows, in write order, each with its own seed.
fn jobs(seed: u64, tensors: &[TensorPlan]) -> Vec<Job> {
    let mut jobs = Vec::new();
    for (spec_index, t) in tensors.iter().enumerate() {
        let rows_per_chunk = (CHUNK_BYTES / row_bytes(t)).max(1);
        let n_rows = rows(t);
        let mut r = 0;
        while r < n_rows {
            let end = (r + rows_per_chunk).min(n_rows);
            jobs.push(Job {
                spec_index,
                rows: r..end,
                seed: splitmix(seed ^ splitmix(((spec_index as u64) << 32) | (r / rows_per_chunk))),
            });
            r = end;
        }
    }
    jobs
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `buf` with the bytes of `job`'s rows.
fn generate(t: &TensorPlan, job: &Job, tables: &[ScaledTable], buf: &mut Vec<u8>) {
    let cols = *t.spec.shape.last().expect("tensors have a shape") as usize;
    let n_rows = (job.rows.end - job.rows.start) as usize;
    let n = n_rows * cols;
    buf.clear();
    if t.spec.role == TensorRole::Bias {
        // Synthetic models are llama-shaped and have none; a zero bias would be the neutral one.
        buf.resize(n * t.dtype.byte_len(&[1]).unwrap_or(4) as usize, 0);
        return;
    }
    if t.spec.role == TensorRole::Norm {
        let one = match t.dtype {
            DType::F16 => half::f16::ONE.to_le_bytes().to_vec(),
            DType::Bf16 => half::bf16::ONE.to_le_bytes().to_vec(),
            _ => 1f32.to_le_bytes().to_vec(),
        };
        for _ in 0..n {
            buf.extend_from_slice(&one);
        }
        return;
    }
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(job.seed);
    match &tables[t.table] {
        ScaledTable::Bytes4(table) => {
            buf.resize(n * 4, 0);
            fill_from_table(&mut rng, buf, table);
        }
        ScaledTable::Bytes2(table) => {
            buf.resize(n * 2, 0);
            fill_from_table(&mut rng, buf, table);
        }
        ScaledTable::Floats(scaled) => {
            buf.reserve(n / t.dtype.block_len() * t.dtype.block_bytes());
            let mut block = [0u16; 32];
            let fast = matches!(t.dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1);
            // The other encodable dtypes (q5_0 … q6_k) through the reference quantizer, a
            // row at a time: slower, but synth runs on every core.
            let mut row = Vec::with_capacity(if fast { 0 } else { cols });
            for _ in 0..n / 32 {
                for quad in block.chunks_exact_mut(4) {
                    let x = rng.next_u64();
                    for (k, i) in quad.iter_mut().enumerate() {
                        *i = (x >> (16 * k)) as u16;
                    }
                }
                if fast {
                    quantize_block(t.dtype, &block, scaled, buf);
                    continue;
                }
                row.extend(block.iter().map(|&i| scaled[i as usize]));
                if row.len() == cols {
                    quant::quantize(t.dtype, &row, buf).expect("checked: whole blocks");
                    row.clear();
                }
            }
        }
    }
}

/// The normal table scaled to one tensor's std and encoded in its dtype, so that generating
/// a value is one lookup (plus a block quantization for quantized types).
enum ScaledTable {
    Bytes4(Vec<[u8; 4]>),
    Bytes2(Vec<[u8; 2]>),
    /// A fixed-size array, so a u16 index needs no bounds check.
    Floats(Box<[f32; 65536]>),
}

impl ScaledTable {
    fn new(normal: &NormalTable, dtype: DType, std: f32) -> ScaledTable {
        let scaled = normal.values.iter().map(|v| v * std);
        match dtype {
            DType::F32 => ScaledTable::Bytes4(scaled.map(f32::to_le_bytes).collect()),
            DType::F16 => ScaledTable::Bytes2(
                scaled
                    .map(|v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
            ),
            DType::Bf16 => ScaledTable::Bytes2(
                scaled
                    .map(|v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
            ),
            _ => {
                let table: Box<[f32; 65536]> = scaled
                    .collect::<Vec<f32>>()
                    .try_into()
                    .expect("the normal table has 65536 entries");
                ScaledTable::Floats(table)
            }
        }
    }
}

/// Fills `out` with table entries picked by uniform 16-bit indices, four per 64-bit draw.
fn fill_from_table<const W: usize>(
    rng: &mut Xoshiro256PlusPlus,
    out: &mut [u8],
    table: &[[u8; W]],
) {
    let pick = |x: u64, k: usize| &table[((x >> (16 * k)) & 0xFFFF) as usize];
    let mut quads = out.chunks_exact_mut(4 * W);
    for quad in &mut quads {
        let x = rng.next_u64();
        for (k, value) in quad.chunks_exact_mut(W).enumerate() {
            value.copy_from_slice(pick(x, k));
        }
    }
    let rest = quads.into_remainder();
    if !rest.is_empty() {
        let x = rng.next_u64();
        for (k, value) in rest.chunks_exact_mut(W).enumerate() {
            value.copy_from_slice(pick(x, k));
        }
    }
}

/// llama.cpp's reference quantizers for the block of values `scaled[idx[j]]`, bit-identical
/// to `weights_format::quant::quantize` (tested) but several times faster: `scaled` is sorted,
/// so the block's extremes come from the smallest and largest index (a vectorisable integer
/// min/max instead of a serial float fold), and rounding avoids calls to `roundf`.
fn quantize_block(dtype: DType, idx: &[u16; 32], scaled: &[f32; 65536], out: &mut Vec<u8>) {
    let x: [f32; 32] = std::array::from_fn(|j| scaled[idx[j] as usize]);
    let lo = scaled[*idx.iter().min().expect("32 values") as usize];
    let hi = scaled[*idx.iter().max().expect("32 values") as usize];
    let mut b = [0u8; 34];
    let len = match dtype {
        DType::Q8_0 => {
            let amax = lo.abs().max(hi.abs());
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            let mut q = [0i32; 32];
            for j in 0..32 {
                q[j] = round_half_away(x[j] * id);
            }
            for j in 0..32 {
                b[2 + j] = q[j] as i8 as u8;
            }
            34
        }
        DType::Q4_0 => {
            // The reference keeps the first value of largest magnitude; only a tie between
            // the two extremes needs the position.
            let max = if lo.abs() > hi.abs() {
                lo
            } else if hi.abs() > lo.abs() {
                hi
            } else {
                x.into_iter()
                    .find(|v| v.abs() == hi.abs())
                    .expect("hi is in the block")
            };
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            for j in 0..16 {
                let q0 = ((x[j] * id + 8.5) as i32).min(15) as u8;
                let q1 = ((x[j + 16] * id + 8.5) as i32).min(15) as u8;
                b[2 + j] = q0 | (q1 << 4);
            }
            18
        }
        DType::Q4_1 => {
            let (min, max) = (lo, hi);
            let d = (max - min) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            b[2..4].copy_from_slice(&half::f16::from_f32(min).to_le_bytes());
            for j in 0..16 {
                let q0 = (((x[j] - min) * id + 0.5) as i32).min(15) as u8;
                let q1 = (((x[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
                b[4 + j] = q0 | (q1 << 4);
            }
            20
        }
        _ => unreachable!("only called for q8_0, q4_0 and q4_1"),
    };
    out.extend_from_slice(&b[..len]);
}

/// `f32::round` (half away from zero) for |v| < 2^31, without a libm call: `v - trunc(v)` is
/// exact in floating point, so comparing it with ½ decides exactly as `round` does.
fn round_half_away(v: f32) -> i32 {
    let t = v as i32;
    let frac = v - t as f32;
    t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)
}

/// The 65,536 quantiles Φ⁻¹((i + ½)/65536) of the standard normal: a uniform 16-bit index
/// picks a value whose distribution is the normal discretised to 65,536 levels (tails cut at
/// ±4.2σ), which is all random weights need.
struct NormalTable {
    values: Vec<f32>,
}

impl NormalTable {
    fn new() -> NormalTable {
        let values = (0..65536)
            .map(|i| inverse_normal_cdf((i as f64 + 0.5) / 65536.0) as f32)
            .collect();
        NormalTable { values }
    }
}

/// Acklam's rational approximation of Φ⁻¹ (relative error < 1.2e-9 on (0, 1)).
#[allow(clippy::excessive_precision)] // the published coefficients, verbatim
fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e+01,
        2.209460984245205e+02,
        -2.759285104469687e+02,
        1.383577518672690e+02,
        -3.066479806614716e+01,
        2.506628277459239e+00,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e+01,
        1.615858368580409e+02,
        -1.556989798598866e+02,
        6.680131188771972e+01,
        -1.328068155288572e+01,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-03,
        -3.223964580411365e-01,
        -2.400758277161838e+00,
        -2.549732539343734e+00,
        4.374664141464968e+00,
        2.938163982698783e+00,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-03,
        3.224671290700398e-01,
        2.445134137142996e+00,
        3.754408661907416e+00,
    ];
    const P_LOW: f64 = 0.02425;
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < P_LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - P_LOW {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// GPT-2's map from bytes to printable characters, which byte-level BPE vocabularies use.
fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next_free = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next_free).expect("256..=323 are valid chars");
            next_free += 1;
            c
        };
    }
    map
}

/// A minimal Hugging Face `tokenizer.json` with `vocab` tokens: 3 specials (`<|endoftext|>`,
/// `<|im_start|>` = BOS, `<|im_end|>` = EOS), the 256 byte-level tokens, and filler "words"
/// (` aa`, ` ab`, …) up to `vocab`. Byte-level BPE without merges, so any text encodes (one
/// token per byte) and every id decodes.
pub fn tokenizer_json(vocab: u32) -> String {
    let bytes = byte_to_char();
    let mut tokens: Vec<String> = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    tokens.extend(bytes.iter().map(|c| c.to_string()));
    let space = bytes[b' ' as usize];
    let mut k = 0u64;
    while (tokens.len() as u32) < vocab {
        // Filler words of two or more lowercase letters; the leading byte-level space makes
        // decoded output read as words.
        let mut word = String::new();
        let mut x = k + 26; // skip the single letters
        while x > 0 {
            word.insert(0, char::from(b'a' + (x % 26) as u8));
            x /= 26;
        }
        tokens.push(format!("{space}{word}"));
        k += 1;
    }
    let vocab_map: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::Value::from(i)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, content)| {
            serde_json::json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            })
        })
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab_map,
            "merges": []
        }
    });
    serde_json::to_string_pretty(&tokenizer).expect("a json! value serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(dtype: DType, tied: bool) -> SynthOptions {
        SynthOptions {
            shape: SynthShape {
                n_layers: 3,
                hidden_size: 64,
                ffn_dim: 96,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 16,
                vocab_size: 300,
                rope_theta: 10000.0,
                rms_norm_eps: 1e-5,
                context_length: 128,
                tie_word_embeddings: tied,
            },
            dtype,
            seed: 7,
            threads: 3,
            shape_name: "custom".into(),
        }
    }

    #[test]
    fn presets_have_the_documented_shapes() {
        let s = SynthShape::preset("llama-70b").unwrap();
        assert_eq!(
            (
                s.n_layers,
                s.hidden_size,
                s.ffn_dim,
                s.n_heads,
                s.n_kv_heads,
                s.head_dim
            ),
            (80, 8192, 28672, 64, 8, 128)
        );
        let s = SynthShape::preset("SmolLM2-135M").unwrap();
        assert_eq!(
            (s.head_dim, s.vocab_size, s.tie_word_embeddings),
            (64, 49152, true)
        );
        // llama-7b f16 is the well-known ~13.5 GB.
        let opts = SynthOptions {
            shape: SynthShape::preset("llama-7b").unwrap(),
            ..tiny(DType::F16, false)
        };
        let gb = synth_bytes(&opts).unwrap() as f64 / 1e9;
        println!("llama-7b f16: {gb:.3} GB");
        assert!((13.4..13.6).contains(&gb), "{gb}");
        assert!(matches!(
            SynthShape::preset("gpt-5"),
            Err(SynthError::UnknownShape(_))
        ));
    }

    #[test]
    fn normal_table_has_unit_variance() {
        let t = NormalTable::new();
        let mean = t.values.iter().map(|&v| v as f64).sum::<f64>() / 65536.0;
        let var = t
            .values
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / 65536.0;
        println!(
            "table mean {mean:e}, variance {var} (tolerance 1e-3), max {}",
            t.values[65535]
        );
        assert!(mean.abs() < 1e-6);
        assert!((var - 1.0).abs() < 1e-3);
        assert!(t.values.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn k_quant_models_decode_to_the_values_they_were_made_from() {
        // dim 256 and ffn 512: rows of whole super-blocks. Each k-quant tensor must be the
        // reference encoding of normal values of its std (checked statistically: the decoded
        // matrix has the intended spread).
        for dtype in [DType::Q4K, DType::Q5K, DType::Q6K, DType::Q5_0, DType::Q5_1] {
            let tmp = tempfile::tempdir().unwrap();
            let mut opts = tiny(dtype, true);
            opts.shape.hidden_size = 256;
            opts.shape.ffn_dim = 512;
            opts.shape.head_dim = 64;
            synth(&tmp.path().join("m"), &opts, &mut |_| {}).unwrap();
            let model = Model::open(tmp.path().join("m")).unwrap();
            model.verify().unwrap();
            assert_eq!(model.metadata().format_version, 3);
            let t = model.tensor(1, weights_format::names::FFN_UP).unwrap();
            assert_eq!(t.dtype, dtype);
            let bytes = model.read_tensor(1, weights_format::names::FFN_UP).unwrap();
            let mut values = vec![0f32; 512 * 256];
            quant::dequantize(dtype, &bytes, &mut values).unwrap();
            let std = (values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32).sqrt();
            println!("{dtype}: decoded std {std} (made with {MATRIX_STD}; tolerance 10 %)");
            assert!((std / MATRIX_STD - 1.0).abs() < 0.1, "{dtype}: std {std}");
        }
        let mut opts = tiny(DType::Q4K, true);
        let err = synth_bytes(&opts).unwrap_err().to_string();
        assert!(err.contains("256-value super-blocks"), "{err}");
        opts.dtype = DType::Q3K;
        let err = synth_bytes(&opts).unwrap_err().to_string();
        assert!(err.contains("no encoder"), "{err}");
    }

    #[test]
    fn writes_a_valid_model_deterministically_for_any_thread_count() {
        for dtype in DType::ALL.into_iter().filter(|d| d.format_version() == 1) {
            let tmp = tempfile::tempdir().unwrap();
            let mut a_opts = tiny(dtype, dtype == DType::Q4_1);
            let expected = synth_bytes(&a_opts).unwrap();
            let mut seen = 0;
            let a = synth(&tmp.path().join("a"), &a_opts, &mut |n| seen += n).unwrap();
            assert_eq!(seen, expected);
            assert_eq!(a.bytes, expected);
            a_opts.threads = 1;
            synth(&tmp.path().join("b"), &a_opts, &mut |_| {}).unwrap();
            let model = Model::open(tmp.path().join("a")).unwrap();
            model.verify().unwrap();
            for entry in std::fs::read_dir(tmp.path().join("a")).unwrap() {
                let name = entry.unwrap().file_name();
                let x = std::fs::read(tmp.path().join("a").join(&name)).unwrap();
                let y = std::fs::read(tmp.path().join("b").join(&name)).unwrap();
                assert!(x == y, "{dtype}: {name:?} depends on the thread count");
            }
            // Different seed, different weights.
            a_opts.seed = 8;
            synth(&tmp.path().join("c"), &a_opts, &mut |_| {}).unwrap();
            assert_ne!(
                std::fs::read(tmp.path().join("a/layer_000.bin")).unwrap(),
                std::fs::read(tmp.path().join("c/layer_000.bin")).unwrap()
            );
        }
    }

    #[test]
    fn weights_have_the_intended_statistics() {
        let tmp = tempfile::tempdir().unwrap();
        let opts = tiny(DType::F32, false);
        synth(&tmp.path().join("m"), &opts, &mut |_| {}).unwrap();
        let model = Model::open(tmp.path().join("m")).unwrap();
        let floats = |blob, name| -> Vec<f32> {
            model
                .read_tensor(blob, name)
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let std = |v: &[f32]| {
            let m = v.iter().sum::<f32>() / v.len() as f32;
            (v.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / v.len() as f32).sqrt()
        };
        let q = floats(1, "attn_q");
        let down = floats(2, "ffn_down");
        let expected_down = MATRIX_STD / (2.0 * 3f32).sqrt();
        println!(
            "attn_q std {} (want 0.02), ffn_down std {} (want {expected_down}), tolerance 5%",
            std(&q),
            std(&down)
        );
        assert!((std(&q) / MATRIX_STD - 1.0).abs() < 0.05);
        assert!((std(&down) / expected_down - 1.0).abs() < 0.05);
        assert!(floats(3, "ffn_norm").iter().all(|&x| x == 1.0));
    }

    #[test]
    fn rejects_shapes_that_cannot_be_written() {
        let tmp = tempfile::tempdir().unwrap();
        let mut opts = tiny(DType::Q4_0, false);
        opts.shape.hidden_size = 48;
        opts.shape.head_dim = 12;
        let err = synth(&tmp.path().join("m"), &opts, &mut |_| {}).unwrap_err();
        assert!(
            err.to_string().contains("whole number of 32-value blocks"),
            "{err}"
        );
        let mut opts = tiny(DType::F16, false);
        opts.shape.vocab_size = 100;
        assert!(synth(&tmp.path().join("m"), &opts, &mut |_| {}).is_err());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn fast_block_quantizer_is_bit_identical_to_the_reference() {
        let table = NormalTable::new();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
        let mut blocks: Vec<[u16; 32]> = (0..5000)
            .map(|_| std::array::from_fn(|_| rng.next_u64() as u16))
            .collect();
        // Ties between the extremes (the table is symmetric: i and 65535 - i), in both orders,
        // and blocks of one repeated value.
        blocks.push(std::array::from_fn(|j| match j {
            3 => 100,
            20 => 65435,
            _ => 30000 + j as u16,
        }));
        blocks.push(std::array::from_fn(|j| match j {
            3 => 65435,
            20 => 100,
            _ => 30000 + j as u16,
        }));
        assert_eq!(
            table.values[100], -table.values[65435],
            "the tie cases need a symmetric table"
        );
        blocks.push([0; 32]);
        blocks.push([65535; 32]);
        blocks.push([32768; 32]);
        for std in [0.02f32, 1.0, 0.003] {
            let scaled: Box<[f32; 65536]> = table
                .values
                .iter()
                .map(|v| v * std)
                .collect::<Vec<f32>>()
                .try_into()
                .unwrap();
            for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
                for block in &blocks {
                    let values: Vec<f32> = block.iter().map(|&i| scaled[i as usize]).collect();
                    let (mut fast, mut reference) = (Vec::new(), Vec::new());
                    quantize_block(dtype, block, &scaled, &mut fast);
                    quant::quantize(dtype, &values, &mut reference).unwrap();
                    assert_eq!(fast, reference, "{dtype} std {std} {block:?}");
                }
            }
        }
        for v in [
            0.5f32,
            -0.5,
            1.5,
            -2.5,
            0.49999997,
            -0.49999997,
            126.5,
            3.0,
            -0.0,
            127.0,
        ] {
            assert_eq!(round_half_away(v), v.round() as i32, "{v}");
        }
    }

    #[test]
    fn tokenizer_loads_and_round_trips_text() {
        let json = tokenizer_json(1000);
        let tok = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
        assert_eq!(tok.get_vocab_size(true), 1000);
        let text = "Hello, wörld! <|im_start|>user\n12";
        let enc = tok.encode(text, false).unwrap();
        assert!(enc.get_ids().contains(&BOS_ID));
        let dec = tok.decode(enc.get_ids(), false).unwrap();
        assert_eq!(dec, text);
        // Every id decodes, fillers to words.
        let all: Vec<u32> = (0..1000).collect();
        let dec = tok.decode(&all[990..], true).unwrap();
        println!("fillers decode to {dec:?}");
        assert!(dec.starts_with(' ') && dec.chars().all(|c| c == ' ' || c.is_ascii_lowercase()));
    }
}
