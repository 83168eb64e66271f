//! CPU dot products for the dtypes that came with the k-quants (q2_k … q6_k, iq4_xs, and the
//! 32-value q5_0, q5_1, iq4_nl), read straight from the blocks, as llama.cpp's CPU backend does.
//!
//! The activations of a row are first quantized to 8 bits ([`QuantizedActs`]: `x ≈ d·q`,
//! `|x − d·q| ≤ max|x| / 254` over the values sharing `d`: 32 for q5_0/q5_1/iq4_nl as llama.cpp's
//! q8_0, 256 for the super-block dtypes as its q8_K) so that each block's product is an integer
//! dot product of its levels with `q` — `maddubs` on AVX2, 32 multiply-adds per instruction.
//! The weights' offsets and mins (q4_k's `dmin·m`, q6_k's −32 …) multiply the per-16 sums `Σq`,
//! so the whole dot product is that of the stored weights with the quantized activations, up to
//! f32 rounding; a super-block is one integer sum scaled once. Only the activation rows of
//! matmuls of fewer than 4 rows take this path (decoding, small batches); longer prompts dot a
//! weight row decoded once to f32 (see `kernels::matmul_rows`), so they keep f32 activations.
//!
//! [`dot`] picks the AVX2 kernels at run time (`multiversion`), else [`portable`]; both are
//! checked against [`reference_dot`] (decode with `weights_format::quant`, then an f64 dot).
//! Layouts: `weights-format/FORMAT.md`.

use multiversion::multiversion;
use multiversion::target::match_target;
use weights_format::DType;
use weights_format::quant::{IQ4_LEVELS, iq4xs_scale, q3k_scale};

use super::kernels::f16_bits_to_f32;

/// Whether [`dot`] handles `dtype` (the dtypes added with the k-quants, format version 3).
pub(crate) fn handles(dtype: DType) -> bool {
    dtype.format_version() >= 3 && dtype.is_quantized()
}

/// Activation rows quantized for the integer dot products, in the two granularities the dtypes
/// read (as llama.cpp's q8_0 and q8_K): the 32-value dtypes take a scale per 32 values, the
/// super-block dtypes one per 256 (so that a whole super-block is one integer sum, scaled once).
/// Each is computed on first use for the rows given ([`QuantizedActs::prepare`]).
#[derive(Debug, Default)]
pub(crate) struct QuantizedActs {
    cols: usize,
    per32: Acts,
    per256: Acts,
}

/// `x ≈ d·q` (round to nearest) with one f32 scale per `block` values (32 or 256), stored per 32
/// values (repeated for 256), and per 16 values `Σq` and `d·Σq`.
#[derive(Debug, Default)]
struct Acts {
    q: Vec<i8>,
    d: Vec<f32>,
    s16: Vec<f32>,
    bsums: Vec<i16>,
}

/// Round to nearest, ties to even, for `|y| ≤ 2²²` (here `|y| ≤ 127`): adding 1.5·2²³ leaves no
/// fraction bits, so the FPU's rounding does it. `f32::round_ties_even` is a call to `rintf`
/// in a build for baseline x86-64 (2 % of a decode step in `perf`).
#[inline(always)]
fn round_small(y: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (y + SHIFT) - SHIFT
}

/// Values one task of [`Acts::quantize`] takes (a multiple of 256): a prompt's rows are
/// quantized in parallel, a decode row (a few thousand values) on the calling thread.
const QUANTIZE_CHUNK: usize = 8 * 1024;

impl Acts {
    fn quantize(&mut self, x: &[f32], block: usize) {
        let n = x.len();
        self.q.resize(n, 0);
        self.d.resize(n / 32, 0.0);
        self.s16.resize(n / 16, 0.0);
        self.bsums.resize(n / 16, 0);
        let (q, d, s16, bsums) = (
            &mut self.q[..],
            &mut self.d[..],
            &mut self.s16[..],
            &mut self.bsums[..],
        );
        if n <= QUANTIZE_CHUNK || !n.is_multiple_of(block) {
            quantize_into(x, block, q, d, s16, bsums);
            return;
        }
        let c = QUANTIZE_CHUNK.next_multiple_of(block);
        let mut tasks: Vec<_> = x
            .chunks(c)
            .zip(q.chunks_mut(c))
            .zip(d.chunks_mut(c / 32))
            .zip(s16.chunks_mut(c / 16).zip(bsums.chunks_mut(c / 16)))
            .collect();
        super::cpu::for_each_task(&mut tasks, |(((x, q), d), (s16, bsums))| {
            quantize_into(x, block, q, d, s16, bsums)
        });
    }
}

/// [`Acts::quantize`] of `x` (whole blocks of `block` values) into slices of the matching
/// lengths. Compiled for AVX-512 and AVX2 as well (a prompt's activations, quantized in the
/// baseline build's SSE2, took a quarter of the time of the matmuls they fed on one thread);
/// the same operations on each value, so the same bits on any of them.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn quantize_into(
    x: &[f32],
    block: usize,
    q: &mut [i8],
    d: &mut [f32],
    s16: &mut [f32],
    bsums: &mut [i16],
) {
    let per_block = (block / 32, block / 16);
    for (b, (chunk, qb)) in x
        .chunks_exact(block)
        .zip(q.chunks_exact_mut(block))
        .enumerate()
    {
        // Sixteen running maxima, then theirs: `max` is exact, so the order changes nothing.
        let mut lanes = [0f32; 16];
        for sixteen in chunk.chunks_exact(16) {
            for (m, v) in lanes.iter_mut().zip(sixteen) {
                *m = m.max(v.abs());
            }
        }
        let amax = lanes.iter().fold(0f32, |m, v| m.max(*v));
        let scale = amax / 127.0;
        let id = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (o, v) in qb.iter_mut().zip(chunk) {
            *o = round_small(v * id) as i8;
        }
        d[b * per_block.0..(b + 1) * per_block.0].fill(scale);
        let sixteens = b * per_block.1..(b + 1) * per_block.1;
        for ((sixteen, s), bs) in qb
            .chunks_exact(16)
            .zip(&mut s16[sixteens.clone()])
            .zip(&mut bsums[sixteens])
        {
            let sum: i32 = sixteen.iter().map(|&v| v as i32).sum();
            *bs = sum as i16;
            *s = scale * sum as f32;
        }
    }
}

