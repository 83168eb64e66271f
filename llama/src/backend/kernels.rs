//! The inner loops of the CPU backend: dot products of f32 activations with weight rows in each
//! storage type, read straight from the blocks (the dtypes added with the k-quants go to
//! [`kquants`], on 8-bit activations).
//!
//! They are written so that LLVM vectorises them without `unsafe`: fixed-size array
//! accumulators, `chunks_exact` with array conversions (so the inner loops carry no bounds
//! checks), and per-block sums of `x` precomputed once per activation row so that the q4_1 `m`
//! and q4_0 `-8` terms cost one multiply per block. [`matmul_rows`] is compiled several times by
//! `multiversion` (AVX-512, AVX2+FMA, baseline) and the best clone is picked at run time.

use multiversion::multiversion;
use multiversion::target::{match_target, target_cfg_f};
use weights_format::DType;
use weights_format::quant::decode_scalars;

use super::int8;
use super::kquants::{self, QuantizedActs};

/// Values per quantization block (q8_0, q4_0, q4_1).
pub const QK: usize = 32;

/// f16 bits to f32, branch-light so it vectorises. Normal and subnormal halves are exact:
/// shifting the exponent and mantissa into f32 position and multiplying by 2^112 rebiases the
/// exponent (and normalises subnormals); infinities and NaNs are patched afterwards.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp_mant = (h & 0x7fff) as u32;
    let magnitude = f32::from_bits(exp_mant << 13) * f32::from_bits(0x7780_0000);
    let magnitude = if exp_mant >= 0x7c00 {
        f32::from_bits((exp_mant << 13) | 0x7f80_0000)
    } else {
        magnitude
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

#[inline(always)]
fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

#[inline(always)]
fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// Horizontal sum of the lanes. Written as a plain sequential sum on purpose: LLVM's SLP
/// vectoriser recognises it as a reduction of the whole 16-lane accumulator and then keeps the
/// loop body 8/16 wide; a hand-written pairwise tree made it pick 2-wide vectors instead.
#[inline(always)]
fn sum16(acc: &[f32; 16]) -> f32 {
    acc.iter().sum()
}

/// Sum of each 32-value block of `x` (whole blocks only).
pub fn block_sums(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.chunks_exact(QK).map(|b| b.iter().sum::<f32>()));
}

