//! The model's tokenizer (Hugging Face `tokenizer.json`) and incremental detokenization for
//! streaming.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::LlamaError;

/// A loaded `tokenizer.json`; clones share it.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    path: PathBuf,
}

impl Tokenizer {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer, LlamaError> {
        let path = path.as_ref().to_path_buf();
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| LlamaError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(Tokenizer {
            inner: Arc::new(inner),
            path,
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> LlamaError {
        LlamaError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// Token ids of `text` exactly as written: no BOS or other template is added (special
    /// tokens spelled out in the text, such as `<|im_start|>`, are still recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LlamaError> {
        let enc = self.inner.encode(text, false).map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are kept when `skip_special` is false.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, LlamaError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| self.err(e))
    }

    /// The string of token `id` (for the chat template's `bos_token`/`eos_token`).
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Turns generated ids into text pieces as they arrive without splitting multi-byte
/// characters: a piece is released only when decoding no longer ends in U+FFFD, and it is
/// the difference between decoding a short window with and without the new ids (so that
/// tokenizers that strip a leading space at the start of a sequence behave).
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds one id; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, LlamaError> {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], false)?;
        let after = tokenizer.decode(&self.ids[self.prefix_offset..], false)?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            let piece = after
                .get(before.len()..)
                .map(str::to_string)
                .unwrap_or_default();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back (an incomplete character at the very end).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String, LlamaError> {
        let before = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], false)?;
        let after = tokenizer.decode(&self.ids[self.prefix_offset..], false)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(after
            .get(before.len()..)
            .map(str::to_string)
            .unwrap_or_default())
    }
}
