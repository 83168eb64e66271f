//! `gdsllm._gdsllm`: the native half of the `gdsllm` Python package.
//!
//! This crate is for: reading file regions and GdsLLM model blobs with gds-io (cuFile, the
//! bounce ring, or O_DIRECT into host memory) into memory the package owns — one gds-io device
//! buffer, or one aligned host buffer, per read — and exporting views of it through DLPack, so
//! that PyTorch, NumPy, CuPy or JAX use the bytes in place. The buffer is freed, and
//! deregistered from cuFile, by the DLPack deleter of the last tensor using it. Live buffers,
//! bytes and cuFile registrations are counted (`memory_stats`) so that tests can check that
//! memory comes back.
//!
//! It is not for: running models (that is the `llama` crate, which this crate does not depend
//! on; `examples/inference_demo.py` runs transformers on the tensors), planning what stays
//! resident (`residency`), or dequantizing (quantized tensors are exported as raw blocks).
//!
//! CUDA is loaded at run time (cudarc's dynamic loading, cufile-sys), so the wheel builds and
//! imports without CUDA and raises `CudaUnavailableError` only when GPU memory is asked for.

mod dtype;
mod errors;
mod io;
mod model;
mod storage;
mod tensor;

use pyo3::exceptions::PyRuntimeWarning;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Issues a Python `RuntimeWarning` with `message`.
pub(crate) fn warn(py: Python<'_>, message: &str) -> PyResult<()> {
    let message =
        std::ffi::CString::new(message.replace('\0', " ")).expect("NUL bytes were replaced above");
    PyErr::warn(py, &py.get_type::<PyRuntimeWarning>(), &message, 1)
}

/// Live memory and cuFile registrations of this package, for checking that memory comes back:
/// `host_buffers`, `host_bytes`, `device_buffers`, `device_bytes` (buffers alive: held by a
/// `GdsTensor` or by a consumer's tensor made from one), `cufile_buffers` and `cufile_files`
/// (cuFile registrations in force; 0 while cuFile is not open).
#[pyfunction]
fn memory_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let memory = storage::live_memory();
    let registrations = io::live_registrations();
    let stats = PyDict::new(py);
    stats.set_item("host_buffers", memory.host_buffers)?;
    stats.set_item("host_bytes", memory.host_bytes)?;
    stats.set_item("device_buffers", memory.device_buffers)?;
    stats.set_item("device_bytes", memory.device_bytes)?;
    stats.set_item("cufile_buffers", registrations.buffers)?;
    stats.set_item("cufile_files", registrations.file_handles)?;
    Ok(stats)
}

/// Whether CUDA device `device` opens here, and what cuFile offers there: a dict with
/// `available` (bool), `reason` (why not, or None), `device_name`, `cufile` (`"gds"` for real
/// DMA, `"compat"` for cuFile's compatibility mode, or `"unavailable: <reason>"`) and
/// `gds_dma` (bool). Never raises for a missing GPU.
#[pyfunction]
#[pyo3(signature = (device=0))]
fn cuda_status(py: Python<'_>, device: usize) -> io::CudaStatus {
    py.detach(move || io::cuda_status(device))
}

/// Releases what the package keeps open between reads: the bounce rings' pinned host memory,
/// the cached readers and its hold on the cuFile driver. Tensors alive keep their memory.
#[pyfunction]
fn release_io(py: Python<'_>) {
    py.detach(io::release);
}

#[pymodule]
fn _gdsllm(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(tensor::gds_tensor, module)?)?;
    module.add_function(wrap_pyfunction!(model::open_model, module)?)?;
    module.add_function(wrap_pyfunction!(memory_stats, module)?)?;
    module.add_function(wrap_pyfunction!(cuda_status, module)?)?;
    module.add_function(wrap_pyfunction!(release_io, module)?)?;
    module.add_class::<tensor::GdsTensor>()?;
    module.add_class::<model::GdsModel>()?;
    errors::register(module)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