#[inline(always)]
fn dot_f32<const FMA: bool>(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let wc = w.chunks_exact(16);
    let xc = x.chunks_exact(16);
    let tail: f32 = wc
        .remainder()
        .iter()
        .zip(xc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (wb, xb) in wc.zip(xc) {
        let wb: &[f32; 16] = wb.try_into().unwrap();
        let xb: &[f32; 16] = xb.try_into().unwrap();
        for j in 0..16 {
            acc[j] = fmadd::<FMA>(wb[j], xb[j], acc[j]);
        }
    }
    sum16(&acc) + tail
}

#[inline(always)]
fn dot_f32_bytes<const FMA: bool>(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (wb, xb) in row.chunks_exact(64).zip(x.chunks_exact(16)) {
        let wb: &[u8; 64] = wb.try_into().unwrap();
        let xb: &[f32; 16] = xb.try_into().unwrap();
        for j in 0..16 {
            let w = f32::from_le_bytes([wb[4 * j], wb[4 * j + 1], wb[4 * j + 2], wb[4 * j + 3]]);
            acc[j] = fmadd::<FMA>(w, xb[j], acc[j]);
        }
    }
    let done = row.len() / 64 * 16;
    let tail: f32 = row[done * 4..]
        .chunks_exact(4)
        .zip(&x[done..])
        .map(|(c, xv)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * xv)
        .sum();
    sum16(&acc) + tail
}

#[inline(always)]
fn dot_half_bytes<const FMA: bool, const BF16: bool>(row: &[u8], x: &[f32]) -> f32 {
    let conv = |lo: u8, hi: u8| {
        let h = u16::from_le_bytes([lo, hi]);
        if BF16 {
            bf16_bits_to_f32(h)
        } else {
            f16_bits_to_f32(h)
        }
    };
    let mut acc = [0f32; 16];
    for (wb, xb) in row.chunks_exact(32).zip(x.chunks_exact(16)) {
        let wb: &[u8; 32] = wb.try_into().unwrap();
        let xb: &[f32; 16] = xb.try_into().unwrap();
        for j in 0..16 {
            acc[j] = fmadd::<FMA>(conv(wb[2 * j], wb[2 * j + 1]), xb[j], acc[j]);
        }
    }
    let done = row.len() / 32 * 16;
    let tail: f32 = row[done * 2..]
        .chunks_exact(2)
        .zip(&x[done..])
        .map(|(c, xv)| conv(c[0], c[1]) * xv)
        .sum();
    sum16(&acc) + tail
}

/// The first `N` values of `x` as the vector type of that size (`__m256`, `__m512`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn load_lanes<const N: usize, V: bytemuck::Pod>(x: &[f32]) -> V
where
    [f32; N]: bytemuck::Pod,
{
    let a: [f32; N] = x[..N].try_into().unwrap();
    bytemuck::cast(a)
}

/// How `dot_f32` finishes an f16 weight row against each activation row of `xs` (`sums[c]`):
/// the sum of its 16 lanes (`lanes(c)`, the values before `done`) plus the products of the
/// values from `done` on, summed apart.
#[inline(always)]
fn finish_f16_row(
    row: &[u8],
    done: usize,
    xs: &[&[f32]],
    lanes: impl Fn(usize) -> [f32; 16],
    sums: &mut [f32],
) {
    let tail_w: Vec<f32> = row[done * 2..]
        .chunks_exact(2)
        .map(|c| f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    for (c, sum) in sums.iter_mut().enumerate() {
        let tail: f32 = tail_w.iter().zip(&xs[c][done..]).map(|(a, b)| a * b).sum();
        *sum = sum16(&lanes(c)) + tail;
    }
}

/// An f16 weight row dotted with f32 activations, converting with F16C where the CPU has it:
/// the same 16 lanes, fused multiply-adds and final sum as `dot_half_bytes::<true, false>`,
/// hence the same bits. The portable conversion (a multiply and a select per value) kept a
/// decode step's f16 matvec at ~3 GB/s a core, below what RAM delivers.
#[multiversion(targets("x86_64+avx2+fma+f16c"))]
fn dot_f16_fma(row: &[u8], x: &[f32]) -> f32 {
    multiversion::target::match_target! {
        "x86_64+avx2+fma+f16c" => f16c::dot(row, x),
        _ => dot_half_bytes::<true, false>(row, x),
    }
}

/// `sums[c]` = the f16 weight row `row` dotted with `xs[c]`, bit for bit
/// `dot_f32::<true>` of the row decoded to f32 with `xs[c]`; with F16C each 16 weights are
/// converted once for four activation rows, kept in registers (the f32 decode-then-dot path ran
/// 8-row f16 matmuls at ~1.5–1.9 GB/s a core).
#[multiversion(targets("x86_64+avx2+fma+f16c"))]
fn dot_f16_many_fma(row: &[u8], xs: &[&[f32]], sums: &mut [f32]) {
    multiversion::target::match_target! {
        "x86_64+avx2+fma+f16c" => f16c::dot_many(row, xs, sums),
        _ => {
            let mut w = vec![0f32; row.len() / 2];
            dequant_row(DType::F16, row, &mut w);
            for (s, x) in sums.iter_mut().zip(xs) {
                *s = dot_f32::<true>(&w, x);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    use super::super::kquants::avx2::{load128, prefetch_ahead};
    use super::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot(row: &[u8], x: &[f32]) -> f32 {
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (i, (wb, xb)) in row.chunks_exact(32).zip(x.chunks_exact(16)).enumerate() {
            if i % 2 == 0 {
                prefetch_ahead(&wb[..1]);
            }
            lo = _mm256_fmadd_ps(
                _mm256_cvtph_ps(load128(wb)),
                load_lanes::<8, __m256>(xb),
                lo,
            );
            hi = _mm256_fmadd_ps(
                _mm256_cvtph_ps(load128(&wb[16..])),
                load_lanes::<8, __m256>(&xb[8..]),
                hi,
            );
        }
        let acc: [f32; 16] = bytemuck::cast([lo, hi]);
        let done = row.len() / 32 * 16;
        let tail: f32 = row[done * 2..]
            .chunks_exact(2)
            .zip(&x[done..])
            .map(|(c, xv)| f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])) * xv)
            .sum();
        sum16(&acc) + tail
    }

    /// [`super::dot_f16_many_fma`] for `T` activation rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn dot_tile<const T: usize>(row: &[u8], xs: &[&[f32]], sums: &mut [f32]) {
        let (mut lo, mut hi) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
        for (i, wb) in row.chunks_exact(32).enumerate() {
            if i % 2 == 0 {
                prefetch_ahead(&wb[..1]);
            }
            let w0 = _mm256_cvtph_ps(load128(wb));
            let w1 = _mm256_cvtph_ps(load128(&wb[16..]));
            for c in 0..T {
                let x = &xs[c][16 * i..16 * i + 16];
                lo[c] = _mm256_fmadd_ps(w0, load_lanes::<8, __m256>(x), lo[c]);
                hi[c] = _mm256_fmadd_ps(w1, load_lanes::<8, __m256>(&x[8..]), hi[c]);
            }
        }
        let done = row.len() / 32 * 16;
        let lanes = |c: usize| bytemuck::cast([lo[c], hi[c]]);
        finish_f16_row(row, done, xs, lanes, &mut sums[..T]);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_many(row: &[u8], xs: &[&[f32]], sums: &mut [f32]) {
        for (xs, sums) in xs.chunks(4).zip(sums.chunks_mut(4)) {
            match xs.len() {
                1 => dot_tile::<1>(row, xs, sums),
                2 => dot_tile::<2>(row, xs, sums),
                3 => dot_tile::<3>(row, xs, sums),
                _ => dot_tile::<4>(row, xs, sums),
            }
        }
    }
}

/// Every f16 weight row of `w` (`row_bytes` each) against every activation row of `xs` (prompt
/// and decode rows), into `out` (weight row `i`, activation row `c` at `out_t[i·stride +
/// columns[c]]`). Returns how many weight rows it computed: all of them, or none without
/// AVX-512 or with `GDSLLM_CPU_AVX512=0` (the caller then takes [`dot_f16_many_fma`] a row at a
/// time). Each result is bit for bit that function's (the same 16 lanes, FMAs and final sum).
///
/// Why: `dot_f16_many_fma` converts each 16 weights once for four activation rows, but loads
/// two activation vectors per two FMAs, so an 8-row f16 matmul ran at ~4 GB/s a core (~35
/// GFLOP/s) where a 32-row one is compute-bound. A tile of 3 weight rows × up to 8 activation
/// rows in 512-bit registers reads each weight once for 8 rows and makes 24 FMAs per 3
/// conversions and 8 activation loads (the tile of 4 × 4 before it made two passes over the
/// weights for 8 rows, and its inner loop reloaded each activation row's slice from the stack
/// and checked its bounds for every 16 values: ~70 instructions per 16 FMAs, 4.1 GB/s a core).
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c"))]
fn f16_wide_tiles(w: &[u8], row_bytes: usize, xs: &[&[f32]], out: int8::Columns<'_>) -> usize {
    multiversion::target::match_target! {
        "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c" => {
            if super::vnni16::avx512_turned_off() {
                return 0;
            }
            f16x16::wide_tiles(w, row_bytes, xs, out)
        }
        _ => {
            let _ = (w, row_bytes, xs, out);
            0
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod f16x16 {
    use std::arch::x86_64::*;

    use super::super::int8::Columns;
    use super::super::kquants::avx2::prefetch_ahead;
    use super::*;

    /// Weight rows a tile: 3 × 8 accumulators, 3 converted weight vectors and an activation
    /// vector are 28 of the 32 zmm registers.
    const R: usize = 3;
    /// Activation rows a tile at most.
    const T: usize = 8;

    /// The 16-lane sums of `RR` weight rows (`rows[r]`, `n` whole chunks of 16 values each)
    /// against `TT` activation rows packed by [`pack`]: `acc[r][c]`, lane j summing the
    /// products of values 16i + j in order of i with FMA, as [`f16c::dot`] does. Not inlined:
    /// that keeps the accumulators in registers (inlined into its caller, whose closures index
    /// them, LLVM stored half of them to the stack in every iteration).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline(never)]
    fn accumulate<const RR: usize, const TT: usize>(
        rows: [&[u8]; RR],
        xp: &[f32],
        n: usize,
    ) -> [[__m512; TT]; RR] {
        // Each slice exactly `n` long, so that indexing them with `i < n` needs no checks.
        let x: &[[[f32; 16]; TT]] = &xp.as_chunks::<16>().0.as_chunks::<TT>().0[..n];
        let w: [&[[u8; 32]]; RR] = rows.map(|r| &r.as_chunks::<32>().0[..n]);
        let mut acc = [[_mm512_setzero_ps(); TT]; RR];
        for i in 0..n {
            if i % 2 == 0 {
                for row in &w {
                    prefetch_ahead(&row[i][..1]);
                }
            }
            let wv: [__m512; RR] = std::array::from_fn(|r| {
                _mm512_cvtph_ps(bytemuck::cast::<[u8; 32], __m256i>(w[r][i]))
            });
            for c in 0..TT {
                let xv: __m512 = bytemuck::cast(x[i][c]);
                for r in 0..RR {
                    acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
                }
            }
        }
        acc
    }

    /// The whole 16-value chunks of the activation rows `part` interleaved (chunk i of row c
    /// at `16·(i·t + c)`), so that a tile reads one contiguous stream of activations instead of
    /// one slice per row (whose pointers and lengths LLVM reloaded and checked each time).
    fn pack(part: &[&[f32]], n: usize, out: &mut Vec<f32>) {
        out.clear();
        for i in 0..n {
            for x in part {
                out.extend_from_slice(&x[16 * i..16 * i + 16]);
            }
        }
    }

    /// The weight rows `first..first + RR` of `w` against `part` (packed in `xp`), into `out_t`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn run<const RR: usize, const TT: usize>(
        w: &[u8],
        row_bytes: usize,
        first: usize,
        part: &[&[f32]],
        xp: &[f32],
        out_t: &mut [f32],
        n: usize,
        columns: &[usize],
    ) {
        let rows: [&[u8]; RR] = std::array::from_fn(|r| {
            let at = (first + r) * row_bytes;
            &w[at..at + row_bytes]
        });
        let whole = row_bytes / 32;
        let acc = accumulate::<RR, TT>(rows, xp, whole);
        for (r, acc) in acc.iter().enumerate() {
            let mut sums = [0f32; TT];
            let lanes = |c: usize| bytemuck::cast(acc[c]);
            finish_f16_row(rows[r], whole * 16, part, lanes, &mut sums);
            for (c, v) in sums.iter().enumerate() {
                out_t[(first + r) * n + columns[c]] = *v;
            }
        }
    }

    /// [`super::f16_wide_tiles`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) fn wide_tiles(w: &[u8], row_bytes: usize, xs: &[&[f32]], out: Columns<'_>) -> usize {
        let Columns {
            out_t,
            stride: n,
            columns,
        } = out;
        let m = w.len() / row_bytes;
        // The activation rows in passes of at most `T`, as even as they go (9 rows: 5 + 4, not
        // 8 + 1, whose lone row would leave 3 accumulators to hide the FMA latency).
        let passes = xs.len().div_ceil(T);
        let bounds = |p: usize| (xs.len() * p / passes, xs.len() * (p + 1) / passes);
        let whole = row_bytes / 32;
        let packed: Vec<Vec<f32>> = (0..passes)
            .map(|p| {
                let (from, to) = bounds(p);
                let mut xp = Vec::new();
                pack(&xs[from..to], whole, &mut xp);
                xp
            })
            .collect();
        let mut first = 0;
        while first < m {
            // Groups of `R` weight rows, then the one or two rows left a row at a time (a
            // task's rows are a multiple of 16).
            let rr = if m - first >= R { R } else { 1 };
            for (p, xp) in packed.iter().enumerate() {
                let (from, to) = bounds(p);
                let (part, cols) = (&xs[from..to], &columns[from..to]);
                macro_rules! go {
                    ($($t:literal)*) => {
                        match (rr, part.len()) {
                            $(
                                (R, $t) => {
                                    run::<R, $t>(w, row_bytes, first, part, xp, out_t, n, cols)
                                }
                                (_, $t) => {
                                    run::<1, $t>(w, row_bytes, first, part, xp, out_t, n, cols)
                                }
                            )*
                            _ => unreachable!("passes of 1..={T} rows"),
                        }
                    };
                }
                go!(1 2 3 4 5 6 7 8);
            }
            first += rr;
        }
        m
    }
}

/// q8_0: `Σ d·(q·x)` per block, 32 lanes like the 4-bit kernels.
#[inline(always)]
fn dot_q8_0<const FMA: bool>(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    for (b, xb) in row.chunks_exact(34).zip(x.chunks_exact(QK)) {
        let b: &[u8; 34] = b.try_into().unwrap();
        let xb: &[f32; 32] = xb.try_into().unwrap();
        let d = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
        let mut p = [0f32; 32];
        for j in 0..32 {
            p[j] = (b[2 + j] as i8) as f32 * xb[j];
        }
        for j in 0..32 {
            acc[j] = fmadd::<FMA>(d, p[j], acc[j]);
        }
    }
    sum32(&acc)
}

#[inline(always)]
fn sum32(acc: &[f32; 32]) -> f32 {
    acc.iter().sum()
}

/// One block of one activation row in the quantized kernels: `acc += d·(q·x)` lane by lane,
/// the product first, as [`dot_q8_0`] does.
#[inline(always)]
fn block_step<const FMA: bool>(q: &[f32; 32], d: f32, x: &[f32], acc: &mut [f32; 32]) {
    let xb: &[f32; 32] = x.try_into().unwrap();
    let mut p = [0f32; 32];
    for j in 0..32 {
        p[j] = q[j] * xb[j];
    }
    for j in 0..32 {
        acc[j] = fmadd::<FMA>(d, p[j], acc[j]);
    }
}

/// [`dot_q8_0`] of one weight row with `R` activation rows at once: each block is widened once
/// and then used for every row, each row's sums taking exactly the steps of `dot_q8_0`, so each
/// result is bit for bit that of `dot_q8_0`.
#[inline(always)]
fn dot_q8_0_rows<const FMA: bool, const R: usize>(row: &[u8], x: [&[f32]; R]) -> [f32; R] {
    let mut acc = [[0f32; 32]; R];
    for (i, b) in row.chunks_exact(34).enumerate() {
        let b: &[u8; 34] = b.try_into().unwrap();
        let d = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
        let mut q = [0f32; 32];
        for j in 0..32 {
            q[j] = (b[2 + j] as i8) as f32;
        }
        for r in 0..R {
            block_step::<FMA>(&q, d, &x[r][i * QK..(i + 1) * QK], &mut acc[r]);
        }
    }
    std::array::from_fn(|r| sum32(&acc[r]))
}

/// q4_1 (`MIN`) or q4_0 dot products of one weight row with `R` activation rows at once (`R`
/// = 1 for a single row). q4_0: `Σ d·(q−8)·x = Σ d·(q·x) − 8·Σ d·Σx`; q4_1:
/// `Σ (d·q + m)·x = Σ d·(q·x) + Σ m·Σx`, with `Σx` per block precomputed. The nibbles are
/// widened into a 32-lane array first: that shape is what LLVM vectorises cleanly (measured
/// 2–3× faster than pairing low and high nibbles in 16 lanes). Each row's sums take the same
/// steps whatever `R` is, so results are bit for bit those of `R` = 1.
#[inline(always)]
fn dot_q4_rows<const FMA: bool, const MIN: bool, const R: usize>(
    row: &[u8],
    x: [&[f32]; R],
    xsum: [&[f32]; R],
) -> [f32; R] {
    let block_bytes = if MIN { 20 } else { 18 };
    let mut acc = [[0f32; 32]; R];
    let mut offsets = [[0f32; 4]; R];
    for (i, b) in row.chunks_exact(block_bytes).enumerate() {
        let d = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
        let (scale, qs) = if MIN {
            (f16_bits_to_f32(u16::from_le_bytes([b[2], b[3]])), &b[4..20])
        } else {
            (d, &b[2..18])
        };
        let qs: &[u8; 16] = qs.try_into().unwrap();
        let mut q = [0f32; 32];
        for j in 0..16 {
            q[j] = (qs[j] & 0xF) as f32;
            q[j + 16] = (qs[j] >> 4) as f32;
        }
        for r in 0..R {
            block_step::<FMA>(&q, d, &x[r][i * QK..(i + 1) * QK], &mut acc[r]);
            offsets[r][i & 3] = fmadd::<FMA>(scale, xsum[r][i], offsets[r][i & 3]);
        }
    }
    std::array::from_fn(|r| {
        let o = offsets[r].iter().sum::<f32>();
        if MIN {
            sum32(&acc[r]) + o
        } else {
            sum32(&acc[r]) - 8.0 * o
        }
    })
}

/// Decodes one weight row into `out` (a row is whole blocks, so no partial block is handled).
#[inline(always)]
fn dequant_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => decode_scalars(row, out, f32::from_le_bytes),
        DType::F16 => decode_scalars(row, out, |b| f16_bits_to_f32(u16::from_le_bytes(b))),
        DType::Bf16 => decode_scalars(row, out, |b| bf16_bits_to_f32(u16::from_le_bytes(b))),
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(34)) {
                let b: &[u8; 34] = b.try_into().unwrap();
                let d = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
                for j in 0..QK {
                    o[j] = b[2 + j] as i8 as f32 * d;
                }
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(18)) {
                let b: &[u8; 18] = b.try_into().unwrap();
                let o: &mut [f32; 32] = o.try_into().unwrap();
                let d = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
                for j in 0..16 {
                    let q = b[2 + j];
                    o[j] = ((q & 0xF) as f32 - 8.0) * d;
                    o[j + 16] = ((q >> 4) as f32 - 8.0) * d;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(20)) {
                let b: &[u8; 20] = b.try_into().unwrap();
                let o: &mut [f32; 32] = o.try_into().unwrap();
                let d = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
                let m = f16_bits_to_f32(u16::from_le_bytes([b[2], b[3]]));
                for j in 0..16 {
                    let q = b[4 + j];
                    o[j] = (q & 0xF) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        _ => kquants::portable::dequantize_row(dtype, row, out),
    }
}

/// Below this many activation rows each weight row is dotted straight from its blocks; from
/// here on a weight row is decoded once into a small buffer and reused for every activation row.
pub const DECODE_ONCE_MIN_ROWS: usize = 4;

/// What [`matmul_rows`] multiplies: weight rows, and the activation rows in each form its
/// kernels read.
#[derive(Clone, Copy)]
pub struct RowsOperands<'a> {
    pub dtype: DType,
    /// The weight rows, each `row_bytes` long, `cols` values.
    pub w: &'a [u8],
    pub row_bytes: usize,
    pub cols: usize,
    /// The activation rows, `cols` values each.
    pub x: &'a [f32],
    /// The per-block sums of each activation row (needed by q4_0 and q4_1 for rows that are
    /// not wide; may be empty otherwise).
    pub xsums: &'a [f32],
    /// The rows quantized for the k-quant-era dtypes ([`kquants`]; needed by those for rows
    /// that are not wide) and, with `int8`, for q4_0/q4_1/q8_0.
    pub xq: &'a QuantizedActs,
    /// q4_0/q4_1/q8_0 rows that are not wide take the integer kernels of [`int8`] instead of
    /// the f32-activation ones of this module.
    pub int8: bool,
}

#[inline(always)]
fn matmul_rows_impl<const FMA: bool>(
    ops: RowsOperands<'_>,
    wide: &[bool],
    narrow_rows: bool,
    out_t: &mut [f32],
) {
    let RowsOperands {
        dtype,
        w,
        row_bytes,
        cols,
        x,
        xsums,
        xq,
        int8,
    } = ops;
    let n = wide.len();
    if int8 && int8::handles(dtype) && int8::has_gemm8() && wide.contains(&true) {
        // A prompt's rows on their 8-bit copies, eight weight rows at a time; the weight rows
        // left over and the decode rows one by one, below.
        let wide_rows: Vec<usize> = (0..n).filter(|&r| wide[r]).collect();
        let acts: Vec<_> = wide_rows.iter().map(|&r| xq.row(dtype, r)).collect();
        let out = int8::Columns {
            out_t: &mut *out_t,
            stride: n,
            columns: &wide_rows,
        };
        let done = int8::gemm8(dtype, w, row_bytes, &acts, out);
        for r in 0..n {
            let (from, rest) = if wide[r] {
                (done, &w[done * row_bytes..])
            } else {
                (0, w)
            };
            if !rest.is_empty() {
                let x = xq.row(dtype, r);
                int8::dot_rows(dtype, rest, row_bytes, x, &mut out_t[from * n + r..], n);
            }
        }
        return;
    }
    // f16 rows with FMA: a weight row decoded once and dotted (wide) and one dotted from its
    // bytes (narrow, `dot_f16_fma`) give the same bits (the conversion is exact; the same 16
    // lanes, FMAs and sums), so every such row, a batch's decode rows too, takes the kernels
    // that convert each weight once for several activation rows. Not a lone row: through the
    // tiles a small f16 model's one-row decode ran at ~0.75x of `dot_f16_fma`'s speed (the
    // 7B-sized `cpu_matvec` matrix was faster; not understood yet).
    let mut f16_rows: Vec<usize> = if FMA && dtype == DType::F16 {
        (0..n).filter(|&r| wide[r] || narrow_rows).collect()
    } else {
        Vec::new()
    };
    if f16_rows.len() < 2 {
        f16_rows.clear();
    }
    let f16_many = !f16_rows.is_empty();
    let any_wide = wide.contains(&true) && !f16_many;
    let mut tmp = vec![0f32; if any_wide { cols } else { 0 }];
    let mut narrow: Vec<usize> = (0..n)
        .filter(|&r| narrow_rows && !wide[r] && !f16_many)
        .collect();
    if int8 && int8::handles(dtype) {
        // All weight rows at once for each activation row, on its 8-bit copy.
        for &r in &narrow {
            int8::dot_rows(dtype, w, row_bytes, xq.row(dtype, r), &mut out_t[r..], n);
        }
        narrow.clear();
    }
    // Rows that must round as single rows (the decode rows of a batch) go four at a time
    // through one widening of each quantized block; the super-block k-quants likewise, on their
    // 8-bit copies (`kquants::dot4`), the scales and levels unpacked once for four rows. Each row alone made a Gemma 3 270M Q4_K_M
    // prompt's q4_k/q6_k matrices the slowest part of it on an AVX2 machine.
    let grouped =
        matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) || kquants::rows4_handles(dtype);
    let blocks = cols / QK;
    let xr = |r: usize| &x[r * cols..(r + 1) * cols];
    let xs = |r: usize| -> &[f32] {
        if matches!(dtype, DType::Q4_0 | DType::Q4_1) {
            &xsums[r * blocks..(r + 1) * blocks]
        } else {
            &[]
        }
    };
    // Those f16 rows: three weight rows × up to eight activation rows in registers where the
    // CPU has AVX-512, else each weight row converted once per four activation rows.
    let wide_xs: Vec<&[f32]> = f16_rows.iter().map(|&r| xr(r)).collect();
    let mut wide_sums = vec![0f32; f16_rows.len()];
    let tiled = if f16_many {
        let out = int8::Columns {
            out_t: &mut *out_t,
            stride: n,
            columns: &f16_rows,
        };
        f16_wide_tiles(w, row_bytes, &wide_xs, out)
    } else {
        0
    };
    for (i, (row, out)) in w
        .chunks_exact(row_bytes)
        .zip(out_t.chunks_exact_mut(n))
        .enumerate()
    {
        if f16_many && i < tiled {
            // Done above.
        } else if f16_many {
            dot_f16_many_fma(row, &wide_xs, &mut wide_sums);
            for (&r, v) in f16_rows.iter().zip(&wide_sums) {
                out[r] = *v;
            }
        } else if any_wide {
            dequant_row(dtype, row, &mut tmp);
            for r in (0..n).filter(|&r| wide[r]) {
                out[r] = dot_f32::<FMA>(&tmp, xr(r));
            }
        }
        let mut fours = narrow.chunks_exact(4);
        if grouped {
            for c in &mut fours {
                let rows = [c[0], c[1], c[2], c[3]];
                let got = match dtype {
                    DType::Q8_0 => dot_q8_0_rows::<FMA, 4>(row, rows.map(xr)),
                    DType::Q4_0 => dot_q4_rows::<FMA, false, 4>(row, rows.map(xr), rows.map(xs)),
                    DType::Q4_1 => dot_q4_rows::<FMA, true, 4>(row, rows.map(xr), rows.map(xs)),
                    _ => kquants::dot4(dtype, row, rows.map(|r| xq.row(dtype, r))),
                };
                for (r, v) in rows.into_iter().zip(got) {
                    out[r] = v;
                }
            }
        }
        let rest = if grouped {
            fours.remainder()
        } else {
            &narrow[..]
        };
        for &r in rest {
            out[r] = match dtype {
                DType::F32 => dot_f32_bytes::<FMA>(row, xr(r)),
                DType::F16 if FMA => dot_f16_fma(row, xr(r)),
                DType::F16 => dot_half_bytes::<false, false>(row, xr(r)),
                DType::Bf16 => dot_half_bytes::<FMA, true>(row, xr(r)),
                DType::Q8_0 => dot_q8_0::<FMA>(row, xr(r)),
                DType::Q4_0 => dot_q4_rows::<FMA, false, 1>(row, [xr(r)], [xs(r)])[0],
                DType::Q4_1 => dot_q4_rows::<FMA, true, 1>(row, [xr(r)], [xs(r)])[0],
                _ => kquants::dot(dtype, row, xq.row(dtype, r)),
            };
        }
    }
}

/// Computes `out_t[i·n + r] = Σ_c W[i, c]·x[r, c]` for the weight rows of `ops` and its
/// `n = wide.len()` activation rows. A row with `wide[r]` is dotted with the weight row decoded
/// once to f32 (the kernel for [`DECODE_ONCE_MIN_ROWS`] or more rows), or with `int8` and AVX2
/// for q4_0/q4_1/q8_0 goes through `int8::gemm8`; the others straight from the blocks (fewer
/// rows). The two round differently, so the caller picks per row to reproduce a given row
/// count's results. The output is transposed (weight row major) so that each task of the
/// caller owns a contiguous slice. Without `narrow_rows` the rows that are not wide are left
/// as they are (the caller computes them elsewhere; not for q4_0/q4_1/q8_0 on 8-bit
/// activations, whose rows are all computed).
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "x86_64+avx+fma",
    "aarch64+neon"
))]
pub fn matmul_rows(ops: RowsOperands<'_>, wide: &[bool], narrow_rows: bool, out_t: &mut [f32]) {
    if target_cfg_f!(any(target_feature = "fma", target_arch = "aarch64")) {
        matmul_rows_impl::<true>(ops, wide, narrow_rows, out_t)
    } else {
        matmul_rows_impl::<false>(ops, wide, narrow_rows, out_t)
    }
}

