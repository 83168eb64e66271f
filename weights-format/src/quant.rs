//! Conversion between f32 and each [`DType`]'s bytes, one row (or any whole number of blocks)
//! at a time. These are the slow, obviously correct definitions of the layouts; fast kernels
//! elsewhere are tested against them.

use half::{bf16, f16};

use crate::DType;

/// Why a conversion could not be done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error(
        "{dtype}: {values} values is not a whole number of {block}-value {}",
        if .dtype.is_super_block() { "super-blocks" } else { "blocks" }
    )]
    PartialBlock {
        dtype: DType,
        values: usize,
        block: usize,
    },
    #[error("{dtype}: no encoder here (it is only carried over bit for bit from GGUF files)")]
    NoEncoder { dtype: DType },
    #[error("{dtype}: {bytes} bytes do not hold {values} values (need {expected})")]
    LengthMismatch {
        dtype: DType,
        bytes: usize,
        values: usize,
        expected: usize,
    },
}

fn check(dtype: DType, values: usize, bytes: usize) -> Result<(), QuantError> {
    let block = dtype.block_len();
    if !values.is_multiple_of(block) {
        return Err(QuantError::PartialBlock {
            dtype,
            values,
            block,
        });
    }
    let expected = values / block * dtype.block_bytes();
    if bytes != expected {
        return Err(QuantError::LengthMismatch {
            dtype,
            bytes,
            values,
            expected,
        });
    }
    Ok(())
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// IQ4_NL's and IQ4_XS's 16 levels (ggml's `kvalues_iq4nl`): a 4-bit index selects one, times
/// the block's scale.
pub const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The 6-bit scale and min of 32-value sub-block `j` (0..8) of a q4_k or q5_k super-block,
/// from its 12 packed scale bytes (ggml's `get_scale_min_k4`): sub-blocks 0–3 keep theirs in
/// the low 6 bits of bytes `j` and `j + 4`; 4–7 in the nibbles of byte `j + 4`, with the top
/// two bits in the high bits of bytes `j − 4` and `j`.
#[inline(always)]
pub fn k4_scale_min(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// The signed scale (−32..31) of 16-value sub-block `i` (0..16) of a q3_k super-block, from its
/// 12 packed scale bytes: the low 4 bits are a nibble of bytes 0–7 (low nibbles for 0–7, high
/// for 8–15), the top 2 bits a pair in bytes 8–11.
#[inline(always)]
pub fn q3k_scale(i: usize, scales: &[u8]) -> i32 {
    let low = if i < 8 {
        scales[i] & 0xF
    } else {
        scales[i - 8] >> 4
    };
    let high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    (low | (high << 4)) as i32 - 32
}

/// The 6-bit scale (−32..31 after the offset) of 32-value sub-block `ib` (0..8) of an iq4_xs
/// super-block: the low nibble from `scales_l`, the top two bits from `scales_h`.
#[inline(always)]
pub fn iq4xs_scale(ib: usize, scales_h: u16, scales_l: &[u8]) -> i32 {
    let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    let high = ((scales_h >> (2 * ib)) & 3) as u8;
    (low | (high << 4)) as i32 - 32
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// Decodes one block of a quantized `dtype` (`b` is exactly its bytes, `o` its values).
fn dequantize_block(dtype: DType, b: &[u8], o: &mut [f32]) {
    match dtype {
        DType::F32 | DType::F16 | DType::Bf16 => unreachable!("not a block type"),
        DType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                o[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        DType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                let q = b[2 + j];
                o[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        DType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for j in 0..16 {
                let q = b[4 + j];
                o[j] = (q & 0xF) as f32 * d + m;
                o[j + 16] = (q >> 4) as f32 * d + m;
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            // The fifth bit of value j is bit j of the little-endian u32 `qh`.
            let (d, m, qs) = if dtype == DType::Q5_0 {
                (f16_at(b, 0), None, 6)
            } else {
                (f16_at(b, 0), Some(f16_at(b, 2)), 8)
            };
            let qh = u32_at(b, qs - 4);
            for j in 0..16 {
                let lo = (b[qs + j] & 0xF) as u32 | (((qh >> j) & 1) << 4);
                let hi = (b[qs + j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                for (k, q) in [(j, lo), (j + 16, hi)] {
                    o[k] = match m {
                        None => (q as i32 - 16) as f32 * d,
                        Some(m) => q as f32 * d + m,
                    };
                }
            }
        }
        DType::Iq4Nl => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                o[j] = d * IQ4_LEVELS[(b[2 + j] & 0xF) as usize] as f32;
                o[j + 16] = d * IQ4_LEVELS[(b[2 + j] >> 4) as usize] as f32;
            }
        }
        DType::Q2K => {
            // scales[16] | qs[64] | f16 d | f16 dmin. Value 128n + 32j + l is the 2 bits at
            // 2j of qs[32n + l], in the 16-value sub-block 8n + 2j + l/16, whose scale byte
            // holds the scale (low nibble) and min (high nibble).
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            for (e, o) in o.iter_mut().enumerate() {
                let (n, j, l) = (e / 128, e % 128 / 32, e % 32);
                let q = (b[16 + 32 * n + l] >> (2 * j)) & 3;
                let sc = b[8 * n + 2 * j + l / 16];
                *o = d * (sc & 0xF) as f32 * q as f32 - dmin * (sc >> 4) as f32;
            }
        }
        DType::Q3K => {
            // hmask[32] | qs[64] | scales[12] | f16 d. Value 128n + 32j + l: the 2 bits at 2j
            // of qs[32n + l], minus 4 unless bit 4n + j of hmask[l] is set; 16-value
            // sub-block 8n + 2j + l/16.
            let d = f16_at(b, 108);
            let scales = &b[96..108];
            for (e, o) in o.iter_mut().enumerate() {
                let (n, j, l) = (e / 128, e % 128 / 32, e % 32);
                let q = ((b[32 + 32 * n + l] >> (2 * j)) & 3) as i32;
                let high = (b[l] >> (4 * n + j)) & 1;
                let q = if high == 1 { q } else { q - 4 };
                *o = d * q3k_scale(8 * n + 2 * j + l / 16, scales) as f32 * q as f32;
            }
        }
        DType::Q4K | DType::Q5K => {
            // f16 d | f16 dmin | scales[12] | (q5_k: qh[32]) | qs[128]. Value 64c + l: the low
            // (l < 32) or high nibble of qs[32c + l % 32], in sub-block 2c + l/32; q5_k adds
            // bit 2c + l/32 of qh[l % 32] as 16.
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let five = dtype == DType::Q5K;
            let qs = if five { 48 } else { 16 };
            for (e, o) in o.iter_mut().enumerate() {
                let (c, l) = (e / 64, e % 64);
                let sub = 2 * c + l / 32;
                let byte = b[qs + 32 * c + l % 32];
                let mut q = if l < 32 { byte & 0xF } else { byte >> 4 };
                if five {
                    q |= ((b[16 + l % 32] >> sub) & 1) << 4;
                }
                let (sc, m) = k4_scale_min(sub, &b[4..16]);
                *o = d * sc as f32 * q as f32 - dmin * m as f32;
            }
        }
        DType::Q6K => {
            // ql[128] | qh[64] | i8 scales[16] | f16 d. Value 128n + 32k + l: the low (k < 2)
            // or high nibble of ql[64n + 32(k & 1) + l] and bits 2k..2k+1 of qh[32n + l] as
            // bits 4–5, minus 32; 16-value sub-block 8n + 2k + l/16.
            let d = f16_at(b, 208);
            for (e, o) in o.iter_mut().enumerate() {
                let (n, k, l) = (e / 128, e % 128 / 32, e % 32);
                let byte = b[64 * n + 32 * (k & 1) + l];
                let low = if k < 2 { byte & 0xF } else { byte >> 4 };
                let high = (b[128 + 32 * n + l] >> (2 * k)) & 3;
                let q = (low | (high << 4)) as i32 - 32;
                let sc = b[192 + 8 * n + 2 * k + l / 16] as i8;
                *o = d * sc as f32 * q as f32;
            }
        }
        DType::Iq4Xs => {
            // f16 d | u16 scales_h | scales_l[4] | qs[128]. Sub-block ib (32 values): value j
            // is the low (j < 16) or high nibble of qs[16ib + j % 16] as a level.
            let d = f16_at(b, 0);
            let scales_h = u16_at(b, 2);
            for (ib, o) in o.chunks_exact_mut(32).enumerate() {
                let dl = d * iq4xs_scale(ib, scales_h, &b[4..8]) as f32;
                for j in 0..16 {
                    let q = b[8 + 16 * ib + j];
                    o[j] = dl * IQ4_LEVELS[(q & 0xF) as usize] as f32;
                    o[j + 16] = dl * IQ4_LEVELS[(q >> 4) as usize] as f32;
                }
            }
        }
    }
}

/// Decodes the little-endian `N`-byte scalars of `src` into `dst` with `decode` (the float
/// dtypes: f32, f16, bf16), as many as both hold.
#[inline(always)]
pub fn decode_scalars<const N: usize>(
    src: &[u8],
    dst: &mut [f32],
    decode: impl Fn([u8; N]) -> f32,
) {
    for (o, c) in dst.iter_mut().zip(src.as_chunks::<N>().0) {
        *o = decode(*c);
    }
}

/// Decodes `src` (whole blocks of `dtype`) into `dst`, whose length is the number of values.
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check(dtype, dst.len(), src.len())?;
    match dtype {
        DType::F32 => decode_scalars(src, dst, f32::from_le_bytes),
        DType::F16 => decode_scalars(src, dst, |b| f16::from_le_bytes(b).to_f32()),
        DType::Bf16 => decode_scalars(src, dst, |b| bf16::from_le_bytes(b).to_f32()),
        _ => {
            let (len, bytes) = (dtype.block_len(), dtype.block_bytes());
            for (o, b) in dst.chunks_exact_mut(len).zip(src.chunks_exact(bytes)) {
                dequantize_block(dtype, b, o);
            }
        }
    }
    Ok(())
}

/// The dtypes [`quantize`] can encode (every dtype can be decoded).
pub fn can_quantize(dtype: DType) -> bool {
    !matches!(dtype, DType::Q2K | DType::Q3K | DType::Iq4Nl | DType::Iq4Xs)
}

/// Encodes `src` as `dtype`, appending to `dst`. Quantized types use llama.cpp's reference
/// quantizers (`quantize_row_*_ref`: for q4_k and q5_k the weighted min/scale search of
/// `make_qkx2_quants`, for q6_k the scale search of `make_qx_quants`), so re-quantizing their
/// output is stable. q2_k, q3_k, iq4_nl and iq4_xs have no encoder here ([`can_quantize`]):
/// they are only carried over from GGUF files.
pub fn quantize(dtype: DType, src: &[f32], dst: &mut Vec<u8>) -> Result<(), QuantError> {
    let block = dtype.block_len();
    if !src.len().is_multiple_of(block) {
        return Err(QuantError::PartialBlock {
            dtype,
            values: src.len(),
            block,
        });
    }
    if !can_quantize(dtype) {
        return Err(QuantError::NoEncoder { dtype });
    }
    dst.reserve(src.len() / block * dtype.block_bytes());
    match dtype {
        DType::F32 => src
            .iter()
            .for_each(|v| dst.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => src
            .iter()
            .for_each(|v| dst.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::Bf16 => src
            .iter()
            .for_each(|v| dst.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        _ => {
            for x in src.chunks_exact(block) {
                quantize_block(dtype, x, dst);
            }
        }
    }
    Ok(())
}

/// The value of largest magnitude, with its sign (the first of equal magnitudes).
fn signed_absmax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a })
}

/// Round to nearest, ties to even: ggml's `nearest_int` for the magnitudes it is used on.
fn nearest(v: f32) -> i32 {
    v.round_ties_even() as i32
}

fn push_f16(dst: &mut Vec<u8>, v: f32) {
    dst.extend_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Encodes one block of `x` (exactly one block's values) and appends it to `dst`.
fn quantize_block(dtype: DType, x: &[f32], dst: &mut Vec<u8>) {
    match dtype {
        DType::Q8_0 => {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            push_f16(dst, d);
            dst.extend(x.iter().map(|v| ((v * id).round() as i8) as u8));
        }
        DType::Q4_0 => {
            // The value of largest magnitude maps to -8, keeping its sign.
            let d = signed_absmax(x) / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            push_f16(dst, d);
            for j in 0..16 {
                let q0 = ((x[j] * id + 8.5) as i32).min(15) as u8;
                let q1 = ((x[j + 16] * id + 8.5) as i32).min(15) as u8;
                dst.push(q0 | (q1 << 4));
            }
        }
        DType::Q4_1 => {
            let min = x.iter().copied().fold(f32::INFINITY, f32::min);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = (max - min) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            push_f16(dst, d);
            push_f16(dst, min);
            for j in 0..16 {
                let q0 = (((x[j] - min) * id + 0.5) as i32).min(15) as u8;
                let q1 = (((x[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
                dst.push(q0 | (q1 << 4));
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            // q5_0: the value of largest magnitude maps to -16; q5_1: min..max over 0..31.
            let (d, min) = if dtype == DType::Q5_0 {
                (signed_absmax(x) / -16.0, None)
            } else {
                let min = x.iter().copied().fold(f32::INFINITY, f32::min);
                let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                ((max - min) / 31.0, Some(min))
            };
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let level = |v: f32| -> u32 {
                match min {
                    // Truncation towards zero after +16.5, as ggml's (int8_t) cast.
                    None => ((v * id + 16.5) as i32).min(31) as u32,
                    Some(m) => (((v - m) * id + 0.5) as u32).min(31),
                }
            };
            push_f16(dst, d);
            if let Some(m) = min {
                push_f16(dst, m);
            }
            let mut qh = 0u32;
            let mut qs = [0u8; 16];
            for j in 0..16 {
                let (q0, q1) = (level(x[j]), level(x[j + 16]));
                qs[j] = (q0 & 0xF) as u8 | (((q1 & 0xF) as u8) << 4);
                qh |= ((q0 >> 4) & 1) << j;
                qh |= ((q1 >> 4) & 1) << (j + 16);
            }
            dst.extend_from_slice(&qh.to_le_bytes());
            dst.extend_from_slice(&qs);
        }
        DType::Q4K | DType::Q5K => quantize_q45k(dtype == DType::Q5K, x, dst),
        DType::Q6K => quantize_q6k(x, dst),
        _ => unreachable!("{dtype} has no encoder (checked by the caller)"),
    }
}

/// ggml's `make_qkx2_quants`: levels `l[i]` in 0..=nmax and (scale, min) such that
/// `scale·l + min ≈ x` minimising the `weights`-weighted squared error, searched over
/// `nstep + 1` candidate scales around `nmax / (max − min)`. `min` is ≤ 0; returns
/// `(scale, −min)`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum_w: f32 = weights.iter().sum();
    let sum_x: f32 = weights.iter().zip(x).map(|(w, v)| w * v).sum();
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let level = |iscale: f32, min: f32, v: f32| nearest(iscale * (v - min)).clamp(0, nmax) as u8;
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        l[i] = level(iscale, min, x[i]);
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * diff * diff;
    }
    let mut aux = vec![0u8; n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            aux[i] = level(iscale, min, x[i]);
            let (w, q) = (weights[i], aux[i] as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let error: f32 = (0..n)
                .map(|i| {
                    let diff = this_scale * aux[i] as f32 + this_min - x[i];
                    weights[i] * diff * diff
                })
                .sum();
            if error < best_error {
                l.copy_from_slice(&aux);
                best_error = error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// One q4_k (`five` false) or q5_k super-block, as `quantize_row_q4_K_ref` /
/// `quantize_row_q5_K_ref`: a (scale, min) per 32-value sub-block from [`make_qkx2_quants`]
/// weighted by `rms(x) + |x|`, both quantized to 6 bits against the super-block's f16 `d` and
/// `dmin`, then every value re-levelled against the stored scales.
fn quantize_q45k(five: bool, x: &[f32], dst: &mut Vec<u8>) {
    let nmax: i32 = if five { 31 } else { 15 };
    let (rmin, nstep) = if five { (-0.5, 15) } else { (-1.0, 20) };
    let mut levels = [0u8; 256];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        let weights: Vec<f32> = xs.iter().map(|v| av_x + v.abs()).collect();
        let l = &mut levels[32 * j..32 * j + 32];
        (scales[j], mins[j]) = make_qkx2_quants(nmax, xs, &weights, l, rmin, 0.1, nstep);
    }
    let max_scale = scales.iter().copied().fold(0f32, f32::max);
    let max_min = mins.iter().copied().fold(0f32, f32::max);
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let ls = nearest(inv_scale * scales[j]).min(63) as u8;
        let lm = nearest(inv_min * mins[j]).min(63) as u8;
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    for j in 0..8 {
        let (sc, m) = k4_scale_min(j, &packed);
        let dl = d.to_f32() * sc as f32;
        if dl == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for i in 32 * j..32 * j + 32 {
            levels[i] = nearest((x[i] + dm) / dl).clamp(0, nmax) as u8;
        }
    }
    dst.extend_from_slice(&d.to_le_bytes());
    dst.extend_from_slice(&dmin.to_le_bytes());
    dst.extend_from_slice(&packed);
    if five {
        let mut qh = [0u8; 32];
        for c in 0..4 {
            for l in 0..32 {
                qh[l] |= (levels[64 * c + l] >> 4) << (2 * c);
                qh[l] |= (levels[64 * c + 32 + l] >> 4) << (2 * c + 1);
            }
        }
        dst.extend_from_slice(&qh);
    }
    for c in 0..4 {
        for l in 0..32 {
            dst.push((levels[64 * c + l] & 0xF) | ((levels[64 * c + 32 + l] & 0xF) << 4));
        }
    }
}

/// ggml's `make_qx_quants` with `rmse_type` 1 (weights `x²`): signed levels in
/// `−nmax..nmax−1` (stored `+ nmax`) and the scale minimising the weighted error, searched
/// over 19 candidates around `−nmax / max` (max = the value of largest magnitude).
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest(iscale * v).clamp(-nmax, nmax - 1);
    let fit = |iscale: f32| -> (f32, f32) {
        x.iter().fold((0f32, 0f32), |(sumlx, suml2), &v| {
            let (w, q) = (v * v, level(iscale, v) as f32);
            (sumlx + w * v * q, suml2 + w * q * q)
        })
    };
    let store = |iscale: f32, l: &mut [u8]| {
        for (o, &v) in l.iter_mut().zip(x) {
            *o = (level(iscale, v) + nmax) as u8;
        }
    };
    let iscale = -(nmax as f32) / max;
    store(iscale, l);
    let (sumlx, suml2) = fit(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            store(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Below this a group of values counts as all zero (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// One q6_k super-block, as `quantize_row_q6_K_ref`: a scale per 16-value sub-block from
/// [`make_qx_quants`], quantized to i8 against the super-block's f16 `d`, then every value
/// re-levelled against the stored scales.
fn quantize_q6k(x: &[f32], dst: &mut Vec<u8>) {
    let mut levels = [0u8; 256];
    let mut scales = [0f32; 16];
    for (ib, s) in scales.iter_mut().enumerate() {
        *s = make_qx_quants(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut levels[16 * ib..16 * ib + 16],
        );
    }
    let max_scale = scales
        .iter()
        .copied()
        .fold(0f32, |a, s| if s.abs() > a.abs() { s } else { a });
    if max_scale.abs() < GROUP_MAX_EPS {
        dst.extend_from_slice(&[0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16::from_f32(1.0 / iscale);
    let mut sc = [0i8; 16];
    for (o, s) in sc.iter_mut().zip(&scales) {
        *o = nearest(iscale * s).min(127) as i8;
    }
    for ((levels, x), s) in levels.chunks_exact_mut(16).zip(x.chunks_exact(16)).zip(sc) {
        let dl = d.to_f32() * s as f32;
        if dl == 0.0 {
            continue;
        }
        for (l, v) in levels.iter_mut().zip(x) {
            *l = (nearest(v / dl).clamp(-32, 31) + 32) as u8;
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for n in 0..2 {
        for l in 0..32 {
            let q = |k: usize| levels[128 * n + 32 * k + l];
            ql[64 * n + l] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            ql[64 * n + 32 + l] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            qh[32 * n + l] =
                (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
    dst.extend_from_slice(&ql);
    dst.extend_from_slice(&qh);
    dst.extend(sc.iter().map(|&s| s as u8));
    dst.extend_from_slice(&d.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic normally distributed values (std 0.02, like initialised weights) with a
    /// rare outlier of 10 standard deviations, as trained weight matrices have.
    fn weights_like(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 + 0.5) / (1u64 << 24) as f32
        };
        (0..n)
            .map(|i| {
                let (u1, u2) = (uniform(), uniform());
                let normal = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
                if i % 211 == 17 { 0.2 } else { 0.02 * normal }
            })
            .collect()
    }

    fn round_trip(dtype: DType, src: &[f32]) -> Vec<f32> {
        let mut bytes = Vec::new();
        quantize(dtype, src, &mut bytes).unwrap();
        assert_eq!(
            bytes.len() as u64,
            dtype.byte_len(&[src.len() as u64]).unwrap()
        );
        let mut back = vec![0f32; src.len()];
        dequantize(dtype, &bytes, &mut back).unwrap();
        back
    }

    #[test]
    fn round_trip_error_is_within_half_a_step() {
        let src: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for dtype in DType::ALL.into_iter().filter(|d| can_quantize(*d)) {
            let back = round_trip(dtype, &src);
            let max_diff = src
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // Block amplitude is ~7.1. Q4_1: a step is 2*7.1/15, half of it ~0.48. Q4_0 maps
            // the largest magnitude to -8, so the opposite extreme clamps at +7: one whole step
            // (7.1/8 ~ 0.89) of error there, as in llama.cpp; Q5_0 likewise with 16 (0.45).
            // Q5_1: half of 2*7.1/31 ~ 0.23. The k-quants fit each sub-block's own range (a
            // 32-value sub-block here spans most of the block's) and store the scales in 6 (8
            // for q6_k) bits: q4_k's step is ~0.95, q5_k's ~0.46, q6_k's (16 values of a
            // ±7.1 range, 64 levels) ~0.22; the search may trade the extremes for the bulk, so
            // the bound is a whole step for q4_k and q5_k and half a step for q6_k.
            let tol = match dtype {
                DType::F32 => 0.0,
                DType::F16 => 4e-3,
                DType::Bf16 => 3e-2,
                DType::Q8_0 => 0.03,
                DType::Q4_1 => 0.5,
                DType::Q4_0 => 0.9,
                DType::Q5_0 => 0.45,
                DType::Q5_1 => 0.25,
                DType::Q4K => 0.95,
                DType::Q5K => 0.46,
                DType::Q6K => 0.12,
                other => unreachable!("{other} has no encoder"),
            };
            println!("{dtype}: max |x - deq(q(x))| = {max_diff:.5} (tolerance {tol})");
            assert!(max_diff <= tol, "{dtype}: {max_diff} > {tol}");
        }
    }

    #[test]
    fn k_quants_beat_the_legacy_types_of_the_same_width() {
        // On weight-like data (small values, rare outliers) the per-sub-block scales and the
        // weighted search must give a smaller RMS error than the 32-value legacy formats of
        // the same bit width: what makes a k-quant worth having.
        let src = weights_like(256 * 64, 7);
        let rms = |dtype: DType| {
            let back = round_trip(dtype, &src);
            let se: f64 = src
                .iter()
                .zip(&back)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            (se / src.len() as f64).sqrt()
        };
        let signal =
            (src.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / src.len() as f64).sqrt();
        for (k, legacy) in [(DType::Q4K, DType::Q4_1), (DType::Q5K, DType::Q5_1)] {
            let (ek, el) = (rms(k), rms(legacy));
            println!(
                "rms error / rms signal: {k} {:.4}, {legacy} {:.4}",
                ek / signal,
                el / signal
            );
            assert!(ek < el, "{k} ({ek}) is not better than {legacy} ({el})");
        }
        // q6_k (6.56 bits per value) against q5_1 (6 bits) and q8_0 (8.5 bits): between them.
        let (e6, e5, e8) = (rms(DType::Q6K), rms(DType::Q5_1), rms(DType::Q8_0));
        println!(
            "rms error / rms signal: q6_k {:.4}, q5_1 {:.4}, q8_0 {:.4}",
            e6 / signal,
            e5 / signal,
            e8 / signal
        );
        assert!(
            e8 < e6 && e6 < e5,
            "q6_k {e6} not between q8_0 {e8} and q5_1 {e5}"
        );
    }

    #[test]
    fn requantizing_is_stable() {
        // The reference quantizers are deterministic; decoding and encoding again must give
        // the same bytes for the types whose levels are a plain affine grid.
        let src = weights_like(512, 3);
        for dtype in [DType::Q5_0, DType::Q5_1, DType::Q6K] {
            let mut a = Vec::new();
            quantize(dtype, &src, &mut a).unwrap();
            let mut back = vec![0f32; src.len()];
            dequantize(dtype, &a, &mut back).unwrap();
            let mut b = Vec::new();
            quantize(dtype, &back, &mut b).unwrap();
            let mut again = vec![0f32; src.len()];
            dequantize(dtype, &b, &mut again).unwrap();
            let drift = back
                .iter()
                .zip(&again)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            println!("{dtype}: max drift after re-quantizing {drift:e}");
            assert!(
                drift <= 1e-3,
                "{dtype}: re-quantizing moved values by {drift}"
            );
        }
    }

    #[test]
    fn all_zero_blocks_decode_to_zero() {
        for dtype in DType::ALL.into_iter().filter(|d| can_quantize(*d)) {
            let back = round_trip(dtype, &[0.0; 256]);
            assert!(back.iter().all(|v| *v == 0.0), "{dtype}");
        }
    }

    #[test]
    fn scale_unpacking_matches_the_bit_layout() {
        // q4_k: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7
        // split between the nibbles of bytes 8-11 and the top bits of bytes 0-7.
        let mut packed = [0u8; 12];
        let want: Vec<(u8, u8)> = (0..8)
            .map(|j| (j as u8 * 7 + 5, 63 - j as u8 * 5))
            .collect();
        for (j, &(s, m)) in want.iter().enumerate() {
            if j < 4 {
                packed[j] |= s;
                packed[j + 4] |= m;
            } else {
                packed[j + 4] = (s & 0xF) | ((m & 0xF) << 4);
                packed[j - 4] |= (s >> 4) << 6;
                packed[j] |= (m >> 4) << 6;
            }
        }
        for (j, w) in want.iter().enumerate() {
            assert_eq!(k4_scale_min(j, &packed), *w, "q4_k sub-block {j}");
        }
        // q3_k: scale i (6 bits, stored + 32) = nibble of byte i % 8 (low for i < 8) | 2 bits
        // of byte 8 + i % 4 at 2·(i / 4).
        let mut packed = [0u8; 12];
        for i in 0..16usize {
            let v = (i as u8 * 4 + 1) & 63;
            if i < 8 {
                packed[i] |= v & 0xF;
            } else {
                packed[i - 8] |= (v & 0xF) << 4;
            }
            packed[8 + i % 4] |= (v >> 4) << (2 * (i / 4));
        }
        for i in 0..16usize {
            assert_eq!(
                q3k_scale(i, &packed),
                ((i as i32 * 4 + 1) & 63) - 32,
                "q3_k {i}"
            );
        }
    }

    #[test]
    fn partial_blocks_and_wrong_lengths_are_errors() {
        let mut out = vec![0f32; 31];
        assert!(dequantize(DType::Q4_1, &[0u8; 20], &mut out).is_err());
        let mut out = vec![0f32; 32];
        assert!(dequantize(DType::Q4_1, &[0u8; 19], &mut out).is_err());
        assert!(quantize(DType::Q8_0, &[0.0; 33], &mut Vec::new()).is_err());
        let err = quantize(DType::Q4K, &[0.0; 576], &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("256-value super-blocks"), "{err}");
        let err = quantize(DType::Q3K, &[0.0; 256], &mut Vec::new()).unwrap_err();
        assert!(matches!(err, QuantError::NoEncoder { .. }), "{err}");
    }
}
