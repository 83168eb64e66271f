"""Writes a small random-weight GGUF per model family, carrying that family's real tokenizer,
for comparing GdsLLM with llama.cpp on identical weights.

The weights come from numpy's legacy `RandomState(seed)`, whose stream numpy keeps fixed across
versions, and are stored as F32 (so llama.cpp's CPU matmuls are f32 too); with the same `gguf`
package the files are identical byte for byte (their SHA-256 is recorded in the references).

usage: python3 make_family_gguf.py INPUTS_DIR OUT_DIR [FAMILY ...]
  INPUTS_DIR: what fetch_inputs.py fetched (the vocab-only GGUFs).
  FAMILY: llama, llama3-rope, qwen2, qwen3, gemma3, phi3 (default: all).
A file already in OUT_DIR whose SHA-256 is the one llamacpp-reference.json records is kept;
a file written anew must come out with that SHA-256, else the script fails (the references
would not apply to it).
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import gguf

sys.path.insert(0, str(Path(__file__).parent))
from fetch_inputs import copy_tokenizer_kvs, sha256  # noqa: E402

SEED = 20261124
DIM, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 128
CONTEXT = 4096
EPS = 1e-5

# family: (GGUF architecture, vocab file, layers, tied, extras)
FAMILIES = {
    "llama": ("llama", "ggml-vocab-llama-spm.gguf", 3, False),
    "llama3-rope": ("llama", "ggml-vocab-llama-bpe.gguf", 3, False),
    "qwen2": ("qwen2", "ggml-vocab-qwen2.gguf", 3, True),
    "qwen3": ("qwen3", "ggml-vocab-qwen2.gguf", 3, True),
    "gemma3": ("gemma3", "ggml-vocab-gemma-3.gguf", 6, True),
    "phi3": ("phi3", "ggml-vocab-phi-3.gguf", 3, False),
}
# Gemma 3 test model: windowed layers of 8 positions (so 30-token runs cross the window), two
# of every three layers windowed, their own RoPE base.
GEMMA3_WINDOW, GEMMA3_PATTERN, GEMMA3_SWA_THETA = 8, 3, 10000.0
# Llama 3.1-style scaling squeezed onto this small head: factor 8, low 1, high 4, original 64.
LLAMA3_FACTOR, LLAMA3_LOW, LLAMA3_HIGH, LLAMA3_ORIG = 8.0, 1.0, 4.0, 64
# Phi-3 longrope: the original context is below the 128-position reference context, so
# llama.cpp uses the long factors.
PHI3_ORIG = 64


def llama3_freq_factors(theta: float) -> list[float]:
    """The divisor of each RoPE frequency, as llama.cpp's converter computes `rope_freqs`."""
    low_wavelen = LLAMA3_ORIG / LLAMA3_LOW
    high_wavelen = LLAMA3_ORIG / LLAMA3_HIGH
    factors = []
    for i in range(HEAD_DIM // 2):
        freq = 1.0 / theta ** (2 * i / HEAD_DIM)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(LLAMA3_FACTOR)
        else:
            smooth = (LLAMA3_ORIG / wavelen - LLAMA3_LOW) / (LLAMA3_HIGH - LLAMA3_LOW)
            factors.append(1.0 / ((1 - smooth) / LLAMA3_FACTOR + smooth))
    return factors


def write_family(family: str, inputs: Path, out: Path) -> Path:
    arch, vocab_file, n_layers, tied = FAMILIES[family]
    rng = np.random.RandomState(SEED + sorted(FAMILIES).index(family))

    def normal(*shape, std=1.0):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def matrix(rows, cols, gain=1.0):
        return normal(rows, cols, std=gain / math.sqrt(cols))

    # With tied embeddings the last token's own row dominates the logits unless the layers
    # move the residual stream well away from it: the residual branches get a larger gain, and
    # Gemma's embedding (scaled by sqrt(dim) in the model) a smaller std.
    branch_gain = 3.0 if tied else 1.0
    embd_std = 1.0 / math.sqrt(DIM) if family == "gemma3" else 1.0

    def norm(n):
        # The multiplier itself (llama.cpp's Gemma files already hold 1 + w).
        return 1.0 + normal(n, std=0.1)

    path = out / f"{family}.gguf"
    vocab = gguf.GGUFReader(str(inputs / vocab_file))
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), arch)
    copy_tokenizer_kvs(vocab, w)
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    w.add_name(f"random-{family}")
    w.add_uint32(k("context_length"), CONTEXT)
    w.add_uint32(k("embedding_length"), DIM)
    w.add_uint32(k("block_count"), n_layers)
    w.add_uint32(k("feed_forward_length"), FFN)
    w.add_uint32(k("attention.head_count"), N_HEADS)
    w.add_uint32(k("attention.head_count_kv"), N_KV_HEADS)
    w.add_uint32(k("attention.key_length"), HEAD_DIM)
    w.add_uint32(k("attention.value_length"), HEAD_DIM)
    w.add_uint32(k("rope.dimension_count"), HEAD_DIM)
    w.add_float32(k("attention.layer_norm_rms_epsilon"), EPS)
    theta = {"llama3-rope": 500000.0, "qwen2": 1e6, "qwen3": 1e6, "gemma3": 1e6}.get(family, 10000.0)
    w.add_float32(k("rope.freq_base"), theta)
    w.add_uint32("general.file_type", 0)
    if family == "gemma3":
        w.add_uint32(k("attention.sliding_window"), GEMMA3_WINDOW)
        w.add_uint32(k("attention.sliding_window_pattern"), GEMMA3_PATTERN)
        w.add_float32(k("rope.freq_base_swa"), GEMMA3_SWA_THETA)
    if family == "phi3":
        w.add_uint32(k("rope.scaling.original_context_length"), PHI3_ORIG)
        scale = CONTEXT / PHI3_ORIG
        w.add_float32(k("rope.scaling.attn_factor"), math.sqrt(1 + math.log(scale) / math.log(PHI3_ORIG)))

    q_rows, kv_rows = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    w.add_tensor("token_embd.weight", normal(n_vocab, DIM, std=embd_std))
    if family == "llama3-rope":
        w.add_tensor("rope_freqs.weight", np.array(llama3_freq_factors(theta), dtype=np.float32))
    if family == "phi3":
        w.add_tensor("rope_factors_long.weight", (1.0 + rng.uniform(0, 3, HEAD_DIM // 2)).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", (1.0 + rng.uniform(0, 0.5, HEAD_DIM // 2)).astype(np.float32))
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(DIM))
        if family == "phi3":
            w.add_tensor(p + "attn_qkv.weight", matrix(q_rows + 2 * kv_rows, DIM))
        else:
            w.add_tensor(p + "attn_q.weight", matrix(q_rows, DIM))
            w.add_tensor(p + "attn_k.weight", matrix(kv_rows, DIM))
            w.add_tensor(p + "attn_v.weight", matrix(kv_rows, DIM))
        if family == "qwen2":
            w.add_tensor(p + "attn_q.bias", normal(q_rows, std=0.2))
            w.add_tensor(p + "attn_k.bias", normal(kv_rows, std=0.2))
            w.add_tensor(p + "attn_v.bias", normal(kv_rows, std=0.2))
        if family in ("qwen3", "gemma3"):
            w.add_tensor(p + "attn_q_norm.weight", norm(HEAD_DIM))
            w.add_tensor(p + "attn_k_norm.weight", norm(HEAD_DIM))
        w.add_tensor(p + "attn_output.weight", matrix(DIM, q_rows, branch_gain))
        if family == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", norm(DIM))
        w.add_tensor(p + "ffn_norm.weight", norm(DIM))
        if family == "phi3":
            w.add_tensor(p + "ffn_up.weight", matrix(2 * FFN, DIM))
        else:
            w.add_tensor(p + "ffn_gate.weight", matrix(FFN, DIM))
            w.add_tensor(p + "ffn_up.weight", matrix(FFN, DIM))
        w.add_tensor(p + "ffn_down.weight", matrix(DIM, FFN, branch_gain))
        if family == "gemma3":
            w.add_tensor(p + "post_ffw_norm.weight", norm(DIM))
    w.add_tensor("output_norm.weight", norm(DIM))
    if not tied:
        w.add_tensor("output.weight", matrix(n_vocab, DIM))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


REFERENCE = Path(__file__).parent / "llamacpp-reference.json"


def main() -> None:
    inputs, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    recorded = {}
    if REFERENCE.is_file():
        recorded = {k: v["sha256"] for k, v in json.loads(REFERENCE.read_text())["models"].items()}
    for family in sys.argv[3:] or FAMILIES:
        path = out / f"{family}.gguf"
        if family in recorded and path.is_file() and sha256(path) == recorded[family]:
            print(path, "(kept)")
            continue
        write_family(family, inputs, out)
        if family in recorded and sha256(path) != recorded[family]:
            sys.exit(f"{path}: SHA-256 {sha256(path)} differs from the reference's {recorded[family]} "
                     "(another numpy or gguf version?)")
        print(path)


if __name__ == "__main__":
    main()
