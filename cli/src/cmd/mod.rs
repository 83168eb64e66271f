//! One module per subcommand; each has `Args` (clap) and `run(args) -> anyhow::Result<()>`.
pub mod bench;
pub mod bench_io;
pub mod convert;
pub mod doctor;
pub mod list;
pub mod plan;
pub mod ps;
pub mod pull;
pub mod rm;
pub mod run;
pub mod serve;
pub mod show;
pub mod synth;
pub mod tag;
pub mod verify;
