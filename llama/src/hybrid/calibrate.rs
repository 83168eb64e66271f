//! Measuring what the placement planner (`residency::placement`) needs to know of this
//! machine's compute: the CPU backend's matmul speed per weight dtype at 1, 8 and 32 rows, and
//! on CUDA the GPU's per dtype at 1, 8, 32 and 512 rows of a layer's matmul calls, its pinned
//! host→device copies and the time of one handoff between the two (what a split matmul adds),
//! and the CPU's matmul and those copies at the same time ([`concurrent_rates`]: on one DRAM
//! they do not add up; skipped without a GPU, where nothing is copied).
//!
//! Each figure is the best of several passes over a weight far larger than the caches (the
//! planner needs what streaming weights costs, not what a cached one does); the concurrent
//! ones are averages over one window instead, each side alone and together alike, so that the
//! two sides cover the same time. The weight's values
//! are a fixed pattern: speed does not depend on them.
//!
//! # The CPU's probe is sized from its caches
//!
//! A fixed 256 MiB probe is not "far larger than the caches" everywhere: server CPUs (and the
//! VMs on them, which often report the host's caches) have hundreds of MiB of last-level
//! cache. On the lent H100 VM the planner predicted 18.7 tok/s for the split f16 7B's batch-1
//! decode and the run made 8.6: solving the split for the achieved time gives the CPU ~70 GB/s
//! where its calibration must have said ~150, a probe read from cache rather than RAM.
//! [`cpu_probe_bytes`] therefore makes the probe at least four times the last-level caches
//! (summed over their distinct instances, from sysfs: [`last_level_cache_bytes`]), within a
//! quarter of the available memory and [`MAX_CPU_PROBE`].

use std::time::{Duration, Instant};

use residency::CpuRate;
use weights_format::DType;

use crate::LlamaError;
use crate::backend::{Backend, CpuBackend, RowGroup, WeightView};

/// Columns of the probe weights (a 7B's hidden size, a whole number of every dtype's blocks).
const PROBE_COLS: usize = 4096;

/// Weight rows of each CPU matmul call of a probe pass: about the CPU's share of one 4096-row
/// matrix in a split layer. Why not one call over the whole probe: a split pass is ~100 such
/// calls, and one call over a 1.2 GB matrix hid what each costs (its tasks' last round, the
/// transposition of its output, the threads meeting): the f16 probe at 8 rows said 58 GB/s where
/// the split calls ran at ~41 (H200 host, 2026-11-29).
const CPU_PROBE_CALL_ROWS: usize = 2048;

/// How long each figure is measured for (at least 3 passes).
const MEASURE_FOR: Duration = Duration::from_millis(300);

/// The CPU's matmuls of `rows` activation rows over `w`, one call per [`CPU_PROBE_CALL_ROWS`]
/// weight rows: a pass of the probe. The rows are `rows` sequences of one row each, what a
/// batched decode step hands the CPU's share (and one row, a lone sequence's step), so that
/// the probe runs the kernels those passes run: one sequence of 8 rows takes the prompt
/// kernels (`RowGroup::solo`), which for q4_0/q4_1/q8_0 read each weight block once for all
/// rows, while 8 decode rows are dotted one by one for their bits. With the prompt kernels
/// the q4_1 probe said 12.9 GB/s at 8 rows where a batch-8 split ran its share at 7.5 (H200,
/// 2026-11-29) and the planner predicted 151 tok/s against 87 achieved. A prefill chunk's
/// share, which does take the prompt kernels, is priced at the 32-row figure: low for it, so
/// the planner gives a prefill less CPU share than it could take (the GPU alone prefills at
/// thousands of tokens a second from the host tier; the CPU's share there is small anyway).
fn cpu_probe_pass(
    be: &CpuBackend,
    w: WeightView<'_>,
    rows: usize,
    x: &Vec<f32>,
    out: &mut Vec<f32>,
) -> Result<(), LlamaError> {
    let bytes = crate::backend::host_bytes(&w, "cpu")?;
    let row_bytes = w.row_bytes();
    let decode_rows = vec![RowGroup::solo(1); rows];
    for first in (0..w.rows).step_by(CPU_PROBE_CALL_ROWS) {
        let n = CPU_PROBE_CALL_ROWS.min(w.rows - first);
        let part = &bytes[first * row_bytes..(first + n) * row_bytes];
        let window = WeightView::host(w.dtype, n, w.cols, part);
        be.matmul_batch(x, &decode_rows, &[window], &mut [&mut *out])?;
    }
    Ok(())
}

