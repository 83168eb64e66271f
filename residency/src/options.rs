//! User-facing settings: budgets, host tier, prefetch depth, policy, and byte-size parsing.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// Device memory budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    Bytes(u64),
    /// GPU: free device memory. CPU: a safe share ([`AUTO_RAM_SHARE`]) of available RAM.
    Auto,
}

/// Host-memory tier (pinned on GPU, ordinary on CPU) for streamed blobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostCache {
    Off,
    Bytes(u64),
    /// A safe share ([`AUTO_RAM_SHARE`]) of available RAM minus what the device tier already
    /// takes from RAM (on CPU the device tier *is* RAM).
    Auto,
}

/// What stays in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Static resident set + streaming ring with exact prefetch (DESIGN.md, the residency
    /// insight).
    #[default]
    Planned,
    /// Least-recently-used cache of whole blobs, demand-fetched. For comparison in tests and
    /// benches only: under cyclic access its hit rate collapses to zero.
    Lru,
}

/// Whether blob bytes are checked against the XXH3 checksums of metadata.json as they are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlobChecksums {
    /// Each blob's first read from disk is hashed before compute may use it; a mismatch fails
    /// that read (and every later one) with an error naming the blob. Later reads of a
    /// streamed blob are not hashed again: the first read proved the file, and re-hashing every
    /// pass would tax the streaming path for a fault that `gdsllm verify` finds.
    #[default]
    FirstRead,
    /// No checking (`--no-checksums`).
    Off,
}

/// Share of `MemAvailable` that `auto` budgets take: the rest stays for the OS, the page cache
/// of other programs and our own activations.
pub const AUTO_RAM_SHARE: f64 = 0.6;

/// Everything that shapes the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResidencyOptions {
    pub device_budget: Budget,
    pub host_cache: HostCache,
    /// Prefetch depth k−1: the staging ring has k = prefetch + 1 ≥ 2 slots.
    pub prefetch: usize,
    /// Force this many layers resident (default: as many as fit).
    pub resident_layers: Option<usize>,
    pub policy: Policy,
    /// KV cache + activations + safety margin, taken off the device budget first.
    pub reserved_bytes: u64,
    /// Whether blobs are checked against their checksums as they are read.
    pub checksums: BlobChecksums,
}

impl Default for ResidencyOptions {
    fn default() -> Self {
        ResidencyOptions {
            device_budget: Budget::Auto,
            host_cache: HostCache::Auto,
            prefetch: 2,
            resident_layers: None,
            policy: Policy::Planned,
            reserved_bytes: 0,
            checksums: BlobChecksums::default(),
        }
    }
}

/// A byte size could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid byte size {input:?}: expected a number with an optional unit, e.g. 4GiB, 512MiB, \
     1.5G, 800M, 123456"
)]
pub struct ParseBytesError {
    pub input: String,
}

/// Parses `4GiB`, `512MiB`, `1.5G`, `800MB`, `64k`, `123456`. `G`/`GiB` are binary (2^30),
/// `GB` is decimal (10^9), because people type `4G` meaning a GPU's GiB.
pub fn parse_bytes(input: &str) -> Result<u64, ParseBytesError> {
    let err = || ParseBytesError {
        input: input.to_string(),
    };
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let value: f64 = number.parse().map_err(|_| err())?;
    let multiplier: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(err()),
    };
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(err());
    }
    Ok(bytes.round() as u64)
}

/// Formats bytes for people: `1.50 GiB`, `512.0 MiB`, `4096 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if value < 10.0 {
        format!("{value:.2} {unit}")
    } else {
        format!("{value:.1} {unit}")
    }
}

impl FromStr for Budget {
    type Err = ParseBytesError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(Budget::Auto)
        } else {
            parse_bytes(s).map(Budget::Bytes)
        }
    }
}

impl FromStr for HostCache {
    type Err = ParseBytesError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(HostCache::Auto),
            "off" | "none" | "0" => Ok(HostCache::Off),
            _ => parse_bytes(s).map(HostCache::Bytes),
        }
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Budget::Bytes(b) => f.write_str(&human_bytes(*b)),
            Budget::Auto => f.write_str("auto"),
        }
    }
}

impl fmt::Display for HostCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostCache::Bytes(b) => f.write_str(&human_bytes(*b)),
            HostCache::Auto => f.write_str("auto"),
            HostCache::Off => f.write_str("off"),
        }
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes; `None` where it cannot be read.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes(" 123456 ").unwrap(), 123456);
        assert_eq!(parse_bytes("64k").unwrap(), 65536);
        for bad in ["", "GiB", "1.2.3G", "-1G", "4 parsecs", "1e3"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} parsed");
        }
        assert_eq!("auto".parse::<Budget>().unwrap(), Budget::Auto);
        assert_eq!("off".parse::<HostCache>().unwrap(), HostCache::Off);
        assert_eq!(
            "1G".parse::<HostCache>().unwrap(),
            HostCache::Bytes(1 << 30)
        );
    }

    #[test]
    fn meminfo() {
        let text = "MemTotal:       24000000 kB\nMemFree: 100 kB\nMemAvailable:   1000 kB\n";
        assert_eq!(parse_mem_available(text), Some(1024 * 1000));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
        assert_eq!(human_bytes(100), "100 B");
    }
}
