//! `GdsModel`: a GdsLLM model directory (validated by `weights_format::Model::open`) whose
//! blobs are read one per call, each into one buffer, and handed out as named tensor views.

use std::path::PathBuf;

use gds_io::IoChoice;
use pyo3::exceptions::{PyIndexError, PyKeyError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use weights_format::{BlobMeta, Model};

use crate::dtype::ElementType;
use crate::errors::BridgeError;
use crate::io::{Placement, parse_io, read_region};
use crate::tensor::GdsTensor;

/// A GdsLLM model directory opened for reading blobs into `device` memory.
#[pyclass(module = "gdsllm._gdsllm", name = "GdsModel", frozen)]
pub struct GdsModel {
    model: Model,
    placement: Placement,
    choice: IoChoice,
}

/// The exported shape of a stored tensor: its own for floats; for quantized blocks the raw
/// bytes, `[outer dims..., bytes per row]`.
fn exported_shape(meta: &weights_format::TensorMeta) -> Vec<i64> {
    let mut shape: Vec<i64> = meta.shape.iter().map(|&d| d as i64).collect();
    if meta.dtype.is_quantized()
        && let Some(inner) = shape.last_mut()
    {
        *inner = *inner / meta.dtype.block_len() as i64 * meta.dtype.block_bytes() as i64;
    }
    shape
}

fn json_to_python<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use pyo3::IntoPyObjectExt;
    Ok(match value {
        serde_json::Value::Null => py.None().into_bound(py),
        serde_json::Value::Bool(b) => b.into_bound_py_any(py)?,
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => i.into_bound_py_any(py)?,
            (None, Some(u), _) => u.into_bound_py_any(py)?,
            (_, _, f) => f.unwrap_or(f64::NAN).into_bound_py_any(py)?,
        },
        serde_json::Value::String(s) => s.into_bound_py_any(py)?,
        serde_json::Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(json_to_python(py, item)?)?;
            }
            list.into_any()
        }
        serde_json::Value::Object(map) => {
            let dict = PyDict::new(py);
            for (key, item) in map {
                dict.set_item(key, json_to_python(py, item)?)?;
            }
            dict.into_any()
        }
    })
}

fn to_python<'py>(py: Python<'py>, value: &impl serde::Serialize) -> PyResult<Bound<'py, PyAny>> {
    // Through the JSON text, as metadata.json holds it: `to_value` would widen an f32 such as
    // rms_norm_eps = 1e-5 to 9.999999747378752e-06.
    let value: serde_json::Value = serde_json::to_string(value)
        .and_then(|text| serde_json::from_str(&text))
        .map_err(|err| BridgeError::Invalid(format!("cannot describe the model: {err}")))?;
    json_to_python(py, &value)
}

impl GdsModel {
    fn blob_index(&self, blob: &Bound<'_, PyAny>) -> PyResult<usize> {
        let count = self.model.blob_count();
        if let Ok(index) = blob.extract::<i64>() {
            let index = if index < 0 {
                index + count as i64
            } else {
                index
            };
            return usize::try_from(index)
                .ok()
                .filter(|&i| i < count)
                .ok_or_else(|| {
                    PyIndexError::new_err(format!(
                        "blob index {index} out of range: the model has {count} blobs"
                    ))
                });
        }
        let name: String = blob.extract()?;
        self.model.metadata().blob_index(&name).ok_or_else(|| {
            PyKeyError::new_err(format!(
                "no blob {name:?} in {} (blobs: embed.bin, layer_NNN.bin, output.bin)",
                self.model.dir().display()
            ))
        })
    }