/// A `[rows, PROBE_COLS]` weight of `dtype` of about `bytes` bytes (at least one row), and its
/// row count.
fn probe_weight(dtype: DType, bytes: usize) -> Result<(Vec<u8>, usize), LlamaError> {
    let row = probe_row(dtype, PROBE_COLS)?;
    let rows = (bytes / row.len()).max(1);
    Ok((row.repeat(rows), rows))
}

/// Best seconds of `pass` over at least 3 runs and [`MEASURE_FOR`], after one to warm up.
fn best_seconds(mut pass: impl FnMut() -> Result<(), LlamaError>) -> Result<f64, LlamaError> {
    pass()?;
    let start = Instant::now();
    let mut best = f64::INFINITY;
    let mut runs = 0;
    while runs < 3 || start.elapsed() < MEASURE_FOR {
        let t = Instant::now();
        pass()?;
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    Ok(best)
}

/// The CPU backend's matmul speed for `dtype` weights on the current rayon pool at 1, 8 and
/// 32 rows, over a probe weight of about `probe_bytes` bytes (pick one well above the
/// last-level caches: [`cpu_probe_bytes`]).
pub fn measure_cpu(dtype: DType, probe_bytes: usize) -> Result<CpuRate, LlamaError> {
    let (bytes, rows) = probe_weight(dtype, probe_bytes)?;
    let w = WeightView::host(dtype, rows, PROBE_COLS, &bytes);
    let be = CpuBackend::new();
    let gbps = |rows: usize| -> Result<f64, LlamaError> {
        let x = vec![0.25; rows * w.cols];
        let mut out = vec![0.0; rows * CPU_PROBE_CALL_ROWS.min(w.rows)];
        let seconds = best_seconds(|| cpu_probe_pass(&be, w, rows, &x, &mut out))?;
        Ok((w.rows * w.row_bytes()) as f64 / seconds / 1e9)
    };
    Ok(CpuRate {
        dtype,
        gbps_1: gbps(1)?,
        gbps_8: gbps(8)?,
        gbps_32: Some(gbps(32)?),
    })
}

/// Weight bytes per second (10^9) the CPU backend's matmul of `rows` rows over `w` sustains:
/// every pass over [`MEASURE_FOR`] (at least 2) after one to warm up, averaged — not the best
/// one, so that it covers the same window as copies running beside it.
fn cpu_sustained_gbps(be: &CpuBackend, w: WeightView<'_>, rows: usize) -> Result<f64, LlamaError> {
    let x = vec![0.25; rows * w.cols];
    let mut out = vec![0.0; rows * CPU_PROBE_CALL_ROWS.min(w.rows)];
    let mut pass = || cpu_probe_pass(be, w, rows, &x, &mut out);
    pass()?;
    let started = Instant::now();
    let mut passes = 0;
    while passes < 2 || started.elapsed() < MEASURE_FOR {
        pass()?;
        passes += 1;
    }
    let bytes = (w.rows * w.row_bytes() * passes) as f64;
    Ok(bytes / started.elapsed().as_secs_f64() / 1e9)
}

/// The copies a concurrent probe runs beside the CPU: `copies(work)` runs `work` on this
/// thread while copies run on another, and returns the GB/s they achieved meanwhile.
pub type CopiesDuring<'a> = dyn FnMut(&mut dyn FnMut()) -> Result<f64, LlamaError> + 'a;

/// The CPU backend's `dtype` matmul (over a probe weight of about `probe_bytes`, on the
/// current rayon pool) and the copies of `copies` (pinned host→device ones on a GPU:
/// [`measure_concurrent`]), each alone and then both at once, at each of
/// [`residency::GpuRates::CONCURRENT_ROWS`]: on one DRAM the two do not add up
/// (`residency::placement`'s module doc says how the planner uses these).
pub fn concurrent_rates(
    dtype: DType,
    probe_bytes: usize,
    copies: &mut CopiesDuring<'_>,
) -> Result<Vec<residency::ConcurrentRate>, LlamaError> {
    let (bytes, rows) = probe_weight(dtype, probe_bytes)?;
    let w = WeightView::host(dtype, rows, PROBE_COLS, &bytes);
    let cpu = CpuBackend::new();
    let h2d_alone_gbps = copies(&mut || std::thread::sleep(MEASURE_FOR))?;
    let mut rates = Vec::new();
    for rows in residency::GpuRates::CONCURRENT_ROWS {
        let cpu_alone_gbps = cpu_sustained_gbps(&cpu, w, rows)?;
        let mut beside = None;
        let h2d_gbps = copies(&mut || beside = Some(cpu_sustained_gbps(&cpu, w, rows)))?;
        let cpu_gbps = beside.ok_or_else(|| LlamaError::Config {
            setting: "calibration",
            message: "the concurrent probe's copies did not run the CPU's matmul".into(),
        })??;
        let rate = residency::ConcurrentRate {
            dtype,
            rows,
            cpu_alone_gbps,
            cpu_gbps,
            h2d_alone_gbps,
            h2d_gbps,
        };
        tracing::info!(
            "{dtype:?} at {rows} rows: the CPU {:.1} GB/s alone, {:.1} beside the copies; the \
             copies {:.1} GB/s alone, {:.1} beside the CPU",
            rate.cpu_alone_gbps,
            rate.cpu_gbps,
            rate.h2d_alone_gbps,
            rate.h2d_gbps
        );
        rates.push(rate);
    }
    Ok(rates)
}

/// Pieces the concurrent probe's copies are made in: about one matmul weight's share of a
/// 7B layer, the grain the ring fills a split blob in.
#[cfg(feature = "cuda")]
const CONCURRENT_COPY_PIECE: usize = 32 << 20;

/// [`concurrent_rates`] with `be`'s pinned host→device copies, from a pinned buffer as large
/// as the CPU's probe (`probe_bytes`: above the caches, so both read DRAM), on a thread and
/// a stream of their own, as the residency ring's reader copies the host tier.
#[cfg(feature = "cuda")]
pub fn measure_concurrent(
    be: &crate::backend::CudaBackend,
    dtype: DType,
    probe_bytes: usize,
) -> Result<Vec<residency::ConcurrentRate>, LlamaError> {
    let mut copies = be.pinned_copies(probe_bytes, CONCURRENT_COPY_PIECE)?;
    concurrent_rates(dtype, probe_bytes, &mut |work| {
        Ok(copies.during(work).map(|(gbps, ())| gbps)?)
    })
}

/// The largest CPU probe [`cpu_probe_bytes`] picks (its passes at 32 rows stay well under a
/// second on a server's threads).
pub const MAX_CPU_PROBE: usize = 4 << 30;

/// Where Linux describes the CPUs' caches.
const SYSFS_CPUS: &str = "/sys/devices/system/cpu";

/// The CPU probe's size: `at_least`, or four times the last-level caches when that is more
/// (their sum over distinct instances, [`last_level_cache_bytes`]), at most a quarter of the
/// available memory (below `at_least` only when memory is that short) and [`MAX_CPU_PROBE`].
/// Returns the size and the caches found.
pub fn cpu_probe_bytes(at_least: usize) -> (usize, Option<u64>) {
    let caches = last_level_cache_bytes(std::path::Path::new(SYSFS_CPUS));
    let available = residency::mem_available().map_or(usize::MAX, |b| (b / 4) as usize);
    (probe_size(at_least, caches, available), caches)
}

/// [`cpu_probe_bytes`]' arithmetic: `at_least`, or 4 × `caches` when more, within
/// `available` and [`MAX_CPU_PROBE`].
fn probe_size(at_least: usize, caches: Option<u64>, available: usize) -> usize {
    let wanted = caches.map_or(0, |c| c.saturating_mul(4) as usize);
    at_least
        .max(wanted.min(MAX_CPU_PROBE))
        .min(available.max(1 << 20))
}

/// The bytes of the CPU's last-level caches under `cpu_root` (sysfs
/// `/sys/devices/system/cpu`): of the highest level any `cpuN/cache/indexM` names (data and
/// unified caches), the sum of `size` over its distinct instances (one per distinct
/// `shared_cpu_list`). `None` when nothing there can be read.
pub fn last_level_cache_bytes(cpu_root: &std::path::Path) -> Option<u64> {
    use std::collections::BTreeMap;
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    // Per level: each instance's size, keyed by the CPUs sharing it.
    let mut levels: BTreeMap<u32, BTreeMap<String, u64>> = BTreeMap::new();
    for cpu in std::fs::read_dir(cpu_root).ok()?.flatten() {
        let name = cpu.file_name();
        let name = name.to_string_lossy();
        let is_cpu = name
            .strip_prefix("cpu")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if !is_cpu {
            continue;
        }
        let Ok(indexes) = std::fs::read_dir(cpu.path().join("cache")) else {
            continue;
        };
        for index in indexes.flatten() {
            if !index.file_name().to_string_lossy().starts_with("index") {
                continue;
            }
            let dir = index.path();
            if read(dir.join("type")).is_some_and(|t| t.trim() == "Instruction") {
                continue;
            }
            let level = read(dir.join("level")).and_then(|l| l.trim().parse::<u32>().ok());
            let size = read(dir.join("size")).and_then(|s| parse_cache_size(&s));
            let (Some(level), Some(size)) = (level, size) else {
                continue;
            };
            let shared = read(dir.join("shared_cpu_list"))
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|| name.to_string());
            levels.entry(level).or_default().insert(shared, size);
        }
    }
    let (_, instances) = levels.into_iter().next_back()?;
    Some(instances.values().sum())
}

