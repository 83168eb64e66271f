//! Deterministic checks of the plan and the prefetch engine on a virtual clock.

use proptest::prelude::*;
use residency::sim::{Jitter, SimConfig, simulate};
use residency::{ModelLayout, Placement, Plan, PlanInputs, Policy};

const MIB: u64 = 1 << 20;

/// `passes` passes at 1 ns a disk byte with no host tier, each blob computed for its
/// `compute_ns`, in plan order and without jitter.
fn disk_sim(compute_ns: Vec<u64>, passes: usize) -> SimConfig {
    SimConfig {
        disk_ns_per_byte: 1.0,
        host_ns_per_byte: 0.0,
        compute_ns,
        access: None,
        passes,
        jitter: None,
    }
}

/// `n` layers of `layer` bytes, untied 4 KiB-output model; compute `c` ns per layer.
fn streaming_setup(
    n: usize,
    layer: u64,
    k: usize,
    resident_layers: usize,
    c: u64,
) -> (ModelLayout, Plan, Vec<u64>) {
    let layout = ModelLayout::synthetic(64 * MIB, &vec![layer; n], 4096, false);
    let plan = Plan::compute(
        &layout,
        &PlanInputs {
            resident_layers: Some(resident_layers),
            ..PlanInputs::new(k as u64 * layer + 4096 + resident_layers as u64 * layer, k)
        },
    )
    .unwrap();
    let mut compute = vec![c; layout.blobs.len()];
    compute[layout.blobs.len() - 1] = 0; // output: the final norm is negligible
    (layout, plan, compute)
}

#[test]
fn steady_state_stall_is_io_minus_compute() {
    let layer = 8 * MIB;
    let n = 12;
    // 1 ns/byte: a layer takes 8.39 ms to read.
    let io = layer as f64;
    for &(c_ms, k) in &[(2.0, 2), (6.0, 2), (8.0, 3), (12.0, 2), (20.0, 4), (5.0, 4)] {
        let c = (c_ms * 1e6) as u64;
        let (_, plan, compute) = streaming_setup(n, layer, k, 0, c);
        assert_eq!(plan.resident_layers, 0);
        assert!(plan.is_resident(n + 1), "output resident");
        let report = simulate(&plan, &disk_sim(compute, 6)).unwrap();
        let expected = (io - c as f64).max(0.0) / 1e9;
        for pass in &report.passes[2..] {
            let per_layer = pass.compute_wait_s / n as f64;
            println!(
                "k={k} io={:.3}ms compute={c_ms}ms: stall/layer {:.6} ms, expected {:.6} ms, \
                 slot wait/pass {:.3} ms, overlap {:.3}",
                io / 1e6,
                per_layer * 1e3,
                expected * 1e3,
                pass.slot_wait_s * 1e3,
                pass.overlap_fraction()
            );
            assert!(
                (per_layer - expected).abs() < 1e-8,
                "stall per layer {per_layer} vs max(0, io - compute) {expected}"
            );
            if expected == 0.0 {
                // The disk waits for compute instead: the I/O side idles c - io per layer.
                let idle = (c as f64 - io) * n as f64 / 1e9;
                assert!(
                    (pass.slot_wait_s - idle).abs() < 1e-7,
                    "{} vs {idle}",
                    pass.slot_wait_s
                );
            }
        }
        // First pass: the ring's ramp-up only: the first layer's whole read, then the
        // steady-state stall for the others (plus at most the tiny output read).
        let first = report.passes[0].compute_wait_s;
        let ramp = io / 1e9 + expected * (n - 1) as f64;
        println!(
            "k={k} compute={c_ms}ms: first-pass stall {:.4} ms, ramp-up model {:.4} ms",
            first * 1e3,
            ramp * 1e3
        );
        assert!(first >= ramp - 1e-8, "first pass {first} vs {ramp}");
        assert!(
            first <= ramp + 4096.0 / 1e9 + 1e-8,
            "first pass {first} vs {ramp}"
        );
    }
}

/// Streamed blobs at the head of the order may have one more read than passes: the
/// prefetch for the pass after the last one.
fn prefetched_past_the_end(plan: &Plan, blob: usize) -> bool {
    plan.order
        .iter()
        .filter(|&&b| !plan.is_resident(b))
        .take(plan.ring_slots)
        .any(|&b| b == blob)
}