/// One row of [`QuantizedActs`] in one granularity: `q` and, per 32 values, `d`; per 16
/// values `s16 = d·Σq` and `bsums = Σq`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub s16: &'a [f32],
    pub bsums: &'a [i16],
}

impl QuantizedActs {
    /// Quantizes the rows of `x` (each `cols` values) for `dtype`, unless that granularity is
    /// already there (every call on one `QuantizedActs` must pass the same `x`).
    pub(crate) fn prepare(&mut self, x: &[f32], cols: usize, dtype: DType) {
        debug_assert!(cols.is_multiple_of(dtype.block_len()) && x.len().is_multiple_of(cols));
        self.cols = cols;
        let block = dtype.block_len();
        let acts = if block == 32 {
            &mut self.per32
        } else {
            &mut self.per256
        };
        if acts.q.is_empty() {
            acts.quantize(x, block);
        }
    }

    /// Row `r` in the granularity `dtype` reads.
    pub(crate) fn row(&self, dtype: DType, r: usize) -> ActRow<'_> {
        let c = self.cols;
        let acts = if dtype.block_len() == 32 {
            &self.per32
        } else {
            &self.per256
        };
        ActRow {
            q: &acts.q[r * c..(r + 1) * c],
            d: &acts.d[r * c / 32..(r + 1) * c / 32],
            s16: &acts.s16[r * c / 16..(r + 1) * c / 16],
            bsums: &acts.bsums[r * c / 16..(r + 1) * c / 16],
        }
    }
}

/// The stored weight row `row` (whole blocks of `dtype`) dotted with the quantized activation
/// row `x` (as many values). The AVX2 kernels when the CPU has AVX2 and FMA, else [`portable`].
#[multiversion(targets("x86_64+avx2+fma+f16c", "aarch64+neon"))]
pub(crate) fn dot(dtype: DType, row: &[u8], x: ActRow<'_>) -> f32 {
    match_target! {
        "x86_64+avx2+fma" => avx2::dot(dtype, row, x),
        _ => portable::dot(dtype, row, x),
    }
}

