#!/usr/bin/env bash
# The Python package's GPU checks and benchmark (issue 20) in one invocation on the lent GPU
# machine (Python 3.12 with torch and transformers, no network, no Rust toolchain): the wheel and
# the gdsllm binary are built on the development machine and carried in. Stages (STAGES, default
# all, in this order):
#   tests  python/tests/test_gpu.py with GDSLLM_GPU_TESTS=1 (CUDA tensors through cufile, bounce
#          and host equal the file's bytes; cuFile registrations and device memory back to where
#          they were once the tensors die; open_model on CUDA equals the CPU read; reads from
#          several threads). First makes sure cuFile can register files in the work dir (the udev
#          record that `gdsllm doctor` asks for, as scripts/gpu-io-check.sh writes it).
#   demo   python/examples/inference_demo.py (transformers LlamaForCausalLM on `meta`, one layer
#          resident at a time, weights through open_model) against `gdsllm run --device cuda
#          --temp 0` on random-weight LlamaForCausalLM models (scripts/hf_reference.py, small
#          shape) saved with save_pretrained and `gdsllm convert`ed: f16 and bf16.
#   bench  a 7B-shaped f16 model (`gdsllm synth --shape llama-7b`, 34 blobs, 13.5 GB): every blob
#          read through gds_tensor into torch tensors vs `gdsllm bench-io` for the same backend
#          (bounce, cufile), and vs safetensors.torch.load_file(..., device="cuda") on the same
#          weights saved as one safetensors file; page cache dropped before each.
# A table is printed last.
#
# Usage: scripts/python-gpu-check.sh [WORK_DIR]    (WORK_DIR must be on a disk, not tmpfs)
# Environment (all optional):
#   GDSLLM_WHEEL  the gdsllm wheel (default: the newest target/wheels/gdsllm-*.whl)
#   GDSLLM_BIN    gdsllm release binary (default: target/release/gdsllm)
#   STAGES        e.g. "tests demo" (default "tests demo bench")
#   DEMO_DTYPES   default "float16 bfloat16";  DEMO_TOKENS: tokens generated (default 32)
#   KEEP_7B=1     keep the 7B model and its safetensors copy for the next run
# LD_LIBRARY_PATH defaults to /usr/local/cuda/lib64. Budget: ~5-7 minutes on the H100 VM.
set -uo pipefail

STAGES="${STAGES:-tests demo bench}"
DEMO_DTYPES="${DEMO_DTYPES:-float16 bfloat16}"
DEMO_TOKENS="${DEMO_TOKENS:-32}"
# shellcheck source=scripts/check-common.sh
source "$(dirname "$0")/check-common.sh"
REPO=$(dirname "$SCRIPTS")
prepare_work_dir python-gpu-work "$@"
home_in_work_dir
export GDSLLM_BIN="$BIN"
WHEEL="${GDSLLM_WHEEL:-$(ls -t "$REPO"/target/wheels/gdsllm-*.whl 2>/dev/null | head -n1)}"

# --- the wheel: unpacked onto PYTHONPATH (no pip, no venv, no network needed) --------------
step "gdsllm wheel: $WHEEL"
if [ -z "$WHEEL" ] || [ ! -f "$WHEEL" ]; then
  echo "no wheel: build one with 'maturin build --release --strip -m python/Cargo.toml -o target/wheels' and carry it" >&2
  exit 1
fi
SITE="$WORK_DIR/site"
rm -rf "$SITE" && mkdir -p "$SITE"
python3 -m zipfile -e "$WHEEL" "$SITE" || { echo "cannot unpack $WHEEL" >&2; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import gdsllm, torch, transformers; print('gdsllm', gdsllm.__version__, gdsllm.cuda_status(), '| torch', torch.__version__, '| transformers', transformers.__version__)" >&2 \
  || { echo "gdsllm, torch or transformers does not import" >&2; exit 1; }

# --- cuFile registration in the work dir (the udev record cuFile needs on these VMs) --------
cufile_registration() { # prints ok or the error
  "$BIN" doctor --json --probe-mib 0 --home "$GDSLLM_HOME" 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin).get("cufile_registration")
print("no cuFile" if r is None else ("ok" if r["ok"] else "FAILED: " + str(r.get("error"))))' 2>/dev/null || echo "doctor failed"
}
reg=$(cufile_registration)
if [ "$reg" != ok ]; then
  majmin=$(stat -c '%Hd:%Ld' "$WORK_DIR"); fstype=$(findmnt -no FSTYPE -T "$WORK_DIR" | head -n1)
  record="/run/udev/data/b$majmin"; SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "cuFile registration: $reg; writing $record (I:, ID_FS_USAGE, ID_FS_TYPE=$fstype)" >&2
  $SUDO mkdir -p /run/udev/data
  printf 'I:%s\nE:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$(awk '{printf "%d", $1 * 1000000}' /proc/uptime)" "${fstype:-ext4}" \
    | $SUDO tee "$record" >/dev/null
  reg=$(cufile_registration)
