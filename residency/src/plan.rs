//! The plan: which blobs stay resident for the whole run, which stream through the ring, which
//! the host tier keeps, and what each pass costs.
//!
//! Decoding visits blobs cyclically. Under a known cyclic order the optimal policy is static
//! (DESIGN.md, "the residency insight"): every blob in the order is needed exactly once per
//! pass, so streamed bytes per pass are minimised by keeping the most bytes resident, counting
//! that the ring must hold k copies of the largest *streamed* blob.

use std::fmt;

use serde::Serialize;
use weights_format::{Metadata, names};

use crate::error::ResidencyError;
use crate::options::{Policy, human_bytes};

/// What a blob is in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlobKind {
    Embed,
    Layer(usize),
    Output,
}

/// One blob as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlobInfo {
    /// Index into `metadata.blobs`.
    pub index: usize,
    pub file: String,
    pub length: u64,
    pub kind: BlobKind,
}

/// The blobs and the cyclic order in which one forward pass acquires them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelLayout {
    pub blobs: Vec<BlobInfo>,
    /// Blob indices in the order one pass acquires them: `embed` (only when the LM head is
    /// tied to it), `layer_000` … `layer_{L-1}`, `output`.
    pub order: Vec<usize>,
    pub tied_embeddings: bool,
    pub n_layers: usize,
}