/// Dot product of two f32 slices (attention scores), vectorised like the matmul.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    if target_cfg_f!(any(target_feature = "fma", target_arch = "aarch64")) {
        dot_f32::<true>(a, b)
    } else {
        dot_f32::<false>(a, b)
    }
}

/// One head of a KV cache (`[slots, width]` each, position `t` in slot `t % slots`): its
/// `head_dim` values start at `offset` in each slot.
#[derive(Clone, Copy)]
pub struct CachedHead<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub width: usize,
    pub offset: usize,
}

/// One query row of one head attending to the positions `keys` of `head`: `out = Σ_t
/// softmax(scale·q·k_t)·v_t` (`scores`: scratch). One call per (row, head), the dot products,
/// softmax and weighted sum inlined in it: called per key, `dot` and `axpy` (64 values for
/// SmolLM2) were a fifth of a decode step at a few hundred positions, their dispatch and the
/// slot's division per key included. The same dot product (16 lanes, as `dot`) and the same
/// order of additions (as `axpy`) as before; the exponentials are `exp_approx`'s. (The
/// instruction set is picked in [`attend_with`].)
pub fn attend(
    q: &[f32],
    head: CachedHead<'_>,
    keys: std::ops::Range<usize>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_with(q, head, keys, scale, scores, out, true)
}

