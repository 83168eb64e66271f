//! Opening a model directory for generation, on the CPU or a CUDA GPU: [`open`] is the one way
//! the CLI, the server and the tests get a model from a directory. It reads the metadata,
//! tokenizer and chat template, sizes what the device must hold besides the weights (KV
//! caches, activations), plans residency (the only way weights reach a backend) and builds the
//! model; `--device auto` is decided here too.
//!
//! This is the top of the crate: it may use everything below (backends, model, generation,
//! batching); nothing below uses it.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use residency::{IoChoice, Residency, ResidencyOptions};
use weights_format::{Metadata, Model};

use crate::LlamaError;
#[cfg(feature = "cuda")]
use crate::backend::cuda::{CudaBackend, CudaWeights, DeviceWeights};
use crate::backend::{Backend, CpuBackend};
use crate::batch::DEFAULT_PREFILL_CHUNK;
use crate::chat::{ChatTemplate, Message};
use crate::config::LlamaConfig;
use crate::generate::Session;
use crate::model::Llama;
use crate::tokenizer::Tokenizer;
use crate::weights::WeightSource;

/// Where a model computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// CUDA device `ordinal` when it is usable (driver, NVRTC and the device), else the CPU,
    /// with a log line saying why.
    Auto {
        ordinal: usize,
    },
    Cpu,
    /// CUDA device `ordinal`; an error when it is not usable.
    Cuda {
        ordinal: usize,
    },
}

/// How to open a model.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// The memory budget and what to keep resident. `reserved_bytes` is ignored: [`open`]
    /// reserves what the device needs besides the weights itself.
    pub residency: ResidencyOptions,
    /// KV-cache positions per sequence; 0: the model's context length.
    pub context: usize,
    /// Sequences decoded together (1: one at a time); sizes the passes and the KV caches.
    pub sequences: usize,
    /// Bytes of KV cache the sequences may hold together; `None`: `sequences` caches of the
    /// whole context. (The CUDA loader reserves `sequences` whole caches regardless.)
    pub kv_budget: Option<u64>,
    /// How blobs reach GPU memory (auto: cuFile where GDS DMA works, else O_DIRECT through a
    /// pinned staging buffer).
    pub io: IoChoice,
    /// The CPU backend's exact mode: f32 activations for q4_0/q4_1/q8_0 decode rows instead of
    /// 8-bit ones (slower; see `backend::cpu`).
    pub cpu_exact: bool,
    /// On a GPU: `Some` (`--placement auto`) has the CPU compute a share of the matmuls of the
    /// layers streamed from the host tier ([`crate::hybrid`]); `None` (`--placement gpu`)
    /// computes everything on the GPU.
    pub hybrid: Option<crate::hybrid::HybridOptions>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            residency: ResidencyOptions::default(),
            context: 0,
            sequences: 1,
            kv_budget: None,
            io: IoChoice::Auto,
            cpu_exact: false,
            hybrid: None,
        }
    }
}

/// A model ready to generate on backend `B` with weights from `W`.
pub struct LoadedModel<B: Backend, W: WeightSource> {
    pub session: Session<B, W>,
    pub chat_template: Option<ChatTemplate>,
    /// Text of the BOS and EOS tokens, for the chat template.
    pub bos_token: String,
    pub eos_token: String,
    /// How blobs are read: `host` (O_DIRECT into host memory) or the `gds-io` backend that
    /// fills GPU memory.
    pub io: String,
    /// Seconds spent opening the directory, planning residency and reading the tokenizer.
    pub load_seconds: f64,
}

/// A model on the CPU backend, weights through residency in host memory (shared, so that its
/// statistics can be read while the model is busy).
pub type CpuModel = LoadedModel<CpuBackend, Arc<Residency>>;

/// A model on a CUDA GPU, weights through residency in device memory.
#[cfg(feature = "cuda")]
pub type CudaModel = LoadedModel<CudaBackend, CudaWeights>;

/// What [`open`] opened.
pub enum OpenedModel {
    Cpu(Box<CpuModel>),
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaModel>),
    /// On a GPU with the CPU computing a share of the streamed layers' matmuls
    /// (`--placement auto`).
    #[cfg(feature = "cuda")]
    Hybrid(Box<crate::hybrid::cuda::HybridModel>),
}

