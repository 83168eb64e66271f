//! The kernel paths of issue 23, each of which can be turned off so that one process can
//! compare the old and the new path (tests build a backend per choice; benches set
//! `GDSLLM_CUDA_PATHS`). `mma`, `seqs` and `flash` are on by default since the H100 runs showed
//! them correct and faster (a 7B q4_k prompt of 512 tokens 6331 -> 9210 tok/s, batched decode
//! about 2x), and `slicesum` since the H200 showed it the same bits and faster (synth 7B q4_1
//! batched decode, 8 / 32 / 64 rows: 1293 / 1976 / 2546 -> 1543 / 2689 / 2898 tok/s);
//! `superblock` stays opt-in (slower for q4_k/q5_k there). `none` restores the kernels whose
//! batched rows equal their solo rows bit for bit.

use crate::LlamaError;

/// The environment variable naming the paths a [`super::CudaBackend`] uses by default.
pub const PATHS_ENV: &str = "GDSLLM_CUDA_PATHS";

/// Which new kernel paths a [`super::CudaBackend`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaPaths {
    /// Matmuls of several rows that are not a long prompt's (batched decoding: one row per
    /// sequence) on tensor cores, each weight read once for up to 64 rows (`matmul_mma.cu`),
    /// for f16, bf16 and the quantized dtypes, on devices of compute capability 8.0 and later.
    /// Off: the eight-row kernel of `matmul.cu`, which reads the weights once per 8 rows.
    pub mma: bool,
    /// RoPE with the KV-cache stores, and decode attention, of all sequences of a batch in one
    /// launch each (off: launches per sequence). A sliding-window layer's attention, and the
    /// stores of a batch where one of its ring caches has wrapped, keep the per-sequence
    /// kernels, which know windows and rings.
    pub seqs: bool,
    /// Prompt attention (more than one query row) on tensor cores, flash-attention style (off:
    /// the tiled f32 kernel); not for a sliding-window layer (the tiled kernel knows windows).
    pub flash: bool,
    /// q4_k, q5_k and q6_k matmuls below a prompt's rows (decoding) with 16 lanes per
    /// super-block reading its quant bytes as consecutive words (`matmul_sb_*` of
    /// `kquants.cu`; off: one lane per 32-value block, `matmul_kq_impl`). One-row q6_k matmuls
    /// take the super-block kernel whether this is on or not (the GPU run showed it faster);
    /// with `mma` on, matmuls of two rows or more take the tensor cores instead.
    pub superblock: bool,
    /// The column slices of a split tensor-core matmul summed by a kernel of their own across
    /// the whole GPU (`mma_sum_slices`; off: by the last block of each tile to finish, which
    /// left most multiprocessors idle at the end of each launch). The same bits either way.
    pub slicesum: bool,
    /// A decoding row's FFN gate and up products of f16/bf16 weights and their gated
    /// activation in one launch (`matmul_*_r1_gated`; off: the matmul, then `gated_act`). The
    /// same bits either way.
    pub gated: bool,
}

impl CudaPaths {
    /// The names `parse` takes, each with what it turns on.
    pub const NAMES: [&'static str; 6] =
        ["mma", "seqs", "flash", "superblock", "slicesum", "gated"];

    /// No new path: every batched row is computed as alone, bit for bit.
    pub fn none() -> CudaPaths {
        CudaPaths {
            mma: false,
            seqs: false,
            flash: false,
            superblock: false,
            slicesum: false,
            gated: false,
        }
    }

    /// Every new path.
    pub fn all() -> CudaPaths {
        CudaPaths {
            mma: true,
            seqs: true,
            flash: true,
            superblock: true,
            slicesum: true,
            gated: true,
        }
    }

    /// A comma-separated list of names ([`CudaPaths::NAMES`]), `all`, `none` or `default`:
    /// the named paths on top of none (empty: none).
    pub fn parse(list: &str) -> Result<CudaPaths, LlamaError> {
        let mut paths = CudaPaths::none();
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "all" => paths = CudaPaths::all(),
                "none" => paths = CudaPaths::none(),
                "default" => paths = CudaPaths::default(),
                "mma" => paths.mma = true,
                "seqs" => paths.seqs = true,
                "flash" => paths.flash = true,
                "superblock" => paths.superblock = true,
                "slicesum" => paths.slicesum = true,
                "gated" => paths.gated = true,
                other => {
                    return Err(LlamaError::Config {
                        setting: PATHS_ENV,
                        message: format!(
                            "unknown kernel path `{other}` (known: {}, all, none, default)",
                            CudaPaths::NAMES.join(", ")
                        ),
                    });
                }
            }
        }
        Ok(paths)
    }

    /// The paths `GDSLLM_CUDA_PATHS` names ([`CudaPaths::default`] when it is unset).
    pub fn from_env() -> Result<CudaPaths, LlamaError> {
        match std::env::var(PATHS_ENV) {
            Ok(list) => CudaPaths::parse(&list),
            Err(std::env::VarError::NotPresent) => Ok(CudaPaths::default()),
            Err(e) => Err(LlamaError::Config {
                setting: PATHS_ENV,
                message: e.to_string(),
            }),
        }
    }
}

/// The paths the GPU runs showed correct and faster: `mma`, `seqs`, `flash`, `slicesum` and
/// `gated`.
impl Default for CudaPaths {
    fn default() -> CudaPaths {
        CudaPaths {
            superblock: false,
            ..CudaPaths::all()
        }
    }
}

impl std::fmt::Display for CudaPaths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on: Vec<&str> = [
            self.mma,
            self.seqs,
            self.flash,
            self.superblock,
            self.slicesum,
            self.gated,
        ]
        .iter()
        .zip(CudaPaths::NAMES)
        .filter(|(on, _)| **on)
        .map(|(_, name)| name)
        .collect();
        if on.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&on.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_all_and_none_and_rejects_unknown_ones() {
        assert_eq!(CudaPaths::parse("").unwrap(), CudaPaths::none());
        assert_eq!(CudaPaths::parse("default").unwrap(), CudaPaths::default());
        assert_eq!(CudaPaths::parse("all").unwrap(), CudaPaths::all());
        assert_eq!(
            CudaPaths::parse(" mma , flash").unwrap(),
            CudaPaths {
                mma: true,
                flash: true,
                ..CudaPaths::none()
            }
        );
        assert!(CudaPaths::parse("superblock").unwrap().superblock);
        assert_eq!(CudaPaths::parse("all,none").unwrap(), CudaPaths::none());
        let e = CudaPaths::parse("mma,fast").unwrap_err().to_string();
        assert!(e.contains("unknown kernel path `fast`"), "{e}");
        assert_eq!(
            CudaPaths::all().to_string(),
            "mma,seqs,flash,superblock,slicesum,gated"
        );
        assert_eq!(CudaPaths::none().to_string(), "none");
        assert_eq!(
            CudaPaths::default().to_string(),
            "mma,seqs,flash,slicesum,gated"
        );
    }
}
