//! The threaded runtime: real files through the host path, pattern sources under random
//! budgets and access sequences, memory pressure.

use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use residency::{
    BlobChecksums, Budget, CpuMemory, DeviceMemory, HostCache, ModelLayout, PatternSource,
    Placement, Policy, Residency, ResidencyError, ResidencyOptions, SystemClock,
};
use weights_format::layout;
use weights_format::{DType, Model, ModelConfig, ModelWriter};

fn config(n_layers: u32, tied: bool) -> ModelConfig {
    ModelConfig {
        n_layers,
        hidden_size: 64,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        ffn_dim: 96,
        vocab_size: 256,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-5,
        context_length: 256,
        tie_word_embeddings: tied,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        add_bos_token: false,
        ..ModelConfig::default()
    }
}

fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Finite f32 values: keep the exponent byte away from 0xFF.
            (x >> 24) as u8 & 0xBF
        })
        .collect()
}

fn write_model(out: &Path, n_layers: u32, tied: bool) -> Model {
    let config = config(n_layers, tied);
    let mut w = ModelWriter::create(out).unwrap();
    for (i, file) in layout::blob_files(config.n_layers).iter().enumerate() {
        let kind = layout::blob_kind(file).unwrap();
        let mut blob = w.begin_blob(file).unwrap();
        for (j, spec) in layout::blob_tensors(&config, kind).iter().enumerate() {
            let dtype = if spec.role.is_float_only() {
                DType::F32
            } else {
                DType::F16
            };
            let len = dtype.byte_len(&spec.shape).unwrap() as usize;
            blob.write_tensor(
                spec.name,
                dtype,
                &spec.shape,
                &noise((i * 100 + j) as u64, len),
            )
            .unwrap();
        }
        blob.finish().unwrap();
    }
    w.add_file("tokenizer.json", b"{}").unwrap();
    w.finish(config, "tokenizer.json", None, serde_json::Map::new())
        .unwrap()
}

/// The model on the CPU with `budget`, `host` and one slot of prefetch.
fn open_host(model: &Model, budget: u64, host: HostCache) -> Residency {
    let options = ResidencyOptions {
        host_cache: host,
        ..opts(budget, 1)
    };
    Residency::open_host(model, &options).unwrap()
}

fn opts(budget: u64, prefetch: usize) -> ResidencyOptions {
    ResidencyOptions {
        device_budget: Budget::Bytes(budget),
        host_cache: HostCache::Off,
        prefetch,
        resident_layers: None,
        policy: Policy::Planned,
        reserved_bytes: 0,
        checksums: BlobChecksums::FirstRead,
    }
}

#[test]
fn host_io_path_bytes_equal_plain_reads() {
    let dir = tempfile::tempdir().unwrap();
    for tied in [true, false] {
        let model = write_model(&dir.path().join(format!("m{tied}")), 6, tied);
        let files: Vec<Vec<u8>> = (0..model.metadata().blobs.len())
            .map(|b| std::fs::read(model.blob_path(b)).unwrap())
            .collect();
        let largest = files.iter().map(|f| f.len() as u64).max().unwrap();
        let total: u64 = files.iter().map(|f| f.len() as u64).sum();
        for (budget, host) in [
            (2 * largest, HostCache::Off),
            (3 * largest, HostCache::Bytes(2 * largest)),
            (total, HostCache::Off),
        ] {
            let res = open_host(&model, budget, host);
            let plan = res.plan().clone();
            println!("tied={tied} budget={budget}:\n{plan}");
            for _pass in 0..3 {
                for &b in &plan.order {
                    let guard = res.acquire(b).unwrap();
                    assert_eq!(
                        guard.host().unwrap(),
                        &files[b][..],
                        "{} tied={tied}",
                        plan.blobs[b].file
                    );
                }
                res.end_pass();
            }
            // Embedding rows on demand, at unaligned offsets.
            let embed = model.embed_blob();
            for (off, len) in [(0u64, 10u64), (4095, 2), (1000, 5000)] {
                let bytes = res.read_range(embed, off, len).unwrap();
                assert_eq!(bytes, &files[embed][off as usize..(off + len) as usize]);
            }
            let err = res
                .read_range(embed, files[embed].len() as u64 - 1, 2)
                .unwrap_err();
            assert!(
                matches!(err, ResidencyError::RangeOutOfBounds { .. }),
                "{err}"
            );
            let stats = res.stats();
            assert!(stats.peak_device_bytes <= budget);
            for b in &plan.blobs {
                let disk = stats.blob_disk_reads[b.index];
                match b.placement {
                    Placement::Resident => assert_eq!(disk, 1, "{}", b.file),
                    Placement::HostCached => assert_eq!(disk, 1, "{}", b.file),
                    Placement::Streamed => assert!((3..=4).contains(&disk), "{}", b.file),
                    Placement::OnDemand => assert_eq!(disk, 0, "{}", b.file),
                }
            }
            println!(
                "  disk {} B, host copies {} B, hits {} misses {}",
                stats.total.disk_bytes,
                stats.total.host_copy_bytes,
                stats.total.device_hits,
                stats.total.device_misses
            );
            let json = serde_json::to_string(&stats).unwrap();
            assert!(json.contains("\"disk_bytes\""));
        }
    }
}

