//! `gdsllm synth`: a model of a given shape with random weights, for benchmarks.

use std::path::PathBuf;

use anyhow::Context;
use gdsllm_convert::synth::{self, PRESETS, SynthOptions, SynthShape};
use weights_format::DType;

/// Write a model of a known LLaMA shape (or a custom one) with random weights, directly in the
/// GdsLLM format. Its output text is meaningless; it exists to benchmark loading and decoding
/// at realistic sizes where no real weights can be downloaded.
///
/// Custom shapes: start from a preset and override any of --layers, --dim, --ffn, --heads,
/// --kv-heads, --head-dim, --vocab, --context, --rope-theta, --tied; or use `--shape custom`,
/// which requires --layers, --dim, --ffn, --heads and --vocab (kv-heads defaults to heads,
/// head-dim to dim/heads, untied, theta 10000, eps 1e-5, context 4096).
/// Example: `gdsllm synth --shape llama-7b --layers 4 --dtype q4_0 /tmp/llama7b-4l`.
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// llama-7b, llama-13b, llama-70b, smollm2-135m, or custom.
    #[arg(long)]
    pub shape: String,
    /// Storage type of the matrices (embedding and LM head included): f32, f16, bf16, q8_0,
    /// q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k (the k-quants need dims that are multiples
    /// of 256). Norms are f32 (f16/bf16 when --dtype is that).
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: DType,
    /// The model directory to create; it must not exist.
    pub output: PathBuf,
    /// Seed of the weights: the same seed, shape and dtype give byte-identical files.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Number of transformer layers.
    #[arg(long)]
    pub layers: Option<u32>,
    /// Hidden size.
    #[arg(long)]
    pub dim: Option<u32>,
    /// FFN intermediate size.
    #[arg(long)]
    pub ffn: Option<u32>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<u32>,
    /// Key/value heads (grouped-query attention); must divide --heads.
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// Per-head dimension (default: dim / heads).
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// Vocabulary size (at least 259: 3 special tokens and 256 byte tokens).
    #[arg(long)]
    pub vocab: Option<u32>,
    /// Context length recorded in the config.
    #[arg(long)]
    pub context: Option<u32>,
    /// RoPE base frequency.
    #[arg(long)]
    pub rope_theta: Option<f32>,
    /// Tie the LM head to the token embedding (true/false).
    #[arg(long)]
    pub tied: Option<bool>,
    /// Generator threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print {dir, bytes, seconds, gb_per_s} as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::from_name(s)
        .filter(|d| weights_format::quant::can_quantize(*d))
        .ok_or_else(|| {
            format!(
                "{s:?}: expected f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k"
            )
        })
}

fn shape(args: &Args) -> anyhow::Result<SynthShape> {
    let mut shape = if args.shape.eq_ignore_ascii_case("custom") {
        let need = |v: Option<u32>, flag: &str| {
            v.with_context(|| format!("--shape custom needs --{flag}"))
        };
        let heads = need(args.heads, "heads")?;
        SynthShape {
            n_layers: need(args.layers, "layers")?,
            hidden_size: need(args.dim, "dim")?,
            ffn_dim: need(args.ffn, "ffn")?,
            n_heads: heads,
            n_kv_heads: heads,
            head_dim: 0, // set below
            vocab_size: need(args.vocab, "vocab")?,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            context_length: 4096,
            tie_word_embeddings: false,
        }
    } else {
        SynthShape::preset(&args.shape)
            .with_context(|| format!("--shape: use one of {}, or custom", PRESETS.join(", ")))?
    };
    let dim_or_heads_changed = args.dim.is_some() || args.heads.is_some();
    if let Some(v) = args.layers {
        shape.n_layers = v;
    }
    if let Some(v) = args.dim {
        shape.hidden_size = v;
    }
    if let Some(v) = args.ffn {
        shape.ffn_dim = v;
    }
    if let Some(v) = args.heads {
        shape.n_heads = v;
        if args.kv_heads.is_none() && !shape.n_heads.is_multiple_of(shape.n_kv_heads.max(1)) {
            shape.n_kv_heads = v;
        }
    }
    if let Some(v) = args.kv_heads {
        shape.n_kv_heads = v;
    }
    if let Some(v) = args.head_dim {
        shape.head_dim = v;
    } else if dim_or_heads_changed || shape.head_dim == 0 {
        anyhow::ensure!(shape.n_heads > 0, "--heads must not be 0");
        anyhow::ensure!(
            shape.hidden_size.is_multiple_of(shape.n_heads),
            "--dim {} is not a multiple of --heads {}; give --head-dim",
            shape.hidden_size,
            shape.n_heads
        );
        shape.head_dim = shape.hidden_size / shape.n_heads;
    }
    if let Some(v) = args.vocab {
        shape.vocab_size = v;
    }
    if let Some(v) = args.context {
        shape.context_length = v;
    }
    if let Some(v) = args.rope_theta {
        shape.rope_theta = v;
    }
    if let Some(v) = args.tied {
        shape.tie_word_embeddings = v;
    }
    Ok(shape)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let options = SynthOptions {
        shape: shape(&args)?,
        dtype: args.dtype,
        seed: args.seed,
        threads: args.threads,
        shape_name: args.shape.to_ascii_lowercase(),
    };
    let total = synth::synth_bytes(&options)?;
    tracing::info!(
        "synth {} {}: {:.2} GB into {}",
        options.shape_name,
        options.dtype,
        total as f64 / 1e9,
        args.output.display()
    );
    let bar = crate::progress::bytes_bar(total, "synth");
    let report = synth::synth(&args.output, &options, &mut |n| bar.inc(n))
        .with_context(|| format!("writing {}", args.output.display()))?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}: {:.2} GB in {:.1} s ({:.2} GB/s); random weights, meaningless output",
            report.dir.display(),
            report.bytes as f64 / 1e9,
            report.seconds,
            report.gb_per_s
        );
    }
    Ok(())
}
