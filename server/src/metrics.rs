//! `/metrics` in Prometheus text format. The recorder is owned by the server (not installed
//! globally) so several servers in one process, as in tests, keep separate counts.

use metrics::{counter, gauge, histogram, with_local_recorder};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::engine::{CacheUsage, EngineStats, TierBytes};

pub const REQUESTS: &str = "gdsllm_requests_total";
pub const CANCELLED: &str = "gdsllm_requests_cancelled_total";
pub const REJECTED: &str = "gdsllm_requests_rejected_total";
pub const CONNECTIONS: &str = "gdsllm_connections_open";
pub const EVICTED: &str = "gdsllm_connections_evicted_total";
pub const PROMPT_TOKENS: &str = "gdsllm_prompt_tokens_total";
pub const GENERATED_TOKENS: &str = "gdsllm_generation_tokens_total";
pub const TTFT: &str = "gdsllm_time_to_first_token_seconds";
pub const INTER_TOKEN: &str = "gdsllm_inter_token_latency_seconds";
pub const QUEUE_TIME: &str = "gdsllm_queue_time_seconds";
pub const RUNNING: &str = "gdsllm_requests_running";
pub const WAITING: &str = "gdsllm_requests_waiting";
pub const WEIGHT_BYTES: &str = "gdsllm_weight_bytes_total";
pub const IO_GBPS: &str = "gdsllm_io_gbps";
pub const RESIDENCY_HITS: &str = "gdsllm_residency_hits_total";
pub const RESIDENCY_MISSES: &str = "gdsllm_residency_misses_total";
pub const COMPUTE_STALL: &str = "gdsllm_compute_stall_seconds";
pub const PASSES: &str = "gdsllm_forward_passes_total";
// The KV-cache and prefix-cache series, named after vLLM's where they map (README's
// "Metrics"): vllm:gpu_cache_usage_perc (a fraction, 0 to 1), vllm:prefix_cache_queries and
// vllm:prefix_cache_hits (prompt tokens).
pub const KV_USAGE: &str = "gdsllm_kv_cache_usage_perc";
pub const PREFIX_QUERIES: &str = "gdsllm_prefix_cache_queries_total";
pub const PREFIX_HITS: &str = "gdsllm_prefix_cache_hits_total";
pub const PREFIX_BYTES: &str = "gdsllm_prefix_cache_bytes";
// Several models in one server (`crate::models`).
pub const MODELS_LOADED: &str = "gdsllm_models_loaded";
pub const MODEL_LOADED: &str = "gdsllm_model_loaded";
pub const MODEL_LOADS: &str = "gdsllm_model_loads_total";
pub const MODEL_UNLOADS: &str = "gdsllm_model_unloads_total";
pub const MODEL_MEMORY: &str = "gdsllm_model_memory_bytes";
pub const MODEL_EVICTIONS: &str = "gdsllm_model_evictions_total";
pub const MEMORY_HELD: &str = "gdsllm_memory_held_bytes";
pub const MEMORY_BUDGET: &str = "gdsllm_memory_budget_bytes";
// The per-model parts of the series above that are per model (the unlabelled ones are the
// server's totals).
pub const MODEL_RUNNING: &str = "gdsllm_model_requests_running";
pub const MODEL_WAITING: &str = "gdsllm_model_requests_waiting";
pub const MODEL_KV_USAGE: &str = "gdsllm_model_kv_cache_usage_perc";

