//! The hybrid-placement flags (issue 24): which paths the planner may use, and the CPU's
//! threads.

use residency::PlacementMode;

/// Where matmuls may run and with how many CPU threads.
#[derive(clap::Args, Debug, Clone)]
pub struct PlacementArgs {
    /// `gpu` (the default until the split is measured faster on the GPU machine): every
    /// matmul on the GPU, layers that do not fit streamed to it; `auto`: the CPU computes a
    /// share of each matmul of the layers streamed from the host tier (--host-cache), sized
    /// from this machine's measured figures (`gdsllm plan --calibrate`, measured on first
    /// use) so that both sides take as long. No effect on the CPU.
    #[arg(long, value_enum, default_value = "gpu")]
    pub placement: PlacementArg,
    /// Threads of the CPU's matmuls (default: one per core; with `--placement auto` on a GPU,
    /// three quarters of the cores, leaving the rest to the threads that copy the weights and
    /// drive the GPU). The calibration is per thread count.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..4096))]
    pub cpu_threads: Option<u64>,
    /// With `--placement auto`: give the CPU this share (0 to 1) of the rows of every split
    /// matmul of passes of up to 8 rows, instead of the planner's share (a prefill chunk still
    /// gets none). For measuring which share is fastest on this machine, to check the planner.
    #[arg(long, value_name = "SHARE", value_parser = parse_share)]
    pub cpu_share: Option<f64>,
}

fn parse_share(s: &str) -> Result<f64, String> {
    let share: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if (0.0..=1.0).contains(&share) {
        Ok(share)
    } else {
        Err(format!("{share} is not a share between 0 and 1"))
    }
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

    /// The CPU's threads for a model opened on `gpu` (whether it may run on a GPU): the flag,
    /// else three quarters of the cores for a split with a GPU (measured on the H100 machine's
    /// 16 cores, f16 7B with 4 GiB: 12 threads decoded batch 8 at 42.2 tok/s where 16 made 35.9,
    /// which spent a fifth of each pass waiting to read the GPU's activations back; batch 1
    /// the same), else `None` (one per core).
    pub fn threads(&self, gpu: bool) -> Option<u64> {
        self.cpu_threads.or_else(|| {
            (gpu && self.mode() == PlacementMode::Auto).then(|| {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
                (cores - cores / 4).max(1)
            })
        })
    }

    /// Sizes the CPU's thread pool (the global rayon pool the CPU backend computes on) from
    /// [`threads`](Self::threads); call before anything computes.
    pub fn apply_threads(&self, gpu: bool) -> anyhow::Result<()> {
        static APPLIED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        if let Some(n) = self.threads(gpu) {
            // A second model of the same process asks again: the pool is already sized.
            if APPLIED.get() == Some(&n) {
                return Ok(());
            }
            if let Err(e) = rayon::ThreadPoolBuilder::new()
                .num_threads(n as usize)
                .build_global()
            {
                // `run` and `bench` size the pool at start-up (`main`), from this flag.
                if rayon::current_num_threads() != n as usize {
                    anyhow::bail!("--cpu-threads {n}: {e}");
                }
            }
            let _ = APPLIED.set(n);
        }
        Ok(())
    }
}

/// `--placement auto` on CUDA device `ordinal`: the loader asks for this machine's figures
/// once it knows the model's dtypes; they come from `$GDSLLM_HOME/calibration.json`, and what
/// is missing there is measured (on this device) and kept.
/// `cpu_share` (`--cpu-share`) replaces the planner's share of passes of up to
/// [`residency::GpuRates::SPLIT_MAX_ROWS`] rows.
pub fn hybrid_options(ordinal: usize, cpu_share: Option<f64>) -> llama::hybrid::HybridOptions {
    let calibrate = move |dtypes: &[weights_format::DType]| {
        let gpu = llama::CudaBackend::new(ordinal).map_err(|e| e.to_string())?;
        crate::calibration::ensure(&crate::calibration::home(), dtypes, Some(&gpu), false, None)
            .map_err(|e| format!("{e:#}"))
    };
    llama::hybrid::HybridOptions {
        calibrate: Some(std::sync::Arc::new(calibrate)),
        force_cpu_fraction: cpu_share,
        force_max_rows: cpu_share.map(|_| residency::GpuRates::SPLIT_MAX_ROWS),
    }
}
