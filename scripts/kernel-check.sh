#!/usr/bin/env bash
# Issue 23's kernels on the GPU machine in one call: the new paths' correctness, then each
# comparison old against new in the same call (`GDSLLM_CUDA_PATHS=none` against `all`, see
# llama/src/backend/cuda/paths.rs), and a short table last. There is no Rust toolchain there:
# binaries are built elsewhere and passed in. Stages (STAGES, default all, in this order):
#   tests    llama/tests/cuda_ops.rs and the CUDA test of llama/tests/batch.rs with
#            GDSLLM_GPU_TESTS=1: every op against the reference, the new paths against the
#            reference and the old ones, batched decoding against each sequence alone.
#   models   for each model directory of MODELS (gdsllm format; default: `gdsllm synth` a
#            7B-shaped q4_1 model): `gdsllm bench` pp512/tg128 and `--batch 1,8,32`, everything
#            resident, old paths then new.
#   kernels  the cuda_kernels example: one 7B layer's matmuls per dtype for 1..64 rows, prompt
#            attention, a decode batch's attention steps; old and new in one process, GB/s and
#            TFLOP/s beside the device-to-device copy rate measured there.
#   profile  GDSLLM_CUDA_PROFILE=1 on the first model with the new paths: GPU time per op of a
#            pp512 + tg32 run and of batch-32 decoding; and of a SmolLM2-shaped model decoding
#            op by op (GDSLLM_CUDA_GRAPH=0) (from the log on stderr).
# The whole script keeps to BUDGET_S seconds (default 225): every step runs under `timeout` with
# a cap of its own and never past the budget; a step stopped or skipped for time says so in the
# summary (and fails the run), and the summary and table always come last.
#
# Usage: scripts/kernel-check.sh [WORK_DIR]
# Environment (all optional):
#   GDSLLM_BIN      gdsllm release binary (default target/release/gdsllm)
#   CUDA_TEST_BIN   cuda_ops test binary (`cargo test --release -p llama --features cuda --test
#                   cuda_ops --no-run`); default: newest target/release/deps/cuda_ops-*
#   BATCH_TEST_BIN  batch test binary (likewise `--test batch`); default: newest .../batch-*
#   KERNELS_BIN     the example (`cargo build --release -p llama --features cuda --example
#                   cuda_kernels`); default target/release/examples/cuda_kernels
#   MODELS          model directories to bench (space-separated)
#   STAGES          e.g. "tests kernels" (default "tests models kernels profile")
#   BATCHES         batch sizes of the batched bench (default 1,8,32)
#   BUDGET_S        seconds for the whole script (default 225)
#   KERNELS_ARGS    arguments of the example (e.g. --quick: fewer dtypes and row counts)
# LD_LIBRARY_PATH defaults to /usr/local/cuda/lib64 (libcuda, libnvrtc, libcublas).
set -uo pipefail

STAGES="${STAGES:-tests models kernels profile}"
BATCHES="${BATCHES:-1,8,32}"
# shellcheck source=scripts/check-common.sh
source "$(dirname "$0")/check-common.sh"
prepare_work_dir kernel-check-work "$@"
home_in_work_dir

START=$(date +%s)
BUDGET_S="${BUDGET_S:-225}"
# The smaller of $1 seconds and what is left of the budget.
cap() { local left=$((START + BUDGET_S - $(date +%s))); echo $((left < $1 ? left : $1)); }
# limited SECONDS LABEL cmd...: cmd under a timeout of `cap SECONDS`; skipped when under 5 s are
# left. Returns cmd's status (124 when it was stopped).
limited() {
  local c; c=$(cap "$1"); local label=$2; shift 2
  if [ "$c" -lt 5 ]; then note "$label: SKIPPED (time budget of ${BUDGET_S}s spent)"; status=1; return 125; fi
  timeout -k 5 "$c" "$@"
  local rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note "$label: STOPPED after ${c}s (time budget)"; status=1; fi
  return $rc
}