impl ModelLayout {
    /// Derives the pass order from the blob names and the tie setting.
    pub fn from_metadata(meta: &Metadata) -> Result<ModelLayout, ResidencyError> {
        let n_layers = meta.config.n_layers as usize;
        let find = |file: &str| {
            meta.blob_index(file).ok_or_else(|| ResidencyError::Layout {
                file: file.to_string(),
                reason: "listed by the model config but missing from metadata.json blobs".into(),
            })
        };
        let embed = find(names::EMBED_BLOB)?;
        let output = find(names::OUTPUT_BLOB)?;
        let layers = (0..n_layers)
            .map(|i| find(&names::layer_blob(i)))
            .collect::<Result<Vec<_>, _>>()?;
        let blobs = meta
            .blobs
            .iter()
            .enumerate()
            .map(|(index, b)| {
                let kind = if index == embed {
                    BlobKind::Embed
                } else if index == output {
                    BlobKind::Output
                } else if let Some(l) = layers.iter().position(|&x| x == index) {
                    BlobKind::Layer(l)
                } else {
                    return Err(ResidencyError::Layout {
                        file: b.file.clone(),
                        reason: "not an embed, layer or output blob".into(),
                    });
                };
                Ok(BlobInfo {
                    index,
                    file: b.file.clone(),
                    length: b.length,
                    kind,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tied = meta.config.tie_word_embeddings;
        Ok(ModelLayout::new(blobs, tied, embed, &layers, output))
    }

    /// A layout from explicit sizes (simulations, tests, `gdsllm plan` on synthetic shapes):
    /// blobs `embed`, `layer_*`, `output` in that index order.
    pub fn synthetic(embed: u64, layers: &[u64], output: u64, tied: bool) -> ModelLayout {
        let mut blobs = vec![BlobInfo {
            index: 0,
            file: names::EMBED_BLOB.into(),
            length: embed,
            kind: BlobKind::Embed,
        }];
        for (i, &len) in layers.iter().enumerate() {
            blobs.push(BlobInfo {
                index: i + 1,
                file: names::layer_blob(i),
                length: len,
                kind: BlobKind::Layer(i),
            });
        }
        let output_index = layers.len() + 1;
        blobs.push(BlobInfo {
            index: output_index,
            file: names::OUTPUT_BLOB.into(),
            length: output,
            kind: BlobKind::Output,
        });
        let layer_idx: Vec<usize> = (1..=layers.len()).collect();
        ModelLayout::new(blobs, tied, 0, &layer_idx, output_index)
    }

    fn new(
        blobs: Vec<BlobInfo>,
        tied: bool,
        embed: usize,
        layers: &[usize],
        output: usize,
    ) -> ModelLayout {
        let mut order = Vec::with_capacity(layers.len() + 2);
        if tied {
            order.push(embed);
        }
        order.extend_from_slice(layers);
        order.push(output);
        ModelLayout {
            blobs,
            order,
            tied_embeddings: tied,
            n_layers: layers.len(),
        }
    }

    pub fn total_bytes(&self) -> u64 {
        self.blobs.iter().map(|b| b.length).sum()
    }
}

/// Where a blob lives during the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// In device memory for the whole run; read once.
    Resident,
    /// Through the staging ring, read from disk every pass.
    Streamed,
    /// Through the staging ring, read from disk once and then copied up from the host tier.
    HostCached,
    /// Not in the pass order (untied embedding): only `read_range` touches it.
    OnDemand,
}

/// One blob's line in the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedBlob {
    pub index: usize,
    pub file: String,
    pub length: u64,
    pub placement: Placement,
}

/// Budgets after `auto` has been resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlanInputs {
    pub device_budget: u64,
    pub reserved_bytes: u64,
    /// Upper bound of the host tier; 0 turns it off.
    pub host_budget: u64,
    /// Ring slots k ≥ 2 (prefetch depth + 1).
    pub ring_slots: usize,
    pub resident_layers: Option<usize>,
    pub policy: Policy,
}

impl PlanInputs {
    /// The planned policy on `device_budget` bytes with `ring_slots` slots: nothing reserved,
    /// no host tier, the resident layers chosen by the plan (set the fields after it for
    /// anything else).
    pub fn new(device_budget: u64, ring_slots: usize) -> PlanInputs {
        PlanInputs {
            device_budget,
            reserved_bytes: 0,
            host_budget: 0,
            ring_slots,
            resident_layers: None,
            policy: Policy::Planned,
        }
    }
}

/// The static plan for a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub policy: Policy,
    pub device_budget: u64,
    pub reserved_bytes: u64,
    pub blobs: Vec<PlannedBlob>,
    /// The cyclic acquire order (blob indices).
    pub order: Vec<usize>,
    pub tied_embeddings: bool,
    pub n_layers: usize,
    pub resident_layers: usize,
    pub ring_slots: usize,
    pub slot_bytes: u64,
    pub ring_bytes: u64,
    pub resident_bytes: u64,
    pub host_budget: u64,
    pub host_cached_bytes: u64,
    /// Bytes moved into the ring per pass in steady state (disk + host tier).
    pub streamed_bytes_per_pass: u64,
    /// Of those, read from disk each pass in steady state.
    pub disk_bytes_per_pass: u64,
    /// Of those, copied up from the host tier each pass in steady state.
    pub host_bytes_per_pass: u64,
    /// Bytes read from disk during the first pass (everything in the order).
    pub first_pass_disk_bytes: u64,
}

impl Plan {
    /// Computes the plan for `layout` under `inputs`. Fails with the numbers when even the
    /// ring does not fit.
    pub fn compute(layout: &ModelLayout, inputs: &PlanInputs) -> Result<Plan, ResidencyError> {
        if inputs.ring_slots < 2 && inputs.policy == Policy::Planned {
            return Err(ResidencyError::InvalidOption {
                setting: "--prefetch",
                reason: format!(
                    "the staging ring needs k = prefetch + 1 >= 2 slots, got {}",
                    inputs.ring_slots
                ),
            });
        }
        if inputs.reserved_bytes > inputs.device_budget {
            return Err(ResidencyError::ReservedExceedsBudget {
                budget: inputs.device_budget,
                reserved: inputs.reserved_bytes,
            });
        }
        let available = inputs.device_budget - inputs.reserved_bytes;
        let (resident, slots) = match inputs.policy {
            Policy::Planned => choose_resident(layout, inputs, available)?,
            Policy::Lru => {
                let largest = largest_in(layout, &layout.order);
                let slots = available
                    .checked_div(largest.1)
                    .map_or(layout.order.len(), |s| (s as usize).min(layout.order.len()));
                if slots == 0 {
                    return Err(too_small(inputs, available, 1, largest, 0));
                }
                (vec![false; layout.blobs.len()], slots)
            }
        };
        Ok(Plan::assemble(layout, inputs, &resident, slots))
    }

