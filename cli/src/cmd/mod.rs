//! One module per subcommand; each has `Args` (clap) and `run(args) -> anyhow::Result<()>`.
pub mod bench;
pub mod bench_io;
pub mod convert;
pub mod doctor;
pub mod plan;
pub mod pull;
pub mod run;
pub mod serve;
pub mod synth;
pub mod verify;