#[test]
fn all_resident_and_all_streamed_deliver_the_same_bytes() {
    let lengths: Vec<u64> = vec![12 * 4096, 5 * 4096, 7 * 4096, 3 * 4096, 6 * 4096, 4096];
    let layout = ModelLayout::synthetic(12 * 4096, &lengths[1..5], 4096, true);
    let digest = |budget: u64, resident_layers: Option<usize>| {
        let source = Arc::new(PatternSource::new(lengths.clone()));
        let res = Residency::open_with(
            layout.clone(),
            source.clone(),
            Arc::new(CpuMemory::new(budget)),
            Arc::new(SystemClock::new()),
            &ResidencyOptions {
                resident_layers,
                ..opts(budget, 1)
            },
        )
        .unwrap();
        let mut seen = Vec::new();
        for _ in 0..3 {
            for &b in &layout.order {
                seen.extend_from_slice(res.acquire(b).unwrap().host().unwrap());
            }
            res.end_pass();
        }
        (seen, res.plan().resident_layers)
    };
    let (all, r_all) = digest(1 << 30, None);
    let (none, r_none) = digest(12 * 4096 + 4096 + 2 * 7 * 4096, Some(0));
    assert_eq!((r_all, r_none), (4, 0));
    assert!(all == none, "same bytes in the same order");
}

#[test]
fn memory_pressure_shrinks_the_resident_set() {
    let unit = 64 * 4096u64;
    let lengths = [vec![unit], vec![unit; 10], vec![4096]].concat();
    let layout = ModelLayout::synthetic(unit, &[unit; 10], 4096, false);
    let budget = 8 * unit;
    // The device has only 5 units although the budget says 8.
    let memory = Arc::new(CpuMemory::with_physical_limit(budget, 5 * unit));
    let source = Arc::new(PatternSource::new(lengths));
    let res = Residency::open_with(
        layout.clone(),
        source.clone(),
        memory.clone(),
        Arc::new(SystemClock::new()),
        &opts(budget, 1),
    )
    .unwrap();
    let plan = res.plan();
    println!("{plan}");
    assert!(plan.device_budget <= 5 * unit);
    // Ring 2 units + 3 layers fill the 5 units the device really has.
    assert_eq!(plan.resident_layers, 3);
    for _ in 0..2 {
        for &b in &layout.order {
            assert!(PatternSource::check(
                b,
                res.acquire(b).unwrap().host().unwrap()
            ));
        }
        res.end_pass();
    }
    assert!(memory.peak() <= 5 * unit);
    drop(res);
    assert_eq!(memory.used(), 0, "buffers are freed on drop");

    // If not even the ring fits, a clear error with the numbers.
    let memory = Arc::new(CpuMemory::with_physical_limit(budget, unit + 4096));
    let err = Residency::open_with(
        layout,
        source,
        memory,
        Arc::new(SystemClock::new()),
        &opts(budget, 1),
    )
    .err()
    .expect("ring cannot fit");
    println!("{err}");
    assert!(
        matches!(err, ResidencyError::BudgetTooSmall { .. }),
        "{err}"
    );
}

