"""What the scripts that measure a running `gdsllm serve` share (constrained_cost.py,
prefix_ttft.py, serve_bench.py): the flags of those that send token-id prompts (the server's
--url and --key, and --vocab) and the ids they draw, and one streamed request read event by
event. Standard library only; imported from the scripts' own directory.
"""

import argparse
import json
import time
import urllib.request


def token_prompt_parser(doc):
    """The argparse parser of a script that sends token-id prompts (so any model works,
    synthetic ones included), described by the first line of `doc`: the server's --url and
    --key, and --vocab, the bound of the ids (see `spread_ids`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL")
    ap.add_argument("--key", default=None, help="API key, sent as a bearer token")
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    return ap


def spread_ids(count, vocab, start=0, stride=7919):
    """`count` fixed token ids spread over 100 .. vocab-100, well inside a vocabulary of `vocab`
    ids; nothing special about them: id i is 100 + (start + i * stride) mod (vocab - 200)."""
    return [100 + (start + i * stride) % (vocab - 200) for i in range(count)]


def stream(url, path, body, key=None):
    """POSTs the JSON `body` (a streamed request) to `url + path` and yields
    `(time.perf_counter() at arrival, chunk)` for each `data: {...}` event, to the end of the
    stream (the server updates its counters before it ends one)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    if key:
        req.add_header("authorization", f"Bearer {key}")
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: {"):
                yield time.perf_counter(), json.loads(line[6:])
