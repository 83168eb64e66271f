//! `gdsllm`: run, chat, convert, verify, synth, pull, list, show, rm, tag, ps, plan, bench,
//! doctor and serve.
//!
//! Results go to stdout (text, or one JSON object with `--json`); logs go to stderr through
//! `tracing`, filtered by `RUST_LOG` (default `info`).

mod calibration;
mod cmd;
mod device_args;
mod model_arg;
mod output;
mod placement_args;
mod progress;
mod residency_args;
mod running;
mod serve_models;

use clap::{Parser, Subcommand};

/// GdsLLM: LLM inference that treats GPU memory as a cache and NVMe as the base of the memory
/// hierarchy.
#[derive(Parser)]
#[command(name = "gdsllm", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    // Each subcommand lives in `cmd/<name>.rs` with its own `Args` and `run`.
    /// Convert a GGUF file or a Hugging Face directory into the GdsLLM format.
    Convert(cmd::convert::Args),
    /// Get a model (Hugging Face, a URL, a .gguf file, a known name) into the model store.
    Pull(cmd::pull::Args),
    /// List the models in the store.
    #[command(alias = "ls")]
    List(cmd::list::Args),
    /// Show a model: architecture, parameters, tensor types, context, bytes per tier.
    Show(cmd::show::Args),
    /// Remove models (or names) from the store.
    Rm(cmd::rm::Args),
    /// Give a model in the store another name.
    Tag(cmd::tag::Args),
    /// Show what running servers hold, per tier.
    Ps(cmd::ps::Args),
    /// Check GPU, CUDA libraries, cuFile/GDS, udev and the model store; measure read speed.
    Doctor(cmd::doctor::Args),
    /// Read every blob of a model with each I/O path; GB/s against raw O_DIRECT.
    BenchIo(cmd::bench_io::Args),
    /// Write a model of a given shape with random weights (for benchmarks).
    Synth(cmd::synth::Args),
    /// Validate a model and re-read every blob against its checksum.
    Verify(cmd::verify::Args),
    /// Show what stays resident, what streams, bytes per token per tier, predicted tokens/s.
    Plan(cmd::plan::Args),
    /// Generate text from a prompt (-p), or chat interactively, on the CPU backend.
    Run(cmd::run::Args),
    /// Prompt-processing and generation tokens/s and load GB/s (like llama-bench).
    Bench(cmd::bench::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (chat, completions, embeddings).
    Serve(cmd::serve::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let cpu_threads = match &cli.command {
        Command::Run(args) => Some(args.open.placement.threads(args.open.device.may_use_gpu())),
        Command::Bench(args) => Some(args.open.placement.threads(args.open.device.may_use_gpu())),
        _ => None,
    };
    if let Some(threads) = cpu_threads {
        // Their CPU passes run on this thread: make it one of rayon's workers, so that each
        // parallel region starts at once instead of waking the pool and sleeping. The pool is
        // built once, so it takes --cpu-threads here.
        llama::CpuBackend::adopt_current_thread(threads.map(|n| n as usize));
    }
    let result: anyhow::Result<()> = match cli.command {
        Command::Convert(args) => cmd::convert::run(args),
        Command::Pull(args) => cmd::pull::run(args),
        Command::List(args) => cmd::list::run(args),
        Command::Show(args) => cmd::show::run(args),
        Command::Rm(args) => cmd::rm::run(args),
        Command::Tag(args) => cmd::tag::run(args),
        Command::Ps(args) => cmd::ps::run(args),
        Command::Doctor(args) => cmd::doctor::run(args),
        Command::BenchIo(args) => cmd::bench_io::run(args),
        Command::Synth(args) => cmd::synth::run(args),
        Command::Verify(args) => cmd::verify::run(args),
        Command::Plan(args) => cmd::plan::run(args),
        Command::Run(args) => cmd::run::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Serve(args) => cmd::serve::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