impl OpenedModel {
    /// The model, when it is on the CPU.
    pub fn into_cpu(self) -> Option<CpuModel> {
        match self {
            OpenedModel::Cpu(m) => Some(*m),
            #[cfg(feature = "cuda")]
            OpenedModel::Cuda(_) | OpenedModel::Hybrid(_) => None,
        }
    }

    /// The model, when it is on a GPU.
    #[cfg(feature = "cuda")]
    pub fn into_cuda(self) -> Option<CudaModel> {
        match self {
            OpenedModel::Cuda(m) => Some(*m),
            OpenedModel::Cpu(_) | OpenedModel::Hybrid(_) => None,
        }
    }

    /// The model, when it is split between a GPU and the CPU.
    #[cfg(feature = "cuda")]
    pub fn into_hybrid(self) -> Option<crate::hybrid::cuda::HybridModel> {
        match self {
            OpenedModel::Hybrid(m) => Some(*m),
            OpenedModel::Cpu(_) | OpenedModel::Cuda(_) => None,
        }
    }
}

/// Most positions one forward pass computes on the GPU: longer prompts take several passes.
/// Bounds the activation buffers (a 7B model needs ~70 KiB per position) without costing
/// prefill speed (512 rows already fill the matmul kernels).
pub const GPU_MAX_ROWS: usize = 512;

/// Opens the model directory `dir` on `device`.
pub fn open(
    dir: impl AsRef<Path>,
    device: Device,
    options: &OpenOptions,
) -> Result<OpenedModel, LlamaError> {
    let started = Instant::now();
    let files = ModelFiles::open(dir.as_ref())?;
    let sizes = Sizes {
        context: files.context(options.context),
        sequences: options.sequences.max(1),
    };
    match device {
        Device::Cpu => open_cpu(files, sizes, options, started),
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal } => {
            open_cuda(files, CudaBackend::new(ordinal)?, sizes, options, started)
        }
        #[cfg(feature = "cuda")]
        Device::Auto { ordinal } => match CudaBackend::new(ordinal) {
            Ok(backend) => open_cuda(files, backend, sizes, options, started),
            Err(e) => {
                tracing::info!(
                    "--device auto: computing on the CPU because CUDA is not usable: {e}"
                );
                open_cpu(files, sizes, options, started)
            }
        },
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { ordinal } => Err(LlamaError::Device {
            message: format!(
                "CUDA device {ordinal}: this build has no CUDA backend (feature `cuda`)"
            ),
        }),
        #[cfg(not(feature = "cuda"))]
        Device::Auto { .. } => {
            tracing::info!("--device auto: computing on the CPU (this build has no CUDA backend)");
            open_cpu(files, sizes, options, started)
        }
    }
}

/// KV positions per sequence and sequences decoded together.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    context: usize,
    sequences: usize,
}

/// Residency reserves `reserved_bytes` of its budget for what is not weights.
fn reserving(options: &OpenOptions, reserved_bytes: u64) -> ResidencyOptions {
    ResidencyOptions {
        reserved_bytes,
        ..options.residency.clone()
    }
}

/// The CPU's KV caches are f32; a pass holds the whole prompt of one sequence, and for a batch
/// also a row per sequence plus a prefill chunk.
fn open_cpu(
    files: ModelFiles,
    Sizes { context, sequences }: Sizes,
    options: &OpenOptions,
    started: Instant,
) -> Result<OpenedModel, LlamaError> {
    let kv = options.kv_budget.unwrap_or_else(|| {
        residency::kv_cache_bytes(&files.metadata.config, context as u64, 4) * sequences as u64
    });
    let residency = Residency::open_host(&files.model, &reserving(options, kv))?;
    let max_rows = if sequences > 1 {
        context.max(sequences + DEFAULT_PREFILL_CHUNK)
    } else {
        context
    };
    let llama = Llama::new(
        CpuBackend::with_exact(options.cpu_exact),
        Arc::new(residency),
        files.metadata.clone(),
        context,
        max_rows,
    )?;
    Ok(OpenedModel::Cpu(Box::new(files.finish(
        llama,
        "host".into(),
        started,
    ))))
}

