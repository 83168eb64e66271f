#!/usr/bin/env bash
# CUDA backend check in one invocation, for the lent GPU machine (no Rust toolchain there: the
# binaries are built here and passed in). In order:
#   1. the CUDA op and whole-model tests (llama/tests/cuda_ops.rs, GDSLLM_GPU_TESTS=1: they fail,
#      not skip, without a usable GPU): every op against the reference backend, a SmolLM2-shaped
#      q4_1 model and a small untied f16 model against the CPU backend,
#   2. synthetic models with `gdsllm synth` (smollm2-135m shape, q4_1 and f16),
#   3. `gdsllm bench --device cuda` and `--device cpu` on each, same prompt/generation lengths,
#   4. a table last: pp/tg tok/s per model and device, and the GPU/CPU ratio.
#
# Usage: scripts/gpu-check.sh [WORK_DIR]
# Environment (all optional):
#   GDSLLM_BIN      gdsllm release binary (default: target/release/gdsllm)
#   CUDA_TEST_BIN   llama's cuda_ops test binary, built with
#                   `cargo test --release -p llama --features cuda --test cuda_ops --no-run`
#                   (default: newest target/release/deps/cuda_ops-*)
#   N_PROMPT, N_GEN bench lengths (default 128, 64); REPS repetitions (default 2)
#   SKIP_TESTS=1    skip step 1
# LD_LIBRARY_PATH defaults to /usr/local/cuda/lib64 (libcuda, libnvrtc).
set -uo pipefail

WORK_DIR="${1:-${WORK_DIR:-$PWD/gpu-check-work}}"
BIN="${GDSLLM_BIN:-target/release/gdsllm}"
N_PROMPT="${N_PROMPT:-128}"
N_GEN="${N_GEN:-64}"
REPS="${REPS:-2}"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-/usr/local/cuda/lib64}"
mkdir -p "$WORK_DIR"
WORK_DIR=$(cd "$WORK_DIR" && pwd)
export GDSLLM_HOME="$WORK_DIR/home"   # the NVRTC kernel cache goes to $GDSLLM_HOME/kernels
mkdir -p "$GDSLLM_HOME"
BIN=$(realpath "$BIN")
status=0
step() { echo >&2; echo "=== $* ===" >&2; }
if [ -z "${CUDA_TEST_BIN:-}" ]; then
  CUDA_TEST_BIN=$(ls -t target/release/deps/cuda_ops-* 2>/dev/null | grep -v '\.d$' | head -n1 || true)
fi

tests_line="skipped"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step "CUDA op and model tests ($CUDA_TEST_BIN)"
  if [ -z "$CUDA_TEST_BIN" ] || [ ! -x "$CUDA_TEST_BIN" ]; then
    echo "no cuda_ops test binary (set CUDA_TEST_BIN)" >&2; tests_line="MISSING"; status=1
  else
    # One thread: the model tests each hold a whole model on the GPU and on the CPU.
    GDSLLM_GPU_TESTS=1 "$CUDA_TEST_BIN" --test-threads=1 --nocapture 2>&1 | tee "$WORK_DIR/cuda_ops.log"
    rc=${PIPESTATUS[0]}
    tests_line=$(grep -E '^test result' "$WORK_DIR/cuda_ops.log" | tail -n1)
    [ "$rc" = 0 ] || { status=1; tests_line="FAILED (rc $rc): $tests_line"; }
  fi
fi

declare -a rows
for dtype in q4_1 f16; do
  model="$WORK_DIR/smollm2-$dtype"
  if [ ! -f "$model/metadata.json" ]; then
    step "gdsllm synth --shape smollm2-135m --dtype $dtype"
    rm -rf "$model"
    "$BIN" synth --shape smollm2-135m --dtype "$dtype" "$model" >&2 || { status=1; continue; }
  fi
  for device in cuda cpu; do
    step "gdsllm bench --device $device on smollm2-135m $dtype"
    json="$WORK_DIR/bench-$dtype-$device.json"
    if "$BIN" bench --device "$device" -m "$model" -p "$N_PROMPT" -n "$N_GEN" -r "$REPS" --json >"$json"; then
      pp=$(python3 -c "import json,sys; print('%.1f' % json.load(open(sys.argv[1]))['pp']['best'])" "$json")
      tg=$(python3 -c "import json,sys; print('%.1f' % json.load(open(sys.argv[1]))['tg']['best'])" "$json")
    else
      status=1; pp="error"; tg="error"
    fi
    rows+=("$dtype $device $pp $tg")
  done
done

echo
echo "=== gpu-check summary ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)) ==="
echo "tests: $tests_line"
printf '| %-18s | %-6s | %12s | %12s |\n' "model" "device" "pp$N_PROMPT tok/s" "tg$N_GEN tok/s"
printf '|%s|%s|%s|%s|\n' "--------------------" "--------" "--------------" "--------------"
for r in "${rows[@]}"; do
  set -- $r
  printf '| %-18s | %-6s | %12s | %12s |\n' "smollm2-135m $1" "$2" "$3" "$4"
done
python3 - "$WORK_DIR" <<'PY'
import json, os, sys
w = sys.argv[1]
for dt in ("q4_1", "f16"):
    try:
        g = json.load(open(os.path.join(w, f"bench-{dt}-cuda.json")))
        c = json.load(open(os.path.join(w, f"bench-{dt}-cpu.json")))
        print(f"{dt}: cuda/cpu pp {g['pp']['best']/c['pp']['best']:.1f}x, tg {g['tg']['best']/c['tg']['best']:.1f}x")
    except Exception as e:
        print(f"{dt}: no ratio ({e})")
PY
exit $status
