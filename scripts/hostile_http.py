#!/usr/bin/env python3
"""Hostile HTTP clients against a running `gdsllm serve` (loopback): half-open connections,
malformed requests and a crowd of concurrent streams. Standard library only; prints one JSON
object per experiment on stdout.

  half-open: opens N connections that send `GET / HTTP/1.1\\r\\nX: ` and then nothing, and
             times /health while they are held (the server must keep answering).
  malformed: sends a corpus of broken requests (bad framing, bad JSON, wrong types, huge
             values, unsupported fields) and classifies each answer: 4xx or a refused
             connection = clear error, 2xx = wrongly accepted, 5xx = server error, no answer
             within the limit = hang.
  streams:   N concurrent streamed chats; each ends in a complete stream or a clean 429/503
             (latency percentiles of the completed ones).

Usage: scripts/hostile_http.py --url http://127.0.0.1:8080 half-open --count 20000
       scripts/hostile_http.py --url ... malformed
       scripts/hostile_http.py --url ... streams --count 1000 --max-tokens 8
"""

import argparse
import asyncio
import json
import resource
import statistics
import time
import urllib.parse

# Longer than the server's default --body-timeout (30 s): a request whose body never comes
# must get its 408 within it, and counts as a hang only past it.
LIMIT_S = 40.0


async def exchange(host, port, raw, limit=LIMIT_S, close_after_send=False):
    """Sends raw bytes; returns (status or None, body bytes, seconds); status 'hang' if the
    server said nothing within `limit`, 'closed' if it closed without answering."""
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), limit)
    except (OSError, asyncio.TimeoutError) as e:
        return "refused", str(e).encode(), time.perf_counter() - start
    try:
        writer.write(raw)
        await writer.drain()
        if close_after_send:
            writer.write_eof()
        # Every request says `Connection: close`: the answer ends when the server closes.
        data = await asyncio.wait_for(reader.read(), limit)
        if not data:
            return "closed", b"", time.perf_counter() - start
        status = data[9:12].decode(errors="replace")
        return status, data, time.perf_counter() - start
    except asyncio.TimeoutError:
        return "hang", b"", time.perf_counter() - start
    except (ConnectionError, OSError):
        return "closed", b"", time.perf_counter() - start
    finally:
        writer.close()


def request(method, path, body=None, headers=None):
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Connection: close"]
    raw_body = b""
    if body is not None:
        raw_body = body if isinstance(body, bytes) else json.dumps(body).encode()
        lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(raw_body)}")
    lines += headers or []
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + raw_body


async def health(host, port):
    status, _, seconds = await exchange(host, port, request("GET", "/health"), limit=5.0)
    return status, seconds


async def metric(host, port, name):
    _, data, _ = await exchange(host, port, request("GET", "/metrics"))
    for line in data.decode(errors="replace").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def half_open(host, port, count, hold):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # Keep descriptors for the probes: a client out of them proves nothing about the server.
    count = min(count, hard - 200)
    writers, failed = [], 0
    started = time.perf_counter()
    for _ in range(count):
        try:
            _, w = await asyncio.open_connection(host, port)
            w.write(b"GET / HTTP/1.1\r\nX: ")
            writers.append(w)
        except OSError:
            failed += 1
    opened_s = time.perf_counter() - started
    probes = []
    for _ in range(10):
        probes.append(await health(host, port))
        await asyncio.sleep(hold / 10)
    open_now = await metric(host, port, "gdsllm_connections_open")
    evicted = await metric(host, port, "gdsllm_connections_evicted_total")
    for w in writers:
        w.close()
    ok = [s for st, s in probes if st == "200"]
    print(json.dumps({
        "experiment": "half-open",
        "half_open_connections": count,
        "connect_failures": failed,
        "seconds_to_open": round(opened_s, 2),
        "health_probes": len(probes),
        "health_ok": len(ok),
        "health_max_s": round(max(s for _, s in probes), 4),
        "health_statuses": sorted({st for st, _ in probes}),
        "server_connections_open": open_now,
        "server_connections_evicted": evicted,
    }))


