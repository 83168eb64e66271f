//! Measuring what the placement planner (`residency::placement`) needs to know of this
//! machine's compute: the CPU backend's matmul speed per weight dtype at 1 and 8 rows, and on
//! CUDA the GPU's per dtype at 1, 8, 32 and 512 rows of a layer's matmul calls, its pinned host→device copies and the time of one handoff
//! between the two (what a split matmul adds).
//!
//! Each figure is the best of several passes over a weight far larger than the caches (the
//! planner needs what streaming weights costs, not what a cached one does). The weight's values
//! are a fixed pattern: speed does not depend on them.

use std::time::{Duration, Instant};

use residency::CpuRate;
use weights_format::DType;

use crate::LlamaError;
use crate::backend::{Backend, CpuBackend, RowGroup, WeightView};

/// Columns of the probe weights (a 7B's hidden size, a whole number of every dtype's blocks).
const PROBE_COLS: usize = 4096;

/// How long each figure is measured for (at least 3 passes).
const MEASURE_FOR: Duration = Duration::from_millis(300);

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

/// Weight bytes per second (10^9) of `be`'s matmul of `rows` rows over `w`, whose input
/// `x` and output `out` it allocated; `sync` waits for the queued work.
fn matmul_gbps<B: Backend>(
    be: &B,
    w: WeightView<'_>,
    rows: usize,
    sync: impl Fn(&B, &B::Buf) -> Result<(), LlamaError>,
) -> Result<f64, LlamaError> {
    let x = be.upload(&vec![0.25; rows * w.cols])?;
    let mut out = be.alloc(rows * w.rows)?;
    let bytes = (w.rows * w.row_bytes()) as f64;
    let seconds = best_seconds(|| {
        be.matmul_batch(&x, &[RowGroup::solo(rows)], &[w], &mut [&mut out])?;
        sync(be, &out)
    })?;
    Ok(bytes / seconds / 1e9)
}

/// The CPU backend's matmul speed for `dtype` weights on the current rayon pool, over a probe
/// weight of about `probe_bytes` bytes (pick one well above the last-level cache: 256 MiB).
pub fn measure_cpu(dtype: DType, probe_bytes: usize) -> Result<CpuRate, LlamaError> {
    let (bytes, rows) = probe_weight(dtype, probe_bytes)?;
    let w = WeightView::host(dtype, rows, PROBE_COLS, &bytes);
    let be = CpuBackend::new();
    let sync = |_: &CpuBackend, _: &Vec<f32>| Ok(());
    Ok(CpuRate {
        dtype,
        gbps_1: matmul_gbps(&be, w, 1, sync)?,
        gbps_8: matmul_gbps(&be, w, 8, sync)?,
    })
}

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
        let groups = [RowGroup::solo(rows)];
        let seconds = best_seconds(|| {
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
            let mut one = [0.0];
            be.read(&residual, &mut one)?;
            Ok(())
        })?;
        rates.push(residency::GpuMatmulRate {
            dtype,
            rows,
            gbps: layer_bytes / seconds / 1e9,
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
        for gbps in [rate.gbps_1, rate.gbps_8] {
            assert!(gbps.is_finite() && gbps > 0.0, "{rate:?}");
        }
    }
}
