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

/// Whether [`repack8`] and [`gemm8_packed`] take `dtype`: those of [`handles`] and q5_0, whose
/// 5-bit levels come out of the interleaved layout as q4_0's nibbles plus one bit each (the
/// layout keeps that bit where one shift and a mask put it in place), less 16 as signed bytes
/// and summed in the one-row kernel's order (see `tile_words`). q5_0 has no stored-layout
/// [`gemm8`] and no [`dot_rows`]: its rows left over take `kquants::dot`, which gives the same
/// bits.
pub(crate) fn packs8(dtype: DType) -> bool {
    handles(dtype) || dtype == DType::Q5_0
}

/// Whether [`gemm8`] computes any rows on this CPU (else it returns 0 and the rows go through
/// [`dot_rows`]).
pub(crate) fn has_gemm8() -> bool {
    super::kquants::has_avx2()
}

/// Where [`gemm8`] writes: the product of weight row `i` with activation row `c` goes to
/// `out_t[i · stride + columns[c]]`.
pub(crate) struct Columns<'a> {
    pub out_t: &'a mut [f32],
    pub stride: usize,
    pub columns: &'a [usize],
}

/// The weight rows of `w` (`row_bytes` each, whole blocks of `dtype`, one of [`handles`]) in
/// groups of eight against every activation row of `acts`, into `out` (see [`Columns`]).
/// Returns how many rows it computed (the whole groups of eight; none without AVX2), the
/// caller computes the rest with [`dot_rows`]. For prompts: one activation row alone is
/// faster through [`dot_rows`], which streams each weight row once without transposing.
///
/// Why eight rows at once (as ggml-cpu's repacked q4_0 8×8 kernels and its AMX path's VNNI
/// fallback lay them out): with the rows in the eight lanes of a vector, one integer multiply-
/// add of a weight vector with four broadcast activation bytes serves eight rows, and each
/// block's scales, offsets and conversions are one vector operation for the eight rows instead
/// of scalar work per row, and no horizontal sum remains. The rows are transposed as they are
/// read (so the stored layout stays the file's); a prompt's rows (more than four) reuse each
/// group's transposed blocks for all of them.
pub(crate) fn gemm8(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &[ActRow<'_>],
    out: Columns<'_>,
) -> usize {
    gemm8_layout(dtype, w, row_bytes, acts, out, false)
}

/// [`gemm8`] over weights in the interleaved layout [`repack8`] writes (whole groups of eight
/// rows interleaved, then the rows left over as stored): bit for bit the same results as
/// [`gemm8`] over the rows as stored, without transposing them as they are read. Returns the
/// rows it computed (the whole groups; none without AVX2); the caller computes the rows left
/// over, which are in the stored layout, with [`dot_rows`].
pub(crate) fn gemm8_packed(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &[ActRow<'_>],
    out: Columns<'_>,
) -> usize {
    gemm8_layout(dtype, w, row_bytes, acts, out, true)
}

#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c+avxvnni",
    "x86_64+avx2+fma+f16c"
))]
fn gemm8_layout(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &[ActRow<'_>],
    out: Columns<'_>,
    packed: bool,
) -> usize {
    match_target! {
        "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c" =>
            avx512vnni::gemm8(dtype, w, row_bytes, acts, out, packed),
        "x86_64+avx2+fma+f16c+avxvnni" => avxvnni::gemm8(dtype, w, row_bytes, acts, out, packed),
        "x86_64+avx2+fma+f16c" => avx2::gemm8(dtype, w, row_bytes, acts, out, packed),
        _ => {
            let _ = (dtype, w, row_bytes, acts, out, packed);
            0
        }
    }
}

/// Bytes at the start of one interleaved block of eight rows (see [`repack8`]) before their
/// levels: the eight f16 scales, and for q4_1 the eight f16 mins, for q5_0 the 32 bytes of the
/// eight rows' fifth bits.
fn packed_header(dtype: DType) -> usize {
    match dtype {
        DType::Q4_1 => 32,
        DType::Q5_0 => 48,
        _ => 16,
    }
}

/// The weight rows of `w` (`row_bytes` each, whole blocks of `dtype`, one of [`handles`]) with
/// each whole group of eight rows interleaved block by block, the layout [`gemm8_packed`]
/// reads (as ggml-cpu's repacked `block_q4_0x8` and its AMX path lay weights out for one
/// vector instruction to serve several rows). Block `b` of group `g` sits where the eight rows'
/// blocks `b` would be if the group's rows were stored block-interleaved, so a group takes
/// exactly the bytes of its eight rows and a range of whole groups keeps its offsets:
/// `[8 scales (f16)] [8 mins (f16), q4_1 only] [levels]`, the levels in 32-byte words `k`
/// whose four bytes `4r..4r+4` are bytes `4k..4k+4` of row `r`'s levels (q4_0/q4_1: 16 bytes
/// a row, two nibbles each, as stored; q8_0: 32). q5_0 is laid out as q4_0 with its fifth
/// bits `[32 bytes]` between the scales and the levels: bit `j` of byte `p` is the fifth bit of
/// the level that byte `p` of `Block8::v[j]` holds (row `p / 4`, value `4j + p % 4` of its 32),
/// so that one shift and one mask put the eight words' bits at bit 4 of their bytes. The rows
/// after the last whole group are copied as they are.
pub(crate) fn repack8(dtype: DType, w: &[u8], row_bytes: usize, out: &mut [u8]) {
    debug_assert!(packs8(dtype) && w.len() == out.len() && w.len().is_multiple_of(row_bytes));
    let bb = dtype.block_bytes();
    let (header, levels) = (
        packed_header(dtype),
        if dtype == DType::Q8_0 { 32 } else { 16 },
    );
    repack_groups::<8>(dtype, w, row_bytes, out, |blocks, packed| {
        for (r, blk) in blocks.iter().enumerate() {
            packed[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
            if dtype == DType::Q4_1 {
                packed[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]);
            }
            if dtype == DType::Q5_0 {
                let qh = u32::from_le_bytes(blk[2..6].try_into().unwrap());
                for i in 0..4 {
                    packed[16 + 4 * r + i] =
                        (0..8).fold(0u8, |h, j| h | ((((qh >> (4 * j + i)) & 1) as u8) << j));
                }
            }
            let qs = &blk[bb - levels..];
            for k in 0..levels / 4 {
                let at = header + 32 * k + 4 * r;
                packed[at..at + 4].copy_from_slice(&qs[4 * k..4 * k + 4]);
            }
        }
    });
}

/// Interleaves each whole group of `G` rows of `w` (`row_bytes` each, whole blocks of `dtype`)
/// into `out`, block by block: `pack` writes block `b` of the group's `G` rows into its
/// `G·block_bytes` bytes. The rows after the last whole group are copied as they are, and a
/// group takes exactly the bytes of its rows, so a range of whole groups keeps its offsets.
pub(crate) fn repack_groups<const G: usize>(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    out: &mut [u8],
    mut pack: impl FnMut(&[&[u8]; G], &mut [u8]),
) {
    let bb = dtype.block_bytes();
    let group_bytes = G * row_bytes;
    let groups = w.len() / group_bytes;
    for (src, dst) in w
        .chunks_exact(group_bytes)
        .zip(out.chunks_exact_mut(group_bytes))
    {
        for (b, packed) in dst.chunks_exact_mut(G * bb).enumerate() {
            let blocks: [&[u8]; G] = std::array::from_fn(|r| &src[r * row_bytes + b * bb..][..bb]);
            pack(&blocks, packed);
        }
    }
    let tail = groups * group_bytes;
    out[tail..].copy_from_slice(&w[tail..]);
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

/// Lane `r` of output `j` is 32-bit word `j` of the 16 bytes at `rows[r][at..]` (eight rows).
/// A macro, as is `f16_lanes!`, so that it expands inside the caller's `target_feature`
/// function: as functions (which cannot be `inline(always)` with target features) they stayed
/// out of line and handed their vectors back through the stack.
macro_rules! transpose_words {
    ($rows:expr, $at:expr) => {{
        let (rows, at): (&[&[u8]; 8], usize) = ($rows, $at);
        let y0 = _mm256_set_m128i(load128(&rows[4][at..]), load128(&rows[0][at..]));
        let y1 = _mm256_set_m128i(load128(&rows[5][at..]), load128(&rows[1][at..]));
        let y2 = _mm256_set_m128i(load128(&rows[6][at..]), load128(&rows[2][at..]));
        let y3 = _mm256_set_m128i(load128(&rows[7][at..]), load128(&rows[3][at..]));
        let t0 = _mm256_unpacklo_epi32(y0, y1);
        let t1 = _mm256_unpackhi_epi32(y0, y1);
        let t2 = _mm256_unpacklo_epi32(y2, y3);
        let t3 = _mm256_unpackhi_epi32(y2, y3);
        [
            _mm256_unpacklo_epi64(t0, t2),
            _mm256_unpackhi_epi64(t0, t2),
            _mm256_unpacklo_epi64(t1, t3),
            _mm256_unpackhi_epi64(t1, t3),
        ]
    }};
}

/// The f16 at `rows[r][at..]` of the eight rows, as f32 lanes (a macro: see
/// `transpose_words!`).
macro_rules! f16_lanes {
    ($rows:expr, $at:expr) => {{
        let (rows, at): (&[&[u8]; 8], usize) = ($rows, $at);
        let h = |r: usize| i16::from_le_bytes([rows[r][at], rows[r][at + 1]]);
        _mm256_cvtph_ps(_mm_setr_epi16(
            h(0),
            h(1),
            h(2),
            h(3),
            h(4),
            h(5),
            h(6),
            h(7),
        ))
    }};
}

/// One block of eight rows in the interleaved layout of [`repack8`] (`$dtype`, the block's
/// `8 · block_bytes` bytes `$blk`): the same `Block8` that `block8` builds from the eight rows,
/// by plain loads (a macro: see `transpose_words!`; as a function it stayed out of line and
/// handed its 256 bytes back through the stack).
macro_rules! block8_packed {
    ($dtype:expr, $blk:expr) => {{
        let (dtype, blk): (DType, &[u8]) = ($dtype, $blk);
        let d = _mm256_cvtph_ps(load128(blk));
        if dtype == DType::Q8_0 {
            Block8 {
                v: [
                    load256(&blk[16..]),
                    load256(&blk[48..]),
                    load256(&blk[80..]),
                    load256(&blk[112..]),
                    load256(&blk[144..]),
                    load256(&blk[176..]),
                    load256(&blk[208..]),
                    load256(&blk[240..]),
                ],
                d,
                m: _mm256_setzero_ps(),
            }
        } else if dtype == DType::Q5_0 {
            let low4 = _mm256_set1_epi8(0xF);
            let bit4 = _mm256_set1_epi8(0x10);
            let h = load256(&blk[16..]);
            let t = [
                load256(&blk[48..]),
                load256(&blk[80..]),
                load256(&blk[112..]),
                load256(&blk[144..]),
            ];
            // Word j's fifth bits are bit j of each byte of `h` (see `repack8`), moved to bit
            // 4: the shifts are of 16-bit lanes, but the mask keeps only bits that stayed in
            // their byte (a shift of at most 4).
            let low = |k: usize| _mm256_and_si256(t[k], low4);
            let high = |k: usize| _mm256_and_si256(_mm256_srli_epi16(t[k], 4), low4);
            // The levels less their 16, as signed bytes (the kernel sums them word by word).
            let sixteen = _mm256_set1_epi8(16);
            let level = |nibbles: __m256i, fifth: __m256i| {
                _mm256_sub_epi8(_mm256_or_si256(nibbles, fifth), sixteen)
            };
            Block8 {
                v: [
                    level(low(0), _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4)),
                    level(low(1), _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4)),
                    level(low(2), _mm256_and_si256(_mm256_slli_epi16(h, 2), bit4)),
                    level(low(3), _mm256_and_si256(_mm256_slli_epi16(h, 1), bit4)),
                    level(high(0), _mm256_and_si256(h, bit4)),
                    level(high(1), _mm256_and_si256(_mm256_srli_epi16(h, 1), bit4)),
                    level(high(2), _mm256_and_si256(_mm256_srli_epi16(h, 2), bit4)),
                    level(high(3), _mm256_and_si256(_mm256_srli_epi16(h, 3), bit4)),
                ],
                d,
                // No offset: the levels are signed.
                m: _mm256_setzero_ps(),
            }
        } else {
            let (qs, m) = if dtype == DType::Q4_1 {
                (32, _mm256_cvtph_ps(load128(&blk[16..])))
            } else {
                (16, _mm256_mul_ps(d, _mm256_set1_ps(-8.0)))
            };
            let low4 = _mm256_set1_epi8(0xF);
            let t = [
                load256(&blk[qs..]),
                load256(&blk[qs + 32..]),
                load256(&blk[qs + 64..]),
                load256(&blk[qs + 96..]),
            ];
            Block8 {
                v: [
                    _mm256_and_si256(t[0], low4),
                    _mm256_and_si256(t[1], low4),
                    _mm256_and_si256(t[2], low4),
                    _mm256_and_si256(t[3], low4),
                    _mm256_and_si256(_mm256_srli_epi16(t[0], 4), low4),
                    _mm256_and_si256(_mm256_srli_epi16(t[1], 4), low4),
                    _mm256_and_si256(_mm256_srli_epi16(t[2], 4), low4),
                    _mm256_and_si256(_mm256_srli_epi16(t[3], 4), low4),
                ],
                d,
                m,
            }
        }
    }};
}

