//! `gdsllm run`: generate text from a prompt (raw completion) or chat interactively, on the
//! CPU or a CUDA GPU with weights streamed through residency.

use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::{Context, bail};
use llama::{
    Backend, BatchConfig, GenerateOptions, Generation, LoadedModel, Message, OpenedModel,
    SamplerConfig, WeightSource,
};
use serde_json::json;

use crate::device_args::OpenArgs;

/// Generate text. With -p: a raw completion of the prompt, exactly as written (no chat
/// template, no BOS unless the model asks for one), streamed to stdout. Without -p: an
/// interactive chat using the model's chat template (`/bye` quits, `/set temp 0.2` changes a
/// setting, `"""` starts and ends a multi-line message).
#[derive(clap::Args)]
pub struct Args {
    /// The model: a name in the store, a directory, a .gguf file or hf.co/OWNER/REPO[:QUANT]
    /// (converted or pulled into the store on first use), or https://HOST/path/MODEL/ (served
    /// over HTTP, fetched as needed); default: smollm2 (pulled on first use).
    #[arg(short, long)]
    pub model: Option<String>,
    /// The prompt for a raw completion; without it (and -f), start an interactive chat.
    #[arg(short, long, conflicts_with = "file")]
    pub prompt: Option<String>,
    /// A file of prompts, one per line (blank lines are skipped; `-` reads stdin): each gets a
    /// raw completion, all decoded together in one batch sharing each pass over the weights.
    /// Prints every completion under a `=== [N] prompt` header, in input order.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: Option<std::path::PathBuf>,
    /// Tokens to generate at most (per reply in chat).
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
    /// Context size in tokens (KV cache positions); 0: the model's full context length; larger
    /// than the model's context: clamped to it, with a warning.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Sampling temperature; 0 is greedy (always the most likely token).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Sample only from the K most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Sample only from the smallest set of tokens whose probability reaches P (1: all).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than M times the most likely one (0: off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalise the last 64 tokens by this factor (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed; the same seed and settings give the same text (default: from the clock).
    #[arg(short, long)]
    pub seed: Option<u64>,
    /// System message for the chat (ignored with -p).
    #[arg(long)]
    pub system: Option<String>,
    /// Stop when the text contains this string (repeatable; the string is not printed).
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Print one JSON object instead of streaming text: prompt_tokens, tokens, text,
    /// finish_reason, device, timings {load_s, prompt_s, prompt_tok_per_s, gen_tok_per_s,
    /// time_to_first_token_s (from the start of the command)}, io {backend, bytes_read, gb_per_s},
    /// residency (statistics). Needs -p or -f; with -f, one object per prompt and line, in input
    /// order: index, prompt, prompt_tokens, tokens, text, finish_reason, timings {prompt_s,
    /// gen_s, gen_tok_per_s}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub open: OpenArgs,
}

impl Args {
    fn sampler(&self) -> SamplerConfig {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: 64,
            seed,
        }
    }
}

/// Finds the model directory: `-m` (see `crate::model_arg`), else the default model.
pub fn model_dir(model: Option<&str>) -> anyhow::Result<std::path::PathBuf> {
    crate::model_arg::resolve_model(model)
}

/// Opens the model where `device` says, for `sequences` sequences decoded together (1 for a
/// single prompt), with a KV cache of `ctx_size` positions each (0: the model's context).
pub fn open_model(
    model: Option<&str>,
    open: &OpenArgs,
    ctx_size: usize,
    sequences: usize,
) -> anyhow::Result<OpenedModel> {
    let dir = model_dir(model)?;
    let (device, options) = open.options(ctx_size, sequences.max(1), None)?;
    llama::open(&dir, device, &options).with_context(|| format!("loading {}", dir.display()))
}

/// Prompts of a `-f` file: one per line, blank lines skipped; `-` is stdin.
fn read_prompts(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading prompts from stdin")?
    } else {
        std::fs::read_to_string(path)
            .with_context(|| format!("reading prompts from {}", path.display()))?
    };
    let prompts: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    if prompts.is_empty() {
        bail!("{}: no prompts (one per line)", path.display());
    }
    Ok(prompts)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.json && args.prompt.is_none() && args.file.is_none() {
        bail!(
            "--json needs -p PROMPT or -f FILE (the interactive chat has no single result to print)"
        );
    }
    let started = std::time::Instant::now();
    let prompts = args.file.as_deref().map(read_prompts).transpose()?;
    let sequences = prompts.as_ref().map_or(1, Vec::len);
    let model = open_model(args.model.as_deref(), &args.open, args.ctx_size, sequences)?;
    match model {
        OpenedModel::Cpu(m) => run_on(*m, &args, prompts.as_deref(), started),
        OpenedModel::Cuda(m) => run_on(*m, &args, prompts.as_deref(), started),
        OpenedModel::Hybrid(m) => run_on(*m, &args, prompts.as_deref(), started),
    }
}

