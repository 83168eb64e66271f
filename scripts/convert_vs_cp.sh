#!/usr/bin/env bash
# Times `gdsllm convert IN OUT` against `cp IN OUT && sync -f OUT` on the same disk, in
# interleaved pairs (order alternating), as in BENCHMARKS.md's convert section.
#
# Usage: scripts/convert_vs_cp.sh IN.gguf [ROUNDS] [SCRATCH_DIR]
#   GDSLLM=path/to/gdsllm (default target/release/gdsllm), EXTRA="--dtype keep" (convert flags).
# Each run starts with earlier outputs removed and flushed, and the source read once into the
# page cache; it ends with the output on disk (convert fsyncs every file; cp is followed by
# `sync -f`). Prints one line per pair and the convert ÷ cp throughput ratio.
set -euo pipefail

in=${1:?usage: convert_vs_cp.sh IN.gguf [ROUNDS] [SCRATCH_DIR]}
rounds=${2:-5}
scratch=${3:-$(dirname "$in")}
gdsllm=${GDSLLM:-target/release/gdsllm}
work=$(mktemp -d "$scratch/.convert-vs-cp.XXXXXX")
trap 'rm -rf "$work"' EXIT

prepare() {
    rm -rf "$work/out" "$work/copy"
    sync -f "$work"
    cat "$in" >/dev/null
}

time_convert() {
    prepare
    local t0=$EPOCHREALTIME
    # shellcheck disable=SC2086
    "$gdsllm" convert "$in" "$work/out" ${EXTRA:-} >/dev/null
    echo "$EPOCHREALTIME - $t0" | bc -l
}

time_cp() {
    prepare
    local t0=$EPOCHREALTIME
    cp "$in" "$work/copy"
    sync -f "$work/copy"
    echo "$EPOCHREALTIME - $t0" | bc -l
}

bytes=$(stat -c %s "$in")
echo "input: $in ($bytes bytes), $rounds pairs, scratch $scratch"
for ((i = 0; i < rounds; i++)); do
    if ((i % 2 == 0)); then
        c=$(time_convert)
        p=$(time_cp)
        order="convert, cp"
    else
        p=$(time_cp)
        c=$(time_convert)
        order="cp, convert"
    fi
    printf 'pair %d (%s): convert %.3f s, cp+sync %.3f s, convert/cp throughput %.2f\n' \
        "$((i + 1))" "$order" "$c" "$p" "$(echo "$p / $c" | bc -l)"
done
