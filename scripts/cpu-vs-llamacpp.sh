#!/usr/bin/env bash
# CPU decode and prefill of one GGUF against llama.cpp on the same file and the same number of
# threads (issue 24), alternated ROUNDS times in one run (the machine may be shared: compare
# within a run). Per round: llama.cpp, `gdsllm bench --device cpu` (8-bit activations, the
# default) and `gdsllm bench --device cpu --cpu-exact` (f32 activations). Prints each run and
# the medians' ratios.
#
#   scripts/cpu-vs-llamacpp.sh GGUF MODEL THREADS
#   e.g. scripts/cpu-vs-llamacpp.sh SmolLM2-135M-Instruct.Q4_1.gguf smollm2 2
#        (MODEL: a name or directory `gdsllm convert GGUF` made from the same GGUF)
# Environment: GDSLLM_BIN (default target/release/gdsllm), ROUNDS (default 3), PROMPT (prompt
# tokens, default 128), GEN (generated tokens, default 64), LLAMA_BENCH (path of llama.cpp's
# `llama-bench`; without it llama-cpp-python is used through PYTHON, default python3).
# On the GPU machine's 16 cores: LLAMA_BENCH=…/llama-bench scripts/cpu-vs-llamacpp.sh GGUF DIR 16
# LLAMACPP_EXTRA_BUFTS=0 (llama-cpp-python only) loads the GGUF without ggml-cpu's extra buffer
# types (its AMX and repacked weight layouts): on the 2-core development VM their AMX path
# crashes on a prompt (SIGSEGV in ggml_backend_amx_mul_mat), so prefill is measurable there only
# with them off, which is not llama.cpp's fastest path: say so beside such figures.
set -euo pipefail
gguf="$1" model="$2" threads="$3"
bin="${GDSLLM_BIN:-target/release/gdsllm}"
rounds="${ROUNDS:-3}" prompt="${PROMPT:-128}" gen="${GEN:-64}"
python="${PYTHON:-python3}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

llamacpp() { # prints {"pp": tok/s, "tg": tok/s}
    if [[ -n "${LLAMA_BENCH:-}" ]]; then
        "$LLAMA_BENCH" -m "$gguf" -ngl 0 -t "$threads" -p "$prompt" -n "$gen" -r 1 -o json 2>/dev/null |
            "$python" -c 'import json,sys; r=json.load(sys.stdin)
print(json.dumps({("pp" if e["n_prompt"] else "tg"): e["avg_ts"] for e in r}))'
    else
        "$python" - "$gguf" "$threads" "$prompt" "$gen" <<'PY'
import json, os, sys, time
from llama_cpp import Llama
import llama_cpp
import llama_cpp.llama
path, threads, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if os.environ.get("LLAMACPP_EXTRA_BUFTS", "1") == "0":
    default_params = llama_cpp.llama_model_default_params
    def without_extra_bufts():
        params = default_params()
        params.use_extra_bufts = False
        return params
    llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_bufts
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
            n_ctx=n_prompt + n_gen + 8, n_batch=max(n_prompt, 8), verbose=False)
text = b"The quick brown fox jumps over the lazy dog. " * (n_prompt // 4 + 8)
tokens = llm.tokenize(text)[:n_prompt]
t0 = time.perf_counter()
llm.eval(tokens)
pp = len(tokens) / (time.perf_counter() - t0)
t0 = time.perf_counter()
# Fixed token ids (the speed does not depend on them; `llm.scores` holds only n_batch rows,
# so reading the logits of position n_tokens - 1 there failed once the prompt filled a batch).
for i in range(n_gen):
    llm.eval([tokens[i % len(tokens)]])
tg = n_gen / (time.perf_counter() - t0)
print(json.dumps({"pp": pp, "tg": tg}))
PY
    fi
}

for round in $(seq "$rounds"); do
    llamacpp >"$out/llamacpp-$round.json"
    RAYON_NUM_THREADS="$threads" "$bin" bench -m "$model" --device cpu -p "$prompt" -n "$gen" \
        -r 1 --json >"$out/gdsllm-$round.json" 2>/dev/null
    RAYON_NUM_THREADS="$threads" "$bin" bench -m "$model" --device cpu --cpu-exact -p "$prompt" \
        -n "$gen" -r 1 --json >"$out/exact-$round.json" 2>/dev/null
    echo "round $round: load $(cut -d' ' -f1 /proc/loadavg)" >&2
done
"$python" - "$out" "$rounds" "$threads" <<'PY'
import json, statistics, sys
out, rounds, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def runs(name):
    rows = [json.load(open(f"{out}/{name}-{r}.json")) for r in range(1, rounds + 1)]
    if name == "llamacpp":
        return [r["pp"] for r in rows], [r["tg"] for r in rows]
    return [r["pp"]["mean"] for r in rows], [r["tg"]["mean"] for r in rows]
peer_pp, peer_tg = runs("llamacpp")
fmt = lambda v: " / ".join(f"{x:.1f}" for x in v)
print(f"{threads} threads, {rounds} rounds (pp, tg tok/s per round)")
print(f"  llama.cpp            pp {fmt(peer_pp)}  tg {fmt(peer_tg)}")
for name, label in (("gdsllm", "gdsllm (8-bit acts)"), ("exact", "gdsllm --cpu-exact")):
    pp, tg = runs(name)
    print(f"  {label:<20} pp {fmt(pp)}  tg {fmt(tg)}  "
          f"ratio of medians: pp {statistics.median(pp) / statistics.median(peer_pp):.2f}x, "
          f"tg {statistics.median(tg) / statistics.median(peer_tg):.2f}x")
PY
