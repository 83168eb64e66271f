//! `gdsllm convert IN OUT`: GGUF file or Hugging Face directory → GdsLLM model directory.
//! xtask compiles this file too (`#[path]`), as `cargo xtask convert`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use gdsllm_convert::{ConvertOptions, TargetDType};

use crate::progress::BarProgress;

/// Convert a GGUF file or a Hugging Face LLaMA directory into the GdsLLM format.
#[derive(clap::Args)]
pub struct Args {
    /// A `.gguf` file, or a Hugging Face directory (config.json, model.safetensors or
    /// model.safetensors.index.json with shards, tokenizer.json, tokenizer_config.json).
    pub input: PathBuf,
    /// The model directory to create. It must not exist, unless --force is given.
    pub output: PathBuf,
    /// Storage type of the 2-D weight matrices: `keep` stores every tensor bit for bit as in
    /// the source (GGUF k-quant mixes such as Q4_K_M included); f16, bf16, q8_0, q4_1, q5_0,
    /// q5_1, q4_k, q5_k and q6_k re-encode the matrices (norms stay f32). The k-quants need
    /// rows of a multiple of 256 values.
    #[arg(long, default_value = "keep")]
    pub dtype: TargetDType,
    /// Replace OUTPUT if it exists; the old directory is removed only after the new one is
    /// complete.
    #[arg(long)]
    pub force: bool,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let options = ConvertOptions {
        dtype: args.dtype,
        force: args.force,
    };
    let progress = BarProgress::new("convert");
    let started = Instant::now();
    let report = gdsllm_convert::convert(&args.input, &args.output, &options, &progress)
        .with_context(|| {
            format!(
                "converting {} into {}",
                args.input.display(),
                args.output.display()
            )
        })?;
    let seconds = started.elapsed().as_secs_f64();
    let mb_per_s = report.source_bytes as f64 / 1e6 / seconds.max(1e-9);
    if args.json {
        let json = serde_json::json!({
            "input": args.input,
            "output": report.out,
            "dtype": args.dtype.name(),
            "tensors": report.tensors,
            "blobs": report.blobs,
            "source_bytes": report.source_bytes,
            "written_bytes": report.written_bytes,
            "seconds": seconds,
            "source_mb_per_s": mb_per_s,
        });
        println!("{json}");
    } else {
        tracing::info!(
            "{} tensors in {} blobs, {:.1} MB read in {seconds:.2} s ({mb_per_s:.0} MB/s)",
            report.tensors,
            report.blobs,
            report.source_bytes as f64 / 1e6
        );
        println!("{}", report.out.display());
    }
    Ok(())
}
