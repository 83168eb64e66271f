//! `gdsllm verify MODEL`: full validation plus a re-read of every byte against its checksum.

use anyhow::Context;
use weights_format::{FormatError, Model, VerifyProgress};

/// Validate a model directory (structure, sizes, tensor layout), then re-read every blob and
/// compare checksums. Exits non-zero naming every bad file.
#[derive(clap::Args)]
pub struct Args {
    /// The model: anything `gdsllm run -m` accepts (a name in the store, a directory, a .gguf
    /// file, hf.co/OWNER/REPO[:QUANT], a URL).
    pub model: String,
    /// Print one JSON object on stdout: {dir, ok, blobs: [{file, bytes, ok, error}], bytes,
    /// seconds, gb_per_s}.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let dir = crate::model_arg::resolve_model(Some(&args.model))?;
    let model = Model::open(&dir).with_context(|| format!("{}: invalid model", dir.display()))?;
    let bar = crate::progress::bytes_bar(model.total_bytes(), "verify");
    let mut blobs = Vec::new();
    let started = std::time::Instant::now();
    let result = model.verify_with(|p| match p {
        VerifyProgress::Bytes(n) => bar.inc(n),
        VerifyProgress::BlobDone {
            file,
            bytes,
            result,
            ..
        } => {
            let error = result.as_ref().err().map(|e| e.to_string());
            if !args.json {
                bar.suspend(|| match &error {
                    None => println!("ok   {file} ({bytes} bytes)"),
                    Some(e) => println!("BAD  {e}"),
                });
            }
            blobs.push(serde_json::json!({
                "file": file, "bytes": bytes, "ok": error.is_none(), "error": error,
            }));
        }
    });
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let bytes = model.total_bytes();
    let gb_per_s = bytes as f64 / seconds.max(1e-9) / 1e9;
    let metadata_error = match &result {
        Err(FormatError::VerifyFailed { errors, .. }) => errors
            .iter()
            .find(|e| e.blobs().iter().any(|b| b.starts_with("metadata.json")))
            .map(|e| e.to_string()),
        _ => None,
    };
    if args.json {
        let json = serde_json::json!({
            "dir": dir, "ok": result.is_ok(), "metadata_error": metadata_error, "blobs": blobs,
            "bytes": bytes, "seconds": seconds, "gb_per_s": gb_per_s,
        });
        println!("{json}");
    } else {
        if let Some(e) = &metadata_error {
            println!("BAD  {e}");
        }
        println!(
            "{}: {} blobs, {:.2} GB read in {:.1} s ({:.2} GB/s): {}",
            dir.display(),
            model.blob_count(),
            bytes as f64 / 1e9,
            seconds,
            gb_per_s,
            if result.is_ok() { "OK" } else { "FAILED" }
        );
    }
    result
        .map(|_| ())
        .with_context(|| format!("{}: verification failed", dir.display()))
}
