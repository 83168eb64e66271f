//! The models `gdsllm serve` can load besides its default: the store's, found by name (a store
//! name, alias or tag, as `-m NAME` finds them; never a path, URL or pull, which a client must
//! not be able to make the server fetch), each opened with the server's own settings.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use gdsllm_server::{Engine, ModelSource, SourceModel};
use gdsllm_store::Store;
use weights_format::Model;

use crate::device_args::OpenArgs;

/// How `serve` opens every model: its device and residency flags, context and batch sizes.
#[derive(Clone)]
pub struct OpenSettings {
    pub open: OpenArgs,
    pub ctx_size: usize,
    pub max_batch: usize,
    /// `--kv-budget`; `None`: room for `max_batch` sequences at the full context of the model.
    pub kv_budget: Option<u64>,
    pub prefix_cache_bytes: u64,
}

/// What opening one model takes, decided before loading (so that bad flags fail at once).
pub struct Prepared {
    pub device: llama::Device,
    pub options: llama::OpenOptions,
    pub context: usize,
}

impl OpenSettings {
    /// The device and options for the model in `dir`.
    pub fn prepare(&self, dir: &Path) -> anyhow::Result<Prepared> {
        let model_config = Model::open(dir)
            .with_context(|| format!("{}: invalid model", dir.display()))?
            .config()
            .clone();
        let context = llama::clamp_context(self.ctx_size, &model_config);
        let kv_budget = self.kv_budget.unwrap_or_else(|| {
            residency::kv_cache_bytes(&model_config, context as u64, 4) * self.max_batch as u64
        });
        // The model reserves device memory for the running sequences and the prefix cache
        // together; `open_serving` gives the sequences their part.
        let (device, options) = self.open.options(
            context,
            self.max_batch,
            Some(kv_budget.saturating_add(self.prefix_cache_bytes)),
        )?;
        Ok(Prepared {
            device,
            options,
            context,
        })
    }

    /// Loads the model in `dir` as `model_id`.
    pub fn load(
        &self,
        dir: &Path,
        model_id: String,
        prepared: &Prepared,
    ) -> anyhow::Result<Arc<dyn Engine>> {
        gdsllm_server::open_serving(
            dir,
            model_id,
            prepared.device,
            &prepared.options,
            self.prefix_cache_bytes,
        )
        .with_context(|| format!("loading {}", dir.display()))
    }
}

/// What identifies a model directory: its canonical path.
pub fn model_key(dir: &Path) -> String {
    std::fs::canonicalize(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .display()
        .to_string()
}

/// The store's models, for the server's registry.
pub struct StoreModels {
    store: Store,
    settings: OpenSettings,
}

impl StoreModels {
    pub fn new(store: Store, settings: OpenSettings) -> StoreModels {
        StoreModels { store, settings }
    }

    /// Every model in the store, one per directory: its first name, the others as aliases.
    fn models(&self) -> anyhow::Result<Vec<(SourceModel, PathBuf)>> {
        let mut models: Vec<(SourceModel, PathBuf)> = Vec::new();
        for row in self.store.list()? {
            let key = model_key(&row.dir);
            if models.iter().any(|(m, _)| m.key == key) {
                continue;
            }
            models.push((
                SourceModel {
                    name: row.name,
                    aliases: row.aliases,
                    key,
                },
                row.dir,
            ));
        }
        Ok(models)
    }

    /// The store's entry for the model directory `dir` (given by `-m`), named `model_id`: its
    /// store names become aliases.
    pub fn default_model(&self, dir: &Path, model_id: &str) -> SourceModel {
        let key = model_key(dir);
        let mut aliases = Vec::new();
        match self.models() {
            Ok(models) => {
                if let Some((m, _)) = models.into_iter().find(|(m, _)| m.key == key) {
                    aliases.extend(std::iter::once(m.name).chain(m.aliases));
                }
            }
            Err(err) => tracing::warn!("listing the store: {err:#}"),
        }
        aliases.retain(|a| a != model_id);
        SourceModel {
            name: model_id.to_string(),
            aliases,
            key,
        }
    }

    fn find_dir(&self, name: &str) -> anyhow::Result<Option<(SourceModel, PathBuf)>> {
        let models = self.models()?;
        if let Some(found) = models
            .into_iter()
            .find(|(m, _)| m.name == name || m.aliases.iter().any(|a| a == name))
        {
            return Ok(Some(found));
        }
        // A directory of the store the index does not name (its directory name).
        Ok(self.store.find(name)?.map(|dir| {
            let model = SourceModel {
                name: name.to_string(),
                aliases: Vec::new(),
                key: model_key(&dir),
            };
            (model, dir)
        }))
    }
}

impl ModelSource for StoreModels {
    fn list(&self) -> Result<Vec<SourceModel>, String> {
        self.models()
            .map(|models| models.into_iter().map(|(m, _)| m).collect())
            .map_err(|e| format!("{e:#}"))
    }

    fn find(&self, name: &str) -> Result<Option<SourceModel>, String> {
        self.find_dir(name)
            .map(|found| found.map(|(m, _)| m))
            .map_err(|e| format!("{e:#}"))
    }

    fn load(&self, model: &SourceModel) -> Result<Arc<dyn Engine>, String> {
        let loaded = (|| {
            let (_, dir) = self
                .find_dir(&model.name)?
                .with_context(|| format!("{} is no longer in the store", model.name))?;
            let prepared = self.settings.prepare(&dir)?;
            self.settings.load(&dir, model.name.clone(), &prepared)
        })();
        loaded.map_err(|e| format!("{e:#}"))
    }
}
