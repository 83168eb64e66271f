#!/usr/bin/env bash
# The CUDA backend's checks and benchmarks (issue 6) in one invocation on the lent GPU machine.
# There is no Rust toolchain there: binaries are built here and passed in. Stages (STAGES, default
# all, in this order):
#   tests    llama/tests/cuda_ops.rs with GDSLLM_GPU_TESTS=1 (they FAIL, not skip, without a usable
#            GPU): every op against the reference backend; SmolLM2-shaped q4_1 and small untied f16
#            models against the CPU backend; the same models through `llama::open` resident, with
#            every layer streamed, and through the pinned host tier, against the upload-once path;
#            a small model in llama.cpp's Q4_K_M mix against its f32 twin on the CPU, streamed too.
#   hf       transformers' LlamaForCausalLM with random weights (scripts/hf_reference.py, on the
#            GPU), saved with save_pretrained, `gdsllm convert`ed, compared by
#            llama/tests/cuda_hf.rs: small f16 and bf16 (GQA, untied), 7B-shaped f16 and bf16.
#   families (issue 16) the model families on CUDA: cuda_ops' family tests (their ops and the
#            windowed ring attention against the reference backend, a small model of every
#            family against the CPU backend, gemma3 streamed = resident) and geglu's quantized
#            output; batch's windowed family batched = solo (close to solo with every new
#            kernel path: windowed layers keep their own kernels); then transformers' own class of
#            every family (Qwen2, Qwen3, Gemma3, Phi3, Llama 3.1 rope) with random weights, as
#            the hf stage does, f16 and bf16.
#   gemma3   (opt-in, issue 16) the real Gemma 3 270M Q4_K_M file against llama.cpp's greedy
#            tokens and logits and the exact math of the file (llama/tests/real_gemma3.rs, CUDA
#            and CPU). The file (253 MB) does not travel in one call: pass it as GEMMA3_GGUF, or
#            as GEMMA3_GGUF_PARTS, the pieces of `split -b 50M` in order, joined here; either
#            way its SHA-256 is checked (scripts/fetch_gemma3_q4km.py, which reuses a file with
#            the right hash and cannot fetch anything on that machine).
#   smollm2  `gdsllm bench` cuda vs cpu on synthetic SmolLM2-shaped q4_1 and f16 models.
#   batch    (opt-in) `gdsllm bench --batch` on the 7B f16 model streamed with 4 GiB, and the
#            batched-equals-solo test on CUDA when BATCH_TEST_BIN is set.
#   serve    (opt-in) `gdsllm serve --device cuda` on the 7B q4_1 model with 4 GiB, measured with
#            scripts/serve_bench.py at 1, 8 and 32 clients.
#   prefix   (opt-in, issue 19) prefix caching on CUDA: batch's cuda_prefix test (greedy tokens
#            with the cache equal alone; BATCH_TEST_BIN or the newest batch-* binary), then
#            `gdsllm serve --device cuda` on the SmolLM2-shaped q4_1 model and
#            scripts/prefix_ttft.py: time to first token of a 1,000-token shared prefix, first
#            request against the later ones, and the hit counter's move; then the same server's
#            decode tokens/s with and without a grammar (scripts/constrained_cost.py).
#   models   (opt-in, issue 19) two 7B-shaped q4_1 models (`synth`, seeds 1 and 2) in the store,
#            served by one `gdsllm serve --device cuda --vram-budget 7GiB --host-cache off`
#            (MODELS_BUDGET), which holds one of them resident, not both: six completions
#            alternating between them, each a 200, /v1/models showing only the one asked for
#            loaded, its device bytes, the totals against the budget, nvidia-smi's memory used;
#            then the eviction counter (reason memory).
#   remote   (opt-in) a SmolLM2-shaped q4_1 model served over HTTP (python3 -m http.server, which
#            ignores Range) and run with `run --device cuda -m http://…/`: the same greedy tokens
#            as the local directory, every blob fetched in the first run (streamed through the
#            staging ring, --vram-budget 320MiB, since the default context's KV cache and
#            activations take ~272 MB of it), none in the second, none resident.
#   checksums (opt-in, issue 17) a flipped bit in a blob must fail `run --device cuda` (resident,
#            streamed from disk, and through the pinned host tier); then the cost of checking
#            each blob's XXH3 on its first read: `gdsllm bench` on the 7B f16 model streamed
#            with 4 GiB (--host-cache off), with and without --no-checksums, alternated.
#   kquants  (opt-in) llama/tests/cuda_kquants.rs with GDSLLM_GPU_TESTS=1 (every k-quant-era
#            dtype's matmuls — one row, tensor-core batches, cuBLAS — and embedding against the
#            reference); then for each GGUF in
#            KQUANT_GGUFS (e.g. llama-quantize Q4_K_M, Q5_K_M and Q6_K files of the random 7B):
#            `gdsllm convert`, `gdsllm verify --against` (every tensor's bytes equal the GGUF's),
#            resident pp512/tg128 (default kernels, then GDSLLM_CUDA_PATHS=superblock) and
#            streamed (--vram-budget 4GiB, no host tier) decode.
#   placement (opt-in, issue 24) the placement planner against what runs today: on the 7B f16
#            and q4_1 models with --vram-budget 4GiB and the pinned host tier, `gdsllm plan
#            --calibrate` (measures the GPU's figures: exercises llama::hybrid::calibrate on
#            CUDA) with --placement gpu and auto, then `gdsllm bench` decode batch 1/8/32 and
#            pp512; prints the CPU's matmul and the H2D copies measured at once and alone (the
#            shared-DRAM figures), predicted (gpu) against achieved with the ratio (target
#            within 25%), and what the auto placement predicts and the CPU's share it picks.
#   hybrid   (opt-in, issue 24) the split on CUDA: llama/tests/cuda_hybrid.rs with
#            GDSLLM_GPU_TESTS=1 (a synthetic model streamed from the host tier, the CPU forced
#            to half of each matmul: logits against all-GPU, each side's rows, fewer bytes
#            copied up); then on the 7B f16 and q4_1 models with --vram-budget 4GiB and the
#            pinned host tier, `gdsllm bench` --placement gpu and auto (CPU_THREADS: its
#            --cpu-threads), decode batch 1/8/32 and pp512, each printed with the planner's
#            predicted tok/s, the ratio, and auto against gpu.
#   7b       7B-shaped f16 and q4_1 (`gdsllm synth`): raw disk reference (`gdsllm bench-io`),
#            streamed decode with --vram-budget 4GiB, the pinned host tier, everything resident
#            (pp512/tg), time to first token from a cold page cache, and the same greedy tokens
#            resident and with a 2 GiB budget.
# A table is printed last.
#
# Usage: scripts/gpu-check.sh [WORK_DIR]
# Environment (all optional):
#   GDSLLM_BIN       gdsllm release binary (default: target/release/gdsllm)
#   CUDA_TEST_BIN    cuda_ops test binary (`cargo test --release -p llama --features cuda
#                    --test cuda_ops --no-run`); default: newest target/release/deps/cuda_ops-*
#   CUDA_HF_BIN      cuda_hf test binary, likewise
#   BATCH_TEST_BIN   batch test binary (`... --test batch --no-run`), for the families stage
#                    (and the batch stage); default for families: newest target/release/deps/batch-*
#   KQ_TEST_BIN      cuda_kquants test binary, likewise
#   HYBRID_TEST_BIN  cuda_hybrid test binary (`... --features cuda --test cuda_hybrid --no-run`)
#   GEMMA3_TEST_BIN  real_gemma3 test binary (`... --features cuda --test real_gemma3 --no-run`)
#   GEMMA3_GGUF      the Gemma 3 270M Q4_K_M file, for the gemma3 stage
#   GEMMA3_GGUF_PARTS its `split` pieces instead (space-separated paths, in order)
#   KQUANT_GGUFS     GGUF files for the kquants stage (space-separated paths)
#   STAGES           e.g. "tests hf" (default "tests hf smollm2 7b"; families is opt-in)
#   HF_CASES         e.g. "small:float16 llama-7b:float16" (default: small and 7B, f16 and bf16)
#   FAMILY_HF_CASES  default: qwen2 qwen3 gemma3 phi3 llama3, each float16 and bfloat16
#   TG_STREAMED      tokens generated in the streamed 7B benches (default 8)
#   DTYPES_7B        dtypes of the 7B stage (default "f16 q4_1")
# LD_LIBRARY_PATH defaults to /usr/local/cuda/lib64 (libcuda, libnvrtc).
set -uo pipefail

