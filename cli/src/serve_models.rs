//! The models `gdsllm serve` can load besides its default: the store's, found by name (a store
//! name, alias or tag, as `-m NAME` finds them; never a path, URL or pull, which a client must
//! not be able to make the server fetch), each opened with the server's own settings, within
//! the part of the server's memory budgets the registry gives it (`gdsllm_server::models`): what
//! a model needs is its residency plan, computed here as the loader will compute it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::Context;
use gdsllm_server::{Engine, MemoryNeed, ModelSource, SourceModel, TierBytes};
use gdsllm_store::Store;
use residency::{Budget, HostCache};
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

/// A model's part of the server's budgets as its --vram-budget and --host-cache.
fn budget_flags(budget: TierBytes) -> (Budget, HostCache) {
    let host = match budget.host {
        0 => HostCache::Off,
        bytes => HostCache::Bytes(bytes),
    };
    (Budget::Bytes(budget.device), host)
}

impl OpenSettings {
    /// These settings with `budget` (the part of the server's budgets a model is given) as
    /// its --vram-budget and --host-cache.
    fn within(&self, budget: Option<TierBytes>) -> OpenSettings {
        let mut settings = self.clone();
        if let Some(budget) = budget {
            let residency = &mut settings.open.residency;
            (residency.vram_budget, residency.host_cache) = budget_flags(budget);
        }
        settings
    }

    /// KV-cache bytes the model's sequences and prefix cache may hold together.
    fn kv_bytes(&self, config: &weights_format::ModelConfig, context: usize) -> u64 {
        let sequences = self.kv_budget.unwrap_or_else(|| {
            residency::kv_cache_bytes(config, context as u64, 4) * self.max_batch as u64
        });
        sequences.saturating_add(self.prefix_cache_bytes)
    }

    /// What the model in `dir` needs out of the server's whole `budget` on `backend` (`cpu`,
    /// `cuda`, `split`): its residency plan with the whole budget (`full`) and with the least
    /// budget a plan accepts, every weight streamed through the staging ring and no host tier
    /// (`minimum`), each with what the loader reserves besides the weights.
    pub fn memory_need(
        &self,
        dir: &Path,
        backend: &str,
        budget: TierBytes,
    ) -> anyhow::Result<MemoryNeed> {
        let model =
            Model::open(dir).with_context(|| format!("{}: invalid model", dir.display()))?;
        let config = model.config();
        let context = llama::clamp_context(self.ctx_size, config);
        // As `llama::open` reserves it: f32 KV caches on the CPU; f16 caches, activations
        // and a margin on a GPU.
        let reserved = if backend == "cpu" {
            self.kv_bytes(config, context)
        } else {
            llama::load::gpu_reserved_bytes(config, context, self.max_batch)?
        };
        let layout = residency::ModelLayout::from_metadata(model.metadata())?;
        let options = self.open.residency.options(reserved);
        let plan = |device: u64, host: u64| {
            let mut options = options.clone();
            (options.device_budget, options.host_cache) =
                budget_flags(TierBytes::new(device, host));
            let inputs = residency::plan_inputs(&options, None)?;
            let plan = residency::Plan::compute(&layout, &inputs)?;
            anyhow::Ok(TierBytes::new(
                reserved + plan.device_bytes(),
                plan.host_cached_bytes,
            ))
        };
        let largest = layout
            .order
            .iter()
            .map(|&b| layout.blobs[b].length)
            .max()
            .unwrap_or(0);
        let ring = largest.saturating_mul(options.prefetch as u64 + 1);
        let minimum = plan(reserved.saturating_add(ring), 0)?;
        // A budget too small for even that: the registry says so with the numbers.
        let full = plan(budget.device, budget.host).unwrap_or(minimum);
        Ok(MemoryNeed { full, minimum })
    }

    /// The device and options for the model in `dir`.
    pub fn prepare(&self, dir: &Path) -> anyhow::Result<Prepared> {
        let model_config = Model::open(dir)
            .with_context(|| format!("{}: invalid model", dir.display()))?
            .config()
            .clone();
        let context = llama::clamp_context(self.ctx_size, &model_config);
        // The model reserves device memory for the running sequences and the prefix cache
        // together; `open_serving` gives the sequences their part.
        let (device, options) = self.open.options(
            context,
            self.max_batch,
            Some(self.kv_bytes(&model_config, context)),
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
    /// The backend the default model computes on (`Engine::memory`), which the others will
    /// too: it decides what a model reserves besides its weights.
    backend: OnceLock<&'static str>,
}

impl StoreModels {
    pub fn new(store: Store, settings: OpenSettings) -> StoreModels {
        StoreModels {
            store,
            settings,
            backend: OnceLock::new(),
        }
    }

    /// Records the backend the default model was loaded on.
    pub fn set_backend(&self, backend: &'static str) {
        let _ = self.backend.set(backend);
    }

    /// The backend models load on: the default's, else what --device says.
    fn backend(&self) -> &'static str {
        self.backend.get().copied().unwrap_or(
            if self.settings.open.device.device == crate::device_args::DeviceArg::Cpu {
                "cpu"
            } else {
                "cuda"
            },
        )
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

impl StoreModels {
    fn dir_of(&self, model: &SourceModel) -> anyhow::Result<PathBuf> {
        let (_, dir) = self
            .find_dir(&model.name)?
            .with_context(|| format!("{} is no longer in the store", model.name))?;
        Ok(dir)
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

    fn memory_need(
        &self,
        model: &SourceModel,
        budget: TierBytes,
    ) -> Result<Option<MemoryNeed>, String> {
        let need = (|| {
            let dir = self.dir_of(model)?;
            self.settings.memory_need(&dir, self.backend(), budget)
        })();
        need.map(Some).map_err(|e| format!("{e:#}"))
    }

    fn load(
        &self,
        model: &SourceModel,
        budget: Option<TierBytes>,
    ) -> Result<Arc<dyn Engine>, String> {
        let loaded = (|| {
            let dir = self.dir_of(model)?;
            let settings = self.settings.within(budget);
            let prepared = settings.prepare(&dir)?;
            settings.load(&dir, model.name.clone(), &prepared)
        })();
        loaded.map_err(|e| format!("{e:#}"))
    }
}
