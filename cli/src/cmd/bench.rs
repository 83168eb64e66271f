//! `gdsllm bench`: prompt processing and generation speed, like llama-bench's pp and tg.

use llama::backend::cuda::LaunchCounts;
use llama::batch::DEFAULT_PREFILL_CHUNK;
use llama::{Backend, Llama, OpenedModel, WeightSource};
use serde_json::json;

use crate::device_args::OpenArgs;

/// Measure prompt processing (one pass over the weights for the whole prompt) and generation
/// (one pass per token) speed, plus the read speed of the first pass. On CUDA the weights go
/// through residency exactly as in `gdsllm run` (resident when the budget allows, streamed
/// otherwise), and the device's own copy speeds are measured as references.
#[derive(clap::Args)]
pub struct Args {
    /// The model: anything `gdsllm run -m` accepts (a name in the store, a directory, a .gguf
    /// file, hf.co/OWNER/REPO[:QUANT], a URL); default: smollm2.
    #[arg(short, long)]
    pub model: Option<String>,
    /// Prompt tokens to process (pp).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128)]
    pub n_prompt: usize,
    /// Tokens to generate (tg).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    pub n_gen: usize,
    /// Repetitions of each test; the report gives the mean and the best.
    #[arg(short, long, default_value_t = 3)]
    pub repetitions: usize,
    /// Print one JSON object: model, device, load {first_pass_s, bytes, gb_per_s, open_s}, pp
    /// {tokens, tok_per_s [per repetition], mean, best}, tg {…, bytes_per_token (streamed from
    /// disk or the host tier), weight_bytes_per_token (every weight a decode step reads)},
    /// references (CUDA: d2d_read_gbps, d2d_read_write_gbps, pinned_h2d_gbps), checksums
    /// ("first_read" or "off", see --no-checksums), residency (with checksum_bytes and
    /// checksum_seconds: what checking cost).
    #[arg(long)]
    pub json: bool,
    /// Batched decoding instead of pp/tg: for each batch size in the list (e.g. 1,4,8,16), that
    /// many sequences with -p-token prompts are prefilled, then -n decode steps are timed, every
    /// sequence gaining one token per step (one pass over the weights for all of them).
    /// Reports aggregate tok/s (all sequences), per-sequence tok/s, the speedup over batch 1
    /// and the weight bytes streamed per generated token. With --json: batch [{batch,
    /// tok_per_s [per repetition], mean, best, per_seq_tok_per_s, bytes_per_token}].
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub batch: Vec<u64>,
    /// With --batch: hand each sequence's logits back to the host and take the greedy token
    /// there, as requests that sample do (by default the sequences are greedy, and the backend
    /// takes the argmax where the logits are: on a GPU only the ids come back).
    #[arg(long, requires = "batch")]
    pub logits_to_host: bool,
    /// Skip the untimed warm-up before the timed repetitions (one prompt pass of -p tokens and
    /// one decode step, as llama-bench does; with --batch, two decode steps of each batch after
    /// its prefill): without it the first repetition also pays the one-time costs of a new
    /// shape (cuBLAS choosing and loading its kernels for the prompt's GEMMs, memory pools and
    /// buffers growing, the decode step's graph being recorded).
    #[arg(long)]
    pub no_warmup: bool,
    #[command(flatten)]
    pub open: OpenArgs,
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(0f64, f64::max)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let batch_sizes = batch_sizes(&args.batch);
    let most = batch_sizes.iter().copied().max().unwrap_or(1);
    let context = if batch_sizes.is_empty() {
        args.n_prompt + args.n_gen + 1
    } else {
        batch_context(args.n_prompt, args.n_gen, most)
    };
    let model = crate::cmd::run::open_model(args.model.as_deref(), &args.open, context, most)?;
    match model {
        OpenedModel::Cpu(mut model) => {
            let open_s = model.load_seconds;
            let llama = model.session.model_mut();
            let cpu = json!({"mode": "cpu"});
            if !batch_sizes.is_empty() {
                let rows = bench_batches(llama, &batch_sizes, &args, streamed_total)?;
                let head = json!({
                    "model": llama.metadata().source,
                    "threads": rayon_threads(),
                    "device": "cpu",
                    "checksums": args.open.residency.checksums(),
                    "residency": llama.weights().residency_stats(),
                    "placement": cpu,
                });
                return print_batches(&args, &rows, head, &|_| None);
            }
            bench(
                llama,
                &args,
                open_s,
                &model.io,
                json!(null),
                &|_| None,
                &|_| cpu.clone(),
                &|_| None,
            )
        }
        OpenedModel::Cuda(model) => {
            bench_gpu(*model, &args, &batch_sizes, |be| be, |_| json!(null))
        }
        OpenedModel::Hybrid(model) => bench_gpu(
            *model,
            &args,
            &batch_sizes,
            |be| be.primary(),
            |be| {
                let stats = be.stats();
                let c = stats.counts();
                // Where each kind of pass spent its time: the CPU's matmuls, waiting for the
                // GPU before a split call, bringing the CPU's outputs over.
                let passes: Vec<_> = stats
                    .pass_times()
                    .into_iter()
                    .map(|(rows, t)| {
                        json!({
                            "rows": rows, "passes": t.passes, "seconds": t.seconds,
                            "cpu_seconds": t.helper_seconds, "gpu_wait_seconds": t.wait_seconds,
                            "merge_seconds": t.merge_seconds, "cpu_bytes": t.helper_bytes,
                            "cpu_gbps": t.helper_gbps(), "split_matmuls": t.splits,
                        })
                    })
                    .collect();
                json!({
                    "cpu_rows": c.helper_rows, "cpu_bytes": c.helper_bytes,
                    "gpu_rows": c.primary_rows, "gpu_bytes": c.primary_bytes,
                    "split_matmuls": c.splits, "passes": passes,
                })
            },
        ),
    }
}

