//! `gdsllm show NAME`: what a model is, what it takes on disk, and where a default run puts it.

use gdsllm_store::summarize;
use residency::human_bytes;

/// Show a model: architecture, parameters, tensor storage types with counts, context length,
/// chat template, bytes on disk, and the bytes per tier of the plan a default `gdsllm run`
/// makes on this machine (CPU, --vram-budget auto, --host-cache auto). NAME is anything -m
/// accepts.
#[derive(clap::Args)]
pub struct Args {
    /// The model (a name in the store, a directory, a .gguf file, a URL, ...).
    pub name: String,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let dir = crate::model_arg::resolve_model(Some(&args.name))?;
    let s = summarize(&dir)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!("model         {}", s.dir.display());
    if let Some(origin) = &s.origin {
        println!("served from   {origin}");
    }
    println!("architecture  {}", s.architecture);
    println!(
        "parameters    {:.1} M ({} layers, hidden {}, {} heads / {} KV heads, vocab {})",
        s.parameters as f64 / 1e6,
        s.n_layers,
        s.hidden_size,
        s.n_heads,
        s.n_kv_heads,
        s.vocab_size
    );
    let types: Vec<String> = s
        .tensor_types
        .iter()
        .map(|(t, c)| format!("{t} ×{} ({})", c.tensors, human_bytes(c.bytes)))
        .collect();
    println!("tensors       {}", types.join(", "));
    println!("context       {}", s.context_length);
    println!(
        "chat template {}",
        if s.chat_template { "yes" } else { "none" }
    );
    println!(
        "on disk       {} (blobs {} of {} local)",
        human_bytes(s.disk_bytes),
        human_bytes(s.local_blob_bytes),
        human_bytes(s.model_bytes)
    );
    match &s.default_plan {
        Ok(p) => {
            println!(
                "default plan  (CPU, budget {} with {} reserved for a {}-token KV cache)",
                human_bytes(p.device_budget),
                human_bytes(p.reserved_bytes),
                p.context
            );
            println!("  resident    {}", human_bytes(p.resident_bytes));
            println!("  staging     {}", human_bytes(p.ring_bytes));
            println!("  host tier   {}", human_bytes(p.host_cached_bytes));
            println!(
                "  per pass    {} from disk, {} from the host tier",
                human_bytes(p.disk_bytes_per_pass),
                human_bytes(p.host_bytes_per_pass)
            );
        }
        Err(reason) => println!("default plan  none: {reason}"),
    }
    Ok(())
}
