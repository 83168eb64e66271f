//! One module per subcommand; each has `Args` (clap) and `run(args) -> anyhow::Result<()>`.
pub mod convert;
pub mod pull;
pub mod bench_io;
pub mod doctor;
pub mod synth;
pub mod verify;
pub mod plan;
pub mod run;
pub mod bench;
pub mod serve;
