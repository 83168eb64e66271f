//! A reader for GGUF files (versions 2 and 3), written from the format description rather than
//! borrowed from a crate so that every length field is checked against the file before it is
//! trusted.
//!
//! The header (metadata key/values and tensor infos) is parsed into memory; tensor data is
//! never loaded wholesale: [`GgufFile::read_tensor`] does one positioned read per tensor. Large
//! arrays (a tokenizer's ~100k strings) are checked while the header is read but kept as the
//! file's bytes, and become [`GgufValue`]s only if asked for as such: the typed accessors read
//! them in place, so opening a file does not allocate a string per token.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use weights_format::DType;

mod split;
pub use split::{SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, SplitName, split_name};

/// The first four bytes of every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml allows at most this many dimensions per tensor.
pub const MAX_DIMS: u32 = 4;
/// Arrays nested deeper than this are refused, so a crafted file cannot exhaust the stack.
const MAX_ARRAY_NESTING: u32 = 8;
/// Top-level arrays of scalars or strings with at least this many elements are kept as bytes.
const RAW_ARRAY_MIN: u64 = 256;

/// Why a GGUF file could not be read. Every variant names the file; most name the byte offset
/// or the metadata key involved.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: not a GGUF file: magic at offset 0 is {found:02x?}, expected \"GGUF\"")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: GGUF version {version} at offset 4 is not supported (only 2 and 3)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error(
        "{path}: truncated at offset {offset}: {what} needs {needed} bytes but the file ends at {file_len}"
    )]
    Truncated {
        path: PathBuf,
        offset: u64,
        needed: u64,
        file_len: u64,
        what: String,
    },
    #[error("{path}: offset {offset}: {what}")]
    Invalid {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error("{path}: metadata key {key} appears twice (second at offset {offset})")]
    DuplicateKey {
        path: PathBuf,
        key: String,
        offset: u64,
    },
    #[error(
        "{path}: {} tensors have ggml types this converter does not support: {} (supported: {})",
        tensors.iter().map(|t| t.2).sum::<usize>(),
        tensors.iter().map(|(id, name, count, example)| format!("{name} (type {id}) ×{count} (e.g. {example})")).collect::<Vec<_>>().join(", "),
        supported_type_names()
    )]
    UnsupportedTensorTypes {
        path: PathBuf,
        /// Per unsupported type, in type-id order: its ggml id and name, how many tensors
        /// have it, and the first of them.
        tensors: Vec<(u32, &'static str, usize, String)>,
    },
    #[error(
        "{path}: tensor {tensor}: data at offsets {start}..{end} lies outside the file (length {file_len}; truncated?)"
    )]
    TensorOutOfBounds {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("{path}: missing metadata key {key}")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: metadata key {key} is {found}, expected {expected}")]
    WrongKeyType {
        path: PathBuf,
        key: String,
        found: String,
        expected: &'static str,
    },
    #[error("{path}: no tensor named {tensor}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: split GGUF: {reason}")]
    Split { path: PathBuf, reason: String },
}

/// The type tag of a metadata value (GGUF `gguf_metadata_value_type`, 0–12).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum GgufValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufValueType {
    pub fn from_id(id: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes a value of this type occupies, used to reject array counts the rest
    /// of the file could not possibly hold before allocating for them.
    fn min_encoded_len(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type and elements (all of that type; arrays may nest).
    Array(GgufValueType, Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(..) => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// Any integer value that fits in a u64 (GGUF writers disagree on integer widths).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value as i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// Any float or integer value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        match self {
            GgufValue::Array(t, v) => format!("an array of {} {:?}", v.len(), t),
            other => format!("a {:?}", other.value_type()),
        }
    }
}

/// The ggml type id of one of our dtypes: every dtype is a ggml type, block layout included.
pub fn ggml_type_id(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q2K => 10,
        DType::Q3K => 11,
        DType::Q4K => 12,
        DType::Q5K => 13,
        DType::Q6K => 14,
        DType::Iq4Nl => 20,
        DType::Iq4Xs => 23,
        DType::Bf16 => 30,
    }
}