    fn assemble(
        layout: &ModelLayout,
        inputs: &PlanInputs,
        resident: &[bool],
        slots: usize,
    ) -> Plan {
        let streamed: Vec<usize> = blobs_where(layout, resident, false).collect();
        let slot_bytes = largest_in(layout, &streamed).1;
        let ring_slots = if streamed.is_empty() { 0 } else { slots };
        let ring_bytes = slot_bytes * ring_slots as u64;
        let resident_bytes: u64 = layout
            .blobs
            .iter()
            .filter(|b| resident[b.index])
            .map(|b| b.length)
            .sum();
        // The host tier only pays off for blobs that are re-read every pass; the LRU
        // comparison policy runs without it so that it measures the device cache alone.
        let mut host_cached = vec![false; layout.blobs.len()];
        let mut host_cached_bytes = 0;
        if inputs.policy == Policy::Planned {
            for &b in &streamed {
                let len = layout.blobs[b].length;
                if host_cached_bytes + len <= inputs.host_budget {
                    host_cached[b] = true;
                    host_cached_bytes += len;
                }
            }
        }
        let in_order: Vec<bool> = (0..layout.blobs.len())
            .map(|b| layout.order.contains(&b))
            .collect();
        let blobs = layout
            .blobs
            .iter()
            .map(|b| PlannedBlob {
                index: b.index,
                file: b.file.clone(),
                length: b.length,
                placement: if !in_order[b.index] {
                    Placement::OnDemand
                } else if resident[b.index] {
                    Placement::Resident
                } else if host_cached[b.index] {
                    Placement::HostCached
                } else {
                    Placement::Streamed
                },
            })
            .collect();
        let streamed_bytes: u64 = streamed.iter().map(|&b| layout.blobs[b].length).sum();
        let resident_layers = layout
            .blobs
            .iter()
            .filter(|b| matches!(b.kind, BlobKind::Layer(_)) && resident[b.index])
            .count();
        Plan {
            policy: inputs.policy,
            device_budget: inputs.device_budget,
            reserved_bytes: inputs.reserved_bytes,
            blobs,
            order: layout.order.clone(),
            tied_embeddings: layout.tied_embeddings,
            n_layers: layout.n_layers,
            resident_layers,
            ring_slots,
            slot_bytes,
            ring_bytes,
            resident_bytes,
            host_budget: inputs.host_budget,
            host_cached_bytes,
            streamed_bytes_per_pass: streamed_bytes,
            disk_bytes_per_pass: streamed_bytes - host_cached_bytes,
            host_bytes_per_pass: host_cached_bytes,
            first_pass_disk_bytes: layout.order.iter().map(|&b| layout.blobs[b].length).sum(),
        }
    }

    /// Device bytes the plan allocates (resident set + ring); never above the budget minus
    /// the reserve.
    pub fn device_bytes(&self) -> u64 {
        self.resident_bytes + self.ring_bytes
    }

    pub fn placement(&self, blob: usize) -> Placement {
        self.blobs[blob].placement
    }

    pub fn is_resident(&self, blob: usize) -> bool {
        self.blobs[blob].placement == Placement::Resident
    }

    /// Predicted steady-state tokens (passes) per second: one I/O channel moves the disk and
    /// host-tier bytes of a pass while compute runs; the slower of the two sets the pace.
    pub fn predict_tokens_per_s(
        &self,
        disk_gbps: f64,
        host_copy_gbps: f64,
        compute_s_per_pass: f64,
    ) -> f64 {
        let io_s = seconds(self.disk_bytes_per_pass, disk_gbps)
            + seconds(self.host_bytes_per_pass, host_copy_gbps);
        let pass_s = io_s.max(compute_s_per_pass);
        if pass_s > 0.0 {
            1.0 / pass_s
        } else {
            f64::INFINITY
        }
    }