#[test]
fn deeper_ring_hides_jitter() {
    let layer = 4 * MIB;
    let n = 16;
    let c = (layer as f64 * 1.05) as u64; // compute slightly slower than the mean read
    let mut stalls = Vec::new();
    for k in [2, 3, 4] {
        let (_, plan, compute) = streaming_setup(n, layer, k, 0, c);
        let report = simulate(
            &plan,
            &SimConfig {
                jitter: Some(Jitter {
                    seed: 7,
                    spread: 0.9,
                }),
                ..disk_sim(compute, 40)
            },
        )
        .unwrap();
        let stall = report.stats.total.compute_wait_s;
        println!("k={k}: total stall {:.2} ms over 40 passes", stall * 1e3);
        stalls.push(stall);
    }
    assert!(
        stalls[1] < stalls[0],
        "k=3 {} vs k=2 {}",
        stalls[1],
        stalls[0]
    );
    assert!(
        stalls[2] < stalls[0],
        "k=4 {} vs k=2 {}",
        stalls[2],
        stalls[0]
    );
}

#[test]
fn lru_collapses_under_cyclic_access_planned_does_not() {
    let layer = MIB;
    let n = 10;
    let layout = ModelLayout::synthetic(16 * MIB, &vec![layer; n], 4096, false);
    // Room for 6 layer-sized blobs: less than the 11 blobs of a pass.
    let budget = 6 * layer;
    let config = |plan: &Plan| disk_sim(vec![500_000; plan.blobs.len()], 8);
    let planned = Plan::compute(&layout, &PlanInputs::new(budget, 2)).unwrap();
    let lru = Plan::compute(
        &layout,
        &PlanInputs {
            policy: Policy::Lru,
            ..PlanInputs::new(budget, 2)
        },
    )
    .unwrap();
    assert_eq!(lru.ring_slots, 6);
    let p = simulate(&planned, &config(&planned)).unwrap();
    let l = simulate(&lru, &config(&lru)).unwrap();
    let steady = |r: &residency::sim::SimReport| {
        let mut s = residency::PassStats::default();
        for pass in &r.passes[1..] {
            s.device_hits += pass.device_hits;
            s.device_misses += pass.device_misses;
            s.disk_bytes += pass.disk_bytes;
        }
        s
    };
    let (ps, ls) = (steady(&p), steady(&l));
    println!(
        "steady state: planned hit rate {:.3}, {} MiB/pass; LRU hit rate {:.3}, {} MiB/pass",
        ps.device_hit_rate(),
        ps.disk_bytes / 7 / MIB,
        ls.device_hit_rate(),
        ls.disk_bytes / 7 / MIB
    );
    assert_eq!(
        ls.device_hits, 0,
        "LRU under a cyclic pattern larger than the cache"
    );
    assert_eq!(
        ps.device_misses, 0,
        "planned: every acquire prefetched or resident"
    );
    assert_eq!(ps.disk_bytes, 7 * planned.disk_bytes_per_pass);
    assert!(ps.disk_bytes < ls.disk_bytes);
}

#[test]
fn host_tier_serves_streamed_blobs_after_the_first_pass() {
    let layer = 2 * MIB;
    let n = 8;
    let layout = ModelLayout::synthetic(0, &vec![layer; n], 4096, false);
    let plan = Plan::compute(
        &layout,
        &PlanInputs {
            host_budget: 3 * layer,
            ..PlanInputs::new(2 * layer + 4096 + 2 * layer, 2)
        },
    )
    .unwrap();
    assert_eq!(plan.host_cached_bytes, 3 * layer);
    let report = simulate(
        &plan,
        &SimConfig {
            disk_ns_per_byte: 0.3,
            host_ns_per_byte: 0.02,
            compute_ns: vec![100_000; plan.blobs.len()],
            access: None,
            passes: 5,
            jitter: None,
        },
    )
    .unwrap();
    assert_eq!(report.passes[0].disk_bytes, plan.first_pass_disk_bytes);
    for pass in &report.passes[1..] {
        assert_eq!(pass.disk_bytes, plan.disk_bytes_per_pass);
        assert_eq!(pass.host_copy_bytes, plan.host_bytes_per_pass);
        assert_eq!(pass.host_hits, 3);
        assert_eq!(pass.host_misses as usize, n - 2 - 3);
    }
    for b in &plan.blobs {
        let disk = report.stats.blob_disk_reads[b.index];
        let host = report.stats.blob_host_copies[b.index];
        match b.placement {
            Placement::Resident => assert_eq!((disk, host), (1, 0), "{}", b.file),
            Placement::HostCached => {
                let extra = prefetched_past_the_end(&plan, b.index) as u64;
                assert_eq!((disk, host - extra), (1, 4), "{}", b.file)
            }
            Placement::Streamed => assert_eq!((disk, host), (5, 0), "{}", b.file),
            Placement::OnDemand => assert_eq!((disk, host), (0, 0), "{}", b.file),
        }
    }
}