/// Whether this CPU runs the AVX2 kernels (AVX2, FMA and F16C: the target their multiversioned
/// entry points dispatch on), here and in `int8`.
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether [`dot4`] takes `dtype` on this CPU: the super-block dtypes whose unpacking (6-bit
/// scales, levels) [`dot`] would repeat for each activation row of a prompt.
pub(crate) fn rows4_handles(dtype: DType) -> bool {
    matches!(dtype, DType::Q4K | DType::Q5K | DType::Q6K) && has_avx2()
}

/// `row` dotted with four quantized activation rows: bit for bit [`dot`] of each (the weights'
/// blocks unpacked once for the four). Only where [`rows4_handles`].
#[multiversion(targets("x86_64+avx2+fma+f16c"))]
pub(crate) fn dot4(dtype: DType, row: &[u8], xs: [ActRow<'_>; 4]) -> [f32; 4] {
    match_target! {
        "x86_64+avx2+fma" => avx2::dot4(dtype, row, xs),
        _ => xs.map(|x| portable::dot(dtype, row, x)),
    }
}

/// The slow definition: `row` decoded with `weights_format::quant::dequantize`, then an f64
/// dot product with `x` (f32 activations, not quantized). The kernels' tests compare with it.
#[cfg(test)]
pub(crate) fn reference_dot(dtype: DType, row: &[u8], x: &[f32]) -> f64 {
    let mut w = vec![0f32; x.len()];
    weights_format::quant::dequantize(dtype, row, &mut w).expect("row is whole blocks");
    w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum()
}

pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// The eight 6-bit scales and eight 6-bit mins of a q4_k / q5_k super-block from its 12
/// packed bytes (the layout of `weights_format::quant::k4_scale_min`), with word operations:
/// the low 6 bits of bytes 0–3 (scales 0–3) and 4–7 (mins 0–3); scales 4–7 are the low
/// nibbles of bytes 8–11 topped by bits 6–7 of bytes 0–3, mins 4–7 the high nibbles topped by
/// bits 6–7 of bytes 4–7.
#[inline(always)]
fn k4_scales(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word =
        |i: usize| u32::from_le_bytes([packed[i], packed[i + 1], packed[i + 2], packed[i + 3]]);
    let (w0, w1, w2) = (word(0), word(4), word(8));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let scales_lo = w0 & LOW6;
    let scales_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let mins_lo = w1 & LOW6;
    let mins_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    let join = |a: u32, b: u32| {
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&a.to_le_bytes());
        out[4..].copy_from_slice(&b.to_le_bytes());
        out
    };
    (join(scales_lo, scales_hi), join(mins_lo, mins_hi))
}

/// One 32-value block of weights as signed levels and an affine map per 16 values:
/// `value[j] = a[j / 16] · lv[j] + c[j / 16]`, computed in exactly the order of
/// `weights_format::quant::dequantize`, so [`portable::dequantize_row`] gives its bits.
struct Block32 {
    lv: [i8; 32],
    a: [f32; 2],
    c: [f32; 2],
}

/// A layout's decoder of one 32-value block (`(row, b) → Block32` for block `b`, the 32 values
/// from `32·b`): one implementation per dtype, so that each kernel below is compiled for one
/// layout with straight loops (a trait method with `inline(always)` is inlined where a function
/// pointer or closure may not be).
trait Layout {
    fn block(row: &[u8], b: usize) -> Block32;
}

macro_rules! layouts {
    ($($name:ident => $f:expr;)*) => {
        $(
            struct $name;
            impl Layout for $name {
                #[inline(always)]
                fn block(row: &[u8], b: usize) -> Block32 {
                    $f(row, b)
                }
            }
        )*
    };
}

layouts! {
    Q5_0Layout => q5_block::<false>;
    Q5_1Layout => q5_block::<true>;
    Iq4NlLayout => iq4nl_block;
    Q2KLayout => q2k_block;
    Q3KLayout => q3k_block;
    Q4KLayout => q45k_block::<false>;
    Q5KLayout => q45k_block::<true>;
    Q6KLayout => q6k_block;
    Iq4XsLayout => iq4xs_block;
}

/// Signed levels with one scale for all 32 values and no offset.
fn scaled(lv: [i8; 32], a: f32) -> Block32 {
    scaled_halves(lv, [a; 2])
}

/// Signed levels with a scale per 16 values and no offset.
fn scaled_halves(lv: [i8; 32], a: [f32; 2]) -> Block32 {
    Block32 { lv, a, c: [0.0; 2] }
}

/// q5_0 (levels − 16) or q5_1 (`ONE`: levels, plus the min `m`).
#[inline(always)]
fn q5_block<const ONE: bool>(row: &[u8], b: usize) -> Block32 {
    let (bytes, qs) = if ONE { (24, 8) } else { (22, 6) };
    let blk = &row[bytes * b..bytes * (b + 1)];
    let nib = nibbles_split(&blk[qs..qs + 16]);
    let qh = u32::from_le_bytes(blk[qs - 4..qs].try_into().unwrap());
    let offset = if ONE { 0 } else { -16 };
    let mut lv = [0i8; 32];
    for j in 0..32 {
        lv[j] = ((nib[j] | ((((qh >> j) & 1) as u8) << 4)) as i8).wrapping_add(offset);
    }
    let c = if ONE { f16_at(blk, 2) } else { 0.0 };
    Block32 {
        lv,
        a: [f16_at(blk, 0); 2],
        c: [c; 2],
    }
}

#[inline(always)]
fn iq4nl_block(row: &[u8], b: usize) -> Block32 {
    let blk = &row[18 * b..18 * (b + 1)];
    let nib = nibbles_split(&blk[2..18]);
    scaled(
        std::array::from_fn(|j| IQ4_LEVELS[nib[j] as usize]),
        f16_at(blk, 0),
    )
}

/// The super-block of block `b`, and `b`'s sub-block index in it.
#[inline(always)]
fn super_block(row: &[u8], b: usize, bytes: usize) -> (&[u8], usize) {
    (&row[bytes * (b / 8)..bytes * (b / 8 + 1)], b % 8)
}

/// The 2-bit levels of sub-block `j` (0..8) of q2_k and q3_k, from their 64 bytes of quants:
/// bits `2·(j % 4)` of bytes `32·(j / 4) ..` (their sub-blocks' scales are numbered `2·j`,
/// `2·j + 1`, and q3_k's high bits are bit `j` of its `hmask`).
#[inline(always)]
fn two_bit_levels(quants: &[u8], j: usize) -> [u8; 32] {
    let (n, k) = (j / 4, j % 4);
    let qs: &[u8; 32] = quants[32 * n..][..32].try_into().unwrap();
    std::array::from_fn(|l| (qs[l] >> (2 * k)) & 3)
}

#[inline(always)]
fn q45k_block<const FIVE: bool>(row: &[u8], b: usize) -> Block32 {
    let (blk, j) = super_block(row, b, if FIVE { 176 } else { 144 });
    let (sc, mn) = k4_scales(&blk[4..16]);
    let qs = if FIVE { 48 } else { 16 } + 32 * (j / 2);
    let bytes: &[u8; 32] = blk[qs..qs + 32].try_into().unwrap();
    let shift = 4 * (j % 2);
    let mut lv = [0i8; 32];
    for l in 0..32 {
        lv[l] = ((bytes[l] >> shift) & 0xF) as i8;
    }
    if FIVE {
        let qh: &[u8; 32] = blk[16..48].try_into().unwrap();
        for l in 0..32 {
            lv[l] |= (((qh[l] >> j) & 1) << 4) as i8;
        }
    }
    let a = f16_at(blk, 0) * sc[j] as f32;
    let c = -(f16_at(blk, 2) * mn[j] as f32);
    Block32 {
        lv,
        a: [a; 2],
        c: [c; 2],
    }
}

#[inline(always)]
fn q6k_block(row: &[u8], b: usize) -> Block32 {
    let (blk, j) = super_block(row, b, 210);
    let (n, k) = (j / 4, j % 4);
    let ql: &[u8; 32] = blk[64 * n + 32 * (k & 1)..][..32].try_into().unwrap();
    let qh: &[u8; 32] = blk[128 + 32 * n..][..32].try_into().unwrap();
    let shift = if k < 2 { 0 } else { 4 };
    let mut lv = [0i8; 32];
    for l in 0..32 {
        let high = ((qh[l] >> (2 * k)) & 3) << 4;
        lv[l] = ((((ql[l] >> shift) & 0xF) | high) as i8).wrapping_sub(32);
    }
    let d = f16_at(blk, 208);
    let a = |g: usize| d * blk[192 + 8 * n + 2 * k + g] as i8 as f32;
    scaled_halves(lv, [a(0), a(1)])
}

#[inline(always)]
fn q3k_block(row: &[u8], b: usize) -> Block32 {
    let (blk, j) = super_block(row, b, 110);
    let low = two_bit_levels(&blk[32..96], j);
    // Sub-block j's high bits are bit j of the 32 bytes of `hmask`.
    let hm: &[u8; 32] = blk[..32].try_into().unwrap();
    let mut lv = [0i8; 32];
    for l in 0..32 {
        let high = ((hm[l] >> j) & 1) << 2;
        lv[l] = ((low[l] | high) as i8).wrapping_sub(4);
    }
    let d = f16_at(blk, 108);
    let a = |g: usize| d * q3k_scale(2 * j + g, &blk[96..108]) as f32;
    scaled_halves(lv, [a(0), a(1)])
}

#[inline(always)]
fn q2k_block(row: &[u8], b: usize) -> Block32 {
    let (blk, j) = super_block(row, b, 84);
    let lv = two_bit_levels(&blk[16..80], j).map(|l| l as i8);
    let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
    let sc = |g: usize| blk[2 * j + g];
    Block32 {
        lv,
        a: [d * (sc(0) & 0xF) as f32, d * (sc(1) & 0xF) as f32],
        c: [-(dmin * (sc(0) >> 4) as f32), -(dmin * (sc(1) >> 4) as f32)],
    }
}

#[inline(always)]
fn iq4xs_block(row: &[u8], b: usize) -> Block32 {
    let (blk, j) = super_block(row, b, 136);
    let nib = nibbles_split(&blk[8 + 16 * j..24 + 16 * j]);
    let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
    let a = f16_at(blk, 0) * iq4xs_scale(j, scales_h, &blk[4..8]) as f32;
    scaled(std::array::from_fn(|l| IQ4_LEVELS[nib[l] as usize]), a)
}

/// The 32 nibbles of 16 bytes as q4_0 packs them: low nibbles first, then high.
#[inline(always)]
fn nibbles_split(qs: &[u8]) -> [u8; 32] {
    let qs: &[u8; 16] = qs.try_into().unwrap();
    let mut out = [0u8; 32];
    for j in 0..16 {
        out[j] = qs[j] & 0xF;
        out[j + 16] = qs[j] >> 4;
    }
    out
}

/// The plain-Rust kernels over [`Block32`]: integer sums per 16 values (loops shaped for
/// LLVM's vectoriser), and the decoder used for prefill rows and embedding lookups.
pub(crate) mod portable {
    use super::*;

    /// Σ lv·q over 16 values.
    #[inline(always)]
    fn isum16(lv: &[i8], q: &[i8]) -> i32 {
        let lv: &[i8; 16] = lv.try_into().unwrap();
        let q: &[i8; 16] = q.try_into().unwrap();
        let mut s = 0i32;
        for i in 0..16 {
            s += lv[i] as i32 * q[i] as i32;
        }
        s
    }

    #[inline(always)]
    fn dot_blocks<L: Layout>(row: &[u8], x: ActRow<'_>) -> f32 {
        let mut sum = 0f32;
        for b in 0..x.d.len() {
            let blk = L::block(row, b);
            let q = &x.q[32 * b..32 * b + 32];
            for g in 0..2 {
                let i = isum16(&blk.lv[16 * g..16 * g + 16], &q[16 * g..16 * g + 16]);
                sum += blk.a[g] * x.d[b] * i as f32 + blk.c[g] * x.s16[2 * b + g];
            }
        }
        sum
    }

    #[inline(always)]
    fn dequantize_blocks<L: Layout>(row: &[u8], out: &mut [f32]) {
        for (b, o) in out.chunks_exact_mut(32).enumerate() {
            let blk = L::block(row, b);
            for (j, o) in o.iter_mut().enumerate() {
                *o = blk.a[j / 16] * blk.lv[j] as f32 + blk.c[j / 16];
            }
        }
    }

    /// `$f::<Layout>($args)` for `dtype`'s layout.
    macro_rules! per_dtype {
        ($dtype:expr, $f:ident($($arg:expr),*)) => {
            match $dtype {
                DType::Q5_0 => $f::<Q5_0Layout>($($arg),*),
                DType::Q5_1 => $f::<Q5_1Layout>($($arg),*),
                DType::Iq4Nl => $f::<Iq4NlLayout>($($arg),*),
                DType::Q2K => $f::<Q2KLayout>($($arg),*),
                DType::Q3K => $f::<Q3KLayout>($($arg),*),
                DType::Q4K => $f::<Q4KLayout>($($arg),*),
                DType::Q5K => $f::<Q5KLayout>($($arg),*),
                DType::Q6K => $f::<Q6KLayout>($($arg),*),
                DType::Iq4Xs => $f::<Iq4XsLayout>($($arg),*),
                other => unreachable!("{other} is not a dtype of this module"),
            }
        };
    }

    /// (Inlined into the multiversioned callers, so each target's clone vectorises it for its
    /// own instruction set.)
    #[inline(always)]
    pub(crate) fn dot(dtype: DType, row: &[u8], x: ActRow<'_>) -> f32 {
        per_dtype!(dtype, dot_blocks(row, x))
    }

    /// Decodes one weight row (whole blocks) into `out`, bit for bit as
    /// `weights_format::quant::dequantize` does. (Inlined like [`dot`].)
    #[inline(always)]
    pub(crate) fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) {
        per_dtype!(dtype, dequantize_blocks(row, out))
    }
}

