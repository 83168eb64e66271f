#!/usr/bin/env python3
"""Checks that the official `openai` Python package talks to `gdsllm serve` unchanged.

Starts `gdsllm serve --port 0` on a model, then through `openai.OpenAI(base_url=...)`:
models.list, chat.completions.create with and without stream (and stream usage),
completions.create, embeddings.create (the SDK's default base64 and float), and the SDK's
error classes for a bad key, an unknown model and n > 1; `logit_bias` (-100 bans the greedy
token, +100 forces one); structured output: 100 requests with random JSON schemas from a
fixed-seed generator, every output validated with the `jsonschema` package, and the decode
speed with and without a schema printed. Stops the server with SIGTERM and expects a clean
exit. Exits non-zero on the first failure.

If `openai` or `jsonschema` is not importable, the script creates a virtual environment
(--venv, default a temporary directory), pip-installs them into it and re-runs itself there.

Usage: scripts/openai_client_check.py --gdsllm target/release/gdsllm --model DIR
       (DIR defaults to $GDSLLM_TEST_MODEL)
"""

import argparse
import json
import math
import os
import random
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


def run_checks(base, model_dir):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)

    models = client.models.list()
    ids = [m.id for m in models.data]
    # The model's id, its alias, then any other model of the store.
    check(ids[1:2] == ["gpt-4o-mini"], f"models.list -> {ids}")

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
    check_logit_bias(client, model_dir)
    check_structured_output(client)
    report_speed(client)

    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        check(False, "a wrong key raises")
    except openai.AuthenticationError:
        check(True, "wrong key -> openai.AuthenticationError")


