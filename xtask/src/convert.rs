//! `cargo xtask convert IN OUT` and `cargo xtask fetch [NAME]`: the same library code as
//! `gdsllm convert` / `gdsllm pull`, for developers who have not built the CLI.

use std::path::PathBuf;

use anyhow::Context;
use gdsllm_convert::{ConvertOptions, Progress, TargetDType};
use gdsllm_store::DEFAULT_MODEL;
use gdsllm_store::PullOptions;
use indicatif::{ProgressBar, ProgressStyle};

/// Arguments of `cargo xtask convert`.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// A `.gguf` file or a Hugging Face directory.
    pub input: PathBuf,
    /// The model directory to create (must not exist unless --force).
    pub output: PathBuf,
    /// keep (bit for bit), f16, bf16, q8_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k for the 2-D
    /// matrices; norms stay f32.
    #[arg(long, default_value = "keep", value_parser = parse_dtype)]
    pub dtype: TargetDType,
    /// Replace OUTPUT once the new model is complete.
    #[arg(long)]
    pub force: bool,
}

/// Arguments of `cargo xtask fetch`.
#[derive(clap::Args, Debug)]
pub struct FetchArgs {
    /// What to pull into $GDSLLM_HOME (default ~/.cache/gdsllm): anything `gdsllm pull`
    /// accepts.
    #[arg(default_value = DEFAULT_MODEL)]
    pub name: String,
    /// Download and convert again even if already present.
    #[arg(long)]
    pub force: bool,
}

fn parse_dtype(s: &str) -> Result<TargetDType, String> {
    TargetDType::from_name(s)
        .ok_or_else(|| format!("{s:?}: expected one of {}", TargetDType::names()))
}

struct Bar(ProgressBar);

impl Bar {
    fn new(what: &str) -> Bar {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("static template is valid")
            .progress_chars("=> "),
        );
        bar.set_message(what.to_string());
        Bar(bar)
    }
}

impl Progress for Bar {
    fn start(&self, total_bytes: u64) {
        self.0.set_length(total_bytes);
        self.0.set_position(0);
        self.0.reset_eta();
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

pub fn run_convert(args: ConvertArgs) -> anyhow::Result<()> {
    let options = ConvertOptions {
        dtype: args.dtype,
        force: args.force,
    };
    let report = gdsllm_convert::convert(&args.input, &args.output, &options, &Bar::new("convert"))
        .with_context(|| {
            format!(
                "converting {} into {}",
                args.input.display(),
                args.output.display()
            )
        })?;
    println!("{}", report.out.display());
    Ok(())
}

impl gdsllm_fetch::Progress for Bar {
    fn start(&self, total: u64, done: u64) {
        self.0.set_length(total);
        self.0.set_position(done);
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl gdsllm_store::PullProgress for Bar {
    fn phase(&self, what: &str) {
        self.0.set_message(what.to_string());
    }
}

pub fn run_fetch(args: FetchArgs) -> anyhow::Result<()> {
    let store = gdsllm_store::Store::from_env()?;
    let options = PullOptions {
        force: args.force,
        ..PullOptions::default()
    };
    let pulled = gdsllm_store::pull(&store, &args.name, &options, &Bar::new(&args.name))
        .with_context(|| format!("fetching {}", args.name))?;
    println!("{}", pulled.dir.display());
    Ok(())
}
