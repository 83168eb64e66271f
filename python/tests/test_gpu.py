"""GPU checks (opt-in): CUDA tensors read through cufile, bounce and host equal the file's bytes;
cuFile registrations and device memory come back when the tensors die; open_model on CUDA gives
what it gives on the CPU; reads from several threads at once.

Run with GDSLLM_GPU_TESTS=1 (without it every test skips); with it, a machine without a usable
GPU, torch or cuFile FAILS. Needs torch. GDSLLM_GPU_TEST_DIR: where test files are written (a
disk-backed directory, so that O_DIRECT and cuFile work; default the system temp dir).
GDSLLM_GPU_TEST_MIB: size of the test file (default 256). GDSLLM_BIN: the gdsllm binary, for
the synthetic models of the open_model test.

Runs under pytest, or as `python3 test_gpu.py` where pytest is not installed (it then prints
pytest's closing line itself)."""

import atexit
import gc
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback

import gdsllm

GPU_TESTS = os.environ.get("GDSLLM_GPU_TESTS") == "1"
REPO = pathlib.Path(__file__).resolve().parents[2]


class Skipped(Exception):
    pass


# Set when run as a script (no pytest): skips raise Skipped instead of pytest's exception.
_STANDALONE = False


def require_gpu():
    """torch with CUDA, and a GPU gdsllm can open: skip without GDSLLM_GPU_TESTS=1, fail with it."""
    if not GPU_TESTS:
        if _STANDALONE:
            raise Skipped("set GDSLLM_GPU_TESTS=1 to run GPU tests")
        import pytest

        pytest.skip("set GDSLLM_GPU_TESTS=1 to run GPU tests")
    try:
        import torch
    except ImportError as err:
        raise AssertionError(f"GDSLLM_GPU_TESTS=1 but torch does not import: {err}")

    assert torch.cuda.is_available(), "GDSLLM_GPU_TESTS=1 but torch sees no CUDA device"
    status = gdsllm.cuda_status(0)
    assert status["available"], f"GDSLLM_GPU_TESTS=1 but gdsllm cannot open GPU 0: {status['reason']}"
    return torch


_FILE = {}


def make_test_file():
    """A file of random bytes (default 256 MiB plus an unaligned tail), made once."""
    if "path" not in _FILE:
        base = os.environ.get("GDSLLM_GPU_TEST_DIR") or tempfile.gettempdir()
        mib = int(os.environ.get("GDSLLM_GPU_TEST_MIB", "256"))
        directory = tempfile.mkdtemp(prefix="gdsllm-py-gpu-", dir=base)
        # randbytes of more than 256 MiB overflows a C int inside getrandbits (Python 3.12), so
        # the bytes come in 1 MiB pieces.
        rng = random.Random(7)
        data = b"".join(rng.randbytes(1 << 20) for _ in range(mib)) + rng.randbytes(5000)
        path = os.path.join(directory, "weights.bin")
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _FILE.update(path=path, data=data, directory=directory)
        atexit.register(shutil.rmtree, directory, True)
    return _FILE["path"], _FILE["data"]


def torch_dtype(torch, name):
    return getattr(torch, name)


def tensor_bytes(torch, tensor):
    """The bytes of a contiguous tensor, copied to the host."""
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"]


