"""GdsLLM for Python: tensors whose bytes were read from NVMe into GPU memory by gds-io.

``gds_tensor(path, shape, dtype)`` reads a file region into memory this package owns -- a GPU
buffer filled through cuFile (GPUDirect Storage, or cuFile's compatibility mode) or the bounce
ring (O_DIRECT into pinned host memory, then an asynchronous copy), or aligned host memory for
``device="cpu"`` -- and hands it to PyTorch through DLPack: no ``torch.load``, no copy through
pageable RAM on the GPU path. ``open_model(dir)`` reads a GdsLLM model one blob (one layer) per
call, each into one buffer, and returns its tensors as views into that buffer.

Ownership: the package owns every buffer and exports it through DLPack with a deleter. A
buffer is freed -- and deregistered from cuFile -- when the last tensor using it (the
``GdsTensor``, and every ``torch``/``numpy``/``cupy`` tensor made from it) is gone.
``memory_stats()`` counts live buffers, bytes and cuFile registrations.

Without PyTorch the functions return the ``GdsTensor`` objects themselves, which any DLPack
consumer takes (``numpy.from_dlpack``, ``cupy.from_dlpack``, ``jax.dlpack.from_dlpack``).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Sequence, Union

from ._gdsllm import (
    CudaUnavailableError,
    GdsModel,
    GdsTensor,
    ModelFormatError,
    ReadError,
    __version__,
    cuda_status,
    memory_stats,
    release_io,
)
from ._gdsllm import gds_tensor as _native_gds_tensor
from ._gdsllm import open_model as _native_open_model

__all__ = [
    "CudaUnavailableError",
    "GdsModel",
    "GdsTensor",
    "Model",
    "ModelFormatError",
    "QuantizedTensor",
    "ReadError",
    "__version__",
    "cuda_status",
    "gds_tensor",
    "memory_stats",
    "open_model",
    "release_io",
]

DeviceLike = Union[str, int, Any]  # "cpu", "cuda", "cuda:1", 1, torch.device
DTypeLike = Union[str, Any]  # "float16", torch.float16, numpy.float16, numpy.dtype


def _torch():
    """The torch module when it can be imported, else None (imported lazily: it is optional)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _dtype_name(dtype: DTypeLike) -> str:
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)  # numpy.dtype
    if isinstance(name, str):
        return name
    if isinstance(dtype, type) and hasattr(dtype, "__name__"):  # numpy.float16 (a type)
        return dtype.__name__
    return str(dtype)  # torch.float16 -> "torch.float16"


def _device_name(device: DeviceLike) -> str:
    if isinstance(device, int):
        return f"cuda:{device}"
    text = str(device)  # torch.device("cuda", 1) -> "cuda:1"
    return text


def _export(tensor: GdsTensor, as_torch: bool | None):
    """``torch.from_dlpack(tensor)`` when torch is wanted (default: when it imports)."""
    torch = _torch() if as_torch is not False else None
    if as_torch and torch is None:
        raise ImportError("as_torch=True but torch cannot be imported")
    return torch.from_dlpack(tensor) if torch is not None else tensor


def gds_tensor(
    path: Union[str, os.PathLike],
    shape: Sequence[int],
    dtype: DTypeLike,
    offset: int = 0,
    device: DeviceLike = "cuda:0",
    io: str = "auto",
    *,
    as_torch: bool | None = None,
):
    """Reads ``prod(shape) * itemsize`` bytes at ``offset`` of ``path`` into a new tensor.

    Args:
        path: the file.
        shape: row-major shape; the tensor is contiguous.
        dtype: ``torch.float16``, ``numpy.float32``, ``"bfloat16"``, ``"uint8"``, ... (bool,
            (u)int8/16/32/64, float16, bfloat16, float32, float64).
        offset: byte offset in the file; any multiple of the element size (the read starts at
            the 4096-byte boundary below it).
        device: ``"cuda:N"`` (default GPU 0), ``"cuda"``, ``N``, a ``torch.device``, or
            ``"cpu"``.
        io: how bytes reach the GPU: ``"auto"`` (cuFile where it does real GPUDirect DMA, else
            the bounce ring; cuFile failing to register the file falls back to bounce with a
            ``RuntimeWarning``), ``"cufile"`` (fails if cuFile cannot read the file),
            ``"bounce"``, or ``"host"`` (O_DIRECT into pageable host memory, then a copy; the
            only choice for ``device="cpu"``).
        as_torch: return a ``torch.Tensor`` (default: when torch imports) or the
            :class:`GdsTensor` itself (``False``).

    Returns:
        A ``torch.Tensor`` sharing the package's buffer, or the :class:`GdsTensor`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: bad shape, dtype, offset, device or io, or a range past the end of file.
        CudaUnavailableError: a CUDA device was asked for and none is usable (or cuFile, for
            ``io="cufile"``); the message says why.
        ReadError: the read itself failed.
    """
    tensor = _native_gds_tensor(
        os.fspath(path),
        [int(d) for d in shape],
        _dtype_name(dtype),
        int(offset),
        _device_name(device),
        io,
    )
    return _export(tensor, as_torch)


