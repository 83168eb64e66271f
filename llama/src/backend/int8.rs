//! Integer dot products of q4_0, q4_1 and q8_0 weight rows with activations quantized to 8 bits
//! per 32 values (llama.cpp's q8_0, [`QuantizedActs`]), as ggml-cpu's `ggml_vec_dot_q4_1_q8_1`
//! and friends do: the default CPU kernels for the rows of a matmul that are dotted straight
//! from the blocks (decoding and small batches, see `kernels::matmul_rows`).
//!
//! Per 32-value block the weights' levels (4-bit unsigned, or q8_0's signed bytes with the
//! sign moved onto the activations) times the activations' `q` are summed as integers in one
//! register — `maddubs` + `madd` on AVX2, one `vpdpbusd` with AVX-VNNI or AVX512-VNNI (picked at
//! run time) — and one FMA scales the eight i32 lanes by `d_weight · d_activation`. q4_1's min
//! and q4_0's −8 multiply the block's `d·Σq`, precomputed with the activations.
//!
//! What it costs: the result is the exact dot product of the stored weights with `x̂`, the
//! activations rounded to 8 bits (`|x − x̂| ≤ max|x| / 254` over each 32 values), so it differs
//! from the f32-activation kernels (the "exact" mode, `CpuBackend::exact`) by at most
//! `Σ_blocks max|x_b| / 254 · Σ|w_b|` (plus f32 rounding); the tests here check that bound
//! against an f64 reference. In exchange a block is ~6 instructions instead of ~20 float ones,
//! so decoding runs at the speed RAM delivers the weights rather than at the speed the cores
//! widen them.

use multiversion::multiversion;
use multiversion::target::match_target;
use weights_format::DType;

use super::kquants::ActRow;

/// Whether [`dot_rows`] handles `dtype`.
pub(crate) fn handles(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
}

/// `out[i · stride] = row_i · x̂` for each weight row `row_i` of `w` (`row_bytes` each, whole
/// blocks of `dtype`, one of [`handles`]), `x` being one activation row quantized per 32
/// values. One run-time dispatch per call, so callers hand over many rows at once.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c+avxvnni",
    "x86_64+avx2+fma+f16c"
))]
pub(crate) fn dot_rows(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    x: ActRow<'_>,
    out: &mut [f32],
    stride: usize,
) {
    match_target! {
        "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c" =>
            avx512vnni::dot_rows(dtype, w, row_bytes, x, out, stride),
        "x86_64+avx2+fma+f16c+avxvnni" => avxvnni::dot_rows(dtype, w, row_bytes, x, out, stride),
        "x86_64+avx2+fma+f16c" => avx2::dot_rows(dtype, w, row_bytes, x, out, stride),
        _ => portable::dot_rows(dtype, w, row_bytes, x, out, stride),
    }
}

/// Plain Rust, integer sums per block (for CPUs without AVX2, and the tests' second opinion).
pub(crate) mod portable {
    use super::super::kquants::f16_at;
    use super::*;

    #[inline(always)]
    fn isum32(lv: &[i8; 32], q: &[i8]) -> i32 {
        let q: &[i8; 32] = q.try_into().unwrap();
        let mut s = 0i32;
        for j in 0..32 {
            s += lv[j] as i32 * q[j] as i32;
        }
        s
    }

    /// One weight row: per block the integer sum, scaled, plus q4_1's `m·d·Σq` or q4_0's
    /// `−8·d_w·d·Σq` (the levels are kept unsigned, as in the SIMD kernels).
    #[inline(always)]
    pub(crate) fn dot(dtype: DType, row: &[u8], x: ActRow<'_>) -> f32 {
        let block_bytes = dtype.block_bytes();
        let mut sum = 0f32;
        let blocks = row.chunks_exact(block_bytes).zip(x.q.chunks_exact(32));
        for (b, (blk, q)) in blocks.enumerate() {
            let d = f16_at(blk, 0);
            let dq = x.s16[2 * b] + x.s16[2 * b + 1];
            let mut lv = [0i8; 32];
            let offset = match dtype {
                DType::Q8_0 => {
                    for (l, v) in lv.iter_mut().zip(&blk[2..34]) {
                        *l = *v as i8;
                    }
                    0.0
                }
                _ => {
                    let qs = if dtype == DType::Q4_1 {
                        &blk[4..20]
                    } else {
                        &blk[2..18]
                    };
                    for j in 0..16 {
                        lv[j] = (qs[j] & 0xF) as i8;
                        lv[j + 16] = (qs[j] >> 4) as i8;
                    }
                    if dtype == DType::Q4_1 {
                        f16_at(blk, 2) * dq
                    } else {
                        -8.0 * d * dq
                    }
                }
            };
            sum += d * x.d[b] * isum32(&lv, q) as f32 + offset;
        }
        sum
    }

