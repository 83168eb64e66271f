#!/usr/bin/env python3
"""Registers, spills and shared memory of every CUDA kernel, without a GPU.

Compiles the kernel program exactly as `llama/src/backend/cuda/compile.rs` assembles it
(common.cuh, then each file of KERNEL_FILES after a `#line 1` marker, with the `#define`s of
GDSLLM_CUDA_DEFINES in front) with NVRTC to PTX, then the PTX with ptxas for one architecture,
and prints ptxas' resource line per kernel: what decides how many blocks fit a multiprocessor.
NVRTC and ptxas come from the PyPI wheels nvidia-cuda-nvrtc and nvidia-cuda-nvcc (CUDA 13):

    python3 -m pip install nvidia-cuda-nvrtc nvidia-cuda-nvcc
    python3 scripts/kernel-resources.py [--arch sm_90] [--defines A,B=1] [--filter matmul_mma]

The device JIT-compiles the same PTX with its driver's ptxas, which may be another version:
treat the figures as the compiler's intent, and ncu's "Registers Per Thread" as the truth.
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "llama/src/backend/cuda/kernels")
COMPILE_RS = os.path.join(ROOT, "llama/src/backend/cuda/compile.rs")


def program_source(defines):
    """compile.rs' `program_source()` and `with_defines()`: the file list is read from
    KERNEL_FILES there, so the two cannot drift apart."""
    rs = open(COMPILE_RS).read()
    table = rs[rs.index("KERNEL_FILES"):]
    table = table[: table.index("];")]
    files = ["common.cuh"] + re.findall(r'\("([a-z_0-9]+\.cu)"', table)
    src = ""
    for name in files:
        text = open(os.path.join(KERNELS, name)).read()
        src += f'#line 1 "{name}"\n' + text + ("" if text.endswith("\n") else "\n")
    head = ""
    for item in filter(None, (d.strip() for d in (defines or "").split(","))):
        name, _, value = item.partition("=")
        head += f"#define {name} {value}\n"
    return head + src


def find(pattern):
    for base in sys.path + [os.path.expanduser("~/.local/lib")]:
        hits = glob.glob(os.path.join(base, pattern))
        if hits:
            return sorted(hits)[-1]
    sys.exit(f"not found: {pattern} (python3 -m pip install nvidia-cuda-nvrtc nvidia-cuda-nvcc)")


def nvrtc_ptx(source, arch):
    lib = ctypes.CDLL(find("nvidia/cu*/lib/libnvrtc.so*"))
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(f"{what} failed ({rc})")
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernels.cu", 0, None, None),
          "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=compute_{arch[3:]}".encode(), b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"NVRTC could not compile the kernels:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--defines", default=os.environ.get("GDSLLM_CUDA_DEFINES", ""))
    ap.add_argument("--filter", default="", help="only kernels whose name contains this")
    args = ap.parse_args()
    ptx = nvrtc_ptx(program_source(args.defines), args.arch)
    ptxas = find("nvidia/cu*/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernels.ptx")
        open(path, "w").write(ptx)
        out = subprocess.run([ptxas, "-v", f"-arch={args.arch}", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr)
    kernel, stack = None, ""
    print(f"{'kernel':<40} {'regs':>5} {'spill st/ld':>12} {'smem':>7} {'stack':>6}")
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            stack, spills = m.group(1), f"{m.group(2)}/{m.group(3)}"
            continue
        m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?", line)
        if m and kernel and args.filter in kernel:
            smem = re.search(r"(\d+) bytes smem", line)
            print(f"{kernel:<40} {m.group(1):>5} {spills:>12} {smem.group(1) if smem else '0':>7} {stack:>6}")


if __name__ == "__main__":
    main()
