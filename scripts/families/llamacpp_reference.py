"""llama.cpp's own results on the family GGUFs that make_family_gguf.py writes, and its token
ids for a fixed multilingual text set on each family's vocabulary, as JSON.

Run here (not in CI): it needs llama-cpp-python (0.3.36, CPU build), which CI does not build
(about 10 minutes of its 45-minute budget). CI regenerates the GGUFs with make_family_gguf.py
and checks their SHA-256 against the ones recorded here, so these references apply to the very
bytes CI converts.

usage: python3 llamacpp_reference.py INPUTS_DIR MODELS_DIR OUT.json
       python3 llamacpp_reference.py --real-only INPUTS_DIR OUT.json
The second form recomputes only the real models' entry (`real_models`: the Gemma 3 270M
Q4_K_M file of fetch_inputs.py) of an existing OUT.json; gemma3_exact_reference.py then adds
the exact logits of its steps again.
"""
import json
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

sys.path.insert(0, str(Path(__file__).parent))
from fetch_inputs import GEMMA_FILE, sha256  # noqa: E402

GGML_TYPE_F32 = 0
N_CTX = 128
STEPS = 24
TOP = 8
# Greedy prompts: plain text and digits, so every vocabulary tokenizes them.
PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]

# The text set for tokenizer ids: llama.cpp's own tokenizer tests' inputs (English, Cyrillic,
# Khmer, emoji, digits, whitespace runs) plus Chinese, Japanese and code.
TEXTS = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "\t\n",
    "Hello world",
    " Hello world",
    "Hello World",
    " Hello World!",
    "Hello, world!",
    " this is 🦙.cpp",
    "w048 7tuijk dsdfhu",
    "нещо на Български",
    "កាន់តែពិសេសអាចខលចេញ",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)",
    "    Hello\n    Hello",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
    "3",
    "33",
    "333",
    "3333",
    "33333",
    "333333333",
    "Cửa Việt",
    "今日は良い天気ですね。東京タワーに行きましょう！",
    "人工智能正在改变世界，大型语言模型可以理解和生成文本。",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tprintln!(\"{}\", 1_000_000u64 >> 3);\n}",
    "a  b   c    d\t\te\n\n\nf",
    "1234567890 3.14159 -42 1e-5 0x1F",
    "I'm sure you'll see it's what they've done",
]
# vocabulary file -> GGUF pre-tokenizer names it stands for
VOCABS = {
    "ggml-vocab-llama-spm.gguf": "llama (SentencePiece)",
    "ggml-vocab-llama-bpe.gguf": "llama-bpe",
    "ggml-vocab-qwen2.gguf": "qwen2",
    "ggml-vocab-deepseek-r1-qwen.gguf": "deepseek-r1-qwen",
    "ggml-vocab-phi-3.gguf": "phi3 (SentencePiece)",
    "ggml-vocab-gemma-3.gguf": "gemma3 (SentencePiece)",
}


def tokenizer_ids(path: Path) -> list:
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    return [llm.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS]


def greedy(path: Path, n_batch: int = N_CTX) -> dict:
    llm = Llama(
        model_path=str(path),
        n_ctx=N_CTX,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=2,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        # llama-cpp-python keeps logits (in `scores`) only with logits_all.
        logits_all=True,
        verbose=False,
    )
    runs = []
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        steps = []
        for _ in range(STEPS):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            order = np.argsort(-logits, kind="stable")[:TOP]
            steps.append(
                {
                    "token": int(order[0]),
                    "margin": float(logits[order[0]] - logits[order[1]]),
                    "top": [[int(i), float(logits[i])] for i in order],
                }
            )
            llm.eval([int(order[0])])
        runs.append({"prompt": prompt, "prompt_ids": ids, "steps": steps})
    return {"sha256": sha256(path), "runs": runs}


def real_models(inputs: Path) -> dict:
    """The real files of fetch_inputs.py, by name without `.gguf`. Prompts go in one token per
    batch: this llama-cpp-python build crashes on the Gemma 3 270M's k-quant matmuls of
    several rows (a segmentation fault in decode), not on one-row ones."""
    return {Path(GEMMA_FILE).stem: greedy(inputs / GEMMA_FILE, n_batch=1)}


def main() -> None:
    if sys.argv[1] == "--real-only":
        inputs, out = Path(sys.argv[2]), Path(sys.argv[3])
        result = json.loads(out.read_text())
        result["real_models"] = real_models(inputs)
        out.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n")
        return
    inputs, models, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    import llama_cpp

    result = {
        "generator": "scripts/families/llamacpp_reference.py",
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {
            "n_ctx": N_CTX,
            "kv_cache": "f32",
            "flash_attn": False,
            "threads": 2,
            "steps": STEPS,
        },
        "texts": TEXTS,
        "tokenizers": {},
        "models": {},
    }
    for vocab, what in VOCABS.items():
        result["tokenizers"][vocab] = {
            "pre_tokenizer": what,
            "sha256": sha256(inputs / vocab),
            "ids": tokenizer_ids(inputs / vocab),
        }
    for gguf_path in sorted(models.glob("*.gguf")):
        result["models"][gguf_path.stem] = greedy(gguf_path)
        print(gguf_path.stem, [s["token"] for s in result["models"][gguf_path.stem]["runs"][0]["steps"]][:8])
    result["real_models"] = real_models(inputs)
    out.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