    pub(crate) fn dot_rows(
        dtype: DType,
        w: &[u8],
        row_bytes: usize,
        x: ActRow<'_>,
        out: &mut [f32],
        stride: usize,
    ) {
        for (row, o) in w
            .chunks_exact(row_bytes)
            .zip(out.iter_mut().step_by(stride))
        {
            *o = dot(dtype, row, x);
        }
    }
}

/// The x86 kernels for one instruction set, `mul_sum(u, s)` being the eight i32 sums of four
/// products `u8 · i8` each.
macro_rules! x86_kernels {
    ($module:ident, $features:literal, |$u:ident, $s:ident| $mul_sum:expr) => {
        #[cfg(target_arch = "x86_64")]
        mod $module {
            use std::arch::x86_64::*;

            use super::super::kquants::avx2::{
                hsum, load256, load256_i8, nibbles_split, prefetch_ahead, scale_add,
            };
            use super::super::kquants::f16_at;
            use super::*;

            #[target_feature(enable = $features)]
            #[inline]
            fn mul_sum($u: __m256i, $s: __m256i) -> __m256i {
                $mul_sum
            }

            /// q4_1 (`MIN`) or q4_0: two accumulators (even and odd blocks) so that the FMAs
            /// of consecutive blocks do not wait on each other.
            #[target_feature(enable = $features)]
            #[inline]
            fn q4<const MIN: bool>(row: &[u8], x: ActRow<'_>) -> f32 {
                let (bb, qs) = if MIN { (20, 4) } else { (18, 2) };
                let mut acc = [_mm256_setzero_ps(); 2];
                let mut offsets = [0f32; 2];
                let blocks = row
                    .chunks_exact(bb)
                    .zip(x.q.chunks_exact(32))
                    .zip(x.d.iter().zip(x.s16.chunks_exact(2)));
                for (b, ((blk, q), (dx, s16))) in blocks.enumerate() {
                    if b % 2 == 0 {
                        prefetch_ahead(&blk[..1]);
                    }
                    let d = f16_at(blk, 0);
                    let p = mul_sum(nibbles_split(&blk[qs..qs + 16]), load256_i8(q));
                    acc[b % 2] = scale_add(acc[b % 2], p, d * dx);
                    let dq = s16[0] + s16[1];
                    offsets[b % 2] += if MIN {
                        f16_at(blk, 2) * dq
                    } else {
                        -8.0 * d * dq
                    };
                }
                hsum(_mm256_add_ps(acc[0], acc[1])) + (offsets[0] + offsets[1])
            }

            /// q8_0: the weights' signs move onto the activations (`|w| · sign(q, w)`).
            #[target_feature(enable = $features)]
            #[inline]
            fn q8(row: &[u8], x: ActRow<'_>) -> f32 {
                let mut acc = [_mm256_setzero_ps(); 2];
                let blocks = row.chunks_exact(34).zip(x.q.chunks_exact(32)).zip(x.d);
                for (b, ((blk, q), dx)) in blocks.enumerate() {
                    if b % 2 == 0 {
                        prefetch_ahead(&blk[..1]);
                    }
                    let w = load256(&blk[2..34]);
                    let p = mul_sum(_mm256_sign_epi8(w, w), _mm256_sign_epi8(load256_i8(q), w));
                    acc[b % 2] = scale_add(acc[b % 2], p, f16_at(blk, 0) * dx);
                }
                hsum(_mm256_add_ps(acc[0], acc[1]))
            }

            #[target_feature(enable = $features)]
            pub(super) fn dot_rows(
                dtype: DType,
                w: &[u8],
                row_bytes: usize,
                x: ActRow<'_>,
                out: &mut [f32],
                stride: usize,
            ) {
                let rows = w
                    .chunks_exact(row_bytes)
                    .zip(out.iter_mut().step_by(stride));
                match dtype {
                    DType::Q4_0 => rows.for_each(|(row, o)| *o = q4::<false>(row, x)),
                    DType::Q4_1 => rows.for_each(|(row, o)| *o = q4::<true>(row, x)),
                    DType::Q8_0 => rows.for_each(|(row, o)| *o = q8(row, x)),
                    other => unreachable!("{other} is not a dtype of the int8 kernels"),
                }
            }
        }
    };
}

x86_kernels!(avx2, "avx2,fma", |u, s| _mm256_madd_epi16(
    _mm256_maddubs_epi16(u, s),
    _mm256_set1_epi16(1)
));
x86_kernels!(avxvnni, "avx2,fma,avxvnni", |u, s| _mm256_dpbusd_avx_epi32(
    _mm256_setzero_si256(),
    u,
    s
));
x86_kernels!(
    avx512vnni,
    "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni",
    |u, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
);

#[cfg(test)]
mod tests {
    use super::super::kquants::tests::Rng;
    use super::super::kquants::{QuantizedActs, reference_dot};
    use super::*;

