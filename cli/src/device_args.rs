//! The device flags shared by `gdsllm run`, `bench` and `serve`, and with the residency flags
//! the options those commands open a model with.

use anyhow::Context;

use crate::placement_args::PlacementArgs;
use crate::residency_args::ResidencyArgs;

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
    /// CPU only: f32 activations for q4_0/q4_1/q8_0 weights and for k-quant prompt rows (the
    /// float reference's agreement the golden tests check) instead of the default 8-bit
    /// activations with integer dot products for decode and prompt rows, as llama.cpp (2–5×
    /// faster; logits move by ~1 %).
    #[arg(long, env = "GDSLLM_CPU_EXACT")]
    pub cpu_exact: bool,
}

impl DeviceArgs {
    /// Whether the model may run on a GPU: `cuda`, or `auto` where the CUDA driver library
    /// loads (a machine without one computes on the CPU, with every core).
    pub fn may_use_gpu(&self) -> bool {
        match self.device {
            DeviceArg::Cpu => false,
            DeviceArg::Cuda => true,
            DeviceArg::Auto => gds_io::gpu::cuda_driver_present(),
        }
    }

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

/// Where and how `gdsllm run`, `bench` and `serve` open a model: the device and residency flags.
#[derive(clap::Args, Debug, Clone)]
pub struct OpenArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub residency: ResidencyArgs,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

impl OpenArgs {
    /// The device and the `llama::open` options for `sequences` sequences of `context`
    /// positions each (0: the model's context).
    pub fn options(
        &self,
        context: usize,
        sequences: usize,
        kv_budget: Option<u64>,
    ) -> anyhow::Result<(llama::Device, llama::OpenOptions)> {
        let (device, io) = self.device.resolve()?;
        self.placement.apply_threads(self.device.may_use_gpu())?;
        if self.placement.cpu_share.is_some()
            && self.placement.mode() != residency::PlacementMode::Auto
        {
            anyhow::bail!("--cpu-share sets the CPU's share of a split: it needs --placement auto");
        }
        let hybrid = match (self.placement.mode(), device) {
            (residency::PlacementMode::Gpu, _) | (_, llama::Device::Cpu) => None,
            (
                residency::PlacementMode::Auto,
                llama::Device::Auto { ordinal } | llama::Device::Cuda { ordinal },
            ) => Some(crate::placement_args::hybrid_options(
                ordinal,
                self.placement.cpu_share,
            )),
        };
        let options = llama::OpenOptions {
            hybrid,
            // The loader reserves the KV caches and activations itself (it knows their layout).
            residency: self.residency.options(0),
            context,
            sequences,
            kv_budget,
            io,
            cpu_exact: self.device.cpu_exact,
        };
        Ok((device, options))
    }
}