STAGES="${STAGES:-tests hf smollm2 7b}"
HF_CASES="${HF_CASES:-small:float16 small:bfloat16 llama-7b:float16 llama-7b:bfloat16}"
FAMILY_HF_CASES="${FAMILY_HF_CASES:-qwen2:float16 qwen2:bfloat16 qwen3:float16 qwen3:bfloat16 gemma3:float16 gemma3:bfloat16 phi3:float16 phi3:bfloat16 llama3:float16 llama3:bfloat16}"
TG_STREAMED="${TG_STREAMED:-8}"
# shellcheck source=scripts/check-common.sh
source "$(dirname "$0")/check-common.sh"
prepare_work_dir gpu-check-work "$@"
home_in_work_dir
# The URL a `gdsllm serve` started with its stdout in $1 prints, once its /health answers
# (at most two minutes).
server_url() {
  local url=""
  for _ in $(seq 1 120); do
    url=$(head -n1 "$1" 2>/dev/null)
    if [ -n "$url" ] && python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1]+'/health')" "$url" 2>/dev/null; then break; fi
    sleep 1
  done
  echo "$url"
}
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(cannot drop the page cache)" >&2; }
# The synthetic 7B of dtype $1 in $model, made by the first stage that needs it.
synth_7b() { model="$WORK_DIR/llama7b-$1"; synth_once llama-7b "$1" "$model"; }
# The host-tier setting of the 7B stages: 4 GiB of VRAM, the rest held in host memory.
HOST_TIER_7B=(--vram-budget 4GiB --host-cache 24GiB)

if has tests; then
  step "CUDA op, model and streaming tests"
  run_test_bin cuda_ops "${CUDA_TEST_BIN:-$(newest cuda_ops)}" GDSLLM_GPU_TESTS=1 >/dev/null
  grep -E "greedy tokens equal|max rel diff|agreed" "$WORK_DIR/cuda_ops.log" | sed 's/^/  /' >&2
fi

hf_case() { # shape dtype: transformers' reference, convert, compare on CUDA (cuda_hf.rs)
  local shape=$1 dtype=$2
  local dir="$WORK_DIR/hf-$shape-$dtype" t0 t1
  rm -rf "$dir"
  step "transformers reference: $shape $dtype"
  if ! python3 "$SCRIPTS/hf_reference.py" "$dir" --shape "$shape" --dtype "$dtype" >&2; then
    note "hf $shape $dtype: reference FAILED"; status=1; return
  fi
  step "gdsllm convert (HF $shape $dtype)"
  t0=$(date +%s.%N)
  if ! "$BIN" convert "$dir/hf" "$dir/model" >&2; then
    note "hf $shape $dtype: convert FAILED"; status=1; rm -rf "$dir"; return
  fi
  t1=$(date +%s.%N)
  rm -rf "$dir/hf"
  run_test_bin "cuda_hf-$shape-$dtype" "$HF_BIN" GDSLLM_HF_CASES="$dir"
  grep -E "logits|identical|part" "$WORK_DIR/cuda_hf-$shape-$dtype.log" | sed 's/^/  /' | while read -r l; do echo "$l" >&2; done
  note "  $(grep -E 'relative error' "$WORK_DIR/cuda_hf-$shape-$dtype.log" | head -n1)"
  note "  $(grep -E 'identical for' "$WORK_DIR/cuda_hf-$shape-$dtype.log" | head -n1) (convert $(python3 -c "print(f'{$t1-$t0:.1f}')") s)"
  rm -rf "$dir/model"
}
HF_BIN="${CUDA_HF_BIN:-$(newest cuda_hf)}"