/// [`attend`], its scores sixteen keys at a time on AVX-512 when `lanes` allows (the same bits
/// either way: the test compares the two).
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn attend_with(
    q: &[f32],
    head: CachedHead<'_>,
    keys: std::ops::Range<usize>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    lanes: bool,
) {
    let hd = q.len();
    let slots = head.k.len() / head.width;
    // The slots of `keys` in order, without a division per key.
    let slot_of = |first: usize| {
        let mut slot = first % slots;
        move || {
            let at = slot * head.width + head.offset;
            slot += 1;
            if slot == slots {
                slot = 0;
            }
            at..at + hd
        }
    };
    let fma = target_cfg_f!(any(target_feature = "fma", target_arch = "aarch64"));
    let scored = match_target! {
        "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c" => {
            let fits = lanes && hd.is_multiple_of(16) && hd > 0;
            if fits {
                lanes512::scores(q, head, keys.clone(), scale, scores);
            }
            fits
        }
        _ => {
            let _ = lanes;
            false
        }
    };
    if !scored {
        let mut next = slot_of(keys.start);
        scores.clear();
        scores.extend(keys.clone().map(|_| {
            let k = &head.k[next()];
            let d = if fma {
                dot_f32::<true>(q, k)
            } else {
                dot_f32::<false>(q, k)
            };
            d * scale
        }));
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // The exponentials in a loop of their own, which vectorises; the sum after, in key order.
    for s in scores.iter_mut() {
        *s = exp_approx(*s - max);
    }
    let mut sum = 0f32;
    for s in scores.iter() {
        sum += *s;
    }
    out.fill(0.0);
    let inv = 1.0 / sum;
    let mut next = slot_of(keys.start);
    for s in scores.iter() {
        let (a, v) = (s * inv, &head.v[next()]);
        for (o, x) in out.iter_mut().zip(v) {
            *o += a * x;
        }
    }
}

/// Query rows a call of [`attend_lanes`] takes at most (the lanes of its vectors).
pub const ATTEND_LANES: usize = 16;

/// Whether [`attend_lanes`] has its vector kernel on this CPU (AVX-512 F and FMA); elsewhere it
/// runs [`attend`] a row at a time. Asked of the same dispatch as `attend_lanes`'s (the same
/// targets), so that the two cannot disagree.
pub fn attend_lanes_fast() -> bool {
    attend_lanes_dispatch()
}

#[multiversion(targets("x86_64+avx512f+avx2+fma"))]
fn attend_lanes_dispatch() -> bool {
    match_target! {
        "x86_64+avx512f+avx2+fma" => true,
        _ => false,
    }
}

/// Up to [`ATTEND_LANES`] query rows of one head (`qs`, `head_dim` values each) attending each
/// to its own positions (`keys[l]`, none empty) of `head`, into `outs`: for each row exactly
/// [`attend`]'s result, bit for bit (`scratch`: scratch).
///
/// Why: a prompt's attention ran [`attend`] once per (row, head), each key's score a 16-lane
/// dot product and a horizontal sum, each exponential scalar (its sum runs in key order): a
/// fifth of a SmolLM2 prompt of 128 tokens on one thread, at ~3 G multiply-adds a second.
/// Here (AVX-512, `head_dim` a multiple of 16) the rows are the lanes of the vectors. A key is
/// read once for all of them; its score is the same 16 partial sums `dot_f32` forms (one vector
/// each) added in the same order; the exponentials, their sum and the weighted sum of values
/// are the same operations in the same order per lane. A lane's keys outside its range get
/// weight exactly 0, which leaves its sum and output as they were (values are finite).
#[multiversion(targets("x86_64+avx512f+avx2+fma"))]
pub fn attend_lanes(
    qs: &[&[f32]],
    head: CachedHead<'_>,
    keys: &[std::ops::Range<usize>],
    scale: f32,
    scratch: &mut Vec<[f32; ATTEND_LANES]>,
    outs: &mut [&mut [f32]],
) {
    debug_assert!(qs.len() <= ATTEND_LANES && keys.len() == qs.len() && outs.len() == qs.len());
    let hd = qs.first().map_or(0, |q| q.len());
    match_target! {
        "x86_64+avx512f+avx2+fma" => {
            if hd.is_multiple_of(16) && hd > 0 {
                lanes512::attend_lanes(qs, head, keys, scale, scratch, outs);
                return;
            }
        }
        _ => {
            let _ = hd;
        }
    }
    scratch.clear();
    let mut scores = Vec::new();
    for ((q, k), o) in qs.iter().zip(keys).zip(outs.iter_mut()) {
        attend(q, head, k.clone(), scale, &mut scores, o);
    }
}

#[cfg(target_arch = "x86_64")]
mod lanes512 {
    use std::arch::x86_64::*;

    use super::{ATTEND_LANES as L, CachedHead, exp_approx};

    /// [`super::attend`]'s scores (`scale · q·k_t` for each key of `keys`, in order) on
    /// AVX-512, sixteen keys at a time, each exactly `dot_f32`'s: a key's 16 partial sums are
    /// one vector of fused multiply-adds as there, and the sixteen keys' vectors are transposed
    /// so that one vector addition a partial sum adds them in `sum16`'s order for all sixteen.
    ///
    /// Why: a decode row's score per key was a dependent chain of fifteen scalar additions
    /// (`sum16`, kept sequential for its bits) after four multiply-adds; the transposition is
    /// 64 shuffles per sixteen keys.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn scores(
        q: &[f32],
        head: CachedHead<'_>,
        keys: std::ops::Range<usize>,
        scale: f32,
        out: &mut Vec<f32>,
    ) {
        let hd = q.len();
        let slots = head.k.len() / head.width;
        // `sum16` folds from the empty sum, and `dot_f32` adds the empty tail to it: the same
        // value (±0) on both ends here, whatever its sign.
        let empty: f32 = [0f32; 0].iter().sum();
        let (empty, scale) = (_mm512_set1_ps(empty), _mm512_set1_ps(scale));
        let chunk = |x: &[f32], c: usize| -> __m512 {
            let v: [f32; L] = x[c..c + L].try_into().unwrap_or([0.0; L]);
            bytemuck::cast(v)
        };
        out.clear();
        let mut slot = keys.start % slots;
        let mut t = keys.start;
        while t < keys.end {
            let n = (keys.end - t).min(L);
            let mut acc = [_mm512_setzero_ps(); L];
            for a in acc.iter_mut().take(n) {
                let at = slot * head.width + head.offset;
                let k = &head.k[at..at + hd];
                let mut sum = _mm512_setzero_ps();
                for c in (0..hd).step_by(L) {
                    sum = _mm512_fmadd_ps(chunk(q, c), chunk(k, c), sum);
                }
                *a = sum;
                slot += 1;
                if slot == slots {
                    slot = 0;
                }
            }
            let parts = transpose16(acc);
            let mut sum = _mm512_add_ps(empty, parts[0]);
            for p in &parts[1..] {
                sum = _mm512_add_ps(sum, *p);
            }
            let sum = _mm512_mul_ps(_mm512_add_ps(sum, empty), scale);
            let lanes: [f32; L] = bytemuck::cast(sum);
            out.extend_from_slice(&lanes[..n]);
            t += n;
        }
    }

    /// The 16 × 16 matrix of rows `r` transposed: lane `l` of row `j` of the result is lane `j`
    /// of `r[l]` (unpacks within 128-bit lanes, then two rounds of 128-bit lane shuffles).
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: [__m512; L]) -> [__m512; L] {
        // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved, low and high pairs of each lane.
        let mut t = [_mm512_setzero_ps(); L];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // u[4i + j], 128-bit lane q: value 4q + j of rows 4i … 4i + 3.
        let mut u = [_mm512_setzero_ps(); L];
        for i in 0..4 {
            let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
            u[4 * i] = _mm512_shuffle_ps::<0x44>(a, c);
            u[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(a, c);
            u[4 * i + 2] = _mm512_shuffle_ps::<0x44>(b, d);
            u[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(b, d);
        }
        // Column 4q + j: lane q of u[j], u[4 + j], u[8 + j], u[12 + j].
        let mut w = [_mm512_setzero_ps(); L];
        for j in 0..4 {
            let p = _mm512_shuffle_f32x4::<0x44>(u[j], u[4 + j]);
            let q = _mm512_shuffle_f32x4::<0xEE>(u[j], u[4 + j]);
            let r = _mm512_shuffle_f32x4::<0x44>(u[8 + j], u[12 + j]);
            let s = _mm512_shuffle_f32x4::<0xEE>(u[8 + j], u[12 + j]);
            w[j] = _mm512_shuffle_f32x4::<0x88>(p, r);
            w[4 + j] = _mm512_shuffle_f32x4::<0xDD>(p, r);
            w[8 + j] = _mm512_shuffle_f32x4::<0x88>(q, s);
            w[12 + j] = _mm512_shuffle_f32x4::<0xDD>(q, s);
        }
        w
    }

    /// [`super::attend_lanes`] on AVX-512.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn attend_lanes(
        qs: &[&[f32]],
        head: CachedHead<'_>,
        keys: &[std::ops::Range<usize>],
        scale: f32,
        scratch: &mut Vec<[f32; L]>,
        outs: &mut [&mut [f32]],
    ) {
        let n = qs.len();
        let hd = qs[0].len();
        let slots = head.k.len() / head.width;
        let first = keys.iter().map(|k| k.start).min().unwrap_or(0);
        let end = keys.iter().map(|k| k.end).max().unwrap_or(0);
        let slot_at = |t: usize| {
            let at = (t % slots) * head.width + head.offset;
            at..at + hd
        };
        // The queries transposed: lane `l` of `qt[d]` is value `d` of row `l` (others 0).
        let qt: Vec<__m512> = (0..hd)
            .map(|d| {
                let mut lanes = [0f32; L];
                for (lane, q) in lanes.iter_mut().zip(qs) {
                    *lane = q[d];
                }
                bytemuck::cast(lanes)
            })
            .collect();
        let mut lo = [usize::MAX; L];
        let mut hi = [0usize; L];
        for (l, k) in keys.iter().enumerate() {
            (lo[l], hi[l]) = (k.start, k.end);
        }
        scratch.clear();
        for t in first..end {
            let k = &head.k[slot_at(t)];
            // `acc[j]`: `dot_f32`'s partial sum `j`, a lane per row.
            let mut acc = [_mm512_setzero_ps(); 16];
            for (qc, kc) in qt.chunks_exact(16).zip(k.chunks_exact(16)) {
                for j in 0..16 {
                    acc[j] = _mm512_fmadd_ps(qc[j], _mm512_set1_ps(kc[j]), acc[j]);
                }
            }
            let mut sum = acc[0];
            for a in &acc[1..] {
                sum = _mm512_add_ps(sum, *a);
            }
            let mut score: [f32; L] = bytemuck::cast(sum);
            for l in 0..L {
                score[l] = if lo[l] <= t && t < hi[l] {
                    score[l] * scale
                } else {
                    f32::NEG_INFINITY
                };
            }
            scratch.push(score);
        }
        let mut max = [f32::NEG_INFINITY; L];
        for s in scratch.iter() {
            for l in 0..L {
                max[l] = max[l].max(s[l]);
            }
        }
        for s in scratch.iter_mut() {
            for l in 0..L {
                s[l] = if s[l] == f32::NEG_INFINITY {
                    0.0
                } else {
                    exp_approx(s[l] - max[l])
                };
            }
        }
        let mut total = [0f32; L];
        for s in scratch.iter() {
            for l in 0..L {
                total[l] += s[l];
            }
        }
        let mut inv = [0f32; L];
        for l in 0..n {
            inv[l] = 1.0 / total[l];
        }
        for s in scratch.iter_mut() {
            for l in 0..L {
                s[l] *= inv[l];
            }
        }
        // Sixteen of the head's values at a time: `o[j]` holds value `c + j`, a lane per row.
        for c in (0..hd).step_by(16) {
            let mut o = [_mm512_setzero_ps(); 16];
            for (i, a) in scratch.iter().enumerate() {
                let a: __m512 = bytemuck::cast(*a);
                let v = &head.v[slot_at(first + i)][c..c + 16];
                for j in 0..16 {
                    o[j] = _mm512_add_ps(o[j], _mm512_mul_ps(a, _mm512_set1_ps(v[j])));
                }
            }
            for (j, o) in o.iter().enumerate() {
                let lanes: [f32; L] = bytemuck::cast(*o);
                for (out, v) in outs.iter_mut().zip(lanes) {
                    out[c + j] = v;
                }
            }
        }
    }
}

