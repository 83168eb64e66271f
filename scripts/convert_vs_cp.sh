#!/usr/bin/env bash
# Times `gdsllm convert IN OUT` against `cp IN OUT && sync -f OUT` on the same disk, in
# interleaved rounds (order rotating), as in BENCHMARKS.md's convert section.
#
# Usage: scripts/convert_vs_cp.sh IN.gguf [ROUNDS] [SCRATCH_DIR]
#   GDSLLM=path/to/gdsllm (default target/release/gdsllm)
#   GDSLLM_OLD=path/to/another/gdsllm: also time that binary in each round (before/after)
#   EXTRA="--dtype keep": extra convert flags
# Each run starts with earlier outputs removed and flushed, and the source read once into the
# page cache; it ends with the output on disk (convert fsyncs every file; cp is followed by
# `sync -f`). Prints one line per round with the convert ÷ cp throughput ratio.
set -euo pipefail

in=${1:?usage: convert_vs_cp.sh IN.gguf [ROUNDS] [SCRATCH_DIR]}
rounds=${2:-5}
scratch=${3:-$(dirname "$in")}
gdsllm=${GDSLLM:-target/release/gdsllm}
old=${GDSLLM_OLD:-}
work=$(mktemp -d "$scratch/.convert-vs-cp.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Prints the seconds one run took.
time_run() {
    rm -rf "$work/out" "$work/copy"
    sync -f "$work"
    cat "$in" >/dev/null
    local t0=$EPOCHREALTIME
    case $1 in
    cp)
        cp "$in" "$work/copy"
        sync -f "$work/copy"
        ;;
    # shellcheck disable=SC2086
    new) RUST_LOG=${RUST_LOG:-warn} "$gdsllm" convert "$in" "$work/out" ${EXTRA:-} >/dev/null ;;
    # shellcheck disable=SC2086
    old) RUST_LOG=${RUST_LOG:-warn} "$old" convert "$in" "$work/out" ${EXTRA:-} >/dev/null ;;
    esac
    echo "$EPOCHREALTIME - $t0" | bc -l
}

kinds=(new cp)
[[ -n $old ]] && kinds=(new old cp)
echo "input: $in ($(stat -c %s "$in") bytes), $rounds rounds, scratch $scratch"
for ((i = 0; i < rounds; i++)); do
    declare -A took=()
    line="round $((i + 1)):"
    for ((k = 0; k < ${#kinds[@]}; k++)); do
        kind=${kinds[$(((i + k) % ${#kinds[@]}))]}
        took[$kind]=$(time_run "$kind")
        line+=$(printf ' %s %.3f s,' "$kind" "${took[$kind]}")
    done
    line+=$(printf ' convert/cp throughput %.2f' "$(echo "${took[cp]} / ${took[new]}" | bc -l)")
    if [[ -n $old ]]; then
        line+=$(printf ' (old %.2f)' "$(echo "${took[cp]} / ${took[old]}" | bc -l)")
    fi
    echo "$line, load $(cut -d' ' -f1 /proc/loadavg)"
done
