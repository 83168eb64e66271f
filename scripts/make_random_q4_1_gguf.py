# A LLaMA-shaped GGUF whose matrices are random Q4_1 blocks (the output matrix Q8_0), written
# directly (no 13 GB f16 file to quantize first), with the tokenizer of VOCAB.gguf: the
# 7B-shaped Q4_1 of issue 24's CPU comparisons with llama.cpp (needs the `gguf` and `numpy` packages).
# usage: make_random_q4_1_gguf.py VOCAB.gguf OUT.gguf [dim ffn layers heads] (default: a 7B)
import os, sys, numpy as np, gguf
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "families"))
from fetch_inputs import copy_tokenizer_kvs  # noqa: E402
vocab_path, out = sys.argv[1:3]
dim, ffn, layers, heads = (int(x) for x in (sys.argv[3:7] or (4096, 11008, 32, 32)))
rng = np.random.default_rng(0)
Q = gguf.GGMLQuantizationType
def q4_1(rows, cols):
    blocks = rows * cols // 32
    d = (rng.uniform(0.5, 1.5, blocks) * 0.02 / 8).astype(np.float16)
    m = (-8 * d.astype(np.float32)).astype(np.float16)
    qs = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    b = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2), qs], axis=1)
    return b.reshape(rows, cols // 32 * 20)
def q8_0(rows, cols):
    blocks = rows * cols // 32
    d = (rng.uniform(0.5, 1.5, blocks) * 0.02 / 127).astype(np.float16)
    qs = rng.integers(-127, 128, (blocks, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1).reshape(rows, cols // 32 * 34)
r = gguf.GGUFReader(vocab_path)
w = gguf.GGUFWriter(out, "llama")
n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
copy_tokenizer_kvs(r, w)
w.add_name("random-llama-q4_1"); w.add_context_length(4096); w.add_embedding_length(dim)
w.add_block_count(layers); w.add_feed_forward_length(ffn); w.add_head_count(heads); w.add_head_count_kv(heads)
w.add_rope_dimension_count(dim // heads); w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(n_vocab); w.add_file_type(3)  # MOSTLY_Q4_1
def add(name, rows, cols, f=q4_1, qt=Q.Q4_1):
    w.add_tensor(name, f(rows, cols), raw_dtype=qt)
add("token_embd.weight", n_vocab, dim)
for i in range(layers):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", (1 + rng.standard_normal(dim) * 0.1).astype(np.float32))
    for n in ("attn_q", "attn_k", "attn_v", "attn_output"): add(p + n + ".weight", dim, dim)
    w.add_tensor(p + "ffn_norm.weight", (1 + rng.standard_normal(dim) * 0.1).astype(np.float32))
    add(p + "ffn_gate.weight", ffn, dim); add(p + "ffn_up.weight", ffn, dim)
    add(p + "ffn_down.weight", dim, ffn)
w.add_tensor("output_norm.weight", (1 + rng.standard_normal(dim) * 0.1).astype(np.float32))
add("output.weight", n_vocab, dim, q8_0, Q.Q8_0)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print("wrote", out)