/// The element types this converter can carry over (the inverse of [`ggml_type_id`]).
pub fn dtype_from_ggml(type_id: u32) -> Option<DType> {
    DType::ALL.into_iter().find(|d| ggml_type_id(*d) == type_id)
}

/// The names of the ggml types [`dtype_from_ggml`] accepts, for error messages.
pub fn supported_type_names() -> String {
    (0..64)
        .filter(|&id| dtype_from_ggml(id).is_some())
        .map(ggml_type_name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// ggml's name for a type id, for error messages.
pub fn ggml_type_name(type_id: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2 (removed)",
        "Q4_3 (removed)",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(type_id as usize).copied().unwrap_or("unknown")
}

/// One tensor's description from the header.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    pub dtype: DType,
    /// Row-major (outermost first): GGUF stores dimensions innermost first; they are reversed.
    pub shape: Vec<u64>,
    /// Absolute byte offset of the data in the file.
    pub file_offset: u64,
    /// Byte length of the data.
    pub length: u64,
    /// The part of a split GGUF whose file holds the data (0: the first, or the only file;
    /// see [`GgufFile::part_paths`]); `file_offset` is within that part.
    pub part: usize,
}

/// An opened GGUF file: its parsed header and a handle for positioned reads of tensor data.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    file: File,
    file_len: u64,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Slot)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Tensors whose ggml type has no [`DType`]: (name, type id), in file order. They are left
    /// out of `tensors` (their sizes are unknown, so they are not bounds-checked either) and
    /// reported all at once by [`GgufFile::check_tensor_types`].
    unsupported: Vec<(String, u32)>,
    /// The other parts of a split GGUF opened with [`GgufFile::open_model`], in order (the
    /// second part first); empty for a single file.
    other_parts: Vec<(PathBuf, File)>,
}

/// A metadata value as kept in memory.
#[derive(Debug)]
enum Slot {
    Parsed(GgufValue),
    Raw(RawArray),
}

impl Slot {
    fn value(&self) -> &GgufValue {
        match self {
            Slot::Parsed(v) => v,
            Slot::Raw(raw) => raw.value(),
        }
    }
}

/// A large array of scalars or strings, kept as encoded in the file (strings with their u64
/// length prefixes). Checked when the header was read: every string is UTF-8 and every bool
/// 0 or 1, so reading it cannot fail.
struct RawArray {
    elem: GgufValueType,
    count: usize,
    bytes: Vec<u8>,
    value: OnceLock<GgufValue>,
}

impl std::fmt::Debug for RawArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawArray")
            .field("elem", &self.elem)
            .field("count", &self.count)
            .field("bytes", &self.bytes.len())
            .finish_non_exhaustive()
    }
}

impl RawArray {
    /// The array as a [`GgufValue`], built on first use.
    fn value(&self) -> &GgufValue {
        self.value.get_or_init(|| {
            let items = match self.elem {
                GgufValueType::String => self
                    .strs()
                    .map(|s| GgufValue::String(s.to_string()))
                    .collect(),
                _ => self.scalars().collect(),
            };
            GgufValue::Array(self.elem, items)
        })
    }

    /// The elements of a string array.
    fn strs(&self) -> impl Iterator<Item = &str> {
        debug_assert_eq!(self.elem, GgufValueType::String);
        let mut rest = self.bytes.as_slice();
        (0..self.count).map(move |_| {
            let (len, tail) = rest.split_at(8);
            let len = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
            let (s, tail) = tail.split_at(len);
            rest = tail;
            std::str::from_utf8(s).expect("checked when the header was read")
        })
    }

    /// The elements of an array of scalars.
    fn scalars(&self) -> impl Iterator<Item = GgufValue> {
        let size = self.elem.min_encoded_len() as usize;
        self.bytes
            .chunks_exact(size)
            .map(|b| decode_scalar(self.elem, b))
    }
}

