//! The AVX-512 VNNI kernels: sixteen weight rows interleaved block by block, one 512-bit
//! integer multiply-add (`vpdpbusd`) serving all sixteen rows, for q8_0, q4_0, q4_1, q5_0, q4_k
//! and q6_k weights against activations quantized to 8 bits ([`QuantizedActs`](super::kquants::QuantizedActs)).
//!
//! Why: the AVX2 kernels either dot one row at a time (a horizontal sum, scalar scale work and,
//! for q5_0 and the k-quants, several instructions to form each block's levels per row), or
//! serve eight rows with 256-bit vectors and, for q8_0, two sign instructions per multiply-add
//! (`maddubs` and `vpdpbusd` take unsigned weights). Here a block of sixteen rows is one 512-bit
//! vector per four activation bytes: lane `r` holds four levels of row `r`, the four activation
//! bytes are broadcast, and the block's scales and offsets are one vector operation for the
//! sixteen rows. The layouts are written once by [`repack16`] (as ggml-cpu's `repack.cpp` does
//! for its interleaved q4_0/q4_K types), each as long as the sixteen rows it replaces:
//!
//! - q8_0: `[16 d (f16)] [8 words]`, the levels stored `+ 128` (unsigned), `−128·d·Σq` added
//!   back with the activations' per-block `d·Σq`;
//! - q4_0, q4_1: `[16 d] [16 m, q4_1 only] [4 words]` (the nibbles as stored: low nibbles are
//!   values 0–15, high 16–31), q4_0's `−8`, q4_1's min through `d·Σq`;
//! - q5_0: `[16 d] [8 masks of 64 bits] [4 words]`: mask `j` has bit `4r + i` set when value
//!   `4j + i` of row `r` has its fifth bit (added to the nibbles with one masked byte add), −16
//!   through `d·Σq`;
//! - q4_k (per 256 values): `[16 d] [16 dmin] [3 words of the 12 packed scale bytes] [32 words]`,
//!   the scales unpacked for sixteen rows at once, the mins times the activations' per-32
//!   sums by `vpdpwssd`;
//! - q6_k: `[16 d] [4 words of the 16 scales] [32 words of ql] [16 words of qh]`.
//!
//! A "word" is 64 bytes: 4 bytes of each of the sixteen rows, bytes `4k..4k+4` of row `r`'s
//! field in lane `r` of word `k`. The rows after the last whole group of sixteen stay as stored
//! (the caller dots them with the row kernels).
//!
//! Results: each weight row's integer sums are exact, so a result is the dot product of the
//! stored weights with the 8-bit activations up to f32 rounding, as the AVX2 kernels' are
//! (their order of f32 operations differs: equal within ~1e-6 of Σ|w·x|, not bit for bit). An
//! activation row gets the same bits whether it comes alone or with others.
//!
//! Used where the CPU has AVX-512 F/BW/VL and VNNI ([`available`]); `GDSLLM_CPU_AVX512=0` turns
//! it off (the AVX2 kernels then run, as on a CPU without AVX-512), for comparisons.

use multiversion::multiversion;
use multiversion::target::match_target;
use weights_format::DType;

use super::int8::{Columns, repack_groups};
use super::kquants::ActRow;

/// Whether [`repack16`] and [`gemm16`] take `dtype`.
pub(crate) fn handles(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q4K | DType::Q6K
    )
}

/// Whether this CPU runs these kernels (AVX-512 F, BW, VL and VNNI, with the rest of what
/// `multiversion` asks of an AVX-512 target: Ice Lake's AVX-512 extensions), and
/// `GDSLLM_CPU_AVX512` is not `0`.
pub(crate) fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| cpu_has_avx512vnni() && !avx512_turned_off())
}

/// Whether `GDSLLM_CPU_AVX512=0` asks the CPU backend to leave its AVX-512 kernels (these and
/// the f16 tiles of `kernels`) unused, as on a CPU without AVX-512, for comparisons.
pub(crate) fn avx512_turned_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("GDSLLM_CPU_AVX512").is_ok_and(|v| v == "0"))
}

/// Whether the CPU has what the kernels need (whatever `GDSLLM_CPU_AVX512` says): whether
/// `multiversion` dispatches to the AVX-512 clone of [`gemm16`]'s entry point.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512vnni+avx2+fma+f16c"))]
pub(crate) fn cpu_has_avx512vnni() -> bool {
    match_target! {
        "x86_64+avx512f+avx512bw+avx512vl+avx512vnni+avx2+fma+f16c" => true,
        _ => false,
    }
}