    fn files_with(&self, placement: Placement) -> Vec<&str> {
        self.blobs
            .iter()
            .filter(|b| b.placement == placement)
            .map(|b| b.file.as_str())
            .collect()
    }
}

/// Positions layer `layer`'s KV cache keeps for a sequence of up to `context` positions: all of
/// them, except on a sliding-window layer, which keeps at most twice its window (a ring: a
/// position lands in slot `pos % slots`). Twice, not once, so that a pass computing up to
/// `window` new positions of a sequence at once never overwrites a key that one of its rows
/// still sees (keys `p - window + 1 ..= p` for the row at `p`; the pass writes all its keys
/// before attending).
pub fn kv_positions(config: &weights_format::ModelConfig, layer: u32, context: u64) -> u64 {
    match &config.sliding_window {
        Some(w) if config.is_sliding_layer(layer) => context.min(2 * u64::from(w.size)),
        _ => context,
    }
}

/// Bytes of the K and V caches of every layer for a sequence of up to `context` positions at
/// `bytes_per_value` (2 for f16, 4 for f32), each layer counted with its own positions
/// ([`kv_positions`]): the largest part of what `reserved_bytes` must cover.
pub fn kv_cache_bytes(
    config: &weights_format::ModelConfig,
    context: u64,
    bytes_per_value: u64,
) -> u64 {
    // Saturating: an absurd config (a context of 2^32) must come out as "too large for the
    // budget", not wrap around to something small or panic.
    let per_position = [
        config.n_kv_heads as u64,
        config.head_dim as u64,
        bytes_per_value,
    ]
    .into_iter()
    .fold(2u64, u64::saturating_mul);
    (0..config.n_layers)
        .map(|l| kv_positions(config, l, context).saturating_mul(per_position))
        .fold(0u64, u64::saturating_add)
}

fn seconds(bytes: u64, gbps: f64) -> f64 {
    if bytes == 0 {
        0.0
    } else if gbps > 0.0 {
        bytes as f64 / (gbps * 1e9)
    } else {
        f64::INFINITY
    }
}

fn largest_in(layout: &ModelLayout, blobs: &[usize]) -> (String, u64) {
    blobs
        .iter()
        .map(|&b| &layout.blobs[b])
        .max_by_key(|b| b.length)
        .map(|b| (b.file.clone(), b.length))
        .unwrap_or_default()
}

fn too_small(
    inputs: &PlanInputs,
    available: u64,
    slots: usize,
    largest: (String, u64),
    resident_bytes: u64,
) -> ResidencyError {
    let ring_bytes = largest.1 * slots as u64;
    ResidencyError::BudgetTooSmall {
        budget: inputs.device_budget,
        reserved: inputs.reserved_bytes,
        available,
        needed: ring_bytes + resident_bytes,
        slots,
        slot_bytes: largest.1,
        ring_bytes,
        resident_bytes,
        largest_file: largest.0,
    }
}

/// `r` of `n` layers at evenly spaced positions: while compute runs over a resident layer the
/// ring keeps reading, which a contiguous block of resident layers would stall (the ring can
/// only run k blobs ahead).
fn spread(r: usize, n: usize) -> Vec<usize> {
    (0..r).map(|j| (2 * j + 1) * n / (2 * r)).collect()
}

/// Returns the resident flags and the ring size k.
/// The blobs whose flag is `resident`, in pass order.
fn blobs_where<'a>(
    layout: &'a ModelLayout,
    flags: &'a [bool],
    resident: bool,
) -> impl Iterator<Item = usize> + 'a {
    layout
        .order
        .iter()
        .copied()
        .filter(move |&b| flags[b] == resident)
}

/// The lengths of [`blobs_where`]'s blobs.
fn lengths_where<'a>(
    layout: &'a ModelLayout,
    flags: &'a [bool],
    resident: bool,
) -> impl Iterator<Item = u64> + 'a {
    blobs_where(layout, flags, resident).map(|b| layout.blobs[b].length)
}

