#!/usr/bin/env bash
# The hostile-input harness of issue 17, at full size, against the release binary: prints the
# bad-input table (attack family -> inputs -> outcome counts) and the HTTP figures that
# BENCHMARKS.md quotes. CI runs the same tests with a few cases each (cargo test). The harness
# itself is built in the test profile; what it attacks is GDSLLM_BIN.
#
#   scripts/hostile-inputs.sh [CASES]      # default 200 cases per random family
#
# Environment: GDSLLM_HOSTILE_SEED (default: random), GDSLLM_BIN (default: the release
# build), SERVE_MODEL (a model for the stream load; default: a tiny random model),
# STREAMS (default 1000), HALF_OPEN (default 20000).
set -euo pipefail
cd "$(dirname "$0")/.."
cases="${1:-200}"
seed="${GDSLLM_HOSTILE_SEED:-$RANDOM$RANDOM}"
if [[ -z "${GDSLLM_BIN:-}" ]]; then
    cargo build --release -p gdsllm-cli >&2
    GDSLLM_BIN="$PWD/target/release/gdsllm"
fi
export GDSLLM_BIN
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo); binary: $GDSLLM_BIN; seed: $seed; cases per family: $cases" >&2
echo "| attack family | inputs | clear error | same output | abort | hang | different output |"
echo "|---|---|---|---|---|---|---|"
GDSLLM_HOSTILE_CASES="$cases" GDSLLM_HOSTILE_SEED="$seed" \
    cargo test -p gdsllm-cli --test hostile -- --nocapture --test-threads 1 \
    >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
grep -ho 'HOSTILE|.*' "$log" | sed 's/^HOSTILE|/|/'

# The same GGUF tensor-table attack in process (no process start per case): many more cases.
GDSLLM_PROPTEST_CASES="$((cases * 10))" \
    cargo test -p gdsllm-convert --test gguf_tables -- --nocapture >"$log" 2>&1 \
    || { cat "$log" >&2; exit 1; }
echo "| GGUF tensor tables (in process, proptest) | $((cases * 10)) | refused or identical: all passed | | 0 | 0 | 0 |"

# HTTP: a server on a tiny random model (or SERVE_MODEL), loopback only.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"; rm -f "$log"; [[ -n "${server:-}" ]] && kill "$server" 2>/dev/null || true' EXIT
model="${SERVE_MODEL:-}"
if [[ -z "$model" ]]; then
    model="$tmp/tiny"
    "$GDSLLM_BIN" synth --shape custom --layers 2 --dim 64 --ffn 128 --heads 4 --kv-heads 2 \
        --vocab 320 --dtype q8_0 "$model" >/dev/null
fi
"$GDSLLM_BIN" serve -m "$model" --port 0 --device cpu --max-batch 8 >"$tmp/url" 2>"$tmp/serve.log" &
server=$!
for _ in $(seq 200); do [[ -s "$tmp/url" ]] && break; sleep 0.1; done
url="$(head -n1 "$tmp/url")"
for _ in $(seq 600); do curl -fs "$url/health" >/dev/null 2>&1 && break; sleep 0.1; done
echo >&2 "server: $url (model $model)"
python3 scripts/hostile_http.py --url "$url" malformed
python3 scripts/hostile_http.py --url "$url" half-open --count "${HALF_OPEN:-20000}"
python3 scripts/hostile_http.py --url "$url" streams --count "${STREAMS:-1000}" --max-tokens 8