/// A sysfs cache `size`: `32768K`, `32M`, `1G` or plain bytes.
fn parse_cache_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let value: u64 = digits.parse().ok()?;
    let scale = match unit.trim() {
        "" => 1,
        "K" | "k" | "KB" | "KiB" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        "G" | "GB" | "GiB" => 1 << 30,
        _ => return None,
    };
    value.checked_mul(scale)
}

/// Layers of [`measure_gpu_matmuls`]'s probe between two waits for the GPU.
#[cfg(feature = "cuda")]
const LAYERS_PER_SYNC: usize = 8;

/// A 7B layer's matmul weights (rows, cols) in the order the forward pass calls them: Q, K, V
/// (one call), the output projection, gate and up (one call), down.
#[cfg(feature = "cuda")]
const LAYER_7B: [(usize, usize); 7] = [
    (4096, 4096),
    (4096, 4096),
    (4096, 4096),
    (4096, 4096),
    (11008, 4096),
    (11008, 4096),
    (4096, 11008),
];

/// One probe row of `cols` values of `dtype`.
fn probe_row(dtype: DType, cols: usize) -> Result<Vec<u8>, LlamaError> {
    let values: Vec<f32> = (0..cols as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut row = Vec::new();
    weights_format::quant::quantize(dtype, &values, &mut row).map_err(|e| LlamaError::Config {
        setting: "calibration",
        message: format!("a probe row of {dtype:?}: {e}"),
    })?;
    Ok(row)
}

/// The GPU's speed for `dtype` weights at each of [`residency::GpuRates::ROWS`]: weight bytes
/// per second of a 7B layer's four matmul calls (`LAYER_7B`), made as the forward pass
/// makes them (`matmul_batch` for Q/K/V and gate/up, `matmul_add_batch` into the residual for
/// the output projection and down), from device memory. A batch and a prefill chunk are
/// measured, not extrapolated from one kernel: the kernel each row count picks (and, in
/// prefill, the conversion of quantized weights to f16 for the GEMM) is what a pass gets.
///
/// The layer's calls are made [`LAYERS_PER_SYNC`] times between two waits for the GPU, as a
/// pass makes a model's layers one after another: with one layer a wait, every layer carried
/// the wait's fixed cost (tens of microseconds), which is a fair part of a quantized layer's
/// time (the f16 figures rose 10–14 % on the H200 machine with eight).
///
/// The decode row counts (up to [`residency::GpuRates::CONCURRENT_ROWS`]' last) are that many
/// sequences of one row each, as a batched step hands them over, and the prefill figure one
/// sequence's chunk: from [`crate::backend::cuda::CUBLAS_MIN_ROWS`] rows a sequence's rows take
/// cuBLAS (quantized weights converted to f16) where a batch of one-row sequences takes the
/// kernels, and with 32 rows probed as one sequence the Qwen2-7B Q4_K_M's batches of 32 ran
/// 1.5–1.6x faster than predicted (BENCHMARKS.md, 2026-11-29 17:52).
#[cfg(feature = "cuda")]
pub fn measure_gpu_matmuls(
    be: &crate::backend::CudaBackend,
    dtype: DType,
) -> Result<Vec<residency::GpuMatmulRate>, LlamaError> {
    use crate::weights::{BlobBytes, WeightSource};

    let mut blob = Vec::new();
    let mut offsets = Vec::new();
    for &(rows, cols) in &LAYER_7B {
        offsets.push(blob.len());
        blob.extend(probe_row(dtype, cols)?.repeat(rows));
    }
    let layer_bytes = blob.len() as f64;
    let weights = be.upload_weights(vec![blob])?;
    let guard = weights.acquire(0)?;
    let all = guard.bytes();
    let views: Vec<WeightView<'_>> = LAYER_7B
        .iter()
        .zip(&offsets)
        .map(|(&(rows, cols), &offset)| {
            let len = rows * (cols / dtype.block_len() * dtype.block_bytes());
            all.slice(offset, len)
                .map(|bytes| WeightView {
                    dtype,
                    rows,
                    cols,
                    bytes,
                })
                .ok_or_else(|| LlamaError::Config {
                    setting: "calibration",
                    message: "a probe weight outside its blob".into(),
                })
        })
        .collect::<Result<_, _>>()?;
    let mut rates = Vec::new();
    for rows in residency::GpuRates::ROWS {
        let x = be.upload(&vec![0.25; rows * 4096])?;
        let x_ffn = be.upload(&vec![0.25; rows * 11008])?;
        let mut qkv: Vec<_> = (0..3)
            .map(|_| be.alloc(rows * 4096))
            .collect::<Result<_, _>>()?;
        let mut gate_up: Vec<_> = (0..2)
            .map(|_| be.alloc(rows * 11008))
            .collect::<Result<_, _>>()?;
        let mut scratch = be.alloc(rows * 4096)?;
        let mut residual = be.alloc(rows * 4096)?;
        let decode = rows <= *residency::GpuRates::CONCURRENT_ROWS.last().unwrap_or(&1);
        let groups = if decode {
            vec![RowGroup::solo(1); rows]
        } else {
            vec![RowGroup::solo(rows)]
        };
        let seconds = best_seconds(|| {
            for _ in 0..LAYERS_PER_SYNC {
                {
                    let mut outs: Vec<&mut _> = qkv.iter_mut().collect();
                    be.matmul_batch(&x, &groups, &views[0..3], &mut outs)?;
                }
                be.matmul_add_batch(&x, &groups, views[3], &mut scratch, &mut residual)?;
                {
                    let mut outs: Vec<&mut _> = gate_up.iter_mut().collect();
                    be.matmul_batch(&x, &groups, &views[4..6], &mut outs)?;
                }
                be.matmul_add_batch(&x_ffn, &groups, views[6], &mut scratch, &mut residual)?;
            }
            let mut one = [0.0];
            be.read(&residual, &mut one)?;
            Ok(())
        })?;
        rates.push(residency::GpuMatmulRate {
            dtype,
            rows,
            gbps: LAYERS_PER_SYNC as f64 * layer_bytes / seconds / 1e9,
        });
    }
    Ok(rates)
}

/// The GPU's figures on `be`: its matmuls for each of `dtypes` ([`measure_gpu_matmuls`]), its
/// pinned host→device copies (over `probe_bytes`) and one CPU↔GPU handoff.
#[cfg(feature = "cuda")]
pub fn measure_gpu(
    be: &crate::backend::CudaBackend,
    dtypes: &[DType],
    probe_bytes: usize,
) -> Result<residency::GpuRates, LlamaError> {
    let mut matmul = Vec::new();
    for &dtype in dtypes {
        matmul.extend(measure_gpu_matmuls(be, dtype)?);
    }
    let h2d_gbps = be.measure_pinned_h2d_gbps(probe_bytes.min(256 << 20))?;
    // One handoff of a 7B-sized split: a row of activations read back, a share's output rows
    // copied up.
    let x = be.alloc(PROBE_COLS)?;
    let mut back = vec![0.0; PROBE_COLS];
    let share = vec![0.0; 11008];
    let handoff = best_seconds(|| {
        be.read(&x, &mut back)?;
        let up = be.upload(&share)?;
        let mut one = [0.0];
        be.read(&up, &mut one)?;
        Ok(())
    })?;
    Ok(residency::GpuRates {
        name: be.device_name().to_string(),
        matmul,
        h2d_gbps,
        handoff_us: handoff * 1e6,
        concurrent: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_weights_are_whole_rows_of_the_dtype() {
        for dtype in [DType::F16, DType::Q4_1, DType::Q4K] {
            let (bytes, rows) = probe_weight(dtype, 1 << 20).unwrap();
            let row_bytes = PROBE_COLS / dtype.block_len() * dtype.block_bytes();
            assert_eq!(bytes.len(), rows * row_bytes, "{dtype:?}");
            assert!(bytes.len() <= 1 << 20 && bytes.len() > (1 << 20) - row_bytes);
        }
    }

    #[test]
    fn the_cpu_figures_are_positive_rates() {
        let rate = measure_cpu(DType::Q8_0, 1 << 20).unwrap();
        println!("{rate:?}");
        assert_eq!(rate.dtype, DType::Q8_0);
        for gbps in [rate.gbps_1, rate.gbps_8, rate.gbps_32.unwrap()] {
            assert!(gbps.is_finite() && gbps > 0.0, "{rate:?}");
        }
    }

    #[test]
    fn the_concurrent_probe_measures_each_side_alone_and_together() {
        // Without a GPU: a thread copying between two host buffers stands in for the PCIe
        // copies (it reads and writes the same DRAM the CPU's matmul reads).
        let mut copies = |work: &mut dyn FnMut()| -> Result<f64, LlamaError> {
            let stop = std::sync::atomic::AtomicBool::new(false);
            let (from, mut to) = (vec![1u8; 16 << 20], vec![0u8; 16 << 20]);
            std::thread::scope(|scope| {
                let copier = scope.spawn(|| {
                    let started = Instant::now();
                    let mut copied = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        to.copy_from_slice(&from);
                        copied += from.len() as u64;
                    }
                    copied as f64 / started.elapsed().as_secs_f64() / 1e9
                });
                work();
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(copier.join().expect("the copy thread"))
            })
        };
        let rates = concurrent_rates(DType::Q8_0, 4 << 20, &mut copies).unwrap();
        for r in &rates {
            println!("{r:?}");
        }
        let rows: Vec<usize> = rates.iter().map(|r| r.rows).collect();
        assert_eq!(rows, residency::GpuRates::CONCURRENT_ROWS);
        for r in &rates {
            assert_eq!(r.dtype, DType::Q8_0);
            for gbps in [r.cpu_alone_gbps, r.cpu_gbps, r.h2d_alone_gbps, r.h2d_gbps] {
                assert!(gbps.is_finite() && gbps > 0.0, "{r:?}");
            }
            // One figure of the copies alone serves every row count.
            assert_eq!(r.h2d_alone_gbps, rates[0].h2d_alone_gbps);
        }
        // Copies that fail are an error, not a figure.
        let mut failing = |_: &mut dyn FnMut()| -> Result<f64, LlamaError> {
            Err(LlamaError::Config {
                setting: "test",
                message: "no copies".into(),
            })
        };
        assert!(concurrent_rates(DType::Q8_0, 1 << 20, &mut failing).is_err());
    }

    /// Writes `files` (path, contents) under `root`.
    fn write_tree(root: &std::path::Path, files: &[(String, String)]) {
        for (path, text) in files {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
    }

    /// One cache of a CPU in a fake sysfs tree.
    fn cache(
        cpu: u32,
        index: u32,
        level: u32,
        kind: &str,
        size: &str,
        shared: &str,
    ) -> Vec<(String, String)> {
        let dir = format!("cpu{cpu}/cache/index{index}");
        [
            ("level", level.to_string()),
            ("type", kind.to_string()),
            ("size", format!("{size}\n")),
            ("shared_cpu_list", format!("{shared}\n")),
        ]
        .into_iter()
        .map(|(f, t)| (format!("{dir}/{f}"), t))
        .collect()
    }

    #[test]
    fn the_last_level_caches_are_summed_over_their_distinct_instances() {
        let tmp = tempfile::tempdir().unwrap();
        // Four CPUs, two L3 instances of 32 MiB (CPUs 0-1 and 2-3), a private L2 and L1 each,
        // and files that are not CPUs.
        let mut files: Vec<(String, String)> = Vec::new();
        for cpu in 0..4 {
            let l3_shared = if cpu < 2 { "0-1" } else { "2-3" };
            files.extend(cache(cpu, 0, 1, "Data", "48K", &cpu.to_string()));
            files.extend(cache(cpu, 1, 1, "Instruction", "64K", &cpu.to_string()));
            files.extend(cache(cpu, 2, 2, "Unified", "2048K", &cpu.to_string()));
            files.extend(cache(cpu, 3, 3, "Unified", "32768K", l3_shared));
        }
        files.push(("cpufreq/policy0/scaling_driver".into(), "x".into()));
        files.push(("online".into(), "0-3\n".into()));
        write_tree(tmp.path(), &files);
        assert_eq!(last_level_cache_bytes(tmp.path()), Some(64 << 20));

        // Without an L3, the L2s: one instance per CPU here.
        let tmp2 = tempfile::tempdir().unwrap();
        let mut files: Vec<(String, String)> = Vec::new();
        for cpu in 0..2 {
            files.extend(cache(cpu, 0, 1, "Data", "32K", &cpu.to_string()));
            files.extend(cache(cpu, 1, 2, "Unified", "1M", &cpu.to_string()));
        }
        write_tree(tmp2.path(), &files);
        assert_eq!(last_level_cache_bytes(tmp2.path()), Some(2 << 20));

        // Nothing readable: no figure.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(last_level_cache_bytes(empty.path()), None);
        assert_eq!(last_level_cache_bytes(&empty.path().join("absent")), None);
        // This machine's, whatever it has (printed for the record).
        println!("this machine: {:?}", cpu_probe_bytes(256 << 20));
    }

    #[test]
    fn cache_sizes_parse_with_their_units() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size("12X"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn the_probe_is_four_times_the_caches_within_memory_and_the_cap() {
        let mib = |m: usize| m << 20;
        // Small caches: the floor.
        assert_eq!(probe_size(mib(256), Some(32 << 20), usize::MAX), mib(256));
        assert_eq!(probe_size(mib(256), None, usize::MAX), mib(256));
        // Large ones (a server's, or a VM reporting its host's): four times them.
        assert_eq!(probe_size(mib(256), Some(192 << 20), usize::MAX), mib(768));
        // Within the cap and a quarter of the available memory.
        assert_eq!(
            probe_size(mib(256), Some(4 << 30), usize::MAX),
            MAX_CPU_PROBE
        );
        assert_eq!(probe_size(mib(256), Some(192 << 20), mib(500)), mib(500));
    }
}
