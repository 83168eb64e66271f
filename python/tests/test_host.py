"""gds_tensor into host memory (device="cpu", the host backend's O_DIRECT reads), checked against
the file's bytes through numpy.from_dlpack; bad inputs; buffers returned when tensors die.

Needs numpy and the installed gdsllm wheel; no GPU, no torch (gdsllm then returns GdsTensor
objects, which numpy takes through DLPack)."""

import gc
import os
import random

import numpy as np
import pytest

import gdsllm

# The element types numpy can take through DLPack (numpy has no bfloat16; see test_bfloat16).
DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "float32", "float64"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """A file of random bytes with an unaligned length (the last 4 KiB block is partial)."""
    rng = random.Random(20)
    data = rng.randbytes(3 * (1 << 20) + 12345)
    path = tmp_path_factory.mktemp("gds") / "weights.bin"
    path.write_bytes(data)
    return path, data


def host_tensor(path, shape, dtype, offset=0):
    return gdsllm.gds_tensor(path, shape, dtype, offset, device="cpu", as_torch=False)


def random_shape(rng, max_elements):
    """A shape of 0 to 3 dimensions (sizes 0 to 300) with at most max_elements elements."""
    while True:
        shape = [rng.randint(0, 300) for _ in range(rng.randint(0, 3))]
        if int(np.prod(shape)) <= max_elements:
            return shape


def test_random_regions_equal_the_file_bytes(data_file):
    path, data = data_file
    rng = random.Random(1)
    for case in range(300):
        dtype = rng.choice(DTYPES)
        size = np.dtype(dtype).itemsize
        # Aligned, block-crossing and tail offsets, always a multiple of the element size.
        offset = rng.choice([0, 4096, rng.randrange(0, len(data)), len(data) - rng.randrange(0, 5000)])
        offset = max(0, offset - offset % size)
        max_elements = (len(data) - offset) // size
        shape = random_shape(rng, max_elements)
        tensor = host_tensor(path, shape, dtype, offset)
        array = np.from_dlpack(tensor)
        nbytes = int(np.prod(shape)) * size
        assert array.dtype == np.dtype(dtype), case
        assert list(array.shape) == shape, case
        assert tensor.shape == tuple(shape) and tensor.nbytes == nbytes
        assert tensor.device == "cpu" and tensor.io == "host" and tensor.offset == offset
        expected = data[offset:offset + nbytes]
        assert array.tobytes() == expected, f"case {case}: {dtype} {shape} at {offset}"
        assert tensor.tobytes() == expected


def test_whole_file_and_its_last_byte(data_file):
    path, data = data_file
    whole = np.from_dlpack(host_tensor(path, [len(data)], "uint8"))
    assert whole.tobytes() == data
    last = np.from_dlpack(host_tensor(path, [1], "uint8", len(data) - 1))
    assert last.tobytes() == data[-1:]
    empty = np.from_dlpack(host_tensor(path, [0], "float32", len(data) - len(data) % 4))
    assert empty.shape == (0,)


def test_dtype_spellings(data_file):
    path, data = data_file
    for spelling in ["float16", "torch.float16", "f16", "half", np.float16, np.dtype("float16")]:
        tensor = host_tensor(path, [8], spelling, 4096)
        assert tensor.dtype == "float16", spelling
        assert tensor.tobytes() == data[4096:4112]


def test_bfloat16(data_file):
    """numpy has no bfloat16: the tensor's own description and bytes are checked instead (the
    GPU tests read bfloat16 through torch)."""
    path, data = data_file
    tensor = host_tensor(path, [3, 5], "bfloat16", 8190)
    assert tensor.dtype == "bfloat16" and tensor.shape == (3, 5) and tensor.nbytes == 30
    assert tensor.tobytes() == data[8190:8220]
    assert tensor.__dlpack_device__() == (1, 0)