def vocab_id(model_dir, text):
    """The id of the single token spelling `text` (ASCII; GPT-2 byte-level vocabularies write a
    space as 'Ġ'), from the model's tokenizer.json."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        vocab = json.load(f)["model"]["vocab"]
    return vocab[text.replace(" ", "\u0120")]


def check_logit_bias(client, model_dir):
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    def first_token(**extra):
        r = client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, temperature=0, max_tokens=3, logprobs=True,
            **extra)
        return r.choices[0].logprobs.content[0].token, r.choices[0].message.content

    greedy, text = first_token()
    banned = vocab_id(model_dir, greedy)
    other, other_text = first_token(logit_bias={str(banned): -100})
    check(other != greedy,
          f"logit_bias -100 on the greedy token {greedy!r} (id {banned}) -> {other_text!r}")
    forced = vocab_id(model_dir, " banana")
    got, got_text = first_token(logit_bias={str(forced): 100})
    check(got == " banana", f"logit_bias +100 on ' banana' (id {forced}) -> {got_text!r}")
    try:
        client.chat.completions.create(model="gpt-4o-mini", messages=messages,
                                       logit_bias={"99999999": 5})
        check(False, "an unknown token id in logit_bias raises")
    except openai_module().BadRequestError as e:
        check("logit_bias" in str(e), "unknown logit_bias id -> openai.BadRequestError")


def openai_module():
    import openai
    return openai


def random_schema(rng, depth=0):
    """An object schema with string/integer/boolean/enum/array (and, at the top, nested
    object) properties, some required. Every value is bounded (maxLength, integer ranges,
    maxItems) so that a complete answer fits the token budget."""
    words = ["name", "city", "age", "count", "color", "tags", "valid", "score", "title",
             "owner", "items", "level", "kind", "code", "note", "active"]
    props = {}
    for key in rng.sample(words, rng.randint(1, 4)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array"]
                          + (["object"] if depth == 0 else []))
        if kind == "string":
            props[key] = {"type": "string", "maxLength": rng.randint(1, 12)}
            if rng.random() < 0.3:
                props[key]["minLength"] = 1
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            props[key] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
        elif kind == "boolean":
            props[key] = {"type": "boolean"}
        elif kind == "enum":
            props[key] = {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes",
                                              "no", "north", "south"], rng.randint(1, 4))}
        elif kind == "array":
            item = rng.choice([{"type": "string", "maxLength": 8}, {"type": "boolean"},
                               {"type": "integer", "minimum": 0, "maximum": 99}])
            props[key] = {"type": "array", "items": item, "maxItems": rng.randint(1, 3)}
            if rng.random() < 0.5:
                props[key]["minItems"] = 1
        else:
            props[key] = random_schema(rng, depth + 1)
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def check_structured_output(client, count=100, seed=19):
    import concurrent.futures

    import jsonschema

    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(count)]

    def ask(i):
        schema = schemas[i]
        r = client.chat.completions.create(
            model="gpt-4o-mini", temperature=0, max_tokens=200,
            messages=[{"role": "user",
                       "content": f"Reply with a JSON object with the fields {', '.join(schema['properties'])}."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return r.choices[0].message.content, r.choices[0].finish_reason

    valid = 0
    failures = []
    # Four at a time: the server batches them.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i, (text, finish) in enumerate(pool.map(ask, range(count))):
            try:
                jsonschema.validate(json.loads(text), schemas[i])
                if finish != "stop":
                    raise ValueError(f"finish_reason {finish}")
                valid += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                failures.append(f"schema {i} {json.dumps(schemas[i])}: {text!r}: {e}")
    for f in failures[:5]:
        print(f"invalid: {f}")
    check(valid == count, f"json_schema: {valid} of {count} outputs valid (jsonschema)")

    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    try:
        client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
        check(False, "an invalid schema raises")
    except openai_module().BadRequestError as e:
        check("response_format" in str(e), f"invalid schema -> openai.BadRequestError ({e})")
    r = client.chat.completions.create(
        model="gpt-4o-mini", temperature=0, max_tokens=100,
        messages=[{"role": "user", "content":
                   "What is the capital of France? Answer as a JSON object with the key capital."}],
        response_format={"type": "json_object"})
    text = r.choices[0].message.content
    check(r.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict),
          f"json_object -> {text!r}")


def decode_speed(client, schema=None, tokens=48, runs=3):
    """Decode tokens/s of one streamed request (first token to last, so the prompt is not
    counted), best of `runs`."""
    best = 0.0
    extra = {}
    if schema is not None:
        extra["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "speed", "schema": schema}}
    for _ in range(runs):
        stamps = []
        stream = client.chat.completions.create(
            model="gpt-4o-mini", temperature=0, max_tokens=tokens, stream=True,
            messages=[{"role": "user", "content": "Write a list of twenty city names."}],
            **extra)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
        if len(stamps) > 2:
            best = max(best, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return best


def report_speed(client):
    # A schema whose answer is long: a list of strings.
    schema = {"type": "object", "properties": {"cities": {
        "type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 40}},
        "required": ["cities"], "additionalProperties": False}
    free = decode_speed(client)
    constrained = decode_speed(client, schema)
    print(f"speed: decode {free:.1f} chunks/s unconstrained, {constrained:.1f} chunks/s with a "
          f"JSON schema ({100 * (1 - constrained / free):+.1f}% cost)")


def check_args():
    """The command line every check script takes: --gdsllm, --model, --venv."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.splitlines()[0])
    parser.add_argument("--gdsllm", default="target/release/gdsllm", help="the gdsllm binary")
    parser.add_argument("--model", default=os.environ.get("GDSLLM_TEST_MODEL"),
                        help="model directory (default: $GDSLLM_TEST_MODEL)")
    parser.add_argument("--venv", help="virtual environment to create/use when openai is missing")
    args = parser.parse_args()
    if not args.model:
        sys.exit("no model: pass --model DIR or set GDSLLM_TEST_MODEL (see `gdsllm pull smollm2`)")
    ensure_importable(["openai", "jsonschema"], ["openai", "jsonschema"], args.venv)
    return args


def serve_and_check(gdsllm, model, run):
    """Serves `model`, calls `run(base_url)`, then stops the server with SIGTERM and expects a
    clean exit; the server's log is printed when `run` fails."""
    proc, base = start_server(argparse.Namespace(gdsllm=gdsllm, model=model))
    try:
        run(base)
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


def main():
    args = check_args()
    import openai
    print(f"openai {openai.__version__}", file=sys.stderr)
    serve_and_check(args.gdsllm, args.model, lambda base: run_checks(base, args.model))
    print("all openai client checks passed")


if __name__ == "__main__":
    main()
