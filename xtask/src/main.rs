//! `cargo xtask`: developer tasks (convert, fetch, bindgen, ci).

mod bindgen;
mod ci;
// `cargo xtask convert | fetch` are `gdsllm convert | pull` for developers who have not built
// the CLI: the CLI is a binary crate, so its command modules (and the progress bars they use)
// are compiled here as well.
#[path = "../../cli/src/cmd/convert.rs"]
mod convert;
#[path = "../../cli/src/progress.rs"]
mod progress;
#[path = "../../cli/src/cmd/pull.rs"]
mod pull;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "GdsLLM developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Regenerate cufile-sys/src/bindings.rs from NVIDIA's cufile.h (needs libclang).
    Bindgen(bindgen::Args),
    /// The whole test suite as CI runs it: build, pull the default model, test everything.
    Ci(ci::Args),
    /// Convert a GGUF file or Hugging Face directory (`gdsllm convert`).
    Convert(convert::Args),
    /// Pull a model into the model store (`gdsllm pull`).
    Fetch(pull::Args),
}

fn main() -> std::process::ExitCode {
    let result = match Cli::parse().command {
        Command::Bindgen(args) => bindgen::run(args),
        Command::Ci(args) => ci::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Fetch(args) => pull::run(args),
    };
    // The message chain is what a developer needs; a backtrace of xtask itself is noise.
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
