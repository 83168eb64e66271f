//! `gdsllm plan -m MODEL --vram-budget X`: what stays resident, what streams, and what a token
//! costs from each tier; then where each layer's matmuls run in each kind of pass (the
//! placement, issue 24) and the tokens/s this machine's measured figures predict.

use anyhow::Context;
use weights_format::Model;

use crate::placement_args::PlacementArgs;
use crate::residency_args::ResidencyArgs;

/// The passes `plan` shows the placement of: decode steps of 1, 8 and 32 sequences, and a
/// prefill chunk of 512 rows.
const PASSES: [residency::PassKind; 4] = [
    residency::PassKind::Decode { batch: 1 },
    residency::PassKind::Decode { batch: 8 },
    residency::PassKind::Decode { batch: 32 },
    residency::PassKind::Prefill { rows: 512 },
];

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
    #[command(flatten)]
    pub placement: PlacementArgs,
    /// Measure this machine's figures for the placement again (the disk's reads, the CPU's
    /// matmuls for each dtype of the model, the GPU's matmuls, copies and handoffs) and keep
    /// them in $GDSLLM_HOME/calibration.json. Without it the stored figures are used, and only
    /// those missing are measured.
    #[arg(long)]
    pub calibrate: bool,
    /// Size of the calibration's probes in MiB (the CPU's probe weight and the disk's probe
    /// file; the GPU's weight is twice that). Default: 256, the CPU's four times its
    /// last-level caches when that is more.
    #[arg(long, value_name = "MIB", hide = true)]
    pub probe_mib: Option<usize>,
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
    /// Context length whose KV cache (f16) is reserved off the budget, with the activations
    /// and the margin a run on the GPU reserves (each pass of the placement is planned with
    /// its batch's caches, as `gdsllm run`/`bench` would open it); default: the model's context
    /// length, at most 4096.
    #[arg(long, value_name = "TOKENS")]
    pub context: Option<u64>,
    /// Extra bytes reserved for activations and safety margin, on top of the KV cache.
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = residency::parse_bytes)]
    pub margin: u64,
    /// Print one JSON object on stdout: {model, plan, reserved_bytes, disk_gbps, host_gbps,
    /// compute_ms, predicted_tokens_per_s (null when not I/O or compute bound), calibration,
    /// placement: {mode, device, passes: [{pass, units, seconds, tokens_per_s}]}}.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // The plan is a GPU's (its placement is between the GPU and the CPU): the same threads
    // as `run --placement auto` on a GPU.
    args.placement.apply_threads(true)?;
    let dir = crate::model_arg::resolve_model(Some(&args.model))?;
    let model = Model::open(&dir).with_context(|| format!("{}: invalid model", dir.display()))?;
    let config = model.config();
    let context = args
        .context
        .unwrap_or_else(|| (config.context_length as u64).min(4096));
    let layout = residency::ModelLayout::from_metadata(model.metadata())?;
    // The residency plan a run of `sequences` sequences has: what the GPU loader reserves
    // besides the weights, and the margin asked for.
    let plan_for = |sequences: usize| -> anyhow::Result<(u64, residency::Plan)> {
        let reserved =
            llama::load::gpu_reserved_bytes(config, context as usize, sequences)? + args.margin;
        let opts = args.residency.options(reserved);
        let inputs = residency::plan_inputs(&opts, None)?;
        let plan = residency::Plan::compute(&layout, &inputs).with_context(|| {
            format!(
                "planning {} with --vram-budget {} for {sequences} sequences",
                dir.display(),
                opts.device_budget
            )
        })?;
        Ok((reserved, plan))
    };
    let (reserved, plan) = plan_for(1)?;
    let tps = plan.predict_tokens_per_s(args.disk_gbps, args.host_gbps, args.compute_ms / 1e3);
    let mut pass_plans = Vec::new();
    for pass in PASSES {
        let sequences = match pass {
            residency::PassKind::Decode { batch } => batch,
            residency::PassKind::Prefill { .. } => 1,
        };
        pass_plans.push((pass, plan_for(sequences)?.1));
    }
    let placement = placement(&args, model.metadata(), &layout, &pass_plans)?;
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
            "calibration": placement.0,
            "placement": placement.1,
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
            "reserved {} = KV cache for {context} tokens (f16), activations and the loader's \
             margin + {} margin",
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
        print!("{}", placement.1);
        print_concurrent(&placement.0);
        println!(
            "(from this machine's figures in {}; --calibrate measures them again)",
            crate::calibration::path(&crate::calibration::home()).display()
        );
    }
    Ok(())
}

/// What the CPU's matmuls and the host→device copies achieved at the same time, beside what
/// each achieved alone (what the planner's shares rest on: `residency::placement`).
fn print_concurrent(cal: &residency::Calibration) {
    let Some(gpu) = &cal.gpu else {
        println!("no GPU: the CPU computes everything, nothing is copied beside it");
        return;
    };
    if gpu.concurrent.is_empty() {
        println!("the CPU and the copies were not measured together: their bandwidths add up");
        return;
    }
    println!("the CPU's matmul and host→device copies at the same time (alone), GB/s:");
    for c in &gpu.concurrent {
        println!(
            "  {:<5} {:>2} rows  CPU {:>6.1} ({:>6.1})  copies {:>6.1} ({:>6.1})",
            format!("{:?}", c.dtype),
            c.rows,
            c.cpu_gbps,
            c.cpu_alone_gbps,
            c.h2d_gbps,
            c.h2d_alone_gbps
        );
    }
}

/// The placement of the model on this machine (on the GPU when one is usable, else the CPU),
/// from the stored calibration, measuring what it lacks.
fn placement(
    args: &Args,
    meta: &weights_format::Metadata,
    layout: &residency::ModelLayout,
    plans: &[(residency::PassKind, residency::Plan)],
) -> anyhow::Result<(residency::Calibration, residency::PlacementPlan)> {
    let gpu = match llama::backend::cuda::cuda_usable() {
        Ok(()) => Some(llama::CudaBackend::new(0).context("opening the GPU to calibrate")?),
        Err(err) => {
            tracing::info!("placing for the CPU: {err}");
            None
        }
    };
    let units = residency::units(meta, layout);
    let cal = crate::calibration::ensure(
        &crate::calibration::home(),
        &residency::placement::dtypes_by_bytes(&units),
        gpu.as_ref(),
        args.calibrate,
        args.probe_mib,
    )?;
    let passes: Vec<(residency::PassKind, Option<&residency::Plan>)> = plans
        .iter()
        .map(|(pass, plan)| (*pass, gpu.as_ref().map(|_| plan)))
        .collect();
    let placed = residency::plan_placement(&units, &cal, args.placement.mode(), &passes)?;
    Ok((cal, placed))
}