#[test]
fn missing_blob_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_model(&dir.path().join("m"), 2, true);
    std::fs::remove_file(model.blob_path(model.layer_blob(1))).unwrap();
    let err = Residency::open_host(&model, &opts(1 << 30, 1))
        .err()
        .expect("missing file");
    assert!(err.to_string().contains("layer_001.bin"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random budgets, blob sizes, ring depths and access sequences: the bytes are always
    /// right, a held guard is never overwritten, and the budget is never exceeded.
    #[test]
    fn runtime_invariants(
        n in 1usize..8,
        sizes in proptest::collection::vec(1u64..6, 8),
        tied in any::<bool>(),
        prefetch in 1usize..4,
        budget_blocks in 2u64..60,
        reserved_blocks in 0u64..4,
        policy_lru in any::<bool>(),
        access in proptest::collection::vec((0usize..16, any::<bool>()), 1..60),
    ) {
        let unit = 4096;
        let layers: Vec<u64> = sizes[..n].iter().map(|s| s * unit).collect();
        let embed = 3 * unit;
        let layout = ModelLayout::synthetic(embed, &layers, unit, tied);
        let lengths: Vec<u64> = layout.blobs.iter().map(|b| b.length).collect();
        let budget = (budget_blocks + reserved_blocks) * unit;
        let memory = Arc::new(CpuMemory::new(budget));
        let opened = Residency::open_with(
            layout.clone(),
            Arc::new(PatternSource::new(lengths.clone())),
            memory.clone(),
            Arc::new(SystemClock::new()),
            &ResidencyOptions {
                reserved_bytes: reserved_blocks * unit,
                policy: if policy_lru { Policy::Lru } else { Policy::Planned },
                ..opts(budget, prefetch)
            },
        );
        let res = match opened {
            Ok(res) => res,
            Err(ResidencyError::BudgetTooSmall { .. }) => return Ok(()),
            Err(err) => return Err(TestCaseError::fail(err.to_string())),
        };
        let order = layout.order.clone();
        let mut held: Option<(usize, residency::BlobGuard<'_>)> = None;
        for (pick, hold) in access {
            // Mostly the plan order, sometimes an arbitrary blob of the order.
            let blob = order[pick % order.len()];
            match res.acquire(blob) {
                Ok(guard) => {
                    prop_assert_eq!(guard.len() as u64, lengths[blob]);
                    prop_assert!(
                        PatternSource::check(blob, guard.host().unwrap()),
                        "blob {} bytes",
                        blob
                    );
                    if let Some((b, g)) = &held {
                        prop_assert!(
                            PatternSource::check(*b, g.host().unwrap()),
                            "held blob {} overwritten",
                            b
                        );
                    }
                    if hold {
                        held = Some((blob, guard));
                    }
                }
                Err(ResidencyError::AllSlotsPinned { .. }) => {
                    prop_assert!(held.is_some());
                    held = None;
                }
                Err(err) => return Err(TestCaseError::fail(err.to_string())),
            }
            prop_assert!(memory.used() <= budget - reserved_blocks * unit);
        }
        drop(held);
        prop_assert!(memory.peak() <= budget - reserved_blocks * unit);
    }
}

/// Flips one bit of `file` at `offset`.
fn flip(path: &Path, offset: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset] ^= 0x10;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_flipped_bit_fails_the_first_read_of_its_blob_on_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    for tied in [true, false] {
        for (host, resident_budget) in [
            (HostCache::Off, false),
            (HostCache::Bytes(1 << 30), false),
            (HostCache::Off, true),
        ] {
            let path = dir.path().join(format!("m{tied}{resident_budget}{host}"));
            let model = write_model(&path, 4, tied);
            // Layer 2: streamed (or resident with the large budget); the embedding table of an
            // untied model is only ever read in pieces (read_range).
            let bad_layer = model.layer_blob(2);
            flip(&model.blob_path(bad_layer), 5000);
            let embed = model.embed_blob();
            if !tied {
                flip(&model.blob_path(embed), 100);
            }
            let model = Model::open(&path).unwrap();
            let budget = if resident_budget {
                1 << 30
            } else {
                3 * model.blob(bad_layer).length
            };
            let res = open_host(&model, budget, host);
            for pass in 0..2 {
                for &b in &res.plan().order.clone() {
                    match res.acquire(b) {
                        Ok(_) => {
                            assert_ne!(b, bad_layer, "pass {pass}: the corrupt blob was handed out")
                        }
                        Err(err) => {
                            println!("{err}");
                            assert_eq!(b, bad_layer, "{err}");
                            assert!(
                                err.to_string().contains("layer_002.bin: checksum mismatch"),
                                "{err}"
                            );
                        }
                    }
                }
                res.end_pass();
            }
            if !tied {
                let err = res.read_range(embed, 0, 16).unwrap_err();
                println!("{err}");
                assert!(
                    matches!(err, ResidencyError::Checksum { ref file, .. } if file == "embed.bin"),
                    "{err}"
                );
            }
            // With checking off the same bytes are handed out as they are.
            let res = Residency::open_host(
                &model,
                &ResidencyOptions {
                    checksums: BlobChecksums::Off,
                    host_cache: host,
                    ..opts(budget, 1)
                },
            )
            .unwrap();
            res.acquire(bad_layer).unwrap();
            if !tied {
                res.read_range(embed, 0, 16).unwrap();
            }
        }
    }
}

#[test]
fn only_the_first_read_of_a_blob_is_hashed() {
    // Four equal blobs through a two-slot ring that holds nothing resident: every pass
    // re-reads every blob from the source, but each is hashed on its first read only. A
    // wrong checksum claimed for a blob fails it on every pass (it is never accepted).
    let len = 8192u64;
    for wrong in [None, Some(1)] {
        let source = Arc::new(PatternSource::new(vec![len; 4]).with_checksums(wrong.as_slice()));
        let layout = ModelLayout::synthetic(len, &[len, len], len, true);
        let res = Residency::open_with(
            layout,
            source.clone(),
            Arc::new(CpuMemory::new(2 * len)),
            Arc::new(SystemClock::new()),
            &opts(2 * len, 1),
        )
        .unwrap();
        assert_eq!(res.plan().resident_bytes, 0, "{}", res.plan());
        let passes = 3;
        for _ in 0..passes {
            for &b in &res.plan().order.clone() {
                let got = res.acquire(b);
                assert_eq!(got.is_err(), Some(b) == wrong, "blob {b}");
            }
            res.end_pass();
        }
        let reads = source.blob_reads();
        assert!(reads.iter().all(|&n| n >= passes), "{reads:?}");
        if wrong.is_none() {
            assert_eq!(res.stats().checksum_bytes, 4 * len, "{reads:?}");
        }
    }
}

/// A copy of `model`'s metadata and side files in `cache`, made a cache of the model served at
/// `url` (what `gdsllm-store` does for `-m http://…/`).
fn remote_cache(model: &Model, cache: &Path, url: &str) -> Model {
    std::fs::create_dir_all(cache).unwrap();
    for name in ["metadata.json", "metadata.json.xxh3", "tokenizer.json"] {
        std::fs::copy(model.dir().join(name), cache.join(name)).unwrap();
    }
    residency::init_cache(cache, model.metadata(), &residency::Origin::new(url)).unwrap();
    Model::open(cache).unwrap()
}

#[test]
fn the_network_tier_fetches_each_blob_once_and_later_passes_read_the_disk() {
    use gdsllm_fetch::testing::{Fault, TestServer};
    let dir = tempfile::tempdir().unwrap();
    let model = write_model(&dir.path().join("served"), 4, false);
    let server = TestServer::start();
    server.add_dir("models/tiny", model.dir());
    let url = format!("{}/models/tiny/", server.url());
    let files: Vec<Vec<u8>> = (0..model.metadata().blobs.len())
        .map(|b| std::fs::read(model.blob_path(b)).unwrap())
        .collect();
    let total: u64 = files.iter().map(|f| f.len() as u64).sum();
    let largest = files.iter().map(|f| f.len() as u64).max().unwrap();

    let cache = remote_cache(&model, &dir.path().join("cache"), &url);
    assert_eq!(
        residency::network::local_blob_bytes(cache.dir(), cache.metadata()).unwrap(),
        0
    );
    // One dropped connection on the way: the fetch resumes within the blob.
    let first = &model.metadata().blobs[1].file;
    server.inject(&format!("models/tiny/{first}"), Fault::DropAfter(4096), 1);
    let res = Residency::open_host(&cache, &opts(3 * largest, 1)).unwrap();
    let order = res.plan().order.clone();
    for pass in 0..3 {
        for &b in &order {
            let guard = res.acquire(b).unwrap();
            assert_eq!(
                guard.host().unwrap(),
                &files[b][..],
                "pass {pass}, blob {b}"
            );
        }
        res.end_pass();
    }
    let stats = res.stats();
    let network: Vec<u64> = stats.passes.iter().map(|p| p.network_bytes).collect();
    println!(
        "network bytes per pass {network:?}, disk {}",
        stats.total.disk_bytes
    );
    let embed = cache.embed_blob();
    let on_demand = cache.metadata().blobs[embed].length;
    // The untied model's embedding is read on demand (rows), not in the pass order.
    assert_eq!(network[0], total - on_demand, "{network:?}");
    assert_eq!(&network[1..], &[0, 0], "later passes fetch nothing");
    assert_eq!(
        stats.total.network_fetches as usize,
        files.len() - 1,
        "one fetch per blob"
    );
    // An embedding row on demand fetches the embedding blob once, then reads it locally.
    assert_eq!(
        res.read_range(embed, 100, 64).unwrap(),
        &files[embed][100..164]
    );
    res.read_range(embed, 4000, 64).unwrap();
    assert_eq!(res.stats().total.network_bytes, total);
    drop(res);
    assert_eq!(
        residency::network::local_blob_bytes(cache.dir(), cache.metadata()).unwrap(),
        total
    );

    // Everything is local now: with the server gone the model still opens and reads.
    server.reset_counts();
    drop(server);
    let res = Residency::open_host(&cache, &opts(3 * largest, 1)).unwrap();
    for &b in &order {
        assert_eq!(res.acquire(b).unwrap().host().unwrap(), &files[b][..]);
    }
    assert_eq!(res.stats().total.network_bytes, 0);
}

#[test]
fn a_corrupt_or_missing_served_blob_is_an_error_naming_it_and_is_not_kept() {
    use gdsllm_fetch::testing::{Content, TestServer};
    let dir = tempfile::tempdir().unwrap();
    let model = write_model(&dir.path().join("served"), 2, true);
    let server = TestServer::start();
    server.add_dir("models/tiny", model.dir());
    let layer = &model.metadata().blobs[1].file;
    let mut bad = std::fs::read(model.dir().join(layer)).unwrap();
    bad[100] ^= 1;
    server.add_file(
        &format!("models/tiny/{layer}"),
        Content::Bytes(Arc::new(bad)),
    );
    let url = format!("{}/models/tiny/", server.url());
    let cache = remote_cache(&model, &dir.path().join("cache"), &url);
    let res = Residency::open_host(&cache, &opts(1 << 30, 1)).unwrap();
    let err = res
        .acquire(1)
        .err()
        .expect("a corrupt blob fails")
        .to_string();
    assert!(
        err.contains(layer.as_str()) && err.contains("checksum mismatch") && err.contains(&url),
        "{err}"
    );
    assert!(!residency::network::is_fetched(cache.dir(), layer));
    res.acquire(0).unwrap();
    drop(res);

    // A blob the server does not have.
    let out = &model.metadata().blobs[3].file;
    let cache = remote_cache(
        &model,
        &dir.path().join("cache404"),
        &format!("{url}missing/"),
    );
    let res = Residency::open_host(&cache, &opts(1 << 30, 1)).unwrap();
    let err = res.acquire(3).err().expect("404").to_string();
    assert!(
        err.contains(out.as_str()) && err.contains("HTTP 404"),
        "{err}"
    );
}

const PAGE: u64 = 4096;

/// Four layers of 5, 7, 3 and 6 pages (pattern bytes), all streamed through a ring of two
/// slots, each kept in the host tier after its first read.
fn streamed_from_the_host_tier() -> (Residency, ModelLayout, Vec<u64>) {
    let lengths: Vec<u64> = [4, 5, 7, 3, 6, 1].map(|pages| pages * PAGE).to_vec();
    let layout = ModelLayout::synthetic(4 * PAGE, &lengths[1..5], PAGE, true);
    let source = Arc::new(PatternSource::new(lengths.clone()));
    let res = Residency::open_with(
        layout.clone(),
        source,
        Arc::new(CpuMemory::new(1 << 30)),
        Arc::new(SystemClock::new()),
        &ResidencyOptions {
            resident_layers: Some(0),
            host_cache: HostCache::Bytes(1 << 30),
            ..opts(1 << 30, 1)
        },
    )
    .unwrap();
    (res, layout, lengths)
}

#[test]
fn a_fill_from_the_host_tier_copies_only_the_ranges_it_is_given() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let page = PAGE;
    let (res, layout, lengths) = streamed_from_the_host_tier();
    // Layer 3, 6 pages, streamed from the host tier after its first read: the last layer of
    // the order, so the ring's prefetch never fills it before its own pass starts.
    let blob = 4;
    assert_eq!(res.plan().placement(blob), Placement::HostCached);
    let ranges = vec![(page, 2 * page), (5 * page, 100)];
    let partial = Arc::new(AtomicBool::new(false));
    let (on, given) = (Arc::clone(&partial), ranges.clone());
    res.set_fill_ranges(Some(Arc::new(move |b| {
        (b == blob && on.load(Ordering::SeqCst)).then(|| (7, given.clone()))
    })));

    // One pass over every blob; the tag of `blob`'s fill, its slot's bytes in `ranges`
    // checked against its host copy (all of them after a whole fill).
    let pass = || {
        let mut tag = None;
        for &b in &layout.order {
            let guard = res.acquire_with_host_copy(b).unwrap();
            if b == blob {
                tag = res.filled_with(b);
                if let Some(host) = guard.host_copy() {
                    assert!(PatternSource::check(b, host), "the host copy is the blob");
                    let slot = guard.host().unwrap();
                    for &(o, n) in &ranges {
                        let (o, n) = (o as usize, n as usize);
                        assert_eq!(slot[o..o + n], host[o..o + n], "range {o}+{n}");
                    }
                    if tag.is_none() {
                        assert!(PatternSource::check(b, slot), "a whole fill");
                    }
                }
            }
        }
        res.end_pass();
        tag
    };
    // The first pass reads from disk into the host tier: whole, whatever the ranges say.
    partial.store(true, Ordering::SeqCst);
    assert_eq!(pass(), None);
    // Ranges off: the second copies up the whole blob.
    partial.store(false, Ordering::SeqCst);
    assert_eq!(pass(), None);
    // Ranges on: the slot holds `blob`'s ranges only, copied from the host tier.
    partial.store(true, Ordering::SeqCst);
    assert_eq!(pass(), Some(7));
    // Every other host-tier copy was whole (whichever pass the ring's prefetch counted it
    // in): the bytes copied are the blobs' lengths less what `blob`'s partial fill skipped.
    let stats = res.stats();
    assert_eq!(stats.blob_host_copies[blob], 2);
    let whole: u64 = (0..lengths.len())
        .map(|b| stats.blob_host_copies[b] * lengths[b])
        .sum();
    let skipped = lengths[blob] - ranges.iter().map(|r| r.1).sum::<u64>();
    assert_eq!(stats.total.host_copy_bytes, whole - skipped);

    // A range past the blob's end fails the read that asked for it, naming the blob.
    res.set_fill_ranges(Some(Arc::new(move |b| {
        (b == blob).then(|| (8, vec![(5 * page, page + 1)]))
    })));
    let err = (0..2)
        .find_map(|_| {
            let mut failed = None;
            for &b in &layout.order {
                if let Err(e) = res.acquire(b) {
                    failed = Some(e);
                    break;
                }
            }
            res.end_pass();
            failed
        })
        .expect("the read of a range past the end fails");
    assert!(err.to_string().contains("layer_003"), "{err}");
}

