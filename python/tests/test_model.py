"""open_model into host memory: every tensor of the real SmolLM2 model (GDSLLM_TEST_MODEL, set
by `cargo xtask ci`) equals what the Rust reader (weights_format::Model::read_tensor) and a
plain read of the blob file give, with metadata.json's dtype and shape; quantized tensors come
as raw uint8 blocks with their type name; float models (gdsllm synth, f16 and bf16) as float
views; views of one blob share one buffer, freed when the last view goes; bad directories and
indices raise."""

import gc
import json
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

import gdsllm

REPO = pathlib.Path(__file__).resolve().parents[2]


def smollm2_dir():
    path = os.environ.get("GDSLLM_TEST_MODEL")
    if not path:
        if os.environ.get("GDSLLM_SKIP_MODEL_TESTS") == "1":
            pytest.skip("GDSLLM_SKIP_MODEL_TESTS=1")
        pytest.fail("set GDSLLM_TEST_MODEL to a converted SmolLM2 directory (`gdsllm pull smollm2` "
                    "prints it; `cargo xtask ci` sets it), or GDSLLM_SKIP_MODEL_TESTS=1")
    return pathlib.Path(path)


def gdsllm_bin():
    candidates = [os.environ.get("GDSLLM_BIN"), REPO / "target/debug/gdsllm", REPO / "target/release/gdsllm"]
    for candidate in candidates:
        if candidate and pathlib.Path(candidate).is_file():
            return str(candidate)
    pytest.fail("no gdsllm binary: set GDSLLM_BIN or run `cargo build -p gdsllm-cli` (`cargo xtask ci` sets it)")


def blob_bytes(model_dir, blob, tensor):
    with open(model_dir / blob["file"], "rb") as f:
        f.seek(tensor["offset"])
        return f.read(tensor["length"])


def check_tensor(entry, meta, expected):
    """One tensor from open_model against metadata.json and the file's bytes."""
    if meta["dtype"] in ("q8_0", "q4_0", "q4_1"):
        assert isinstance(entry, gdsllm.QuantizedTensor), meta["name"]
        assert entry.qtype == meta["dtype"] and list(entry.shape) == meta["shape"]
        data = np.from_dlpack(entry.data)
        block_values, block_bytes = 32, {"q8_0": 34, "q4_0": 18, "q4_1": 20}[meta["dtype"]]
        row_bytes = meta["shape"][-1] // block_values * block_bytes
        assert data.dtype == np.uint8 and list(data.shape) == meta["shape"][:-1] + [row_bytes]
        assert data.tobytes() == expected, meta["name"]
    else:
        assert entry.dtype == {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[meta["dtype"]]
        assert list(entry.shape) == meta["shape"] and entry.quant_type is None
        if meta["dtype"] != "bf16":  # numpy has no bfloat16
            array = np.from_dlpack(entry)
            assert array.dtype == np.dtype(entry.dtype) and list(array.shape) == meta["shape"]
            assert array.tobytes() == expected, meta["name"]
        assert entry.tobytes() == expected, meta["name"]


def check_blob(model, model_dir, index, blob):
    """Every tensor of `blob` as read by open_model equals the file's bytes and the Rust reader's."""
    before = gdsllm.memory_stats()
    tensors = model.blob(blob["file"])
    after = gdsllm.memory_stats()
    assert after["host_buffers"] == before["host_buffers"] + 1, "one buffer per blob"
    assert after["host_bytes"] == before["host_bytes"] + blob["length"]
    assert sorted(tensors) == sorted(t["name"] for t in blob["tensors"])
    for meta in blob["tensors"]:
        expected = blob_bytes(model_dir, blob, meta)
        assert model.native.read_tensor_bytes(index, meta["name"]) == expected
        check_tensor(tensors[meta["name"]], meta, expected)
    del tensors
    gc.collect()
    assert gdsllm.memory_stats() == before, "the blob's buffer is freed with its last view"


def test_smollm2_tensors_equal_the_rust_reader_and_the_files():
    model_dir = smollm2_dir()
    metadata = json.loads((model_dir / "metadata.json").read_text())
    model = gdsllm.open_model(model_dir, device="cpu", as_torch=False)
    assert model.n_layers == metadata["config"]["n_layers"] == len(metadata["blobs"]) - 2
    assert model.config == metadata["config"]
    assert model.blobs == metadata["blobs"]
    assert model.device == "cpu"
    # Every blob: embed (q8_0), the layers (q4_1 matrices, f32 norms), output (f32 norm).
    for index, blob in enumerate(metadata["blobs"]):
        check_blob(model, model_dir, index, blob)
    layer = model.layer(model.n_layers - 1)
    assert layer["attn_q"].qtype == "q4_1" and layer["attn_q"].shape == (576, 576)
    assert np.from_dlpack(layer["attn_norm"]).shape == (576,)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_float_models_give_float_views(tmp_path, dtype):
    model_dir = tmp_path / f"synth-{dtype}"
    subprocess.run([gdsllm_bin(), "synth", "--shape", "custom", "--layers", "2", "--dim", "128",
                    "--ffn", "352", "--heads", "4", "--kv-heads", "2", "--vocab", "512",
                    "--tied", "false", "--dtype", dtype, str(model_dir)],
                   check=True, capture_output=True)
    metadata = json.loads((model_dir / "metadata.json").read_text())
    model = gdsllm.open_model(model_dir, device="cpu", as_torch=False)
    for index, blob in enumerate(metadata["blobs"]):
        check_blob(model, model_dir, index, blob)
    layer = model.layer(1)
    assert layer["attn_k"].shape == (64, 128) and layer["attn_k"].dtype == {"f16": "float16", "bf16": "bfloat16"}[dtype]
    assert sorted(model.output()) == ["output", "output_norm"]


def test_bad_directories_and_indices_raise(tmp_path):
    model_dir = smollm2_dir()
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        gdsllm.open_model(tmp_path, device="cpu")
    with pytest.raises(ValueError, match="unknown device"):
        gdsllm.open_model(model_dir, device="gpu")
    with pytest.raises(ValueError, match="invalid I/O path"):
        gdsllm.open_model(model_dir, device="cpu", io="fast")
    model = gdsllm.open_model(model_dir, device="cpu")
    with pytest.raises(IndexError, match="layer 30 out of range: the model has 30 layers"):
        model.layer(30)
    with pytest.raises(IndexError):
        model.layer(-1)
    with pytest.raises(KeyError, match="layer_999.bin"):
        model.blob("layer_999.bin")
    with pytest.raises(IndexError, match="blob index 40 out of range"):
        model.blob(40)
    assert sorted(model.blob(-1)) == ["output_norm"]

    # A copy whose metadata.json lies about a tensor's shape.
    broken = tmp_path / "broken"
    broken.mkdir()
    # Copies, not symlinks: a model refuses files that point outside its directory.
    for entry in model_dir.iterdir():
        if entry.name != "metadata.json" and entry.is_file():
            shutil.copy(entry, broken / entry.name)
    metadata = json.loads((model_dir / "metadata.json").read_text())
    metadata["blobs"][1]["tensors"][1]["shape"] = [575, 576]
    (broken / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(gdsllm.ModelFormatError, match="layer_000.bin"):
        gdsllm.open_model(broken, device="cpu")
    # A missing blob file.
    (broken / "layer_003.bin").unlink()
    shutil.copy(model_dir / "metadata.json", broken / "metadata.json")
    with pytest.raises((FileNotFoundError, gdsllm.ModelFormatError), match="layer_003.bin"):
        gdsllm.open_model(broken, device="cpu")