/// A scalar from its `min_encoded_len()` little-endian bytes (a bool byte already checked).
fn decode_scalar(t: GgufValueType, b: &[u8]) -> GgufValue {
    use GgufValueType as T;
    let b8 = || <[u8; 8]>::try_from(b).expect("8 bytes");
    let b4 = || <[u8; 4]>::try_from(b).expect("4 bytes");
    let b2 = || <[u8; 2]>::try_from(b).expect("2 bytes");
    match t {
        T::U8 => GgufValue::U8(b[0]),
        T::I8 => GgufValue::I8(b[0] as i8),
        T::Bool => GgufValue::Bool(b[0] != 0),
        T::U16 => GgufValue::U16(u16::from_le_bytes(b2())),
        T::I16 => GgufValue::I16(i16::from_le_bytes(b2())),
        T::U32 => GgufValue::U32(u32::from_le_bytes(b4())),
        T::I32 => GgufValue::I32(i32::from_le_bytes(b4())),
        T::F32 => GgufValue::F32(f32::from_le_bytes(b4())),
        T::U64 => GgufValue::U64(u64::from_le_bytes(b8())),
        T::I64 => GgufValue::I64(i64::from_le_bytes(b8())),
        T::F64 => GgufValue::F64(f64::from_le_bytes(b8())),
        T::String | T::Array => unreachable!("{t:?} is not a scalar type"),
    }
}

/// Sequential reader over the header with every read checked against the file length.
struct HeaderReader<'a> {
    reader: BufReader<&'a File>,
    pos: u64,
    file_len: u64,
    path: &'a Path,
}