fn choose_resident(
    layout: &ModelLayout,
    inputs: &PlanInputs,
    available: u64,
) -> Result<(Vec<bool>, usize), ResidencyError> {
    let k = inputs.ring_slots;
    // Blobs needed every pass besides the layers: output (final norm, LM head when untied)
    // and the tied embedding (the LM head). Few, so every subset is tried.
    let (layer_blobs, specials): (Vec<usize>, Vec<usize>) = layout
        .order
        .iter()
        .copied()
        .partition(|&b| matches!(layout.blobs[b].kind, BlobKind::Layer(_)));
    let n = layer_blobs.len();
    // Resident flags with the specials of the bits of `mask` (bit i: specials[i]) set.
    let special_flags = |mask: usize| -> Vec<bool> {
        let mut flags = vec![false; layout.blobs.len()];
        for (i, &b) in specials.iter().enumerate() {
            flags[b] = mask & (1 << i) != 0;
        }
        flags
    };
    let resident_bytes = |flags: &[bool]| -> u64 { lengths_where(layout, flags, true).sum() };
    let cost = |flags: &[bool]| -> u64 {
        let largest_streamed = lengths_where(layout, flags, false).max();
        resident_bytes(flags) + largest_streamed.map_or(0, |l| l * k as u64)
    };
    // (resident bytes, output kept, flags)
    let mut best: Option<(u64, bool, Vec<bool>)> = None;
    for mask in 0..(1usize << specials.len()) {
        let flags = special_flags(mask);
        let counts: Vec<usize> = match inputs.resident_layers {
            Some(r) => vec![r.min(n)],
            None => (0..=n).rev().collect(),
        };
        for r in counts {
            let mut candidate = flags.clone();
            for l in spread(r, n) {
                candidate[layer_blobs[l]] = true;
            }
            if cost(&candidate) <= available {
                let resident = resident_bytes(&candidate);
                let keeps_output = specials
                    .iter()
                    .any(|&b| layout.blobs[b].kind == BlobKind::Output && candidate[b]);
                let better = match &best {
                    None => true,
                    Some((bytes, out, _)) => {
                        resident > *bytes || (resident == *bytes && keeps_output && !out)
                    }
                };
                if better {
                    best = Some((resident, keeps_output, candidate));
                }
                break;
            }
        }
    }
    match best {
        Some((_, _, flags)) => Ok((flags, k)),
        None => {
            if let Some(r) = inputs.resident_layers
                && r > 0
            {
                let mut flags = vec![false; layout.blobs.len()];
                for l in spread(r.min(n), n) {
                    flags[layer_blobs[l]] = true;
                }
                return Err(ResidencyError::ResidentLayersDoNotFit {
                    requested: r,
                    n_layers: n,
                    needed: cost(&flags),
                    available,
                });
            }
            // Report the cheapest configuration: some specials kept resident may shrink the
            // slots enough to need less than streaming everything.
            let mut cheapest: Option<(u64, Vec<bool>)> = None;
            for mask in 0..(1usize << specials.len()) {
                let flags = special_flags(mask);
                let c = cost(&flags);
                if cheapest.as_ref().is_none_or(|(best, _)| c < *best) {
                    cheapest = Some((c, flags));
                }
            }
            let flags = cheapest.map(|(_, f)| f).unwrap_or_default();
            let streamed: Vec<usize> = blobs_where(layout, &flags, false).collect();
            Err(too_small(
                inputs,
                available,
                k,
                largest_in(layout, &streamed),
                resident_bytes(&flags),
            ))
        }
    }
}

