#!/usr/bin/env python3
"""Requests/s and generated tokens/s of a running `gdsllm serve` at several client counts.

Each client sends chat requests back to back (streamed, greedy, --max-tokens each) for
--seconds; prints one JSON line per concurrency with requests/s, tokens/s and mean
time-to-first-token. Standard library only.

Usage: scripts/serve_bench.py --url http://127.0.0.1:8080 --clients 1 8 32
"""

import argparse
import json
import threading
import time

from serve_client import stream


def one_request(url, key, max_tokens, i):
    body = {
        "messages": [{"role": "user", "content": f"Tell me a fact about the number {i}."}],
        "temperature": 0, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens = None, 0
    for t, chunk in stream(url, "/v1/chat/completions", body, key):
        if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            ttft = t - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return ttft or 0.0, tokens


def run(url, key, clients, seconds, max_tokens):
    done, ttfts, tokens, errors = [0], [], [0], [0]
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(c):
        i = c
        while time.perf_counter() < deadline:
            try:
                t, n = one_request(url, key, max_tokens, i)
                with lock:
                    done[0] += 1
                    ttfts.append(t)
                    tokens[0] += n
            except Exception:
                with lock:
                    errors[0] += 1
            i += clients

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {
        "clients": clients, "requests": done[0], "errors": errors[0], "wall_s": round(wall, 2),
        "requests_per_s": round(done[0] / wall, 3), "tokens_per_s": round(tokens[0] / wall, 2),
        "mean_ttft_s": round(sum(ttfts) / max(len(ttfts), 1), 3), "max_tokens": max_tokens,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    for c in a.clients:
        print(json.dumps(run(a.url, a.api_key, c, a.seconds, a.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