/// The bench on a GPU (`cuda`: the CUDA backend of `B`; `split`: what each side of a split
/// computed), with the placement planner's prediction for each pass beside what it achieves.
fn bench_gpu<B: Backend>(
    mut model: llama::LoadedModel<B, llama::backend::cuda::CudaWeights>,
    args: &Args,
    batch_sizes: &[usize],
    cuda: fn(&B) -> &llama::CudaBackend,
    split: fn(&B) -> serde_json::Value,
) -> anyhow::Result<()> {
    let open_s = model.load_seconds;
    let llama = model.session.model_mut();
    let be = cuda(llama.backend());
    let (d2d_read, d2d_rw) = be.measure_copy_gbps(1 << 30)?;
    let h2d = be.measure_pinned_h2d_gbps(1 << 30)?;
    let references = json!({
        "device_name": be.device_name(),
        "d2d_read_gbps": d2d_read,
        "d2d_read_write_gbps": d2d_rw,
        "pinned_h2d_gbps": h2d,
    });
    let mode = args.open.placement.mode();
    let predict = crate::calibration::predictor(
        llama.metadata(),
        llama.weights().residency().plan(),
        be,
        mode,
    );
    let placement = |be: &B| {
        json!({
            "mode": mode,
            "cpu_threads": rayon_threads(),
            "split": split(be),
        })
    };
    if !batch_sizes.is_empty() {
        let rows = bench_batches(llama, batch_sizes, args, streamed_total)?;
        let head = json!({
            "model": llama.metadata().source,
            "device": cuda(llama.backend()).device_name(),
            "io_backend": model.io,
            "checksums": args.open.residency.checksums(),
            "references": references,
            "residency": llama.weights().residency_stats(),
            "placement": placement(llama.backend()),
        });
        return print_batches(args, &rows, head, &predict);
    }
    let counts = |be: &B| Some(cuda(be).launch_counts());
    bench(
        llama, args, open_s, &model.io, references, &counts, &placement, &predict,
    )
}

/// Bytes the weight source has brought in so far: from disk, from the host tier, on demand.
fn streamed_total<W: WeightSource>(weights: &W) -> u64 {
    weights.residency_stats().map_or(0, |s| {
        s.total.disk_bytes + s.total.host_copy_bytes + s.total.on_demand_bytes
    })
}

/// Bytes of weights one decode step reads: every blob, except an untied embedding table of
/// which only one row is read.
fn weight_bytes_per_token<B: Backend, W: WeightSource>(llama: &Llama<B, W>) -> u64 {
    let tied = llama.config().tie_word_embeddings;
    llama
        .metadata()
        .blobs
        .iter()
        .filter(|b| tied || b.file != weights_format::names::EMBED_BLOB)
        .map(|b| b.length)
        .sum()
}

fn streamed_bytes<B: Backend, W: WeightSource>(llama: &Llama<B, W>) -> u64 {
    streamed_total(llama.weights())
}

