//! `GdsTensor`: a view (shape, element type, offset) into a buffer the package owns, exported
//! through DLPack. Every `__dlpack__` call hands out a fresh managed tensor holding its own
//! reference to the buffer; the buffer is freed (and deregistered from cuFile) when the last
//! view and the last consumer's tensor are gone.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;

use dlpark::ffi::{DLDevice, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::dtype::ElementType;
use crate::errors::BridgeError;
use crate::io::{Placement, Region, parse_io, read_region};
use crate::storage::Storage;

/// A tensor whose bytes were read by gds-io into memory this package owns.
///
/// Hand it to any DLPack consumer: `torch.from_dlpack(t)`, `numpy.from_dlpack(t)` (CPU),
/// `cupy.from_dlpack(t)`, `jax.dlpack.from_dlpack(t)`. The consumer's tensor shares the
/// memory (no copy) and keeps it alive; the memory is freed once this object and every
/// consumer tensor made from it are gone. The bytes are in place when the object is returned
/// (reads are synchronous), so no stream synchronisation is needed.
#[pyclass(module = "gdsllm._gdsllm", name = "GdsTensor", frozen)]
pub struct GdsTensor {
    storage: Arc<Storage>,
    /// Byte offset of element 0 inside the buffer.
    data_offset: usize,
    shape: Vec<i64>,
    element: ElementType,
    /// For quantized tensors of a model: the stored dtype (`q4_1`, ...) and logical shape.
    quantized: Option<(weights_format::DType, Vec<u64>)>,
    source: Source,
}

/// Where a tensor's bytes came from.
#[derive(Debug, Clone)]
pub struct Source {
    pub path: PathBuf,
    /// Byte offset of the tensor in `path`.
    pub offset: u64,
    /// The I/O path that read it: `host`, `cufile` or `bounce`.
    pub io_path: &'static str,
}

impl GdsTensor {
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<i64>() as usize * self.element.size()
    }

    /// A view of `shape` × `element` at byte `skip` of the bytes `region` read, the tensor's
    /// bytes from `offset` of the file `path`.
    ///
    /// # Panics
    /// If the view does not lie inside the buffer (callers build views from checked ranges).
    pub fn in_region(
        region: &Region,
        skip: usize,
        shape: Vec<i64>,
        element: ElementType,
        quantized: Option<(weights_format::DType, Vec<u64>)>,
        path: PathBuf,
        offset: u64,
    ) -> GdsTensor {
        let tensor = GdsTensor {
            storage: Arc::clone(&region.storage),
            data_offset: region.data_offset + skip,
            shape,
            element,
            quantized,
            source: Source {
                path,
                offset,
                io_path: region.io_path,
            },
        };
        assert!(
            tensor.data_offset + tensor.nbytes() <= tensor.storage.len(),
            "view outside its buffer"
        );
        tensor
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let mut tensor = Dynamic::compact(self.shape.clone())
            .initialize_as::<M>(Arc::clone(&self.storage))
            .map_err(|err| PyRuntimeError::new_err(format!("DLPack export failed: {err}")))?;
        tensor
            .set_data(self.storage.address(self.data_offset))
            .set_device(self.storage.dl_device())
            .set_dtype(self.element.dlpack())
            .set_byte_offset(0);
        // SAFETY: the data pointer addresses `nbytes()` bytes inside the buffer (checked in
        // `view`), which the managed tensor keeps alive through its own Arc<Storage> until the
        // consumer calls the deleter; shape and strides live in the managed allocation; the
        // memory is writable and not a copy, as the (empty) flags say.
        Ok(unsafe { tensor.finish() })
    }
}

impl DlpackExporter for GdsTensor {
    fn device(&self) -> DLDevice {
        self.storage.dl_device()
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    /// Nothing to do on any stream: every read has landed before the tensor exists.
    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl GdsTensor {
    /// DLPack export (the Python array API protocol). `stream` is accepted and needs no
    /// action: the bytes are already in place.
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    /// `(device_type, device_id)`: `(1, 0)` for the CPU, `(2, N)` for CUDA device N.
    fn __dlpack_device__(&self) -> (u32, i32) {
        let device = self.storage.dl_device();
        (device.device_type.0, device.device_id)
    }

    /// The shape (row-major).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The element type: `float16`, `bfloat16`, `float32`, `uint8`, ...
    #[getter]
    fn dtype(&self) -> &'static str {
        self.element.name()
    }

    /// Bytes of the tensor's elements.
    #[getter(nbytes)]
    fn py_nbytes(&self) -> usize {
        self.nbytes()
    }

    /// `cpu` or `cuda:N`.
    #[getter]
    fn device(&self) -> String {
        let device = self.storage.dl_device();
        if device == DLDevice::CPU {
            Placement::Cpu.name()
        } else {
            Placement::Cuda(device.device_id as usize).name()
        }
    }

    /// The I/O path that read the bytes: `host`, `cufile` or `bounce`.
    #[getter]
    fn io(&self) -> &'static str {
        self.source.io_path
    }

