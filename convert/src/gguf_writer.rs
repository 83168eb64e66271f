//! A minimal GGUF (version 3) writer, the mirror image of [`crate::gguf`]. It exists so tests
//! (here and in other crates) can build small GGUF files with known contents, including the
//! llama.cpp Q/K row permutation ([`permute_rows_like_llama_cpp`]); it is not a general
//! exporter.

use std::io::Write;

use weights_format::DType;

use crate::gguf::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufValue, ggml_type_id};

/// A GGUF file under construction, held in memory.
#[derive(Debug, Default)]
pub struct GgufBuilder {
    metadata: Vec<(String, GgufValue)>,
    /// name, ggml type id, row-major shape, bytes
    tensors: Vec<(String, u32, Vec<u64>, Vec<u8>)>,
}

impl GgufBuilder {
    pub fn new() -> GgufBuilder {
        GgufBuilder::default()
    }

    pub fn kv(&mut self, key: &str, value: GgufValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Replaces the value of `key` (added if absent).
    pub fn set_kv(&mut self, key: &str, value: GgufValue) -> &mut Self {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
        self
    }

    /// Adds a tensor of one of our dtypes with row-major `shape`.
    pub fn tensor(&mut self, name: &str, dtype: DType, shape: &[u64], data: Vec<u8>) -> &mut Self {
        self.tensor_raw(name, ggml_type_id(dtype), shape, data)
    }

    /// Adds a tensor with an arbitrary ggml type id (to test rejection of unsupported types).
    pub fn tensor_raw(
        &mut self,
        name: &str,
        type_id: u32,
        shape: &[u64],
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors
            .push((name.to_string(), type_id, shape.to_vec(), data));
        self
    }

    /// Names of the tensors added so far, in header order.
    pub fn tensor_names(&self) -> Vec<String> {
        self.tensors.iter().map(|t| t.0.clone()).collect()
    }

    /// Serialises the file. Tensor data is aligned to `general.alignment` when that key is
    /// set, otherwise to 32 bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = self
            .metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(DEFAULT_ALIGNMENT);
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut out, key);
            out.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, type_id, shape, data) in &self.tensors {
            write_string(&mut out, name);
            out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
            for d in shape.iter().rev() {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(alignment) * alignment;
        }
        let data_start = (out.len() as u64).div_ceil(alignment) * alignment;
        out.resize(data_start as usize, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(data);
        }
        out
    }

    pub fn write_to(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::fs::File::create(path)?.write_all(&self.to_bytes())
    }

    /// The file split into `parts` parts the way llama.cpp's `gguf-split --split-max-tensors`
    /// splits it: the tensors in order, as evenly as they go; the first part with all the
    /// metadata and the `split.*` keys, the others with the `split.*` keys only. Write part
    /// `i` (from 0) as `NAME-{i+1:05}-of-{parts:05}.gguf`.
    pub fn split(&self, parts: usize) -> Vec<GgufBuilder> {
        use crate::gguf::{SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT};
        let per_part = self.tensors.len().div_ceil(parts.max(1)).max(1);
        let mut chunks = self.tensors.chunks(per_part);
        (0..parts)
            .map(|i| {
                let mut part = GgufBuilder::new();
                if i == 0 {
                    part.metadata = self.metadata.clone();
                }
                part.set_kv(SPLIT_NO, GgufValue::U16(i as u16))
                    .set_kv(SPLIT_COUNT, GgufValue::U16(parts as u16))
                    .set_kv(
                        SPLIT_TENSORS_COUNT,
                        GgufValue::I32(self.tensors.len() as i32),
                    );
                part.tensors = chunks.next().unwrap_or_default().to_vec();
                part
            })
            .collect()
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.push(*v),
        GgufValue::I8(v) => out.push(*v as u8),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(*v as u8),
        GgufValue::String(s) => write_string(out, s),
        GgufValue::Array(elem_type, items) => {
            out.extend_from_slice(&(*elem_type as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// Reorders the rows of a Q or K projection (`rows` rows of `row_bytes` bytes each) the way
/// llama.cpp's `convert_hf_to_gguf.py` does: per head, `reshape(n_head, 2, rows/n_head/2,
/// cols).swapaxes(1, 2)`, i.e. the two rotary halves of each head are interleaved.
pub fn permute_rows_like_llama_cpp(data: &[u8], n_head: usize, row_bytes: usize) -> Vec<u8> {
    let rows = data.len() / row_bytes;
    let head_rows = rows / n_head;
    let half = head_rows / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let dst = h * head_rows + i * 2 + j;
                let src = h * head_rows + j * half + i;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}
