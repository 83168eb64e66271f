#!/usr/bin/env python3
"""Whole-model read into GPU memory from Python: every blob of a GdsLLM model through
gdsllm.gds_tensor (one read per blob, all kept resident, like loading a model), against
safetensors.torch.load_file(..., device="cuda") on the same weights saved as one safetensors
file. The page cache is dropped before each measurement. Prints one JSON object per line.

  read_model.py gds MODEL_DIR --io bounce|cufile
  read_model.py safetensors FILE
  read_model.py make-safetensors MODEL_DIR FILE    (streams the blobs' tensors into FILE)
"""

import argparse
import json
import os
import struct
import sys
import time

SAFETENSORS_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


def drop_page_cache(paths):
    """Drops the whole page cache when root, else evicts `paths` (posix_fadvise DONTNEED)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "all"
    except OSError:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "files"


def blobs_of(model_dir):
    with open(os.path.join(model_dir, "metadata.json")) as f:
        metadata = json.load(f)
    return metadata["blobs"]


def read_with_gds(model_dir, io):
    import torch

    import gdsllm

    blobs = blobs_of(model_dir)
    paths = [os.path.join(model_dir, b["file"]) for b in blobs]
    torch.cuda.init()
    # Set-up outside the timing: CUDA context, the backend (bounce ring, cuFile driver).
    warm = gdsllm.gds_tensor(paths[-1], [4096], torch.uint8, device="cuda:0", io=io)
    del warm
    dropped = drop_page_cache(paths)
    torch.cuda.synchronize()
    start = time.perf_counter()
    tensors, backends = [], set()
    for path, blob in zip(paths, blobs):
        raw = gdsllm.gds_tensor(path, [blob["length"]], torch.uint8, device="cuda:0", io=io, as_torch=False)
        backends.add(raw.io)
        tensors.append(torch.from_dlpack(raw))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    total = sum(b["length"] for b in blobs)
    ios = sorted(backends)
    del tensors
    return {"what": f"gds_tensor io={io}", "io": ios, "blobs": len(blobs), "bytes": total,
            "seconds": seconds, "gbps": total / seconds / 1e9, "page_cache_dropped": dropped}


def read_with_safetensors(path):
    import torch
    from safetensors.torch import load_file

    torch.cuda.init()
    torch.empty(1, device="cuda")
    dropped = drop_page_cache([path])
    torch.cuda.synchronize()
    start = time.perf_counter()
    tensors = load_file(path, device="cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"what": "safetensors.torch.load_file(device=cuda)", "tensors": len(tensors), "bytes": total,
            "seconds": seconds, "gbps": total / seconds / 1e9, "page_cache_dropped": dropped}


def make_safetensors(model_dir, out):
    """Writes every tensor of the model into one safetensors file, streaming from the blobs."""
    header, offset, plan = {}, 0, []
    for blob in blobs_of(model_dir):
        for t in blob["tensors"]:
            if t["dtype"] not in SAFETENSORS_DTYPES:
                raise SystemExit(f"{blob['file']}: {t['name']} is {t['dtype']}: safetensors has no such dtype")
            name = f"{blob['file'].removesuffix('.bin')}.{t['name']}"
            header[name] = {"dtype": SAFETENSORS_DTYPES[t["dtype"]], "shape": t["shape"],
                            "data_offsets": [offset, offset + t["length"]]}
            plan.append((os.path.join(model_dir, blob["file"]), t["offset"], t["length"]))
            offset += t["length"]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = time.perf_counter()
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for path, tensor_offset, length in plan:
            with open(path, "rb") as src:
                src.seek(tensor_offset)
                while length:
                    chunk = src.read(min(length, 64 << 20))
                    f.write(chunk)
                    length -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"what": "make-safetensors", "bytes": offset, "seconds": time.perf_counter() - start, "file": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    gds = sub.add_parser("gds")
    gds.add_argument("model")
    gds.add_argument("--io", default="auto")
    st = sub.add_parser("safetensors")
    st.add_argument("file")
    mk = sub.add_parser("make-safetensors")
    mk.add_argument("model")
    mk.add_argument("file")
    a = ap.parse_args()
    if a.command == "gds":
        result = read_with_gds(a.model, a.io)
    elif a.command == "safetensors":
        result = read_with_safetensors(a.file)
    else:
        result = make_safetensors(a.model, a.file)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