/// `y += a·x` (attention's weighted sum of values).
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

/// `e^x` for |x| below ~87 (clamped to the range of normal f32 results), within 2 ulp: Cephes'
/// `expf` (`x = n·ln2 + r`, |r| ≤ ln2/2, a degree-5 polynomial for `e^r`, then `2^n` through
/// the exponent bits), written without calls or branches so that LLVM vectorises the loops
/// over it (a call of libm's `expf` per value kept the gated units scalar: a few per cent of a
/// small model's decode step).
#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, the first exact in few bits, so that `x − n·ln2` loses nothing.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest by the float adder: 1.5·2²³ leaves no fraction bits.
    const SHIFT: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + SHIFT) - SHIFT;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001e-1, which is 0.5 in f32
    let er = p * r * r + r + 1.0;
    // `2^n` from the bits of `n + SHIFT`, whose low mantissa bits hold `n` (|n| ≤ 127): integer
    // operations, where `n as i32` is a saturating conversion with a NaN test per value that
    // kept the loops over this function from vectorising. The same `2^n`.
    let n_bits = (n + SHIFT).to_bits().wrapping_sub(SHIFT.to_bits());
    er * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// `x·σ(x)`.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp_approx(-x))
}

/// `√(2/π)`, in the tanh approximation of GeLU.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// GeLU's tanh approximation `0.5·x·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)`, written as
/// `x·σ(2u)` (the same function: `0.5·(1 + tanh(u)) = σ(2u)`).
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    x / (1.0 + exp_approx(-2.0 * u))
}