/// The prompts of `-f` in one batch, else `-p` or the chat.
fn run_on<B: Backend, W: WeightSource>(
    model: LoadedModel<B, W>,
    args: &Args,
    prompts: Option<&[String]>,
    started: std::time::Instant,
) -> anyhow::Result<()> {
    match prompts {
        Some(texts) => complete_file(model, args, texts),
        None => run_model(model, args, started),
    }
}

fn run_model<B: Backend, W: WeightSource>(
    mut model: LoadedModel<B, W>,
    args: &Args,
    started: std::time::Instant,
) -> anyhow::Result<()> {
    tracing::info!(
        "loaded in {:.2} s, context {} tokens, backend {}",
        model.load_seconds,
        model.session.model().context(),
        model.session.model().backend().name()
    );
    let options = GenerateOptions {
        max_tokens: args.n_predict,
        sampler: args.sampler(),
        stop: args.stop.clone(),
    };
    match &args.prompt {
        Some(prompt) => complete(&mut model, prompt, &options, args.json, started),
        None => chat(&mut model, options, args.system.as_deref()),
    }
}

fn complete<B: Backend, W: WeightSource>(
    model: &mut LoadedModel<B, W>,
    prompt: &str,
    options: &GenerateOptions,
    json: bool,
    started: std::time::Instant,
) -> anyhow::Result<()> {
    let ids = model.session.encode_prompt(prompt)?;
    let mut stdout = std::io::stdout().lock();
    let generation = if json {
        model.session.generate(&ids, options, |_| {})?
    } else {
        let g = model.session.generate(&ids, options, |piece| {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        })?;
        writeln!(stdout)?;
        g
    };
    // The first token is sampled right after the prompt's pass: everything since the command
    // started (resolving and loading the model, encoding, prefill) except the decode loop.
    let ttft = started.elapsed().as_secs_f64() - generation.generation_seconds;
    report(model, &generation, json, ttft)
}

/// `-f`: every prompt of the file in one batch; results in input order.
fn complete_file<B: Backend, W: WeightSource>(
    mut model: LoadedModel<B, W>,
    args: &Args,
    texts: &[String],
) -> anyhow::Result<()> {
    let prompts = texts
        .iter()
        .map(|t| model.session.encode_prompt(t))
        .collect::<Result<Vec<_>, _>>()?;
    let options = GenerateOptions {
        max_tokens: args.n_predict,
        sampler: args.sampler(),
        stop: args.stop.clone(),
    };
    let started = std::time::Instant::now();
    let session = &mut model.session;
    let config = BatchConfig::for_model(session.model(), texts.len());
    let (llama, tokenizer) = session.parts_mut();
    let generations =
        llama::generate_batch(llama, tokenizer, &prompts, &options, config, |_, _| {})?;
    let seconds = started.elapsed().as_secs_f64();
    let mut stdout = std::io::stdout().lock();
    for (i, (text, g)) in texts.iter().zip(&generations).enumerate() {
        if args.json {
            let line = json!({
                "index": i,
                "prompt": text,
                "prompt_tokens": g.prompt_tokens,
                "tokens": g.tokens,
                "text": g.text,
                "finish_reason": g.finish_reason,
                "timings": {
                    "prompt_s": g.prompt_seconds,
                    "gen_s": g.generation_seconds,
                    "gen_tok_per_s": g.generation_tokens_per_second(),
                },
            });
            writeln!(stdout, "{line}")?;
        } else {
            writeln!(stdout, "=== [{}] {text}", i + 1)?;
            writeln!(stdout, "{}", g.text)?;
        }
    }
    let generated: usize = generations.iter().map(|g| g.tokens.len()).sum();
    let stats = model
        .session
        .model()
        .weights()
        .residency_stats()
        .unwrap_or_default();
    tracing::info!(
        "{} prompts in one batch: {generated} tokens generated in {seconds:.2} s ({:.1} tok/s in all); read {:.1} MB",
        texts.len(),
        generated as f64 / seconds.max(1e-9),
        (stats.total.disk_bytes + stats.total.on_demand_bytes) as f64 / 1e6
    );
    Ok(())
}

