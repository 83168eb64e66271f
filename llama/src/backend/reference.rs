//! Slow, obviously correct versions of every [`Backend`] op: whole tensors dequantized with
//! `weights_format::quant::dequantize` (the definition of the layouts), single-threaded loops
//! that follow the formulas, f64 accumulation, and every sequence of a batch computed on its
//! own. The CPU and CUDA backends are tested against these.

use weights_format::quant::dequantize;

use super::{
    AttentionParams, AttentionSeq, AttentionShape, Backend, BackendError, NormInto, RowGroup,
    WeightView, check_cache_slots, host_bytes, matmul_then_add,
};

/// Single-threaded reference backend (host memory).
#[derive(Debug, Clone, Default)]
pub struct ReferenceBackend;

/// The whole weight as f32.
pub fn dequantize_all(w: WeightView<'_>) -> Result<Vec<f32>, BackendError> {
    let mut out = vec![0f32; w.rows * w.cols];
    dequantize(w.dtype, host_bytes(&w, "reference")?, &mut out).map_err(|e| {
        BackendError::Unsupported {
            op: "dequantize",
            message: e.to_string(),
        }
    })?;
    Ok(out)
}

impl ReferenceBackend {
    /// `out[r, i] = Σ_c x[r, c] · w[i, c]` in f64.
    fn matmul(x: &[f32], rows: usize, w: &[f32], m: usize, k: usize, out: &mut [f32]) {
        for r in 0..rows {
            for i in 0..m {
                let mut acc = 0f64;
                for c in 0..k {
                    acc += x[r * k + c] as f64 * w[i * k + c] as f64;
                }
                out[r * m + i] = acc as f32;
            }
        }
    }

    /// `x[r, :] / sqrt(mean(x[r, :]²) + eps) · w` in f64, for `rows` rows of `w.len()` values.
    /// [`ReferenceBackend::rmsnorm_f64`] with the weight of `weight` (any dtype).
    fn normed(
        x: &[f32],
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
    ) -> Result<Vec<f64>, BackendError> {
        Ok(Self::rmsnorm_f64(x, rows, &dequantize_all(weight)?, eps))
    }

    fn rmsnorm_f64(x: &[f32], rows: usize, w: &[f32], eps: f32) -> Vec<f64> {
        let dim = w.len();
        let mut out = vec![0f64; rows * dim];
        for r in 0..rows {
            let xr = &x[r * dim..(r + 1) * dim];
            let mean_sq = xr.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / dim as f64;
            let scale = 1.0 / (mean_sq + eps as f64).sqrt();
            for i in 0..dim {
                out[r * dim + i] = xr[i] as f64 * scale * w[i] as f64;
            }
        }
        out
    }

    /// Rotary embedding of `rows` rows of `n_heads` heads at positions `pos0 ..`.
    fn rope(x: &mut [f32], rows: usize, n_heads: usize, head_dim: usize, pos0: usize, inv: &[f32]) {
        let half = head_dim / 2;
        for r in 0..rows {
            for h in 0..n_heads {
                let base = (r * n_heads + h) * head_dim;
                for i in 0..half {
                    let angle = (pos0 + r) as f64 * inv[i] as f64;
                    let (x1, x2) = (x[base + i] as f64, x[base + half + i] as f64);
                    x[base + i] = (x1 * angle.cos() - x2 * angle.sin()) as f32;
                    x[base + half + i] = (x2 * angle.cos() + x1 * angle.sin()) as f32;
                }
            }
        }
    }
}

impl Backend for ReferenceBackend {
    type Buf = Vec<f32>;
    type KvBuf = Vec<f32>;