/// Bytes of device memory the f16 KV caches of `sequences` sequences of `context` positions,
/// the activation buffers of `max_rows` positions (f32) and a margin for kernels and
/// temporaries take besides the weights.
pub fn device_reserved_bytes(
    model: &weights_format::ModelConfig,
    context: usize,
    sequences: usize,
    max_rows: usize,
) -> Result<u64, LlamaError> {
    let c = LlamaConfig::from_model_config(model)?;
    let kv = residency::kv_cache_bytes(model, context as u64, 2) * sequences as u64;
    let per_row = 3 * c.dim + 2 * c.q_dim() + 2 * c.kv_dim() + 2 * c.ffn_dim;
    let activations = ((max_rows * per_row + 2 * c.dim + c.vocab_size) * 4) as u64;
    let margin = 256 << 20;
    Ok(kv + activations + margin)
}

/// Rows of a pass on the GPU: up to [`GPU_MAX_ROWS`] prompt positions, or for a batch a row
/// per sequence plus a prefill chunk.
fn gpu_max_rows(context: usize, sequences: usize) -> usize {
    if sequences > 1 {
        sequences + DEFAULT_PREFILL_CHUNK
    } else {
        context.min(GPU_MAX_ROWS)
    }
}

/// What [`open`] reserves of a GPU's budget besides the weights for `sequences` sequences of
/// `context` positions each (0: the model's context): what `gdsllm plan` must reserve to plan
/// the residency the run will have.
pub fn gpu_reserved_bytes(
    model: &weights_format::ModelConfig,
    context: usize,
    sequences: usize,
) -> Result<u64, LlamaError> {
    let context = crate::clamp_context(context, model);
    let sequences = sequences.max(1);
    device_reserved_bytes(model, context, sequences, gpu_max_rows(context, sequences))
}

/// What stays resident and what streams is residency's plan for the options (`--vram-budget`,
/// `--host-cache`, …); the f16 KV caches, activations and a margin are reserved first. A pass
/// holds up to [`GPU_MAX_ROWS`] prompt positions, or for a batch a row per sequence plus a
/// prefill chunk.
#[cfg(feature = "cuda")]
fn open_cuda(
    files: ModelFiles,
    backend: CudaBackend,
    Sizes { context, sequences }: Sizes,
    options: &OpenOptions,
    started: Instant,
) -> Result<OpenedModel, LlamaError> {
    let max_rows = gpu_max_rows(context, sequences);
    let config = &files.metadata.config;
    let reserved = device_reserved_bytes(config, context, sequences, max_rows)?;
    let (residency, memory) = Residency::open_gpu(
        &files.model,
        &reserving(options, reserved),
        backend.ordinal(),
        options.io,
    )?;
    let plan = residency.plan();
    tracing::info!(
        device = backend.device_name(),
        io = %memory.io_path(),
        budget = plan.device_budget,
        resident_bytes = plan.resident_bytes,
        resident_layers = plan.resident_layers,
        streamed_bytes_per_pass = plan.disk_bytes_per_pass + plan.host_bytes_per_pass,
        "model on the GPU"
    );
    let io = memory.io_path().name().to_string();
    if let Some(hybrid) = &options.hybrid {
        if plan.host_bytes_per_pass == 0 {
            tracing::info!(
                "--placement auto: no layer streams from the host tier, so the GPU computes \
                 everything"
            );
        } else {
            let weights = CudaWeights::new(residency, memory, &backend).with_host_copies();
            let (share, hook) =
                crate::hybrid::cuda::split_shares(&files.metadata, &weights, hybrid)?;
            let helper = CpuBackend::with_exact(options.cpu_exact);
            tracing::info!(
                cpu_threads = CpuBackend::threads(),
                "--placement auto: the CPU computes a share of the matmuls of the layers \
                 streamed from the host tier"
            );
            let split =
                crate::hybrid::SplitBackend::new(backend, helper, share).with_pass_hook(hook);
            let llama = Llama::new(split, weights, files.metadata.clone(), context, max_rows)?;
            return Ok(OpenedModel::Hybrid(Box::new(
                files.finish(llama, io, started),
            )));
        }
    }
    let weights = CudaWeights::new(residency, memory, &backend);
    let llama = Llama::new(backend, weights, files.metadata.clone(), context, max_rows)?;
    Ok(OpenedModel::Cuda(Box::new(
        files.finish(llama, io, started),
    )))
}

