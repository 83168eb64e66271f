#!/usr/bin/env python3
"""Runs a GdsLLM model with transformers' LlamaForCausalLM, one layer resident at a time, every
weight read from NVMe into GPU memory by gdsllm (no torch.load, no safetensors, no copy through
pageable RAM).

The model is a transformers skeleton built from the model's config on the `meta` device: it
holds no weights. Each step of generation walks the layers in order; layer i's weights come
from `gdsllm.open_model(dir).layer(i)` (one read of `layer_NNN.bin` into one GPU buffer, each
tensor a view into it), are used through `torch.func.functional_call`, and are dropped before
the next layer runs, which frees the buffer; meanwhile a thread has already read layer i+1.
Greedy decoding, so the tokens can be compared with `gdsllm run --temp 0` on the same model
(`--compare run.json` does it).

Tensor names: GdsLLM stores HF's tensors under its own names (attn_q = self_attn.q_proj.weight,
... see LAYER_NAMES) and in Hugging Face row order: Q and K rows are NOT permuted for
llama.cpp's interleaved RoPE (the GGUF converter undoes that permutation, FORMAT.md "RoPE and
the Q/K row order"), so the skeleton's rotate-half RoPE takes them as they are.

Numerics: by default weights are upcast to float32 and the skeleton computes in float32 without
TF32, as GdsLLM's CUDA backend keeps float32 activations; `--compute-dtype native` computes in
the stored float16/bfloat16 instead. Quantized models (q8_0, q4_0, q4_1) are refused: this demo
does not dequantize.

Usage:
  inference_demo.py MODEL_DIR --prompt "w17 w3 w301" -n 32 [--device cuda:0] [--io auto]
      [--compare RUN_JSON] [--json]
"""

import argparse
import inspect
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.func import functional_call

import gdsllm

# GdsLLM name -> name inside transformers' LlamaDecoderLayer.
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}


def llama_config(c):
    """transformers' LlamaConfig from metadata.json's config."""
    from transformers import LlamaConfig

    eos = c["eos_token_ids"]
    extra = {}
    if c.get("rope_scaling"):
        extra["rope_scaling"] = {k: v for k, v in c["rope_scaling"].items() if v is not None}
    config = LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["ffn_dim"],
        num_hidden_layers=c["n_layers"],
        num_attention_heads=c["n_heads"],
        num_key_value_heads=c["n_kv_heads"],
        head_dim=c["head_dim"],
        max_position_embeddings=c["context_length"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"],
        tie_word_embeddings=c["tie_word_embeddings"],
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        **extra,
    )
    config._attn_implementation = "sdpa"
    return config