if has hf; then
  for case in $HF_CASES; do hf_case "${case%%:*}" "${case##*:}"; done
fi

if has families; then
  step "CUDA family tests (cuda_ops family*, geglu's quantized output; batch windowed family)"
  TEST_FILTER="family quantized_inputs" run_test_bin cuda_ops-families "${CUDA_TEST_BIN:-$(newest cuda_ops)}" GDSLLM_GPU_TESTS=1 >/dev/null
  grep -E "max rel diff|agreed|greedy tokens equal" "$WORK_DIR/cuda_ops-families.log" | sed 's/^/  /' >&2
  TEST_FILTER=cuda_windowed_family run_test_bin batch-families "${BATCH_TEST_BIN:-$(newest batch)}" GDSLLM_GPU_TESTS=1 >/dev/null
  grep -E "sequences per pass|relative L2 from alone" "$WORK_DIR/batch-families.log" | sed 's/^/  /' >&2
  for case in $FAMILY_HF_CASES; do hf_case "${case%%:*}" "${case##*:}"; done
fi

if has gemma3; then
  step "the real Gemma 3 270M Q4_K_M file against llama.cpp (CUDA and CPU)"
  gemma_dir="$WORK_DIR/gemma3"
  mkdir -p "$gemma_dir"
  if [ -n "${GEMMA3_GGUF_PARTS:-}" ]; then
    # shellcheck disable=SC2086 # a list of paths
    cat $GEMMA3_GGUF_PARTS > "$gemma_dir/gemma-3-270m-q4_k_m.gguf"
  elif [ -n "${GEMMA3_GGUF:-}" ]; then
    cp "$GEMMA3_GGUF" "$gemma_dir/gemma-3-270m-q4_k_m.gguf"
  fi
  if gemma_file=$(python3 "$SCRIPTS/fetch_gemma3_q4km.py" "$gemma_dir"); then
    run_test_bin real_gemma3 "${GEMMA3_TEST_BIN:-$(newest real_gemma3)}" GDSLLM_GPU_TESTS=1 \
      GDSLLM_TEST_GEMMA3_GGUF="$gemma_file" >/dev/null
    grep -E "decided|max \|ours" "$WORK_DIR/real_gemma3.log" | while read -r l; do note "  $l"; done
  else
    note "gemma3: no Gemma 3 270M Q4_K_M file with the right SHA-256 (set GEMMA3_GGUF or GEMMA3_GGUF_PARTS)"; status=1
  fi
fi

if has smollm2; then
  for dtype in q4_1 f16; do
    model="$WORK_DIR/smollm2-$dtype"
    synth_once smollm2-135m "$dtype" "$model" || { status=1; continue; }
    for device in cuda cpu; do
      step "gdsllm bench --device $device on smollm2-135m $dtype"
      json="$WORK_DIR/bench-smollm2-$dtype-$device.json"
      if "$BIN" bench --device "$device" -m "$model" -p 128 -n 64 -r 2 --json >"$json"; then
        note "smollm2-135m $dtype $device: pp128 $(jq_py "$json" "'%.0f' % d['pp']['best']") tok/s, tg64 $(jq_py "$json" "'%.1f' % d['tg']['best']") tok/s"
      else
        note "smollm2-135m $dtype $device: bench FAILED"; status=1
      fi
    done
  done
fi

if has kquants; then
  step "k-quant kernels against the reference"
  run_test_bin cuda_kquants "${KQ_TEST_BIN:-$(newest cuda_kquants)}" GDSLLM_GPU_TESTS=1 >/dev/null
  grep -E "max rel diff" "$WORK_DIR/cuda_kquants.log" | sed 's/^/  /' >&2
  for gguf in ${KQUANT_GGUFS:-}; do
    name=$(basename "$gguf" .gguf)
    model="$WORK_DIR/kq-$name"
    step "gdsllm convert + verify --against $name"
    rm -rf "$model"
    if ! "$BIN" convert "$gguf" "$model" >&2; then note "$name: convert FAILED"; status=1; continue; fi
    v="$WORK_DIR/verify-$name.json"
    if "$BIN" verify "$model" --against "$gguf" --json >"$v" 2>"$v.log"; then
      note "$name: lossless: $(jq_py "$v" "'; '.join(f'{k}: {e} of {n} tensors equal' for k, (n, e, b) in d['lossless']['by_dtype'].items())")"
    else
      note "$name: verify --against FAILED: $(tail -n 1 "$v.log")"; status=1
    fi
    # The default kernels, then the q4_k/q5_k/q6_k kernels of the `superblock` path.
    for paths in none superblock; do
      r="$WORK_DIR/bench-$name-resident-$paths.json"
      step "gdsllm bench --device cuda $name resident, GDSLLM_CUDA_PATHS=$paths"
      if json_run "$r" "$name resident bench ($paths)" env GDSLLM_CUDA_PATHS="$paths" "$BIN" bench --device cuda -m "$model" -p 512 -n 128 -r 2 --json; then
        note "$name resident ($paths): pp512 $(jq_py "$r" "'%.0f' % d['pp']['best']") tok/s, tg128 $(jq_py "$r" "'%.1f' % d['tg']['best']") tok/s, $(jq_py "$r" "'%.0f kernels, %.0f stream calls' % (d['tg']['kernels_per_token'], d['tg']['stream_calls_per_token'])") per token"
      fi
    done
    s="$WORK_DIR/bench-$name-streamed.json"
    step "gdsllm bench --device cuda $name streamed, --vram-budget 4GiB"
    drop_caches
    if json_run "$s" "$name streamed bench" "$BIN" bench --device cuda -m "$model" --vram-budget 4GiB --host-cache off -p 16 -n "$TG_STREAMED" -r 1 --json; then
      note "$name streamed 4GiB: tg $(jq_py "$s" "'%.3f tok/s, %.2f GB streamed/token' % (d['tg']['best'], d['tg']['bytes_per_token'] / 1e9)")"
    fi
    rm -rf "$model"
  done
