//! Kernel timings of issue 23 on the GPU, old path against new in one process: the matmuls of
//! one 7B-shaped layer (Q/K/V, O with the residual add, gate/up, down) for 1 to 64 rows per dtype
//! (the eight-row kernel against the tensor-core kernels; for q4_k/q5_k/q6_k the block kernels
//! against the `superblock` ones), prompt attention (tiled f32 kernel against flash attention),
//! and a batch's attention steps (per sequence against one launch).
//! Each figure is the best of a few timed runs of several calls, beside the bandwidth or
//! arithmetic it achieves and the device-to-device copy rate measured in the same process.
//!
//! `cargo run --release -p llama --features cuda --example cuda_kernels [-- --quick]`; prints a
//! table (results on stdout).

use std::time::Instant;

use llama::backend::cuda::{CudaBuf, CudaKvBuf, CudaPaths, DeviceWeights};
use llama::backend::{AttentionParams, AttentionSeq, AttentionShape, KvStoreSeq, RowGroup};
use llama::{Backend, CudaBackend, WeightSource, WeightView, rope_inv_freq};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use weights_format::DType;

type Error = Box<dyn std::error::Error>;

fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Seconds per call of `f` (which queues work): the best of 3 runs of `n` calls, each run
/// ended by reading one value back (which waits for the stream).
fn time(be: &CudaBackend, sync: &CudaBuf, n: usize, mut f: impl FnMut()) -> f64 {
    let mut one = [0f32];
    f();
    be.read(sync, &mut one).expect("read");
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        be.read(sync, &mut one).expect("read");
        best = best.min(t.elapsed().as_secs_f64() / n as f64);
    }
    best
}

/// One layer's weights of a 7B-shaped model in `dtype`, on `be`'s device.
struct Layer {
    blobs: DeviceWeights,
    dtype: DType,
    bytes: usize,
}

const DIM: usize = 4096;
const FFN: usize = 11008;
/// (rows, cols) of Q, K, V, O, gate, up, down.
const SHAPES: [(usize, usize); 7] = [
    (DIM, DIM),
    (DIM, DIM),
    (DIM, DIM),
    (DIM, DIM),
    (FFN, DIM),
    (FFN, DIM),
    (DIM, FFN),
];

impl Layer {
    /// The same random layer on two backends (quantized once: the weights are most of this
    /// program's host time).
    fn pair(
        bes: [&CudaBackend; 2],
        rng: &mut StdRng,
        dtype: DType,
    ) -> Result<(Layer, Layer), Error> {
        let mut blobs = Vec::new();
        for (m, k) in SHAPES {
            let mut b = Vec::new();
            weights_format::quant::quantize(dtype, &random(rng, m * k), &mut b)?;
            blobs.push(b);
        }
        let bytes = blobs.iter().map(Vec::len).sum();
        let on = |be: &CudaBackend, blobs| -> Result<Layer, Error> {
            Ok(Layer {
                blobs: be.upload_weights(blobs)?,
                dtype,
                bytes,
            })
        };
        Ok((on(bes[0], blobs.clone())?, on(bes[1], blobs)?))
    }

    fn w(&self, i: usize) -> WeightView<'_> {
        let (m, k) = SHAPES[i];
        WeightView::device(self.dtype, m, k, self.blobs.acquire(i).unwrap().ptr())
    }
}

/// Activations of one layer's matmuls for `rows` rows.
struct Acts {
    x: CudaBuf,
    h: CudaBuf,
    q: CudaBuf,
    k: CudaBuf,
    v: CudaBuf,
    gate: CudaBuf,
    up: CudaBuf,
    res: CudaBuf,
    scratch: CudaBuf,
}

impl Acts {
    fn new(be: &CudaBackend, rng: &mut StdRng, rows: usize) -> Result<Acts, Error> {
        Ok(Acts {
            x: be.upload(&random(rng, rows * DIM))?,
            h: be.upload(&random(rng, rows * FFN))?,
            q: be.alloc(rows * DIM)?,
            k: be.alloc(rows * DIM)?,
            v: be.alloc(rows * DIM)?,
            gate: be.alloc(rows * FFN)?,
            up: be.alloc(rows * FFN)?,
            res: be.alloc(rows * DIM)?,
            scratch: be.alloc(rows * DIM)?,
        })
    }
}

