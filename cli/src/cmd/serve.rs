//! `gdsllm serve`: the OpenAI-compatible HTTP server (`gdsllm-server`) over the CPU model.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use gdsllm_server::{Server, ServerConfig};
use gdsllm_store::Store;

use crate::device_args::OpenArgs;
use crate::serve_models::{OpenSettings, StoreModels};

/// Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
/// /v1/embeddings, /v1/models, /v1/ws (JSON-RPC 2.0 over a WebSocket, token by token), plus
/// /health and /metrics (Prometheus); gRPC with --grpc-port. /v1/models lists the store's
/// models too: a request naming one loads it (see --max-models, --model-idle-timeout), and
/// POST /v1/models/NAME/load and /unload load and unload one (409 while it is busy). The
/// server listens at once; /health answers 503 until the model is loaded, then 200. The first line on stdout is
/// the bound address (`http://HOST:PORT`, or a JSON object with --json); logs go to stderr.
/// SIGINT/SIGTERM stop accepting requests and let in-flight ones finish (see
/// --shutdown-grace). Every flag can also be set through the environment variable shown.
#[derive(clap::Args)]
pub struct Args {
    /// The model: a name in the store, a directory, a .gguf file or hf.co/OWNER/REPO[:QUANT]
    /// (converted or pulled into the store on first use), or https://HOST/path/MODEL/ (a model
    /// served over HTTP: each blob fetched the first time it is needed and kept); default:
    /// smollm2 (pulled on first use).
    #[arg(short, long, env = "GDSLLM_MODEL")]
    pub model: Option<String>,
    /// Address to listen on; 0.0.0.0 listens on every interface.
    #[arg(long, env = "GDSLLM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (the first line on stdout says which).
    #[arg(long, env = "GDSLLM_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (repeatable; the variable takes a
    /// comma-separated list). /health and /metrics stay open. Keys are never logged.
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "GDSLLM_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// Read more API keys from a file: one per line, `#` starts a comment.
    #[arg(long, value_name = "FILE", env = "GDSLLM_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Another name the model answers to in requests and lists in /v1/models (repeatable;
    /// e.g. `gpt-4o-mini` for clients that insist on a name).
    #[arg(
        long = "alias",
        value_name = "NAME",
        env = "GDSLLM_ALIAS",
        value_delimiter = ','
    )]
    pub aliases: Vec<String>,
    /// System message inserted at the start of every chat request that has none.
    #[arg(long, value_name = "TEXT", env = "GDSLLM_SYSTEM_PROMPT")]
    pub system_prompt: Option<String>,
    /// A system prompt from a file (repeatable): `PATH` is the default for every model (like
    /// --system-prompt, which it cannot be given with); `NAME=PATH` applies to chats that name
    /// model NAME (its name or an alias), in place of the default. Inserted only into chats
    /// that have no system message of their own.
    #[arg(
        long = "system-prompt-file",
        value_name = "[NAME=]PATH",
        env = "GDSLLM_SYSTEM_PROMPT_FILE",
        value_delimiter = ','
    )]
    pub system_prompt_files: Vec<String>,
    /// Let browser pages from these origins call the API (CORS): `*` for any, or a
    /// comma-separated list such as `http://localhost:3000,https://chat.example.com`.
    /// Preflight requests are answered without an API key; the requests themselves still
    /// need one when --api-key is set.
    #[arg(long, value_name = "ORIGINS", env = "GDSLLM_CORS_ORIGINS")]
    pub cors_origins: Option<String>,
    /// Most sequences decoded together: running requests share each pass over the weights
    /// (continuous batching; new requests join between steps, their prompts prefilled in
    /// chunks alongside the running ones). Requests beyond it wait in arrival order.
    #[arg(long, value_name = "N", env = "GDSLLM_MAX_BATCH", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub max_batch: u64,
    /// KV-cache memory all running sequences may hold together, e.g. 2GiB; `auto`: room for
    /// --max-batch sequences at the full --ctx-size. Each request reserves its prompt plus
    /// max_tokens positions when it starts; while the budget is full, new requests wait (a
    /// request that would not fit even alone gets a 400).
    #[arg(long, value_name = "BYTES|auto", env = "GDSLLM_KV_BUDGET", default_value = "auto", value_parser = parse_kv_budget)]
    pub kv_budget: KvBudget,
    /// Memory for recent prompts' KV-cache positions, e.g. 512MiB; 0 turns prefix caching
    /// off. A request whose prompt starts like a recent one's (a shared system prompt, earlier
    /// turns of a chat) takes those positions from it instead of computing them, in blocks of
    /// 16 tokens; the least recently used prompts are dropped first. Held on the model's
    /// device on top of --kv-budget. /metrics counts gdsllm_prefix_cache_queries_total and
    /// gdsllm_prefix_cache_hits_total in prompt tokens.
    #[arg(long, value_name = "BYTES", env = "GDSLLM_PREFIX_CACHE_BYTES", default_value = "512MiB", value_parser = residency::parse_bytes)]
    pub prefix_cache_bytes: u64,
    /// Context size in tokens per sequence (prompt + reply); 0, or more than the model's
    /// context: the model's full context (with a warning when more).
    /// Longer prompts get a 400 that gives both numbers.
    #[arg(
        short = 'c',
        long = "ctx-size",
        env = "GDSLLM_CTX_SIZE",
        default_value_t = 4096
    )]
    pub ctx_size: usize,
    /// Largest request body accepted (413 above it), e.g. 4MiB.
    #[arg(long, value_name = "BYTES", env = "GDSLLM_BODY_LIMIT", default_value = "4MiB", value_parser = residency::parse_bytes)]
    pub body_limit: u64,
    /// Requests that may wait for the model beyond the --max-batch it runs; when that many
    /// wait, new ones get 429 with `Retry-After` at once instead of an ever longer queue.
    #[arg(
        long,
        value_name = "N",
        env = "GDSLLM_MAX_QUEUE",
        default_value_t = 256
    )]
    pub max_queue: usize,
    /// Most open client connections (lowered to fit the open-file limit). At the limit a new
    /// connection closes the oldest one with no request in flight (half-open or idle), so
    /// idle sockets cannot lock clients out.
    #[arg(
        long,
        value_name = "N",
        env = "GDSLLM_MAX_CONNECTIONS",
        default_value_t = 1024
    )]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (and to start the next request on a
    /// kept-alive connection) before the connection is closed.
    #[arg(
        long,
        value_name = "SECONDS",
        env = "GDSLLM_HEADER_TIMEOUT",
        default_value_t = 10.0
    )]
    pub header_timeout: f64,
    /// Seconds a client has to send a request's whole body (408 after that).
    #[arg(
        long,
        value_name = "SECONDS",
        env = "GDSLLM_BODY_TIMEOUT",
        default_value_t = 30.0
    )]
    pub body_timeout: f64,
    /// Seconds in-flight requests may run after SIGINT/SIGTERM before they are cancelled.
    #[arg(
        long,
        value_name = "SECONDS",
        env = "GDSLLM_SHUTDOWN_GRACE",
        default_value_t = 30
    )]
    pub shutdown_grace: u64,
    /// Also serve gRPC on this port (same host): the KServe v2 / Open Inference Protocol
    /// health, metadata and ModelInfer (embeddings) RPCs and the streaming
    /// gdsllm.v1.Generation/Generate (server/proto/). Off by default; 0 picks a free port, and
    /// the second line on stdout says which (`grpc://HOST:PORT`).
    #[arg(long, value_name = "PORT", env = "GDSLLM_GRPC_PORT")]
    pub grpc_port: Option<u16>,
    /// Most models loaded at once. A request naming another model of the store (`"model":
    /// NAME`, a store name, alias or tag) loads it on demand; at the limit the least recently
    /// used idle model is unloaded first, and when every loaded model is busy the request
    /// gets 429 with `Retry-After`. Each loaded model has its own --max-batch, --kv-budget and
    /// prefix cache, but --vram-budget and --host-cache are the whole server's: a model is
    /// loaded with what the others leave, idle models are unloaded (least recently used
    /// first) to leave it what it would take alone, and when busy models hold too much for
    /// even its smallest (all streamed) plan the request gets 429 with `Retry-After`.
    #[arg(long, value_name = "N", env = "GDSLLM_MAX_MODELS", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub max_models: u64,
    /// Unload a model other than the default (-m) after it has had no request for this long,
    /// e.g. 300, 90s, 5m, 1h; 0: never.
    #[arg(long, value_name = "DURATION", env = "GDSLLM_MODEL_IDLE_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    pub model_idle_timeout: Duration,
    /// Seconds a request for a model that is loading waits for it (503 with `Retry-After`
    /// after that).
    #[arg(
        long,
        value_name = "SECONDS",
        env = "GDSLLM_MODEL_LOAD_TIMEOUT",
        default_value_t = 600.0
    )]
    pub model_load_timeout: f64,
    /// Print the bound address as JSON: {"address": "HOST:PORT", "url": "http://HOST:PORT"}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub open: OpenArgs,
}