impl HeaderReader<'_> {
    fn need(&self, needed: u64, what: &dyn Fn() -> String) -> Result<(), GgufError> {
        if self.file_len.saturating_sub(self.pos) < needed {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                offset: self.pos,
                needed,
                file_len: self.file_len,
                what: what(),
            });
        }
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        self.need(N as u64, what)?;
        let mut buf = [0u8; N];
        self.read_into(&mut buf)?;
        Ok(buf)
    }

    /// Fills `buf`; callers have checked with [`HeaderReader::need`] that the file holds it.
    fn read_into(&mut self, buf: &mut [u8]) -> Result<(), GgufError> {
        self.reader
            .read_exact(buf)
            .map_err(|source| GgufError::Io {
                path: self.path.to_path_buf(),
                error: source,
            })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        // Checking against the bytes left bounds the allocation by the file size.
        self.need(len, what)?;
        let start = self.pos;
        let mut buf = vec![0u8; len as usize];
        self.read_into(&mut buf)?;
        String::from_utf8(buf).map_err(|_| self.not_utf8(start, what))
    }

    fn not_utf8(&self, offset: u64, what: &dyn Fn() -> String) -> GgufError {
        GgufError::Invalid {
            path: self.path.to_path_buf(),
            offset,
            what: format!("{} is not valid UTF-8", what()),
        }
    }

    /// Reads an array's element type and count, refusing counts the file cannot hold.
    fn array_header(
        &mut self,
        depth: u32,
        what: &dyn Fn() -> String,
    ) -> Result<(GgufValueType, u64), GgufError> {
        let offset = self.pos;
        if depth >= MAX_ARRAY_NESTING {
            return Err(self.invalid(
                offset,
                format!(
                    "{}: arrays nested more than {MAX_ARRAY_NESTING} deep",
                    what()
                ),
            ));
        }
        let type_id = self.u32(what)?;
        let elem_type = GgufValueType::from_id(type_id).ok_or_else(|| {
            self.invalid(offset, format!("{}: array element type {type_id}", what()))
        })?;
        let count_offset = self.pos;
        let count = self.u64(what)?;
        let min_len = count.checked_mul(elem_type.min_encoded_len());
        match min_len {
            Some(n) if n <= self.file_len.saturating_sub(self.pos) => Ok((elem_type, count)),
            _ => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                offset: count_offset,
                needed: min_len.unwrap_or(u64::MAX),
                file_len: self.file_len,
                what: format!("{} (array of {count} {elem_type:?})", what()),
            }),
        }
    }

    /// Reads the elements of an array of scalars or strings as they are encoded, checking
    /// them exactly as [`HeaderReader::value`] would.
    fn raw_array(
        &mut self,
        elem: GgufValueType,
        count: u64,
        what: &dyn Fn() -> String,
    ) -> Result<RawArray, GgufError> {
        let mut bytes = Vec::new();
        if elem == GgufValueType::String {
            self.raw_strings(count, what, &mut bytes)?;
        } else {
            let len = count * elem.min_encoded_len();
            self.need(len, what)?;
            let start = self.pos;
            bytes.resize(len as usize, 0);
            self.read_into(&mut bytes)?;
            if elem == GgufValueType::Bool
                && let Some(i) = bytes.iter().position(|&b| b > 1)
            {
                return Err(self.invalid(
                    start + i as u64,
                    format!("{}: bool byte {}", what(), bytes[i]),
                ));
            }
        }
        Ok(RawArray {
            elem,
            count: count as usize,
            bytes,
            value: OnceLock::new(),
        })
    }

    /// Appends `count` length-prefixed strings to `out`. The strings that lie whole in the read
    /// buffer are checked there and copied in one go; one that crosses its end takes the
    /// checked path of [`HeaderReader::string`].
    fn raw_strings(
        &mut self,
        count: u64,
        what: &dyn Fn() -> String,
        out: &mut Vec<u8>,
    ) -> Result<(), GgufError> {
        let mut left = count;
        while left > 0 {
            let buf = self.reader.buffer();
            let mut used = 0usize;
            let mut bad_utf8 = None;
            while left > 0 {
                let Some(len) = buf.get(used..used + 8) else {
                    break;
                };
                let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
                let start = used + 8;
                let Some(end) = usize::try_from(len)
                    .ok()
                    .and_then(|len| start.checked_add(len))
                    .filter(|&end| end <= buf.len())
                else {
                    break;
                };
                if std::str::from_utf8(&buf[start..end]).is_err() {
                    bad_utf8 = Some(start);
                    break;
                }
                used = end;
                left -= 1;
            }
            out.extend_from_slice(&buf[..used]);
            self.reader.consume(used);
            self.pos += used as u64;
            if let Some(start) = bad_utf8 {
                return Err(self.not_utf8(self.pos + (start - used) as u64, what));
            }
            if left == 0 {
                break;
            }
            // The next string crosses the end of the buffer.
            let len = self.u64(what)?;
            self.need(len, what)?;
            let start = self.pos;
            out.extend_from_slice(&len.to_le_bytes());
            let at = out.len();
            out.resize(at + len as usize, 0);
            self.read_into(&mut out[at..])?;
            if std::str::from_utf8(&out[at..]).is_err() {
                return Err(self.not_utf8(start, what));
            }
            left -= 1;
        }
        Ok(())
    }

    fn value(
        &mut self,
        value_type: GgufValueType,
        depth: u32,
        what: &dyn Fn() -> String,
    ) -> Result<GgufValue, GgufError> {
        use GgufValueType as T;
        Ok(match value_type {
            T::Bool => {
                let offset = self.pos;
                match self.bytes::<1>(what)?[0] {
                    b @ (0 | 1) => GgufValue::Bool(b == 1),
                    b => {
                        return Err(self.invalid(offset, format!("{}: bool byte {b}", what())));
                    }
                }
            }
            T::String => GgufValue::String(self.string(what)?),
            T::Array => {
                let (elem_type, count) = self.array_header(depth, what)?;
                self.array_items(elem_type, count, depth, what)?
            }
            scalar => {
                let mut buf = [0u8; 8];
                let buf = &mut buf[..scalar.min_encoded_len() as usize];
                self.need(buf.len() as u64, what)?;
                self.read_into(buf)?;
                decode_scalar(scalar, buf)
            }
        })
    }

    /// The elements of an array at `depth` whose header has been read.
    fn array_items(
        &mut self,
        elem_type: GgufValueType,
        count: u64,
        depth: u32,
        what: &dyn Fn() -> String,
    ) -> Result<GgufValue, GgufError> {
        let mut items = Vec::with_capacity(count as usize);
        for _ in 0..count {
            items.push(self.value(elem_type, depth + 1, what)?);
        }
        Ok(GgufValue::Array(elem_type, items))
    }

    fn invalid(&self, offset: u64, what: String) -> GgufError {
        GgufError::Invalid {
            path: self.path.to_path_buf(),
            offset,
            what,
        }
    }
}