fi
note "cuFile registration in $WORK_DIR: $reg"

# --- tests ---------------------------------------------------------------------------------
if has tests; then
  step "python/tests/test_gpu.py (GDSLLM_GPU_TESTS=1)"
  log="$WORK_DIR/test_gpu.log"
  if python3 -c "import pytest" 2>/dev/null; then
    runner=(python3 -m pytest -q -s -p no:cacheprovider "$REPO/python/tests/test_gpu.py")
  else
    runner=(python3 "$REPO/python/tests/test_gpu.py")   # its own runner prints pytest's closing line
  fi
  GDSLLM_GPU_TESTS=1 GDSLLM_GPU_TEST_DIR="$WORK_DIR" "${runner[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  line=$(grep -E '[0-9]+ passed|[0-9]+ failed' "$log" | tail -n1)
  [ "$rc" = 0 ] || { status=1; line="FAILED (rc $rc): $line"; }
  note "test_gpu.py: $line"
  grep -E '^io=|^(f16|bf16|q4_1):|20 cufile tensors|after the tensors died|device memory free|auto chose' "$log" | sed 's/^/  /' | while read -r l; do note "$l"; done
fi

# --- demo vs gdsllm run -----------------------------------------------------------------------
if has demo; then
  PROMPT="w17 w301 w5 w1999 w42 w42 w7 w1024 w3 w88 w640 w2 w1500 w9 w33 w400 w21"
  for dtype in $DEMO_DTYPES; do
    dir="$WORK_DIR/demo-$dtype"
    rm -rf "$dir"
    step "random-weight LlamaForCausalLM (small, $dtype) -> gdsllm convert"
    if ! python3 "$REPO/scripts/hf_reference.py" "$dir" --shape small --dtype "$dtype" --steps 1 >&2 \
        || ! "$BIN" convert "$dir/hf" "$dir/model" >&2; then
      note "demo $dtype: model FAILED"; status=1; continue
    fi
    step "gdsllm run --device cuda --temp 0 ($dtype)"
    if ! "$BIN" run --device cuda -m "$dir/model" -p "$PROMPT" -n "$DEMO_TOKENS" --temp 0 -c 256 --json >"$dir/run.json" 2>"$dir/run.log"; then
      tail -n 5 "$dir/run.log" >&2; note "demo $dtype: gdsllm run FAILED"; status=1; continue
    fi
    step "inference_demo.py ($dtype) vs gdsllm run"
    if python3 "$REPO/python/examples/inference_demo.py" "$dir/model" --prompt "$PROMPT" -n "$DEMO_TOKENS" \
        --device cuda:0 --compare "$dir/run.json" --json >"$dir/demo.json" 2>"$dir/demo.log"; then
      verdict="OK"
    else
      verdict="MISMATCH"; status=1; tail -n 20 "$dir/demo.log" >&2
    fi
    note "demo $dtype: $verdict: $(python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
c = d.get("compare", {})
verdict, reads, gb, secs = c.get("verdict"), d["layer_reads"], d["gb_read"], d["seconds"]
alive = d["memory_after"]["device_buffers"]
# No backslashes inside the f-string: Python before 3.12 refuses them.
print(f"{verdict}; {reads} layer reads ({gb:.3f} GB) through open_model, {secs:.1f} s; gdsllm buffers alive after: {alive}")' "$dir/demo.json" 2>"$dir/summary.err" || echo "no result (see $dir/demo.log)")"
    if [ -s "$dir/summary.err" ]; then
      # A demo that exits 0 without the JSON the summary reads is a failure too: show why.
      status=1
      echo "--- demo.json (head) ---" >&2; head -c 2000 "$dir/demo.json" >&2; echo >&2
      echo "--- summary error ---" >&2; tail -n 5 "$dir/summary.err" >&2
      echo "--- demo.log (tail) ---" >&2; tail -n 30 "$dir/demo.log" >&2
    fi
  done
fi