/// A timeout flag: a positive number of seconds.
fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} {value}: expected a positive number of seconds"))
}

/// A duration: seconds, or a number with `s`, `m` or `h` after it.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = match s.char_indices().last() {
        Some((i, 's')) => (&s[..i], 1.0),
        Some((i, 'm')) => (&s[..i], 60.0),
        Some((i, 'h')) => (&s[..i], 3600.0),
        _ => (s, 1.0),
    };
    number
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|n| Duration::try_from_secs_f64(n * unit).ok())
        .ok_or_else(|| format!("{s:?}: expected a duration such as 300, 90s, 5m or 1h"))
}

/// `--kv-budget`: a size, or `auto` (None).
#[derive(Debug, Clone, Copy)]
pub struct KvBudget(pub Option<u64>);

fn parse_kv_budget(s: &str) -> Result<KvBudget, residency::ParseBytesError> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(KvBudget(None));
    }
    residency::parse_bytes(s).map(|b| KvBudget(Some(b)))
}

/// `--vram-budget` and `--host-cache` as the server's budgets across models (`auto`: what the
/// default model is planned with at its load).
fn memory_budget(residency: &crate::residency_args::ResidencyArgs) -> gdsllm_server::MemoryBudget {
    gdsllm_server::MemoryBudget {
        device: match residency.vram_budget {
            residency::Budget::Bytes(bytes) => Some(bytes),
            residency::Budget::Auto => None,
        },
        host: match residency.host_cache {
            residency::HostCache::Bytes(bytes) => Some(bytes),
            residency::HostCache::Off => Some(0),
            residency::HostCache::Auto => None,
        },
    }
}

