//! `gdsllm verify MODEL`: full validation plus a re-read of every byte against its checksum,
//! and the tokenizer and chat template loaded as `run` loads them.

use anyhow::Context;
use weights_format::{FormatError, Model, VerifyProgress};

/// Validate a model directory (structure, sizes, tensor layout), then re-read every blob and
/// compare checksums, load tokenizer.json (and encode a sample with it) and render the chat
/// template for a one-message chat. Exits non-zero naming every bad file.
///
/// With `--against FILE.gguf`, also compare every tensor byte for byte with the GGUF tensor it
/// was converted from (after the same transform the converter makes: llama's Q/K row move,
/// Gemma's `1 + w` norms): a model converted with `--dtype keep` from a llama.cpp file (a
/// Q4_K_M mix, say) must hold its blocks unchanged.
#[derive(clap::Args)]
pub struct Args {
    /// The model: anything `gdsllm run -m` accepts (a name in the store, a directory, a .gguf
    /// file, hf.co/OWNER/REPO[:QUANT], a URL).
    pub model: String,
    /// The GGUF file the model was converted from: check that every tensor is bit for bit the
    /// GGUF's (one line per tensor, a summary per dtype); exits non-zero if any differs.
    #[arg(long, value_name = "FILE.gguf")]
    pub against: Option<std::path::PathBuf>,
    /// Print one JSON object on stdout: {dir, ok, metadata_error, blobs: [{file, bytes, ok,
    /// error}], tokenizer: {ok, error}, chat_template: {ok, error} (null without one), bytes,
    /// seconds, gb_per_s}, and with --against `lossless`: {all_equal, by_dtype, tensors}.
    #[arg(long)]
    pub json: bool,
    /// Accept a deliberate edit of metadata.json: validate the directory and write the
    /// checksum of metadata.json as it is now into metadata.json.xxh3, then verify.
    #[arg(long)]
    pub update_metadata_checksum: bool,
}

/// Loads the tokenizer as `run` does and checks that it encodes text into ids the model has.
fn check_tokenizer(model: &Model) -> Result<(), String> {
    let path = model.dir().join(&model.metadata().tokenizer);
    let tokenizer = llama::Tokenizer::from_file(&path).map_err(|e| e.to_string())?;
    let vocab = model.config().vocab_size;
    let ids = tokenizer
        .encode("Hello, world! 123 \u{e9}\u{4e2d}")
        .map_err(|e| e.to_string())?;
    if let Some(bad) = ids.iter().find(|&&id| id >= vocab) {
        return Err(format!(
            "{}: encodes text into token {bad}, but the model's vocab_size is {vocab}",
            path.display()
        ));
    }
    Ok(())
}

/// Compiles the chat template and renders a one-message chat with it, as `run` does.
fn check_chat_template(model: &Model) -> Option<Result<(), String>> {
    let file = &model.metadata().chat_template.as_ref()?.file;
    let check = || {
        let template =
            llama::ChatTemplate::from_file(model.dir().join(file)).map_err(|e| e.to_string())?;
        template
            .render(&[llama::Message::new("user", "Hello")], "", "", true)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    Some(check())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let dir = crate::model_arg::resolve_model(Some(&args.model))?;
    if args.update_metadata_checksum {
        Model::update_metadata_checksum(&dir)
            .with_context(|| format!("{}: invalid model", dir.display()))?;
        if !args.json {
            println!("updated {}", dir.join("metadata.json.xxh3").display());
        }
    }
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
    let tokenizer = check_tokenizer(&model);
    let template = check_chat_template(&model);
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
    let side_files_ok = tokenizer.is_ok() && template.as_ref().is_none_or(Result::is_ok);
    let lossless_ok = lossless.as_ref().is_none_or(|r| r.all_equal());
    let ok = result.is_ok() && side_files_ok && lossless_ok;
    let status =
        |r: &Result<(), String>| serde_json::json!({"ok": r.is_ok(), "error": r.as_ref().err()});
    if args.json {
        let mut json = serde_json::json!({
            "dir": dir, "ok": ok, "metadata_error": metadata_error, "blobs": blobs,
            "tokenizer": status(&tokenizer),
            "chat_template": template.as_ref().map(status),
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
        match &tokenizer {
            Ok(()) => println!("ok   {}", model.metadata().tokenizer),
            Err(e) => println!("BAD  tokenizer: {e}"),
        }
        match &template {
            Some(Ok(())) => println!("ok   chat template"),
            Some(Err(e)) => println!("BAD  chat template: {e}"),
            None => {}
        }
        println!(
            "{}: {} blobs, {:.2} GB read in {:.1} s ({:.2} GB/s): {}",
            dir.display(),
            model.blob_count(),
            bytes as f64 / 1e9,
            seconds,
            gb_per_s,
            if ok { "OK" } else { "FAILED" }
        );
    }
    result.with_context(|| format!("{}: verification failed", dir.display()))?;
    tokenizer.map_err(|e| anyhow::anyhow!("{}: tokenizer: {e}", dir.display()))?;
    if let Some(Err(e)) = template {
        anyhow::bail!("{}: chat template: {e}", dir.display());
    }
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
