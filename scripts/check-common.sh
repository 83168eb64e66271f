# Shell helpers shared by the GPU check scripts (gpu-check.sh, kernel-check.sh); sourced, not
# run. They expect WORK_DIR and STAGES to be set, and append to `summary` and set `status`.

status=0
declare -a summary
step() { echo >&2; echo "=== $* ($(date -u +%T)) ===" >&2; }
note() { summary+=("$*"); echo "[note] $*" >&2; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
newest() { ls -t target/release/deps/"$1"-* 2>/dev/null | grep -v '\.d$' | head -n1 || true; }
jq_py() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"; }

# A test binary with --test-threads=1 --nocapture, its output in $WORK_DIR/LABEL.log and on
# stdout, the result line (and any panic) in the summary. TEST_FILTER selects tests by name.
run_test_bin() { # label binary [VAR=value...]
  local label=$1 bin=$2; shift 2
  if [ -z "$bin" ] || [ ! -x "$bin" ]; then note "$label: MISSING test binary"; status=1; return; fi
  env "$@" "$bin" ${TEST_FILTER:-} --test-threads=1 --nocapture 2>&1 | tee "$WORK_DIR/$label.log"
  local rc=${PIPESTATUS[0]}
  local line; line=$(grep -E '^test result' "$WORK_DIR/$label.log" | tail -n1)
  [ "$rc" = 0 ] || { status=1; line="FAILED (rc $rc): $line"; }
  note "$label: $line"
  grep -A4 "panicked" "$WORK_DIR/$label.log" | head -n 40 | while read -r l; do note "  $l"; done
}
