//! `gdsllm plan -m MODEL --vram-budget X`: what stays resident, what streams, and what a token
//! costs from each tier.

use anyhow::Context;
use weights_format::Model;

use crate::residency_args::ResidencyArgs;

/// Print the residency plan for a model and a memory budget: the resident set, the streamed
/// blobs and the staging ring, the host tier, bytes per token from each tier, and the predicted
/// tokens/s at the given disk and host-copy speeds.
#[derive(clap::Args)]
pub struct Args {
    /// The model: anything `gdsllm run -m` accepts (a name in the store, a directory, a .gguf
    /// file, hf.co/OWNER/REPO[:QUANT], a URL).
    #[arg(short, long)]
    pub model: String,
    #[command(flatten)]
    pub residency: ResidencyArgs,
    /// Disk read speed for the prediction, in GB/s (10^9 bytes/s). DESIGN.md measured
    /// 2.6–3.0 GB/s O_DIRECT on the lent machines.
    #[arg(long, value_name = "GB/S", default_value_t = 3.0)]
    pub disk_gbps: f64,
    /// Host-tier to device copy speed for the prediction, in GB/s (pinned H2D: ~55).
    #[arg(long, value_name = "GB/S", default_value_t = 55.0)]
    pub host_gbps: f64,
    /// Compute time per token for the prediction, in milliseconds (0: I/O bound only).
    #[arg(long, value_name = "MS", default_value_t = 0.0)]
    pub compute_ms: f64,
    /// Context length whose KV cache (f16) is reserved off the budget; default: the model's
    /// context length, at most 4096.
    #[arg(long, value_name = "TOKENS")]
    pub context: Option<u64>,
    /// Extra bytes reserved for activations and safety margin, on top of the KV cache.
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = residency::parse_bytes)]
    pub margin: u64,
    /// Print one JSON object on stdout: {model, plan, reserved_bytes, disk_gbps, host_gbps,
    /// compute_ms, predicted_tokens_per_s (null when not I/O or compute bound)}.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let dir = crate::model_arg::resolve_model(Some(&args.model))?;
    let model = Model::open(&dir).with_context(|| format!("{}: invalid model", dir.display()))?;
    let config = model.config();
    let context = args
        .context
        .unwrap_or_else(|| (config.context_length as u64).min(4096));
    let reserved = residency::kv_cache_bytes(config, context, 2) + args.margin;
    let opts = args.residency.options(reserved);
    let layout = residency::ModelLayout::from_metadata(model.metadata())?;
    let inputs = residency::plan_inputs(&opts, None)?;
    let plan = residency::Plan::compute(&layout, &inputs).with_context(|| {
        format!(
            "planning {} with --vram-budget {}",
            dir.display(),
            opts.device_budget
        )
    })?;
    let tps = plan.predict_tokens_per_s(args.disk_gbps, args.host_gbps, args.compute_ms / 1e3);
    if args.json {
        let json = serde_json::json!({
            "model": dir,
            "plan": plan,
            "reserved_bytes": reserved,
            "context": context,
            "disk_gbps": args.disk_gbps,
            "host_gbps": args.host_gbps,
            "compute_ms": args.compute_ms,
            "predicted_tokens_per_s": if tps.is_finite() { Some(tps) } else { None },
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!(
            "model {} ({} layers, {})",
            dir.display(),
            config.n_layers,
            residency::human_bytes(model.total_bytes())
        );
        println!(
            "reserved {} = KV cache for {context} tokens (f16) + {} margin",
            residency::human_bytes(reserved),
            residency::human_bytes(args.margin)
        );
        print!("{plan}");
        if tps.is_finite() {
            println!(
                "predicted: {tps:.2} tokens/s at {} GB/s disk, {} GB/s host→device, {} ms compute per token",
                args.disk_gbps, args.host_gbps, args.compute_ms
            );
        } else {
            println!(
                "predicted: not bound by I/O (everything resident) nor by the given compute time"
            );
        }
    }
    Ok(())
}