def malformed_corpus():
    good = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "temperature": 0}
    text = json.dumps(good).encode()
    corpus = []
    # Every truncation of a valid body: not JSON, or JSON of the wrong shape.
    for cut in range(1, len(text)):
        corpus.append((f"truncated body at {cut}", request("POST", "/v1/chat/completions",
                                                            text[:cut])))
    wrong = [
        ("messages", "hi"), ("messages", []), ("messages", [{"role": "king", "content": "x"}]),
        ("messages", [{"content": "x"}]), ("messages", [{"role": "user", "content": 5}]),
        ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", "many"), ("max_tokens", 1e300),
        ("temperature", -1), ("temperature", 99), ("temperature", "warm"),
        ("top_p", 0), ("top_p", 2), ("top_k", -5), ("min_p", 7), ("seed", "x"),
        ("stop", [""]), ("stop", ["x"] * 100), ("stop", 5), ("n", 2), ("n", 0),
        ("logprobs", "yes"), ("top_logprobs", 999), ("stream", "yes"),
        ("stream_options", 5), ("presence_penalty", 50), ("frequency_penalty", -50),
        ("model", "no-such-model"), ("model", 7),
        ("logit_bias", {"1": 100}), ("response_format", {"type": "json_object"}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "required"), ("functions", [{"name": "f"}]),
    ]
    for field, value in wrong:
        body = dict(good)
        body[field] = value
        corpus.append((f"chat {field}={json.dumps(value)[:40]}",
                       request("POST", "/v1/chat/completions", body)))
    for body in [{"prompt": 5}, {"prompt": []}, {"prompt": [[1, 2], [3]]},
                 {"prompt": [10 ** 12]}, {"prompt": "x", "echo": True},
                 {"prompt": "x", "best_of": 3}, {"prompt": "x", "suffix": "y"},
                 {"prompt": "x", "logprobs": 99}]:
        corpus.append((f"completions {json.dumps(body)[:40]}",
                       request("POST", "/v1/completions", body)))
    for body in [{"input": ""}, {"input": []}, {"input": [[]]}, {"input": 5},
                 {"input": ["x"] * 3000}, {"input": "x", "encoding_format": "hex"},
                 {"input": "x", "dimensions": 3}, {"input": [[10 ** 9]]}]:
        corpus.append((f"embeddings {json.dumps(body)[:40]}",
                       request("POST", "/v1/embeddings", body)))
    corpus += [
        ("body is a JSON array", request("POST", "/v1/chat/completions", b"[1,2,3]")),
        ("body is a scalar", request("POST", "/v1/chat/completions", b"42")),
        ("deeply nested JSON", request("POST", "/v1/chat/completions",
                                       b"[" * 100000 + b"]" * 100000)),
        ("NaN literal", request("POST", "/v1/chat/completions",
                                b'{"messages":[],"temperature":NaN}')),
        ("invalid UTF-8", request("POST", "/v1/chat/completions",
                                  b'{"messages":[{"role":"user","content":"\xff\xfe"}]}')),
        ("body over the limit", request("POST", "/v1/chat/completions",
                                        b'{"x":"' + b"a" * (5 << 20) + b'"}')),
        ("unknown path", request("GET", "/v2/everything")),
        ("wrong method", request("DELETE", "/v1/chat/completions")),
        ("garbage request line", b"\x00\x01\x02 nonsense\r\n\r\n"),
        ("HTTP/0.9 style", b"GET /\r\n\r\n"),
        ("header too large", request("GET", "/health", headers=["X: " + "a" * 200000])),
        ("invalid header name", b"GET /health HTTP/1.1\r\nBad Header: x\r\n\r\n"),
        ("content-length lies (short body)",
         b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
         b"Content-Type: application/json\r\n\r\n{\"messages\": "),
        ("two content-lengths",
         b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
         b"Content-Length: 3\r\n\r\n{}"),
        ("bad chunk size",
         b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
         b"\r\nzz\r\n{}\r\n0\r\n\r\n"),
        ("negative content-length",
         b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"),
        ("wrong content type", request("POST", "/v1/chat/completions", b"messages=hi",
                                       headers=["X-Note: form"])),
    ]
    return corpus


async def malformed(host, port):
    counts = {"clear error": 0, "accepted": 0, "server error": 0, "hang": 0}
    details = []
    for name, raw in malformed_corpus():
        status, _, seconds = await exchange(host, port, raw)
        if status in ("hang",):
            kind = "hang"
        elif status in ("closed", "refused") or status.startswith("4"):
            kind = "clear error"
        elif status.startswith("2"):
            kind = "accepted"
        else:
            kind = "server error"
        counts[kind] += 1
        if kind != "clear error":
            details.append({"request": name, "status": status, "seconds": round(seconds, 3)})
    alive, _ = await health(host, port)
    print(json.dumps({"experiment": "malformed", "requests": sum(counts.values()), **counts,
                      "health_after": alive, "not_clear": details}))


async def one_stream(host, port, i, max_tokens):
    body = {"messages": [{"role": "user", "content": f"Count to {i % 50}."}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    status, data, _ = await exchange(host, port, request("POST", "/v1/chat/completions", body),
                                     limit=600.0)
    seconds = time.perf_counter() - start
    complete = status == "200" and b"data: [DONE]" in data
    retry_after = b"\r\nretry-after:" in data.lower()
    return status, complete, retry_after, seconds


async def streams(host, port, count, max_tokens):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    started = time.perf_counter()
    results = await asyncio.gather(*(one_stream(host, port, i, max_tokens)
                                     for i in range(count)))
    wall = time.perf_counter() - started
    done = sorted(s for st, ok, _, s in results if ok)
    rejected = [r for r in results if r[0] in ("429", "503")]
    rejected_s = sorted(r[3] for r in rejected)
    other = [r[0] for r in results if not r[1] and r[0] not in ("429", "503")]

    def pct(p):
        return round(done[min(len(done) - 1, int(p * len(done)))], 3) if done else None

    print(json.dumps({
        "experiment": "streams", "streams": count, "max_tokens": max_tokens,
        "completed": len(done), "rejected_429_503": len(rejected),
        "rejected_with_retry_after": sum(1 for r in rejected if r[2]),
        "rejected_p99_s": round(rejected_s[int(0.99 * (len(rejected_s) - 1))], 3) if rejected_s else None,
        "other": other[:20], "other_count": len(other),
        "p50_s": pct(0.50), "p99_s": pct(0.99), "max_s": round(done[-1], 3) if done else None,
        "mean_s": round(statistics.mean(done), 3) if done else None,
        "wall_s": round(wall, 2),
    }))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("half-open")
    p.add_argument("--count", type=int, default=20000)
    p.add_argument("--hold", type=float, default=5.0)
    sub.add_parser("malformed")
    p = sub.add_parser("streams")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    url = urllib.parse.urlparse(args.url)
    host, port = url.hostname, url.port
    if args.what == "half-open":
        asyncio.run(half_open(host, port, args.count, args.hold))
    elif args.what == "malformed":
        asyncio.run(malformed(host, port))
    else:
        asyncio.run(streams(host, port, args.count, args.max_tokens))


if __name__ == "__main__":
    main()