fi

if has 7b; then
  for dtype in ${DTYPES_7B:-f16 q4_1}; do
    model="$WORK_DIR/llama7b-$dtype"
    if [ ! -f "$model/metadata.json" ]; then
      step "gdsllm synth --shape llama-7b --dtype $dtype"
      t0=$(date +%s.%N)
      "$BIN" synth --shape llama-7b --dtype "$dtype" "$model" >&2 || { note "7b $dtype: synth FAILED"; status=1; continue; }
      note "7b $dtype: synth $(du -sb "$model" | cut -f1) bytes in $(python3 -c "import time; print(f'{time.time()-$t0:.1f}')") s"
    fi
    step "raw disk reference: gdsllm bench-io --io bounce on 7b $dtype"
    io="$WORK_DIR/bench-io-7b-$dtype.json"
    "$BIN" bench-io -m "$model" --io bounce --bounce-request-mib 1 --no-buffered --drop-caches --json >"$io" 2>"$WORK_DIR/bench-io-7b-$dtype.log" || status=1
    raw=$(jq_py "$io" "'%.3f' % d['raw_gbps']" 2>/dev/null || echo 0)
    note "7b $dtype: raw O_DIRECT disk read $raw GB/s (bench-io, page cache dropped)"

    bench() { # name json-out args...
      local name=$1 out=$2; shift 2
      step "gdsllm bench --device cuda 7b $dtype: $name"
      drop_caches
      json_run "$out" "7b $dtype $name:" "$BIN" bench --device cuda -m "$model" --json "$@"
    }
    s="$WORK_DIR/bench-7b-$dtype-streamed.json"
    if bench "streamed, --vram-budget 4GiB" "$s" --vram-budget 4GiB --host-cache off -p 16 -n "$TG_STREAMED" -r 1; then
      python3 - "$s" "$raw" "7b $dtype streamed 4GiB" >>"$WORK_DIR/lines" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); raw = float(sys.argv[2]); tg = d["tg"]["best"]; b = d["tg"]["bytes_per_token"]
bound = raw * 1e9 / b if b else float("nan")
print(f"{sys.argv[3]}: tg {tg:.3f} tok/s, {b/1e9:.2f} GB streamed/token, disk bound {bound:.3f} tok/s -> {tg/bound:.2f}x (target >= 0.85); io {d['io_backend']}; pp16 {d['pp']['best']:.2f} tok/s")
PY
      note "$(tail -n1 "$WORK_DIR/lines")"
    fi
    h="$WORK_DIR/bench-7b-$dtype-host.json"
    if bench "host tier, ${HOST_TIER_7B[*]}" "$h" "${HOST_TIER_7B[@]}" -p 16 -n 16 -r 1; then
      python3 - "$h" "7b $dtype host tier" >>"$WORK_DIR/lines" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); tg = d["tg"]["best"]; b = d["tg"]["bytes_per_token"]; h2d = d["references"]["pinned_h2d_gbps"]
bound = h2d * 1e9 / b if b else float("nan")
print(f"{sys.argv[2]}: tg {tg:.2f} tok/s, {b/1e9:.2f} GB copied/token, pinned H2D {h2d:.1f} GB/s bound {bound:.2f} tok/s -> {tg/bound:.2f}x (target >= 0.8)")
PY
      note "$(tail -n1 "$WORK_DIR/lines")"
    fi
    r="$WORK_DIR/bench-7b-$dtype-resident.json"
    if bench "resident" "$r" -p 512 -n 64 -r 2; then
      python3 - "$r" "7b $dtype resident" >>"$WORK_DIR/lines" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); tg = d["tg"]["best"]; w = d["tg"]["weight_bytes_per_token"]; ref = d["references"]
