# Shell helpers shared by the GPU check scripts (gpu-check.sh, kernel-check.sh,
# gpu-io-check.sh, python-gpu-check.sh); sourced, not run. They expect STAGES to be set and
# prepare_work_dir to have run, and append to `summary` and set `status`.

# This directory (absolute), for the scripts beside it.
SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
status=0
declare -a summary
step() { echo >&2; echo "=== $* ($(date -u +%T)) ===" >&2; }
note() { summary+=("$*"); echo "[note] $*" >&2; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
newest() { ls -t target/release/deps/"$1"-* 2>/dev/null | grep -v '\.d$' | head -n1 || true; }
# WORK_DIR: the script's first argument, else $WORK_DIR, else $PWD/DEFAULT_NAME; BIN (the gdsllm
# binary): $GDSLLM_BIN, else the release build. CUDA's libraries on the loader's path, WORK_DIR
# created, and both made absolute, so that the stages can change directory.
prepare_work_dir() { # default_name [the script's arguments...]
  WORK_DIR="${2:-${WORK_DIR:-$PWD/$1}}"
  BIN="${GDSLLM_BIN:-target/release/gdsllm}"
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-/usr/local/cuda/lib64}"
  mkdir -p "$WORK_DIR"
  WORK_DIR=$(cd "$WORK_DIR" && pwd)
  BIN=$(realpath "$BIN")
}
# gdsllm's home (the NVRTC kernel cache among it) in the work dir, not the user's.
home_in_work_dir() {
  export GDSLLM_HOME="$WORK_DIR/home"
  mkdir -p "$GDSLLM_HOME"
}
# `gdsllm synth --shape SHAPE --dtype DTYPE DIR` unless DIR holds a model already (stages share
# the synthetic models they need).
synth_once() { # shape dtype dir
  [ -f "$3/metadata.json" ] || "$BIN" synth --shape "$1" --dtype "$2" "$3" >&2
}
# Runs CMD with its stdout (a JSON result) into OUT and its stderr into OUT.log; on failure the
# log's tail on stderr, "LABEL FAILED" in the summary, status=1 and a non-zero return.
json_run() { # out label cmd...
  local out=$1 label=$2; shift 2
  "$@" >"$out" 2>"$out.log" && return 0
  tail -n 5 "$out.log" >&2; note "$label FAILED"; status=1; return 1
}
jq_py() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"; }

# A test binary with --test-threads=1 --nocapture, its output in $WORK_DIR/LABEL.log and on
# stdout, the result line (and any panic) in the summary. TEST_FILTER selects tests by name
# (space-separated substrings); TEST_TIMEOUT (seconds) stops the binary after that long.
run_test_bin() { # label binary [VAR=value...]
  local label=$1 bin=$2; shift 2
  if [ -z "$bin" ] || [ ! -x "$bin" ]; then note "$label: MISSING test binary"; status=1; return; fi
  local -a limit=()
  if [ -n "${TEST_TIMEOUT:-}" ]; then
    if [ "$TEST_TIMEOUT" -lt 5 ]; then note "$label: SKIPPED (no time left)"; status=1; return; fi
    limit=(timeout -k 5 "$TEST_TIMEOUT")
  fi
  # shellcheck disable=SC2086 # TEST_FILTER is a list of filters
  "${limit[@]}" env "$@" "$bin" ${TEST_FILTER:-} --test-threads=1 --nocapture 2>&1 | tee "$WORK_DIR/$label.log"
  local rc=${PIPESTATUS[0]}
  local line; line=$(grep -E '^test result' "$WORK_DIR/$label.log" | tail -n1)
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    line="stopped after ${TEST_TIMEOUT}s (time budget), $(grep -cE ' ok$' "$WORK_DIR/$label.log") tests passed by then"
  fi
  [ "$rc" = 0 ] || { status=1; line="FAILED (rc $rc): $line"; }
  note "$label: $line"
  grep -A4 "panicked" "$WORK_DIR/$label.log" | head -n 40 | while read -r l; do note "  $l"; done
}
