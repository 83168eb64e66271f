//! The CPU backend's matmul bandwidth over one 7B-sized weight (`[11008, 4096]`, a 7B's FFN
//! matrix) per dtype, at 1, 8 and 32 activation rows (one sequence's, and a batch's decode rows): weight bytes read per second, the figure the
//! hybrid placement planner calibrates (`llama::hybrid::calibrate`) and that decoding is bound
//! by. Each dtype is measured with the stored layout (weights the backend is told may move:
//! what the calibration and a streamed split read) and with the repacked copies the CPU keeps
//! of resident q4_0/q4_1/q8_0 weights (`backend::cpu::repack`). The weight is read from RAM
//! (it is larger than the caches); each figure is the best of several calls.
//!
//! `RAYON_NUM_THREADS=N cargo run --release -p llama --example cpu_matvec [DTYPE ...]`; prints a
//! table (on stdout) with the thread count. `GDSLLM_CPU_AVX512=0` leaves the AVX-512 kernels
//! unused, for an A/B in one binary.

use std::time::{Duration, Instant};

use llama::backend::{PassInfo, RowGroup};
use llama::{Backend, CpuBackend, WeightView};
use weights_format::DType;

type Error = Box<dyn std::error::Error>;

const ROWS: usize = 11008;
const COLS: usize = 4096;

/// Best seconds of one call of `f`, over at least 5 calls and half a second, after a warm-up
/// call (which makes the repacked copy).
fn best_seconds(mut f: impl FnMut() -> Result<(), Error>) -> Result<f64, Error> {
    f()?;
    let start = Instant::now();
    let (mut best, mut runs) = (f64::INFINITY, 0);
    while runs < 5 || start.elapsed() < Duration::from_millis(500) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    Ok(best)
}

fn main() -> Result<(), Error> {
    CpuBackend::adopt_current_thread(None);
    println!("threads: {}", CpuBackend::threads());
    println!("dtype  layout    kind    rows  GB/s   ms/call");
    // A random-looking weight (speed does not depend on the values; distinct rows so that no
    // cache holds them).
    let values: Vec<f32> = (0..ROWS as u64 * COLS as u64)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    // `cpu_matvec f16 q4_1`: only those dtypes.
    let only: Vec<String> = std::env::args().skip(1).collect();
    for dtype in [DType::F16, DType::Q4_1, DType::Q4_0, DType::Q8_0] {
        if !only.is_empty() && !only.iter().any(|d| *d == format!("{dtype}")) {
            continue;
        }
        let mut bytes = Vec::new();
        weights_format::quant::quantize(dtype, &values, &mut bytes)?;
        let w = WeightView::host(dtype, ROWS, COLS, &bytes);
        for stable in [false, true] {
            if stable && dtype == DType::F16 {
                continue;
            }
            let be = CpuBackend::new();
            be.begin_pass(&PassInfo {
                rows: 1,
                sequence: Some(0),
                pos: 0,
                weights_stable: stable,
                generation: 0,
            })?;
            // One sequence of `rows` rows (a prompt), or `rows` sequences of one row each (a
            // batch's decode step; each row must round as it would alone).
            let passes = [(1, false), (8, false), (32, false), (8, true), (32, true)];
            for (rows, decode) in passes {
                let x = be.upload(&vec![0.25; rows * COLS])?;
                let mut out = be.alloc(rows * ROWS)?;
                let groups = if decode {
                    vec![RowGroup::solo(1); rows]
                } else {
                    vec![RowGroup::solo(rows)]
                };
                let seconds = best_seconds(|| {
                    be.matmul_batch(&x, &groups, &[w], &mut [&mut out])?;
                    Ok(())
                })?;
                let layout = if stable { "repacked" } else { "stored" };
                let kind = if decode { "decode" } else { "prompt" };
                println!(
                    "{:<6} {layout:<9} {kind:<7} {rows:>4}  {:>5.1}  {:>7.3}",
                    format!("{dtype}"),
                    bytes.len() as f64 / seconds / 1e9,
                    seconds * 1e3
                );
            }
        }
    }
    Ok(())
}