/// The first id of `bench`'s text-like prompts, and the token its decode steps (timed and
/// warm-up) start from (half the vocabulary when that is smaller): ids below it are often
/// special tokens, which some models treat apart.
const FIRST_TEXT_ID: u32 = 300;

/// [`FIRST_TEXT_ID`] for a vocabulary of `vocab` ids.
fn first_text_id(vocab: u32) -> u32 {
    FIRST_TEXT_ID.min(vocab / 2)
}

/// `len` ordinary text-like ids (from [`first_text_id`] on), different for each `seq`; what
/// they are does not change the work done.
fn text_prompt(vocab: u32, len: usize, seq: u32) -> Vec<u32> {
    let first = first_text_id(vocab);
    (0..len as u32)
        .map(|i| first + (i * 7919 + seq * 104_729) % (vocab - first))
        .collect()
}

/// pp and tg: `launch_counts` reads the kernels run so far (CUDA), `placement` what the run
/// placed where (read after it), `predict` the planner's tok/s for a pass.
#[allow(clippy::too_many_arguments)]
fn bench<B: Backend, W: WeightSource>(
    llama: &mut Llama<B, W>,
    args: &Args,
    open_s: f64,
    io_backend: &str,
    references: serde_json::Value,
    launch_counts: &dyn Fn(&B) -> Option<LaunchCounts>,
    placement: &dyn Fn(&B) -> serde_json::Value,
    predict: &dyn Fn(residency::PassKind) -> Option<f64>,
) -> anyhow::Result<()> {
    let vocab = llama.config().vocab_size as u32;
    let first_id = first_text_id(vocab);
    let prompt = text_prompt(vocab, args.n_prompt, 0);
    let reps = args.repetitions.max(1);

    // The first pass reads every blob from disk: that is the load speed (and, on CUDA, it
    // compiles or loads the kernels).
    let t = std::time::Instant::now();
    llama.truncate(0);
    llama.forward(&prompt[..1])?;
    let first_pass_s = t.elapsed().as_secs_f64();
    let after_load = llama.weights().residency_stats().unwrap_or_default();
    let load_bytes = after_load.total.disk_read_bytes();
    let load_gbps = after_load.total.disk_read_gbps();

    if !args.no_warmup {
        llama.truncate(0);
        if args.n_prompt > 1 {
            llama.forward(&prompt)?;
        }
        if args.n_gen > 0 {
            llama.forward_greedy(&[first_id])?;
        }
    }

    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut tg_bytes = 0u64;
    // Kernels and stream calls over the timed decode steps (CUDA): the fixed cost per token.
    let mut tg_launches: Option<LaunchCounts> = None;
    for _ in 0..reps {
        llama.truncate(0);
        let t = std::time::Instant::now();
        llama.forward(&prompt)?;
        pp.push(args.n_prompt as f64 / t.elapsed().as_secs_f64());

        let before = streamed_bytes(llama);
        let counts_before = launch_counts(llama.backend());
        let mut next = first_id;
        let t = std::time::Instant::now();
        for _ in 0..args.n_gen {
            next = llama.forward_greedy(&[next])?;
        }
        tg.push(args.n_gen as f64 / t.elapsed().as_secs_f64());
        tg_bytes += streamed_bytes(llama) - before;
        if let (Some(a), Some(b)) = (counts_before, launch_counts(llama.backend())) {
            let sum = tg_launches.get_or_insert_default();
            sum.kernels += b.kernels - a.kernels;
            sum.stream_calls += b.stream_calls - a.stream_calls;
        }
        llama.truncate(0);
    }
    let tokens = (reps * args.n_gen).max(1) as f64;
    let bytes_per_token = tg_bytes as f64 / tokens;
    let per_token =
        tg_launches.map(|c| (c.kernels as f64 / tokens, c.stream_calls as f64 / tokens));
    let weight_bytes = weight_bytes_per_token(llama);
    let stats = llama.weights().residency_stats();
    let device = llama.backend().name();
    if args.json {
        let out = json!({
            "model": llama.metadata().source,
            "device": device,
            "io_backend": io_backend,
            "checksums": args.open.residency.checksums(),
            "threads": rayon_threads(),
            "load": { "first_pass_s": first_pass_s, "bytes": load_bytes, "gb_per_s": load_gbps, "open_s": open_s },
            "pp": {
                "tokens": args.n_prompt, "tok_per_s": pp, "mean": mean(&pp), "best": best(&pp),
                "predicted_tok_s": predict(residency::PassKind::Prefill { rows: args.n_prompt }),
            },
            "tg": {
                "tokens": args.n_gen, "tok_per_s": tg, "mean": mean(&tg), "best": best(&tg),
                "predicted_tok_s": predict(residency::PassKind::Decode { batch: 1 }),
                "bytes_per_token": bytes_per_token, "weight_bytes_per_token": weight_bytes,
                "kernels_per_token": per_token.map(|p| p.0),
                "stream_calls_per_token": per_token.map(|p| p.1),
            },
            "references": references,
            "residency": stats,
            "placement": placement(llama.backend()),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(args.n_prompt, args.n_gen, &pp, &tg);
        println!(
            "{device} (reads: {io_backend}); load: {:.1} MB in {:.2} s first pass ({:.2} GB/s read); \
             {:.1} MB streamed and {:.1} MB of weights read per generated token; {} threads",
            load_bytes as f64 / 1e6,
            first_pass_s,
            load_gbps,
            bytes_per_token / 1e6,
            weight_bytes as f64 / 1e6,
            rayon_threads()
        );
        if let Some((kernels, calls)) = per_token {
            println!(
                "per generated token: {kernels:.1} kernels run, {calls:.1} calls on the stream"
            );
        }
        if !references.is_null() {
            println!("references: {references}");
        }
    }
    Ok(())
}

fn rayon_threads() -> usize {
    llama::CpuBackend::threads()
}

/// The batch sizes to run, in the order given, each once.
fn batch_sizes(list: &[u64]) -> Vec<usize> {
    let mut sizes: Vec<usize> = Vec::new();
    for &b in list {
        if !sizes.contains(&(b as usize)) {
            sizes.push(b as usize);
        }
    }
    sizes
}

/// The context for a batched run of up to `most` sequences: room for a prompt, the tokens
/// sampled while the other prompts are still being prefilled (one per prefill step, with the
/// default chunk) and the timed decode steps. (Both loaders size a batch's pass, `most` rows
/// plus a chunk, apart from the context, so a 7B model's KV caches stay small.)
fn batch_context(n_prompt: usize, n_gen: usize, most: usize) -> usize {
    let prefill_steps = (most * n_prompt.max(1)).div_ceil(DEFAULT_PREFILL_CHUNK);
    n_prompt + n_gen + prefill_steps + BATCH_WARMUP_STEPS + 2
}

/// Untimed decode steps of every batch before its timed ones (unless `--no-warmup`): the first
/// steps at a new batch size also pay one-time costs (buffers growing to the new shape), which
/// made a batch of 32's first repetition on the H200 0.97× llama-batched-bench where later
/// ones made 1.05× (BENCHMARKS.md, 2026-11-28).
const BATCH_WARMUP_STEPS: usize = 2;

/// One batch size's results.
struct BatchRow {
    batch: usize,
    /// Aggregate tokens per second of each repetition.
    tok_per_s: Vec<f64>,
    bytes_per_token: f64,
}

/// Batched decoding over any backend and weight source: for each size, `size` sequences with
/// different prompts of `n_prompt` tokens are prefilled (untimed), then `n_gen` steps in which
/// every sequence decodes are timed. `streamed` reads the weight source's total bytes brought
/// in so far (0 for resident weights).
fn bench_batches<B: llama::Backend, W: llama::WeightSource>(
    llama: &mut llama::Llama<B, W>,
    sizes: &[usize],
    args: &Args,
    streamed: impl Fn(&W) -> u64,
) -> anyhow::Result<Vec<BatchRow>> {
    use std::collections::HashSet;
    let vocab = llama.config().vocab_size as u32;
    let reps = args.repetitions.max(1);
    let n_prompt = args.n_prompt.max(1);
    let mut rows = Vec::new();
    for &size in sizes {
        let mut config = llama::BatchConfig::for_model(llama, size);
        config.prefill_chunk = config
            .prefill_chunk
            .min(llama.max_rows().saturating_sub(size).max(1));
        let prefill_steps = (size * n_prompt).div_ceil(config.prefill_chunk);
        // Nobody may finish inside the timed steps.
        let max_new = args.n_gen + prefill_steps + BATCH_WARMUP_STEPS + 2;
        if n_prompt + max_new > llama.context() {
            anyhow::bail!(
                "batch {size}: {n_prompt} prompt + {max_new} tokens exceed the context {}",
                llama.context()
            );
        }
        let (mut tok_per_s, mut bytes, mut tokens) = (Vec::new(), 0u64, 0usize);
        let choosing = if args.logits_to_host {
            llama::Choosing::FromLogits
        } else {
            llama::Choosing::Greedy
        };
        for _ in 0..reps {
            let mut batcher = llama::Batcher::new(llama, config)?;
            for s in 0..size as u32 {
                batcher.submit_choosing(text_prompt(vocab, n_prompt, s), max_new, choosing)?;
            }
            // Greedy, as a server's greedy requests (with --logits-to-host, from the logits).
            let greedy = |_: llama::SeqId, s: llama::Scores<'_>| Some(s.greedy());
            let mut started: HashSet<llama::SeqId> = HashSet::new();
            while started.len() < size {
                batcher.step(llama, |id, l| {
                    started.insert(id);
                    greedy(id, l)
                })?;
            }
            if !args.no_warmup {
                for _ in 0..BATCH_WARMUP_STEPS {
                    batcher.step(llama, greedy)?;
                }
            }
            let before = streamed(llama.weights());
            let mut n = 0usize;
            let t = std::time::Instant::now();
            for _ in 0..args.n_gen {
                let ended = batcher.step(llama, |id, l| {
                    n += 1;
                    greedy(id, l)
                })?;
                debug_assert!(ended.is_empty());
            }
            let seconds = t.elapsed().as_secs_f64();
            bytes += streamed(llama.weights()) - before;
            tokens += n;
            tok_per_s.push(n as f64 / seconds.max(1e-9));
        }
        rows.push(BatchRow {
            batch: size,
            tok_per_s,
            bytes_per_token: bytes as f64 / tokens.max(1) as f64,
        });
    }
    Ok(rows)
}

/// The batched-decoding table, or one JSON object (`head` plus `batch`).
fn print_batches(
    args: &Args,
    rows: &[BatchRow],
    mut head: serde_json::Value,
    predict: &dyn Fn(residency::PassKind) -> Option<f64>,
) -> anyhow::Result<()> {
    let base = rows
        .iter()
        .find(|r| r.batch == 1)
        .map(|r| mean(&r.tok_per_s));
    if args.json {
        head["n_prompt"] = json!(args.n_prompt);
        head["n_gen"] = json!(args.n_gen);
        head["batch"] = rows
            .iter()
            .map(|r| {
                let m = mean(&r.tok_per_s);
                json!({
                    "batch": r.batch,
                    "tok_per_s": r.tok_per_s,
                    "mean": m,
                    "best": best(&r.tok_per_s),
                    "per_seq_tok_per_s": m / r.batch as f64,
                    "speedup_vs_batch1": base.map(|b| m / b),
                    "bytes_per_token": r.bytes_per_token,
                    "predicted_tok_s": predict(residency::PassKind::Decode { batch: r.batch }),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&head)?);
        return Ok(());
    }
    println!(
        "| batch | aggregate tok/s (mean) |   best | per-seq tok/s | x batch 1 | MB streamed / token |"
    );
    for r in rows {
        let m = mean(&r.tok_per_s);
        let speedup = base.map_or("-".to_string(), |b| format!("{:.2}", m / b));
        println!(
            "| {:>5} | {:>22.1} | {:>6.1} | {:>13.1} | {:>9} | {:>19.3} |",
            r.batch,
            m,
            best(&r.tok_per_s),
            m / r.batch as f64,
            speedup,
            r.bytes_per_token / 1e6
        );
    }
    println!(
        "prompts of {} tokens; {} timed decode steps per repetition, {} repetitions",
        args.n_prompt,
        args.n_gen,
        args.repetitions.max(1)
    );
    Ok(())
}

/// The llama-bench-style table of prompt-processing and generation rates.
fn print_table(n_prompt: usize, n_gen: usize, pp: &[f64], tg: &[f64]) {
    println!("| test   |      tok/s (mean) |  best |");
    println!(
        "| pp{:<4} | {:>17.1} | {:>5.1} |",
        n_prompt,
        mean(pp),
        best(pp)
    );
    println!(
        "| tg{:<4} | {:>17.1} | {:>5.1} |",
        n_gen,
        mean(tg),
        best(tg)
    );
}
