#!/usr/bin/env bash
# The CUDA kernels of llama/src/backend/cuda/kernels run on the CPU emulator
# (llama/tests/cuda_emu/emu.h) against slow references: no GPU needed. Compiles
# llama/tests/cuda_emu/kernels_test.cpp with the host C++ compiler and runs it; every check prints
# its error and tolerance, and the exit status is non-zero on any failure.
#
# Usage: scripts/cuda-emu-check.sh [--quick]     (CXX picks the compiler; default c++)
set -euo pipefail
cd "$(dirname "$0")/.."
CXX="${CXX:-c++}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$CXX" -std=c++17 -O1 -Wall -Wno-unknown-pragmas -Wno-unused-function -Wno-unused-variable \
    -I llama/tests/cuda_emu -I llama/src/backend/cuda/kernels \
    llama/tests/cuda_emu/kernels_test.cpp -o "$out/kernels_test"
"$out/kernels_test" "$@"