    fn name(&self) -> &'static str {
        "reference"
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; len])
    }

    fn alloc_kv(&self, len: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; len])
    }

    fn kv_value_bytes(&self) -> usize {
        4
    }

    fn copy_kv(
        &self,
        src: &Vec<f32>,
        dst: &mut Vec<f32>,
        values: usize,
    ) -> Result<(), BackendError> {
        dst[..values].copy_from_slice(&src[..values]);
        Ok(())
    }

    fn uniform_rows_from(&self) -> usize {
        1
    }

    fn upload(&self, values: &[f32]) -> Result<Vec<f32>, BackendError> {
        Ok(values.to_vec())
    }

    fn read(&self, buf: &Vec<f32>, out: &mut [f32]) -> Result<(), BackendError> {
        out.copy_from_slice(&buf[..out.len()]);
        Ok(())
    }

    fn embed_rows(
        &self,
        table: WeightView<'_>,
        ids: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let t = dequantize_all(table)?;
        let dim = table.cols;
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            out[r * dim..(r + 1) * dim].copy_from_slice(&t[id * dim..(id + 1) * dim]);
        }
        Ok(())
    }

    fn embed_host_rows(
        &self,
        rows: WeightView<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let t = dequantize_all(rows)?;
        out[..t.len()].copy_from_slice(&t);
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        rows: usize,
        weight: WeightView<'_>,
        eps: f32,
        out: &mut Vec<f32>,
        into: NormInto,
    ) -> Result<(), BackendError> {
        for (o, v) in out
            .iter_mut()
            .zip(ReferenceBackend::normed(x, rows, weight, eps)?)
        {
            *o = match into {
                NormInto::Write => v as f32,
                NormInto::Add => (*o as f64 + v) as f32,
            };
        }
        Ok(())
    }

    /// The f64 result does not depend on how the rows are grouped.
    fn matmul_batch(
        &self,
        x: &Vec<f32>,
        groups: &[RowGroup],
        ws: &[WeightView<'_>],
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), BackendError> {
        let rows = groups.iter().map(|g| g.rows).sum();
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            let wf = dequantize_all(*w)?;
            ReferenceBackend::matmul(x, rows, &wf, w.rows, w.cols, out);
        }
        Ok(())
    }

    fn matmul_add_batch(
        &self,
        x: &Vec<f32>,
        groups: &[RowGroup],
        w: WeightView<'_>,
        scratch: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        matmul_then_add(self, x, groups, w, scratch, out)
    }

    fn rope_store_kv(
        &self,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &Vec<f32>,
        row0: usize,
        rows: usize,
        pos0: usize,
        shape: AttentionShape,
        inv_freq: &Vec<f32>,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let (hd, q_dim, kv_dim) = (
            shape.head_dim,
            shape.n_heads * shape.head_dim,
            shape.n_kv_heads * shape.head_dim,
        );
        let qr = &mut q[row0 * q_dim..(row0 + rows) * q_dim];
        ReferenceBackend::rope(qr, rows, shape.n_heads, hd, pos0, inv_freq);
        let kr = &mut k[row0 * kv_dim..(row0 + rows) * kv_dim];
        ReferenceBackend::rope(kr, rows, shape.n_kv_heads, hd, pos0, inv_freq);
        let slots = k_cache.len() / kv_dim;
        for r in 0..rows {
            let slot = (pos0 + r) % slots;
            for i in 0..kv_dim {
                k_cache[slot * kv_dim + i] = k[(row0 + r) * kv_dim + i];
                v_cache[slot * kv_dim + i] = v[(row0 + r) * kv_dim + i];
            }
        }
        Ok(())
    }

    fn attention_batch(
        &self,
        q: &Vec<f32>,
        seqs: &[AttentionSeq<'_, Vec<f32>>],
        shape: AttentionShape,
        params: AttentionParams,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        let kv_width = n_kv_heads * head_dim;
        for s in seqs {
            let slots = s.k_cache.len() / kv_width;
            check_cache_slots(slots, s.pos0, s.rows, params)?;
            for r in 0..s.rows {
                let row = s.row0 + r;
                let pos = s.pos0 + r;
                let keys: Vec<usize> = (params.first_key(pos)..=pos).collect();
                for h in 0..n_heads {
                    let kvh = h / (n_heads / n_kv_heads);
                    let at = |t: usize| t % slots * kv_width + kvh * head_dim;
                    let qh = &q[(row * n_heads + h) * head_dim..][..head_dim];
                    let scores: Vec<f64> = keys
                        .iter()
                        .map(|&t| {
                            let k = &s.k_cache[at(t)..][..head_dim];
                            qh.iter()
                                .zip(k)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                * params.scale as f64
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = exps.iter().sum();
                    for d in 0..head_dim {
                        let mut acc = 0f64;
                        for (&t, e) in keys.iter().zip(&exps) {
                            acc += e / sum * s.v_cache[at(t) + d] as f64;
                        }
                        out[(row * n_heads + h) * head_dim + d] = acc as f32;
                    }
                }
            }
        }
        Ok(())
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize) -> Result<(), BackendError> {
        for i in 0..len {
            let g = gate[i] as f64;
            gate[i] = (g / (1.0 + (-g).exp()) * up[i] as f64) as f32;
        }
        Ok(())
    }

    fn geglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize) -> Result<(), BackendError> {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        for i in 0..len {
            let g = gate[i] as f64;
            gate[i] =
                (0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * up[i] as f64) as f32;
        }
        Ok(())
    }

    fn add_bias(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        bias: WeightView<'_>,
    ) -> Result<(), BackendError> {
        let b = dequantize_all(bias)?;
        for r in 0..rows {
            for (i, bv) in b.iter().enumerate() {
                x[r * b.len() + i] = (x[r * b.len() + i] as f64 + *bv as f64) as f32;
            }
        }
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, len: usize, factor: f32) -> Result<(), BackendError> {
        for v in &mut x[..len] {
            *v = (*v as f64 * factor as f64) as f32;
        }
        Ok(())
    }

    fn softcap(&self, x: &mut Vec<f32>, len: usize, cap: f32) -> Result<(), BackendError> {
        for v in &mut x[..len] {
            *v = (cap as f64 * (*v as f64 / cap as f64).tanh()) as f32;
        }
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &Vec<f32>,
        src_row: usize,
        dst: &mut Vec<f32>,
        dst_row: usize,
        rows: usize,
        row_len: usize,
    ) -> Result<(), BackendError> {
        for i in 0..rows * row_len {
            dst[dst_row * row_len + i] = src[src_row * row_len + i];
        }
        Ok(())
    }
}
