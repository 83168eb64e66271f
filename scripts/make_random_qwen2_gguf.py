# A Qwen2-shaped GGUF with random F16 weights (f32 norms and q/k/v biases) and the tokenizer of
# VOCAB.gguf, for issue 16's side-by-side runs with llama.cpp: `llama-quantize` it to Q4_K_M,
# `gdsllm convert` the result, run both on the same file. Needs the `gguf` and `numpy` packages;
# draws on the GPU with torch where it can (13 GB of f16 for the default 7B shape).
# usage: make_random_qwen2_gguf.py VOCAB.gguf OUT.gguf [dim ffn layers heads kv_heads]
# (default: Qwen2-7B's 3584 18944 28 28 4; the vocabulary is VOCAB's, not Qwen's 152k)
import os
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "families"))
from fetch_inputs import copy_tokenizer_kvs  # noqa: E402

vocab_path, out = sys.argv[1:3]
dim, ffn, layers, heads, kv_heads = (int(x) for x in (sys.argv[3:8] or (3584, 18944, 28, 28, 4)))
head_dim = dim // heads
kv_dim = kv_heads * head_dim

try:
    import torch

    generator = torch.Generator(device="cuda").manual_seed(0)

    def random(*shape, scale=0.02, dtype=np.float16):
        t = torch.randn(*shape, generator=generator, device="cuda") * scale
        return t.to(torch.float16 if dtype == np.float16 else torch.float32).cpu().numpy()

except Exception:  # no torch or no GPU: numpy on the CPU (slower for a 7B, same shapes)
    rng = np.random.default_rng(0)

    def random(*shape, scale=0.02, dtype=np.float16):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def norm(n):
    return 1 + random(n, scale=0.1, dtype=np.float32)


reader = gguf.GGUFReader(vocab_path)
writer = gguf.GGUFWriter(out, "qwen2")
n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
copy_tokenizer_kvs(reader, writer)

writer.add_name("random-qwen2")
writer.add_context_length(32768)
writer.add_embedding_length(dim)
writer.add_block_count(layers)
writer.add_feed_forward_length(ffn)
writer.add_head_count(heads)
writer.add_head_count_kv(kv_heads)
writer.add_rope_freq_base(1000000.0)
writer.add_layer_norm_rms_eps(1e-6)
writer.add_vocab_size(n_vocab)
writer.add_file_type(1)  # MOSTLY_F16

writer.add_tensor("token_embd.weight", random(n_vocab, dim))
for i in range(layers):
    p = f"blk.{i}."
    writer.add_tensor(p + "attn_norm.weight", norm(dim))
    writer.add_tensor(p + "attn_q.weight", random(dim, dim))
    writer.add_tensor(p + "attn_q.bias", random(dim, dtype=np.float32))
    writer.add_tensor(p + "attn_k.weight", random(kv_dim, dim))
    writer.add_tensor(p + "attn_k.bias", random(kv_dim, dtype=np.float32))
    writer.add_tensor(p + "attn_v.weight", random(kv_dim, dim))
    writer.add_tensor(p + "attn_v.bias", random(kv_dim, dtype=np.float32))
    writer.add_tensor(p + "attn_output.weight", random(dim, dim))
    writer.add_tensor(p + "ffn_norm.weight", norm(dim))
    writer.add_tensor(p + "ffn_gate.weight", random(ffn, dim))
    writer.add_tensor(p + "ffn_up.weight", random(ffn, dim))
    writer.add_tensor(p + "ffn_down.weight", random(dim, ffn))
writer.add_tensor("output_norm.weight", norm(dim))
writer.add_tensor("output.weight", random(n_vocab, dim))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
print("wrote", out)
