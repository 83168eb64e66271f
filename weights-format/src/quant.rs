//! Conversion between f32 and each [`DType`]'s bytes, one row (or any whole number of blocks)
//! at a time. These are the slow, obviously correct definitions of the layouts; fast kernels
//! elsewhere are tested against them.

use half::{bf16, f16};

use crate::DType;

/// Why a conversion could not be done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{dtype}: {values} values is not a whole number of {block}-value blocks")]
    PartialBlock {
        dtype: DType,
        values: usize,
        block: usize,
    },
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

/// Decodes `src` (whole blocks of `dtype`) into `dst`, whose length is the number of values.
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check(dtype, dst.len(), src.len())?;
    match dtype {
        DType::F32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Bf16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Q8_0 => {
            for (o, b) in dst.chunks_exact_mut(32).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    o[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
        DType::Q4_0 => {
            for (o, b) in dst.chunks_exact_mut(32).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    let q = b[2 + j];
                    o[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in dst.chunks_exact_mut(32).zip(src.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..16 {
                    let q = b[4 + j];
                    o[j] = (q & 0xF) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
    }
    Ok(())
}

/// Encodes `src` as `dtype`, appending to `dst`. Quantized types use llama.cpp's reference
/// quantizers (`quantize_row_*_ref`), so re-quantizing their output is stable.
pub fn quantize(dtype: DType, src: &[f32], dst: &mut Vec<u8>) -> Result<(), QuantError> {
    let block = dtype.block_len();
    if !src.len().is_multiple_of(block) {
        return Err(QuantError::PartialBlock {
            dtype,
            values: src.len(),
            block,
        });
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
        DType::Q8_0 => {
            for x in src.chunks_exact(32) {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                dst.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                dst.extend(x.iter().map(|v| ((v * id).round() as i8) as u8));
            }
        }
        DType::Q4_0 => {
            for x in src.chunks_exact(32) {
                // The value of largest magnitude maps to -8, keeping its sign.
                let max = x
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                dst.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                for j in 0..16 {
                    let q0 = ((x[j] * id + 8.5) as i32).min(15) as u8;
                    let q1 = ((x[j + 16] * id + 8.5) as i32).min(15) as u8;
                    dst.push(q0 | (q1 << 4));
                }
            }
        }
        DType::Q4_1 => {
            for x in src.chunks_exact(32) {
                let min = x.iter().copied().fold(f32::INFINITY, f32::min);
                let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                dst.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                dst.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                for j in 0..16 {
                    let q0 = (((x[j] - min) * id + 0.5) as i32).min(15) as u8;
                    let q1 = (((x[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
                    dst.push(q0 | (q1 << 4));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_error_is_within_half_a_step() {
        let src: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for dtype in DType::ALL {
            let mut bytes = Vec::new();
            quantize(dtype, &src, &mut bytes).unwrap();
            assert_eq!(bytes.len() as u64, dtype.byte_len(&[256]).unwrap());
            let mut back = vec![0f32; src.len()];
            dequantize(dtype, &bytes, &mut back).unwrap();
            let max_diff = src
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // Block amplitude is ~7.1. Q4_1: a step is 2*7.1/15, half of it ~0.48. Q4_0 maps
            // the largest magnitude to -8, so the opposite extreme clamps at +7: one whole step
            // (7.1/8 ~ 0.89) of error there, as in llama.cpp.
            let tol = match dtype {
                DType::F32 => 0.0,
                DType::F16 => 4e-3,
                DType::Bf16 => 3e-2,
                DType::Q8_0 => 0.03,
                DType::Q4_1 => 0.5,
                DType::Q4_0 => 0.9,
            };
            println!("{dtype}: max |x - deq(q(x))| = {max_diff:.5} (tolerance {tol})");
            assert!(max_diff <= tol, "{dtype}: {max_diff} > {tol}");
        }
    }

    #[test]
    fn partial_blocks_and_wrong_lengths_are_errors() {
        let mut out = vec![0f32; 31];
        assert!(dequantize(DType::Q4_1, &[0u8; 20], &mut out).is_err());
        let mut out = vec![0f32; 32];
        assert!(dequantize(DType::Q4_1, &[0u8; 19], &mut out).is_err());
        assert!(quantize(DType::Q8_0, &[0.0; 33], &mut Vec::new()).is_err());
    }
}
