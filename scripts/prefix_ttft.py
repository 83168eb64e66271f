#!/usr/bin/env python3
"""Time to first token of a prompt whose long prefix a previous request shared (prefix caching).

Against a running `gdsllm serve`: sends /v1/completions requests (streamed, greedy, token-id
prompts, so any model works, synthetic ones included) made of one shared prefix of --prefix
tokens and a distinct --suffix-token tail each. The first request computes the prefix; every
later one should take it from the prefix cache. Prints one JSON line: the first request's time
to first token, the later ones' (each, and their median), the speed-up, and how far the
server's gdsllm_prefix_cache_hits_total moved. Standard library only.

Usage: scripts/prefix_ttft.py --url http://127.0.0.1:8080 [--prefix 1000] [--requests 4]
"""

import json
import statistics
import time
import urllib.request

from serve_client import spread_ids, stream, token_prompt_parser


def metric(url, name):
    with urllib.request.urlopen(url + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise SystemExit(f"{name} is not in {url}/metrics")


def ttft(url, prompt, key):
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    # Read to the end: the server updates its counters before it ends a stream.
    for t, chunk in stream(url, "/v1/completions", body, key):
        if first is None and chunk["choices"]:
            first = t - start
    if first is None:
        raise SystemExit("the stream ended without a token")
    return first


def main():
    ap = token_prompt_parser(__doc__)
    ap.add_argument("--prefix", type=int, default=1000, help="shared prompt tokens")
    ap.add_argument("--suffix", type=int, default=8, help="distinct tokens after it")
    ap.add_argument("--requests", type=int, default=4, help="requests in all (>= 2)")
    ap.add_argument("--salt", type=int, default=0, help="another shared prefix (a second run)")
    args = ap.parse_args()
    if args.requests < 2:
        raise SystemExit("--requests must be at least 2")
    shared = spread_ids(args.prefix, args.vocab, start=args.salt * 65537)
    hits_before = metric(args.url, "gdsllm_prefix_cache_hits_total")
    times = []
    for n in range(args.requests):
        tail = spread_ids(args.suffix, args.vocab, start=n * 131, stride=104729)
        times.append(ttft(args.url, shared + tail, args.key))
    hits = metric(args.url, "gdsllm_prefix_cache_hits_total") - hits_before
    later = statistics.median(times[1:])
    print(json.dumps({
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "first_ttft_s": round(times[0], 4),
        "later_ttft_s": [round(t, 4) for t in times[1:]],
        "later_median_ttft_s": round(later, 4),
        "speedup": round(times[0] / later, 2),
        "prefix_cache_hit_tokens": hits,
    }))


if __name__ == "__main__":
    main()
