#!/usr/bin/env python3
"""Dequantizes GGUF blocks with the `gguf` Python package (llama.cpp's own gguf-py), the
reference that GdsLLM's decoders are tested against.

Usage:
  gguf_py_dequant.py blocks DIR
      for every DIR/<TYPE>.bin (raw blocks of the ggml type named TYPE, e.g. Q4_K), writes
      DIR/<TYPE>.f32 (little-endian float32 values)
  gguf_py_dequant.py tensors FILE.gguf ROWS OUT_DIR NAME...
      for every tensor NAME of FILE.gguf, writes its first ROWS rows to OUT_DIR/NAME.f32

If `gguf` is not importable, creates a virtual environment (GDSLLM_GGUF_PY_VENV, default a
temporary directory), pip-installs gguf==0.19.0 into it and re-runs itself there.
"""

import os
import sys

from venv_rerun import ensure_importable


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("blocks", "tensors"):
        sys.exit(__doc__)
    ensure_importable("gguf", "gguf==0.19.0", os.environ.get("GDSLLM_GGUF_PY_VENV"))
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    if sys.argv[1] == "blocks":
        folder = sys.argv[2]
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".bin"):
                continue
            qtype = GGMLQuantizationType[name[:-4]]
            raw = np.fromfile(os.path.join(folder, name), dtype=np.uint8)
            values = dequantize(raw, qtype).astype("<f4")
            values.tofile(os.path.join(folder, name[:-4] + ".f32"))
        return
    path, rows, out_dir, names = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name in names:
        t = tensors[name]
        data = np.asarray(t.data)[:rows]
        values = dequantize(np.ascontiguousarray(data), t.tensor_type).astype("<f4")
        values.tofile(os.path.join(out_dir, name + ".f32"))


if __name__ == "__main__":
    main()