/// Writes the interleaved fields of one block of sixteen rows.
struct Packer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Packer<'_> {
    /// The f16 at byte `field` of each row's block, side by side.
    fn halves(&mut self, blocks: &[&[u8]; 16], field: usize) {
        for (r, blk) in blocks.iter().enumerate() {
            self.out[self.at + 2 * r..self.at + 2 * r + 2].copy_from_slice(&blk[field..field + 2]);
        }
        self.at += 32;
    }

    /// The `len` bytes at `field` of each row's block (a multiple of 4) as `len / 4` words,
    /// each byte XOR `flip`.
    fn words(&mut self, blocks: &[&[u8]; 16], field: usize, len: usize, flip: u8) {
        for k in 0..len / 4 {
            for (r, blk) in blocks.iter().enumerate() {
                for i in 0..4 {
                    self.out[self.at + 64 * k + 4 * r + i] = blk[field + 4 * k + i] ^ flip;
                }
            }
        }
        self.at += 16 * len;
    }

    /// q5_0's fifth bits: mask `j` has bit `4r + i` = bit `4j + i` of row `r`'s `qh`.
    fn q5_masks(&mut self, blocks: &[&[u8]; 16]) {
        for j in 0..8 {
            let mut mask = 0u64;
            for (r, blk) in blocks.iter().enumerate() {
                let qh = u32::from_le_bytes(blk[2..6].try_into().unwrap());
                mask |= (((qh >> (4 * j)) & 0xF) as u64) << (4 * r);
            }
            self.out[self.at + 8 * j..self.at + 8 * j + 8].copy_from_slice(&mask.to_le_bytes());
        }
        self.at += 64;
    }
}

/// One block (of `dtype`) of sixteen rows, `blocks[r]` being row `r`'s, into `out` (sixteen
/// blocks' bytes) in the layout of the module doc.
fn pack_block(dtype: DType, blocks: &[&[u8]; 16], out: &mut [u8]) {
    let len = out.len();
    let mut p = Packer { out, at: 0 };
    match dtype {
        DType::Q8_0 => {
            p.halves(blocks, 0);
            p.words(blocks, 2, 32, 0x80);
        }
        DType::Q4_0 => {
            p.halves(blocks, 0);
            p.words(blocks, 2, 16, 0);
        }
        DType::Q4_1 => {
            p.halves(blocks, 0);
            p.halves(blocks, 2);
            p.words(blocks, 4, 16, 0);
        }
        DType::Q5_0 => {
            p.halves(blocks, 0);
            p.q5_masks(blocks);
            p.words(blocks, 6, 16, 0);
        }
        DType::Q4K => {
            p.halves(blocks, 0);
            p.halves(blocks, 2);
            p.words(blocks, 4, 12, 0);
            p.words(blocks, 16, 128, 0);
        }
        DType::Q6K => {
            p.halves(blocks, 208);
            p.words(blocks, 192, 16, 0);
            p.words(blocks, 0, 128, 0);
            p.words(blocks, 128, 64, 0);
        }
        other => unreachable!("{other} is not a dtype of the sixteen-row kernels"),
    }
    debug_assert_eq!(p.at, len);
}

/// The weight rows of `w` (`row_bytes` each, whole blocks of `dtype`, one of [`handles`]) with
/// each whole group of sixteen rows interleaved block by block (the module doc's layouts), the
/// rows after the last whole group copied as they are. A group takes exactly the bytes of its
/// sixteen rows, so a range of whole groups keeps its offsets.
pub(crate) fn repack16(dtype: DType, w: &[u8], row_bytes: usize, out: &mut [u8]) {
    debug_assert!(handles(dtype) && w.len() == out.len() && w.len().is_multiple_of(row_bytes));
    repack_groups::<16>(dtype, w, row_bytes, out, |blocks, packed| {
        pack_block(dtype, blocks, packed)
    });
}

