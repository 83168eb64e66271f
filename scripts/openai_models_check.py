#!/usr/bin/env python3
"""Checks the official `openai` Python package against `gdsllm serve` serving two models.

Makes a model store (a temporary $GDSLLM_HOME) holding the model given (as `smollm2`, a link)
and a tiny random model (`gdsllm synth`, as `tiny`), serves the first, then through
`openai.OpenAI(base_url=...)`: models.list names both, and one chat request to each model
answers (the second model loaded on demand), with different text. Stops the server with
SIGTERM and expects a clean exit. Exits non-zero on the first failure.

If `openai` is not importable, the script creates a virtual environment (--venv, default a
temporary directory), pip-installs it into it and re-runs itself there.

Usage: scripts/openai_models_check.py --gdsllm target/release/gdsllm --model DIR
       (DIR defaults to $GDSLLM_TEST_MODEL)
"""

import os
import subprocess
import sys
import tempfile

from openai_client_check import KEY, check, check_args, serve_and_check


def make_store(gdsllm, model, home):
    """`home`/models holding `smollm2` (a link to `model`) and `tiny` (random weights)."""
    models = os.path.join(home, "models")
    os.makedirs(models)
    os.symlink(os.path.realpath(model), os.path.join(models, "smollm2"))
    subprocess.run([gdsllm, "synth", "--shape", "custom", "--layers", "2", "--dim", "64",
                    "--ffn", "128", "--heads", "2", "--kv-heads", "1", "--vocab", "300",
                    "--context", "256", "--dtype", "f32", "--seed", "7",
                    os.path.join(models, "tiny")],
                   check=True, stdout=subprocess.DEVNULL)
    return os.path.join(models, "smollm2")


def run_checks(base):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    ids = [m.id for m in client.models.list().data]
    check("smollm2" in ids and "tiny" in ids, f"models.list -> {ids}")
    replies = {}
    for model in ("smollm2", "tiny"):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=12)
        replies[model] = r.choices[0].message.content
        check(r.model == model and r.usage.completion_tokens > 0,
              f"chat.completions.create(model={model!r}) -> {replies[model]!r}")
    check(replies["smollm2"] != replies["tiny"], "the two models answer differently")


def main():
    args = check_args()
    with tempfile.TemporaryDirectory() as home:
        model = make_store(args.gdsllm, args.model, home)
        # start_server keeps GDSLLM_HOME: the server's store is this one.
        os.environ["GDSLLM_HOME"] = home
        serve_and_check(args.gdsllm, model, run_checks)
    print("all openai two-model checks passed")


if __name__ == "__main__":
    sys.exit(main())