/// The kinds of levels of `Block8::v`, a kernel's const parameter: unsigned, with an f32
/// offset per unit of the activations' `d·Σq` (q4_0's `−8·d`, q4_1's min) ...
#[cfg(target_arch = "x86_64")]
const OFFSET_F32: u8 = 0;
/// ... signed (q8_0; the sign moved onto the activations) ...
#[cfg(target_arch = "x86_64")]
const SIGNED: u8 = 1;
/// ... or signed and summed word by word (q5_0, its levels less 16: see `tile_words`).
#[cfg(target_arch = "x86_64")]
const WORDS: u8 = 2;

/// The x86 kernels for one instruction set, `mul_sum_add(acc, u, s)` being `acc` plus the eight
/// i32 sums of four products `u8 · i8` each.
macro_rules! x86_kernels {
    ($module:ident, $features:literal, |$acc:ident, $u:ident, $s:ident| $mul_sum_add:expr) => {
        #[cfg(target_arch = "x86_64")]
        mod $module {
            use std::arch::x86_64::*;

            use super::super::kquants::avx2::{
                hsum, load128, load256, load256_i8, nibbles_split, prefetch_ahead, scale_add,
            };
            use super::*;

            #[target_feature(enable = $features)]
            #[inline]
            fn mul_sum_add($acc: __m256i, $u: __m256i, $s: __m256i) -> __m256i {
                $mul_sum_add
            }

            #[target_feature(enable = $features)]
            #[inline]
            fn mul_sum(u: __m256i, s: __m256i) -> __m256i {
                mul_sum_add(_mm256_setzero_si256(), u, s)
            }

            /// A block's f16 scale and the f16 after it (q4_1's min) as f32, by F16C.
            #[target_feature(enable = $features)]
            #[inline]
            fn two_f16(blk: &[u8]) -> (f32, f32) {
                let bits = u32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
                let h = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
                (_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_movehdup_ps(h)))
            }

            /// One q4_1 (`MIN`) or q4_0 block: `acc + d·dx · Σ lv·q`, and its offset term
            /// (q4_1's `m·d·Σq`, q4_0's `−8·d_w·d·Σq`, `dq` being the activations' `d·Σq`).
            #[target_feature(enable = $features)]
            #[inline]
            fn q4_block<const MIN: bool>(
                blk: &[u8],
                q: &[i8],
                dx: f32,
                dq: f32,
                acc: __m256,
            ) -> (__m256, f32) {
                let qs = if MIN { 4 } else { 2 };
                let (d, m) = two_f16(blk);
                let p = mul_sum(nibbles_split(&blk[qs..qs + 16]), load256_i8(q));
                let offset = if MIN { m * dq } else { -8.0 * d * dq };
                (scale_add(acc, p, d * dx), offset)
            }

            /// q4_1 (`MIN`) or q4_0, two blocks a step into two accumulators held in
            /// registers, so that the FMAs of consecutive blocks do not wait on each other
            /// (indexing an array of accumulators by the block's parity kept them on the
            /// stack, a store and a reload per block; the scales went through a software f16
            /// conversion: together a third of llama.cpp's one-thread decode speed).
            #[target_feature(enable = $features)]
            #[inline]
            fn q4<const MIN: bool>(row: &[u8], x: ActRow<'_>) -> f32 {
                let bb = if MIN { 20 } else { 18 };
                let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let (mut off0, mut off1) = (0f32, 0f32);
                let pairs = row.chunks_exact(2 * bb);
                let tail = pairs.remainder();
                let steps = pairs
                    .zip(x.q.chunks_exact(64))
                    .zip(x.d.chunks_exact(2).zip(x.s16.chunks_exact(4)));
                for ((blk, q), (dx, s16)) in steps {
                    prefetch_ahead(&blk[..1]);
                    let (b0, b1) = blk.split_at(bb);
                    let (a, o) = q4_block::<MIN>(b0, &q[..32], dx[0], s16[0] + s16[1], acc0);
                    acc0 = a;
                    off0 += o;
                    let (a, o) = q4_block::<MIN>(b1, &q[32..], dx[1], s16[2] + s16[3], acc1);
                    acc1 = a;
                    off1 += o;
                }
                if !tail.is_empty() {
                    let b = row.len() / bb - 1;
                    let dq = x.s16[2 * b] + x.s16[2 * b + 1];
                    let (a, o) = q4_block::<MIN>(tail, &x.q[32 * b..], x.d[b], dq, acc0);
                    acc0 = a;
                    off0 += o;
                }
                hsum(_mm256_add_ps(acc0, acc1)) + (off0 + off1)
            }

            /// One q8_0 block: the weights' signs move onto the activations
            /// (`|w| · sign(q, w)`).
            #[target_feature(enable = $features)]
            #[inline]
            fn q8_block(blk: &[u8], q: &[i8], dx: f32, acc: __m256) -> __m256 {
                let d = two_f16(blk).0;
                let w = load256(&blk[2..34]);
                let p = mul_sum(_mm256_sign_epi8(w, w), _mm256_sign_epi8(load256_i8(q), w));
                scale_add(acc, p, d * dx)
            }

            /// q8_0, two blocks a step as [`q4`].
            #[target_feature(enable = $features)]
            #[inline]
            fn q8(row: &[u8], x: ActRow<'_>) -> f32 {
                let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let pairs = row.chunks_exact(68);
                let tail = pairs.remainder();
                for ((blk, q), dx) in pairs.zip(x.q.chunks_exact(64)).zip(x.d.chunks_exact(2)) {
                    prefetch_ahead(&blk[..1]);
                    acc0 = q8_block(&blk[..34], &q[..32], dx[0], acc0);
                    acc1 = q8_block(&blk[34..], &q[32..], dx[1], acc1);
                }
                if !tail.is_empty() {
                    let b = row.len() / 34 - 1;
                    acc0 = q8_block(tail, &x.q[32 * b..], x.d[b], acc0);
                }
                hsum(_mm256_add_ps(acc0, acc1))
            }

            /// Block `b` of eight weight rows with the rows in the lanes: lane `r` of `v[k]`
            /// holds the four levels of row `r` that meet the activations' bytes `4k..4k+4`
            /// (unsigned for q4_0/q4_1, signed for q8_0); `d` the rows' scales, `m` their
            /// offset per unit of the activations' `d·Σq` (q4_1's min, q4_0's `−8·d`).
            #[derive(Clone, Copy)]
            pub(super) struct Block8 {
                v: [__m256i; 8],
                d: __m256,
                m: __m256,
            }

            /// Prefetches the cache line at byte `at` of each row of the next group of eight
            /// (the rows of a matrix lie one after the other, so the next group starts eight
            /// rows on): eight streams at once are more than the hardware prefetcher follows
            /// early enough, and the first loads of each block waited on memory. A hint: an
            /// address past the weights is never read.
            #[target_feature(enable = $features)]
            #[inline]
            fn prefetch_next_group(rows: &[&[u8]; 8], at: usize) {
                let ahead = 8 * rows[0].len() + at;
                for row in rows {
                    _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(ahead) as *const i8);
                }
            }

            #[target_feature(enable = $features)]
            #[inline]
            fn block8(dtype: DType, rows: &[&[u8]; 8], b: usize) -> Block8 {
                let at = b * dtype.block_bytes();
                let d = f16_lanes!(rows, at);
                if dtype == DType::Q8_0 {
                    let lo = transpose_words!(rows, at + 2);
                    let hi = transpose_words!(rows, at + 18);
                    return Block8 {
                        v: [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]],
                        d,
                        m: _mm256_setzero_ps(),
                    };
                }
                let (qs, m) = if dtype == DType::Q4_1 {
                    (4, f16_lanes!(rows, at + 2))
                } else {
                    (2, _mm256_mul_ps(d, _mm256_set1_ps(-8.0)))
                };
                let t = transpose_words!(rows, at + qs);
                let low4 = _mm256_set1_epi8(0xF);
                let (t0, t1, t2, t3) = (t[0], t[1], t[2], t[3]);
                Block8 {
                    v: [
                        _mm256_and_si256(t0, low4),
                        _mm256_and_si256(t1, low4),
                        _mm256_and_si256(t2, low4),
                        _mm256_and_si256(t3, low4),
                        _mm256_and_si256(_mm256_srli_epi16(t0, 4), low4),
                        _mm256_and_si256(_mm256_srli_epi16(t1, 4), low4),
                        _mm256_and_si256(_mm256_srli_epi16(t2, 4), low4),
                        _mm256_and_si256(_mm256_srli_epi16(t3, 4), low4),
                    ],
                    d,
                    m,
                }
            }

            /// Activation bytes `4k..4k+4` of a block's 32 `q`, in every lane (the four values
            /// word `k` of a `Block8` meets in each row).
            #[target_feature(enable = $features)]
            #[inline]
            fn word_lanes(q: &[i8], k: usize) -> __m256i {
                let word = [q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]];
                _mm256_set1_epi32(i32::from_le_bytes(word.map(|b| b as u8)))
            }

            /// `acc + Σ` of block `b` of eight rows with one activation row, per row (lane), for
            /// levels of the kind `L` ([`OFFSET_F32`] or [`SIGNED`]; [`WORDS`] is `tile_words`).
            #[target_feature(enable = $features)]
            #[inline]
            fn dot8<const L: u8>(blk: &Block8, x: &ActRow<'_>, b: usize, acc: __m256) -> __m256 {
                let q = &x.q[32 * b..32 * b + 32];
                let mut isum = _mm256_setzero_si256();
                for (k, v) in blk.v.iter().enumerate() {
                    let qk = word_lanes(q, k);
                    isum = if L == SIGNED {
                        mul_sum_add(isum, _mm256_sign_epi8(*v, *v), _mm256_sign_epi8(qk, *v))
                    } else {
                        mul_sum_add(isum, *v, qk)
                    };
                }
                let f = _mm256_mul_ps(blk.d, _mm256_set1_ps(x.d[b]));
                let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, acc);
                if L == OFFSET_F32 {
                    let dq = x.s16[2 * b] + x.s16[2 * b + 1];
                    _mm256_fmadd_ps(blk.m, _mm256_set1_ps(dq), acc)
                } else {
                    acc
                }
            }

            /// Where a tile reads its blocks: decoded from the rows as it goes, or decoded
            /// once before for many activation rows.
            #[derive(Clone, Copy)]
            enum Blocks<'a, 'r> {
                Rows(&'a [&'r [u8]; 8]),
                Decoded(&'a [Block8]),
                /// The group's bytes in the interleaved layout of [`repack8`].
                Packed(&'a [u8]),
            }

            /// Block `b` of the eight rows `src`.
            #[target_feature(enable = $features)]
            #[inline]
            fn block_of(dtype: DType, src: Blocks<'_, '_>, b: usize) -> Block8 {
                let bb = dtype.block_bytes();
                match src {
                    Blocks::Rows(rows) => {
                        if (b * bb) % 64 < bb {
                            prefetch_next_group(rows, b * bb);
                        }
                        block8(dtype, rows, b)
                    }
                    Blocks::Decoded(all) => all[b],
                    Blocks::Packed(group) => {
                        let at = b * 8 * bb;
                        prefetch_ahead(&group[at..at + 8 * bb]);
                        block8_packed!(dtype, &group[at..at + 8 * bb])
                    }
                }
            }

            /// [`tile`] for levels of the kind [`WORDS`] (q5_0): each of a block's eight words
            /// (four values of each row) summed into an accumulator of its own, and the eight
            /// added at the end in the order `kquants::avx2::hsum` adds a row's eight lanes,
            /// so that a row's result is bit for bit that of the one-row kernel
            /// `kquants::dot`, whose lane `k` holds the same four values' products.
            #[target_feature(enable = $features)]
            #[inline]
            fn tile_words<const T: usize>(
                dtype: DType,
                src: Blocks<'_, '_>,
                blocks: usize,
                acts: &[ActRow<'_>],
            ) -> [[f32; 8]; T] {
                let mut acc = [[_mm256_setzero_ps(); 8]; T];
                for b in 0..blocks {
                    let blk = block_of(dtype, src, b);
                    for (acc, x) in acc.iter_mut().zip(acts) {
                        let q = &x.q[32 * b..32 * b + 32];
                        let f = _mm256_mul_ps(blk.d, _mm256_set1_ps(x.d[b]));
                        for (k, (acc, v)) in acc.iter_mut().zip(&blk.v).enumerate() {
                            let qk = word_lanes(q, k);
                            let p = mul_sum(_mm256_sign_epi8(*v, *v), _mm256_sign_epi8(qk, *v));
                            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), f, *acc);
                        }
                    }
                }
                acc.map(|a| {
                    let low = _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6]));
                    let high = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
                    bytemuck::cast(_mm256_add_ps(low, high))
                })
            }

            /// Eight weight rows against `T` activation rows, block by block: the same
            /// operations in the same order for an activation row whichever tile it is in.
            #[target_feature(enable = $features)]
            #[inline]
            fn tile<const T: usize, const L: u8>(
                dtype: DType,
                src: Blocks<'_, '_>,
                blocks: usize,
                acts: &[ActRow<'_>],
            ) -> [[f32; 8]; T] {
                let mut acc = [_mm256_setzero_ps(); T];
                for b in 0..blocks {
                    let blk = block_of(dtype, src, b);
                    for c in 0..T {
                        acc[c] = dot8::<L>(&blk, &acts[c], b, acc[c]);
                    }
                }
                let mut sums = [[0f32; 8]; T];
                for c in 0..T {
                    sums[c] = bytemuck::cast(acc[c]);
                }
                sums
            }

            #[target_feature(enable = $features)]
            pub(super) fn gemm8(
                dtype: DType,
                w: &[u8],
                row_bytes: usize,
                acts: &[ActRow<'_>],
                out: Columns<'_>,
                packed: bool,
            ) -> usize {
                // q5_0 only interleaved (see `packs8`): its stored rows go to the row kernels.
                if !(if packed {
                    packs8(dtype)
                } else {
                    handles(dtype)
                }) {
                    return 0;
                }
                match dtype {
                    DType::Q8_0 => gemm8_of::<SIGNED>(dtype, w, row_bytes, acts, out, packed),
                    DType::Q5_0 => gemm8_of::<WORDS>(dtype, w, row_bytes, acts, out, packed),
                    _ => gemm8_of::<OFFSET_F32>(dtype, w, row_bytes, acts, out, packed),
                }
            }

            #[target_feature(enable = $features)]
            fn gemm8_of<const L: u8>(
                dtype: DType,
                w: &[u8],
                row_bytes: usize,
                acts: &[ActRow<'_>],
                out: Columns<'_>,
                packed: bool,
            ) -> usize {
                let n = acts.len();
                debug_assert_eq!(out.columns.len(), n);
                let blocks = row_bytes / dtype.block_bytes();
                let groups = w.len() / row_bytes / 8;
                let mut decoded = Vec::new();
                for g in 0..groups {
                    let rows: [&[u8]; 8] = std::array::from_fn(|r| {
                        &w[(8 * g + r) * row_bytes..(8 * g + r + 1) * row_bytes]
                    });
                    let group = &w[8 * g * row_bytes..8 * (g + 1) * row_bytes];
                    let src = if packed && n <= 4 {
                        Blocks::Packed(group)
                    } else if packed {
                        // Unpacked once for all the tiles of four rows (q5_0's fifth bits
                        // and the nibbles cost about what a tile row's products do).
                        decoded.clear();
                        let bb = 8 * dtype.block_bytes();
                        decoded.extend(group.chunks_exact(bb).map(|b| block8_packed!(dtype, b)));
                        Blocks::Decoded(&decoded)
                    } else if n <= 4 {
                        Blocks::Rows(&rows)
                    } else {
                        decoded.clear();
                        decoded.extend((0..blocks).map(|b| block8(dtype, &rows, b)));
                        Blocks::Decoded(&decoded)
                    };
                    for c0 in (0..n).step_by(4) {
                        let a = &acts[c0..n.min(c0 + 4)];
                        let sums: &[[f32; 8]] = match (L == WORDS, a.len()) {
                            (true, 1) => &tile_words::<1>(dtype, src, blocks, a),
                            (true, 2) => &tile_words::<2>(dtype, src, blocks, a),
                            (true, 3) => &tile_words::<3>(dtype, src, blocks, a),
                            (true, _) => &tile_words::<4>(dtype, src, blocks, a),
                            (false, 1) => &tile::<1, L>(dtype, src, blocks, a),
                            (false, 2) => &tile::<2, L>(dtype, src, blocks, a),
                            (false, 3) => &tile::<3, L>(dtype, src, blocks, a),
                            (false, _) => &tile::<4, L>(dtype, src, blocks, a),
                        };
                        for (c, lanes) in sums.iter().enumerate() {
                            let column = out.columns[c0 + c];
                            for (l, v) in lanes.iter().enumerate() {
                                out.out_t[(8 * g + l) * out.stride + column] = *v;
                            }
                        }
                    }
                }
                8 * groups
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

x86_kernels!(avx2, "avx2,fma,f16c", |acc, u, s| _mm256_add_epi32(
    acc,
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
));
x86_kernels!(avxvnni, "avx2,fma,f16c,avxvnni", |acc, u, s| {
    _mm256_dpbusd_avx_epi32(acc, u, s)
});
x86_kernels!(
    avx512vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |acc, u, s| _mm256_dpbusd_epi32(acc, u, s)
);

#[cfg(test)]
pub(crate) mod tests {
    use super::super::kquants::QuantizedActs;
    use super::super::kquants::tests::Rng;
    use super::*;

    /// `$list()`: `$kernel` of every instruction set this CPU runs, by name, after `$first`
    /// (the names printed, so that a test's output says which ran); each ISA's behind its own
    /// multiversioned entry point (the dispatch checks the CPU).
    macro_rules! variants_on_this_cpu {
        (
            fn $list:ident() for $kernel:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?,
            first: [$($first:expr),*]
        ) => {
            #[allow(clippy::type_complexity)]
            fn $list() -> Vec<(&'static str, fn($($ty),*) $(-> $ret)?)> {
                #[cfg(target_arch = "x86_64")]
                #[multiversion(targets("x86_64+avx2+fma+f16c"))]
                fn x86_avx2($($arg: $ty),*) $(-> $ret)? {
                    match_target! {
                        "x86_64+avx2+fma+f16c" => avx2::$kernel($($arg),*),
                        _ => {
                            let _ = ($($arg),*);
                            unreachable!("registered only where the CPU has AVX2")
                        }
                    }
                }

                #[cfg(target_arch = "x86_64")]
                #[multiversion(targets("x86_64+avx2+fma+f16c+avxvnni"))]
                fn x86_avxvnni($($arg: $ty),*) $(-> $ret)? {
                    match_target! {
                        "x86_64+avx2+fma+f16c+avxvnni" => avxvnni::$kernel($($arg),*),
                        _ => {
                            let _ = ($($arg),*);
                            unreachable!("registered only where the CPU has AVX-VNNI")
                        }
                    }
                }

                let mut v: Vec<(&'static str, fn($($ty),*) $(-> $ret)?)> = vec![$($first),*];
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx2") {
                        v.push(("avx2", x86_avx2));
                    }
                    if std::arch::is_x86_feature_detected!("avxvnni") {
                        v.push(("avxvnni", x86_avxvnni));
                    }
                }
                let names: Vec<&str> = v.iter().map(|v| v.0).collect();
                println!("{} variants: {names:?}", stringify!($kernel));
                v
            }
        };
    }

    variants_on_this_cpu! {
        fn variants() for dot_rows(
            dtype: DType, w: &[u8], rb: usize, x: ActRow<'_>, out: &mut [f32], st: usize
        ),
        first: [("portable", portable::dot_rows), ("dispatched", dot_rows)]
    }

    variants_on_this_cpu! {
        fn gemm8_variants() for gemm8(
            dtype: DType, w: &[u8], rb: usize, x: &[ActRow<'_>], out: Columns<'_>, packed: bool
        ) -> usize,
        first: [("dispatched", gemm8_layout)]
    }

    /// `rows` random weight rows of `cols` values of `dtype` and `n` activation rows whose
    /// magnitudes vary by block (one block in three 16× the others), in f32 and quantized as
    /// the kernels take them.
    fn random_case(
        rng: &mut Rng,
        dtype: DType,
        rows: usize,
        cols: usize,
        n: usize,
    ) -> (Vec<u8>, Vec<f32>, QuantizedActs) {
        let blocks = rows * cols / dtype.block_len();
        let w = gdsllm_convert::testing::random_blocks(dtype, blocks, rng.next());
        let x: Vec<f32> = (0..n * cols)
            .map(|i| rng.uniform() * if i % 96 < 32 { 4.0 } else { 0.25 })
            .collect();
        let mut xq = QuantizedActs::default();
        xq.prepare(&x, cols, dtype);
        (w, x, xq)
    }

    /// `(reference, bound, magnitude)` of [`kquants::tests::bound_of`] for the 32-value blocks
    /// these dtypes round their activations in.
    fn bound_of(dtype: DType, wr: &[u8], x: &[f32]) -> (f64, f64, f64) {
        super::super::kquants::tests::bound_of(dtype, wr, x, 32)
    }

    /// Checks that `gemm` (activation rows and where their results go in; how many weight rows
    /// it computed out, `done` of `rows`) gives each activation row of `acts` bit for bit what
    /// it gives that row alone when it comes with 1, 4 or 8 others, their results written into
    /// every other column of a table twice as wide, backwards. Returns the results of each
    /// activation row alone (`[activation row][weight row]`).
    pub(crate) fn check_alone_in_any_column(
        acts: &[ActRow<'_>],
        rows: usize,
        done: usize,
        what: &str,
        mut gemm: impl FnMut(&[ActRow<'_>], Columns<'_>) -> usize,
    ) -> Vec<Vec<f32>> {
        let mut alone = vec![vec![f32::NAN; rows]; acts.len()];
        for (c, a) in acts.iter().enumerate() {
            let out = Columns {
                out_t: &mut alone[c],
                stride: 1,
                columns: &[0],
            };
            assert_eq!(
                gemm(std::slice::from_ref(a), out),
                done,
                "{what}: whole groups"
            );
        }
        for n in [2, 5, 9].into_iter().filter(|&n| n <= acts.len()) {
            // Into every other column of a table twice as wide, backwards.
            let mut table = vec![f32::NAN; rows * 2 * n];
            let columns: Vec<usize> = (0..n).map(|c| 2 * (n - 1 - c)).collect();
            let out = Columns {
                out_t: &mut table,
                stride: 2 * n,
                columns: &columns,
            };
            gemm(&acts[..n], out);
            for i in 0..done {
                assert!((0..n).all(|c| table[i * 2 * n + 2 * c + 1].is_nan()));
                for c in 0..n {
                    assert_eq!(
                        table[i * 2 * n + columns[c]].to_bits(),
                        alone[c][i].to_bits(),
                        "{what}: row {i}, activation row {c} of {n}"
                    );
                }
            }
        }
        alone
    }

    #[test]
    fn eight_row_kernel_is_within_the_8_bit_bound_and_the_same_for_any_row_count() {
        // Each (weight row, activation row) against the f64 reference of the stored weights
        // and the f32 activations, within the 8-bit bound of the test below; the row kernel
        // `dot_rows` (a different f32 summation order) within 1e-5 of Σ|w·x|; and each
        // activation row's results bit for bit the same whether it comes alone (decoding) or
        // with 2, 5 or 9 others (prompts: the tiles of four and the decoded-once blocks).
        let (rows, cols) = (43, 512);
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let variants = gemm8_variants();
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let n_acts = 9;
            let (w, x, xq) = random_case(&mut rng, dtype, rows, cols, n_acts);
            let row_bytes = w.len() / rows;
            let acts: Vec<ActRow<'_>> = (0..n_acts).map(|r| xq.row(dtype, r)).collect();
            for (name, f) in &variants {
                let mut worst = 0f64;
                let what = format!("{dtype} {name}");
                let alone =
                    check_alone_in_any_column(&acts, rows, rows / 8 * 8, &what, |a, out| {
                        f(dtype, &w, row_bytes, a, out, false)
                    });
                for (c, xc) in x.chunks_exact(cols).enumerate() {
                    let mut by_row = vec![0f32; rows];
                    portable::dot_rows(dtype, &w, row_bytes, acts[c], &mut by_row, 1);
                    for (i, wr) in w.chunks_exact(row_bytes).take(rows / 8 * 8).enumerate() {
                        let (reference, bound, magnitude) = bound_of(dtype, wr, xc);
                        let got = alone[c][i] as f64;
                        assert!(
                            (got - reference).abs() <= bound,
                            "{dtype} {name} row {i} act {c}: {got} reference {reference} bound {bound}"
                        );
                        assert!(
                            (got - by_row[i] as f64).abs() <= 1e-5 * magnitude,
                            "{dtype} {name} row {i} act {c}: {got} row kernel {}",
                            by_row[i]
                        );
                        worst = worst.max((got - reference).abs() / bound);
                    }
                }
                println!(
                    "{dtype} gemm8 {name}: worst |dot − reference| is {:.0} % of the 8-bit bound",
                    worst * 100.0
                );
            }
        }
    }

    #[test]
    fn repacked_rows_give_the_stored_rows_results_bit_for_bit() {
        // `repack8` then `gemm8_packed` against `gemm8` over the rows as stored: the same
        // integer sums and the same f32 operations in the same order, so the same bits, for
        // every dtype, row counts with and without a tail (which both leave to `dot_rows`),
        // rows of 3 and 16 blocks, and 1 to 9 activation rows. Against the row kernel
        // `dot_rows` (another f32 summation order) within 1e-5 of Σ|w·x|, the error printed.
        let mut rng = Rng(0x5851_F42D_4C95_7F2D);
        let variants = gemm8_variants();
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            for (rows, cols) in [(8, 96), (21, 512), (43, 96), (5, 512)] {
                let n_acts = 9;
                let (w, x, xq) = random_case(&mut rng, dtype, rows, cols, n_acts);
                let row_bytes = w.len() / rows;
                let mut packed = vec![0u8; w.len()];
                repack8(dtype, &w, row_bytes, &mut packed);
                assert_eq!(
                    packed[rows / 8 * 8 * row_bytes..],
                    w[rows / 8 * 8 * row_bytes..],
                    "the rows after the last group stay as stored"
                );
                let acts: Vec<ActRow<'_>> = (0..n_acts).map(|r| xq.row(dtype, r)).collect();
                for (name, f) in &variants {
                    let mut worst = 0f64;
                    for n in [1, 2, 5, 9] {
                        let columns: Vec<usize> = (0..n).collect();
                        let mut plain = vec![f32::NAN; rows * n];
                        let mut from_packed = vec![f32::NAN; rows * n];
                        let out = |t| Columns {
                            out_t: t,
                            stride: n,
                            columns: &columns,
                        };
                        let a = &acts[..n];
                        let done = f(dtype, &w, row_bytes, a, out(&mut plain), false);
                        let done_packed =
                            f(dtype, &packed, row_bytes, a, out(&mut from_packed), true);
                        assert_eq!((done, done_packed), (rows / 8 * 8, rows / 8 * 8), "{name}");
                        for i in 0..done {
                            for c in 0..n {
                                let (p, q) = (from_packed[i * n + c], plain[i * n + c]);
                                assert_eq!(
                                    p.to_bits(),
                                    q.to_bits(),
                                    "{dtype} {name} {rows}x{cols}: row {i}, activation row {c} of {n}: {p} {q}"
                                );
                            }
                        }
                        for c in 0..n {
                            let mut by_row = vec![0f32; rows];
                            dot_rows(dtype, &w, row_bytes, acts[c], &mut by_row, 1);
                            let xc = &x[c * cols..(c + 1) * cols];
                            for (i, wr) in w.chunks_exact(row_bytes).take(done).enumerate() {
                                let magnitude = bound_of(dtype, wr, xc).2;
                                let err = (from_packed[i * n + c] - by_row[i]).abs() as f64;
                                assert!(err <= 1e-5 * magnitude, "{dtype} {name} row {i}: {err}");
                                worst = worst.max(err / magnitude);
                            }
                        }
                    }
                    println!(
                        "{dtype} {rows}x{cols} {name}: packed = stored bit for bit; worst |packed − dot_rows| is {worst:.1e} of Σ|w·x|"
                    );
                }
            }
        }
    }

    #[test]
    fn repacked_q5_0_rows_are_within_the_8_bit_bound_and_the_same_for_any_row_count() {
        // q5_0 has no stored-layout `gemm8`: its interleaved rows against the f64 reference
        // (the 8-bit bound), bit for bit the one-row kernel `kquants::dot` of the stored rows
        // (which the rows after the last group take: a matrix's rows must not depend on which
        // kernel took them), and each activation row bit for bit the same alone or with 2, 5 or
        // 9 others; rows with and without a tail (left to the caller), rows of 3 and 20 blocks.
        // Random blocks set every fifth bit pattern, so a bit put in the wrong lane or word
        // shows as an error far past the bound.
        let mut rng = Rng(0xD1B5_4A32_D192_ED03);
        let variants = gemm8_variants();
        let dtype = DType::Q5_0;
        for (rows, cols) in [(8, 96), (21, 640), (43, 96)] {
            let n_acts = 9;
            let (w, x, xq) = random_case(&mut rng, dtype, rows, cols, n_acts);
            let row_bytes = w.len() / rows;
            let mut packed = vec![0u8; w.len()];
            repack8(dtype, &w, row_bytes, &mut packed);
            let done = rows / 8 * 8;
            assert_eq!(packed[done * row_bytes..], w[done * row_bytes..]);
            let acts: Vec<ActRow<'_>> = (0..n_acts).map(|r| xq.row(dtype, r)).collect();
            for (name, f) in &variants {
                let what = format!("q5_0 {rows}x{cols} {name}");
                let mut unpacked = vec![f32::NAN; rows];
                let columns = [0];
                let out = Columns {
                    out_t: &mut unpacked,
                    stride: 1,
                    columns: &columns,
                };
                assert_eq!(f(dtype, &w, row_bytes, &acts[..1], out, false), 0, "{what}");
                let alone = check_alone_in_any_column(&acts, rows, done, &what, |a, out| {
                    f(dtype, &packed, row_bytes, a, out, true)
                });
                let mut worst_bound = 0f64;
                for (c, xc) in x.chunks_exact(cols).enumerate() {
                    for (i, wr) in w.chunks_exact(row_bytes).take(done).enumerate() {
                        let (reference, bound, magnitude) = bound_of(dtype, wr, xc);
                        let got = alone[c][i] as f64;
                        assert!(
                            (got - reference).abs() <= bound,
                            "{what} row {i} act {c}: {got} reference {reference} bound {bound}"
                        );
                        let one_row = super::super::kquants::dot(dtype, wr, acts[c]);
                        assert_eq!(
                            alone[c][i].to_bits(),
                            one_row.to_bits(),
                            "{what} row {i} act {c}: {got} one-row kernel {one_row}"
                        );
                        let one_row = one_row as f64;
                        assert!((got - one_row).abs() <= 1e-5 * magnitude);
                        worst_bound = worst_bound.max((got - reference).abs() / bound);
                    }
                }
                println!(
                    "{what}: worst |dot − reference| {:.0} % of the 8-bit bound; = kquants::dot bit for bit",
                    worst_bound * 100.0
                );
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
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let (w, x, xq) = random_case(&mut rng, dtype, rows, cols, 1);
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
                let (reference, bound, magnitude) = bound_of(dtype, wr, &x);
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