/// The KV-cache usage gauge's fraction: 0 without a budget (no model, or none loaded yet).
fn kv_fill(used: u64, budget: u64) -> f64 {
    if budget == 0 {
        0.0
    } else {
        used as f64 / budget as f64
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The recorder of one server, or a handle on it that one model's scheduler records through
/// ([`Metrics::for_model`]): its running/waiting/KV-cache gauges then go into that model's
/// labelled series, and the unlabelled ones become the sums over the models.
pub struct Metrics {
    shared: Arc<Shared>,
    model: Option<String>,
}

struct Shared {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    models: Mutex<BTreeMap<String, ModelGauges>>,
}

/// What one model's scheduler last reported.
#[derive(Default)]
struct ModelGauges {
    running: usize,
    waiting: usize,
    usage: CacheUsage,
    /// Prefix-cache totals of the model's earlier loads (a new load's batch counts from 0).
    earlier_queried: u64,
    earlier_hits: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let builder = [TTFT, INTER_TOKEN, QUEUE_TIME].into_iter().fold(
            PrometheusBuilder::new(),
            |b, name| {
                b.set_buckets_for_metric(Matcher::Full(name.to_string()), LATENCY_BUCKETS)
                    .expect("bucket list is a non-empty constant")
            },
        );
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        let m = Metrics {
            shared: Arc::new(Shared {
                recorder,
                handle,
                models: Mutex::new(BTreeMap::new()),
            }),
            model: None,
        };
        m.with(|| {
            use metrics::{describe_counter, describe_gauge, describe_histogram};
            describe_counter!(REQUESTS, "HTTP requests by endpoint and status code");
            describe_counter!(CANCELLED, "Sequences cancelled (client gone or shutdown)");
            describe_gauge!(CONNECTIONS, "Open client connections");
            describe_counter!(
                EVICTED,
                "Idle connections closed to make room for new ones at --max-connections"
            );
            describe_counter!(
                REJECTED,
                "Requests refused with 429 because the queue was full"
            );
            describe_counter!(PROMPT_TOKENS, "Prompt tokens processed");
            describe_counter!(GENERATED_TOKENS, "Tokens generated");
            describe_histogram!(
                TTFT,
                metrics::Unit::Seconds,
                "Queueing + prefill until the first token"
            );
            describe_histogram!(
                INTER_TOKEN,
                metrics::Unit::Seconds,
                "Time between tokens of a sequence"
            );
            describe_histogram!(
                QUEUE_TIME,
                metrics::Unit::Seconds,
                "Time a request waited for the model"
            );
            describe_gauge!(RUNNING, "Sequences being generated");
            describe_gauge!(WAITING, "Requests queued for the model");
            describe_counter!(
                WEIGHT_BYTES,
                "Weight bytes brought to the compute device, by tier"
            );
            describe_gauge!(
                IO_GBPS,
                "Weight bytes per second of wall time since load, GB/s"
            );
            describe_counter!(
                RESIDENCY_HITS,
                "Weight acquisitions served from device memory"
            );
            describe_counter!(RESIDENCY_MISSES, "Weight acquisitions that read on demand");
            describe_gauge!(
                COMPUTE_STALL,
                "Seconds compute waited for weights since load"
            );
            describe_counter!(PASSES, "Forward passes over the weights");
            describe_gauge!(
                KV_USAGE,
                "Fraction of the KV-cache budget the running sequences hold (0 to 1)"
            );
            describe_counter!(
                PREFIX_QUERIES,
                "Prompt tokens looked up in the prefix cache"
            );
            describe_counter!(
                PREFIX_HITS,
                "Prompt tokens served from the prefix cache instead of computed"
            );
            describe_gauge!(PREFIX_BYTES, "Bytes the prefix cache holds");
            describe_gauge!(MODELS_LOADED, "Models loaded now");
            describe_gauge!(MODEL_LOADED, "Whether the model is loaded (1) or not (0)");
            describe_counter!(MODEL_LOADS, "Times the model was loaded");
            describe_counter!(MODEL_UNLOADS, "Times the model was unloaded");
            describe_gauge!(
                MODEL_MEMORY,
                "Bytes the model holds, by tier (device: weights resident and staging, KV cache \
                 and scratch; host: its host tier)"
            );
            describe_counter!(
                MODEL_EVICTIONS,
                "Models unloaded, by reason (idle_timeout, memory, count, operator)"
            );
            describe_gauge!(
                MEMORY_HELD,
                "Bytes the loaded and loading models hold together, by tier"
            );
            describe_gauge!(
                MEMORY_BUDGET,
                "The server's memory budget across models, by tier (--vram-budget, --host-cache)"
            );
            describe_gauge!(MODEL_RUNNING, "Sequences of the model being generated");
            describe_gauge!(MODEL_WAITING, "Requests queued for the model");
            describe_gauge!(
                MODEL_KV_USAGE,
                "Fraction of the model's KV-cache budget its running sequences hold"
            );
            gauge!(MODELS_LOADED).set(0.0);
            gauge!(KV_USAGE).set(0.0);
            counter!(PREFIX_QUERIES).absolute(0);
            counter!(PREFIX_HITS).absolute(0);
            gauge!(PREFIX_BYTES).set(0.0);
            gauge!(RUNNING).set(0.0);
            gauge!(WAITING).set(0.0);
            counter!(CANCELLED).absolute(0);
            counter!(REJECTED).absolute(0);
            counter!(EVICTED).absolute(0);
            gauge!(CONNECTIONS).set(0.0);
            counter!(PROMPT_TOKENS).absolute(0);
            counter!(GENERATED_TOKENS).absolute(0);
        });
        m
    }

    /// A handle that records one model's gauges (the same recorder).
    pub fn for_model(&self, model: &str) -> Arc<Metrics> {
        Arc::new(Metrics {
            shared: self.shared.clone(),
            model: Some(model.to_string()),
        })
    }

    fn with<T>(&self, f: impl FnOnce() -> T) -> T {
        with_local_recorder(&self.shared.recorder, f)
    }

    /// Updates this handle's model's gauges with `change`, then the labelled series and the
    /// server totals; without a model, `unlabelled` sets the totals directly.
    fn model_gauges(&self, change: impl FnOnce(&mut ModelGauges), unlabelled: impl FnOnce()) {
        let Some(model) = &self.model else {
            self.with(unlabelled);
            return;
        };
        let mut models = self.shared.models.lock();
        change(models.entry(model.clone()).or_default());
        let own = &models[model];
        let sum = |f: &dyn Fn(&ModelGauges) -> u64| models.values().map(f).sum::<u64>();
        self.with(|| {
            let label = model.clone();
            gauge!(MODEL_RUNNING, "model" => label.clone()).set(own.running as f64);
            gauge!(MODEL_WAITING, "model" => label.clone()).set(own.waiting as f64);
            gauge!(MODEL_KV_USAGE, "model" => label)
                .set(kv_fill(own.usage.kv_used_bytes, own.usage.kv_budget_bytes));
            gauge!(RUNNING).set(sum(&|g| g.running as u64) as f64);
            gauge!(WAITING).set(sum(&|g| g.waiting as u64) as f64);
            gauge!(KV_USAGE).set(kv_fill(
                sum(&|g| g.usage.kv_used_bytes),
                sum(&|g| g.usage.kv_budget_bytes),
            ));
            counter!(PREFIX_QUERIES)
                .absolute(sum(&|g| g.earlier_queried + g.usage.prefix_queried_tokens));
            counter!(PREFIX_HITS).absolute(sum(&|g| g.earlier_hits + g.usage.prefix_hit_tokens));
            gauge!(PREFIX_BYTES).set(sum(&|g| g.usage.prefix_bytes) as f64);
        });
    }

    pub fn request(&self, endpoint: String, status: u16) {
        self.with(|| {
            counter!(REQUESTS, "endpoint" => endpoint, "status" => status.to_string()).increment(1)
        });
    }

    pub fn cancelled(&self) {
        self.with(|| counter!(CANCELLED).increment(1));
    }

    pub fn set_connections(&self, n: usize) {
        self.with(|| gauge!(CONNECTIONS).set(n as f64));
    }

    pub fn connection_evicted(&self) {
        self.with(|| counter!(EVICTED).increment(1));
    }

    /// A request refused because the queue was full.
    pub fn rejected(&self) {
        self.with(|| counter!(REJECTED).increment(1));
    }

    pub fn prompt_tokens(&self, n: usize) {
        self.with(|| counter!(PROMPT_TOKENS).increment(n as u64));
    }

    pub fn generated_token(&self) {
        self.with(|| counter!(GENERATED_TOKENS).increment(1));
    }

    pub fn time_to_first_token(&self, seconds: f64) {
        self.with(|| histogram!(TTFT).record(seconds));
    }

    pub fn inter_token(&self, seconds: f64) {
        self.with(|| histogram!(INTER_TOKEN).record(seconds));
    }

    pub fn queue_time(&self, seconds: f64) {
        self.with(|| histogram!(QUEUE_TIME).record(seconds));
    }

    pub fn set_running(&self, n: usize) {
        self.model_gauges(|g| g.running = n, || gauge!(RUNNING).set(n as f64));
    }

    /// The batch's KV-cache fill and prefix-cache totals (since the batch began).
    pub fn set_cache_usage(&self, usage: &CacheUsage) {
        self.model_gauges(
            |g| g.usage = *usage,
            || {
                gauge!(KV_USAGE).set(kv_fill(usage.kv_used_bytes, usage.kv_budget_bytes));
                counter!(PREFIX_QUERIES).absolute(usage.prefix_queried_tokens);
                counter!(PREFIX_HITS).absolute(usage.prefix_hit_tokens);
                gauge!(PREFIX_BYTES).set(usage.prefix_bytes as f64);
            },
        );
    }

    /// `model` finished loading.
    pub fn model_loaded(&self, model: &str) {
        let model = model.to_string();
        self.with(|| {
            counter!(MODEL_LOADS, "model" => model.clone()).increment(1);
            gauge!(MODEL_LOADED, "model" => model).set(1.0);
        });
    }

    /// `model` was unloaded: its gauges go to 0; its prefix-cache totals stay counted.
    pub fn model_unloaded(&self, model: &str) {
        self.for_model(model).model_gauges(
            |g| {
                g.earlier_queried += g.usage.prefix_queried_tokens;
                g.earlier_hits += g.usage.prefix_hit_tokens;
                g.usage = CacheUsage::default();
                g.running = 0;
                g.waiting = 0;
            },
            || {},
        );
        let model = model.to_string();
        self.with(|| {
            counter!(MODEL_UNLOADS, "model" => model.clone()).increment(1);
            gauge!(MODEL_LOADED, "model" => model).set(0.0);
        });
    }

    /// The bytes `model` holds per tier (0 once it is unloaded).
    pub fn set_model_memory(&self, model: &str, held: TierBytes) {
        let model = model.to_string();
        self.with(|| {
            gauge!(MODEL_MEMORY, "model" => model.clone(), "tier" => "device")
                .set(held.device as f64);
            gauge!(MODEL_MEMORY, "model" => model, "tier" => "host").set(held.host as f64);
        });
    }

    /// What the models hold together, and the budgets (when the server has them).
    pub fn set_memory(&self, held: TierBytes, budget: Option<TierBytes>) {
        self.with(|| {
            gauge!(MEMORY_HELD, "tier" => "device").set(held.device as f64);
            gauge!(MEMORY_HELD, "tier" => "host").set(held.host as f64);
            if let Some(budget) = budget {
                gauge!(MEMORY_BUDGET, "tier" => "device").set(budget.device as f64);
                gauge!(MEMORY_BUDGET, "tier" => "host").set(budget.host as f64);
            }
        });
    }

    /// A model was unloaded for `reason` (`idle_timeout`, `memory`, `count`, `operator`).
    pub fn model_evicted(&self, reason: &'static str) {
        self.with(|| counter!(MODEL_EVICTIONS, "reason" => reason).increment(1));
    }

    pub fn set_models_loaded(&self, n: usize) {
        self.with(|| gauge!(MODELS_LOADED).set(n as f64));
    }

    pub fn set_waiting(&self, n: usize) {
        self.model_gauges(|g| g.waiting = n, || gauge!(WAITING).set(n as f64));
    }

    /// The text exposition, with the engine's counters brought up to date first.
    pub fn render(&self, engine: Option<&EngineStats>) -> String {
        if let Some(s) = engine {
            self.with(|| {
                for &(tier, bytes) in &s.bytes_by_tier {
                    counter!(WEIGHT_BYTES, "tier" => tier).absolute(bytes);
                }
                gauge!(IO_GBPS).set(s.io_gbps);
                counter!(RESIDENCY_HITS).absolute(s.residency_hits);
                counter!(RESIDENCY_MISSES).absolute(s.residency_misses);
                // A total, but fractional: Prometheus counters here are integers.
                gauge!(COMPUTE_STALL).set(s.compute_stall_seconds);
                counter!(PASSES).absolute(s.passes);
            });
        }
        self.shared.handle.render()
    }
}
