use serde::{Deserialize, Serialize};

/// Element type of a tensor. Quantized types use the GGUF (ggml) block layouts bit for bit;
/// `FORMAT.md` gives every layout and how its values decode, and [`crate::quant`] is the
/// reference decoder. In short:
///
/// - `Q8_0`: 32 values in 34 bytes: f16 `d`, i8 `qs[32]`; `x = qs * d`.
/// - `Q4_0`: 32 values in 18 bytes: f16 `d`, u8 `qs[16]`; `x[j] = ((qs[j] & 0xF) - 8) * d`,
///   `x[j+16] = ((qs[j] >> 4) - 8) * d`.
/// - `Q4_1`: 32 values in 20 bytes: f16 `d`, f16 `m`, u8 `qs[16]`; `x[j] = (qs[j] & 0xF) * d + m`,
///   `x[j+16] = (qs[j] >> 4) * d + m`.
/// - `Q5_0`, `Q5_1`: as `Q4_0`/`Q4_1` with a fifth bit per value in a u32 `qh` (22 / 24 bytes).
/// - `Iq4Nl`: 32 values in 18 bytes, 4-bit indices into a fixed non-linear table.
/// - The k-quants `Q2K` … `Q6K` and `Iq4Xs`: 256-value super-blocks with per-sub-block scales
///   (84, 110, 144, 176, 210 and 136 bytes).
///
/// Blocks run along the innermost (last) dimension, so each row of a quantized matrix is a
/// whole number of blocks and rows can be moved without dequantizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
    #[serde(rename = "q8_0")]
    Q8_0,
    #[serde(rename = "q4_0")]
    Q4_0,
    #[serde(rename = "q4_1")]
    Q4_1,
    #[serde(rename = "q5_0")]
    Q5_0,
    #[serde(rename = "q5_1")]
    Q5_1,
    #[serde(rename = "q2_k")]
    Q2K,
    #[serde(rename = "q3_k")]
    Q3K,
    #[serde(rename = "q4_k")]
    Q4K,
    #[serde(rename = "q5_k")]
    Q5K,
    #[serde(rename = "q6_k")]
    Q6K,
    #[serde(rename = "iq4_nl")]
    Iq4Nl,
    #[serde(rename = "iq4_xs")]
    Iq4Xs,
}

/// Values per super-block of the k-quants (ggml's `QK_K`).
pub const QK_K: usize = 256;

impl DType {
    /// Every dtype, in the order of their introduction. New dtypes go at the end: the CUDA
    /// kernels number the dtypes by their position here.
    pub const ALL: [DType; 15] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Iq4Nl,
        DType::Iq4Xs,
    ];

    /// Values per block (1 for plain floats).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::Bf16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Iq4Nl => {
                32
            }
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K | DType::Iq4Xs => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
            DType::Iq4Nl => 18,
            DType::Iq4Xs => 136,
        }
    }

    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Whether this is one of the 256-value super-block types (k-quants and IQ4_XS).
    pub const fn is_super_block(self) -> bool {
        self.block_len() == QK_K
    }

    /// The oldest `metadata.json` format version that has this dtype: 1 for the original six,
    /// 3 for those added with the k-quants (version 2 added the family fields). A writer stamps
    /// a model with the highest version any of its tensors needs (at least 2), so models
    /// without the new types stay readable by builds that predate them.
    pub const fn format_version(self) -> u32 {
        match self {
            DType::F32 | DType::F16 | DType::Bf16 | DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 1,
            _ => 3,
        }
    }

    /// The name used in `metadata.json` and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
            DType::Iq4Nl => "iq4_nl",
            DType::Iq4Xs => "iq4_xs",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(name))
    }

    /// Byte length of a tensor of this dtype and row-major `shape`, or `None` when the
    /// innermost dimension is not a whole number of blocks or the size overflows.
    pub fn byte_len(self, shape: &[u64]) -> Option<u64> {
        let inner = *shape.last().unwrap_or(&1);
        let block = self.block_len() as u64;
        if !inner.is_multiple_of(block) {
            return None;
        }
        let mut blocks: u64 = inner / block;
        for &d in &shape[..shape.len().saturating_sub(1)] {
            blocks = blocks.checked_mul(d)?;
        }
        blocks.checked_mul(self.block_bytes() as u64)
    }

    /// Why rows of `cols` values cannot be stored as this dtype, when they cannot: the message
    /// says the block size (for the k-quants, that a row must be whole 256-value super-blocks).
    pub fn row_error(self, cols: u64) -> Option<String> {
        if cols.is_multiple_of(self.block_len() as u64) {
            return None;
        }
        Some(if self.is_super_block() {
            format!(
                "rows of {cols} values cannot be stored as {self}: a row must be a whole number \
                 of {QK_K}-value super-blocks ({cols} is not a multiple of {QK_K})"
            )
        } else {
            format!(
                "rows of {cols} values cannot be stored as {self}: a row must be a whole number \
                 of {}-value blocks",
                self.block_len()
            )
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_serde_agrees() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
            assert_eq!(
                serde_json::to_string(&d).unwrap(),
                format!("\"{}\"", d.name())
            );
        }
    }

    #[test]
    fn super_block_rows_must_be_whole() {
        assert_eq!(DType::Q4K.byte_len(&[2, 512]), Some(2 * 2 * 144));
        assert_eq!(DType::Q4K.byte_len(&[2, 576]), None);
        let msg = DType::Q6K.row_error(576).unwrap();
        assert!(msg.contains("256-value super-blocks"), "{msg}");
        assert!(DType::Q5_0.row_error(576).is_none());
    }
}
