#!/usr/bin/env python3
"""Tokens/s and time to first token of one `gdsllm serve` over its three streaming transports,
REST SSE (/v1/completions with stream), WebSocket JSON-RPC (/v1/ws `generate`) and gRPC
(gdsllm.v1.Generation/Generate), for the same load; then the per-message overhead of each.

The script starts `gdsllm serve --grpc-port 0` on the model (as scripts/rpc_client_check.py
does) and runs --rounds rounds. Each round runs every transport once, in an order that rotates
from round to round (so that a neighbour's compile on a shared machine does not always land
on the same transport), and each run is:
- the load: --clients concurrent clients, each on its own connection (REST: one kept-alive
  HTTP/1.1 connection per client; WebSocket: one socket per client; gRPC: one HTTP/2
  channel shared by the clients' threads, as a gRPC client would), each sending --requests
  greedy requests of --max-tokens tokens back to back; tokens/s is all clients' tokens over
  the run's wall time, TTFT the median over its requests from the send to the first token;
- the idle round trip: --pings sequential calls that do no model work (REST GET /v1/models
  on a kept-alive connection, WebSocket `models`, gRPC ServerReady);
- the one-token round trip: --one-token sequential greedy requests with max_tokens 1 (the
  same short prompt, so the model's share is the same on every transport).
Printed: the median over the rounds of each figure per transport, the bytes one streamed
token takes on the wire (the payload of a real token message, without TCP or HTTP/2 frame
headers: SSE's `data:` line, the WebSocket text frame, the gRPC length-prefixed message),
as JSON lines and as a Markdown table. The greedy completions must give the same number of
tokens on every transport (the script stops otherwise).

Needs `websockets` and `grpcio` + `grpcio-tools`; when they are not importable it creates a
virtual environment (--venv, default a temporary directory), installs them and re-runs itself.

Usage: scripts/transport_bench.py --gdsllm target/release/gdsllm --model DIR \\
           --clients 8 --requests 4 --max-tokens 32 --rounds 5
"""

import argparse
import asyncio
import http.client
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse

from venv_rerun import ensure_importable

TRANSPORTS = ["rest_sse", "websocket", "grpc"]
# Seconds any single wait may take before the benchmark fails instead of hanging.
TIMEOUT = 300


def prompt(i):
    return f"Count from {i} to {i + 100}: {i}, {i + 1},"


def run_threads(clients, requests, one):
    """Runs `one(client, i)` for each client's requests on one thread per client; returns
    the results and the wall time."""
    runs, lock = [], threading.Lock()
    errors = []

    def client(c):
        try:
            for r in range(requests):
                result = one(c, c * requests + r)
                with lock:
                    runs.append(result)
        except Exception as e:  # re-raised on the main thread below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return runs, time.perf_counter() - start