    /// Reads blob `index` with one read into one buffer and returns its tensors as views.
    fn read_blob<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyDict>> {
        let blob: &BlobMeta = self.model.blob(index);
        let path = self.model.blob_path(index);
        let (placement, choice, len) = (self.placement, self.choice, blob.length as usize);
        let read_path = path.clone();
        let region = py.detach(move || read_region(&read_path, 0, len, placement, choice))?;
        if let Some(note) = &region.note {
            crate::warn(py, note)?;
        }
        let tensors = PyDict::new(py);
        for meta in &blob.tensors {
            let quantized = meta
                .dtype
                .is_quantized()
                .then(|| (meta.dtype, meta.shape.clone()));
            // The region holds the whole blob, from offset 0 of its file.
            let view = GdsTensor::in_region(
                &region,
                meta.offset as usize,
                exported_shape(meta),
                ElementType::of_stored(meta.dtype),
                quantized,
                path.clone(),
                meta.offset,
            );
            tensors.set_item(&meta.name, view)?;
        }
        Ok(tensors)
    }
}

#[pymethods]
impl GdsModel {
    /// The model directory.
    #[getter]
    fn path(&self) -> PathBuf {
        self.model.dir().to_path_buf()
    }

    /// Where blobs are read to: `cpu` or `cuda:N`.
    #[getter]
    fn device(&self) -> String {
        self.placement.name()
    }

    /// Number of transformer layers.
    #[getter]
    fn n_layers(&self) -> u32 {
        self.model.config().n_layers
    }

    /// The model's hyper-parameters (metadata.json's `config`) as a dict.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, self.model.config())
    }

    /// Every blob in streaming order: dicts of `file`, `length`, `checksum` and `tensors`
    /// (each `name`, `dtype`, `shape`, `offset`, `length`), as in metadata.json.
    #[getter]
    fn blobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.model.metadata().blobs)
    }

    /// Layer `i`'s tensors (`attn_q`, ..., `ffn_down`): one read of `layer_NNN.bin` into one
    /// buffer, each tensor a view into it.
    fn layer<'py>(&self, py: Python<'py>, i: i64) -> PyResult<Bound<'py, PyDict>> {
        let n_layers = self.model.config().n_layers as i64;
        if !(0..n_layers).contains(&i) {
            return Err(PyIndexError::new_err(format!(
                "layer {i} out of range: the model has {n_layers} layers (0..{n_layers})"
            )));
        }
        self.read_blob(py, self.model.layer_blob(i as usize))
    }

    /// A blob's tensors by file name (`embed.bin`, `layer_007.bin`, `output.bin`) or by
    /// position in `blobs` (negative counts from the end).
    fn blob<'py>(&self, py: Python<'py>, blob: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        let index = self.blob_index(blob)?;
        self.read_blob(py, index)
    }

    /// The bytes of one tensor as the format crate's plain reader reads them (a buffered read,
    /// not gds-io): a reference for tests and tools.
    fn read_tensor_bytes<'py>(
        &self,
        py: Python<'py>,
        blob: &Bound<'py, PyAny>,
        name: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let index = self.blob_index(blob)?;
        let bytes = self
            .model
            .read_tensor(index, name)
            .map_err(BridgeError::from)?;
        Ok(PyBytes::new(py, &bytes))
    }

    fn __repr__(&self) -> String {
        let c = self.model.config();
        format!(
            "GdsModel(path={:?}, layers={}, hidden_size={}, blobs={}, bytes={}, device={:?})",
            self.model.dir().display().to_string(),
            c.n_layers,
            c.hidden_size,
            self.model.blob_count(),
            self.model.total_bytes(),
            self.placement.name()
        )
    }
}

/// Opens a GdsLLM model directory (validating metadata.json against the blobs, without
/// reading them) for reading blobs into `device` memory through `io`.
#[pyfunction]
#[pyo3(signature = (dir, device="cuda:0", io="auto"))]
pub fn open_model(py: Python<'_>, dir: PathBuf, device: &str, io: &str) -> PyResult<GdsModel> {
    let placement = Placement::parse(device)?;
    let choice = parse_io(io)?;
    let model = py
        .detach(move || Model::open(dir))
        .map_err(BridgeError::from)?;
    Ok(GdsModel {
        model,
        placement,
        choice,
    })
}
