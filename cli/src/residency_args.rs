//! The residency flags shared by `gdsllm run`, `bench`, `serve` and `plan`.

use residency::{BlobChecksums, Budget, HostCache, Policy, ResidencyOptions};

/// How much device memory to use and what to keep in it.
#[derive(clap::Args, Debug, Clone)]
pub struct ResidencyArgs {
    /// Device memory budget for weights, e.g. 4GiB, 512MiB, 1.5G (G = GiB; GB = 10^9), or
    /// `auto` (GPU: free device memory; CPU: 60% of available RAM). KV cache, activations and
    /// a safety margin are taken off it first. For `serve`: the whole server's, across the
    /// models it has loaded (`auto`: as the default model finds it at its load).
    #[arg(long, value_name = "BYTES|auto", default_value = "auto")]
    pub vram_budget: Budget,
    /// Host-memory tier for streamed layers (pinned on GPU): they stay in RAM after their
    /// first read and are copied up instead of re-read from disk. `auto`: 60% of available
    /// RAM minus what the device tier already takes from it; `off`: always read from disk.
    /// For `serve`: the whole server's, across the models it has loaded.
    #[arg(long, value_name = "BYTES|auto|off", default_value = "auto")]
    pub host_cache: HostCache,
    /// Prefetch depth: how many blobs are read ahead of the one being computed. The staging
    /// ring has prefetch+1 slots; deeper hides disk jitter but costs one slot of memory each.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..64))]
    pub prefetch: u64,
    /// Keep exactly N layers resident instead of as many as fit the budget.
    #[arg(long, value_name = "N")]
    pub resident_layers: Option<usize>,
    /// Cache policy: `planned` (static resident set + exact prefetch) or `lru` (for
    /// comparison only; collapses under the cyclic access of decoding).
    #[arg(long, value_enum, default_value = "planned", hide = true)]
    pub policy: PolicyArg,
    /// Do not check blobs against their XXH3 checksums while loading. By default the first
    /// read of each blob from disk is hashed before the model uses it, so a corrupt file fails
    /// loudly (naming the blob) instead of changing the output; later re-reads of streamed
    /// blobs are not hashed again. `gdsllm verify` checks every byte.
    #[arg(long)]
    pub no_checksums: bool,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyArg {
    Planned,
    Lru,
}

impl ResidencyArgs {
    /// The options for `residency`, with `reserved_bytes` (KV cache + activations + margin)
    /// computed by the caller, who knows the context length and batch.
    pub fn options(&self, reserved_bytes: u64) -> ResidencyOptions {
        ResidencyOptions {
            device_budget: self.vram_budget,
            host_cache: self.host_cache,
            prefetch: self.prefetch as usize,
            resident_layers: self.resident_layers,
            policy: match self.policy {
                PolicyArg::Planned => Policy::Planned,
                PolicyArg::Lru => Policy::Lru,
            },
            reserved_bytes,
            checksums: self.checksums(),
        }
    }

    /// What `--no-checksums` says, as reported by `--json` outputs.
    pub fn checksums(&self) -> BlobChecksums {
        if self.no_checksums {
            BlobChecksums::Off
        } else {
            BlobChecksums::FirstRead
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Test {
        #[command(flatten)]
        residency: ResidencyArgs,
    }

    #[test]
    fn parses_sizes_and_keywords() {
        let t = Test::try_parse_from([
            "t",
            "--vram-budget",
            "1.5G",
            "--host-cache",
            "off",
            "--prefetch",
            "3",
            "--resident-layers",
            "4",
        ])
        .unwrap();
        let o = t.residency.options(7);
        assert_eq!(o.device_budget, Budget::Bytes(3 << 29));
        assert_eq!(o.host_cache, HostCache::Off);
        assert_eq!(
            (o.prefetch, o.resident_layers, o.reserved_bytes),
            (3, Some(4), 7)
        );
        let t = Test::try_parse_from(["t"]).unwrap();
        assert_eq!(t.residency.vram_budget, Budget::Auto);
        assert_eq!(t.residency.options(0).policy, Policy::Planned);
        assert_eq!(t.residency.options(0).checksums, BlobChecksums::FirstRead);
        let t = Test::try_parse_from(["t", "--no-checksums"]).unwrap();
        assert_eq!(t.residency.options(0).checksums, BlobChecksums::Off);
        assert!(Test::try_parse_from(["t", "--vram-budget", "lots"]).is_err());
        assert!(Test::try_parse_from(["t", "--prefetch", "0"]).is_err());
        let t = Test::try_parse_from(["t", "--host-cache", "512MiB", "--policy", "lru"]).unwrap();
        assert_eq!(t.residency.host_cache, HostCache::Bytes(512 << 20));
        assert_eq!(t.residency.options(0).policy, Policy::Lru);
    }
}