/// The weight rows of `w` (in the layout of [`repack16`]; `row_bytes` each, whole blocks of
/// `dtype`) in groups of sixteen against every activation row of `acts`, into `out` (see
/// [`Columns`]). Returns how many rows it computed (the whole groups of sixteen; none where
/// [`available`] is false); the caller computes the rest, which are in the stored layout.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512vnni+avx2+fma+f16c"))]
pub(crate) fn gemm16(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &[ActRow<'_>],
    out: Columns<'_>,
) -> usize {
    debug_assert!(handles(dtype));
    match_target! {
        "x86_64+avx512f+avx512bw+avx512vl+avx512vnni+avx2+fma+f16c" => {
            if !available() {
                return 0;
            }
            x86::gemm16(dtype, w, row_bytes, acts, out)
        }
        _ => {
            let _ = (dtype, w, row_bytes, acts, out);
            0
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::*;

    /// The dtypes of the 32-value kernel, as a const parameter.
    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q4_1: u8 = 2;
    const Q5_0: u8 = 3;

    /// How far ahead of the block being computed the group's bytes are prefetched.
    const PREFETCH_AHEAD: usize = 4096;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn load512(s: &[u8]) -> __m512i {
        let a: [u8; 64] = s[..64].try_into().unwrap();
        bytemuck::cast(a)
    }

    /// Sixteen f16 at the start of `s` as f32 lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn f16x16(s: &[u8]) -> __m512 {
        let a: [u8; 32] = s[..32].try_into().unwrap();
        _mm512_cvtph_ps(bytemuck::cast::<_, __m256i>(a))
    }

    /// Activation bytes `4k..4k+4` of `q` in every lane.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn bcast<const N: usize>(q: &[i8; N], k: usize) -> __m512i {
        let at = 4 * k;
        _mm512_set1_epi32(i32::from_le_bytes([
            q[at] as u8,
            q[at + 1] as u8,
            q[at + 2] as u8,
            q[at + 3] as u8,
        ]))
    }

    /// Prefetches the cache lines `PREFETCH_AHEAD` bytes past those of `blk` (a hint: an
    /// address past the weights is never read).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn prefetch_ahead(blk: &[u8]) {
        let start = blk.as_ptr().wrapping_add(PREFETCH_AHEAD);
        for line in (0..blk.len()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line) as *const i8);
        }
    }

    /// One block of sixteen rows of a 32-value dtype: `v[k]` holds the unsigned levels that
    /// meet activation bytes `4k..4k+4` (lane `r`: row `r`), `d` the rows' scales, `m` their
    /// offset per unit of the activations' `d·Σq` (q4_1's min, q4_0's `−8·d`, q5_0's `−16·d`,
    /// q8_0's `−128·d`).
    struct Block16 {
        v: [__m512i; 8],
        d: __m512,
        m: __m512,
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn block16<const D: u8>(blk: &[u8]) -> Block16 {
        let d = f16x16(blk);
        if D == Q8_0 {
            return Block16 {
                v: std::array::from_fn(|k| load512(&blk[32 + 64 * k..])),
                d,
                m: _mm512_mul_ps(d, _mm512_set1_ps(-128.0)),
            };
        }
        let (qs, m) = match D {
            Q4_0 => (32, _mm512_mul_ps(d, _mm512_set1_ps(-8.0))),
            Q4_1 => (64, f16x16(&blk[32..])),
            _ => (96, _mm512_mul_ps(d, _mm512_set1_ps(-16.0))),
        };
        let low4 = _mm512_set1_epi8(0xF);
        let t: [__m512i; 4] = std::array::from_fn(|k| load512(&blk[qs + 64 * k..]));
        let mut v: [__m512i; 8] = std::array::from_fn(|k| {
            if k < 4 {
                _mm512_and_si512(t[k], low4)
            } else {
                _mm512_and_si512(_mm512_srli_epi16::<4>(t[k - 4]), low4)
            }
        });
        if D == Q5_0 {
            let sixteen = _mm512_set1_epi8(16);
            for (j, v) in v.iter_mut().enumerate() {
                let mask = u64::from_le_bytes(blk[32 + 8 * j..40 + 8 * j].try_into().unwrap());
                *v = _mm512_mask_add_epi8(*v, mask, *v, sixteen);
            }
        }
        Block16 { v, d, m }
    }

    /// Sixteen rows of a 32-value dtype (`group`: their `blocks` blocks) against `T`
    /// activation rows: the same operations in the same order for an activation row whichever
    /// tile it is in.
    ///
    /// The activation rows' multiply-adds are interleaved (two chains a row, `2·T` in flight):
    /// one row's chain of `vpdpbusd`s waits ~5 cycles on each, so a tile that finished one row's
    /// block before starting the next ran at about a fifth of the instruction's rate (a
    /// SmolLM2 prompt's matmuls at ~32 G multiply-adds a second a core).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn tile32<const T: usize, const D: u8>(
        group: &[u8],
        blocks: usize,
        acts: &[ActRow<'_>],
    ) -> [__m512; T] {
        let mut acc = [_mm512_setzero_ps(); T];
        let bb16 = group.len() / blocks;
        for (b, blk) in group.chunks_exact(bb16).enumerate() {
            prefetch_ahead(blk);
            let blk = block16::<D>(blk);
            let qs: [&[i8; 32]; T] =
                std::array::from_fn(|c| acts[c].q[32 * b..32 * b + 32].try_into().unwrap());
            let zero = _mm512_setzero_si512();
            let (mut i0, mut i1) = ([zero; T], [zero; T]);
            for k in (0..8).step_by(2) {
                for c in 0..T {
                    i0[c] = _mm512_dpbusd_epi32(i0[c], blk.v[k], bcast(qs[c], k));
                    i1[c] = _mm512_dpbusd_epi32(i1[c], blk.v[k + 1], bcast(qs[c], k + 1));
                }
            }
            for c in 0..T {
                let x = &acts[c];
                let dq = x.s16[2 * b] + x.s16[2 * b + 1];
                let isum = _mm512_add_epi32(i0[c], i1[c]);
                let f = _mm512_mul_ps(blk.d, _mm512_set1_ps(x.d[b]));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), f, acc[c]);
                acc[c] = _mm512_fmadd_ps(blk.m, _mm512_set1_ps(dq), acc[c]);
            }
        }
        acc
    }

    /// Control of `vpshufb` moving byte `b` of each 32-bit lane to byte 0 (and byte `b2` to
    /// byte 2 when `b2` is below 4), zeroing the others.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn pick(b: u8, b2: u8) -> __m512i {
        let z = 0x80u8;
        let hi = if b2 < 4 { b2 } else { z };
        // Byte indices are relative to the 128-bit lane: dword p takes 4p + b.
        let lane = |p: u8| [4 * p + b, z, if hi == z { z } else { 4 * p + hi }, z];
        let mut bytes = [0u8; 64];
        for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
            chunk.copy_from_slice(&lane((i % 4) as u8));
        }
        bytemuck::cast(bytes)
    }

    /// Control of `vpshufb` moving byte `b` of each 32-bit lane to byte 3, zeroing the others
    /// (then an arithmetic shift by 24 sign-extends it).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn pick_top(b: u8) -> __m512i {
        let mut bytes = [0x80u8; 64];
        for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
            chunk[3] = 4 * (i % 4) as u8 + b;
        }
        bytemuck::cast(bytes)
    }

    /// The activations' Σq over each 32 values of super-block `sb`, as four i32 of two i16
    /// (sub-blocks 2i and 2i+1).
    #[inline(always)]
    fn bsum32_pairs(x: &ActRow<'_>, sb: usize) -> [i32; 4] {
        let b: &[i16; 16] = x.bsums[16 * sb..16 * sb + 16].try_into().unwrap();
        std::array::from_fn(|i| {
            let lo = b[4 * i].wrapping_add(b[4 * i + 1]) as u16 as u32;
            let hi = b[4 * i + 2].wrapping_add(b[4 * i + 3]) as u16 as u32;
            (lo | (hi << 16)) as i32
        })
    }

    /// Sixteen q4_k rows (`group`: their super-blocks) against `T` activation rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn tile_q4k<const T: usize>(group: &[u8], acts: &[ActRow<'_>]) -> [__m512; T] {
        let mut acc = [_mm512_setzero_ps(); T];
        let (low4, low6) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x3F));
        let low2 = _mm512_set1_epi8(3);
        let scale_pick: [__m512i; 4] = std::array::from_fn(|b| pick(b as u8, 4));
        let (pair01, pair23) = (pick(0, 1), pick(2, 3));
        for (sb, blk) in group.chunks_exact(16 * 144).enumerate() {
            prefetch_ahead(blk);
            let d = f16x16(blk);
            let dmin = f16x16(&blk[32..]);
            let (w0, w1, w2) = (
                load512(&blk[64..]),
                load512(&blk[128..]),
                load512(&blk[192..]),
            );
            // As `kquants::k4_scales`, sixteen rows at once (the masks keep each byte's bits).
            let sc_lo = _mm512_and_si512(w0, low6);
            let sc_hi = _mm512_or_si512(
                _mm512_and_si512(w2, low4),
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w0), low2)),
            );
            let mn_lo = _mm512_and_si512(w1, low6);
            let mn_hi = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32::<4>(w2), low4),
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w1), low2)),
            );
            let scale = |j: usize| {
                let src = if j < 4 { sc_lo } else { sc_hi };
                _mm512_shuffle_epi8(src, scale_pick[j % 4])
            };
            // Mins as i16 pairs: (mn0, mn1), (mn2, mn3), (mn4, mn5), (mn6, mn7).
            let mins = [
                _mm512_shuffle_epi8(mn_lo, pair01),
                _mm512_shuffle_epi8(mn_lo, pair23),
                _mm512_shuffle_epi8(mn_hi, pair01),
                _mm512_shuffle_epi8(mn_hi, pair23),
            ];
            let qs = &blk[256..];
            // The activation rows interleaved, each weight word unpacked once for all of them
            // (as `tile32`; the integer sums are the same whichever order they are added in).
            let q: [&[i8; 256]; T] =
                std::array::from_fn(|c| acts[c].q[256 * sb..256 * sb + 256].try_into().unwrap());
            let mut total = [_mm512_setzero_si512(); T];
            for ch in 0..4 {
                let (mut lo, mut hi) = ([_mm512_setzero_si512(); T], [_mm512_setzero_si512(); T]);
                for t in 0..8 {
                    let raw = load512(&qs[64 * (8 * ch + t)..]);
                    let l = _mm512_and_si512(raw, low4);
                    let h = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low4);
                    for c in 0..T {
                        lo[c] = _mm512_dpbusd_epi32(lo[c], l, bcast(q[c], 16 * ch + t));
                        hi[c] = _mm512_dpbusd_epi32(hi[c], h, bcast(q[c], 16 * ch + 8 + t));
                    }
                }
                for c in 0..T {
                    let t = _mm512_add_epi32(total[c], _mm512_mullo_epi32(lo[c], scale(2 * ch)));
                    total[c] = _mm512_add_epi32(t, _mm512_mullo_epi32(hi[c], scale(2 * ch + 1)));
                }
            }
            for (c, total) in total.into_iter().enumerate() {
                let x = &acts[c];
                let pairs = bsum32_pairs(x, sb);
                let mut m = _mm512_setzero_si512();
                for (mins, pair) in mins.iter().zip(pairs) {
                    m = _mm512_dpwssd_epi32(m, *mins, _mm512_set1_epi32(pair));
                }
                let dx = _mm512_set1_ps(x.d[8 * sb]);
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, dx), acc[c]);
                acc[c] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dmin, dx), acc[c]);
            }
        }
        acc
    }

    /// Sixteen q6_k rows (`group`: their super-blocks) against `T` activation rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn tile_q6k<const T: usize>(group: &[u8], acts: &[ActRow<'_>]) -> [__m512; T] {
        let mut acc = [_mm512_setzero_ps(); T];
        let (low4, bits45) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x30));
        let top: [__m512i; 4] = std::array::from_fn(|b| pick_top(b as u8));
        for (sb, blk) in group.chunks_exact(16 * 210).enumerate() {
            prefetch_ahead(blk);
            let d = f16x16(blk);
            // Scale words: lane r of word w holds row r's scales 4w..4w+4 (i8).
            let sc: [__m512i; 4] = std::array::from_fn(|w| load512(&blk[32 + 64 * w..]));
            // Scale g sign-extended to i32 lanes.
            let scale =
                |g: usize| _mm512_srai_epi32::<24>(_mm512_shuffle_epi8(sc[g / 4], top[g % 4]));
            let (ql, qh) = (&blk[288..288 + 2048], &blk[2336..2336 + 1024]);
            for c in 0..T {
                let x = &acts[c];
                let q: &[i8; 256] = x.q[256 * sb..256 * sb + 256].try_into().unwrap();
                let mut total = _mm512_setzero_si512();
                for n in 0..2 {
                    for half in 0..2 {
                        let mut part = [_mm512_setzero_si512(); 4];
                        for t in 4 * half..4 * half + 4 {
                            let a = load512(&ql[64 * (16 * n + t)..]);
                            let b = load512(&ql[64 * (16 * n + 8 + t)..]);
                            let h = load512(&qh[64 * (8 * n + t)..]);
                            // (x & 0x0F) | y, y holding only bits 4-5.
                            let join = |x: __m512i, y: __m512i| {
                                _mm512_ternarylogic_epi32::<0xEA>(x, low4, y)
                            };
                            let lv = [
                                join(a, _mm512_and_si512(_mm512_slli_epi16::<4>(h), bits45)),
                                join(b, _mm512_and_si512(_mm512_slli_epi16::<2>(h), bits45)),
                                join(_mm512_srli_epi16::<4>(a), _mm512_and_si512(h, bits45)),
                                join(
                                    _mm512_srli_epi16::<4>(b),
                                    _mm512_and_si512(_mm512_srli_epi16::<2>(h), bits45),
                                ),
                            ];
                            for k in 0..4 {
                                let at = 32 * n + 8 * k + t;
                                part[k] = _mm512_dpbusd_epi32(part[k], lv[k], bcast(q, at));
                            }
                        }
                        for (k, part) in part.iter().enumerate() {
                            let g = 8 * n + 2 * k + half;
                            total = _mm512_add_epi32(total, _mm512_mullo_epi32(*part, scale(g)));
                        }
                    }
                }
                // The levels are stored + 32: subtract 32·Σ_g sc[g]·Σq over group g.
                let b: &[i16; 16] = x.bsums[16 * sb..16 * sb + 16].try_into().unwrap();
                let pair = |g0: usize, g1: usize| {
                    _mm512_set1_epi32(
                        ((b[g0] as u16 as u32) | ((b[g1] as u16 as u32) << 16)) as i32,
                    )
                };
                let mut off = _mm512_setzero_si512();
                for (w, sc) in sc.iter().enumerate() {
                    let even = _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(*sc));
                    let odd = _mm512_srai_epi16::<8>(*sc);
                    off = _mm512_dpwssd_epi32(off, even, pair(4 * w, 4 * w + 2));
                    off = _mm512_dpwssd_epi32(off, odd, pair(4 * w + 1, 4 * w + 3));
                }
                let total = _mm512_sub_epi32(total, _mm512_slli_epi32::<5>(off));
                let f = _mm512_mul_ps(d, _mm512_set1_ps(x.d[8 * sb]));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), f, acc[c]);
            }
        }
        acc
    }

    /// [`tile32`], [`tile_q4k`] or [`tile_q6k`] for `dtype`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn tile<const T: usize>(
        dtype: DType,
        group: &[u8],
        blocks: usize,
        acts: &[ActRow<'_>],
    ) -> [__m512; T] {
        match dtype {
            DType::Q8_0 => tile32::<T, Q8_0>(group, blocks, acts),
            DType::Q4_0 => tile32::<T, Q4_0>(group, blocks, acts),
            DType::Q4_1 => tile32::<T, Q4_1>(group, blocks, acts),
            DType::Q5_0 => tile32::<T, Q5_0>(group, blocks, acts),
            DType::Q4K => tile_q4k::<T>(group, acts),
            DType::Q6K => tile_q6k::<T>(group, acts),
            other => unreachable!("{other} is not a dtype of the sixteen-row kernels"),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn gemm16(
        dtype: DType,
        w: &[u8],
        row_bytes: usize,
        acts: &[ActRow<'_>],
        out: Columns<'_>,
    ) -> usize {
        let n = acts.len();
        debug_assert_eq!(out.columns.len(), n);
        let blocks = row_bytes / dtype.block_bytes();
        debug_assert_eq!(
            blocks * dtype.block_len(),
            acts.first().map_or(0, |a| a.q.len())
        );
        let group_bytes = 16 * row_bytes;
        let groups = w.len() / group_bytes;
        for (g, group) in w.chunks_exact(group_bytes).enumerate() {
            for c0 in (0..n).step_by(4) {
                let a = &acts[c0..n.min(c0 + 4)];
                let sums: &[__m512] = match a.len() {
                    1 => &tile::<1>(dtype, group, blocks, a),
                    2 => &tile::<2>(dtype, group, blocks, a),
                    3 => &tile::<3>(dtype, group, blocks, a),
                    _ => &tile::<4>(dtype, group, blocks, a),
                };
                for (c, lanes) in sums.iter().enumerate() {
                    let lanes: [f32; 16] = bytemuck::cast(*lanes);
                    let column = out.columns[c0 + c];
                    for (l, v) in lanes.iter().enumerate() {
                        out.out_t[(16 * g + l) * out.stride + column] = *v;
                    }
                }
            }
        }
        16 * groups
    }
}

#[cfg(test)]
mod tests {
    use super::super::int8;
    use super::super::int8::tests::check_alone_in_any_column;
    use super::super::kquants::tests::Rng;
    use super::super::kquants::tests::bound_of;
    use super::super::kquants::{self, QuantizedActs};
    use super::*;

    /// The row kernel of `dtype` (what the rows after the last group of sixteen take).
    fn row_kernel(dtype: DType, row: &[u8], x: ActRow<'_>) -> f32 {
        if int8::handles(dtype) {
            let mut out = [0f32];
            int8::dot_rows(dtype, row, row.len(), x, &mut out, 1);
            out[0]
        } else {
            kquants::dot(dtype, row, x)
        }
    }

    #[test]
    fn sixteen_row_kernels_are_within_the_8_bit_bound_and_the_same_for_any_row_count() {
        // For each dtype, random blocks (ordinary f16 fields), rows with and without a tail
        // after the last group of sixteen, activation rows whose magnitudes vary by block (one
        // in three 16× the others). Each (weight row, activation row) result of `gemm16` over
        // the repacked rows: within the 8-bit-activation bound of the f64 reference of the
        // stored weights and the f32 activations (the activations rounded to 8 bits per 32
        // values, or per 256 for the k-quants: |x − x̂| ≤ max|x|/254, plus f32 rounding, 1e-5
        // of Σ|w·x|); within 1e-5 of Σ|w·x| of the row kernel that the AVX2 path runs on the
        // stored row (the same integer sums, another order of f32 operations); and bit for bit
        // the same whether its activation row comes alone or with 1, 4 or 8 others, in any
        // column. The worst errors are printed.
        if !available() {
            println!("the CPU has no AVX-512 VNNI (or GDSLLM_CPU_AVX512=0): nothing to check");
            return;
        }
        let mut rng = Rng(0xA076_1D64_78BD_642F);
        for dtype in DType::ALL.into_iter().filter(|d| handles(*d)) {
            let shapes: &[(usize, usize)] = if dtype.block_len() == 256 {
                &[(16, 256), (43, 768), (37, 512)]
            } else {
                &[(16, 32), (43, 640), (37, 96)]
            };
            let (mut worst_ref, mut worst_row) = (0f64, 0f64);
            for &(rows, cols) in shapes {
                let n_acts = 9;
                let blocks = rows * cols / dtype.block_len();
                let w = gdsllm_convert::testing::random_blocks(dtype, blocks, rng.next());
                let x: Vec<f32> = (0..n_acts * cols)
                    .map(|i| rng.uniform() * if i % 96 < 32 { 4.0 } else { 0.25 })
                    .collect();
                let mut xq = QuantizedActs::default();
                xq.prepare(&x, cols, dtype);
                let acts: Vec<ActRow<'_>> = (0..n_acts).map(|r| xq.row(dtype, r)).collect();
                let row_bytes = w.len() / rows;
                let mut packed = vec![0u8; w.len()];
                repack16(dtype, &w, row_bytes, &mut packed);
                let whole = rows / 16 * 16;
                assert_eq!(
                    packed[whole * row_bytes..],
                    w[whole * row_bytes..],
                    "{dtype}: the rows after the last group stay as stored"
                );
                let what = format!("{dtype} {rows}x{cols}");
                let alone = check_alone_in_any_column(&acts, rows, whole, &what, |a, out| {
                    gemm16(dtype, &packed, row_bytes, a, out)
                });
                for (c, xc) in x.chunks_exact(cols).enumerate() {
                    for (i, wr) in w.chunks_exact(row_bytes).take(whole).enumerate() {
                        let (reference, bound, magnitude) =
                            bound_of(dtype, wr, xc, dtype.block_len());
                        let got = alone[c][i] as f64;
                        assert!(
                            (got - reference).abs() <= bound,
                            "{dtype} {rows}x{cols} row {i} act {c}: {got} reference {reference} bound {bound}"
                        );
                        let by_row = row_kernel(dtype, wr, acts[c]) as f64;
                        assert!(
                            (got - by_row).abs() <= 1e-5 * magnitude,
                            "{dtype} {rows}x{cols} row {i} act {c}: {got} row kernel {by_row}"
                        );
                        worst_ref = worst_ref.max((got - reference).abs() / bound);
                        worst_row = worst_row.max((got - by_row).abs() / magnitude.max(1e-30));
                    }
                }
            }
            println!(
                "{dtype} gemm16: worst |dot − reference| is {:.0} % of the 8-bit bound; worst \
                 |gemm16 − row kernel| / Σ|w·x| = {worst_row:.1e} (tolerance 1e-5)",
                worst_ref * 100.0
            );
        }
    }
}

#[cfg(test)]
mod speed {
    use super::super::int8;
    use super::super::kquants::tests::Rng;
    use super::super::kquants::{self, QuantizedActs};
    use super::*;

    /// Seconds of the fastest of `reps` calls of `f`.
    fn fastest(reps: usize, mut f: impl FnMut(usize)) -> f64 {
        (0..reps)
            .map(|i| {
                let t = std::time::Instant::now();
                f(i);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }

    #[test]
    #[ignore = "a speed measurement, one thread: cargo test --release -p llama --lib \
                vnni16::speed -- --ignored --nocapture"]
    fn one_activation_row_against_the_avx2_kernels() {
        // Each matrix is copied until the copies fill 256 MiB and the calls cycle through
        // them, so that the weights come from beyond the core's caches as in a decode step.
        // "avx2" is the path of a CPU without AVX-512 VNNI (the eight-row kernels of `int8`
        // for q4_0/q4_1/q8_0, which on this CPU run their AVX-512 VNNI clone; the row
        // kernels of `kquants` for the others).
        if !available() {
            println!("no AVX-512 VNNI here");
            return;
        }
        let mut rng = Rng(5);
        let shapes = [
            (DType::Q8_0, 262_144, 640),
            (DType::Q8_0, 256, 640),
            (DType::Q5_0, 2048, 640),
            (DType::Q4K, 640, 1024),
            (DType::Q6K, 640, 2048),
            (DType::Q4_1, 1536, 576),
        ];
        for (dtype, rows, cols) in shapes {
            let blocks = rows * cols / dtype.block_len();
            let w = gdsllm_convert::testing::random_blocks(dtype, blocks, rng.next());
            let row_bytes = w.len() / rows;
            let copies = (256usize << 20).div_ceil(w.len()).max(1);
            let mut p16 = vec![0u8; w.len()];
            repack16(dtype, &w, row_bytes, &mut p16);
            let p8 = if int8::handles(dtype) {
                let mut p8 = vec![0u8; w.len()];
                int8::repack8(dtype, &w, row_bytes, &mut p8);
                p8
            } else {
                w.clone()
            };
            let many = |one: &[u8]| one.repeat(copies);
            let (p16, p8) = (many(&p16), many(&p8));
            let x: Vec<f32> = (0..cols).map(|_| rng.uniform()).collect();
            let mut xq = QuantizedActs::default();
            xq.prepare(&x, cols, dtype);
            let act = [xq.row(dtype, 0)];
            let mut out = vec![0f32; rows];
            let reps = (copies * 4).clamp(8, 400);
            let at = |i: usize| (i % copies) * w.len()..(i % copies + 1) * w.len();
            let t16 = fastest(reps, |i| {
                let o = Columns {
                    out_t: &mut out,
                    stride: 1,
                    columns: &[0],
                };
                gemm16(dtype, &p16[at(i)], row_bytes, &act, o);
            });
            let t8 = fastest(reps, |i| {
                let wb = &p8[at(i)];
                if int8::handles(dtype) {
                    let o = Columns {
                        out_t: &mut out,
                        stride: 1,
                        columns: &[0],
                    };
                    int8::gemm8_packed(dtype, wb, row_bytes, &act, o);
                } else {
                    for (o, row) in out.iter_mut().zip(wb.chunks_exact(row_bytes)) {
                        *o = kquants::dot(dtype, row, act[0]);
                    }
                }
            });
            let gb = |t: f64| w.len() as f64 / t / 1e9;
            println!(
                "{dtype} {rows}x{cols} ({:.1} MB): sixteen rows {:.1} µs ({:.1} GB/s), avx2 path \
                 {:.1} µs ({:.1} GB/s): {:.2}x",
                w.len() as f64 / 1e6,
                t16 * 1e6,
                gb(t16),
                t8 * 1e6,
                gb(t8),
                t8 / t16
            );
        }
    }
}