fn report<B: Backend, W: WeightSource>(
    model: &LoadedModel<B, W>,
    g: &Generation,
    json: bool,
    ttft: f64,
) -> anyhow::Result<()> {
    let llama = model.session.model();
    let stats = llama.weights().residency_stats().unwrap_or_default();
    let bytes_read = stats.total.disk_read_bytes();
    let gb_per_s = stats.total.disk_read_gbps();
    if json {
        let out = json!({
            "prompt_tokens": g.prompt_tokens,
            "tokens": g.tokens,
            "text": g.text,
            "finish_reason": g.finish_reason,
            "device": llama.backend().name(),
            "timings": {
                "load_s": model.load_seconds,
                "prompt_s": g.prompt_seconds,
                "prompt_tok_per_s": g.prompt_tokens_per_second(),
                "gen_tok_per_s": g.generation_tokens_per_second(),
                "time_to_first_token_s": ttft,
            },
            "io": { "backend": model.io, "bytes_read": bytes_read, "gb_per_s": gb_per_s },
            "residency": stats,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        tracing::info!(
            "prompt {} tokens at {:.1} tok/s, generated {} tokens at {:.1} tok/s ({:?}); read {:.1} MB at {:.2} GB/s",
            g.prompt_tokens.len(),
            g.prompt_tokens_per_second(),
            g.tokens.len(),
            g.generation_tokens_per_second(),
            g.finish_reason,
            bytes_read as f64 / 1e6,
            gb_per_s
        );
    }
    Ok(())
}

/// Reads one user message: a line, or several between `"""` lines. `None` at end of input.
fn read_message(input: &mut impl BufRead) -> anyhow::Result<Option<String>> {
    let mut line = String::new();
    if input.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let trimmed = line.trim_end_matches(['\n', '\r']);
    let Some(first) = trimmed.strip_prefix("\"\"\"") else {
        return Ok(Some(trimmed.to_string()));
    };
    if let Some(one) = first.strip_suffix("\"\"\"") {
        return Ok(Some(one.to_string()));
    }
    let mut text = first.to_string();
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(Some(text));
        }
        let l = line.trim_end_matches(['\n', '\r']);
        if !text.is_empty() {
            text.push('\n');
        }
        if let Some(last) = l.strip_suffix("\"\"\"") {
            text.push_str(last);
            return Ok(Some(text));
        }
        text.push_str(l);
    }
}

/// Applies `/set NAME VALUE` to the sampling settings.
fn set(options: &mut GenerateOptions, name: &str, value: &str) -> anyhow::Result<()> {
    let s = &mut options.sampler;
    let f = || {
        value
            .parse::<f32>()
            .with_context(|| format!("{value:?} is not a number"))
    };
    match name {
        "temp" | "temperature" => s.temperature = f()?,
        "top-k" | "top_k" => {
            s.top_k = value
                .parse()
                .with_context(|| format!("{value:?} is not a count"))?
        }
        "top-p" | "top_p" => s.top_p = f()?,
        "min-p" | "min_p" => s.min_p = f()?,
        "repeat-penalty" | "repeat_penalty" => s.repeat_penalty = f()?,
        "seed" => {
            s.seed = value
                .parse()
                .with_context(|| format!("{value:?} is not a seed"))?
        }
        "n" | "n-predict" => {
            options.max_tokens = value
                .parse()
                .with_context(|| format!("{value:?} is not a count"))?
        }
        _ => bail!(
            "unknown setting {name:?} (temp, top-k, top-p, min-p, repeat-penalty, seed, n-predict)"
        ),
    }
    s.validate()?;
    Ok(())
}

fn chat<B: Backend, W: WeightSource>(
    model: &mut LoadedModel<B, W>,
    mut options: GenerateOptions,
    system: Option<&str>,
) -> anyhow::Result<()> {
    if model.chat_template.is_none() {
        bail!("this model has no chat template; use -p for a raw completion");
    }
    let mut messages: Vec<Message> = system
        .map(|s| Message::new("system", s))
        .into_iter()
        .collect();
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut stdout = std::io::stdout();
    eprintln!("chat: /bye to quit, /set temp 0.2 to change a setting, \"\"\" for multi-line input");
    loop {
        print!(">>> ");
        stdout.flush()?;
        let Some(text) = read_message(&mut input)? else {
            break;
        };
        let cmd = text.trim();
        if cmd.is_empty() {
            continue;
        }
        if cmd == "/bye" {
            break;
        }
        if let Some(rest) = cmd.strip_prefix("/set") {
            let parts: Vec<&str> = rest.split_whitespace().collect();
            match parts.as_slice() {
                [name, value] => match set(&mut options, name, value) {
                    Ok(()) => eprintln!("set {name} = {value}"),
                    Err(e) => eprintln!("error: {e:#}"),
                },
                _ => eprintln!("usage: /set NAME VALUE"),
            }
            continue;
        }
        if cmd.starts_with('/') {
            eprintln!("unknown command {cmd:?} (/bye, /set)");
            continue;
        }
        messages.push(Message::new("user", text));
        let ids = model.encode_chat(&messages)?;
        let g = model.session.generate(&ids, &options, |piece| {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        });
        let g = match g {
            Ok(g) => g,
            Err(e) => {
                messages.pop();
                eprintln!("error: {e:#}");
                continue;
            }
        };
        println!();
        messages.push(Message::new("assistant", g.text.clone()));
        tracing::debug!(
            "{} tokens at {:.1} tok/s ({:?})",
            g.tokens.len(),
            g.generation_tokens_per_second(),
            g.finish_reason
        );
    }
    Ok(())
}
