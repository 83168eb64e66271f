"""What the scripts that measure a running `gdsllm serve` share (constrained_cost.py,
prefix_ttft.py, serve_bench.py): the server's --url and --key flags, and one streamed request
read event by event. Standard library only; imported from the scripts' own directory.
"""

import json
import time
import urllib.request


def add_server_args(ap):
    """--url and --key on the argparse parser `ap`."""
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL")
    ap.add_argument("--key", default=None, help="API key, sent as a bearer token")


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
