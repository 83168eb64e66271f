//! Slow, obviously correct versions of every [`Backend`] op: whole tensors dequantized with
//! `weights_format::quant::dequantize` (the definition of the layouts), single-threaded loops
//! that follow the formulas, f64 accumulation. The CPU backend is tested against these.

use weights_format::quant::dequantize;

use super::{AttentionShape, Backend, WeightView};

/// Single-threaded reference backend.
#[derive(Debug, Clone, Default)]
pub struct ReferenceBackend;

/// The whole weight as f32.
pub fn dequantize_all(w: WeightView<'_>) -> Vec<f32> {
    let mut out = vec![0f32; w.rows * w.cols];
    dequantize(w.dtype, w.bytes, &mut out).expect("weight view whose shape matches its bytes");
    out
}

impl Backend for ReferenceBackend {
    type Buf = Vec<f32>;

    fn name(&self) -> &'static str {
        "reference"
    }

    fn alloc(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn read(&self, buf: &Vec<f32>, out: &mut [f32]) {
        out.copy_from_slice(&buf[..out.len()]);
    }

    fn embed_rows(&self, table: WeightView<'_>, ids: &[u32], out: &mut Vec<f32>) {
        let t = dequantize_all(table);
        let dim = table.cols;
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            out[r * dim..(r + 1) * dim].copy_from_slice(&t[id * dim..(id + 1) * dim]);
        }
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &mut Vec<f32>,
    ) {
        let w = dequantize_all(weight);
        let dim = weight.cols;
        for r in 0..rows {
            let xr = &x[r * dim..(r + 1) * dim];
            let mean_sq = xr.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / dim as f64;
            let scale = 1.0 / (mean_sq + eps as f64).sqrt();
            for i in 0..dim {
                out[r * dim + i] = (xr[i] as f64 * scale * w[i] as f64) as f32;
            }
        }
    }

    fn matmul(&self, x: &Vec<f32>, rows: usize, w: WeightView<'_>, out: &mut Vec<f32>) {
        let wf = dequantize_all(w);
        let (m, k) = (w.rows, w.cols);
        for r in 0..rows {
            for i in 0..m {
                let mut acc = 0f64;
                for c in 0..k {
                    acc += x[r * k + c] as f64 * wf[i * k + c] as f64;
                }
                out[r * m + i] = acc as f32;
            }
        }
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        inv_freq: &[f32],
    ) {
        let half = head_dim / 2;
        for r in 0..rows {
            for h in 0..n_heads {
                let base = (r * n_heads + h) * head_dim;
                for i in 0..half {
                    let angle = (pos0 + r) as f64 * inv_freq[i] as f64;
                    let (x1, x2) = (x[base + i] as f64, x[base + half + i] as f64);
                    x[base + i] = (x1 * angle.cos() - x2 * angle.sin()) as f32;
                    x[base + half + i] = (x2 * angle.cos() + x1 * angle.sin()) as f32;
                }
            }
        }
    }

    fn copy_rows(
        &self,
        src: &Vec<f32>,
        src_row: usize,
        dst: &mut Vec<f32>,
        dst_row: usize,
        rows: usize,
        row_len: usize,
    ) {
        for i in 0..rows * row_len {
            dst[dst_row * row_len + i] = src[src_row * row_len + i];
        }
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        rows: usize,
        k_cache: &Vec<f32>,
        v_cache: &Vec<f32>,
        pos0: usize,
        shape: AttentionShape,
        out: &mut Vec<f32>,
    ) {
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        let kv_width = n_kv_heads * head_dim;
        for r in 0..rows {
            for h in 0..n_heads {
                let kvh = h / (n_heads / n_kv_heads);
                let qh = &q[(r * n_heads + h) * head_dim..][..head_dim];
                let len = pos0 + r + 1;
                let scores: Vec<f64> = (0..len)
                    .map(|t| {
                        let k = &k_cache[t * kv_width + kvh * head_dim..][..head_dim];
                        qh.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (head_dim as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = exps.iter().sum();
                for d in 0..head_dim {
                    let mut acc = 0f64;
                    for (t, e) in exps.iter().enumerate() {
                        acc += e / sum * v_cache[t * kv_width + kvh * head_dim + d] as f64;
                    }
                    out[(r * n_heads + h) * head_dim + d] = acc as f32;
                }
            }
        }
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize) {
        for i in 0..len {
            let g = gate[i] as f64;
            gate[i] = (g / (1.0 + (-g).exp()) * up[i] as f64) as f32;
        }
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) {
        for i in 0..len {
            x[i] += y[i];
        }
    }
}