if has tests; then
  step "CUDA op tests (old and new paths)"
  TEST_TIMEOUT=$(cap 70) run_test_bin cuda_ops "${CUDA_TEST_BIN:-$(newest cuda_ops)}" GDSLLM_GPU_TESTS=1 GDSLLM_CUDA_PATHS=none >/dev/null
  grep -E "^(mma matmul|flash attention|[0-9]+ sequences|matmul |attention rows|smollm2|small f16)" \
    "$WORK_DIR/cuda_ops.log" | sed 's/^/  /' >&2
  # The matmul, fused-launch, attention and model tests again with the new paths as the
  # backend's default (the others do not touch them or name their paths themselves).
  step "CUDA op and model tests with GDSLLM_CUDA_PATHS=all"
  TEST_FILTER="matmul_matches_reference_for fused_launches attention_over model_matches_cpu gives_the_resident_tokens" \
    TEST_TIMEOUT=$(cap 40) run_test_bin cuda_ops_all "${CUDA_TEST_BIN:-$(newest cuda_ops)}" GDSLLM_GPU_TESTS=1 GDSLLM_CUDA_PATHS=all >/dev/null
  grep -E "^(smollm2|small f16|matmul \(paths)" "$WORK_DIR/cuda_ops_all.log" | grep -E "prefill|agreed|equal|paths" \
    | while read -r l; do note "  all paths: $l"; done
  # The worst errors of the new paths, for the table.
  for pat in "mma matmul .* rows=" "flash attention"; do
    worst=$(grep -E "^$pat" "$WORK_DIR/cuda_ops.log" | grep -oE "max rel diff [0-9.e+-]+" | awk '{print $4}' | sort -g | tail -n1)
    [ -n "$worst" ] && note "  worst of '$pat': max rel diff $worst vs reference"
  done
  grep -E "^[0-9]+ sequences|bits in batches" "$WORK_DIR/cuda_ops.log" | while read -r l; do note "  $l"; done
  step "CUDA batch test: batched decoding against each sequence alone"
  TEST_FILTER=cuda TEST_TIMEOUT=$(cap 30) run_test_bin batch_cuda "${BATCH_TEST_BIN:-$(newest batch)}" GDSLLM_GPU_TESTS=1 >/dev/null
  grep -E "^cuda " "$WORK_DIR/batch_cuda.log" | while read -r l; do note "  $l"; done
fi

# gdsllm bench with the given paths: bench_paths NAME PATHS JSON args...
bench_paths() {
  local name=$1 paths=$2 out=$3; shift 3
  if ! GDSLLM_CUDA_PATHS="$paths" limited 25 "$name ($paths)" "$BIN" bench --device cuda --json "$@" >"$out" 2>"$out.log"; then
    tail -n 5 "$out.log" >&2; note "$name ($paths): bench FAILED"; status=1; return 1
  fi
}
jf() { jq_py "$@" 2>/dev/null || echo "nan"; }

if has models || has profile; then
  if [ -z "${MODELS:-}" ]; then
    MODELS="$WORK_DIR/llama7b-q4_1"
    if [ ! -f "$MODELS/metadata.json" ]; then
      step "gdsllm synth --shape llama-7b --dtype q4_1"
      limited 30 synth "$BIN" synth --shape llama-7b --dtype q4_1 "$MODELS" >&2 || { note "synth FAILED"; status=1; }
    fi
  fi
fi

