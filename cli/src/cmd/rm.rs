//! `gdsllm rm NAME...`: remove models (or names) from the store.

use anyhow::Context;
use gdsllm_store::Store;
use residency::human_bytes;

/// Remove names from the store; a model's files go with its last name. A local cache of a
/// model served over HTTP is removed by its URL.
#[derive(clap::Args)]
pub struct Args {
    /// The names to remove (see `gdsllm list`).
    #[arg(required = true)]
    pub names: Vec<String>,
    /// Print a JSON array of {name, deleted, remaining_names, freed_bytes}.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let mut removed = Vec::new();
    for name in &args.names {
        let r = store
            .remove(name)
            .with_context(|| format!("removing {name}"))?;
        if !args.json {
            match &r.deleted {
                Some(dir) => println!(
                    "removed {name} ({}, {} freed)",
                    dir.display(),
                    human_bytes(r.freed_bytes)
                ),
                None => println!(
                    "removed the name {name}; the model stays as {}",
                    r.remaining_names.join(", ")
                ),
            }
        }
        removed.push(r);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&removed)?);
    }
    Ok(())
}