b_rw = ref["d2d_read_write_gbps"] * 1e9 / w; b_r = ref["d2d_read_gbps"] * 1e9 / w
print(f"{sys.argv[2]}: pp512 {d['pp']['best']:.0f} tok/s, tg64 {tg:.1f} tok/s, {w/1e9:.2f} GB weights/token; d2d copy {ref['d2d_read_gbps']:.0f} GB/s copied ({ref['d2d_read_write_gbps']:.0f} read+written): bound {b_r:.1f} / {b_rw:.1f} tok/s -> {tg/b_r:.2f}x / {tg/b_rw:.2f}x (target >= 0.6)")
PY
      note "$(tail -n1 "$WORK_DIR/lines")"
    fi
    for budget in auto 4GiB; do
      step "time to first token, cold page cache, 7b $dtype, --vram-budget $budget"
      drop_caches
      t="$WORK_DIR/ttft-7b-$dtype-$budget.json"
      if json_run "$t" "7b $dtype TTFT:" "$BIN" run --device cuda -m "$model" -p "the quick brown fox" -n 1 --temp 0 -c 64 --vram-budget "$budget" --host-cache off --json; then
        note "7b $dtype TTFT cold (--vram-budget $budget): $(jq_py "$t" "'%.2f s (load %.2f s, prompt %.2f s)' % (d['timings']['time_to_first_token_s'], d['timings']['load_s'], d['timings']['prompt_s'])")"
      fi
    done
    step "same greedy tokens resident and with --vram-budget 2GiB, 7b $dtype"
    a="$WORK_DIR/tokens-7b-$dtype-resident.json"; b="$WORK_DIR/tokens-7b-$dtype-2g.json"
    "$BIN" run --device cuda -m "$model" -p "the quick brown fox" -n 8 --temp 0 -c 64 --json >"$a" 2>"$a.log" || status=1
    "$BIN" run --device cuda -m "$model" -p "the quick brown fox" -n 8 --temp 0 -c 64 --vram-budget 2GiB --host-cache off --json >"$b" 2>"$b.log" || status=1
    if python3 -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); print(a['tokens'], b['tokens'], b['residency']['total']['disk_bytes']); sys.exit(a['tokens']!=b['tokens'])" "$a" "$b" >&2; then
      note "7b $dtype: 8 greedy tokens identical resident vs --vram-budget 2GiB (streamed)"
    else
      note "7b $dtype: resident vs 2GiB tokens DIFFER or failed"; status=1
    fi
  done
fi

if has batch; then
  # Issue 7: batched decoding on the 7B-shaped f16 model streamed with a 4 GiB budget.
  synth_7b f16 || status=1
  if [ -n "${BATCH_TEST_BIN:-}" ]; then
    step "batched forward equals solo on CUDA ($BATCH_TEST_BIN)"
    run_test_bin batch_cuda "$BATCH_TEST_BIN" GDSLLM_GPU_TESTS=1 >/dev/null
  fi
  step "gdsllm bench --batch ${BATCHES:-1,8,32} on 7b f16, --vram-budget 4GiB"
  j="$WORK_DIR/bench-batch-7b-f16.json"
  drop_caches
  if json_run "$j" "batch bench" "$BIN" bench --device cuda -m "$model" --vram-budget 4GiB --host-cache off --batch "${BATCHES:-1,8,32}" -p 16 -n "${TG_BATCH:-4}" -r 1 --json; then
    python3 - "$j" >>"$WORK_DIR/lines" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["batch"]
base = next((r["mean"] for r in rows if r["batch"] == 1), None)
for r in rows:
    x = f"{r['mean']/base:.1f}x batch 1" if base else "no batch 1"
    print(f"7b f16 streamed 4GiB batch {r['batch']}: {r['mean']:.3f} tok/s aggregate ({x}), {r['per_seq_tok_per_s']:.3f} per sequence, {r['bytes_per_token']/1e9:.3f} GB streamed per generated token")
PY
    tail -n 3 "$WORK_DIR/lines" | while read -r l; do note "$l"; done
  fi
fi

if has serve; then
  # Issue 8: requests/s and tokens/s of `gdsllm serve` on the GPU with a streamed 7B model.
  synth_7b "${SERVE_DTYPE:-q4_1}" || status=1
  step "gdsllm serve --device cuda on 7b ${SERVE_DTYPE:-q4_1}, --vram-budget 4GiB"
  "$BIN" serve --device cuda -m "$model" --vram-budget 4GiB --host-cache off --port 0 -c 256 \
      --max-batch "${SERVE_MAX_BATCH:-8}" >"$WORK_DIR/serve.out" 2>"$WORK_DIR/serve.log" &
  spid=$!
  url=$(server_url "$WORK_DIR/serve.out")
  if python3 "$SCRIPTS/serve_bench.py" --url "$url" --clients 1 8 32 --seconds "${SERVE_SECONDS:-15}" --max-tokens 16 >"$WORK_DIR/serve-bench.jsonl"; then
    while read -r l; do note "serve 7b ${SERVE_DTYPE:-q4_1} 4GiB: $l"; done <"$WORK_DIR/serve-bench.jsonl"
  else
    note "serve bench FAILED"; tail -n 5 "$WORK_DIR/serve.log" >&2; status=1
  fi
  kill -INT "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
fi

if has prefix; then
  step "prefix caching on CUDA: batch cuda_prefix test, TTFT of a shared 1000-token prefix"
  TEST_FILTER=cuda_prefix run_test_bin batch-prefix "${BATCH_TEST_BIN:-$(newest batch)}" GDSLLM_GPU_TESTS=1 >/dev/null
  grep -E "PrefixCacheStats" "$WORK_DIR/batch-prefix.log" | sed 's/^/  /' >&2
  model="$WORK_DIR/smollm2-q4_1"
  synth_once smollm2-135m q4_1 "$model" || status=1
  "$BIN" serve --device cuda -m "$model" --port 0 -c 2048 --max-batch 4 \
      >"$WORK_DIR/prefix-serve.out" 2>"$WORK_DIR/prefix-serve.log" &
  spid=$!
  url=$(server_url "$WORK_DIR/prefix-serve.out")
  if python3 "$SCRIPTS/prefix_ttft.py" --url "$url" --prefix 1000 --requests 4 --vocab 49152 >"$WORK_DIR/prefix-ttft.json"; then
    note "prefix cache smollm2-135m q4_1 cuda: $(cat "$WORK_DIR/prefix-ttft.json")"
  else
    note "prefix TTFT FAILED"; tail -n 5 "$WORK_DIR/prefix-serve.log" >&2; status=1
  fi
  if python3 "$SCRIPTS/constrained_cost.py" --url "$url" --tokens 128 --rounds 3 --vocab 49152 >"$WORK_DIR/constrained.json"; then
    note "grammar cost smollm2-135m q4_1 cuda: $(cat "$WORK_DIR/constrained.json")"
  else
    note "constrained decoding cost FAILED"; tail -n 5 "$WORK_DIR/prefix-serve.log" >&2; status=1
  fi
  kill -INT "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
