//! Opening a model directory for generation on the CPU: metadata, residency (the only way
//! weights reach the backend), tokenizer and chat template.

use std::path::Path;
use std::time::Instant;

use residency::{Residency, ResidencyOptions};
use weights_format::Model;

use crate::LlamaError;
use crate::backend::CpuBackend;
use crate::chat::{ChatTemplate, Message};
use crate::generate::Session;
use crate::model::Llama;
use crate::tokenizer::Tokenizer;

/// A model ready to generate on the CPU backend.
pub struct CpuModel {
    pub session: Session<CpuBackend, Residency>,
    pub chat_template: Option<ChatTemplate>,
    /// Text of the BOS and EOS tokens, for the chat template.
    pub bos_token: String,
    pub eos_token: String,
    /// Seconds spent opening the directory, planning residency and reading the tokenizer.
    pub load_seconds: f64,
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
    let model = Model::open(dir.as_ref())?;
    let metadata = model.metadata().clone();
    let context = if context == 0 {
        metadata.config.context_length as usize
    } else {
        context
    };
    let tokenizer = Tokenizer::from_file(model.dir().join(&metadata.tokenizer))?;
    let chat_template = match &metadata.chat_template {
        Some(t) => Some(ChatTemplate::from_file(model.dir().join(&t.file))?),
        None => None,
    };
    let token_text = |id: Option<u32>| id.and_then(|id| tokenizer.token(id)).unwrap_or_default();
    let bos_token = token_text(metadata.config.bos_token_id);
    let eos_token = token_text(metadata.config.eos_token_ids.first().copied());
    let residency = Residency::open_host(&model, options)?;
    let llama = Llama::new(
        CpuBackend::new(),
        residency,
        metadata,
        context,
        max_rows.max(context),
    )?;
    Ok(CpuModel {
        session: Session::new(llama, tokenizer),
        chat_template,
        bos_token,
        eos_token,
        load_seconds: started.elapsed().as_secs_f64(),
    })
}

impl CpuModel {
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