# --- bench: 7B-shaped model, gds_tensor vs bench-io vs safetensors ------------------------------
if has bench; then
  model="$WORK_DIR/llama7b-f16"
  if [ ! -f "$model/metadata.json" ]; then
    step "gdsllm synth --shape llama-7b --dtype f16"
    "$BIN" synth --shape llama-7b --dtype f16 "$model" >&2 || { note "bench: synth FAILED"; status=1; }
  fi
  st="$WORK_DIR/llama7b-f16.safetensors"
  if [ ! -f "$st" ]; then
    step "the same weights as one safetensors file"
    python3 "$REPO/python/benchmarks/read_model.py" make-safetensors "$model" "$st" >"$WORK_DIR/make-st.json" || { note "bench: safetensors FAILED"; status=1; }
  fi
  for io in bounce cufile; do
    step "gdsllm bench-io --io $io (page cache dropped)"
    "$BIN" bench-io -m "$model" --io "$io" --bounce-request-mib 1 --no-buffered --drop-caches --json \
      >"$WORK_DIR/bench-io-$io.json" 2>"$WORK_DIR/bench-io-$io.log" || { tail -n 3 "$WORK_DIR/bench-io-$io.log" >&2; status=1; }
    step "gds_tensor, every blob, io=$io (page cache dropped)"
    python3 "$REPO/python/benchmarks/read_model.py" gds "$model" --io "$io" >"$WORK_DIR/gds-$io.json" 2>"$WORK_DIR/gds-$io.log" \
      || { tail -n 5 "$WORK_DIR/gds-$io.log" >&2; status=1; }
  done
  step "safetensors.torch.load_file(device=cuda) (page cache dropped)"
  python3 "$REPO/python/benchmarks/read_model.py" safetensors "$st" >"$WORK_DIR/safetensors.json" 2>"$WORK_DIR/safetensors.log" \
    || { tail -n 5 "$WORK_DIR/safetensors.log" >&2; status=1; }
  table=$(python3 - "$WORK_DIR" <<'PY'
import json, os, sys
w = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(w, name)))
    except Exception as e:
        return {"error": str(e)}
rows, gds_best = [], 0.0
st = load("safetensors.json")
for io in ["bounce", "cufile"]:
    bench, gds = load(f"bench-io-{io}.json"), load(f"gds-{io}.json")
    ref = next((b for b in bench.get("backends", []) if b["name"].startswith(io)), {})
    if bench.get("raw_gbps") and io == "bounce":
        rows.append(("bench-io raw O_DIRECT", bench["raw_gbps"], "", "", "8 threads x 16 MiB, file after file"))
    if ref.get("gbps"):
        rows.append((f"bench-io {ref['name']}", ref["gbps"], "", "", ref.get("pattern", "")))
    if gds.get("gbps"):
        gds_best = max(gds_best, gds["gbps"])
        ratio = gds["gbps"] / ref["gbps"] if ref.get("gbps") else float("nan")
        rows.append((f"gds_tensor io={io}", gds["gbps"], f"{ratio:.2f}x bench-io", ">= 0.90 " + ("ok" if ratio >= 0.9 else "BELOW"),
                     f"{gds['blobs']} blobs, one gds_tensor each, all kept; read by {','.join(gds['io'])}"))
    else:
        rows.append((f"gds_tensor io={io}", float("nan"), "", "", gds.get("error", "failed")))
if st.get("gbps"):
    ratio = gds_best / st["gbps"]
    rows.append(("safetensors load_file cuda", st["gbps"], f"best gds_tensor {ratio:.2f}x", ">= 1.50 " + ("ok" if ratio >= 1.5 else "BELOW"),
                 f"{st['tensors']} tensors, one file, mmap + copies"))
size = load("gds-bounce.json").get("bytes") or st.get("bytes") or 0
print(f"7B-shaped f16 model, {size / 1e9:.2f} GB, page cache dropped before each read")
print(f"{'read':<28}{'GB/s':>7}  {'ratio':<22}{'target':<14}how")
for name, gbps, ratio, target, how in rows:
    print(f"{name:<28}{gbps:>7.2f}  {ratio:<22}{target:<14}{how}")
PY
)
  while IFS= read -r l; do note "$l"; done <<<"$table"
  [ "${KEEP_7B:-0}" = 1 ] || rm -rf "$model" "$st"
fi

echo
echo "=== python-gpu-check summary ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)) ==="
for line in "${summary[@]}"; do echo "$line"; done
exit $status