class Rest:
    name = "rest_sse"

    def __init__(self, base, key):
        url = urllib.parse.urlparse(base)
        self.host, self.port = url.hostname, url.port
        self.headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
        self.token_bytes = None

    def connect(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)

    def generate(self, conn, i, max_tokens):
        """(seconds to the first token, completion tokens)."""
        body = json.dumps({"prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, self.headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"REST: HTTP {response.status}: {response.read()!r}")
        ttft, tokens = None, None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - start
                # The line and the blank line that ends the event.
                self.token_bytes = len(raw) + 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return ttft, tokens

    def load(self, clients, requests, max_tokens):
        conns = [self.connect() for _ in range(clients)]
        runs, wall = run_threads(clients, requests,
                                 lambda c, i: self.generate(conns[c], i, max_tokens))
        for conn in conns:
            conn.close()
        return runs, wall

    def pings(self, n):
        conn = self.connect()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            conn.request("GET", "/v1/models", headers=self.headers)
            conn.getresponse().read()
            times.append(time.perf_counter() - start)
        conn.close()
        return times

    def one_token(self, n):
        conn = self.connect()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.generate(conn, 0, 1)
            times.append(time.perf_counter() - start)
        conn.close()
        return times


class WebSocket:
    name = "websocket"

    def __init__(self, base, key):
        self.url = base.replace("http://", "ws://") + "/v1/ws"
        self.headers = {"authorization": f"Bearer {key}"}
        self.token_bytes = None

    async def generate(self, ws, i, max_tokens):
        start = time.perf_counter()
        await ws.send(json.dumps({"jsonrpc": "2.0", "id": i, "method": "generate", "params": {
            "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0}}))
        ttft = None
        while True:
            frame = await asyncio.wait_for(ws.recv(), TIMEOUT)
            m = json.loads(frame)
            if m.get("method") == "token":
                if ttft is None and m["params"]["text"]:
                    ttft = time.perf_counter() - start
                    self.token_bytes = len(frame.encode())
            elif m.get("id") == i:
                if "result" not in m:
                    raise RuntimeError(f"WebSocket: {m}")
                return ttft, m["result"]["usage"]["completion_tokens"]

    def load(self, clients, requests, max_tokens):
        from websockets.asyncio.client import connect

        async def client(c, runs):
            async with connect(self.url, additional_headers=self.headers) as ws:
                for r in range(requests):
                    runs.append(await self.generate(ws, c * requests + r, max_tokens))

        async def all_clients():
            runs = []
            start = time.perf_counter()
            await asyncio.gather(*(client(c, runs) for c in range(clients)))
            return runs, time.perf_counter() - start

        return asyncio.run(all_clients())

    def sequential(self, n, call):
        from websockets.asyncio.client import connect

        async def run():
            times = []
            async with connect(self.url, additional_headers=self.headers) as ws:
                for i in range(n):
                    start = time.perf_counter()
                    await call(ws, i)
                    times.append(time.perf_counter() - start)
            return times

        return asyncio.run(run())

    def pings(self, n):
        async def models(ws, i):
            await ws.send(json.dumps({"jsonrpc": "2.0", "id": i, "method": "models"}))
            await asyncio.wait_for(ws.recv(), TIMEOUT)

        return self.sequential(n, models)

    def one_token(self, n):
        async def one(ws, i):
            ttft, _ = await self.generate(ws, 0, 1)
            return ttft

        return self.sequential(n, one)


class Grpc:
    name = "grpc"

    def __init__(self, address, key, stubs):
        import grpc

        self.pb, self.pb_grpc, self.gen, self.gen_grpc = stubs
        self.channel = grpc.insecure_channel(address)
        self.generation = self.gen_grpc.GenerationStub(self.channel)
        self.kserve = self.pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.metadata = [("authorization", f"Bearer {key}")]
        self.token_bytes = None

    def generate(self, i, max_tokens):
        request = self.gen.GenerateRequest(prompt=prompt(i), max_tokens=max_tokens,
                                           temperature=0.0)
        start = time.perf_counter()
        ttft, tokens = None, None
        for m in self.generation.Generate(request, metadata=self.metadata, timeout=TIMEOUT):
            if m.HasField("token"):
                if ttft is None and m.token.text:
                    ttft = time.perf_counter() - start
                    # The 5-byte prefix (compressed flag, length) and the message.
                    self.token_bytes = 5 + m.ByteSize()
            else:
                tokens = m.done.usage.completion_tokens
        return ttft, tokens

    def load(self, clients, requests, max_tokens):
        return run_threads(clients, requests, lambda c, i: self.generate(i, max_tokens))

    def pings(self, n):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.kserve.ServerReady(self.pb.ServerReadyRequest(), metadata=self.metadata,
                                    timeout=TIMEOUT)
            times.append(time.perf_counter() - start)
        return times

    def one_token(self, n):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.generate(0, 1)
            times.append(time.perf_counter() - start)
        return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gdsllm", required=True, help="the gdsllm binary (a release build)")
    p.add_argument("--model", default=os.environ.get("GDSLLM_TEST_MODEL"))
    p.add_argument("--venv", help="virtual environment for websockets/grpcio")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--requests", type=int, default=4, help="requests per client, per run")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--rounds", type=int, default=5, help="rounds (each runs every transport)")
    p.add_argument("--pings", type=int, default=200, help="idle round trips per run")
    p.add_argument("--one-token", type=int, default=20, help="max_tokens=1 requests per run")
    args = p.parse_args()
    if not args.model:
        sys.exit("--model (or GDSLLM_TEST_MODEL) is required")
    ensure_importable(["websockets", "grpc", "grpc_tools"],
                      ["websockets==17.4", "grpcio==1.85.3", "grpcio-tools==1.85.1"], args.venv)
    import rpc_client_check as rpc

    proc, base, grpc_address = rpc.start_server(argparse.Namespace(gdsllm=args.gdsllm,
                                                                   model=args.model))
    try:
        with tempfile.TemporaryDirectory(prefix="gdsllm-bench-stubs-") as stubs_dir:
            transports = [Rest(base, rpc.KEY), WebSocket(base, rpc.KEY),
                          Grpc(grpc_address, rpc.KEY, rpc.grpc_stubs(stubs_dir))]
        # Warm up: the first requests pay for page faults and thread start-up.
        for t in transports:
            t.one_token(2)
        figures = {t.name: {"tokens_per_s": [], "ttft_ms": [], "idle_rt_us": [],
                            "one_token_rt_ms": []} for t in transports}
        tokens_seen = {}
        for r in range(args.rounds):
            order = transports[r % 3:] + transports[:r % 3]
            for t in order:
                runs, wall = t.load(args.clients, args.requests, args.max_tokens)
                tokens = sum(n for _, n in runs)
                ttfts = [s for s, _ in runs if s is not None]
                if len(ttfts) != len(runs):
                    sys.exit(f"{t.name}: {len(runs) - len(ttfts)} requests streamed no text")
                tokens_seen.setdefault(t.name, set()).add(tokens)
                f = figures[t.name]
                f["tokens_per_s"].append(tokens / wall)
                f["ttft_ms"].append(1000 * statistics.median(ttfts))
                f["idle_rt_us"].append(1e6 * statistics.median(t.pings(args.pings)))
                f["one_token_rt_ms"].append(1000 * statistics.median(t.one_token(args.one_token)))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {figures[n]['tokens_per_s'][-1]:.1f} tok/s" for n in TRANSPORTS),
                file=sys.stderr)
        if len({frozenset(s) for s in tokens_seen.values()}) != 1:
            sys.exit(f"the transports generated different token counts: {tokens_seen}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    load = (f"{args.clients} clients x {args.requests} requests x {args.max_tokens} tokens "
            f"(greedy), {args.rounds} rounds")
    print(f"| transport | tokens/s | TTFT p50 (ms) | idle round trip (µs) | max_tokens=1 round "
          f"trip (ms) | bytes per token message |  <!-- {load} -->")
    print("|---|---|---|---|---|---|")
    for t in transports:
        f = {k: statistics.median(v) for k, v in figures[t.name].items()}
        print(json.dumps({"transport": t.name, "load": load, **{k: round(v, 2) for k, v in f.items()},
                          "bytes_per_token_message": t.token_bytes,
                          "rounds": figures[t.name]}), file=sys.stderr)
        print(f"| {t.name} | {f['tokens_per_s']:.1f} | {f['ttft_ms']:.1f} | "
              f"{f['idle_rt_us']:.0f} | {f['one_token_rt_ms']:.2f} | {t.token_bytes} |")


if __name__ == "__main__":
    main()
