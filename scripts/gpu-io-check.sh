#!/usr/bin/env bash
# GPU I/O check in one invocation, for the lent GPU machine (see DESIGN.md):
#   1. makes sure the udev record cuFile needs exists for the work directory's block device,
#   2. runs `gdsllm doctor --json`,
#   3. runs the gds-io GPU tests (GDSLLM_GPU_TESTS=1: they fail, not skip, without a GPU),
#   4. writes a synthetic 7B-shaped model (bf16 layer blobs) and runs `gdsllm bench-io` on it,
#   5. prints a short table last.
#
# Usage: scripts/gpu-io-check.sh [WORK_DIR]
# Environment (all optional):
#   GDSLLM_BIN          gdsllm release binary            (default: target/release/gdsllm)
#   GPU_TEST_BIN        gds-io test binary gpu_reads-*   (default: newest target/release/deps/gpu_reads-*)
#   WORK_DIR            disk-backed scratch directory    (default: $PWD/gpu-io-work; arg 1 wins)
#   GPU_TEST_MIB        size of the GPU tests' file       (default: 1024)
#   LAYERS, LAYER_MIB   synthetic model shape             (default: 32 × 386 MiB ≈ 7B bf16)
#   OUT                 where JSON results are copied     (default: $WORK_DIR/results)
#   SKIP_UDEV=1         do not touch /run/udev/data
# LD_LIBRARY_PATH should include /usr/local/cuda/lib64.
set -uo pipefail

WORK_DIR="${1:-${WORK_DIR:-$PWD/gpu-io-work}}"
BIN="${GDSLLM_BIN:-target/release/gdsllm}"
GPU_TEST_MIB="${GPU_TEST_MIB:-1024}"
LAYERS="${LAYERS:-32}"
LAYER_MIB="${LAYER_MIB:-386}"
RESULTS="${OUT:-$WORK_DIR/results}"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-/usr/local/cuda/lib64}"
export GDSLLM_HOME="$WORK_DIR/home"
mkdir -p "$WORK_DIR" "$GDSLLM_HOME" "$RESULTS"
status=0
step() { echo; echo "=== $* ===" >&2; }

if [ -z "${GPU_TEST_BIN:-}" ]; then
  GPU_TEST_BIN=$(ls -t target/release/deps/gpu_reads-* 2>/dev/null | grep -v '\.d$' | head -n1 || true)
fi

step "udev record for the work directory's block device"
majmin=$(stat -c '%Hd:%Ld' "$WORK_DIR" 2>/dev/null || true)
if [ "${SKIP_UDEV:-0}" = 1 ]; then
  echo "skipped (SKIP_UDEV=1)" >&2
elif [ -z "$majmin" ] || [ "${majmin%%:*}" = "0" ]; then
  echo "work dir $WORK_DIR is not on a block device ($majmin); cuFile registration cannot work there" >&2
else
  record="/run/udev/data/b$majmin"
  if grep -qx 'E:ID_FS_USAGE=filesystem' "$record" 2>/dev/null; then
    echo "$record already has E:ID_FS_USAGE=filesystem" >&2
  else
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO mkdir -p /run/udev/data
    echo 'E:ID_FS_USAGE=filesystem' | $SUDO tee -a "$record" >/dev/null \
      && echo "created/extended $record (cuFile error 5027 without it)" >&2 \
      || echo "could not write $record; cuFile registration will fail with the explained fallback" >&2
  fi
fi

step "gdsllm doctor --json"
if "$BIN" doctor --json --probe-mib 512 >"$RESULTS/doctor.json"; then
  cat "$RESULTS/doctor.json"
else
  echo "doctor FAILED" >&2; status=1
fi

step "gds-io GPU tests (GDSLLM_GPU_TESTS=1, ${GPU_TEST_MIB} MiB file)"
if [ -n "$GPU_TEST_BIN" ] && [ -x "$GPU_TEST_BIN" ]; then
  if GDSLLM_GPU_TESTS=1 GDSLLM_GPU_TEST_DIR="$WORK_DIR" GDSLLM_GPU_TEST_MIB="$GPU_TEST_MIB" \
      "$GPU_TEST_BIN" --test-threads=1 --nocapture 2>&1 | tee "$RESULTS/gpu_tests.log"; then
    gpu_tests="passed"
  else
    gpu_tests="FAILED"; status=1
  fi
else
  echo "no gds-io GPU test binary (set GPU_TEST_BIN)" >&2; gpu_tests="missing"; status=1
fi

step "synthetic model: embed + $LAYERS × $LAYER_MIB MiB layers + output"
MODEL="$WORK_DIR/synth7b"
if [ ! -f "$MODEL/layer_$(printf %03d $((LAYERS - 1))).bin" ]; then
  mkdir -p "$MODEL"
  head -c $((64 << 20)) /dev/urandom >"$WORK_DIR/chunk"
  write_blob() { # name MiB
    local name=$1 mib=$2 i
    : >"$MODEL/$name"
    for ((i = 0; i < mib / 64; i++)); do cat "$WORK_DIR/chunk" >>"$MODEL/$name"; done
    head -c $(((mib % 64) << 20)) "$WORK_DIR/chunk" >>"$MODEL/$name"
  }
  write_blob embed.bin 250
  for ((l = 0; l < LAYERS; l++)); do write_blob "$(printf 'layer_%03d.bin' "$l")" "$LAYER_MIB"; done
  write_blob output.bin 250
  sync
fi
du -sh "$MODEL" >&2

step "gdsllm bench-io"
if "$BIN" bench-io -m "$MODEL" --json >"$RESULTS/bench_io.json"; then
  bench="ok"
else
  echo "bench-io FAILED" >&2; bench="FAILED"; status=1
fi

step "summary"
python3 - "$RESULTS/doctor.json" "$RESULTS/bench_io.json" "$gpu_tests" <<'PY'
import json, sys
def load(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return {"error": str(e)}
doctor, bench, tests = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
print(f"doctor: {doctor.get('summary')}; GPU {doctor.get('gpu', {}).get('name')}; "
      f"compat_mode={doctor.get('compat_mode')} nvidia_fs={doctor.get('nvidia_fs')} p2pdma={doctor.get('p2pdma')}")
print(f"gds-io GPU tests: {tests}")
if "raw_gbps" in bench:
    print(f"bench-io: {bench['files']} files, {bench['bytes']/1e9:.2f} GB, cuFile path: {bench.get('cufile_path')}")
    print(f"{'read':<20}{'GB/s':>8}{'x raw':>8}")
    print(f"{'raw O_DIRECT':<20}{bench['raw_gbps']:>8.2f}{1.0:>8.2f}")
    if bench.get("buffered_gbps"):
        print(f"{'buffered (cp)':<20}{bench['buffered_gbps']:>8.2f}{bench['buffered_gbps']/bench['raw_gbps']:>8.2f}")
    for b in bench["backends"]:
        if b.get("gbps") is not None:
            print(f"{b['name']:<20}{b['gbps']:>8.2f}{b['ratio']:>8.2f}")
        else:
            print(f"{b['name']:<20} unavailable: {b.get('error')}")
else:
    print(f"bench-io: {bench.get('error')}")
PY
exit $status