fi

if has models; then
  step "two 7B q4_1 models in one serve, --vram-budget ${MODELS_BUDGET:-7GiB} for one: alternating requests"
  mkdir -p "$GDSLLM_HOME/models"
  for seed in 1 2; do
    model="$GDSLLM_HOME/models/7b-q4_1-$seed"
    [ -f "$model/metadata.json" ] || "$BIN" synth --shape llama-7b --dtype q4_1 --seed "$seed" "$model" >&2 || status=1
  done
  "$BIN" serve --device cuda -m "$GDSLLM_HOME/models/7b-q4_1-1" --vram-budget "${MODELS_BUDGET:-7GiB}" \
      --host-cache off --port 0 -c 512 --max-batch 1 --prefix-cache-bytes 0 \
      >"$WORK_DIR/models-serve.out" 2>"$WORK_DIR/models-serve.log" &
  spid=$!
  url=$(server_url "$WORK_DIR/models-serve.out")
  if python3 - "$url" >"$WORK_DIR/models.txt" <<'PY'
import json, subprocess, sys, urllib.request
url = sys.argv[1]
def get(path):
    return urllib.request.urlopen(url + path, timeout=600).read().decode()
def post(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())
for i, name in enumerate(["7b-q4_1-2", "7b-q4_1-1"] * 3):
    r = post("/v1/completions", {"model": name, "prompt": "hello", "max_tokens": 8, "temperature": 0})
    assert r["model"] == name, r
    listed = json.loads(get("/v1/models"))
    loaded = [m["id"] for m in listed["data"] if m["loaded"]]
    assert loaded == [name], f"asked {name}, loaded {loaded}"
    device = [m["memory_bytes"]["device"] for m in listed["data"] if m["id"] == name][0]
    try:
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError as e:
        used = f"n/a ({e})"
    print(f"request {i} {name}: loaded {loaded}, it holds {device / 2**30:.2f} GiB; server {listed['memory']['held_bytes']['device'] / 2**30:.2f} of {listed['memory']['budget_bytes']['device'] / 2**30:.2f} GiB; nvidia-smi {used}")
evictions = [l for l in get("/metrics").splitlines() if l.startswith("gdsllm_model_evictions_total")]
print("; ".join(evictions))
assert any('reason="memory"} 6' in l for l in evictions), evictions
PY
  then
    while read -r l; do note "models 7b q4_1 x2: $l"; done <"$WORK_DIR/models.txt"
  else
    note "models stage FAILED"; cat "$WORK_DIR/models.txt" >&2; tail -n 5 "$WORK_DIR/models-serve.log" >&2; status=1
  fi
  kill -INT "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
fi

if has remote; then
  # Issue 18: the network tier on CUDA: blobs fetched into the cache before the I/O path reads
  # the files, the same tokens as the local model, nothing fetched once everything is local.
  model="$WORK_DIR/smollm2-q4_1"
  synth_once smollm2-135m q4_1 "$model" || status=1
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  (cd "$model" && exec python3 -m http.server "$port" --bind 127.0.0.1) >"$WORK_DIR/remote-http.log" 2>&1 &
  hpid=$!
  sleep 1
  remote_home="$WORK_DIR/remote-home"
  rm -rf "$remote_home/remote"
  mkdir -p "$remote_home"
  total=$(python3 -c "import json,sys; print(sum(b['length'] for b in json.load(open(sys.argv[1]))['blobs']))" "$model/metadata.json")
  prompt=(-p "the quick brown fox" -n 8 --temp 0 -c 64 --json)
  step "gdsllm run --device cuda on smollm2-135m q4_1: local, then served over HTTP twice"
  "$BIN" run --device cuda -m "$model" "${prompt[@]}" --vram-budget 320MiB --host-cache off >"$WORK_DIR/remote-local.json" 2>"$WORK_DIR/remote-local.log" || status=1
  for pass in first second resident; do
    budget=(--vram-budget 320MiB --host-cache off)
    [ "$pass" = resident ] && budget=()
    out="$WORK_DIR/remote-$pass.json"
    if GDSLLM_HOME="$remote_home" "$BIN" run --device cuda -m "http://127.0.0.1:$port/" "${prompt[@]}" "${budget[@]}" >"$out" 2>"$out.log"; then
      same=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['text'] == json.load(open(sys.argv[2]))['text'])" "$out" "$WORK_DIR/remote-local.json")
      net=$(jq_py "$out" "d['residency']['total']['network_bytes']")
      expected=$([ "$pass" = first ] && echo "$total" || echo 0)
      note "remote $pass run: same text as local: $same, network bytes $net (expected $expected of $total), $(jq_py "$out" "'%.1f' % d['timings']['gen_tok_per_s']") tok/s"
      { [ "$same" = True ] && [ "$net" = "$expected" ]; } || status=1
    else
      note "remote $pass run FAILED"; tail -n 5 "$out.log" >&2; status=1
    fi
  done
  kill "$hpid" 2>/dev/null; wait "$hpid" 2>/dev/null
fi

