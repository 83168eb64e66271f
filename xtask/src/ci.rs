//! `cargo xtask ci`: the whole test suite, exactly as CI runs it (`.ci/run`).
//!
//! It builds the workspace's tests, pulls the default model with the freshly built `gdsllm`
//! (the same code path as a user's first run), then runs every test with the model's paths in
//! `GDSLLM_TEST_GGUF` / `GDSLLM_TEST_MODEL`, so tests that need the real model never download
//! anything themselves.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

#[derive(clap::Args)]
pub struct Args {
    /// Also run `cargo clippy --workspace --all-targets -- -D warnings`.
    #[arg(long)]
    pub lint: bool,
    /// Extra arguments passed to `cargo test` after `--` (e.g. a test name filter).
    #[arg(last = true)]
    pub test_args: Vec<String>,
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

fn run_step(what: &str, cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("==> {what}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    run_step(
        "cargo fmt --check",
        cargo().args(["fmt", "--all", "--", "--check"]),
    )?;
    if args.lint {
        run_step(
            "cargo clippy",
            cargo().args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]),
        )?;
    }
    // Building the tests also builds the `gdsllm` binary the CLI tests run, with the same
    // profile, so the pull below costs no extra compilation.
    run_step(
        "cargo test --workspace --no-run",
        cargo().args(["test", "--workspace", "--no-run"]),
    )?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    let gdsllm = target.join("debug").join("gdsllm");
    eprintln!("==> gdsllm pull smollm2");
    let out = Command::new(&gdsllm)
        .args(["pull", "smollm2", "--json"])
        .output()
        .with_context(|| format!("could not start {}", gdsllm.display()))?;
    if !out.status.success() {
        bail!(
            "gdsllm pull smollm2 failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let pulled: serde_json::Value = serde_json::from_slice(&out.stdout)
        .context("gdsllm pull --json did not print one JSON object")?;
    let field = |name: &str| -> anyhow::Result<String> {
        pulled[name]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("gdsllm pull --json printed no `{name}`: {pulled}"))
    };
    let (model_dir, gguf) = (field("dir")?, field("gguf")?);
    eprintln!("    model {model_dir}\n    gguf  {gguf}");
    run_step(
        "cargo test --workspace",
        cargo()
            .args(["test", "--workspace", "--"])
            .args(&args.test_args)
            .env("GDSLLM_TEST_MODEL", &model_dir)
            .env("GDSLLM_TEST_GGUF", &gguf),
    )
}
