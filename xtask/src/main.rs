//! `cargo xtask`: developer tasks (convert, fetch, bindgen, ci).

mod bindgen;
mod ci;
mod convert;
// The CLI's progress bars, so that `cargo xtask convert | fetch` show what `gdsllm convert |
// pull` show (the CLI is a binary crate; its module is compiled here as well).
#[path = "../../cli/src/progress.rs"]
mod progress;

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
    /// Convert a GGUF file or Hugging Face directory (same code as `gdsllm convert`).
    Convert(convert::ConvertArgs),
    /// Pull a known model into the model store (same code as `gdsllm pull`).
    Fetch(convert::FetchArgs),
}

fn main() -> std::process::ExitCode {
    let result = match Cli::parse().command {
        Command::Bindgen(args) => bindgen::run(args),
        Command::Ci(args) => ci::run(args),
        Command::Convert(args) => convert::run_convert(args),
        Command::Fetch(args) => convert::run_fetch(args),
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
