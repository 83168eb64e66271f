#!/usr/bin/env python3
"""Builds a model with random weights from a config with transformers' own class, saves it with
save_pretrained (safetensors) plus a word-level tokenizer.json, and writes the float32 reference
our CUDA backend is compared with (llama/tests/cuda_hf.rs): the last-position logits of a random
prompt and 32 greedy steps with their top-2 margins.

Shapes: `small` and `llama-7b` (LlamaForCausalLM), and one small model per family (FAMILIES:
Qwen2ForCausalLM with its Q/K/V biases, Qwen3ForCausalLM with its Q/K head norms,
Gemma3ForCausalLM with sliding-window layers of their own RoPE base, post-norms, the GeLU gate,
a query_pre_attn_scalar other than head_dim and a final soft-cap, Phi3ForCausalLM with longrope
and its fused projections, LlamaForCausalLM with Llama 3.1's rope). In the family models every
1-d parameter (norm weights, biases) gets noise added after the initialisation, which leaves
biases at 0 and norms at their neutral value: every step of the family then changes the logits.
The prompt and the greedy steps (48 positions) run past Gemma's window of 8; Phi-3's context
stays below original_max_position_embeddings, where transformers and we both use short_factor
(transformers switches per forward pass, we per opened context, as llama.cpp does).

The model is built on the GPU in the requested dtype (f16/bf16: what gets saved and converted);
the reference runs the SAME rounded weights in float32 without TF32, so it is the exact math of
the weights we load.

Usage: hf_reference.py OUT_DIR --shape SHAPE --dtype float16|bfloat16 [--steps 32] [--device cpu]
(SHAPE: small, llama-7b, or a family of FAMILIES; --device cpu checks the script, or our CPU
backend, on a machine without a GPU.)
Writes OUT_DIR/hf/ (the Hugging Face directory) and OUT_DIR/reference.json.
"""
import argparse
import json
import os
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
import transformers
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

# Common to the family models: GQA, a 2048-word vocabulary, 512 positions.
FAMILY_BASE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, vocab_size=2048,
                   max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# name: (config class, model class, config arguments over FAMILY_BASE).
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # head_dim · heads (1024) != hidden_size, as in Qwen3.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=128, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
        query_pre_attn_scalar=96, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=30.0, attn_logit_softcapping=None, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        max_position_embeddings=8192, original_max_position_embeddings=4096,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0,
                         "attention_factor": 1.19,
                         "short_factor": [1.0 + 0.1 * i for i in range(16)],
                         "long_factor": [1.0 + 0.7 * i for i in range(16)]})),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
}


def build(shape):
    """(config, model class, vocabulary size, whether to perturb the 1-d parameters)."""
    if shape in SHAPES:
        cfg = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
                          eos_token_id=2, hidden_act="silu")
        return cfg, LlamaForCausalLM, SHAPES[shape]["vocab_size"], False
    config_class, model_class, extra = FAMILIES[shape]
    args = {**FAMILY_BASE, **extra}
    cfg = getattr(transformers, config_class)(**args)
    return cfg, getattr(transformers, model_class), args["vocab_size"], True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(FAMILIES), required=True)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda",
                    help="torch device the model is built and run on (cpu: a check without a GPU)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, a.dtype)
    cfg, model_class, vocab_size, perturb = build(a.shape)
    torch.manual_seed(a.seed)
    t = time.time()
    with torch.device(a.device):
        model = model_class(cfg)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.2 * torch.randn_like(p))
    # `.to(dtype)` casts every floating buffer, the RoPE frequencies (`inv_freq`, or cos/sin
    # caches in older transformers) included: they are not weights and are not saved, but
    # rounded to bfloat16's 8-bit mantissa they turn the rotation angles by up to 2^-9 relative,
    # which alone moved the 7B-shaped model's last logits by 1.29e-2 (L2 relative; 2.25e-3 in
    # float16) on the H200. The reference keeps the float32 values that the config defines,
    # for every floating buffer (Gemma's embedding scale, √hidden_size, is one too: we compute
    # it in f32, as llama.cpp does).
    # Every name, duplicates included: transformers 5.x (up to at least 5.17) re-registers a
    # longrope model's `inv_freq` as the very tensor `original_inv_freq` on each forward pass,
    # and `named_buffers()` lists a tensor held under two names only once, so the second name
    # disappeared after the first pass (the KeyError 'model.rotary_emb.original_inv_freq' of
    # Phi-3). Newer versions copy in place; older ones keep it a plain attribute.
    rope_f32 = {n: b.detach().clone()
                for n, b in model.named_buffers(remove_duplicate=False) if b.is_floating_point()}
    model = model.to(dtype).eval()
    hf = os.path.join(a.out, "hf")
    os.makedirs(hf, exist_ok=True)
    model.save_pretrained(hf, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(hf, "tokenizer.json"))
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False}, f)
    saved_s = time.time() - t

    ref = model.float()
    gen = torch.Generator().manual_seed(a.seed + 1)
    prompt = torch.randint(3, vocab_size, (1, a.prompt_len), generator=gen).to(a.device)
    with torch.no_grad():
        # What the rounded frequencies would have done to the reference, for the record.
        rounded = ref(input_ids=prompt).logits[0, -1].float()
        buffers = dict(ref.named_buffers(remove_duplicate=False))
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