/// `gate[i] = silu(gate[i]) · up[i]` (SwiGLU), vectorised.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `gate[i] = gelu_tanh(gate[i]) · up[i]` (GeGLU), vectorised.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// Decodes one whole row (embedding lookup).
pub fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    dequant_row(dtype, row, out)
}

#[cfg(test)]
mod tests {
    use super::super::kquants::tests::Rng;
    use super::*;

    /// `attend_lanes` gives each row `attend`'s bits (a prompt's rows take it, a decode row
    /// `attend`, so a sequence's tokens must not depend on which): 1–16 rows of one head with
    /// causal and sliding-window ranges, head sizes 16–256, a ring cache that wraps, several
    /// heads in a slot (the head at an offset), scores far apart (exponentials near 0).
    #[test]
    fn attention_scores_in_key_lanes_give_attends_bits() {
        // `attend` with its scores sixteen keys at a time (AVX-512) against the same call with
        // one key at a time: every output bit equal, every score equal, for head sizes 16–256,
        // key counts around the sixteen-key blocks, and keys that wrap around a ring cache.
        let mut rng = Rng(0x5c0e_5ea1);
        let (mut fast_scores, mut slow_scores) = (Vec::new(), Vec::new());
        let mut cases = 0;
        for hd in [16, 64, 128, 256] {
            for (n_keys, slots, first) in [
                (1, 8, 0),
                (15, 40, 3),
                (16, 16, 0),
                (17, 40, 0),
                (40, 24, 20),
                (203, 256, 5),
            ] {
                let width = 2 * hd;
                let spread = if n_keys == 203 { 40.0 } else { 2.0 };
                let k: Vec<f32> = (0..slots * width).map(|_| spread * rng.uniform()).collect();
                let v: Vec<f32> = (0..slots * width).map(|_| rng.uniform()).collect();
                let q: Vec<f32> = (0..hd).map(|_| rng.uniform()).collect();
                let head = CachedHead {
                    k: &k,
                    v: &v,
                    width,
                    offset: hd,
                };
                let keys = first..first + n_keys;
                let scale = 1.0 / (hd as f32).sqrt();
                let (mut fast, mut slow) = (vec![0f32; hd], vec![0f32; hd]);
                attend_with(
                    &q,
                    head,
                    keys.clone(),
                    scale,
                    &mut fast_scores,
                    &mut fast,
                    true,
                );
                attend_with(&q, head, keys, scale, &mut slow_scores, &mut slow, false);
                assert_eq!(fast_scores.len(), slow_scores.len());
                assert!(
                    fast.iter()
                        .zip(&slow)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "head_dim {hd}, {n_keys} keys from {first} of {slots} slots: outputs differ"
                );
                cases += 1;
            }
        }
        let fast = cfg!(target_arch = "x86_64") && attend_lanes_fast();
        println!("{cases} cases, every output bit equal (AVX-512 scores: {fast})");
    }

