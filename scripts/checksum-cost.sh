#!/usr/bin/env bash
# What checking blob checksums on their first read costs (issue 17): `gdsllm bench --json` on
# one model with and without --no-checksums, alternated ROUNDS times (the machine is shared:
# compare within one run). Prints one line per setting (first pass, pp and tg tok/s, bytes
# hashed and the seconds hashing took) and the ratios.
#
#   scripts/checksum-cost.sh MODEL [extra bench flags...]
#   e.g. scripts/checksum-cost.sh smollm2 --device cpu -p 64 -n 32
# Environment: GDSLLM_BIN (default target/release/gdsllm), ROUNDS (default 3).
set -euo pipefail
model="$1"; shift
bin="${GDSLLM_BIN:-target/release/gdsllm}"
rounds="${ROUNDS:-3}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for round in $(seq "$rounds"); do
    for check in on off; do
        flag=(); [[ "$check" == off ]] && flag=(--no-checksums)
        "$bin" bench -m "$model" "$@" "${flag[@]}" --json >"$out/$check-$round.json" 2>/dev/null
    done
done
python3 - "$out" "$rounds" "$model" <<'PY'
import json, statistics, sys
out, rounds, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for check in ("on", "off"):
    runs = [json.load(open(f"{out}/{check}-{r}.json")) for r in range(1, rounds + 1)]
    first = statistics.median(d["load"]["first_pass_s"] for d in runs)
    pp = statistics.median(d["pp"]["mean"] for d in runs)
    tg = statistics.median(d["tg"]["mean"] for d in runs)
    res = runs[0]["residency"]
    rows[check] = (first, pp, tg)
    hashed = res["checksum_bytes"] / 1e6
    secs = statistics.median(d["residency"]["checksum_seconds"] for d in runs)
    rate = f", {res['checksum_bytes'] / secs / 1e9:.1f} GB/s" if secs > 0 else ""
    print(f"{model} checksums {runs[0]['checksums']}: first pass {first:.3f} s, pp {pp:.1f} tok/s, "
          f"tg {tg:.2f} tok/s; hashed {hashed:.1f} MB in {secs:.3f} s{rate} (median of {rounds})")
(f1, p1, t1), (f0, p0, t0) = rows["on"], rows["off"]
print(f"{model}: checking costs {(f1 / f0 - 1) * 100:+.1f}% first-pass time, "
      f"{(p1 / p0 - 1) * 100:+.1f}% pp tok/s, {(t1 / t0 - 1) * 100:+.1f}% tg tok/s")
PY
