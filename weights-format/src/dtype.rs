use serde::{Deserialize, Serialize};

/// Element type of a tensor. Quantized types use the GGUF block layouts bit for bit:
///
/// - `Q8_0`: 32 values in 34 bytes: f16 `d`, i8 `qs[32]`; `x = qs * d`.
/// - `Q4_0`: 32 values in 18 bytes: f16 `d`, u8 `qs[16]`; `x[j] = ((qs[j] & 0xF) - 8) * d`,
///   `x[j+16] = ((qs[j] >> 4) - 8) * d`.
/// - `Q4_1`: 32 values in 20 bytes: f16 `d`, f16 `m`, u8 `qs[16]`; `x[j] = (qs[j] & 0xF) * d + m`,
///   `x[j+16] = (qs[j] >> 4) * d + m`.
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
}

impl DType {
    /// Every element type, in declaration order.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ];

    /// Values per block (1 for plain floats).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::Bf16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
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
        }
    }

    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
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
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
