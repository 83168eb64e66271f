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

/// The resolved choice.
#[derive(Debug, Clone, Copy)]
pub enum Device {
    Cpu,
    Cuda {
        ordinal: usize,
        io: residency::IoChoice,
    },
}

impl DeviceArgs {
    /// Resolves `auto` by trying CUDA (and says why when it falls back to the CPU).
    pub fn resolve(&self) -> anyhow::Result<Device> {
        let io = || gds_io::io_choice_from_env(self.io.as_deref()).context("--io / GDSLLM_IO");
        match self.device {
            DeviceArg::Cpu => Ok(Device::Cpu),
            DeviceArg::Cuda => Ok(Device::Cuda {
                ordinal: self.gpu,
                io: io()?,
            }),
            DeviceArg::Auto => match llama::backend::cuda::cuda_usable_on(self.gpu) {
                Ok(()) => Ok(Device::Cuda {
                    ordinal: self.gpu,
                    io: io()?,
                }),
                Err(e) => {
                    tracing::info!(
                        "--device auto: computing on the CPU because CUDA is not usable: {e}"
                    );
                    Ok(Device::Cpu)
                }
            },
        }
    }
}
