#!/usr/bin/env python3
"""Builds a LlamaForCausalLM with random weights from a config, saves it with save_pretrained
(safetensors) plus a word-level tokenizer.json, and writes the float32 reference our CUDA backend
is compared with (llama/tests/cuda_hf.rs): the last-position logits of a random prompt and 32
greedy steps with their top-2 margins.

The model is built on the GPU in the requested dtype (f16/bf16: what gets saved and converted);
the reference runs the SAME rounded weights in float32 without TF32, so it is the exact math of
the weights we load.

Usage: hf_reference.py OUT_DIR --shape small|llama-7b --dtype float16|bfloat16 [--steps 32]
Writes OUT_DIR/hf/ (the Hugging Face directory) and OUT_DIR/reference.json.
"""
import argparse
import json
import os
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    # GQA (4 query heads per KV head), untied head: the paths a 7B Llama does not exercise.
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=2048,
                  max_position_embeddings=512, tie_word_embeddings=False),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                     max_position_embeddings=4096, tie_word_embeddings=False),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, a.dtype)
    shape = SHAPES[a.shape]
    cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
                      eos_token_id=2, hidden_act="silu")
    torch.manual_seed(a.seed)
    t = time.time()
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    # `.to(dtype)` casts every floating buffer, the RoPE frequencies (`inv_freq`, or cos/sin
    # caches in older transformers) included: they are not weights and are not saved, but
    # rounded to bfloat16's 8-bit mantissa they turn the rotation angles by up to 2^-9 relative,
    # which alone moved the 7B-shaped model's last logits by 1.29e-2 (L2 relative; 2.25e-3 in
    # float16) on the H200. The reference keeps the float32 values that the config defines.
    # (A Llama has no other buffers.)
    rope_f32 = {n: b.detach().clone() for n, b in model.named_buffers() if b.is_floating_point()}
    model = model.to(dtype).eval()
    hf = os.path.join(a.out, "hf")
    os.makedirs(hf, exist_ok=True)
    model.save_pretrained(hf, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(hf, "tokenizer.json"))
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False}, f)
    saved_s = time.time() - t

    ref = model.float()
    gen = torch.Generator().manual_seed(a.seed + 1)
    prompt = torch.randint(3, shape["vocab_size"], (1, a.prompt_len), generator=gen).cuda()
    with torch.no_grad():
        # What the rounded frequencies would have done to the reference, for the record.
        rounded = ref(input_ids=prompt).logits[0, -1].float()
        buffers = dict(ref.named_buffers())
        for n, b in rope_f32.items():
            buffers[n].copy_(b)
        out = ref(input_ids=prompt, use_cache=True)
        last = out.logits[0, -1].float()
        past, logits = out.past_key_values, last
        tokens, margins = [], []
        for _ in range(a.steps):
            top = torch.topk(logits, 2)
            nxt = top.indices[0]
            tokens.append(int(nxt))
            margins.append(float(top.values[0] - top.values[1]))
            out = ref(input_ids=nxt.view(1, 1), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
        rope_rounding = float((rounded - last).norm() / last.norm())
    result = {
        "shape": a.shape,
        "dtype": a.dtype,
        "prompt": prompt[0].tolist(),
        "last_logits": last.cpu().tolist(),
        "greedy_tokens": tokens,
        "greedy_margins": margins,
        "transformers_dtype_saved": a.dtype,
        "rope_rounding_rel_l2": rope_rounding,
        "torch": torch.__version__,
        "save_seconds": saved_s,
    }
    with open(os.path.join(a.out, "reference.json"), "w") as f:
        json.dump(result, f)
    print(f"{a.shape} {a.dtype}: saved in {saved_s:.1f} s; greedy {tokens[:8]}...; "
          f"min margin {min(margins):.3e}; inv_freq rounded to {a.dtype} would move the last "
          f"logits by {rope_rounding:.2e} (L2 relative)")


if __name__ == "__main__":
    main()