    #[test]
    fn attention_lanes_give_each_row_the_bits_of_attend() {
        let mut rng = Rng(0x5eed_a77e);
        let mut lane_scratch = Vec::new();
        let mut scores = Vec::new();
        let mut cases = 0;
        for hd in [16, 64, 128, 256] {
            let shapes: [(usize, Option<usize>, usize); 6] = [
                (1, None, 40),
                (5, None, 40),
                (16, None, 64),
                (16, Some(7), 64),
                (11, Some(24), 30),
                (13, None, 200),
            ];
            for (n_rows, window, slots) in shapes {
                let heads = 3;
                let width = heads * hd;
                let spread = if n_rows == 13 { 40.0 } else { 2.0 };
                let k: Vec<f32> = (0..slots * width).map(|_| spread * rng.uniform()).collect();
                let v: Vec<f32> = (0..slots * width).map(|_| rng.uniform()).collect();
                let qs: Vec<Vec<f32>> = (0..n_rows)
                    .map(|_| (0..hd).map(|_| rng.uniform()).collect())
                    .collect();
                // The rows' positions end at the cache's last written slot (a ring when the
                // window is smaller than the positions: `slots` is at least window + rows).
                let pos0 = if window.is_some() { 45 } else { slots - n_rows };
                let keys: Vec<_> = (0..n_rows)
                    .map(|r| {
                        let pos = pos0 + r;
                        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                        first..pos + 1
                    })
                    .collect();
                let head = CachedHead {
                    k: &k,
                    v: &v,
                    width,
                    offset: hd,
                };
                let scale = 1.0 / (hd as f32).sqrt();
                let mut lanes = vec![vec![0f32; hd]; n_rows];
                {
                    let q_refs: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
                    let mut outs: Vec<&mut [f32]> = lanes.iter_mut().map(|o| &mut o[..]).collect();
                    attend_lanes(&q_refs, head, &keys, scale, &mut lane_scratch, &mut outs);
                }
                for r in 0..n_rows {
                    let mut want = vec![0f32; hd];
                    attend(&qs[r], head, keys[r].clone(), scale, &mut scores, &mut want);
                    let same = want
                        .iter()
                        .zip(&lanes[r])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "head_dim {hd}, {n_rows} rows, window {window:?}: row {r} differs"
                    );
                }
                cases += 1;
            }
        }
        println!(
            "{cases} cases, every row bit for bit (AVX-512 kernel: {})",
            attend_lanes_fast()
        );
    }

    #[test]
    fn vectorised_activations_match_libm_within_a_few_ulp() {
        // `exp_approx` against libm's `exp` (f64) where its results are normal floats (it
        // clamps below −87, where they are tiny), and the gated units against their libm
        // forms, outputs below 1e-25 in magnitude counting as equal (the clamped tails):
        // relative error printed, tolerance 4e-7 (a few ulp; the f32 divisions and products
        // add a rounding each).
        let mut worst_exp = 0f64;
        let mut x = -80.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            worst_exp = worst_exp.max((exp_approx(x) as f64 - want).abs() / want);
            x += 0.013;
        }
        println!("exp_approx: max rel error {worst_exp:.2e} (tol 4e-7)");
        assert!(worst_exp <= 4e-7);
        let mut rng = Rng(99);
        let xs: Vec<f32> = (0..4096)
            .map(|i| rng.uniform() * if i % 2 == 0 { 8.0 } else { 200.0 })
            .chain([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 200.0, -200.0])
            .collect();
        let up = vec![1f32; xs.len()];
        let (mut s, mut g) = (xs.clone(), xs.clone());
        swiglu(&mut s, &up);
        geglu(&mut g, &up);
        let (mut worst_s, mut worst_g) = (0f64, 0f64);
        for ((x, s), g) in xs.iter().zip(&s).zip(&g) {
            let x64 = *x as f64;
            let want_s = x64 / (1.0 + (-x64).exp());
            // 0.5·x·(1 + tanh(u)) in a form without cancellation where tanh(u) is near −1,
            // `u` rounded to f32 as the kernel (and the libm form before it) computes it: its
            // rounding moves e^(−2u) by up to 2|u| ulp, which is the f32 input's, not exp's.
            let u = (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)) as f64;
            let want_g = x64 / (1.0 + (-2.0 * u).exp());
            let rel = |got: f32, want: f64| (got as f64 - want).abs() / want.abs().max(1e-25);
            worst_s = worst_s.max(rel(*s, want_s));
            worst_g = worst_g.max(rel(*g, want_g));
        }
        println!("swiglu: max rel error {worst_s:.2e}, geglu: {worst_g:.2e} (tol 4e-7)");
        assert!(worst_s <= 4e-7 && worst_g <= 4e-7, "{worst_s} {worst_g}");
    }

    #[test]
    fn the_f16c_row_kernel_gives_the_portable_kernels_bits() {
        // Random f16 bit patterns (normal and subnormal values of both signs, no NaN or
        // infinity) in rows with and without a tail of fewer than 16 values: F16C converts
        // each value exactly, as the portable conversion does, and the lanes, FMAs and final
        // sum are the same, so the results are bit for bit equal.
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        for cols in [16, 4096, 4096 + 7, 5] {
            let row: Vec<u8> = (0..cols)
                .flat_map(|_| {
                    let bits = (rng.next() as u16) & 0xFBFF; // exponent never all ones
                    bits.to_le_bytes()
                })
                .collect();
            let x: Vec<f32> = (0..cols).map(|_| rng.uniform()).collect();
            let fast = dot_f16_fma(&row, &x);
            let portable = dot_half_bytes::<true, false>(&row, &x);
            println!("f16 row of {cols}: {fast} (portable {portable})");
            assert_eq!(fast.to_bits(), portable.to_bits(), "{cols} columns");
            // Many activation rows at once (tiles of four and a remainder) against the row
            // decoded to f32 and dotted with each (the prompt path's kernel before).
            let xs: Vec<Vec<f32>> = (0..7)
                .map(|_| (0..cols).map(|_| rng.uniform()).collect())
                .collect();
            let refs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
            let mut sums = vec![f32::NAN; xs.len()];
            dot_f16_many_fma(&row, &refs, &mut sums);
            let mut decoded = vec![0f32; cols];
            dequant_row(DType::F16, &row, &mut decoded);
            // The premise of `matmul_rows` taking one kernel for wide and narrow f16 rows.
            let decoded_dot = dot_f32::<true>(&decoded, &x);
            assert_eq!(
                fast.to_bits(),
                decoded_dot.to_bits(),
                "{cols}: decoded first"
            );
            for (c, x) in xs.iter().enumerate() {
                let reference = dot_f32::<true>(&decoded, x);
                assert_eq!(
                    sums[c].to_bits(),
                    reference.to_bits(),
                    "{cols} columns, row {c}"
                );
            }
        }
    }

    #[test]
    fn f16_tiles_give_the_row_kernels_bits() {
        // Three weight rows × up to eight activation rows in 512-bit registers (where the CPU
        // has AVX-512), the one or two weight rows after the last group of three a row at a
        // time: every result bit for bit `dot_f16_many_fma`'s, into the columns asked for, for
        // weight row counts of every remainder by three, rows with and without a tail of fewer
        // than 16 values, and 1–40 activation rows (passes of up to eight and their remainders).
        let mut rng = Rng(0x0F16_7113_5EED_0001);
        for (rows, cols) in [
            (4, 16),
            (9, 4096 + 7),
            (5, 33 * 16),
            (13, 512),
            (4, 5),
            (2, 48),
            (17, 1024 + 9),
        ] {
            let row_bytes = cols * 2;
            let w: Vec<u8> = (0..rows * cols)
                .flat_map(|_| ((rng.next() as u16) & 0xFBFF).to_le_bytes())
                .collect();
            let mut tiled = false;
            for n_acts in 1..=40 {
                let xs: Vec<Vec<f32>> = (0..n_acts)
                    .map(|_| (0..cols).map(|_| rng.uniform()).collect())
                    .collect();
                let refs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
                // Into every other column of a table twice as wide, backwards.
                let n = 2 * n_acts;
                let columns: Vec<usize> = (0..n_acts).map(|c| 2 * (n_acts - 1 - c)).collect();
                let mut out_t = vec![f32::NAN; rows * n];
                let out = int8::Columns {
                    out_t: &mut out_t,
                    stride: n,
                    columns: &columns,
                };
                let done = f16_wide_tiles(&w, row_bytes, &refs, out);
                assert!(done == 0 || done == rows, "{done} of {rows} rows");
                tiled = done > 0;
                let mut sums = vec![0f32; n_acts];
                for (i, row) in w.chunks_exact(row_bytes).enumerate().take(done) {
                    dot_f16_many_fma(row, &refs, &mut sums);
                    for c in 0..n_acts {
                        assert_eq!(
                            out_t[i * n + columns[c]].to_bits(),
                            sums[c].to_bits(),
                            "[{rows}x{cols}] weight row {i}, activation row {c} of {n_acts}"
                        );
                        assert!(
                            out_t[i * n + 2 * c + 1].is_nan(),
                            "column {} written",
                            2 * c + 1
                        );
                    }
                }
                assert!(
                    out_t[done * n..].iter().all(|v| v.is_nan()),
                    "rows after {done}"
                );
            }
            println!(
                "f16 tiles [{rows}x{cols}] × 1..=40: {}",
                if tiled {
                    "bit for bit"
                } else {
                    "no AVX-512 here: not run"
                }
            );
        }
    }
}
