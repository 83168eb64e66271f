//! `gdsllm show NAME`: what a model is (architecture, parameters, tensor types, context,
//! template), what it takes on disk, and where the default residency plan would put its bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use weights_format::Model;

use crate::error::StoreError;
use crate::layout::disk_usage;

/// Tensors of one storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct TypeCount {
    pub tensors: u64,
    pub bytes: u64,
}

/// Where the default plan (`gdsllm run` on the CPU with no flags: `--vram-budget auto`,
/// `--host-cache auto`, the KV cache of `context` positions reserved) puts the model's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TierBytes {
    pub context: u64,
    pub device_budget: u64,
    pub reserved_bytes: u64,
    /// Kept in device memory (RAM on the CPU backend) for the whole run.
    pub resident_bytes: u64,
    /// The staging ring the rest streams through.
    pub ring_bytes: u64,
    /// Streamed blobs kept in the host tier after their first read.
    pub host_cached_bytes: u64,
    /// Read from disk in every pass after the first.
    pub disk_bytes_per_pass: u64,
    /// Copied up from the host tier in every pass.
    pub host_bytes_per_pass: u64,
}

/// What `gdsllm show` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    pub dir: PathBuf,
    pub architecture: String,
    pub parameters: u64,
    pub n_layers: u32,
    pub hidden_size: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub vocab_size: u32,
    pub context_length: u32,
    /// Storage type → tensors and bytes.
    pub tensor_types: BTreeMap<String, TypeCount>,
    pub chat_template: bool,
    /// Bytes of all blobs.
    pub model_bytes: u64,
    /// Bytes of blobs on local disk (less than `model_bytes` for a served model not fully
    /// fetched yet).
    pub local_blob_bytes: u64,
    /// Bytes the directory takes on disk.
    pub disk_bytes: u64,
    /// Where a served model comes from.
    pub origin: Option<String>,
    /// Provenance recorded by the conversion.
    pub converted_from: serde_json::Map<String, serde_json::Value>,
    /// The default plan, or why there is none (e.g. too little memory).
    pub default_plan: Result<TierBytes, String>,
}

/// Summarizes the model in `dir`.
pub fn summarize(dir: &Path) -> Result<ModelSummary, StoreError> {
    let model = Model::open(dir)?;
    let meta = model.metadata();
    let config = &meta.config;
    let mut tensor_types: BTreeMap<String, TypeCount> = BTreeMap::new();
    let mut parameters = 0u64;
    for tensor in meta.blobs.iter().flat_map(|b| &b.tensors) {
        let entry = tensor_types.entry(tensor.dtype.to_string()).or_default();
        entry.tensors += 1;
        entry.bytes += tensor.length;
        // A tied output projection is the embedding, stored (and counted) once.
        parameters += tensor.shape.iter().product::<u64>();
    }
    Ok(ModelSummary {
        dir: dir.to_path_buf(),
        architecture: config.architecture.clone(),
        parameters,
        n_layers: config.n_layers,
        hidden_size: config.hidden_size,
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        vocab_size: config.vocab_size,
        context_length: config.context_length,
        tensor_types,
        chat_template: meta.chat_template.is_some(),
        model_bytes: meta.blobs.iter().map(|b| b.length).sum(),
        local_blob_bytes: residency::network::local_blob_bytes(dir, meta)?,
        disk_bytes: disk_usage(dir),
        origin: residency::Origin::read(dir)?.map(|o| o.url),
        converted_from: meta.source.clone(),
        default_plan: default_plan(&model).map_err(|e| e.to_string()),
    })
}

/// The plan `gdsllm run` makes with no flags on the CPU (context 4096 or the model's, if
/// shorter, with an f32 KV cache).
fn default_plan(model: &Model) -> Result<TierBytes, residency::ResidencyError> {
    let config = model.config();
    let context = u64::from(config.context_length).min(4096);
    let options = residency::ResidencyOptions {
        reserved_bytes: residency::kv_cache_bytes(config, context, 4),
        ..residency::ResidencyOptions::default()
    };
    let layout = residency::ModelLayout::from_metadata(model.metadata())?;
    let inputs = residency::plan_inputs(&options, None)?;
    let plan = residency::Plan::compute(&layout, &inputs)?;
    Ok(TierBytes {
        context,
        device_budget: plan.device_budget,
        reserved_bytes: plan.reserved_bytes,
        resident_bytes: plan.resident_bytes,
        ring_bytes: plan.ring_bytes,
        host_cached_bytes: plan.host_cached_bytes,
        disk_bytes_per_pass: plan.disk_bytes_per_pass,
        host_bytes_per_pass: plan.host_bytes_per_pass,
    })
}
