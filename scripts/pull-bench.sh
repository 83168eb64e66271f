#!/usr/bin/env bash
# Pull throughput against curl (issue 18) from a prebuilt example binary: builds nothing.
# Makes a random file of SIZE_MIB MiB (default 1024) in a temporary directory, prints the CPU
# model, whether the CPU has the SHA extensions (sha_ni), what `sha256sum` and `openssl`
# (if installed) hash that file at, the sha256 rate of each stage of our download alone
# (`loopback_pull --stages`), then a table of RUNS invocations (default 5) of
# `loopback_pull FILE ROUNDS` (curl and our download alternating on the same file, best of
# ROUNDS, default 3, per tool per invocation).
#
#   scripts/pull-bench.sh [BIN]
#   BIN: the loopback_pull example, default target/release/examples/loopback_pull, built with
#   cargo build --release -p gdsllm-fetch --features testing --example loopback_pull
# Environment: SIZE_MIB, RUNS, ROUNDS, TMPDIR (where the file goes; it needs twice SIZE_MIB).
set -euo pipefail
bin="${1:-target/release/examples/loopback_pull}"
size_mib="${SIZE_MIB:-1024}"
runs="${RUNS:-5}"
rounds="${ROUNDS:-3}"
[[ -x "$bin" ]] || { echo "pull-bench: no executable $bin (build it: see the header)" >&2; exit 2; }
command -v curl >/dev/null || { echo "pull-bench: curl is not installed" >&2; exit 2; }
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
file="$dir/random.bin"
head -c "$((size_mib << 20))" /dev/urandom >"$file"

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
if grep -qw sha_ni /proc/cpuinfo; then sha_ni=yes; else sha_ni=no; fi
echo "cpu: $cpu; $(nproc) cores; sha_ni: $sha_ni; load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "file: $size_mib MiB random, in $dir"

# A rate from the seconds a command took over the file (page cache warm: it was just written).
rate() {
    local started ended
    started=$(date +%s.%N)
    "$@" >/dev/null
    ended=$(date +%s.%N)
    awk -v b="$((size_mib << 20))" -v s="$started" -v e="$ended" \
        'BEGIN { printf "%.2f GB/s\n", b / (e - s) / 1e9 }'
}
echo "sha256sum: $(rate sha256sum "$file")"
if command -v openssl >/dev/null; then
    echo "openssl dgst -sha256: $(rate openssl dgst -sha256 "$file")"
fi
"$bin" --stages "$file" "$rounds" | grep -v '^pull-stages '

echo
echo "| run | curl | gdsllm download | ratio |"
echo "|---|---|---|---|"
for run in $(seq "$runs"); do
    line="$("$bin" "$file" "$rounds" | grep '^pull-bench ')"
    # pull-bench bytes=… rounds=… curl_gbps=… ours_gbps=… ratio=…
    echo "$line" | awk -v run="$run" '{
        for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
        printf "| %s | %.2f GB/s | %.2f GB/s | %.2f× |\n", run, f["curl_gbps"], f["ours_gbps"], f["ratio"]
    }'
done