/// The AVX2 kernels: the levels of 32 values are formed in one register, `maddubs` multiplies
/// them with the activations and adds pairs (16 × i16), `madd` applies the integer sub-block
/// scales and adds pairs again (8 × i32, lanes 0–3 the first 16 values, 4–7 the next). A
/// super-block's products, offsets and mins (the latter two through the activations' per-16
/// sums) add up as integers and one FMA applies `d_weight · d_activation`; the 32-value dtypes
/// take one FMA per block, as their activations have a scale per block. Loads go through `bytemuck` (arrays to
/// vectors), so nothing here is `unsafe`: the intrinsics are safe inside functions compiled
/// with the features they need.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::*;

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn load256(s: &[u8]) -> __m256i {
        let a: [u8; 32] = s[..32].try_into().unwrap();
        bytemuck::cast(a)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn load256_i8(s: &[i8]) -> __m256i {
        let a: [i8; 32] = s[..32].try_into().unwrap();
        bytemuck::cast(a)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn load128(s: &[u8]) -> __m128i {
        let a: [u8; 16] = s[..16].try_into().unwrap();
        bytemuck::cast(a)
    }

    /// `acc + f · Σ_pairs sc16 · (Σ_pairs lv · q)`: 32 unsigned levels (≤ 63) times 32
    /// activations, each 16-bit lane pair scaled by `sc16` (the 32-value dtypes, whose
    /// activations have a scale per 32 values: one FMA per block).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn step(acc: __m256, lv: __m256i, q: __m256i, sc16: __m256i, f: f32) -> __m256 {
        scale_add(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(lv, q), sc16), f)
    }

    /// [`step`] for signed levels (the iq4 tables): |lv| times q with lv's sign.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn step_signed(acc: __m256, lv: __m256i, q: __m256i, sc16: __m256i, f: f32) -> __m256 {
        step(
            acc,
            _mm256_sign_epi8(lv, lv),
            _mm256_sign_epi8(q, lv),
            sc16,
            f,
        )
    }

    /// i16 scale `a` for the first 16 values, `b` for the next 16.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn halves(a: i16, b: i16) -> __m256i {
        _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a))
    }

    /// Byte j is 0xFF when bit j of `bits` is set.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn bytes_from_bits(bits: u32) -> __m256i {
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        // Set every bit but bit (j % 8) of byte j: all ones exactly when that bit was set.
        let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
        _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1))
    }

    /// The 32 nibbles of 16 bytes, low nibbles first (values 0–15), then high (16–31).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn nibbles_split(qs: &[u8]) -> __m256i {
        let v = load128(qs);
        let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
        _mm256_and_si256(both, _mm256_set1_epi8(0xF))
    }

    /// `acc + f · (the eight i32 lanes of v)`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn scale_add(acc: __m256, v: __m256i, f: f32) -> __m256 {
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(f), acc)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// How far ahead of the block being computed the weights are prefetched: the rows of a
    /// matrix lie one after the other, so this runs on into the next rows (a row is often only
    /// a few super-blocks). The hardware prefetcher alone left the kernels at about half of a
    /// core's streaming bandwidth.
    const PREFETCH_AHEAD: usize = 2048;

    /// Prefetches the cache lines `PREFETCH_AHEAD` bytes past those of `blk` (a hint: an
    /// address past the end of the weights is never touched, prefetches do not fault).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn prefetch_ahead(blk: &[u8]) {
        let start = blk.as_ptr().wrapping_add(PREFETCH_AHEAD);
        for line in (0..blk.len()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line) as *const i8);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn iq4_table() -> __m256i {
        let t: __m128i = bytemuck::cast(IQ4_LEVELS);
        _mm256_set_m128i(t, t)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot(dtype: DType, row: &[u8], x: ActRow<'_>) -> f32 {
        let mut acc = _mm256_setzero_ps();
        // The offset and min terms: Σ (per 16 or 32 values) coefficient · d·Σq.
        let mut offsets = 0f32;
        let ones = _mm256_set1_epi16(1);
        let low2 = _mm256_set1_epi8(3);
        let bit = _mm256_set1_epi8(1);
        // q2_k's and q3_k's 2-bit levels of sub-block 4·n + k: bits 2k of their n-th 32 bytes.
        let two_bits = |qs: __m256i, k: usize| {
            _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * k as i32)), low2)
        };
        let qx = |b: usize| load256_i8(&x.q[32 * b..32 * b + 32]);
        let s32 = |b: usize| x.s16[2 * b] + x.s16[2 * b + 1];
        // The 16 per-16-value Σq of super-block sb (activations with one scale per 256).
        let bsums = |sb: usize| -> __m256i {
            let a: [i16; 16] = x.bsums[16 * sb..16 * sb + 16].try_into().unwrap();
            bytemuck::cast(a)
        };
        match dtype {
            DType::Q5_0 | DType::Q5_1 => {
                let (bb, qs) = if dtype == DType::Q5_0 {
                    (22, 6)
                } else {
                    (24, 8)
                };
                for (b, blk) in row.chunks_exact(bb).enumerate() {
                    prefetch_ahead(blk);
                    let d = f16_at(blk, 0);
                    let qh = u32::from_le_bytes(blk[qs - 4..qs].try_into().unwrap());
                    let high = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(16));
                    let lv = _mm256_or_si256(nibbles_split(&blk[qs..qs + 16]), high);
                    if dtype == DType::Q5_0 {
                        // The levels less their 16 as signed bytes, so that the integer sum is
                        // the block's whole product: adding `−16·d·Σx` in f32 afterwards
                        // cancelled two sums ~16× the result, and on Gemma 3 270M that
                        // rounding moved logits by tenths (as llama.cpp's kernel, no offset).
                        let signed = _mm256_sub_epi8(lv, _mm256_set1_epi8(16));
                        acc = step_signed(acc, signed, qx(b), ones, d * x.d[b]);
                    } else {
                        acc = step(acc, lv, qx(b), ones, d * x.d[b]);
                        offsets += f16_at(blk, 2) * s32(b);
                    }
                }
            }
            DType::Iq4Nl => {
                let table = iq4_table();
                for (b, blk) in row.chunks_exact(18).enumerate() {
                    prefetch_ahead(blk);
                    let lv = _mm256_shuffle_epi8(table, nibbles_split(&blk[2..18]));
                    acc = step_signed(acc, lv, qx(b), ones, f16_at(blk, 0) * x.d[b]);
                }
            }
            DType::Iq4Xs => {
                let table = iq4_table();
                for (sb, blk) in row.chunks_exact(136).enumerate() {
                    prefetch_ahead(blk);
                    let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
                    let mut sumi = _mm256_setzero_si256();
                    for j in 0..8 {
                        let lv = _mm256_shuffle_epi8(table, nibbles_split(&blk[8 + 16 * j..]));
                        let q = qx(8 * sb + j);
                        let s = _mm256_set1_epi16(iq4xs_scale(j, scales_h, &blk[4..8]) as i16);
                        let p =
                            _mm256_maddubs_epi16(_mm256_sign_epi8(lv, lv), _mm256_sign_epi8(q, lv));
                        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
                    }
                    acc = scale_add(acc, sumi, f16_at(blk, 0) * x.d[8 * sb]);
                }
            }
            DType::Q4K => return q45k::<false>(row, x),
            DType::Q5K => return q45k::<true>(row, x),
            DType::Q6K => return q6k(row, x),
            DType::Q3K => {
                for (sb, blk) in row.chunks_exact(110).enumerate() {
                    prefetch_ahead(blk);
                    let sc: [i16; 16] = std::array::from_fn(|i| q3k_scale(i, &blk[96..108]) as i16);
                    let hm = load256(&blk[0..32]);
                    let mut sumi = _mm256_setzero_si256();
                    for n in 0..2 {
                        let qs = load256(&blk[32 + 32 * n..]);
                        for k in 0..4 {
                            let q2 = two_bits(qs, k);
                            let hshift = _mm_cvtsi32_si128((4 * n + k) as i32);
                            let h = _mm256_and_si256(_mm256_srl_epi16(hm, hshift), bit);
                            let lv = _mm256_or_si256(q2, _mm256_slli_epi16(h, 2));
                            let g = 8 * n + 2 * k;
                            let p = _mm256_maddubs_epi16(lv, qx(8 * sb + 4 * n + k));
                            sumi = _mm256_add_epi32(
                                sumi,
                                _mm256_madd_epi16(p, halves(sc[g], sc[g + 1])),
                            );
                        }
                    }
                    // Levels are stored + 4: subtract 4·Σ_g sc[g]·Σq over group g.
                    let offset = _mm256_madd_epi16(bsums(sb), bytemuck::cast(sc));
                    sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 2));
                    acc = scale_add(acc, sumi, f16_at(blk, 108) * x.d[8 * sb]);
                }
            }
            DType::Q2K => {
                for (sb, blk) in row.chunks_exact(84).enumerate() {
                    prefetch_ahead(blk);
                    let mut sumi = _mm256_setzero_si256();
                    for n in 0..2 {
                        let qs = load256(&blk[16 + 32 * n..]);
                        for k in 0..4 {
                            let lv = two_bits(qs, k);
                            let g = 8 * n + 2 * k;
                            let s = halves((blk[g] & 0xF) as i16, (blk[g + 1] & 0xF) as i16);
                            let p = _mm256_maddubs_epi16(lv, qx(8 * sb + 4 * n + k));
                            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
                        }
                    }
                    let dx = x.d[8 * sb];
                    acc = scale_add(acc, sumi, f16_at(blk, 80) * dx);
                    // The mins, the high nibbles of the 16 scale bytes, times each group's Σq.
                    let mins =
                        _mm_and_si128(_mm_srli_epi16(load128(&blk[..16]), 4), _mm_set1_epi8(0xF));
                    let m = _mm256_madd_epi16(bsums(sb), _mm256_cvtepu8_epi16(mins));
                    acc = scale_add(acc, m, -(f16_at(blk, 82) * dx));
                }
            }
            other => unreachable!("{other} is not handled here"),
        }
        if dtype == DType::Q5_0 {
            // Exactly the lanes' sum, as `int8`'s eight-row q5_0 kernel gives it.
            return hsum(acc);
        }
        hsum(acc) + offsets
    }

    /// The 16 per-16-value Σq of super-block `sb` (activations with one scale per 256).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn bsums256(x: &ActRow<'_>, sb: usize) -> __m256i {
        let a: [i16; 16] = x.bsums[16 * sb..16 * sb + 16].try_into().unwrap();
        bytemuck::cast(a)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q45k<const FIVE: bool>(row: &[u8], x: ActRow<'_>) -> f32 {
        q45k_rows::<FIVE, 1>(row, [x])[0]
    }

    /// `row` against `R` activation rows: each super-block's scales and levels unpacked once
    /// for all of them, and for each row the same operations in the same order as for that
    /// row alone (`R = 1`, [`q45k`]), so the same bits whatever `R`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q45k_rows<const FIVE: bool, const R: usize>(row: &[u8], xs: [ActRow<'_>; R]) -> [f32; R] {
        let (bb, qs) = if FIVE { (176, 48) } else { (144, 16) };
        let (low4, bit) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(1));
        let mut acc = [_mm256_setzero_ps(); R];
        for (sb, blk) in row.chunks_exact(bb).enumerate() {
            prefetch_ahead(blk);
            let (sc, mn) = k4_scales(&blk[4..16]);
            let qh = if FIVE {
                load256(&blk[16..48])
            } else {
                _mm256_setzero_si256()
            };
            let mut sumi = [_mm256_setzero_si256(); R];
            for c in 0..4 {
                let bits = load256(&blk[qs + 32 * c..]);
                let mut lv = [
                    _mm256_and_si256(bits, low4),
                    _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4),
                ];
                if FIVE {
                    // Bits 2c and 2c+1 of qh[l] as 16.
                    let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32));
                    lv[0] = _mm256_or_si256(lv[0], _mm256_slli_epi16(_mm256_and_si256(h, bit), 4));
                    let h1 = _mm256_and_si256(_mm256_srli_epi16(h, 1), bit);
                    lv[1] = _mm256_or_si256(lv[1], _mm256_slli_epi16(h1, 4));
                }
                for (half, lv) in lv.into_iter().enumerate() {
                    let j = 2 * c + half;
                    let s = _mm256_set1_epi16(sc[j] as i16);
                    for (sumi, x) in sumi.iter_mut().zip(&xs) {
                        let p = _mm256_maddubs_epi16(lv, load256_i8(&x.q[256 * sb + 32 * j..]));
                        *sumi = _mm256_add_epi32(*sumi, _mm256_madd_epi16(p, s));
                    }
                }
            }
            let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
            for ((acc, sumi), x) in acc.iter_mut().zip(sumi).zip(&xs) {
                let dx = x.d[8 * sb];
                *acc = scale_add(*acc, sumi, d * dx);
                *acc = scale_add(*acc, k4_mins(x, sb, mn), -(dmin * dx));
            }
        }
        acc.map(|a| hsum(a))
    }

    /// The mins of a q4_k/q5_k super-block times the activations: Σ_j mn[j]·Σq over sub-block
    /// j (two 16-value sums each), as eight i32 lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn k4_mins(x: &ActRow<'_>, sb: usize, mn: [u8; 8]) -> __m256i {
        let mins = _mm_set_epi64x(0, u64::from_le_bytes(mn) as i64);
        let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));
        _mm256_madd_epi16(bsums256(x, sb), mins)
    }

    /// The levels of a q6_k super-block are stored + 32: 32·Σ_g sc[g]·Σq over group g, to be
    /// subtracted, as eight i32 lanes (`sc16`: the 16 scales as i16).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q6k_offset(x: &ActRow<'_>, sb: usize, sc16: __m256i) -> __m256i {
        _mm256_slli_epi32(_mm256_madd_epi16(bsums256(x, sb), sc16), 5)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q6k(row: &[u8], x: ActRow<'_>) -> f32 {
        q6k_rows::<1>(row, [x])[0]
    }

    /// `row` against `R` activation rows, as [`q45k_rows`]: the same bits as each row alone.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q6k_rows<const R: usize>(row: &[u8], xs: [ActRow<'_>; R]) -> [f32; R] {
        let (low4, low2) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
        // Bytes 0-1 of each 32-bit lane in the low half, bytes 2-3 in the high half: a lane
        // holding two i16 scales becomes the first for values 0-15, the second for 16-31.
        let spread = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
            3, 2, 3,
        );
        let mut acc = [_mm256_setzero_ps(); R];
        for (sb, blk) in row.chunks_exact(210).enumerate() {
            prefetch_ahead(blk);
            // The scale first: the block's last bytes, often on a cache line of their own, so
            // their load starts before the levels' arithmetic needs the core.
            let d = f16_at(blk, 208);
            // The 16 scales as i16; pairs of them (groups 2j, 2j+1) spread over block j.
            let sc16 = _mm256_cvtepi8_epi16(load128(&blk[192..208]));
            let mut sumi = [_mm256_setzero_si256(); R];
            for n in 0..2 {
                let ql = [load256(&blk[64 * n..]), load256(&blk[64 * n + 32..])];
                let qh = load256(&blk[128 + 32 * n..]);
                for k in 0..4 {
                    let low = if k < 2 {
                        ql[k]
                    } else {
                        _mm256_srli_epi16(ql[k - 2], 4)
                    };
                    let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32));
                    let lv = _mm256_or_si256(
                        _mm256_and_si256(low, low4),
                        _mm256_slli_epi16(_mm256_and_si256(h, low2), 4),
                    );
                    let j = 4 * n + k;
                    let pair = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(j as i32));
                    let s = _mm256_shuffle_epi8(pair, spread);
                    for (sumi, x) in sumi.iter_mut().zip(&xs) {
                        let p = _mm256_maddubs_epi16(lv, load256_i8(&x.q[256 * sb + 32 * j..]));
                        *sumi = _mm256_add_epi32(*sumi, _mm256_madd_epi16(p, s));
                    }
                }
            }
            for ((acc, sumi), x) in acc.iter_mut().zip(sumi).zip(&xs) {
                let sumi = _mm256_sub_epi32(sumi, q6k_offset(x, sb, sc16));
                *acc = scale_add(*acc, sumi, d * x.d[8 * sb]);
            }
        }
        acc.map(|a| hsum(a))
    }

    /// `row` against four activation rows, for the dtypes [`rows4_handles`] lists: the same
    /// bits as [`dot`] of each row alone.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot4(dtype: DType, row: &[u8], xs: [ActRow<'_>; 4]) -> [f32; 4] {
        match dtype {
            DType::Q4K => q45k_rows::<false, 4>(row, xs),
            DType::Q5K => q45k_rows::<true, 4>(row, xs),
            DType::Q6K => q6k_rows::<4>(row, xs),
            other => unreachable!("{other} has no four-row kernel"),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// xorshift64: the test inputs of this module and of `int8`.
    pub(crate) struct Rng(pub(crate) u64);
    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Uniform in [-0.5, 0.5).
        pub(crate) fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        }
    }

    /// `rows` weight rows of `cols` values: random levels and scales, ordinary f16 fields.
    fn random_rows(dtype: DType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
        let blocks = rows * cols / dtype.block_len();
        gdsllm_convert::testing::random_blocks(dtype, blocks, rng.next())
    }

    /// The dtypes of this module.
    fn dtypes() -> impl Iterator<Item = DType> {
        DType::ALL.into_iter().filter(|d| handles(*d))
    }

    #[test]
    fn handles_the_quantized_dtypes_of_format_version_3() {
        let names: Vec<&str> = dtypes().map(DType::name).collect();
        assert_eq!(
            names,
            [
                "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"
            ]
        );
    }

    /// `(reference, bound, magnitude)` for the stored weight row `wr` and the f32 activations
    /// `x`: the f64 dot product, how far an 8-bit-activation kernel may be from it
    /// (`Σ_groups max|x_g|/254 · Σ|w_g|` over the activations' rounding groups of `group`
    /// values, plus f32 rounding: 1e-5 of `Σ|w·x|`), and `Σ|w·x|`.
    pub(crate) fn bound_of(dtype: DType, wr: &[u8], x: &[f32], group: usize) -> (f64, f64, f64) {
        let mut dense = vec![0f32; x.len()];
        weights_format::quant::dequantize(dtype, wr, &mut dense).unwrap();
        let magnitude: f64 = dense.iter().zip(x).map(|(a, b)| (a * b).abs() as f64).sum();
        let rounding: f64 = dense
            .chunks_exact(group)
            .zip(x.chunks_exact(group))
            .map(|(wb, xb)| {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
            })
            .sum();
        (
            reference_dot(dtype, wr, x),
            rounding * 1.001 + 1e-5 * magnitude,
            magnitude,
        )
    }

    #[test]
    fn dot_products_match_the_dequantize_then_f32_reference() {
        // The kernels (AVX2 where the CPU has it, and portable) compute the dot
        // product of the stored weights with the activations rounded to 8 bits per 32 values
        // (the 32-value dtypes) or per 256 (the super-block ones), |x − x̂| ≤ max|x|/254 per
        // block, so their distance to the f32 reference is at most Σ_blocks max|x|/254 · Σ|w|
        // (plus f32 rounding, bounded here by 1e-5 of Σ|w·x|). They differ from each other
        // only in the order of their f32 sums (tolerance 1e-5 of Σ|w·x̂|).
        let (rows, cols) = (24, 512);
        let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
        for dtype in dtypes() {
            let w = random_rows(dtype, rows, cols, &mut rng);
            // Activations of very different magnitudes from block to block, one row at a time.
            let x: Vec<f32> = (0..cols)
                .map(|i| rng.uniform() * if i % 96 < 32 { 4.0 } else { 0.25 })
                .collect();
            let mut xq = QuantizedActs::default();
            xq.prepare(&x, cols, dtype);
            // The activations' rounding granularity: 32 values, or 256 for super-blocks.
            let group = dtype.block_len();
            let row_bytes = w.len() / rows;
            let (mut worst_ref, mut worst_bound, mut worst_port) = (0f64, 0f64, 0f64);
            for wr in w.chunks_exact(row_bytes) {
                let (reference, bound, magnitude) = bound_of(dtype, wr, &x, group);
                let fast = dot(dtype, wr, xq.row(dtype, 0)) as f64;
                let port = portable::dot(dtype, wr, xq.row(dtype, 0)) as f64;
                assert!(
                    (fast - reference).abs() <= bound,
                    "{dtype}: fast {fast} reference {reference} bound {bound}"
                );
                assert!(
                    (fast - port).abs() <= 1e-5 * magnitude.max(1e-30),
                    "{dtype}: fast {fast} portable {port}"
                );
                let rel = |v: f64| v / magnitude.max(1e-30);
                worst_ref = worst_ref.max(rel((fast - reference).abs()));
                worst_bound = worst_bound.max((fast - reference).abs() / bound);
                worst_port = worst_port.max(rel((fast - port).abs()));
            }
            println!(
                "{dtype}: max |dot - reference| / Σ|w·x| = {worst_ref:.2e} ({:.0} % of the \
                 8-bit activation bound); |avx2 - portable| / Σ|w·x| = {worst_port:.1e}",
                worst_bound * 100.0
            );
        }
    }

    #[test]
    fn four_row_kernel_is_bit_for_bit_the_one_row_kernel() {
        // A prompt's rows of q4_k/q5_k/q6_k go four at a time through `dot4` and the rest one
        // at a time through `dot`: each row must come out the same either way (batch
        // invariance), so the check is on the bits, over rows of 1 and 3 super-blocks and
        // activation rows of very different magnitudes.
        let mut rng = Rng(0x1405_7B7E_F767_814F);
        for dtype in [DType::Q4K, DType::Q5K, DType::Q6K] {
            if !rows4_handles(dtype) {
                println!("{dtype}: no four-row kernel on this CPU");
                continue;
            }
            for cols in [256, 768] {
                let rows = 5;
                let w = random_rows(dtype, rows, cols, &mut rng);
                let x: Vec<f32> = (0..4 * cols)
                    .map(|i| rng.uniform() * if i % 320 < 64 { 8.0 } else { 0.125 })
                    .collect();
                let mut xq = QuantizedActs::default();
                xq.prepare(&x, cols, dtype);
                let acts = [0, 1, 2, 3].map(|r| xq.row(dtype, r));
                for (i, wr) in w.chunks_exact(w.len() / rows).enumerate() {
                    let four = dot4(dtype, wr, acts);
                    for (r, got) in four.into_iter().enumerate() {
                        let alone = dot(dtype, wr, acts[r]);
                        assert_eq!(
                            got.to_bits(),
                            alone.to_bits(),
                            "{dtype} {cols} cols, weight row {i}, activation row {r}: {got} {alone}"
                        );
                    }
                }
            }
            println!("{dtype}: dot4 = dot bit for bit");
        }
    }

    #[test]
    fn decoded_rows_are_bit_for_bit_the_reference_decoder() {
        let mut rng = Rng(77);
        for dtype in dtypes() {
            let w = random_rows(dtype, 3, 512, &mut rng);
            let mut ours = vec![0f32; 3 * 512];
            for (o, r) in ours.chunks_exact_mut(512).zip(w.chunks_exact(w.len() / 3)) {
                portable::dequantize_row(dtype, r, o);
            }
            let mut reference = vec![0f32; 3 * 512];
            weights_format::quant::dequantize(dtype, &w, &mut reference).unwrap();
            // == rather than bits: a zero may come out as -0.0 on one side.
            assert!(ours == reference, "{dtype}");
        }
    }

    #[test]
    fn activation_rounding_is_within_half_a_step() {
        let mut rng = Rng(3);
        let x: Vec<f32> = (0..512)
            .map(|i| rng.uniform() * (1 + i / 32) as f32)
            .collect();
        for dtype in [DType::Q5_0, DType::Q4K] {
            let mut xq = QuantizedActs::default();
            xq.prepare(&x, 512, dtype);
            let r = xq.row(dtype, 0);
            let group = dtype.block_len();
            for (g, xg) in x.chunks_exact(group).enumerate() {
                let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (j, v) in xg.iter().enumerate() {
                    let i = group * g + j;
                    let back = r.d[i / 32] * r.q[i] as f32;
                    assert!((v - back).abs() <= amax / 254.0 * 1.0001, "{v} vs {back}");
                }
            }
            for (s, q) in r.bsums.iter().zip(r.q.chunks_exact(16)) {
                assert_eq!(*s as i32, q.iter().map(|&v| v as i32).sum::<i32>());
            }
            for (i, s) in r.s16.iter().enumerate() {
                assert_eq!(*s, r.d[i / 2] * r.bsums[i] as f32);
            }
        }
    }

    #[test]
    fn k4_scale_words_match_the_reference_unpacking() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..1000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut packed = [0u8; 12];
            packed[..8].copy_from_slice(&state.to_le_bytes());
            packed[8..].copy_from_slice(&(state >> 17).to_le_bytes()[..4]);
            let (sc, mn) = k4_scales(&packed);
            for j in 0..8 {
                assert_eq!(
                    (sc[j], mn[j]),
                    weights_format::quant::k4_scale_min(j, &packed),
                    "{packed:?} sub-block {j}"
                );
            }
        }
    }
}
