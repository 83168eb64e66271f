//! One module per subcommand; each has `Args` (clap) and `run(args) -> anyhow::Result<()>`.
