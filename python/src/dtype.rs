//! Element types a tensor can be exported with, by the names Python users write.

use dlpark::ffi::{DLDataType, DLDataTypeCode};
use weights_format::DType;

/// The element type of an exported tensor (one DLPack scalar type each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementType {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    Bf16,
    F32,
    F64,
}

/// Every element type with its canonical (PyTorch/NumPy) name and the other names accepted.
const NAMES: &[(ElementType, &str, &[&str])] = &[
    (ElementType::Bool, "bool", &[]),
    (ElementType::U8, "uint8", &["u8"]),
    (ElementType::I8, "int8", &["i8"]),
    (ElementType::U16, "uint16", &["u16"]),
    (ElementType::I16, "int16", &["i16", "short"]),
    (ElementType::U32, "uint32", &["u32"]),
    (ElementType::I32, "int32", &["i32", "int"]),
    (ElementType::U64, "uint64", &["u64"]),
    (ElementType::I64, "int64", &["i64", "long"]),
    (ElementType::F16, "float16", &["f16", "half"]),
    (ElementType::Bf16, "bfloat16", &["bf16"]),
    (ElementType::F32, "float32", &["f32", "float"]),
    (ElementType::F64, "float64", &["f64", "double"]),
];

impl ElementType {
    /// Parses `float16`, `torch.float16`, `f16`, `half`, ... (case-insensitive).
    pub fn parse(name: &str) -> Result<ElementType, String> {
        let wanted = name.trim().to_ascii_lowercase();
        let wanted = wanted.strip_prefix("torch.").unwrap_or(&wanted);
        NAMES
            .iter()
            .find(|(_, canonical, aliases)| *canonical == wanted || aliases.contains(&wanted))
            .map(|(element, _, _)| *element)
            .ok_or_else(|| {
                let known: Vec<&str> = NAMES.iter().map(|(_, canonical, _)| *canonical).collect();
                format!(
                    "unknown dtype {name:?}: expected one of {} (or a torch/numpy dtype)",
                    known.join(", ")
                )
            })
    }

    /// The canonical name, as `torch` and `numpy` spell it.
    pub fn name(self) -> &'static str {
        NAMES
            .iter()
            .find(|(element, _, _)| *element == self)
            .map(|(_, canonical, _)| *canonical)
            .expect("every element type has a name")
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElementType::Bool | ElementType::U8 | ElementType::I8 => 1,
            ElementType::U16 | ElementType::I16 | ElementType::F16 | ElementType::Bf16 => 2,
            ElementType::U32 | ElementType::I32 | ElementType::F32 => 4,
            ElementType::U64 | ElementType::I64 | ElementType::F64 => 8,
        }
    }

    /// The DLPack descriptor of one element.
    pub fn dlpack(self) -> DLDataType {
        let code = match self {
            ElementType::Bool => DLDataTypeCode::BOOL,
            ElementType::U8 | ElementType::U16 | ElementType::U32 | ElementType::U64 => {
                DLDataTypeCode::UINT
            }
            ElementType::I8 | ElementType::I16 | ElementType::I32 | ElementType::I64 => {
                DLDataTypeCode::INT
            }
            ElementType::F16 | ElementType::F32 | ElementType::F64 => DLDataTypeCode::FLOAT,
            ElementType::Bf16 => DLDataTypeCode::BFLOAT,
        };
        DLDataType::scalar(code, (self.size() * 8) as u8)
    }

    /// How a tensor stored as `dtype` in a GdsLLM model is exported: its float type, or raw
    /// bytes (`uint8`) for quantized blocks.
    pub fn of_stored(dtype: DType) -> ElementType {
        match dtype {
            DType::F32 => ElementType::F32,
            DType::F16 => ElementType::F16,
            DType::Bf16 => ElementType::Bf16,
            // Every other dtype is quantized blocks (q8_0 … q4_1, the k-quants).
            _ => ElementType::U8,
        }
    }
}
