//! Opening a model directory for generation: metadata, residency (the only way weights reach
//! the backend), tokenizer and chat template. [`load_cpu`] here; `backend::cuda::load_cuda`
//! for the GPU.

use std::path::Path;
use std::time::Instant;

use residency::{Residency, ResidencyOptions};
use weights_format::{Metadata, Model};

use crate::LlamaError;
use crate::backend::{Backend, CpuBackend};
use crate::chat::{ChatTemplate, Message};
use crate::generate::Session;
use crate::model::Llama;
use crate::tokenizer::Tokenizer;
use crate::weights::WeightSource;

/// A model ready to generate on backend `B` with weights from `W`.
pub struct LoadedModel<B: Backend, W: WeightSource> {
    pub session: Session<B, W>,
    pub chat_template: Option<ChatTemplate>,
    /// Text of the BOS and EOS tokens, for the chat template.
    pub bos_token: String,
    pub eos_token: String,
    /// Seconds spent opening the directory, planning residency and reading the tokenizer.
    pub load_seconds: f64,
}

/// A model on the CPU backend, weights through residency in host memory.
pub type CpuModel = LoadedModel<CpuBackend, Residency>;

/// What every backend needs besides the weights: the validated directory, tokenizer, chat
/// template and the text of BOS/EOS.
pub(crate) struct ModelFiles {
    pub model: Model,
    pub metadata: Metadata,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub bos_token: String,
    pub eos_token: String,
}

impl ModelFiles {
    pub(crate) fn open(dir: &Path) -> Result<ModelFiles, LlamaError> {
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

    /// `context`, or the model's context length when 0.
    pub(crate) fn context(&self, context: usize) -> usize {
        if context == 0 {
            self.metadata.config.context_length as usize
        } else {
            context
        }
    }

    pub(crate) fn finish<B: Backend, W: WeightSource>(
        self,
        llama: Llama<B, W>,
        started: Instant,
    ) -> LoadedModel<B, W> {
        LoadedModel {
            session: Session::new(llama, self.tokenizer),
            chat_template: self.chat_template,
            bos_token: self.bos_token,
            eos_token: self.eos_token,
            load_seconds: started.elapsed().as_secs_f64(),
        }
    }
}

/// Opens `dir` with a KV cache of `context` positions (0: the model's full context length).
/// The whole prompt of up to `context` positions is computed in one pass over the weights.
pub fn load_cpu(
    dir: impl AsRef<Path>,
    options: &ResidencyOptions,
    context: usize,
) -> Result<CpuModel, LlamaError> {
    load_cpu_rows(dir, options, context, 0)
}

/// [`load_cpu`] with room for `max_rows` positions per pass when that is more than the context
/// (a batch of sequences shares a pass: see [`crate::batch::BatchConfig::rows_per_pass`]).
pub fn load_cpu_rows(
    dir: impl AsRef<Path>,
    options: &ResidencyOptions,
    context: usize,
    max_rows: usize,
) -> Result<CpuModel, LlamaError> {
    let started = Instant::now();
    let files = ModelFiles::open(dir.as_ref())?;
    let context = files.context(context);
    let residency = Residency::open_host(&files.model, options)?;
    let llama = Llama::new(
        CpuBackend::new(),
        residency,
        files.metadata.clone(),
        context,
        max_rows.max(context),
    )?;
    Ok(files.finish(llama, started))
}

impl<B: Backend, W: WeightSource> LoadedModel<B, W> {
    /// Token ids of a chat conversation rendered with the model's template, ending where the
    /// assistant's reply starts.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>, LlamaError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(LlamaError::NoChatTemplate)?;
        let text = template.render(messages, &self.bos_token, &self.eos_token, true)?;
        self.session.tokenizer().encode(&text)
    }
}