class QuantizedTensor(NamedTuple):
    """A quantized tensor of a model: its raw GGUF-layout blocks and what they encode.

    ``data`` is a uint8 tensor of shape ``[*outer_dims, bytes_per_row]``; ``qtype`` is the
    block type (``"q8_0"``, ``"q4_0"``, ``"q4_1"``; layouts in weights-format/FORMAT.md);
    ``shape`` is the logical shape of the values. Dequantizing is the caller's business.
    """

    data: Any
    qtype: str
    shape: tuple


class Model:
    """A GdsLLM model directory whose blobs are read one per call into device memory.

    Each :meth:`layer` (or :meth:`blob`) call does one read of one blob file into one buffer
    and returns its tensors as views into that buffer: the buffer is freed when the last of
    them is gone. Float tensors come with the dtype and shape of metadata.json; quantized
    tensors as :class:`QuantizedTensor`. Safe to call from several threads (reads release the
    GIL), e.g. to prefetch the next layer while this one computes.
    """

    def __init__(self, native: GdsModel, as_torch: bool | None = None):
        self.native = native
        self._as_torch = as_torch

    @property
    def path(self) -> str:
        """The model directory."""
        return str(self.native.path)

    @property
    def device(self) -> str:
        """Where blobs are read to: ``"cpu"`` or ``"cuda:N"``."""
        return self.native.device

    @property
    def n_layers(self) -> int:
        """Number of transformer layers."""
        return self.native.n_layers

    @property
    def config(self) -> dict:
        """metadata.json's ``config`` (hidden_size, n_heads, rope_theta, ...)."""
        return self.native.config

    @property
    def blobs(self) -> list:
        """Every blob in streaming order, with its tensors, as in metadata.json."""
        return self.native.blobs

    def _convert(self, tensors: dict) -> dict:
        out = {}
        for name, tensor in tensors.items():
            data = _export(tensor, self._as_torch)
            if tensor.quant_type is not None:
                out[name] = QuantizedTensor(data, tensor.quant_type, tuple(tensor.logical_shape))
            else:
                out[name] = data
        return out

    def layer(self, i: int) -> dict:
        """Layer ``i``'s tensors by name (``attn_norm``, ``attn_q``, ..., ``ffn_down``)."""
        return self._convert(self.native.layer(i))

    def blob(self, blob: Union[int, str]) -> dict:
        """A blob's tensors, by file name (``"embed.bin"``, ``"output.bin"``) or position."""
        return self._convert(self.native.blob(blob))

    def embed(self) -> dict:
        """``embed.bin``: ``{"token_embd": ...}``."""
        return self.blob("embed.bin")

    def output(self) -> dict:
        """``output.bin``: ``{"output_norm": ...}`` and ``"output"`` unless tied."""
        return self.blob("output.bin")

    def __repr__(self) -> str:
        return repr(self.native).replace("GdsModel(", "Model(", 1)


def open_model(
    dir: Union[str, os.PathLike],
    device: DeviceLike = "cuda:0",
    io: str = "auto",
    *,
    as_torch: bool | None = None,
) -> Model:
    """Opens a GdsLLM model directory for reading its blobs into ``device`` memory.

    metadata.json is validated against the blob files (sizes, offsets, shapes) without reading
    them. ``device``, ``io`` and ``as_torch`` as for :func:`gds_tensor`.

    Raises:
        FileNotFoundError: no metadata.json (not a model directory) or a blob is missing.
        ModelFormatError: metadata.json and the blobs disagree; the message names the place.
        ValueError: bad device or io.
    """
    native = _native_open_model(os.fspath(dir), _device_name(device), io)
    return Model(native, as_torch)
