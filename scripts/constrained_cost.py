#!/usr/bin/env python3
"""Decode tokens/s with and without a grammar on a running `gdsllm serve` (issue 19's cost of
constrained decoding, on whatever device the server runs).

Sends streamed, greedy /v1/completions requests with the same token-id prompt (so any model
works, synthetic ones included), alternating a free request and one under llama-server's
`grammar` field (llguidance's Lark: lower-case words and spaces, which never forces an end, so
both decode --tokens tokens unless the model picks its end-of-sequence token). Decode speed is
counted from the first streamed token to the last, so the prompt's time is left out. Prints one
JSON line: each side's tokens/s per round, their medians, and the constrained/free ratio
(issue 19's target: >= 0.9). Standard library only.

Usage: scripts/constrained_cost.py --url http://127.0.0.1:8080 [--tokens 128] [--rounds 3]
"""

import json
import statistics

from serve_client import spread_ids, stream, token_prompt_parser

GRAMMAR = 'start: /[a-z]+( [a-z]+)*/'


def decode_rate(url, prompt, tokens, grammar, key):
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    if grammar:
        body["grammar"] = grammar
    stamps = [t for t, chunk in stream(url, "/v1/completions", body, key)
              if chunk.get("choices") and chunk["choices"][0].get("text")]
    if len(stamps) < 8:
        raise SystemExit(f"only {len(stamps)} text chunks came back (grammar={bool(grammar)})")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps)


def main():
    ap = token_prompt_parser(__doc__)
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    ap.add_argument("--rounds", type=int, default=3, help="free/constrained pairs")
    args = ap.parse_args()
    prompt = spread_ids(32, args.vocab)
    decode_rate(args.url, prompt, 16, None, args.key)  # warm-up
    free, constrained, chunks = [], [], []
    for _ in range(args.rounds):
        rate, n = decode_rate(args.url, prompt, args.tokens, None, args.key)
        free.append(rate)
        rate, m = decode_rate(args.url, prompt, args.tokens, GRAMMAR, args.key)
        constrained.append(rate)
        chunks.append((n, m))
    f, c = statistics.median(free), statistics.median(constrained)
    print(json.dumps({
        "tokens": args.tokens,
        "chunks_free_constrained": chunks,
        "free_tok_s": [round(x, 1) for x in free],
        "constrained_tok_s": [round(x, 1) for x in constrained],
        "free_median": round(f, 1),
        "constrained_median": round(c, 1),
        "ratio": round(c / f, 3),
    }))


if __name__ == "__main__":
    main()