declare -a table
if has models; then
  for m in $MODELS; do
    name=$(basename "$m")
    for paths in none all; do
      step "$name: pp512/tg128, paths $paths"
      bench_paths "$name pp/tg" "$paths" "$WORK_DIR/bench-$name-$paths.json" -m "$m" -p 512 -n 128 -r 2
      step "$name: batched decoding $BATCHES, paths $paths"
      bench_paths "$name batch" "$paths" "$WORK_DIR/batch-$name-$paths.json" -m "$m" --batch "$BATCHES" -p 16 -n 32 -r 1
    done
    o="$WORK_DIR/bench-$name-none.json"; n="$WORK_DIR/bench-$name-all.json"
    for metric in pp tg; do
      a=$(jf "$o" "'%.1f' % d['$metric']['best']"); b=$(jf "$n" "'%.1f' % d['$metric']['best']")
      table+=("$name | ${metric}$([ $metric = pp ] && echo 512 || echo 128) tok/s | $a | $b | $(python3 -c "print(f'{$b/$a:.2f}x')" 2>/dev/null)")
    done
    o="$WORK_DIR/batch-$name-none.json"; n="$WORK_DIR/batch-$name-all.json"
    for bsz in ${BATCHES//,/ }; do
      a=$(jf "$o" "'%.1f' % next(r['mean'] for r in d['batch'] if r['batch']==$bsz)")
      b=$(jf "$n" "'%.1f' % next(r['mean'] for r in d['batch'] if r['batch']==$bsz)")
      table+=("$name | batch $bsz aggregate tok/s | $a | $b | $(python3 -c "print(f'{$b/$a:.2f}x')" 2>/dev/null)")
    done
    w=$(jf "$n" "'%.2f GB weights/token, d2d copy %.0f GB/s -> tg bound %.1f tok/s' % (d['tg']['weight_bytes_per_token']/1e9, d['references']['d2d_read_gbps'], d['references']['d2d_read_gbps']*1e9/d['tg']['weight_bytes_per_token'])")
    note "$name: $w"
  done
fi

if has kernels; then
  step "kernel timings, old vs new (cuda_kernels example)"
  KBIN="${KERNELS_BIN:-target/release/examples/cuda_kernels}"
  # shellcheck disable=SC2086 # KERNELS_ARGS is a list of arguments
  if [ -x "$KBIN" ] && limited 45 "kernel timings" "$KBIN" ${KERNELS_ARGS:-} >"$WORK_DIR/kernels.md" 2>"$WORK_DIR/kernels.log"; then
    cat "$WORK_DIR/kernels.md" >&2
  else
    tail -n 20 "$WORK_DIR/kernels.log" >&2; note "kernel timings FAILED (or $KBIN missing)"; status=1
  fi
fi

if has profile; then
  m=${MODELS%% *}
  step "GPU time per op, new paths, $(basename "$m"): pp512 + tg32"
  GDSLLM_CUDA_PROFILE=1 GDSLLM_CUDA_PATHS=all limited 20 "profile pp512" "$BIN" bench --device cuda -m "$m" -p 512 -n 32 -r 1 --json \
    >"$WORK_DIR/profile-pp.json" 2>"$WORK_DIR/profile-pp.log" || status=1
  sed -n '/GPU time per op/,$p' "$WORK_DIR/profile-pp.log" | head -n 30 >&2
  step "GPU time per op, new paths: batch 32"
  GDSLLM_CUDA_PROFILE=1 GDSLLM_CUDA_PATHS=all limited 20 "profile batch 32" "$BIN" bench --device cuda -m "$m" --batch 32 -p 16 -n 16 -r 1 --json \
    >"$WORK_DIR/profile-batch.json" 2>"$WORK_DIR/profile-batch.log" || status=1
  sed -n '/GPU time per op/,$p' "$WORK_DIR/profile-batch.log" | head -n 30 >&2
  # Decoding one sequence op by op (no CUDA graph), on a SmolLM2-shaped model: where the fixed
  # cost per token of a small model goes.
  small="$WORK_DIR/smollm2-q4_1"
  [ -f "$small/metadata.json" ] || limited 15 "synth smollm2" "$BIN" synth --shape smollm2-135m --dtype q4_1 "$small" >&2 || status=1
  step "GPU time per op, SmolLM2-shaped q4_1 decode without the CUDA graph"
  GDSLLM_CUDA_PROFILE=1 GDSLLM_CUDA_GRAPH=0 limited 15 "profile smollm2" "$BIN" bench --device cuda -m "$small" -p 16 -n 64 -r 1 --json \
    >"$WORK_DIR/profile-small.json" 2>"$WORK_DIR/profile-small.log" || status=1
  sed -n '/GPU time per op/,$p' "$WORK_DIR/profile-small.log" | head -n 30 >&2
fi

echo
echo "=== kernel-check summary ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1), $(($(date +%s) - START)) s of ${BUDGET_S}) ==="
for line in "${summary[@]}"; do echo "$line"; done
if [ -f "$WORK_DIR/kernels.md" ]; then
  echo
  grep -E "^(#|\|)" "$WORK_DIR/kernels.md"
fi
if [ ${#table[@]} -gt 0 ]; then
  echo
  echo "| model | metric | old paths | new paths | new/old |"
  echo "|---|---|---|---|---|"
  for line in "${table[@]}"; do echo "| $line |"; done
fi
exit $status