def check_io(io, cases=60):
    torch = require_gpu()
    path, data = make_test_file()
    rng = random.Random({"cufile": 1, "bounce": 2, "host": 3}[io])
    whole = gdsllm.gds_tensor(path, [len(data)], torch.uint8, device="cuda:0", io=io)
    assert whole.is_cuda and whole.device == torch.device("cuda:0")
    assert tensor_bytes(torch, whole) == data, f"{io}: whole file differs"
    del whole
    for case in range(cases):
        name = rng.choice(DTYPES)
        dtype = torch_dtype(torch, name)
        size = torch.empty((), dtype=dtype).element_size()
        offset = rng.choice([0, 4096 * rng.randrange(1, 1000), rng.randrange(len(data)),
                             len(data) - rng.randrange(1, 20000)])
        offset -= offset % size
        room = (len(data) - offset) // size
        count = min(room, rng.choice([1, 7, 4096, rng.randrange(1, 1 << 20)]))
        shape = [count] if rng.random() < 0.5 or count % 4 else [4, count // 4]
        raw = gdsllm.gds_tensor(path, shape, dtype, offset, device="cuda:0", io=io, as_torch=False)
        assert raw.io == io, f"{io}: read by {raw.io}"
        assert raw.cufile_registered == (io == "cufile"), f"{io}: registered={raw.cufile_registered}"
        tensor = torch.from_dlpack(raw)
        assert tensor.data_ptr() == raw.data_ptr, "torch got a copy, not the buffer"
        assert tensor.dtype == dtype and list(tensor.shape) == shape
        nbytes = count * size
        assert tensor_bytes(torch, tensor) == data[offset:offset + nbytes], \
            f"{io} case {case}: {name} {shape} at {offset}"
    print(f"io={io}: {cases} random regions and the whole file ({len(data)} bytes) equal the file")


def test_cufile_tensors_equal_the_file():
    check_io("cufile")


def test_bounce_tensors_equal_the_file():
    check_io("bounce")


def test_host_staged_tensors_equal_the_file():
    check_io("host", cases=20)


def test_auto_picks_a_gpu_path():
    torch = require_gpu()
    path, data = make_test_file()
    raw = gdsllm.gds_tensor(path, [1 << 20], "float16", 8192, device="cuda", as_torch=False)
    status = gdsllm.cuda_status(0)
    expected = "cufile" if status["gds_dma"] else "bounce"
    assert raw.io == expected, f"auto read with {raw.io}, expected {expected} ({status})"
    assert tensor_bytes(torch, torch.from_dlpack(raw)) == data[8192:8192 + (2 << 20)]
    print(f"io=auto chose {raw.io}; cuFile: {status['cufile']}")


def settle(torch):
    gc.collect()
    torch.cuda.synchronize()


def test_registrations_and_device_memory_come_back():
    torch = require_gpu()
    path, data = make_test_file()
    settle(torch)
    before = gdsllm.memory_stats()
    free_before = torch.cuda.mem_get_info()[0]
    tensors = [gdsllm.gds_tensor(path, [8 << 20], torch.uint8, (i % 16) << 20, device="cuda:0", io="cufile")
               for i in range(20)]
    during = gdsllm.memory_stats()
    print(f"20 cufile tensors alive: {during}")
    assert during["device_buffers"] == before["device_buffers"] + 20
    assert during["cufile_buffers"] == before["cufile_buffers"] + 20, "each buffer is registered"
    assert during["cufile_files"] == before["cufile_files"], "file handles live only during a read"
    views = [t[1:] for t in tensors]  # torch views keep the buffer alive too
    del tensors
    settle(torch)
    assert gdsllm.memory_stats()["cufile_buffers"] == before["cufile_buffers"] + 20
    del views
    settle(torch)
    after = gdsllm.memory_stats()
    print(f"after the tensors died: {after}")
    assert after == before, f"{after} != {before}"
    # 60 reads of up to 256 MiB (15 GiB): a leak would show in the free device memory.
    count = min(64 << 20, len(data) // 4)
    for i in range(60):
        tensor = gdsllm.gds_tensor(path, [count], torch.float32, device="cuda:0", io=("bounce", "cufile")[i % 2])
        if i % 17 == 0:
            assert tensor_bytes(torch, tensor[:1024]) == data[:4096]
        del tensor
    settle(torch)
    free_after = torch.cuda.mem_get_info()[0]
    assert gdsllm.memory_stats() == before
    print(f"device memory free before {free_before / 2**30:.2f} GiB, after 60 reads {free_after / 2**30:.2f} GiB")
    assert free_after > free_before - (256 << 20), "device memory did not come back"


def gdsllm_bin():
    for candidate in [os.environ.get("GDSLLM_BIN"), REPO / "target/release/gdsllm", REPO / "target/debug/gdsllm"]:
        if candidate and pathlib.Path(candidate).is_file():
            return str(candidate)
    raise AssertionError("no gdsllm binary: set GDSLLM_BIN")


def test_open_model_on_cuda_equals_cpu_and_reads_in_threads():
    torch = require_gpu()
    base = os.environ.get("GDSLLM_GPU_TEST_DIR") or tempfile.gettempdir()
    directory = tempfile.mkdtemp(prefix="gdsllm-py-models-", dir=base)
    try:
        for dtype in ["f16", "bf16", "q4_1"]:
            model_dir = os.path.join(directory, dtype)
            subprocess.run([gdsllm_bin(), "synth", "--shape", "custom", "--layers", "6", "--dim", "512",
                            "--ffn", "1408", "--heads", "8", "--kv-heads", "2", "--vocab", "2048",
                            "--dtype", dtype, model_dir], check=True, capture_output=True)
            cpu = gdsllm.open_model(model_dir, device="cpu")
            for io in ["bounce", "cufile"]:
                gpu = gdsllm.open_model(model_dir, device="cuda:0", io=io)
                results = {}

                def read(i):
                    results[i] = gpu.layer(i)

                threads = [threading.Thread(target=read, args=(i,)) for i in range(gpu.n_layers)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                for i in range(gpu.n_layers):
                    want = cpu.layer(i)
                    assert sorted(results[i]) == sorted(want)
                    for name, tensor in results[i].items():
                        if isinstance(tensor, gdsllm.QuantizedTensor):
                            assert tensor.qtype == want[name].qtype == dtype
                            tensor, expected = tensor.data, want[name].data
                        else:
                            expected = want[name]
                        assert tensor.is_cuda and tensor.dtype == expected.dtype
                        assert torch.equal(tensor.cpu(), expected), f"{dtype} {io} layer {i} {name}"
                del results
                settle(torch)
            print(f"{dtype}: every layer on cuda (bounce, cufile; read from {gpu.n_layers} threads at once) equals the cpu read")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_cuda_errors_name_the_device():
    require_gpu()
    path, _ = make_test_file()
    try:
        gdsllm.gds_tensor(path, [4], "float32", device="cuda:99")
    except gdsllm.CudaUnavailableError as err:
        assert "99" in str(err), str(err)
    else:
        raise AssertionError("cuda:99 did not raise")


def _run_standalone():
    """A minimal runner for machines without pytest: runs every test_* function in order."""
    passed = failed = skipped = 0
    for name, function in list(globals().items()):
        if not (name.startswith("test_") and callable(function)):
            continue
        try:
            function()
        except Skipped as why:
            skipped += 1
            print(f"SKIPPED {name}: {why}")
        except Exception:
            failed += 1
            print(f"FAILED {name}")
            traceback.print_exc()
        else:
            passed += 1
            print(f"PASSED {name}")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    _STANDALONE = True
    sys.exit(_run_standalone())
