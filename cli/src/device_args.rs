//! The device flags shared by `gdsllm run`, `bench` and `serve`.

use anyhow::Context;

/// Where the model computes.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg {
    /// A CUDA GPU when one is usable (driver, NVRTC and a device), else the CPU with a log
    /// line saying why.
    Auto,
    /// The CUDA GPU chosen with --gpu; an error when it is not usable.
    Cuda,
    /// The CPU.
    Cpu,
}

/// Which device computes and how weights reach it.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Where to compute: `auto` (a CUDA GPU when usable, else the CPU), `cuda` or `cpu`.
    #[arg(long, value_enum, default_value = "auto", env = "GDSLLM_DEVICE")]
    pub device: DeviceArg,
    /// CUDA device ordinal used with `--device cuda|auto`.
    #[arg(long, value_name = "N", default_value_t = 0, env = "GDSLLM_GPU")]
    pub gpu: usize,
    /// How weights are read into GPU memory: `auto` (cuFile where GPUDirect Storage works,
    /// else bounce), `cufile`, `bounce` (O_DIRECT into pinned host buffers, then async copies)
    /// or `host`. Also GDSLLM_IO.
    #[arg(long, value_name = "IO_PATH")]
    pub io: Option<String>,
}

impl DeviceArgs {
    /// Where to compute, for `llama::open` (which decides `auto` and says why when it falls
    /// back to the CPU), and how weights are read into GPU memory.
    pub fn resolve(&self) -> anyhow::Result<(llama::Device, residency::IoChoice)> {
        let device = match self.device {
            DeviceArg::Cpu => return Ok((llama::Device::Cpu, residency::IoChoice::Auto)),
            DeviceArg::Cuda => llama::Device::Cuda { ordinal: self.gpu },
            DeviceArg::Auto => llama::Device::Auto { ordinal: self.gpu },
        };
        let io = gds_io::io_choice_from_env(self.io.as_deref()).context("--io / GDSLLM_IO")?;
        Ok((device, io))
    }
}
