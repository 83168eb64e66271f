//! `gdsllm ps`: what running servers hold.

use anyhow::Context;
use gdsllm_fetch::{Client, ClientOptions};
use residency::human_bytes;
use serde_json::Value;

use crate::running::running;

/// Show what each running `gdsllm serve` on this machine holds: each loaded model (the default
/// first; others loaded on demand) with the memory it holds per tier (device: weights, staging
/// ring, KV cache and scratch; host tier), the weight bytes held per tier (resident in device
/// memory, the staging ring, the host tier) and read per tier so far (disk, host tier, on
/// demand, network); and the server's totals against its budgets (--vram-budget,
/// --host-cache, shared by its models). With --url, ask that server only (it may run
/// elsewhere).
#[derive(clap::Args)]
pub struct Args {
    /// The server to ask, e.g. http://127.0.0.1:8080 (default: every server this machine's
    /// store knows is running).
    #[arg(long)]
    pub url: Option<String>,
    /// Print a JSON array of {url, pid, dir, models: [...], memory: {held_bytes, budget_bytes}},
    /// as each server's /api/ps says.
    #[arg(long)]
    pub json: bool,
}

/// A server's `/api/ps`, or why it could not be asked.
fn ask(client: &Client, url: &str) -> anyhow::Result<Value> {
    let endpoint = format!("{}/api/ps", url.trim_end_matches('/'));
    let bytes = client
        .get_bytes(&endpoint, 1 << 20)
        .with_context(|| format!("asking {endpoint}"))?;
    serde_json::from_slice(&bytes).with_context(|| format!("{endpoint}: not JSON"))
}

fn tiers(value: &Value) -> String {
    value
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(t, b)| format!("{t} {}", human_bytes(b.as_u64().unwrap_or(0))))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(ClientOptions {
        retries: 0,
        ..ClientOptions::default()
    });
    let targets: Vec<(String, Option<u32>, Option<std::path::PathBuf>)> = match &args.url {
        Some(url) => vec![(url.clone(), None, None)],
        None => running()?
            .into_iter()
            .map(|s| (s.url, Some(s.pid), Some(s.dir)))
            .collect(),
    };
    let mut out = Vec::new();
    for (url, pid, dir) in targets {
        let answer = if args.url.is_some() {
            ask(&client, &url)?
        } else {
            match ask(&client, &url) {
                Ok(answer) => answer,
                Err(err) => {
                    tracing::warn!("{err:#}");
                    continue;
                }
            }
        };
        out.push(serde_json::json!({
            "url": url, "pid": pid, "dir": dir, "models": answer["models"],
            "memory": answer["memory"],
        }));
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if out.is_empty() {
        println!("no gdsllm server is running (start one with `gdsllm serve`)");
    }
    for server in &out {
        let memory = &server["memory"];
        if memory.is_object() {
            let budget = if memory["budget_bytes"].is_object() {
                format!(" (budget {})", tiers(&memory["budget_bytes"]))
            } else {
                String::new()
            };
            println!(
                "{}  memory  {}{budget}",
                server["url"].as_str().unwrap_or(""),
                tiers(&memory["held_bytes"])
            );
        }
        for model in server["models"].as_array().into_iter().flatten() {
            let name = model["model"].as_str().unwrap_or("-");
            let state = model["state"].as_str().unwrap_or("?");
            println!("{}  {name}  {state}", server["url"].as_str().unwrap_or(""));
            if state == "ready" {
                println!("  memory {}", tiers(&model["memory_bytes"]));
                println!("  holds  {}", tiers(&model["held_bytes"]));
                println!("  read   {}", tiers(&model["read_bytes"]));
            } else if let Some(error) = model["error"].as_str() {
                println!("  {error}");
            }
        }
    }
    Ok(())
}