#[test]
fn out_of_order_access_is_correct_and_counted_as_misses() {
    let layout = ModelLayout::synthetic(0, &[MIB; 8], 4096, false);
    let plan = Plan::compute(&layout, &PlanInputs::new(3 * MIB + 4096, 3)).unwrap();
    // Skip forward, go back, repeat a blob, then resume the plan order.
    let access = vec![vec![1, 2, 5, 3, 3, 8, 9], vec![1, 2, 3, 4, 5, 6, 7, 8, 9]];
    let report = simulate(
        &plan,
        &SimConfig {
            access: Some(access),
            ..disk_sim(vec![1_000_000; plan.blobs.len()], 0)
        },
    )
    .unwrap();
    let first = &report.passes[0];
    println!("out-of-order pass: {first:?}");
    assert!(first.device_misses >= 2, "{first:?}");
    assert_eq!(first.acquires, 7);
    let second = &report.passes[1];
    assert_eq!(second.device_misses, 0, "back in order: {second:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn planned_invariants(
        n in 1usize..14,
        sizes in proptest::collection::vec(1u64..16, 14),
        embed in 1u64..40,
        tied in any::<bool>(),
        k in 2usize..5,
        budget_blocks in 2u64..200,
        passes in 2usize..5,
    ) {
        let unit = 4096;
        let layers: Vec<u64> = sizes[..n].iter().map(|s| s * unit).collect();
        let layout = ModelLayout::synthetic(embed * unit, &layers, unit, tied);
        let budget = budget_blocks * unit;
        let Ok(plan) = Plan::compute(&layout, &PlanInputs::new(budget, k)) else {
            // Only when even the ring does not fit.
            let largest = layout.order.iter().map(|&b| layout.blobs[b].length).max().unwrap();
            prop_assert!(largest * k as u64 > budget);
            return Ok(());
        };
        prop_assert!(plan.device_bytes() <= budget);
        let report = simulate(&plan, &disk_sim(vec![20_000; plan.blobs.len()], passes)).unwrap();
        for b in &plan.blobs {
            let reads = report.stats.blob_disk_reads[b.index];
            match b.placement {
                Placement::Resident => prop_assert_eq!(reads, 1, "{}", &b.file),
                Placement::Streamed => {
                    let extra = prefetched_past_the_end(&plan, b.index) as u64;
                    prop_assert!(reads == passes as u64 || reads == passes as u64 + extra, "{}: {} reads", &b.file, reads)
                }
                Placement::OnDemand => prop_assert_eq!(reads, 0),
                Placement::HostCached => prop_assert!(false, "no host tier here"),
            }
        }
        if budget >= layout.order.iter().map(|&b| layout.blobs[b].length).sum::<u64>() {
            for pass in &report.passes[1..] {
                prop_assert_eq!(pass.disk_bytes, 0);
            }
        }
        // Against LRU with the same budget, on the same cyclic access.
        let total: u64 = layout.order.iter().map(|&b| layout.blobs[b].length).sum();
        let largest = layout.order.iter().map(|&b| layout.blobs[b].length).max().unwrap();
        if let Ok(lru) = Plan::compute(&layout, &PlanInputs { policy: Policy::Lru, ..PlanInputs::new(budget, k) })
            && total > budget
            && budget >= plan.ring_slots as u64 * largest + layout.order.iter().map(|&b| layout.blobs[b].length).min().unwrap()
        {
            let l = simulate(&lru, &disk_sim(vec![20_000; plan.blobs.len()], passes)).unwrap();
            // Planned bytes for exactly `passes` passes: without the prefetch of the pass
            // after the last (LRU does not prefetch).
            let planned: u64 = plan.blobs.iter().map(|b| {
                let cap = if b.placement == Placement::Resident { 1 } else { passes as u64 };
                b.length * report.stats.blob_disk_reads[b.index].min(cap)
            }).sum();
            prop_assert!(
                planned < l.stats.total.disk_bytes,
                "planned {} vs LRU {}", planned, l.stats.total.disk_bytes
            );
        }
    }
}