impl GgufFile {
    /// Opens `path` and parses its header. Tensor data is only checked to lie inside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            error: source,
        };
        let file = File::open(&path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut r = HeaderReader {
            reader: BufReader::with_capacity(1 << 20, &file),
            pos: 0,
            file_len,
            path: &path,
        };

        let magic = r.bytes::<4>(&|| "the magic".into())?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                path: path.clone(),
                found: magic,
            });
        }
        let version = r.u32(&|| "the version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion {
                path: path.clone(),
                version,
            });
        }
        let tensor_count_offset = r.pos;
        let tensor_count = r.u64(&|| "the tensor count".into())?;
        let kv_count_offset = r.pos;
        let kv_count = r.u64(&|| "the metadata count".into())?;
        // Each KV needs at least a key length, a type and a 1-byte value; each tensor info at
        // least a name length, n_dims, type and offset. Refuse counts the file cannot hold.
        let left = file_len.saturating_sub(r.pos);
        if kv_count.checked_mul(13).is_none_or(|n| n > left) {
            return Err(r.invalid(
                kv_count_offset,
                format!("metadata count {kv_count} cannot fit in the {left} bytes that follow"),
            ));
        }
        if tensor_count.checked_mul(24).is_none_or(|n| n > left) {
            return Err(r.invalid(
                tensor_count_offset,
                format!("tensor count {tensor_count} cannot fit in the {left} bytes that follow"),
            ));
        }

        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut key_index = HashMap::with_capacity(kv_count as usize);
        for i in 0..kv_count {
            let key_offset = r.pos;
            let key = r.string(&|| format!("metadata key #{i}"))?;
            let what = || format!("metadata key {key}");
            let type_offset = r.pos;
            let type_id = r.u32(&what)?;
            let value_type = GgufValueType::from_id(type_id).ok_or_else(|| {
                r.invalid(
                    type_offset,
                    format!("metadata key {key}: value type {type_id} (valid: 0-12)"),
                )
            })?;
            let value = if value_type == GgufValueType::Array {
                let (elem, count) = r.array_header(0, &what)?;
                if count >= RAW_ARRAY_MIN && elem != GgufValueType::Array {
                    Slot::Raw(r.raw_array(elem, count, &what)?)
                } else {
                    Slot::Parsed(r.array_items(elem, count, 0, &what)?)
                }
            } else {
                Slot::Parsed(r.value(value_type, 0, &what)?)
            };
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey {
                    path: path.clone(),
                    key,
                    offset: key_offset,
                });
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.value().as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::WrongKeyType {
                        path: path.clone(),
                        key: "general.alignment".into(),
                        found: v.value().describe(),
                        expected: "a power of two",
                    });
                }
            },
        };

        struct RawInfo {
            name: String,
            type_id: u32,
            dims: Vec<u64>,
            offset: u64,
            info_offset: u64,
        }
        let mut raw = Vec::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let info_offset = r.pos;
            let name = r.string(&|| format!("tensor info #{i} name"))?;
            let what = || format!("tensor info of {name}");
            let dims_offset = r.pos;
            let n_dims = r.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.invalid(
                    dims_offset,
                    format!("tensor {name}: {n_dims} dimensions (valid: 1-{MAX_DIMS})"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&what)?);
            }
            let type_id = r.u32(&what)?;
            let offset = r.u64(&what)?;
            raw.push(RawInfo {
                name,
                type_id,
                dims,
                offset,
                info_offset,
            });
        }
        let data_offset = r.pos.div_ceil(alignment) * alignment;

        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::with_capacity(raw.len());
        let mut unsupported = Vec::new();
        // GGUF (and ggml's reader) lay tensors out back to back in header order, each padded to
        // the alignment: where the next one must start. An offset elsewhere means an overlap, a
        // gap, or an earlier tensor whose type or shape does not match its bytes. After a
        // tensor of a type we cannot size the layout is unknown; such a file is refused anyway
        // (`check_tensor_types`), naming every unsupported type.
        let mut next_offset = Some(0u64);
        let mut last_padding = 0u64;
        for t in raw {
            let Some(dtype) = dtype_from_ggml(t.type_id) else {
                unsupported.push((t.name, t.type_id));
                next_offset = None;
                continue;
            };
            let shape: Vec<u64> = t.dims.iter().rev().copied().collect();
            let length = dtype.byte_len(&shape).ok_or_else(|| GgufError::Invalid {
                path: path.clone(),
                offset: t.info_offset,
                what: format!(
                    "tensor {}: shape {shape:?}: {}",
                    t.name,
                    dtype
                        .row_error(shape.last().copied().unwrap_or(1))
                        .unwrap_or_else(|| "the size overflows".into())
                ),
            })?;
            if t.offset % alignment != 0 {
                return Err(GgufError::Invalid {
                    path: path.clone(),
                    offset: t.info_offset,
                    what: format!(
                        "tensor {}: data offset {} is not a multiple of the alignment {alignment}",
                        t.name, t.offset
                    ),
                });
            }
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(length));
            let (Some(start), Some(end)) = (start, end) else {
                return Err(GgufError::TensorOutOfBounds {
                    path: path.clone(),
                    tensor: t.name,
                    start: t.offset,
                    end: u64::MAX,
                    file_len,
                });
            };
            if end > file_len {
                return Err(GgufError::TensorOutOfBounds {
                    path: path.clone(),
                    tensor: t.name,
                    start,
                    end,
                    file_len,
                });
            }
            if let Some(expected) = next_offset {
                if t.offset != expected {
                    return Err(GgufError::Invalid {
                        path: path.clone(),
                        offset: t.info_offset,
                        what: format!(
                            "tensor {}: data offset {} where the previous tensors end at \
                             {expected} (tensors follow each other in header order, each padded \
                             to {alignment} bytes: this one overlaps another, leaves a gap, or an \
                             earlier tensor's type or shape does not match its bytes)",
                            t.name, t.offset
                        ),
                    });
                }
                let padded = length.div_ceil(alignment).checked_mul(alignment);
                let Some(after) = padded.and_then(|p| expected.checked_add(p)) else {
                    return Err(GgufError::TensorOutOfBounds {
                        path: path.clone(),
                        tensor: t.name,
                        start,
                        end: u64::MAX,
                        file_len,
                    });
                };
                last_padding = after - expected - length;
                next_offset = Some(after);
            }
            if tensor_index.insert(t.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Invalid {
                    path: path.clone(),
                    offset: t.info_offset,
                    what: format!("tensor {} appears twice", t.name),
                });
            }
            tensors.push(GgufTensorInfo {
                name: t.name,
                dtype,
                shape,
                file_offset: start,
                length,
                part: 0,
            });
        }

        // The data section is exactly the tensors (the last one's padding may be cut off at the
        // end of the file): bytes beyond it belong to no tensor, which is what a tensor whose
        // type was changed to a smaller one leaves behind.
        if let Some(end) = next_offset.filter(|_| !tensors.is_empty()) {
            let data_len = file_len.saturating_sub(data_offset);
            if data_len > end || data_len < end - last_padding {
                return Err(GgufError::Invalid {
                    path: path.clone(),
                    offset: data_offset,
                    what: format!(
                        "the data section holds {data_len} bytes but its {} tensors take {} \
                         (plus up to {last_padding} bytes of final padding): a tensor's type or \
                         shape does not match its bytes",
                        tensors.len(),
                        end - last_padding
                    ),
                });
            }
        }
        drop(r);
        Ok(GgufFile {
            path,
            file,
            file_len,
            version,
            alignment,
            data_offset,
            metadata,
            key_index,
            tensors,
            tensor_index,
            unsupported,
            other_parts: Vec::new(),
        })
    }

    /// Fails when any tensor has a ggml type this converter cannot carry, listing every such
    /// type with its count (so one run tells everything that is missing).
    pub fn check_tensor_types(&self) -> Result<(), GgufError> {
        if self.unsupported.is_empty() {
            return Ok(());
        }
        let mut by_type: std::collections::BTreeMap<u32, (usize, &str)> = Default::default();
        for (name, type_id) in &self.unsupported {
            by_type.entry(*type_id).or_insert((0, name)).0 += 1;
        }
        Err(GgufError::UnsupportedTensorTypes {
            path: self.path.clone(),
            tensors: by_type
                .into_iter()
                .map(|(id, (count, first))| (id, ggml_type_name(id), count, first.to_string()))
                .collect(),
        })
    }

    /// Names and ggml type ids of the tensors whose type has no [`DType`], in file order.
    pub fn unsupported_tensors(&self) -> &[(String, u32)] {
        &self.unsupported
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v.value()))
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.slot(key).map(Slot::value)
    }

    fn slot(&self, key: &str) -> Option<&Slot> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// All tensor infos in file order (those of a supported type; see
    /// [`GgufFile::unsupported_tensors`]).
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    fn missing(&self, key: &str) -> GgufError {
        GgufError::MissingKey {
            path: self.path.clone(),
            key: key.into(),
        }
    }

    fn wrong(&self, key: &str, value: &GgufValue, expected: &'static str) -> GgufError {
        GgufError::WrongKeyType {
            path: self.path.clone(),
            key: key.into(),
            found: value.describe(),
            expected,
        }
    }

    /// A required non-negative integer that fits in u32.
    pub fn require_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.opt_u32(key)?.ok_or_else(|| self.missing(key))
    }

    /// An optional non-negative integer that fits in u32.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| self.wrong(key, v, "an integer in 0..2^32")),
        }
    }

    /// A required number (float or integer).
    pub fn require_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.opt_f32(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|v| Some(v as f32))
                .ok_or_else(|| self.wrong(key, v, "a number")),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(key, v, "a bool")),
        }
    }

    pub fn require_str(&self, key: &str) -> Result<&str, GgufError> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(key, v, "a string")),
        }
    }

    /// An optional array whose elements are all strings.
    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        if let Some(Slot::Raw(raw)) = self.slot(key)
            && raw.elem == GgufValueType::String
        {
            return Ok(Some(raw.strs().collect()));
        }
        match self.get(key) {
            None => Ok(None),
            Some(v @ GgufValue::Array(_, items)) => items
                .iter()
                .map(GgufValue::as_str)
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(|| self.wrong(key, v, "an array of strings")),
            Some(v) => Err(self.wrong(key, v, "an array of strings")),
        }
    }

    /// An optional array of integers.
    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        if let Some(Slot::Raw(raw)) = self.slot(key)
            && raw.elem != GgufValueType::String
        {
            return raw
                .scalars()
                .map(|v| v.as_i64())
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(|| self.wrong(key, raw.value(), "an array of integers"));
        }
        match self.get(key) {
            None => Ok(None),
            Some(v @ GgufValue::Array(_, items)) => items
                .iter()
                .map(GgufValue::as_i64)
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(|| self.wrong(key, v, "an array of integers")),
            Some(v) => Err(self.wrong(key, v, "an array of integers")),
        }
    }

    /// An optional array of numbers.
    pub fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        if let Some(Slot::Raw(raw)) = self.slot(key)
            && raw.elem != GgufValueType::String
        {
            return raw
                .scalars()
                .map(|v| v.as_f64().map(|x| x as f32))
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(|| self.wrong(key, raw.value(), "an array of numbers"));
        }
        match self.get(key) {
            None => Ok(None),
            Some(v @ GgufValue::Array(_, items)) => items
                .iter()
                .map(|x| x.as_f64().map(|x| x as f32))
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(|| self.wrong(key, v, "an array of numbers")),
            Some(v) => Err(self.wrong(key, v, "an array of numbers")),
        }
    }

    /// Reads one tensor's bytes into `buf` (resized to the tensor's length) with one
    /// positioned read.
    pub fn read_tensor(&self, info: &GgufTensorInfo, buf: &mut Vec<u8>) -> Result<(), GgufError> {
        buf.resize(info.length as usize, 0);
        let (path, file) = match info.part.checked_sub(1) {
            None => (&self.path, &self.file),
            Some(i) => {
                let (path, file) = &self.other_parts[i];
                (path, file)
            }
        };
        file.read_exact_at(buf, info.file_offset)
            .map_err(|source| GgufError::Io {
                path: path.clone(),
                error: source,
            })
    }
}
