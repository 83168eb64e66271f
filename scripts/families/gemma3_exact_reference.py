"""The exact math of the real Gemma 3 270M Q4_K_M file, as a yardstick for llama.cpp's and our
results on it: every tensor dequantized with the gguf package (llama.cpp's own gguf-py), the
forward pass written out in numpy in float64, teacher-forced on llama.cpp's prompt and greedy
tokens of `real_models` in llamacpp-reference.json. Adds to each step of those runs `exact`:
the token and top-2 margin of the exact logits and the exact logits of llama.cpp's top 8 ids.

Why it exists: llama.cpp's CPU matmuls (and our one-row decode kernels) round the activations to
8 bits per block of 32 or 256 values before the integer dot products with the quantized
weights; on this model that moves logits of ~20 by up to ~0.3 on either side, more than some
top-2 margins. Where the exact margin is below the comparison's threshold, neither llama.cpp's
token nor ours is the model's answer, and the tests stop comparing tokens there.

Run here (not in CI; ~3 minutes on 2 cores, ~3 GB of RAM), after llamacpp_reference.py --real-only:
    python3 gemma3_exact_reference.py INPUTS_DIR llamacpp-reference.json
(needs numpy and gguf==0.19.0, e.g. the venv of README.md).
"""
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).parent))
from fetch_inputs import GEMMA_FILE, sha256  # noqa: E402

NAME = Path(GEMMA_FILE).stem


class Gemma3:
    """Gemma 3 text model from a GGUF, llama.cpp's reading of it (norm weights already 1 + w,
    NEOX RoPE with base 10000 on the sliding-window layers, attention scale 1/sqrt(head_dim)
    except on the 27B, which this file is not)."""

    def __init__(self, path: Path):
        r = GGUFReader(str(path))

        def field(key):
            f = r.fields[key]
            return f.parts[f.data[0]].tolist()[0]

        self.n_layers = field("gemma3.block_count")
        self.dim = field("gemma3.embedding_length")
        self.n_heads = field("gemma3.attention.head_count")
        self.n_kv = field("gemma3.attention.head_count_kv")
        self.head_dim = field("gemma3.attention.key_length")
        self.eps = field("gemma3.attention.layer_norm_rms_epsilon")
        self.theta = field("gemma3.rope.freq_base")
        self.window = field("gemma3.attention.sliding_window")
        self.theta_local = 10000.0
        self.w = {}
        for t in r.tensors:
            self.w[t.name] = dequantize(t.data, t.tensor_type).astype(np.float64)
        self.reset()

    def reset(self):
        self.k = [[] for _ in range(self.n_layers)]
        self.v = [[] for _ in range(self.n_layers)]
        self.pos = 0

    def is_global(self, layer):
        return (layer + 1) % 6 == 0

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, theta):
        half = self.head_dim // 2
        inv = theta ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        ang = self.pos * inv
        c, s = np.cos(ang), np.sin(ang)
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def forward(self, token):
        w, hd = self.w, self.head_dim
        x = w["token_embd.weight"][token] * np.sqrt(np.float32(self.dim), dtype=np.float32)
        for layer in range(self.n_layers):
            p = f"blk.{layer}."
            a = self.rms(x, w[p + "attn_norm.weight"])
            q = (w[p + "attn_q.weight"] @ a).reshape(self.n_heads, hd)
            k = (w[p + "attn_k.weight"] @ a).reshape(self.n_kv, hd)
            v = (w[p + "attn_v.weight"] @ a).reshape(self.n_kv, hd)
            q = self.rms(q, w[p + "attn_q_norm.weight"])
            k = self.rms(k, w[p + "attn_k_norm.weight"])
            theta = self.theta if self.is_global(layer) else self.theta_local
            q, k = self.rope(q, theta), self.rope(k, theta)
            self.k[layer].append(k)
            self.v[layer].append(v)
            first = 0 if self.is_global(layer) else max(0, self.pos + 1 - self.window)
            keys = np.stack(self.k[layer][first:])  # [t, n_kv, hd]
            vals = np.stack(self.v[layer][first:])
            group = self.n_heads // self.n_kv
            out = np.empty((self.n_heads, hd))
            for h in range(self.n_heads):
                scores = keys[:, h // group] @ q[h] / np.sqrt(hd)
                e = np.exp(scores - scores.max())
                out[h] = (e / e.sum()) @ vals[:, h // group]
            o = w[p + "attn_output.weight"] @ out.reshape(-1)
            x = x + self.rms(o, w[p + "post_attention_norm.weight"])
            f = self.rms(x, w[p + "ffn_norm.weight"])
            g = w[p + "ffn_gate.weight"] @ f
            g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
            d = w[p + "ffn_down.weight"] @ (g * (w[p + "ffn_up.weight"] @ f))
            x = x + self.rms(d, w[p + "post_ffw_norm.weight"])
        self.pos += 1
        h = self.rms(x, w["output_norm.weight"])
        return w["token_embd.weight"] @ h


def main():
    inputs, out = Path(sys.argv[1]), Path(sys.argv[2])
    reference = json.loads(out.read_text())
    entry = reference["real_models"][NAME]
    path = inputs / GEMMA_FILE
    assert sha256(path) == entry["sha256"], f"{path}: not the file the references were made on"
    model = Gemma3(path)
    for run in entry["runs"]:
        model.reset()
        for t in run["prompt_ids"]:
            logits = model.forward(t)
        for i, step in enumerate(run["steps"]):
            order = np.argsort(-logits, kind="stable")[:2]
            step["exact"] = {
                "token": int(order[0]),
                "margin": float(logits[order[0]] - logits[order[1]]),
                "top": [[i_, float(logits[i_])] for i_, _ in step["top"]],
            }
            worst = max(abs(logits[i_] - l_) for i_, l_ in step["top"])
            print(f"{run['prompt']!r} step {i}: llama.cpp {step['token']} (margin "
                  f"{step['margin']:.3f}), exact {int(order[0])} (margin "
                  f"{step['exact']['margin']:.3f}); max |llama.cpp - exact| over its top 8 "
                  f"{worst:.3f}")
            logits = model.forward(step["token"])
    out.write_text(json.dumps(reference, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