def test_bad_inputs_raise_with_the_reason(data_file, tmp_path):
    path, data = data_file
    missing = tmp_path / "absent.bin"
    with pytest.raises(FileNotFoundError, match="absent.bin"):
        host_tensor(missing, [4], "float32")
    with pytest.raises(ValueError, match="is a directory"):
        host_tensor(tmp_path, [4], "float32")
    with pytest.raises(ValueError, match="beyond the end of the file"):
        host_tensor(path, [len(data) // 4 + 1], "float32")
    with pytest.raises(ValueError, match="beyond the end of the file"):
        host_tensor(path, [2], "uint8", len(data) - 1)
    with pytest.raises(ValueError, match="negative dimension"):
        host_tensor(path, [4, -1], "float32")
    with pytest.raises(ValueError, match="offset -4 is negative"):
        host_tensor(path, [4], "float32", -4)
    with pytest.raises(ValueError, match="not a multiple of the 4-byte size of float32"):
        host_tensor(path, [4], "float32", 4098)
    with pytest.raises(ValueError, match="unknown dtype \"complex64\""):
        host_tensor(path, [4], "complex64")
    with pytest.raises(ValueError, match="too large"):
        host_tensor(path, [1 << 40, 1 << 40], "float32")
    with pytest.raises(ValueError, match="unknown device \"tpu:0\""):
        gdsllm.gds_tensor(path, [4], "float32", device="tpu:0", as_torch=False)
    with pytest.raises(ValueError, match="invalid I/O path \"nvme\""):
        gdsllm.gds_tensor(path, [4], "float32", device="cpu", io="nvme", as_torch=False)
    with pytest.raises(ValueError, match="io=\"cufile\" reads into GPU memory"):
        gdsllm.gds_tensor(path, [4], "float32", device="cpu", io="cufile", as_torch=False)


def test_cuda_without_a_gpu_raises_cuda_unavailable(data_file):
    """On a machine without CUDA (CI), asking for GPU memory raises with the reason; on a GPU
    machine the read succeeds (the GPU tests check its bytes)."""
    path, _ = data_file
    status = gdsllm.cuda_status()
    if status["available"]:
        pytest.skip(f"a GPU is usable here ({status['device_name']}): covered by test_gpu.py")
    with pytest.raises(gdsllm.CudaUnavailableError, match="no usable GPU") as err:
        gdsllm.gds_tensor(path, [4], "float32", device="cuda:0", as_torch=False)
    assert status["reason"] in str(err.value)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_comes_back_after_a_create_delete_loop(data_file):
    """Buffers are freed when the last holder (GdsTensor, numpy array, unconsumed capsule) goes:
    the counters return to where they started and the process does not grow by what was read."""
    path, data = data_file
    gc.collect()
    before = gdsllm.memory_stats()
    rss_before = rss_bytes()
    nbytes = (len(data) // 4096) * 4096  # 3 MiB per tensor, 600 MiB over the loop
    for i in range(200):
        tensor = host_tensor(path, [nbytes // 4], "float32")
        array = np.from_dlpack(tensor)
        during = gdsllm.memory_stats()
        assert during["host_buffers"] == before["host_buffers"] + 1
        assert during["host_bytes"] == before["host_bytes"] + nbytes
        del tensor  # the array still holds the buffer
        assert gdsllm.memory_stats()["host_buffers"] == before["host_buffers"] + 1
        assert array[-1:].tobytes() == data[nbytes - 4:nbytes]
        del array
        assert gdsllm.memory_stats() == before, f"iteration {i}"
    # A capsule that no consumer took is freed with the capsule.
    capsule = host_tensor(path, [1024], "uint8").__dlpack__()
    assert gdsllm.memory_stats()["host_buffers"] == before["host_buffers"] + 1
    del capsule
    gc.collect()
    assert gdsllm.memory_stats() == before
    grown = rss_bytes() - rss_before
    print(f"RSS grew by {grown / 2**20:.1f} MiB over 200 reads of {nbytes / 2**20:.1f} MiB")
    assert grown < 64 << 20, f"RSS grew by {grown} bytes: buffers are not returned"


def test_views_share_one_buffer_and_outlive_the_producer(data_file):
    path, data = data_file
    before = gdsllm.memory_stats()
    tensor = host_tensor(path, [4, 4], "int32", 4096 * 3 + 16)
    first, second = np.from_dlpack(tensor), np.from_dlpack(tensor)
    assert gdsllm.memory_stats()["host_buffers"] == before["host_buffers"] + 1
    first[0, 0] = 12345  # consumers share (and may write) the same memory
    assert second[0, 0] == 12345
    del tensor, first
    assert second.tobytes()[4:] == data[4096 * 3 + 20:4096 * 3 + 80]
    del second
    assert gdsllm.memory_stats() == before


def test_dlpack_protocol_arguments(data_file):
    path, _ = data_file
    tensor = host_tensor(path, [16], "float32")
    for kwargs in [{}, {"max_version": (1, 0)}, {"max_version": (0, 8)}, {"stream": None},
                   {"dl_device": (1, 0)}, {"copy": False}]:
        assert np.from_dlpack(_Wrapper(tensor, kwargs)).tobytes() == tensor.tobytes(), kwargs
    with pytest.raises(BufferError):
        tensor.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        tensor.__dlpack__(dl_device=(2, 0))


class _Wrapper:
    """Forwards DLPack to a GdsTensor with fixed extra arguments."""

    def __init__(self, tensor, kwargs):
        self.tensor, self.kwargs = tensor, kwargs

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        kwargs.update(self.kwargs)
        return self.tensor.__dlpack__(**kwargs)
