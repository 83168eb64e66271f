//! Chat templates: the model's Jinja template rendered with minijinja and the Python string
//! methods templates from Hugging Face expect (minijinja-contrib `pycompat`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::LlamaError;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A parsed chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    path: PathBuf,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Reads and compiles the template file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<ChatTemplate, LlamaError> {
        let path = path.as_ref().to_path_buf();
        let source = std::fs::read_to_string(&path).map_err(|source| LlamaError::Io {
            path: path.clone(),
            source,
        })?;
        ChatTemplate::from_source(source, path)
    }

    /// Compiles `source`; `path` names it in errors.
    pub fn from_source(source: String, path: PathBuf) -> Result<ChatTemplate, LlamaError> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| LlamaError::ChatTemplate {
                path: path.clone(),
                message: format!("{e:#}"),
            })?;
        Ok(ChatTemplate { env, path })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(
        &self,
        messages: &[Message],
        bos_token: &str,
        eos_token: &str,
        add_generation_prompt: bool,
    ) -> Result<String, LlamaError> {
        let err = |e: minijinja::Error| LlamaError::ChatTemplate {
            path: self.path.clone(),
            message: format!("{e:#}"),
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(err)?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| minijinja::context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        template
            .render(minijinja::context! {
                messages => messages,
                bos_token => bos_token,
                eos_token => eos_token,
                add_generation_prompt => add_generation_prompt,
            })
            .map_err(err)
    }
}
