#!/usr/bin/env python3
"""Serving benchmark: generated tokens/s, time to first token and inter-token latency at several concurrencies,
for `prescope serve` or llama.cpp's `llama-server` with the same client (httpx, asyncio, server-sent events as the
OpenAI API streams them; httpx is on the GPU machine, where the `openai` package is not).

At each concurrency C, C clients each send --rounds streamed completions one after another: a prompt of about
--prompt-words words (a fixed text repeated; the token count comes from the server's usage) that starts with the
request's own number, so that no request's prefix is in a server's prompt cache (llama-server reuses the KV of a
cached prefix and would skip most of the prefill the other server does), max_tokens
--gen-tokens with ignore_eos (both servers accept it), temperature 0. Generated tokens are the servers' own
counts (stream_options include_usage); tokens/s is all requests' generated tokens over the level's wall time.
TTFT is request start to first text chunk; inter-token latency is the gap between text chunks (one token each on
both servers, except where a split UTF-8 character is held back). Prints a table and writes JSON (--out).

    python3 bench/serve/bench_serve.py --url http://127.0.0.1:8080 --concurrency 1 8 32 64 --label "..." --out F

Loopback only (the URL's host must be 127.0.0.1 or localhost). Exit code 1 when a request failed.
"""
import argparse
import asyncio
import json
import sys
import time
import urllib.parse
from pathlib import Path

try:
    import httpx
except ImportError:  # the openai package of requirements.txt brings the same client under this name
    import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_stats import get_json, percentiles  # noqa: E402  (same folder)

TEXT = ("The Debian project is an association of individuals who have made common cause to create a free "
        "operating system. ")


async def one_request(client, model, prompt, n_gen, out):
    """One streamed completion; appends its TTFT, inter-token gaps and end-to-end time (s) to out and adds the
    server's token counts (the usage chunk). Raises on an HTTP error, a malformed chunk or a stream without
    text or usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": n_gen, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.monotonic()
    first = last = None
    itl = []
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("usage"):
                usage = ch["usage"]
            if ch.get("choices") and ch["choices"][0].get("text"):
                now = time.monotonic()
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
    if usage is None or first is None:
        raise RuntimeError("the stream ended without text or without usage")
    out["ttft"].append(first - t0)
    out["itl"].extend(itl)
    out["e2e"].append(time.monotonic() - t0)
    out["completion_tokens"] += usage["completion_tokens"]
    out["prompt_tokens"] += usage["prompt_tokens"]


def make_prompt(i, n_words):
    """Request i's prompt: its number, then n_words - 1 words of TEXT starting at word i (no shared prefix)."""
    words = TEXT.split()
    return " ".join([f"{i}."] + [words[(i + j) % len(words)] for j in range(n_words - 1)])


async def run_level(url, model, concurrency, rounds, first_id, n_words, n_gen, timeout):
    """One concurrency level: `concurrency` clients, `rounds` requests each, request ids from first_id."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    client = httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, headers={"Authorization": "Bearer none"})
    out = {"ttft": [], "itl": [], "e2e": [], "completion_tokens": 0, "prompt_tokens": 0, "errors": []}

    ids = iter(range(first_id, first_id + concurrency * rounds))

    async def worker():
        for _ in range(rounds):
            try:
                await one_request(client, model, make_prompt(next(ids), n_words), n_gen, out)
            except Exception as e:  # noqa: BLE001 -- every failure is reported
                out["errors"].append(f"{type(e).__name__}: {e}")

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.monotonic() - t0
    await client.aclose()
    n = len(out["e2e"])
    return {"concurrency": concurrency, "requests": n, "errors": out["errors"][:10], "n_errors": len(out["errors"]),
            "wall_s": wall, "prompt_tokens_per_request": out["prompt_tokens"] / n if n else 0,
            "generated_tokens": out["completion_tokens"], "gen_tok_s": out["completion_tokens"] / wall,
            "ttft_s": percentiles(out["ttft"]), "itl_s": percentiles(out["itl"]), "e2e_s": percentiles(out["e2e"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each concurrency")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--label", default="", help="free text stored in the JSON (server, flags, routing)")
    ap.add_argument("--out", help="JSON result file")
    a = ap.parse_args()
    if urllib.parse.urlparse(a.url).hostname not in ("127.0.0.1", "localhost"):
        sys.exit("bench_serve.py: loopback URLs only")
    model = get_json(a.url, "/v1/models", "none")["data"][0]["id"]
    # One request first, outside the timings: the servers' first step pays one-off costs (cuBLAS handles, caches).
    asyncio.run(run_level(a.url, model, 1, 1, 0, a.prompt_words, 4, a.request_timeout))
    levels, first_id = [], 1
    for c in a.concurrency:
        levels.append(asyncio.run(run_level(a.url, model, c, a.rounds, first_id, a.prompt_words, a.gen_tokens,
                                            a.request_timeout)))
        first_id += c * a.rounds
    print(f"{a.label}\n{'conc':>5} {'reqs':>5} {'gen tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'errors':>6}")
    def ms(d, k):
        return d.get(k, float("nan")) * 1e3

    for r in levels:
        print(f"{r['concurrency']:>5} {r['requests']:>5} {r['gen_tok_s']:>10.1f} {ms(r['ttft_s'], 'p50'):>7.0f}ms "
              f"{ms(r['ttft_s'], 'p99'):>7.0f}ms {ms(r['itl_s'], 'p50'):>6.1f}ms {ms(r['itl_s'], 'p99'):>6.1f}ms "
              f"{r['n_errors']:>6}")
    result = {"label": a.label, "url": a.url, "model": model, "prompt_words": a.prompt_words,
              "gen_tokens": a.gen_tokens, "rounds": a.rounds, "levels": levels}
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any(r["n_errors"] for r in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