/// Opens `dir` on CUDA device `ordinal` with every blob read into host memory and uploaded to
/// the device once, and a KV cache of `context` positions (0: the model's context length):
/// the reference the tests compare the residency path with.
#[cfg(feature = "cuda")]
pub fn open_uploaded(
    dir: &Path,
    ordinal: usize,
    context: usize,
) -> Result<Llama<CudaBackend, DeviceWeights>, LlamaError> {
    open_uploaded_on(dir, CudaBackend::new(ordinal)?, context)
}

/// [`open_uploaded`] on a backend made by the caller (tests pick its kernel paths).
#[cfg(feature = "cuda")]
pub fn open_uploaded_on(
    dir: &Path,
    backend: CudaBackend,
    context: usize,
) -> Result<Llama<CudaBackend, DeviceWeights>, LlamaError> {
    let files = ModelFiles::open(dir)?;
    let context = files.context(context);
    let blobs = crate::weights::InMemoryWeights::read_dir(files.model.dir(), &files.metadata)?;
    let weights = backend.upload_weights(blobs.into_blobs())?;
    tracing::info!(
        device = backend.device_name(),
        bytes = weights.total_bytes(),
        "model weights uploaded to device memory"
    );
    Llama::new(backend, weights, files.metadata, context, context)
}

/// What every backend needs besides the weights: the validated directory, tokenizer, chat
/// template and the text of BOS/EOS.
struct ModelFiles {
    model: Model,
    metadata: Metadata,
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    bos_token: String,
    eos_token: String,
}

impl ModelFiles {
    fn open(dir: &Path) -> Result<ModelFiles, LlamaError> {
        let model = Model::open(dir)?;
        let metadata = model.metadata().clone();
        // A family the pass does not run fails here, before any weight is read.
        crate::LlamaConfig::from_model_config(&metadata.config)?;
        let tokenizer = Tokenizer::from_file(model.dir().join(&metadata.tokenizer))?;
        let chat_template = match &metadata.chat_template {
            Some(t) => Some(ChatTemplate::from_file(model.dir().join(&t.file))?),
            None => None,
        };
        let token_text =
            |id: Option<u32>| id.and_then(|id| tokenizer.token(id)).unwrap_or_default();
        let bos_token = token_text(metadata.config.bos_token_id);
        let eos_token = token_text(metadata.config.eos_token_ids.first().copied());
        Ok(ModelFiles {
            model,
            metadata,
            tokenizer,
            chat_template,
            bos_token,
            eos_token,
        })
    }

    /// `context`, or the model's context length when 0 or larger (see [`crate::clamp_context`]).
    fn context(&self, context: usize) -> usize {
        crate::clamp_context(context, &self.metadata.config)
    }

    fn finish<B: Backend, W: WeightSource>(
        self,
        llama: Llama<B, W>,
        io: String,
        started: Instant,
    ) -> LoadedModel<B, W> {
        LoadedModel {
            session: Session::new(llama, self.tokenizer),
            chat_template: self.chat_template,
            bos_token: self.bos_token,
            eos_token: self.eos_token,
            io,
            load_seconds: started.elapsed().as_secs_f64(),
        }
    }
}

impl<B: Backend, W: WeightSource> LoadedModel<B, W> {
    /// Token ids of a chat conversation rendered with the model's template, ending where the
    /// assistant's reply starts.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>, LlamaError> {
        let text = self.render_chat(messages)?;
        self.session.tokenizer().encode(&text)
    }

    /// A chat conversation rendered with the model's template, ending where the assistant's
    /// reply starts.
    pub fn render_chat(&self, messages: &[Message]) -> Result<String, LlamaError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(LlamaError::NoChatTemplate)?;
        template.render(messages, &self.bos_token, &self.eos_token, true)
    }
}
