//! `gdsllm verify MODEL`: full validation plus a re-read of every byte against its checksum.

use anyhow::Context;
use weights_format::{FormatError, Model, VerifyProgress};

/// Validate a model directory (structure, sizes, tensor layout), then re-read every blob and
/// compare checksums. Exits non-zero naming every bad file.
///
/// With `--against FILE.gguf`, also compare every tensor byte for byte with the GGUF tensor it
/// was converted from (after the same transform the converter makes: llama's Q/K row move,
/// Gemma's `1 + w` norms): a model converted with `--dtype keep` from a llama.cpp file (a
/// Q4_K_M mix, say) must hold its blocks unchanged.
#[derive(clap::Args)]
pub struct Args {
    /// A model directory, or the name of a model in the store (see `gdsllm pull`).
    pub model: String,
    /// The GGUF file the model was converted from: check that every tensor is bit for bit the
    /// GGUF's (one line per tensor, a summary per dtype); exits non-zero if any differs.
    #[arg(long, value_name = "FILE.gguf")]
    pub against: Option<std::path::PathBuf>,
    /// Print one JSON object on stdout: {dir, ok, blobs: [{file, bytes, ok, error}], bytes,
    /// seconds, gb_per_s}, and with --against `lossless`: {all_equal, by_dtype, tensors}.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let dir = gdsllm_convert::resolve_model(&args.model)
        .with_context(|| format!("finding model {:?}", args.model))?;
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
    let lossless = match &args.against {
        Some(path) => {
            let source = gdsllm_convert::convert::open_source(path)?;
            Some(
                gdsllm_convert::lossless::compare_with_source(&model, &source, true)
                    .with_context(|| format!("comparing with {}", path.display()))?,
            )
        }
        None => None,
    };
    if args.json {
        let mut json = serde_json::json!({
            "dir": dir, "ok": result.is_ok(), "metadata_error": metadata_error, "blobs": blobs,
            "bytes": bytes, "seconds": seconds, "gb_per_s": gb_per_s,
        });
        if let Some(report) = &lossless {
            json["lossless"] = serde_json::json!({
                "all_equal": report.all_equal(), "by_dtype": report.by_dtype,
                "tensors": report.tensors,
            });
        }
        println!("{json}");
    } else {
        if let Some(report) = &lossless {
            for t in &report.tensors {
                let verdict = if t.equal { "same" } else { "DIFF" };
                let detail = match (t.dtype == t.gguf_dtype, t.first_difference) {
                    (false, _) => format!(" (GGUF has {})", t.gguf_dtype),
                    (true, Some(at)) => format!(" (first difference at byte {at})"),
                    (true, None) => String::new(),
                };
                println!(
                    "{verdict} {}/{} {} {} bytes = {}{detail}",
                    t.blob, t.tensor, t.dtype, t.bytes, t.gguf_tensor
                );
            }
            for (dtype, (n, equal, bytes)) in &report.by_dtype {
                println!("{dtype}: {equal} of {n} tensors bit for bit equal ({bytes} bytes)");
            }
        }
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
        .with_context(|| format!("{}: verification failed", dir.display()))?;
    if let (Some(report), Some(path)) = (&lossless, &args.against) {
        let differ = report.tensors.iter().filter(|t| !t.equal).count();
        if differ > 0 {
            anyhow::bail!(
                "{}: {differ} of {} tensors differ from {}",
                dir.display(),
                report.tensors.len(),
                path.display()
            );
        }
        if !args.json {
            println!(
                "all {} tensors equal those of {} bit for bit",
                report.tensors.len(),
                path.display()
            );
        }
    }
    Ok(())
}