#[test]
fn a_partial_fill_is_completed_to_what_the_ranges_ask_for_when_acquired() {
    use parking_lot::Mutex;
    let page = PAGE;
    let (res, layout, lengths) = streamed_from_the_host_tier();
    // Layer 3 (6 pages), the last of the order: filled during its own pass, after the pass
    // has set what its acquire asks for.
    let blob = 4;
    let len = lengths[blob];
    // The fill's ranges (a decode step's share) and what the acquire that follows asks for
    // (the pass being run: a prefill's bytes, the whole blob, a larger share's, the same).
    let decode = vec![(page, 2 * page), (5 * page, 100)];
    let prefill = vec![(0, 3 * page), (5 * page, page)];
    let larger_share = vec![(2 * page, page)];
    type Ask = Option<(u64, Vec<(u64, u64)>)>;
    // The ranges function is asked once per fill of `blob` and once more by its acquire while
    // that fill is partial: fills are the even calls.
    let state: Arc<Mutex<(u64, Ask)>> = Arc::new(Mutex::new((0, None)));
    let (asked, fill) = (Arc::clone(&state), decode.clone());
    res.set_fill_ranges(Some(Arc::new(move |b| {
        if b != blob {
            return None;
        }
        let mut s = asked.lock();
        s.0 += 1;
        if s.0 % 2 == 1 {
            Some((7, fill.clone()))
        } else {
            s.1.clone()
        }
    })));

    // One pass over every blob with `ask` at `blob`'s acquire: the tag its fill has then, the
    // pass's completions, and the slot's bytes checked against the host copy over `held`.
    let pass = |ask: Ask, held: &[(u64, u64)]| {
        state.lock().1 = ask;
        let mut tag = None;
        for &b in &layout.order {
            let guard = res.acquire_with_host_copy(b).unwrap();
            if b == blob {
                tag = res.filled_with(b);
                let host = guard.host_copy().expect("after the first pass");
                let slot = guard.host().unwrap();
                for &(o, n) in held {
                    let (o, n) = (o as usize, n as usize);
                    assert_eq!(slot[o..o + n], host[o..o + n], "range {o}+{n}");
                }
            }
        }
        res.end_pass();
        let completions = res.stats().passes.last().unwrap().fill_completions;
        (tag, completions)
    };
    // The first pass reads from disk: whole, the function not asked.
    state.lock().1 = None;
    for &b in &layout.order {
        drop(res.acquire(b).unwrap());
    }
    res.end_pass();
    assert_eq!(state.lock().0, 0);

    // A prefill after decode steps: what the decode fill left out of the prefill's ranges
    // is copied up, and the fill takes the prefill's tag.
    let both: Vec<(u64, u64)> = [decode.clone(), prefill.clone()].concat();
    assert_eq!(pass(Some((9, prefill.clone())), &both), (Some(9), 1));
    // Asked for the whole blob: completed to whole, no tag.
    assert_eq!(pass(None, &[(0, len)]), (None, 1));
    // A larger share asks for less than the fill holds: nothing copied, the fill's tag stays
    // (the device has the bytes; the CPU computes what the fill left out).
    assert_eq!(pass(Some((11, larger_share)), &decode), (Some(7), 0));
    // The same tag: nothing to do.
    assert_eq!(pass(Some((7, decode.clone())), &decode), (Some(7), 0));
    assert_eq!(
        state.lock().0,
        8,
        "asked once per fill and once per acquire"
    );

    // Every byte copied is accounted: whole copies of every other blob, `blob`'s four
    // partial fills, and the two completions (the prefill's missing page and a bit, the
    // rest of the blob).
    let stats = res.stats();
    assert_eq!(stats.blob_host_copies[blob], 4);
    assert_eq!(stats.total.fill_completions, 2);
    let whole: u64 = (0..lengths.len())
        .filter(|&b| b != blob)
        .map(|b| stats.blob_host_copies[b] * lengths[b])
        .sum();
    let decode_bytes: u64 = decode.iter().map(|r| r.1).sum();
    let to_prefill = page + (page - 100);
    let to_whole = len - decode_bytes;
    assert_eq!(
        stats.total.host_copy_bytes,
        whole + 4 * decode_bytes + to_prefill + to_whole
    );
}
