//! Shared by the op tests (`ops.rs`, `cuda_ops.rs`): random inputs and weights, the error
//! measure, and the single-sequence forms of the batched ops (what a plain `matmul`, `rope` or
//! `attention` of one sequence computes), written with the ops the backends have.
#![allow(dead_code)]

pub mod families;

use llama::WeightView;
use llama::backend::{AttentionParams, AttentionSeq, AttentionShape, Backend, RowGroup};
use rand::RngExt;
use rand::rngs::StdRng;
use weights_format::DType;
use weights_format::quant::quantize;

#[cfg(feature = "cuda")]
pub mod cuda;

/// The dtypes of format version 1, the first six of `DType::ALL` (which lists them in the order
/// of their introduction): those of the CUDA kernel files before `kquants.cu`;
/// `cuda_kquants.rs` and the CPU kernel tests of `backend/kquants.rs` cover the others.
pub const ALL: [DType; 6] = *DType::ALL
    .first_chunk()
    .expect("format version 1 has 6 dtypes");

pub fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Random weights stored as `dtype` (for quantized types: random blocks, built by the
/// reference quantizer so every layout detail is that of `weights_format::quant`).
pub fn weights(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let mut bytes = Vec::new();
    quantize(dtype, &random(rng, rows * cols), &mut bytes).unwrap();
    bytes
}

/// Max |a-b| relative to the largest |b| (so the tolerance reads as a fraction of the scale).
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

/// `out = x · wᵀ` for `rows` rows computed as one sequence.
pub fn matmul<B: Backend>(be: &B, x: &B::Buf, rows: usize, w: WeightView<'_>, out: &mut B::Buf) {
    be.matmul_batch(x, &[RowGroup::solo(rows)], &[w], &mut [out])
        .unwrap();
}

/// Causal attention (scores scaled by `1/√head_dim`, no window) of one sequence's `rows` query
/// rows (from row 0) at positions `pos0 ..`.
#[allow(clippy::too_many_arguments)]
pub fn attention<B: Backend>(
    be: &B,
    q: &B::Buf,
    rows: usize,
    k_cache: &B::KvBuf,
    v_cache: &B::KvBuf,
    pos0: usize,
    shape: AttentionShape,
    out: &mut B::Buf,
) {
    attention_with(
        be,
        q,
        rows,
        (k_cache, v_cache),
        pos0,
        shape,
        AttentionParams::causal(shape),
        out,
    );
}

/// [`attention`] with the scale and window of `params`.
#[allow(clippy::too_many_arguments)]
pub fn attention_with<B: Backend>(
    be: &B,
    q: &B::Buf,
    rows: usize,
    (k_cache, v_cache): (&B::KvBuf, &B::KvBuf),
    pos0: usize,
    shape: AttentionShape,
    params: AttentionParams,
    out: &mut B::Buf,
) {
    let seq = AttentionSeq {
        row0: 0,
        rows,
        pos0,
        k_cache,
        v_cache,
    };
    be.attention_batch(q, &[seq], shape, params, out).unwrap();
}