/// The layer's four matmul launches for `rows` decode rows (one row per sequence).
fn layer_matmuls(be: &CudaBackend, l: &Layer, a: &mut Acts, rows: usize) {
    let groups = vec![RowGroup::solo(1); rows];
    let Acts {
        x,
        h,
        q,
        k,
        v,
        gate,
        up,
        res,
        scratch,
    } = a;
    be.matmul_batch(x, &groups, &[l.w(0), l.w(1), l.w(2)], &mut [q, k, v])
        .unwrap();
    be.matmul_add_batch(x, &groups, l.w(3), scratch, res)
        .unwrap();
    be.matmul_batch(x, &groups, &[l.w(4), l.w(5)], &mut [gate, up])
        .unwrap();
    be.matmul_add_batch(h, &groups, l.w(6), scratch, res)
        .unwrap();
}

fn main() -> Result<(), Error> {
    let quick = std::env::args().any(|a| a == "--quick");
    let old = CudaBackend::with_paths(0, CudaPaths::none())?;
    let new = CudaBackend::with_paths(0, CudaPaths::all())?;
    let (copy_read, _) = old.measure_copy_gbps(1 << 30)?;
    println!(
        "# {} — device-to-device copy {copy_read:.0} GB/s (bytes copied per second: the read roofline of this run)",
        old.device_name()
    );
    let mut rng = StdRng::seed_from_u64(1);
    let mut rows_list = vec![1, 2, 8, 16, 32, 64];
    let dtypes: &[DType] = if quick {
        rows_list = vec![1, 8, 32];
        &[DType::Q4_1, DType::F16]
    } else {
        &[
            DType::F16,
            DType::Bf16,
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            // New: the `superblock` kernels below 16 rows (no tensor-core kernels for these).
            DType::Q4K,
            DType::Q5K,
            DType::Q6K,
        ]
    };

    println!("\n## One 7B layer's matmuls (Q/K/V, O + residual, gate/up, down), per call");
    println!(
        "| dtype | rows | old µs | old GB/s | new µs | new GB/s | new/old speed | new % of copy rate | new TFLOP/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &dtype in dtypes {
        let (l_old, l_new) = Layer::pair([&old, &new], &mut rng, dtype)?;
        for &rows in &rows_list {
            let mut a_old = Acts::new(&old, &mut rng, rows)?;
            let mut a_new = Acts::new(&new, &mut rng, rows)?;
            let sync_old = old.alloc(1)?;
            let sync_new = new.alloc(1)?;
            let n = if quick { 5 } else { 10 };
            let t_old = time(&old, &sync_old, n, || {
                layer_matmuls(&old, &l_old, &mut a_old, rows)
            });
            let t_new = time(&new, &sync_new, n, || {
                layer_matmuls(&new, &l_new, &mut a_new, rows)
            });
            let gbps = |t: f64| l_new.bytes as f64 / t / 1e9;
            let flops: f64 = SHAPES
                .iter()
                .map(|(m, k)| 2.0 * (m * k * rows) as f64)
                .sum();
            println!(
                "| {dtype:?} | {rows} | {:.1} | {:.0} | {:.1} | {:.0} | {:.2}x | {:.0}% | {:.1} |",
                t_old * 1e6,
                gbps(t_old),
                t_new * 1e6,
                gbps(t_new),
                t_old / t_new,
                100.0 * gbps(t_new) / copy_read,
                flops / t_new / 1e12
            );
        }
    }

    println!("\n## Prompt attention (causal, f16 KV cache), per call");
    println!("| heads/kv | head_dim | rows | old µs | new µs | new/old speed | new TFLOP/s |");
    println!("|---|---|---|---|---|---|---|");
    let cases: &[(usize, usize, usize, usize)] = if quick {
        &[(32, 32, 128, 512)]
    } else {
        &[(32, 32, 128, 512), (32, 8, 128, 2048), (9, 3, 64, 128)]
    };
    for &(n_heads, n_kv_heads, head_dim, rows) in cases {
        let shape = AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        let kv = random(&mut rng, rows * n_kv_heads * head_dim);
        let q = random(&mut rng, rows * n_heads * head_dim);
        let mut times = Vec::new();
        for be in [&old, &new] {
            let (kc, vc) = (be.upload_kv(&kv)?, be.upload_kv(&kv)?);
            let qd = be.upload(&q)?;
            let mut out = be.alloc(rows * n_heads * head_dim)?;
            let seq = [AttentionSeq {
                row0: 0,
                rows,
                pos0: 0,
                k_cache: &kc,
                v_cache: &vc,
            }];
            times.push(time(be, &out_sync(be)?, 5, || {
                be.attention_batch(&qd, &seq, shape, AttentionParams::causal(shape), &mut out)
                    .unwrap()
            }));
        }
        // QKᵀ and PV over the causal half.
        let flops = 2.0 * 2.0 * (rows * rows / 2 * head_dim * n_heads) as f64;
        println!(
            "| {n_heads}/{n_kv_heads} | {head_dim} | {rows} | {:.1} | {:.1} | {:.2}x | {:.1} |",
            times[0] * 1e6,
            times[1] * 1e6,
            times[0] / times[1],
            flops / times[1] / 1e12
        );
    }

    println!("\n## A decode batch's RoPE + KV stores + attention (7B heads), per call");
    println!("| sequences | context | old µs | new µs | new/old speed |");
    println!("|---|---|---|---|---|");
    let shape = AttentionShape {
        n_heads: 32,
        n_kv_heads: 32,
        head_dim: 128,
    };
    let inv = rope_inv_freq(128, 10000.0, None, 0);
    for &(n_seqs, ctx) in &[(8usize, 512usize), (32, 512), (64, 256)] {
        let mut times = Vec::new();
        for be in [&old, &new] {
            let w = shape.n_heads * shape.head_dim;
            let (mut q, mut k) = (
                be.upload(&random(&mut rng, n_seqs * w))?,
                be.upload(&random(&mut rng, n_seqs * w))?,
            );
            let v = be.upload(&random(&mut rng, n_seqs * w))?;
            let invd = be.upload(&inv)?;
            let mut caches: Vec<(CudaKvBuf, CudaKvBuf)> = (0..n_seqs)
                .map(|_| {
                    let c = random(&mut rng, (ctx + 1) * w);
                    (be.upload_kv(&c).unwrap(), be.upload_kv(&c).unwrap())
                })
                .collect();
            let mut out = be.alloc(n_seqs * w)?;
            times.push(time(be, &out_sync(be)?, 10, || {
                let mut stores: Vec<KvStoreSeq<'_, CudaKvBuf>> = caches
                    .iter_mut()
                    .enumerate()
                    .map(|(i, (kc, vc))| KvStoreSeq {
                        row0: i,
                        rows: 1,
                        pos0: ctx,
                        k_cache: kc,
                        v_cache: vc,
                    })
                    .collect();
                be.rope_store_kv_batch(&mut q, &mut k, &v, &mut stores, shape, &invd)
                    .unwrap();
                let seqs: Vec<AttentionSeq<'_, CudaKvBuf>> =
                    stores.iter().map(KvStoreSeq::attention).collect();
                be.attention_batch(&q, &seqs, shape, AttentionParams::causal(shape), &mut out)
                    .unwrap();
            }));
        }
        println!(
            "| {n_seqs} | {ctx} | {:.1} | {:.1} | {:.2}x |",
            times[0] * 1e6,
            times[1] * 1e6,
            times[0] / times[1]
        );
    }
    Ok(())
}

/// A one-value buffer to read back (the end of a timed run).
fn out_sync(be: &CudaBackend) -> Result<CudaBuf, Error> {
    Ok(be.alloc(1)?)
}