if has placement; then
  for dtype in ${DTYPES_7B:-f16 q4_1}; do
    synth_7b "$dtype" || { note "7b $dtype: synth FAILED"; status=1; continue; }
    for mode in gpu auto; do
      p="$WORK_DIR/plan-7b-$dtype-$mode.json"
      step "gdsllm plan --placement $mode on 7b $dtype, ${HOST_TIER_7B[*]}"
      calibrate=(); [ "$mode" = gpu ] && calibrate=(--calibrate)
      json_run "$p" "7b $dtype plan --placement $mode" "$BIN" plan -m "$model" "${HOST_TIER_7B[@]}" --context 128 --placement "$mode" "${calibrate[@]}" --json
    done
    b="$WORK_DIR/bench-placement-7b-$dtype-batch.json"
    step "gdsllm bench --batch 1,8,32 on 7b $dtype, ${HOST_TIER_7B[*]}"
    json_run "$b" "7b $dtype placement batch bench" "$BIN" bench --device cuda -m "$model" "${HOST_TIER_7B[@]}" --batch 1,8,32 -p 16 -n "${TG_BATCH:-8}" -r 1 --json
    r="$WORK_DIR/bench-placement-7b-$dtype-pp.json"
    step "gdsllm bench -p 512 on 7b $dtype, ${HOST_TIER_7B[*]}"
    json_run "$r" "7b $dtype placement pp bench" "$BIN" bench --device cuda -m "$model" "${HOST_TIER_7B[@]}" -p 512 -n 4 -r 1 --json
    python3 - "$WORK_DIR" "$dtype" >>"$WORK_DIR/lines" <<'PY' && tail -n 6 "$WORK_DIR/lines" | while read -r l; do note "$l"; done
import json, sys
w, dtype = sys.argv[1], sys.argv[2]
plan = {m: json.load(open(f"{w}/plan-7b-{dtype}-{m}.json")) for m in ("gpu", "auto")}
batch = {r["batch"]: r["mean"] for r in json.load(open(f"{w}/bench-placement-7b-{dtype}-batch.json"))["batch"]}
pp = json.load(open(f"{w}/bench-placement-7b-{dtype}-pp.json"))["pp"]["best"]
g = plan["gpu"]["calibration"]["gpu"]
mm = ", ".join(f"{r['rows']}:{r['gbps']:.0f}" for r in g["matmul"] if str(r["dtype"]).lower() == dtype)
print(f"7b {dtype} calibration: GPU {g['name']} layer matmuls GB/s by rows {mm}, pinned H2D {g['h2d_gbps']:.1f} GB/s, handoff {g['handoff_us']:.1f} us; CPU "
      + ", ".join(f"{c['dtype']} {c['gbps_1']:.1f}/{c['gbps_8']:.1f} GB/s" for c in plan["gpu"]["calibration"]["cpu"]))
conc = [c for c in g.get("concurrent", []) if str(c["dtype"]).lower() == dtype]
print(f"7b {dtype} CPU matmul and H2D copies at once (alone), GB/s: "
      + ("; ".join(f"{c['rows']} rows CPU {c['cpu_gbps']:.1f} ({c['cpu_alone_gbps']:.1f}) copies {c['h2d_gbps']:.1f} ({c['h2d_alone_gbps']:.1f})" for c in conc) or "NOT MEASURED"))
def placed(mode, kind, n):
    for p in plan[mode]["placement"]["passes"]:
        if p["pass"]["kind"] == kind and p["pass"].get("batch", p["pass"].get("rows")) == n:
            return p
for kind, n, achieved in [("decode", 1, batch.get(1)), ("decode", 8, batch.get(8)), ("decode", 32, batch.get(32)), ("prefill", 512, pp)]:
    pg, auto = placed("gpu", kind, n)["tokens_per_s"], placed("auto", kind, n)
    cpu = sum(u["cpu_bytes"] for u in auto["units"])
    share = cpu / max(1, cpu + sum(u["gpu_bytes"] for u in auto["units"] if u["tier"] == "host"))
    ratio = f"{pg / achieved:.2f}x" if achieved else "n/a"
    print(f"7b {dtype} host tier 4GiB {kind} {n}: predicted (gpu) {pg:.2f} tok/s, achieved {achieved or float('nan'):.2f} -> predicted/achieved {ratio} (target 0.75-1.25); auto placement predicts {auto['tokens_per_s']:.2f} with the CPU on {share:.0%} of the host tier's bytes")
PY
  done
fi

if has hybrid; then
  step "CUDA+CPU split test"
  run_test_bin cuda_hybrid "${HYBRID_TEST_BIN:-$(newest cuda_hybrid)}" GDSLLM_GPU_TESTS=1 >/dev/null
  grep -E "max rel diff|bytes per copy|beside the copies" "$WORK_DIR/cuda_hybrid.log" | sed 's/^/  /' | while read -r l; do note "$l"; done
  threads=(); [ -n "${CPU_THREADS:-}" ] && threads=(--cpu-threads "$CPU_THREADS")
  for dtype in ${DTYPES_7B:-f16 q4_1}; do
    synth_7b "$dtype" || { note "7b $dtype: synth FAILED"; status=1; continue; }
    for mode in gpu auto; do
      b="$WORK_DIR/bench-hybrid-7b-$dtype-$mode-batch.json"
      step "gdsllm bench --placement $mode --batch 1,8,32 on 7b $dtype, ${HOST_TIER_7B[*]}"
      json_run "$b" "7b $dtype --placement $mode batch bench" "$BIN" bench --device cuda -m "$model" "${HOST_TIER_7B[@]}" --placement "$mode" "${threads[@]}" --batch 1,8,32 -p 16 -n "${TG_BATCH:-8}" -r 1 --json
      r="$WORK_DIR/bench-hybrid-7b-$dtype-$mode-pp.json"
      step "gdsllm bench --placement $mode -p 512 on 7b $dtype, ${HOST_TIER_7B[*]}"
      json_run "$r" "7b $dtype --placement $mode pp bench" "$BIN" bench --device cuda -m "$model" "${HOST_TIER_7B[@]}" --placement "$mode" "${threads[@]}" -p 512 -n 4 -r 1 --json
    done
    python3 - "$WORK_DIR" "$dtype" >>"$WORK_DIR/lines" <<'PY' && tail -n 6 "$WORK_DIR/lines" | while read -r l; do note "$l"; done