class KVCache:
    """The keys and values of every layer so far: what a transformers Cache's `update` does for
    a single sequence, without depending on the Cache classes of one transformers version."""

    def __init__(self):
        self.keys, self.values = {}, {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx in self.keys:
            key_states = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            value_states = torch.cat([self.values[layer_idx], value_states], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx=0):
        return 0 if layer_idx not in self.keys else self.keys[layer_idx].shape[-2]


class LayerByLayer:
    """A meta-device LlamaForCausalLM fed one layer's weights at a time from gdsllm."""

    def __init__(self, model_dir, device, io, compute_dtype):
        from transformers import LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.gds = gdsllm.open_model(model_dir, device=device, io=io)
        self.device = torch.device(device)
        for blob in self.gds.blobs:
            for tensor in blob["tensors"]:
                if tensor["dtype"] not in ("f32", "f16", "bf16"):
                    raise SystemExit(f"{blob['file']}: {tensor['name']} is {tensor['dtype']}; this demo runs "
                                     "float models (convert with --dtype f16 or bf16)")
        self.meta = self.gds.config
        self.config = llama_config(self.meta)
        with torch.device("meta"):
            self.skeleton = LlamaForCausalLM(self.config)
        # RoPE frequencies are a buffer computed at construction: on `meta` they are empty, so
        # the rotary module is built again on the GPU, in float32 (as the reference keeps them).
        self.rotary = LlamaRotaryEmbedding(config=self.config, device=self.device)
        layer0 = self.skeleton.model.layers[0]
        params = inspect.signature(layer0.forward).parameters
        # transformers 4.x named it past_key_value, 5.x past_key_values.
        self.cache_arg = "past_key_values" if "past_key_values" in params else "past_key_value"
        self.compute_dtype = compute_dtype
        # Embedding and head stay resident (they are read once, like gdsllm's resident set).
        embed = self.gds.embed()["token_embd"]
        output = self.gds.output()
        self.embed = self.cast(embed)
        self.norm = self.cast(output["output_norm"])
        self.head = self.cast(output["output"]) if "output" in output else self.embed
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.stats = {"layer_reads": 0, "bytes_read": 0, "read_seconds_waited": 0.0}

    def cast(self, tensor):
        return tensor if self.compute_dtype is None else tensor.to(self.compute_dtype)

    def load_layer(self, i):
        weights = self.gds.layer(i)
        return {LAYER_NAMES[name]: self.cast(t) for name, t in weights.items()}, \
            sum(t.numel() * t.element_size() for t in weights.values())

    def forward(self, input_ids, cache):
        """Logits of the last position for `input_ids` appended to what `cache` holds."""
        past = cache.get_seq_length()
        n = input_ids.shape[1]
        positions = torch.arange(past, past + n, device=self.device).unsqueeze(0)
        hidden = torch.nn.functional.embedding(input_ids, self.embed)
        position_embeddings = self.rotary(hidden, positions)
        mask = None
        if n > 1:  # causal mask for a prompt; one new token attends to everything cached
            mask = torch.full((n, past + n), torch.finfo(hidden.dtype).min, device=self.device, dtype=hidden.dtype)
            mask = torch.triu(mask, diagonal=past + 1)[None, None]
        pending = self.pool.submit(self.load_layer, 0)
        for i, layer in enumerate(self.skeleton.model.layers):
            waited = time.perf_counter()
            weights, nbytes = pending.result()
            self.stats["read_seconds_waited"] += time.perf_counter() - waited
            self.stats["layer_reads"] += 1
            self.stats["bytes_read"] += nbytes
            if i + 1 < len(self.skeleton.model.layers):
                pending = self.pool.submit(self.load_layer, i + 1)  # prefetch while layer i runs
            kwargs = {"attention_mask": mask, "position_ids": positions, "use_cache": True,
                      "cache_position": positions[0], "position_embeddings": position_embeddings,
                      self.cache_arg: cache}
            out = functional_call(layer, weights, (hidden,), kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            del weights, out  # layer i's buffer is freed once its tensors are gone
        hidden = functional_call(self.skeleton.model.norm, {"weight": self.norm}, (hidden[:, -1:],))
        return torch.nn.functional.linear(hidden, self.head)[0, -1].float()


def greedy(runner, prompt_ids, max_tokens, eos_ids):
    """Greedy tokens (EOS included when it comes, as `gdsllm run` reports them) and the top-2
    logit margin of each step."""
    cache = KVCache()
    tokens, margins = [], []
    ids = torch.tensor([prompt_ids], device=runner.device)
    with torch.no_grad():
        logits = runner.forward(ids, cache)
        while len(tokens) < max_tokens:
            top = torch.topk(logits, 2)
            token = int(top.indices[0])
            tokens.append(token)
            margins.append(float(top.values[0] - top.values[1]))
            if token in eos_ids or len(tokens) >= max_tokens:
                break
            logits = runner.forward(torch.tensor([[token]], device=runner.device), cache)
    return tokens, margins


# Below this top-2 margin (in logits) two implementations may pick different tokens honestly.
NEAR_TIE = 0.05


def compare(ours, margins, reference):
    """Compares with `gdsllm run --json`'s tokens: identical, or parting only at a near tie."""
    for step, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            if margins[step] < NEAR_TIE:
                return True, (f"tokens identical for {step} steps, then part ({a} vs {b}) where the "
                              f"top-2 margin is {margins[step]:.3e} < {NEAR_TIE}: a near tie")
            return False, f"tokens differ at step {step}: {a} vs {b} (margin {margins[step]:.3e})"
    if len(ours) != len(reference):
        return False, f"lengths differ: {len(ours)} vs {len(reference)} tokens"
    return True, f"all {len(ours)} tokens identical (min top-2 margin {min(margins):.3e})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GdsLLM model directory (f16, bf16 or f32)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--io", default="auto", help="auto, cufile, bounce or host")
    ap.add_argument("--compute-dtype", choices=["float32", "native"], default="float32")
    ap.add_argument("--compare", help="`gdsllm run --temp 0 --json` output on the same model and prompt")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from tokenizers import Tokenizer

    compute = torch.float32 if a.compute_dtype == "float32" else None
    started = time.perf_counter()
    runner = LayerByLayer(a.model, a.device, a.io, compute)
    tokenizer = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    prompt_ids = tokenizer.encode(a.prompt, add_special_tokens=False).ids
    if runner.meta.get("add_bos_token") and runner.meta.get("bos_token_id") is not None:
        prompt_ids = [runner.meta["bos_token_id"]] + prompt_ids
    tokens, margins = greedy(runner, prompt_ids, a.n_predict, set(runner.meta["eos_token_ids"]))
    seconds = time.perf_counter() - started
    result = {
        "prompt_tokens": prompt_ids,
        "tokens": tokens,
        "text": tokenizer.decode(tokens, skip_special_tokens=False),
        "margins": margins,
        "seconds": seconds,
        "layer_reads": runner.stats["layer_reads"],
        "gb_read": runner.stats["bytes_read"] / 1e9,
        "seconds_waiting_for_reads": runner.stats["read_seconds_waited"],
        "memory_after": gdsllm.memory_stats(),
    }
    ok = True
    if a.compare:
        with open(a.compare) as f:
            reference = json.load(f)
        if reference["prompt_tokens"] != prompt_ids:
            ok, verdict = False, f"prompt tokens differ: {prompt_ids} vs gdsllm's {reference['prompt_tokens']}"
        else:
            ok, verdict = compare(tokens, margins, reference["tokens"])
        result["compare"] = {"ok": ok, "verdict": verdict, "gdsllm_tokens": reference["tokens"]}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"prompt {prompt_ids}\ntokens {tokens}\ntext   {result['text']!r}")
        print(f"{len(tokens)} tokens in {seconds:.2f} s; {result['layer_reads']} layer reads "
              f"({result['gb_read']:.3f} GB), {result['seconds_waiting_for_reads']:.2f} s waiting for reads")
        if a.compare:
            print(f"vs gdsllm run: {'OK' if ok else 'MISMATCH'}: {result['compare']['verdict']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