    /// Every variant this CPU can run, by name, each computing `dot_rows` over `w`.
    #[allow(clippy::type_complexity)]
    fn variants() -> Vec<(
        &'static str,
        fn(DType, &[u8], usize, ActRow<'_>, &mut [f32], usize),
    )> {
        let mut v: Vec<(
            &'static str,
            fn(DType, &[u8], usize, ActRow<'_>, &mut [f32], usize),
        )> = vec![("portable", portable::dot_rows), ("dispatched", dot_rows)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                v.push(("avx2", x86_avx2));
            }
            if std::arch::is_x86_feature_detected!("avxvnni") {
                v.push(("avxvnni", x86_avxvnni));
            }
        }
        v
    }

    // Each variant behind its own multiversioned entry point (the dispatch checks the CPU).
    #[cfg(target_arch = "x86_64")]
    #[multiversion(targets("x86_64+avx2+fma+f16c"))]
    fn x86_avx2(dtype: DType, w: &[u8], rb: usize, x: ActRow<'_>, out: &mut [f32], st: usize) {
        match_target! {
            "x86_64+avx2+fma+f16c" => avx2::dot_rows(dtype, w, rb, x, out, st),
            _ => {
                let _ = (dtype, w, rb, x, out, st);
                unreachable!("registered only where the CPU has AVX2")
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[multiversion(targets("x86_64+avx2+fma+f16c+avxvnni"))]
    fn x86_avxvnni(dtype: DType, w: &[u8], rb: usize, x: ActRow<'_>, out: &mut [f32], st: usize) {
        match_target! {
            "x86_64+avx2+fma+f16c+avxvnni" => avxvnni::dot_rows(dtype, w, rb, x, out, st),
            _ => {
                let _ = (dtype, w, rb, x, out, st);
                unreachable!("registered only where the CPU has AVX-VNNI")
            }
        }
    }

    #[test]
    fn dot_products_are_within_the_8_bit_activation_bound_of_the_f32_reference() {
        // As ggml's test-quantize-fns: the dot product of the stored weights with activations
        // rounded to 8 bits per 32 values (|x − x̂| ≤ max|x|/254) is at most
        // Σ_blocks max|x_b|/254 · Σ|w_b| from the f64 reference (plus f32 rounding, 1e-5 of
        // Σ|w·x|); the variants differ from each other only in the order of their f32 sums.
        let (rows, cols) = (40, 1024);
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        let variants = variants();
        println!(
            "variants: {:?}",
            variants.iter().map(|v| v.0).collect::<Vec<_>>()
        );
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let w = gdsllm_convert::testing::random_blocks(
                dtype,
                rows * cols / dtype.block_len(),
                rng.next(),
            );
            let x: Vec<f32> = (0..cols)
                .map(|i| rng.uniform() * if i % 96 < 32 { 4.0 } else { 0.25 })
                .collect();
            let mut xq = QuantizedActs::default();
            xq.prepare(&x, cols, dtype);
            let row_bytes = w.len() / rows;
            let results: Vec<Vec<f32>> = variants
                .iter()
                .map(|(_, f)| {
                    // Every other output slot, to check the stride.
                    let mut out = vec![f32::NAN; 2 * rows];
                    f(dtype, &w, row_bytes, xq.row(dtype, 0), &mut out, 2);
                    assert!(out.iter().skip(1).step_by(2).all(|v| v.is_nan()));
                    out.into_iter().step_by(2).collect()
                })
                .collect();
            let mut worst = vec![0f64; variants.len()];
            for (i, wr) in w.chunks_exact(row_bytes).enumerate() {
                let mut dense = vec![0f32; cols];
                weights_format::quant::dequantize(dtype, wr, &mut dense).unwrap();
                let reference = reference_dot(dtype, wr, &x);
                let magnitude: f64 = dense
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (a * b).abs() as f64)
                    .sum();
                let rounding: f64 = dense
                    .chunks_exact(32)
                    .zip(x.chunks_exact(32))
                    .map(|(wb, xb)| {
                        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                        amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
                    })
                    .sum();
                let bound = rounding * 1.001 + 1e-5 * magnitude;
                let portable = results[0][i] as f64;
                for (v, (name, _)) in variants.iter().enumerate() {
                    let got = results[v][i] as f64;
                    assert!(
                        (got - reference).abs() <= bound,
                        "{dtype} {name} row {i}: {got} reference {reference} bound {bound}"
                    );
                    assert!(
                        (got - portable).abs() <= 1e-5 * magnitude,
                        "{dtype} {name} row {i}: {got} portable {portable}"
                    );
                    worst[v] = worst[v].max((got - reference).abs() / bound);
                }
            }
            for (v, (name, _)) in variants.iter().enumerate() {
                println!(
                    "{dtype} {name}: worst |dot − reference| is {:.0} % of the 8-bit bound",
                    worst[v] * 100.0
                );
            }
        }
    }
}