import json, sys
w, dtype = sys.argv[1], sys.argv[2]
rows = {}
for mode in ("gpu", "auto"):
    try:
        batch = json.load(open(f"{w}/bench-hybrid-7b-{dtype}-{mode}-batch.json"))
        pp = json.load(open(f"{w}/bench-hybrid-7b-{dtype}-{mode}-pp.json"))
    except (OSError, ValueError) as e:
        print(f"7b {dtype} hybrid {mode}: no result ({e})"); continue
    for r in batch["batch"]:
        rows[(mode, f"decode {r['batch']}")] = (r["mean"], r.get("predicted_tok_s"))
    rows[(mode, "pp512")] = (pp["pp"]["best"], pp["pp"].get("predicted_tok_s"))
    print(f"7b {dtype} hybrid {mode}: split {json.dumps(batch.get('placement', {}).get('split'))} (batch run), {json.dumps(pp.get('placement', {}).get('split'))} (pp run)")
for p in ("decode 1", "decode 8", "decode 32", "pp512"):
    parts = []
    for mode in ("gpu", "auto"):
        a, pr = rows.get((mode, p), (None, None))
        ratio = f"{pr / a:.2f}x" if a and pr else "n/a"
        parts.append(f"{mode} {a or float('nan'):.2f} tok/s (predicted {pr or float('nan'):.2f}, {ratio})")
    g, h = rows.get(("gpu", p), (None,))[0], rows.get(("auto", p), (None,))[0]
    speed = f"{h / g:.2f}x" if g and h else "n/a"
    print(f"7b {dtype} 4GiB+host tier {p}: " + "; ".join(parts) + f"; auto/gpu {speed}")
PY
  done
fi

if has checksums; then
  # Issue 17: blob checksums at run time on the GPU paths (device buffers are hashed by copying
  # them back; the host tier is hashed in place), and what checking costs on the streamed 7B.
  small="$WORK_DIR/smollm2-q4_1-flip"
  rm -rf "$small"
  "$BIN" synth --shape smollm2-135m --dtype q4_1 --layers 4 "$small" >&2 || status=1
  python3 - "$small/layer_002.bin" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(5000); b = f.read(1); f.seek(5000); f.write(bytes([b[0] ^ 0x10]))
PY
  for mode in "resident:--vram-budget auto --host-cache off" "streamed:--vram-budget 320MiB --host-cache off" "host-tier:--vram-budget 320MiB --host-cache 1GiB"; do
    name=${mode%%:*}; flags=${mode#*:}
    step "flipped bit, run --device cuda ($name)"
    # shellcheck disable=SC2086
    if "$BIN" run --device cuda -m "$small" $flags -p hello -n 4 --temp 0 >/dev/null 2>"$WORK_DIR/flip-$name.log"; then
      note "checksums $name: FAILED (a flipped bit ran without error)"; status=1
    elif grep -q "layer_002.bin: checksum mismatch" "$WORK_DIR/flip-$name.log"; then
      note "checksums $name: flipped bit refused: $(grep -o 'layer_002.bin: checksum mismatch[^(]*' "$WORK_DIR/flip-$name.log" | head -n1)"
    else
      note "checksums $name: FAILED (error without the checksum message)"; tail -n 3 "$WORK_DIR/flip-$name.log" >&2; status=1
    fi
  done
  synth_7b f16 || status=1
  for rep in 1 2; do
    for check in on off; do
      extra=""; [ "$check" = off ] && extra="--no-checksums"
      step "checksum cost: bench 7b f16 streamed 4GiB, checksums $check (round $rep)"
      j="$WORK_DIR/bench-7b-checksums-$check-$rep.json"
      # shellcheck disable=SC2086
      "$BIN" bench --device cuda -m "$model" --vram-budget 4GiB --host-cache off -p 16 -n "$TG_STREAMED" -r 1 --json $extra >"$j" 2>"$j.log" || { note "checksum bench $check FAILED"; status=1; }
    done
  done
  python3 - "$WORK_DIR" >>"$WORK_DIR/lines" <<'PY' && tail -n 1 "$WORK_DIR/lines" | while read -r l; do note "$l"; done
import json, sys
w = sys.argv[1]
def load(check):
    runs = [json.load(open(f"{w}/bench-7b-checksums-{check}-{r}.json")) for r in (1, 2)]
    tg = sum(d["tg"]["mean"] for d in runs) / 2
    first = sum(d["load"]["first_pass_s"] for d in runs) / 2
    return tg, first, runs[0]
on, first_on, d_on = load("on")
off, first_off, _ = load("off")
res = d_on["residency"]
print(f"7b f16 streamed 4GiB: tg {on:.3f} tok/s with checksums vs {off:.3f} without ({(on/off-1)*100:+.1f}%, target >= -3%); "
      f"first pass {first_on:.2f} s vs {first_off:.2f} s; hashed {res['checksum_bytes']/1e9:.2f} GB in {res['checksum_seconds']:.2f} s; checksums field: {d_on['checksums']}")
PY
fi

echo
echo "=== gpu-check summary ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)) ==="
for line in "${summary[@]}"; do echo "$line"; done
exit $status
