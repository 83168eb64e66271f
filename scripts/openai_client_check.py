#!/usr/bin/env python3
"""Checks that the official `openai` Python package talks to `gdsllm serve` unchanged.

Starts `gdsllm serve --port 0` on a model, then through `openai.OpenAI(base_url=...)`:
models.list, chat.completions.create with and without stream (and stream usage),
completions.create, embeddings.create (the SDK's default base64 and float), and the SDK's
error classes for a bad key, an unknown model and n > 1. Stops the server with SIGTERM and
expects a clean exit. Exits non-zero on the first failure.

If `openai` is not importable, the script creates a virtual environment (--venv, default a
temporary directory), pip-installs `openai` into it and re-runs itself there.

Usage: scripts/openai_client_check.py --gdsllm target/release/gdsllm --model DIR
       (DIR defaults to $GDSLLM_TEST_MODEL)
"""

import argparse
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

from venv_rerun import ensure_importable

KEY = "openai-check-key"


def start_server(args):
    cmd = [args.gdsllm, "serve", "-m", args.model, "--port", "0", "-c", "512",
           "--api-key", KEY, "--alias", "gpt-4o-mini"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSLLM_") or k == "GDSLLM_HOME"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    base = proc.stdout.readline().strip()
    if not base.startswith("http://"):
        proc.kill()
        sys.exit(f"gdsllm serve did not print its address: {base!r}\n{proc.stderr.read()}")
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health") as r:
                if r.status == 200:
                    return proc, base
        except Exception:
            pass
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            sys.exit(f"server not ready\n{proc.stderr.read()}")
        time.sleep(0.1)


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}")


def run_checks(base):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)

    models = client.models.list()
    ids = [m.id for m in models.data]
    check("gpt-4o-mini" in ids and len(ids) == 2, f"models.list -> {ids}")

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model="gpt-4o-mini", messages=messages, temperature=0, max_tokens=16)
    text = whole.choices[0].message.content
    check(isinstance(text, str) and len(text) > 0 and whole.usage.completion_tokens > 0,
          f"chat.completions.create -> {text!r}, usage {whole.usage}")
    check(whole.choices[0].finish_reason in ("stop", "length"), "finish_reason")

    stream = client.chat.completions.create(
        model="gpt-4o-mini", messages=messages, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    check("".join(parts) == text, f"streamed chat equals the whole reply ({''.join(parts)!r})")
    check(finish == whole.choices[0].finish_reason, f"streamed finish_reason {finish}")
    check(usage is not None and usage.completion_tokens == whole.usage.completion_tokens,
          f"stream usage {usage}")

    lp = client.chat.completions.create(
        model="gpt-4o-mini", messages=messages, temperature=0, max_tokens=3, logprobs=True,
        top_logprobs=2)
    content = lp.choices[0].logprobs.content
    check(len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content),
          "chat logprobs parse")

    comp = client.completions.create(
        model="gpt-4o-mini", prompt="The capital of France is", temperature=0, max_tokens=8)
    check(len(comp.choices[0].text) > 0, f"completions.create -> {comp.choices[0].text!r}")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="gpt-4o-mini", prompt="The capital of France is", temperature=0, max_tokens=8,
        stream=True) if c.choices)
    check(streamed == comp.choices[0].text, "streamed completion equals the whole one")

    # The SDK asks for base64 by default and decodes it itself.
    emb = client.embeddings.create(model="gpt-4o-mini", input=["hello world", "bonjour"])
    vec = emb.data[0].embedding
    norm = math.sqrt(sum(x * x for x in vec))
    check(len(emb.data) == 2 and len(vec) > 0 and abs(norm - 1) < 1e-3,
          f"embeddings.create: {len(emb.data)} x {len(vec)}, norm {norm:.6f}")
    flt = client.embeddings.create(model="gpt-4o-mini", input="hello world",
                                   encoding_format="float")
    diff = max(abs(a - b) for a, b in zip(flt.data[0].embedding, vec))
    check(diff == 0.0, f"float and base64 embeddings agree (max diff {diff})")

    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        check(False, "unknown model raises")
    except openai.NotFoundError as e:
        check(e.status_code == 404, "unknown model -> openai.NotFoundError")
    try:
        client.chat.completions.create(model="gpt-4o-mini", messages=messages, n=2)
        check(False, "n=2 raises")
    except openai.BadRequestError as e:
        check("n" in str(e), "n=2 -> openai.BadRequestError")
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        check(False, "a wrong key raises")
    except openai.AuthenticationError:
        check(True, "wrong key -> openai.AuthenticationError")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gdsllm", default="target/release/gdsllm", help="the gdsllm binary")
    parser.add_argument("--model", default=os.environ.get("GDSLLM_TEST_MODEL"),
                        help="model directory (default: $GDSLLM_TEST_MODEL)")
    parser.add_argument("--venv", help="virtual environment to create/use when openai is missing")
    args = parser.parse_args()
    if not args.model:
        sys.exit("no model: pass --model DIR or set GDSLLM_TEST_MODEL (see `gdsllm pull smollm2`)")
    ensure_importable("openai", "openai", args.venv)
    import openai
    print(f"openai {openai.__version__}", file=sys.stderr)
    proc, base = start_server(args)
    try:
        run_checks(base)
    except Exception:
        proc.kill()
        print(proc.stderr.read(), file=sys.stderr)
        raise
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        sys.exit("the server did not exit within 60 s of SIGTERM")
    if code != 0:
        sys.exit(f"the server exited with {code} after SIGTERM\n{proc.stderr.read()}")
    print("ok: SIGTERM -> clean exit")
    print("all openai client checks passed")


if __name__ == "__main__":
    main()
