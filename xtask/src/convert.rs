//! `cargo xtask convert IN OUT` and `cargo xtask fetch [NAME]`: the same library code as
//! `gdsllm convert` / `gdsllm pull`, for developers who have not built the CLI.

use std::path::PathBuf;

use anyhow::Context;
use gdsllm_convert::{ConvertOptions, TargetDType};
use gdsllm_store::DEFAULT_MODEL;
use gdsllm_store::PullOptions;

use crate::progress::BarProgress;

/// Arguments of `cargo xtask convert`.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// A `.gguf` file or a Hugging Face directory.
    pub input: PathBuf,
    /// The model directory to create (must not exist unless --force).
    pub output: PathBuf,
    /// keep (bit for bit), f16, bf16, q8_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k for the 2-D
    /// matrices; norms stay f32.
    #[arg(long, default_value = "keep")]
    pub dtype: TargetDType,
    /// Replace OUTPUT once the new model is complete.
    #[arg(long)]
    pub force: bool,
}

/// Arguments of `cargo xtask fetch`.
#[derive(clap::Args, Debug)]
pub struct FetchArgs {
    /// What to pull into $GDSLLM_HOME (default ~/.cache/gdsllm): anything `gdsllm pull`
    /// accepts.
    #[arg(default_value = DEFAULT_MODEL)]
    pub name: String,
    /// Download and convert again even if already present.
    #[arg(long)]
    pub force: bool,
}

pub fn run_convert(args: ConvertArgs) -> anyhow::Result<()> {
    let options = ConvertOptions {
        dtype: args.dtype,
        force: args.force,
    };
    let progress = BarProgress::new("convert");
    let report = gdsllm_convert::convert(&args.input, &args.output, &options, &progress)
        .with_context(|| {
            format!(
                "converting {} into {}",
                args.input.display(),
                args.output.display()
            )
        })?;
    println!("{}", report.out.display());
    Ok(())
}

pub fn run_fetch(args: FetchArgs) -> anyhow::Result<()> {
    let store = gdsllm_store::Store::from_env()?;
    let options = PullOptions {
        force: args.force,
        ..PullOptions::default()
    };
    let pulled = gdsllm_store::pull(&store, &args.name, &options, &BarProgress::new(&args.name))
        .with_context(|| format!("fetching {}", args.name))?;
    println!("{}", pulled.dir.display());
    Ok(())
}
