//! The hybrid-placement flags (issue 24): which paths the planner may use, and the CPU's
//! threads.

use residency::PlacementMode;

/// Where matmuls may run and with how many CPU threads.
#[derive(clap::Args, Debug, Clone)]
pub struct PlacementArgs {
    /// `auto`: the CPU computes a share of each matmul of the layers streamed from the host
    /// tier, sized from this machine's measured figures so that both sides take as long;
    /// `gpu`: every matmul on the GPU (the placement before hybrid execution, for comparisons).
    #[arg(long, value_enum, default_value = "auto")]
    pub placement: PlacementArg,
    /// Threads of the CPU's matmuls (default: one per core). The calibration is per thread
    /// count.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..4096))]
    pub cpu_threads: Option<u64>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementArg {
    Auto,
    Gpu,
}

impl PlacementArgs {
    pub fn mode(&self) -> PlacementMode {
        match self.placement {
            PlacementArg::Auto => PlacementMode::Auto,
            PlacementArg::Gpu => PlacementMode::Gpu,
        }
    }

    /// Sizes the CPU's thread pool (the global rayon pool the CPU backend computes on) from
    /// `--cpu-threads`; call before anything computes.
    pub fn apply_threads(&self) -> anyhow::Result<()> {
        if let Some(n) = self.cpu_threads {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n as usize)
                .build_global()
                .map_err(|e| anyhow::anyhow!("--cpu-threads {n}: {e}"))?;
        }
        Ok(())
    }
}