/// The server's system prompts: the default one and each model's own (name, prompt).
type SystemPrompts = (Option<String>, Vec<(String, String)>);

/// `--system-prompt-file`: the default prompt (with `--system-prompt`) and the per-model ones.
fn system_prompts(inline: Option<&str>, files: &[String]) -> anyhow::Result<SystemPrompts> {
    let mut default = inline.map(str::to_string);
    let mut per_model: Vec<(String, String)> = Vec::new();
    for spec in files {
        // A `NAME=` prefix only where NAME has no path separator, so that `./a=b.txt` is a path.
        let (name, path) = match spec.split_once('=') {
            Some((name, path)) if !name.is_empty() && !name.contains(['/', '\\']) => {
                (Some(name), path)
            }
            _ => (None, spec.as_str()),
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--system-prompt-file {spec}: reading {path}"))?;
        let text = text.trim_end().to_string();
        if text.is_empty() {
            bail!("--system-prompt-file {spec}: {path} is empty");
        }
        match name {
            Some(name) => {
                if per_model.iter().any(|(n, _)| n == name) {
                    bail!("--system-prompt-file: model {name} is given twice");
                }
                per_model.push((name.to_string(), text));
            }
            None if default.is_some() => bail!(
                "--system-prompt-file {spec}: a default system prompt is already set (by \
                 --system-prompt or another --system-prompt-file); name the model: NAME={path}"
            ),
            None => default = Some(text),
        }
    }
    Ok((default, per_model))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut api_keys = args.api_keys.clone();
    if let Some(path) = &args.api_key_file {
        api_keys.extend(gdsllm_server::load_api_key_file(path)?);
    }
    api_keys.retain(|k| !k.trim().is_empty());
    let (system_prompt, model_system_prompts) =
        system_prompts(args.system_prompt.as_deref(), &args.system_prompt_files)?;
    let cors_origins = args
        .cors_origins
        .as_deref()
        .map(gdsllm_server::cors::CorsOrigins::parse)
        .transpose()?;
    let config = ServerConfig {
        api_keys,
        aliases: args.aliases.clone(),
        system_prompt,
        model_system_prompts,
        cors_origins,
        max_batch: args.max_batch as usize,
        body_limit: usize::try_from(args.body_limit).context("--body-limit is too large")?,
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        max_queue: args.max_queue,
        max_connections: args.max_connections,
        header_read_timeout: seconds("--header-timeout", args.header_timeout)?,
        body_read_timeout: seconds("--body-timeout", args.body_timeout)?,
        max_models: args.max_models as usize,
        model_idle_timeout: Some(args.model_idle_timeout).filter(|d| !d.is_zero()),
        model_load_timeout: seconds("--model-load-timeout", args.model_load_timeout)?,
        memory_budget: Some(memory_budget(&args.open.residency)),
    };
    // Resolve the model before listening, so that a wrong -m fails at once.
    let dir = super::run::model_dir(args.model.as_deref())?;
    let settings = OpenSettings {
        open: args.open.clone(),
        ctx_size: args.ctx_size,
        max_batch: args.max_batch as usize,
        kv_budget: args.kv_budget.0,
        prefix_cache_bytes: args.prefix_cache_bytes,
    };
    let prepared = settings.prepare(&dir)?;
    let context = prepared.context;
    let model_id = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("gdsllm-http")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let bound: SocketAddr = listener.local_addr()?;
        let grpc_listener = match args.grpc_port {
            Some(port) => {
                let addr = format!("{}:{port}", args.host);
                let listener = tokio::net::TcpListener::bind(&addr)
                    .await
                    .with_context(|| format!("binding {addr} (--grpc-port)"))?;
                Some(listener)
            }
            None => None,
        };
        let grpc_bound = grpc_listener.as_ref().map(|l| l.local_addr()).transpose()?;
        if args.json {
            let mut line =
                serde_json::json!({"address": bound.to_string(), "url": format!("http://{bound}")});
            if let Some(g) = grpc_bound {
                line["grpc_address"] = serde_json::json!(g.to_string());
            }
            println!("{line}");
        } else {
            println!("http://{bound}");
            if let Some(g) = grpc_bound {
                println!("grpc://{g}");
            }
        }
        tracing::info!(
            address = %bound,
            model = %dir.display(),
            context,
            keys = config.api_keys.len(),
            "listening; loading the model"
        );
        // For `gdsllm ps`; removed when the server stops.
        let _registered = crate::running::register(&format!("http://{bound}"), &model_id, &dir);
        let server = Server::new(config);
        let store_models = match Store::from_env() {
            Ok(store) => {
                let models = Arc::new(StoreModels::new(store, settings.clone()));
                let default = models.default_model(&dir, &model_id);
                server.set_model_source(models.clone(), default);
                Some(models)
            }
            Err(err) => {
                tracing::warn!("no model store, serving {model_id} only: {err}");
                None
            }
        };
        let loader = server.clone();
        let (load_failed_tx, load_failed) = tokio::sync::oneshot::channel::<String>();
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let engine = settings.load(&dir, model_id, &prepared);
            match engine {
                Ok(engine) => {
                    tracing::info!(seconds = started.elapsed().as_secs_f64(), "model loaded");
                    if let (Some(models), Some(memory)) = (&store_models, engine.memory()) {
                        models.set_backend(memory.backend);
                    }
                    loader.set_engine(engine);
                }
                Err(err) => {
                    tracing::error!("{err:#}");
                    let message = format!("{err:#}");
                    loader.set_load_failed(message.clone());
                    let _ = load_failed_tx.send(message);
                }
            }
        });
        // A model that cannot load ends the server with an error instead of answering 503
        // forever.
        let failure = Arc::new(std::sync::Mutex::new(None));
        let failure_seen = failure.clone();
        let stop = async move {
            tokio::select! {
                _ = gdsllm_server::shutdown_signal() => {}
                Ok(message) = load_failed => {
                    *failure_seen.lock().expect("not poisoned") = Some(message);
                }
            }
        };
        if let Some(listener) = grpc_listener {
            tracing::info!(address = ?grpc_bound, "serving gRPC");
            let grpc = server.clone();
            tokio::spawn(async move {
                if let Err(err) = grpc.serve_grpc(listener).await {
                    tracing::error!("{err}");
                }
            });
        }
        server.serve(listener, stop).await.context("serving")?;
        if let Some(message) = failure.lock().expect("not poisoned").take() {
            bail!("loading the model failed: {message}");
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::{parse_duration, system_prompts};
    use std::time::Duration;

    #[test]
    fn durations_take_seconds_or_a_unit() {
        assert_eq!(parse_duration("300"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in ["", "m", "-1", "5 minutes", "1d"] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.contains("expected a duration"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn system_prompt_files_set_the_default_or_a_model_s_own() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.txt");
        let b = dir.path().join("b.txt");
        std::fs::write(&a, "Default prompt.\n").unwrap();
        std::fs::write(&b, "Coder prompt.").unwrap();
        let (a, b) = (a.display().to_string(), b.display().to_string());
        let (default, per_model) =
            system_prompts(None, &[a.clone(), format!("coder={b}")]).unwrap();
        assert_eq!(default.as_deref(), Some("Default prompt."));
        assert_eq!(per_model, vec![("coder".into(), "Coder prompt.".into())]);

        let err = system_prompts(Some("inline"), std::slice::from_ref(&a)).unwrap_err();
        assert!(format!("{err:#}").contains("already set"), "{err:#}");
        let twice = [format!("coder={a}"), format!("coder={b}")];
        let err = system_prompts(None, &twice).unwrap_err();
        assert!(format!("{err:#}").contains("given twice"), "{err:#}");
        let missing = dir.path().join("missing.txt").display().to_string();
        let err = system_prompts(None, &[missing]).unwrap_err();
        assert!(format!("{err:#}").contains("reading"), "{err:#}");
    }
}
