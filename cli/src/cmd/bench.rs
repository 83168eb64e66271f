//! `gdsllm bench`: prompt processing and generation speed, like llama-bench's pp and tg.

use serde_json::json;

use crate::residency_args::ResidencyArgs;

/// Measure prompt processing (one pass over the weights for the whole prompt) and generation
/// (one pass per token) speed on the CPU backend, plus the read speed of the first pass.
#[derive(clap::Args)]
pub struct Args {
    /// A model directory, or the name of a model in the store; default: smollm2.
    #[arg(short, long)]
    pub model: Option<String>,
    /// Prompt tokens to process (pp).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128)]
    pub n_prompt: usize,
    /// Tokens to generate (tg).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    pub n_gen: usize,
    /// Repetitions of each test; the report gives the mean and the best.
    #[arg(short, long, default_value_t = 3)]
    pub repetitions: usize,
    /// Print one JSON object: model, load {seconds, bytes, gb_per_s}, pp {tokens, tok_per_s
    /// [per repetition]}, tg {tokens, tok_per_s [per repetition], bytes_per_token}, residency.
    #[arg(long)]
    pub json: bool,
    /// Where to compute: `cpu`, `cuda` (GPU 0, every weight resident in device memory), or
    /// `auto` (cuda when usable, else cpu with a log line saying why).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "auto"])]
    pub device: String,
    #[command(flatten)]
    pub residency: ResidencyArgs,
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(0f64, f64::max)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.device.as_str() {
        "cuda" => return run_cuda(&args),
        "auto" => match llama::backend::cuda::cuda_usable() {
            Ok(()) => return run_cuda(&args),
            Err(e) => {
                tracing::warn!("--device auto: using the CPU because CUDA is not usable: {e}")
            }
        },
        _ => {}
    }
    let context = args.n_prompt + args.n_gen + 1;
    let mut model = crate::cmd::run::open_model(args.model.as_deref(), &args.residency, context)?;
    let vocab = model.session.model().config().vocab_size as u32;
    // Ordinary text-like ids; what they are does not change the work done.
    let prompt: Vec<u32> = (0..args.n_prompt as u32)
        .map(|i| 300 + (i * 7919) % (vocab - 300))
        .collect();
    let reps = args.repetitions.max(1);

    // The first pass reads every blob from disk: that is the load speed.
    let llama = model.session.model_mut();
    let t = std::time::Instant::now();
    llama.truncate(0);
    llama.forward(&prompt[..1])?;
    let first_pass_s = t.elapsed().as_secs_f64();
    let after_load = llama.weights().stats();
    let load_bytes = after_load.total.disk_bytes + after_load.total.on_demand_bytes;
    let load_gbps = if after_load.total.io_busy_s > 0.0 {
        load_bytes as f64 / after_load.total.io_busy_s / 1e9
    } else {
        0.0
    };

    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut tg_bytes = 0u64;
    for _ in 0..reps {
        llama.truncate(0);
        let t = std::time::Instant::now();
        llama.forward(&prompt)?;
        pp.push(args.n_prompt as f64 / t.elapsed().as_secs_f64());

        let before = llama.weights().stats().total;
        let mut next = 300u32;
        let t = std::time::Instant::now();
        for _ in 0..args.n_gen {
            let logits = llama.forward(&[next])?;
            next = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(i, _)| i as u32);
        }
        tg.push(args.n_gen as f64 / t.elapsed().as_secs_f64());
        let after = llama.weights().stats().total;
        tg_bytes += (after.disk_bytes + after.host_copy_bytes + after.on_demand_bytes)
            - (before.disk_bytes + before.host_copy_bytes + before.on_demand_bytes);
        llama.truncate(0);
    }
    let bytes_per_token = tg_bytes as f64 / (reps * args.n_gen).max(1) as f64;
    let stats = llama.weights().stats();
    if args.json {
        let out = json!({
            "model": model.session.model().metadata().source,
            "threads": rayon_threads(),
            "load": { "first_pass_s": first_pass_s, "bytes": load_bytes, "gb_per_s": load_gbps, "open_s": model.load_seconds },
            "pp": { "tokens": args.n_prompt, "tok_per_s": pp, "mean": mean(&pp), "best": best(&pp) },
            "tg": { "tokens": args.n_gen, "tok_per_s": tg, "mean": mean(&tg), "best": best(&tg), "bytes_per_token": bytes_per_token },
            "residency": stats,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(args.n_prompt, args.n_gen, &pp, &tg);
        println!(
            "load: {:.1} MB in {:.2} s first pass ({:.2} GB/s read); {:.1} MB read per generated token; {} threads",
            load_bytes as f64 / 1e6,
            first_pass_s,
            load_gbps,
            bytes_per_token / 1e6,
            rayon_threads()
        );
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// pp/tg on CUDA device 0 with every weight resident (the streaming path comes with residency's
/// device memory).
fn run_cuda(args: &Args) -> anyhow::Result<()> {
    use anyhow::Context;
    let dir = crate::cmd::run::model_dir(args.model.as_deref())?;
    let context = args.n_prompt + args.n_gen + 1;
    let t = std::time::Instant::now();
    let mut llama = llama::backend::cuda::open_resident(&dir, 0, context)
        .with_context(|| format!("loading {} on CUDA device 0", dir.display()))?;
    let open_s = t.elapsed().as_secs_f64();
    let device = llama.backend().device_name().to_string();
    let vocab = llama.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..args.n_prompt as u32)
        .map(|i| 300 + (i * 7919) % (vocab - 300))
        .collect();
    let reps = args.repetitions.max(1);
    // Warm-up: first launches load the kernels.
    llama.truncate(0);
    llama.forward(&prompt[..1])?;
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        llama.truncate(0);
        let t = std::time::Instant::now();
        llama.forward(&prompt)?;
        pp.push(args.n_prompt as f64 / t.elapsed().as_secs_f64());
        let mut next = 300u32;
        let t = std::time::Instant::now();
        for _ in 0..args.n_gen {
            let logits = llama.forward(&[next])?;
            next = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(i, _)| i as u32);
        }
        tg.push(args.n_gen as f64 / t.elapsed().as_secs_f64());
    }
    let weight_bytes = llama.weights().total_bytes();
    if args.json {
        let out = json!({
            "model": llama.metadata().source,
            "device": device,
            "load": { "open_s": open_s, "resident_bytes": weight_bytes },
            "pp": { "tokens": args.n_prompt, "tok_per_s": pp, "mean": mean(&pp), "best": best(&pp) },
            "tg": { "tokens": args.n_gen, "tok_per_s": tg, "mean": mean(&tg), "best": best(&tg) },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(args.n_prompt, args.n_gen, &pp, &tg);
        println!(
            "device: {device}; {:.1} MB of weights resident; opened in {open_s:.2} s",
            weight_bytes as f64 / 1e6
        );
    }
    Ok(())
}

/// The llama-bench-style table of prompt-processing and generation rates.
fn print_table(n_prompt: usize, n_gen: usize, pp: &[f64], tg: &[f64]) {
    println!("| test   |      tok/s (mean) |  best |");
    println!(
        "| pp{:<4} | {:>17.1} | {:>5.1} |",
        n_prompt,
        mean(pp),
        best(pp)
    );
    println!(
        "| tg{:<4} | {:>17.1} | {:>5.1} |",
        n_gen,
        mean(tg),
        best(tg)
    );
}
