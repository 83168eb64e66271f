//! `-m`: whatever the user names (a store name, a .gguf file, a Hugging Face repository, a URL,
//! a directory), the local model directory to open. `run`, `bench`, `serve`, `plan`, `verify`
//! and `show` all come through here, so they accept the same forms.

use std::path::PathBuf;

use anyhow::Context;
use gdsllm_store::{DEFAULT_MODEL, PullOptions, Resolution, Store};

use crate::progress::BarProgress;

/// The model directory `spec` names (the default model, pulled on first use, when `None`).
/// Converting, pulling or caching on the way is said on stderr.
pub fn resolve_model(spec: Option<&str>) -> anyhow::Result<PathBuf> {
    let shown = spec.unwrap_or(DEFAULT_MODEL);
    let store = Store::from_env()?;
    let progress = BarProgress::new("model");
    let resolved = gdsllm_store::resolve(&store, spec, &PullOptions::default(), &progress)
        .with_context(|| format!("finding model {shown:?}"))?;
    match &resolved.how {
        Resolution::Directory | Resolution::Stored { .. } => {
            tracing::debug!("-m {shown}: {}", resolved.how);
        }
        how => tracing::info!("-m {shown}: {how}"),
    }
    Ok(resolved.dir)
}
