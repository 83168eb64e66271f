//! `gdsllm list`: the models in the store.

use gdsllm_store::Store;
use residency::human_bytes;

/// List the models in the store: their names (one row per name; other names of the same model
/// under ALIASES), bytes on disk, and where they came from. Local caches of models served over
/// HTTP are listed by URL, with the share of their blobs fetched so far.
#[derive(clap::Args)]
pub struct Args {
    /// Print a JSON array of {name, dir, aliases, source, disk_bytes, model_bytes, remote,
    /// added_unix}.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let rows = store.list()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!(
            "the store ({}) is empty; get a model with `gdsllm pull`",
            store.home().display()
        );
        return Ok(());
    }
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(4).max(4);
    println!("{:width$}  {:>10}  SOURCE", "NAME", "SIZE");
    for row in rows {
        let size = if row.remote {
            format!(
                "{} of {}",
                human_bytes(row.disk_bytes),
                human_bytes(row.model_bytes)
            )
        } else {
            human_bytes(row.disk_bytes)
        };
        let mut source = row.source.unwrap_or_else(|| {
            if row.remote {
                "served over HTTP (cached blobs)".into()
            } else {
                "-".into()
            }
        });
        if !row.aliases.is_empty() {
            source = format!("{source}  (also: {})", row.aliases.join(", "));
        }
        println!("{:width$}  {size:>10}  {source}", row.name);
    }
    Ok(())
}