/// Compresses `layer_003.bin, layer_004.bin, layer_005.bin` into `layer_003–005`.
fn summarize_files(files: &[&str]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(usize, usize)> = None;
    let layer_no =
        |f: &str| -> Option<usize> { f.strip_prefix("layer_")?.strip_suffix(".bin")?.parse().ok() };
    let flush = |run: &mut Option<(usize, usize)>, out: &mut Vec<String>| {
        if let Some((a, b)) = run.take() {
            out.push(if a == b {
                format!("layer_{a:03}")
            } else {
                format!("layer_{a:03}–{b:03}")
            });
        }
    };
    for f in files {
        match (layer_no(f), run) {
            (Some(n), Some((a, b))) if n == b + 1 => run = Some((a, n)),
            (Some(n), _) => {
                flush(&mut run, &mut out);
                run = Some((n, n));
            }
            (None, _) => {
                flush(&mut run, &mut out);
                out.push(f.trim_end_matches(".bin").to_string());
            }
        }
    }
    flush(&mut run, &mut out);
    if out.is_empty() {
        "none".into()
    } else {
        out.join(", ")
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let usable = self.device_budget - self.reserved_bytes;
        writeln!(
            f,
            "policy {:?}; device budget {} ({} reserved for KV cache, activations and margin; {} usable)",
            self.policy,
            human_bytes(self.device_budget),
            human_bytes(self.reserved_bytes),
            human_bytes(usable),
        )?;
        let resident = self.files_with(Placement::Resident);
        writeln!(
            f,
            "resident:  {} blobs, {} ({} of {} layers): {}",
            resident.len(),
            human_bytes(self.resident_bytes),
            self.resident_layers,
            self.n_layers,
            summarize_files(&resident),
        )?;
        let mut streamed = self.files_with(Placement::Streamed);
        streamed.extend(self.files_with(Placement::HostCached));
        if self.ring_slots == 0 {
            writeln!(f, "streamed:  none (the whole pass is resident)")?;
        } else {
            writeln!(
                f,
                "streamed:  {} blobs through a ring of {} slots × {} = {}: {}",
                streamed.len(),
                self.ring_slots,
                human_bytes(self.slot_bytes),
                human_bytes(self.ring_bytes),
                summarize_files(&self.files_with(Placement::Streamed)),
            )?;
        }
        if self.host_cached_bytes > 0 {
            writeln!(
                f,
                "host tier: {} of {} budget kept after the first read: {}",
                human_bytes(self.host_cached_bytes),
                human_bytes(self.host_budget),
                summarize_files(&self.files_with(Placement::HostCached)),
            )?;
        } else {
            writeln!(
                f,
                "host tier: off or empty (budget {})",
                human_bytes(self.host_budget)
            )?;
        }
        let on_demand = self.files_with(Placement::OnDemand);
        if !on_demand.is_empty() {
            writeln!(
                f,
                "on demand: {} (rows read as needed)",
                summarize_files(&on_demand)
            )?;
        }
        writeln!(
            f,
            "per token: {} from disk, {} from the host tier, {} already resident (first pass reads {} from disk)",
            human_bytes(self.disk_bytes_per_pass),
            human_bytes(self.host_bytes_per_pass),
            human_bytes(self.resident_bytes),
            human_bytes(self.first_pass_disk_bytes),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3 270M's layout: 18 layers, 15 of them with a 512-position window, one KV head of
    /// 256 values. Its global layers cost the whole context, the windowed ones 1024 positions.
    #[test]
    fn windowed_layers_cost_their_ring_not_the_context() {
        let config = weights_format::ModelConfig {
            architecture: "gemma3".into(),
            n_layers: 18,
            n_kv_heads: 1,
            head_dim: 256,
            sliding_window: Some(weights_format::SlidingWindow {
                size: 512,
                layers: (0..18).filter(|l| l % 6 != 5).collect(),
                rope_theta: 1e4,
            }),
            ..weights_format::ModelConfig::default()
        };
        assert_eq!(kv_positions(&config, 0, 32768), 1024);
        assert_eq!(kv_positions(&config, 5, 32768), 32768);
        assert_eq!(kv_positions(&config, 0, 100), 100);
        let per_position = 2 * 256 * 2;
        assert_eq!(
            kv_cache_bytes(&config, 32768, 2),
            (3 * 32768 + 15 * 1024) * per_position
        );
        let llama = weights_format::ModelConfig {
            sliding_window: None,
            ..config
        };
        assert_eq!(kv_cache_bytes(&llama, 32768, 2), 18 * 32768 * per_position);
    }

    #[test]
    fn output_first_then_spread_layers() {
        let layout = ModelLayout::synthetic(1000, &[100; 10], 10, false);
        // Ring 2×100, output 10, then 3 layers.
        let plan = Plan::compute(&layout, &PlanInputs::new(200 + 10 + 300 + 50, 2)).unwrap();
        assert_eq!(plan.placement(0), Placement::OnDemand);
        assert_eq!(plan.placement(11), Placement::Resident);
        assert_eq!(plan.resident_layers, 3);
        let resident: Vec<usize> = (1..=10).filter(|&b| plan.is_resident(b)).collect();
        assert_eq!(resident, vec![2, 6, 9]);
        assert_eq!(plan.disk_bytes_per_pass, 700);
        assert!(plan.device_bytes() <= plan.device_budget);
    }

    #[test]
    fn resident_large_tied_embedding_shrinks_the_ring() {
        // Tied embedding of 500 bytes, 4 layers of 100: keeping the embedding resident makes
        // the slots 100 bytes instead of 500.
        let layout = ModelLayout::synthetic(500, &[100; 4], 10, true);
        let plan = Plan::compute(&layout, &PlanInputs::new(500 + 10 + 200, 2)).unwrap();
        assert!(plan.is_resident(0));
        assert_eq!(plan.slot_bytes, 100);
        assert_eq!(plan.ring_bytes, 200);
        assert_eq!(plan.resident_layers, 0);
    }

    #[test]
    fn everything_fits_means_no_ring() {
        let layout = ModelLayout::synthetic(500, &[100; 4], 10, true);
        let plan = Plan::compute(&layout, &PlanInputs::new(910, 3)).unwrap();
        assert_eq!(plan.ring_bytes, 0);
        assert_eq!(plan.disk_bytes_per_pass, 0);
        assert!(plan.predict_tokens_per_s(3.0, 50.0, 0.0).is_infinite());
    }

    #[test]
    fn too_small_names_the_numbers() {
        let layout = ModelLayout::synthetic(500, &[100; 4], 10, false);
        let err = Plan::compute(&layout, &PlanInputs::new(150, 2)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("150") && text.contains("needs 200 bytes"),
            "{text}"
        );
        let err = Plan::compute(
            &layout,
            &PlanInputs {
                resident_layers: Some(4),
                ..PlanInputs::new(300, 2)
            },
        )
        .unwrap_err();
        assert!(
            matches!(err, ResidencyError::ResidentLayersDoNotFit { .. }),
            "{err}"
        );
    }

    #[test]
    fn host_tier_and_prediction() {
        let layout = ModelLayout::synthetic(0, &[1_000_000_000; 4], 4096, false);
        let plan = Plan::compute(
            &layout,
            &PlanInputs {
                host_budget: 2_000_000_000,
                ..PlanInputs::new(2_000_004_096, 2)
            },
        )
        .unwrap();
        assert_eq!(plan.disk_bytes_per_pass, 2_000_000_000);
        assert_eq!(plan.host_bytes_per_pass, 2_000_000_000);
        // 2 GB at 2 GB/s + 2 GB at 20 GB/s = 1.1 s per pass.
        let tps = plan.predict_tokens_per_s(2.0, 20.0, 0.5);
        assert!((tps - 1.0 / 1.1).abs() < 1e-9, "{tps}");
        let text = plan.to_string();
        assert!(text.contains("host tier"), "{text}");
    }

    #[test]
    fn summaries() {
        assert_eq!(
            summarize_files(&[
                "output.bin",
                "layer_001.bin",
                "layer_002.bin",
                "layer_004.bin"
            ]),
            "output, layer_001–002, layer_004"
        );
        assert_eq!(spread(1, 10), vec![5]);
        assert_eq!(spread(10, 10), (0..10).collect::<Vec<_>>());
    }
}
