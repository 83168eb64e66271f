"""Type stubs of the native module ``gdsllm._gdsllm`` (Rust, PyO3)."""

import os
from typing import Any, Optional, Sequence, Union

__version__: str

class CudaUnavailableError(RuntimeError):
    """No usable GPU for what was asked (no libcuda, no such device, no libcufile, or a CUDA or
    cuFile call failed); the message says which."""

class ReadError(OSError):
    """A read of a file region failed; the message names the file and offset."""

class ModelFormatError(ValueError):
    """The directory is not a valid GdsLLM model."""

class GdsTensor:
    """A view into a buffer this package owns, exported through DLPack.

    ``torch.from_dlpack(t)``, ``numpy.from_dlpack(t)`` (CPU), ``cupy.from_dlpack(t)`` share the
    memory; it is freed when this object and every tensor made from it are gone."""

    def __dlpack__(
        self,
        stream: Optional[Any] = None,
        *,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str:
        """``float16``, ``bfloat16``, ``float32``, ``uint8``, ..."""
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> str:
        """``cpu`` or ``cuda:N``."""
    @property
    def io(self) -> str:
        """The I/O path that read the bytes: ``host``, ``cufile`` or ``bounce``."""
    @property
    def path(self) -> str: ...
    @property
    def offset(self) -> int:
        """Byte offset of the tensor in ``path``."""
    @property
    def quant_type(self) -> Optional[str]:
        """``q8_0``/``q4_0``/``q4_1`` for a quantized model tensor (raw uint8 blocks), else None."""
    @property
    def logical_shape(self) -> Optional[tuple[int, ...]]:
        """The shape of the values a quantized tensor's blocks encode, else None."""
    @property
    def cufile_registered(self) -> bool:
        """Whether the buffer is GPU memory registered with cuFile."""
    @property
    def data_ptr(self) -> int:
        """Address of element 0 (a device address for CUDA tensors)."""
    def tobytes(self) -> bytes:
        """A copy of the tensor's bytes (copied back from the GPU for CUDA tensors)."""

class GdsModel:
    """A GdsLLM model directory; each ``layer``/``blob`` call reads one blob into one buffer."""

    @property
    def path(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def config(self) -> dict[str, Any]: ...
    @property
    def blobs(self) -> list[dict[str, Any]]: ...
    def layer(self, i: int) -> dict[str, GdsTensor]: ...
    def blob(self, blob: Union[int, str]) -> dict[str, GdsTensor]: ...
    def read_tensor_bytes(self, blob: Union[int, str], name: str) -> bytes:
        """One tensor's bytes through the format crate's plain (buffered) reader."""

def gds_tensor(
    path: Union[str, os.PathLike[str]],
    shape: Sequence[int],
    dtype: str,
    offset: int = 0,
    device: str = "cuda:0",
    io: str = "auto",
) -> GdsTensor: ...
def open_model(
    dir: Union[str, os.PathLike[str]], device: str = "cuda:0", io: str = "auto"
) -> GdsModel: ...
def memory_stats() -> dict[str, int]:
    """``host_buffers``, ``host_bytes``, ``device_buffers``, ``device_bytes``, ``cufile_buffers``,
    ``cufile_files``: what is alive now."""
def cuda_status(device: int = 0) -> dict[str, Any]:
    """``available``, ``reason``, ``device_name``, ``cufile`` (gds/compat/unavailable: ...),
    ``gds_dma``. Never raises for a missing GPU."""
def release_io() -> None:
    """Frees the bounce rings' pinned memory and the cached readers; lets cuFile close."""