    /// The file the bytes came from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.source.path.clone()
    }

    /// The byte offset in that file.
    #[getter]
    fn offset(&self) -> u64 {
        self.source.offset
    }

    /// For a quantized tensor of a model: its stored type (`q8_0`, `q4_0`, `q4_1`); else None.
    #[getter]
    fn quant_type(&self) -> Option<&'static str> {
        self.quantized.as_ref().map(|(dtype, _)| dtype.name())
    }

    /// For a quantized tensor of a model: the logical shape of the values its blocks encode
    /// (`shape` is that of the raw bytes); else None.
    #[getter]
    fn logical_shape<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        self.quantized
            .as_ref()
            .map(|(_, shape)| PyTuple::new(py, shape))
            .transpose()
    }

    /// Whether the buffer is GPU memory registered with cuFile (true for `io="cufile"` reads
    /// when registration succeeded).
    #[getter]
    fn cufile_registered(&self) -> bool {
        self.storage.is_registered()
    }

    /// The address of element 0 (a device address for CUDA tensors).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.storage.address(self.data_offset) as *const c_void as usize
    }

    /// A copy of the tensor's bytes as `bytes` (from the device for CUDA tensors).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let range = self.data_offset..self.data_offset + self.nbytes();
        let storage = Arc::clone(&self.storage);
        let bytes = py
            .detach(move || storage.copy_to_host(range))
            .map_err(BridgeError::from)?;
        Ok(PyBytes::new(py, &bytes))
    }

    fn __repr__(&self) -> String {
        let quant = self
            .quantized
            .as_ref()
            .map(|(dtype, shape)| {
                format!(", quant_type={:?}, logical_shape={shape:?}", dtype.name())
            })
            .unwrap_or_default();
        format!(
            "GdsTensor(shape={:?}, dtype={:?}, device={:?}, io={:?}{quant}, path={:?}, offset={})",
            self.shape,
            self.element.name(),
            self.device(),
            self.source.io_path,
            self.source.path.display().to_string(),
            self.source.offset,
        )
    }
}

/// Checks shape and offset against the element type and returns the byte count.
fn tensor_bytes(shape: &[i64], element: ElementType, offset: i64) -> Result<usize, BridgeError> {
    if let Some(bad) = shape.iter().find(|&&d| d < 0) {
        return Err(BridgeError::Invalid(format!(
            "shape {shape:?} has a negative dimension ({bad})"
        )));
    }
    if offset < 0 {
        return Err(BridgeError::Invalid(format!("offset {offset} is negative")));
    }
    if !(offset as u64).is_multiple_of(element.size() as u64) {
        return Err(BridgeError::Invalid(format!(
            "offset {offset} is not a multiple of the {}-byte size of {}: the elements would be \
             misaligned",
            element.size(),
            element.name()
        )));
    }
    shape
        .iter()
        .try_fold(element.size(), |bytes, &d| bytes.checked_mul(d as usize))
        .filter(|&bytes| bytes <= isize::MAX as usize)
        .ok_or_else(|| {
            BridgeError::Invalid(format!(
                "shape {shape:?} of {} is too large to address",
                element.name()
            ))
        })
}

/// Reads `prod(shape) × sizeof(dtype)` bytes at `offset` of `path` into memory on `device`
/// and returns them as a `GdsTensor` (see `gdsllm.gds_tensor` for the torch-returning form).
///
/// `device`: `"cpu"`, `"cuda"` or `"cuda:N"`. `io`: `"auto"` (cuFile where it does real DMA,
/// else the bounce ring), `"cufile"`, `"bounce"`, or `"host"` (O_DIRECT into host memory: the
/// only choice for the CPU, and for a GPU an O_DIRECT read plus a pageable copy). `offset` need
/// not be aligned (the read starts at the 4096-byte boundary below it) but must be a multiple
/// of the element size.
#[pyfunction]
#[pyo3(signature = (path, shape, dtype, offset=0, device="cuda:0", io="auto"))]
pub fn gds_tensor(
    py: Python<'_>,
    path: PathBuf,
    shape: Vec<i64>,
    dtype: &str,
    offset: i64,
    device: &str,
    io: &str,
) -> PyResult<GdsTensor> {
    let element = ElementType::parse(dtype).map_err(BridgeError::Invalid)?;
    let nbytes = tensor_bytes(&shape, element, offset)?;
    let placement = Placement::parse(device)?;
    let choice = parse_io(io)?;
    let offset = offset as u64;
    let read_path = path.clone();
    let region = py.detach(move || read_region(&read_path, offset, nbytes, placement, choice))?;
    if let Some(note) = &region.note {
        crate::warn(py, note)?;
    }
    Ok(GdsTensor::in_region(
        &region, 0, shape, element, None, path, offset,
    ))
}
