//! `gdsllm tag NAME NEW`: another name for a model in the store.

use anyhow::Context;
use gdsllm_store::Store;

/// Give a model in the store a further name (NAME or NAME:TAG, e.g. `qwen2.5:7b-q4_k_m`);
/// `-m NEW` then finds it. `gdsllm rm NEW` removes only the name.
#[derive(clap::Args)]
pub struct Args {
    /// A name the model has (see `gdsllm list`).
    pub name: String,
    /// The new name.
    pub new_name: String,
    /// Print {name, dir} as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let dir = store
        .tag(&args.name, &args.new_name)
        .with_context(|| format!("naming {} {}", args.name, args.new_name))?;
    if args.json {
        println!("{}", serde_json::json!({"name": args.new_name, "dir": dir}));
    } else {
        println!("{} → {}", args.new_name, dir.display());
    }
    Ok(())
}
