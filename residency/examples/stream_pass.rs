//! Streams a model's blobs through the residency cache with a simulated compute load and
//! compares the effective GB/s with a raw O_DIRECT read of the same files, in the same run.
//!
//! `cargo run --release -p residency --example stream_pass -- MODEL_DIR BUDGET [COMPUTE_MS_PER_LAYER] [PASSES]`

use std::time::{Duration, Instant};

use gds_io::{DirectFile, ParallelRead};
use residency::{Budget, HostCache, Residency, ResidencyOptions};
use weights_format::Model;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: stream_pass MODEL_DIR BUDGET [COMPUTE_MS_PER_LAYER] [PASSES]");
        std::process::exit(2);
    }
    let model = Model::open(&args[1])?;
    let budget = residency::parse_bytes(&args[2])?;
    let compute = Duration::from_secs_f64(args.get(3).map_or(Ok(0.0), |s| s.parse::<f64>())? / 1e3);
    let passes: usize = args.get(4).map_or(Ok(3), |s| s.parse())?;

    // Raw: every blob in pass order, whole-file O_DIRECT reads.
    let res = Residency::open_host(
        &model,
        &ResidencyOptions {
            device_budget: Budget::Bytes(budget),
            host_cache: HostCache::Off,
            ..ResidencyOptions::default()
        },
    )?;
    let order = res.plan().order.clone();
    println!("{}", res.plan());
    let started = Instant::now();
    let mut raw_bytes = 0u64;
    for &b in &order {
        let file = DirectFile::open(model.blob_path(b))?;
        let (_, rec) = file.read_range_parallel(0, file.len(), ParallelRead::default())?;
        raw_bytes += rec.bytes;
    }
    let raw_gbps = raw_bytes as f64 / started.elapsed().as_secs_f64() / 1e9;

    for _ in 0..passes {
        for &b in &order {
            let guard = res.acquire(b)?;
            // The simulated compute: busy for `compute`, touching the bytes once.
            let t = Instant::now();
            let mut sum = 0u64;
            for chunk in guard.host().expect("host memory").chunks(4096) {
                sum = sum.wrapping_add(chunk[0] as u64);
            }
            std::hint::black_box(sum);
            while t.elapsed() < compute {
                std::hint::spin_loop();
            }
        }
        res.end_pass();
    }
    let stats = res.stats();
    for (i, p) in stats.passes.iter().enumerate() {
        println!(
            "pass {i}: disk {:.1} MB in {:.1} ms, effective {:.2} GB/s ({:.2}x raw {:.2} GB/s), compute waited {:.1} ms, io waited for slot {:.1} ms, overlap {:.2}",
            p.disk_bytes as f64 / 1e6,
            p.elapsed_s * 1e3,
            p.effective_gbps(),
            p.effective_gbps() / raw_gbps,
            raw_gbps,
            p.compute_wait_s * 1e3,
            p.slot_wait_s * 1e3,
            p.overlap_fraction(),
        );
    }
    Ok(())
}
