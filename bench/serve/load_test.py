#!/usr/bin/env python3
"""Load test of an OpenAI-compatible server on loopback: `prescope serve` or llama.cpp's `llama-server`, with the
same client (the official `openai` package, asyncio).

N requests (default 1000) from C concurrent clients (default 64): completions and chat, mostly streamed, random
prompts, sampling settings and max_tokens; a share of the clients (default 10%) drop their stream after a few
chunks (the server must free the slot). A 503 (full queue, provoked on purpose by running more clients than
slots + queue) is counted and retried after a short pause; every other failure is an error. Bounded in requests
and in time (--time-limit). With --pid, the server's resident memory is read before (after a warm-up) and after,
and the growth must stay under --rss-bound-mib.

Prints a table and writes JSON (--out). Exit code 1 when there were errors, the RSS bound was exceeded, the time
limit was hit or the server no longer answers /health. Commands and results: bench/serve/README.md.
"""
import argparse
import asyncio
import json
import random
import sys
import time
import urllib.parse
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_stats import get_json, percentiles  # noqa: E402  (same folder)

PROMPTS = [
    "The Debian project is",
    "To install a package, run",
    "The kernel module",
    "Free software means",
    "A configuration file in /etc",
    "The maintainer of this package",
    "Überprüfung der Paketliste —",
    "To build the documentation,",
]
QUESTIONS = [
    "How do I install a package?",
    "What is a Debian source package?",
    "Explain what systemd does.",
    "How do I list the files of a package?",
]


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Stats:
    def __init__(self):
        self.completed = 0
        self.dropped = 0
        self.drop_planned = 0
        self.rejected_503 = 0
        self.errors = []
        self.ttft = []
        self.itl = []
        self.e2e = []
        self.completion_tokens = 0


async def one_request(client, model, rng, drop, stats, args):
    chat = rng.random() < args.chat_share
    stream = drop or rng.random() < args.stream_share
    stats.drop_planned += drop
    kw = dict(model=model, max_tokens=rng.randint(args.min_tokens, args.max_tokens), temperature=rng.choice([0.0, 0.8]),
              seed=rng.randint(0, 2**31 - 1))
    if chat:
        kw["messages"] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        create = client.chat.completions.create
    else:
        kw["prompt"] = rng.choice(PROMPTS)
        create = client.completions.create
    while True:
        t0 = time.monotonic()
        try:
            if not stream:
                r = await create(**kw)
                stats.e2e.append(time.monotonic() - t0)
                stats.completion_tokens += r.usage.completion_tokens
                stats.completed += 1
                return
            s = await create(**kw, stream=True)
            first, last, chunks = None, None, 0
            drop_after = rng.randint(1, 3) if drop else None
            async for ch in s:
                if not ch.choices:
                    continue
                c = ch.choices[0]
                text = c.delta.content if chat else c.text
                if text:
                    now = time.monotonic()
                    if first is None:
                        first = now
                        stats.ttft.append(now - t0)
                    else:
                        stats.itl.append(now - last)
                    last = now
                    chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    await s.close()
                    stats.dropped += 1
                    return
            stats.e2e.append(time.monotonic() - t0)
            stats.completed += 1
            return
        except openai.APIStatusError as e:
            if e.status_code == 503:
                stats.rejected_503 += 1
                await asyncio.sleep(rng.uniform(0.05, 0.3))
                continue
            stats.errors.append(f"HTTP {e.status_code}: {e.message}")
            return
        except Exception as e:  # noqa: BLE001 -- every other failure is an error to report
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
            stats.errors.append(f"{type(e).__name__}: {e}{cause}")
            return


async def run_phase(url, model, n_requests, concurrency, seed, stats, args, deadline):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key, max_retries=0, timeout=args.request_timeout)
    rng = random.Random(seed)
    # Exactly round(drop_share * n) requests, spread at random, drop their stream.
    n_drop = round(args.drop_share * n_requests)
    drops = [i < n_drop for i in range(n_requests)]
    rng.shuffle(drops)
    queue = asyncio.Queue()
    for d in drops:
        queue.put_nowait((rng.randint(0, 2**31 - 1), d))

    async def worker():
        while not queue.empty() and time.monotonic() < deadline:
            s, d = queue.get_nowait()
            await one_request(client, model, random.Random(s), d, stats, args)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return queue.qsize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (loopback only)")
    ap.add_argument("--pid", type=int, help="server process id, for its resident memory")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=64, help="requests before the first RSS reading")
    ap.add_argument("--drop-share", type=float, default=0.10, help="share of the requests that drop their stream")
    ap.add_argument("--stream-share", type=float, default=1.0)
    ap.add_argument("--chat-share", type=float, default=0.5)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=1800, help="seconds for the whole run")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--rss-bound-mib", type=float, default=64, help="allowed RSS growth from warm-up to the end")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="", help="free text stored in the JSON (server, flags)")
    ap.add_argument("--out", help="JSON result file")
    args = ap.parse_args()

    host = urllib.parse.urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"error: --url {args.url}: the load test only targets loopback addresses")
    if not 0 <= args.drop_share <= 1 or args.requests < 1 or args.concurrency < 1:
        sys.exit("error: --drop-share in [0, 1], --requests and --concurrency >= 1")

    models = get_json(args.url, "/v1/models", args.api_key)
    model = models["data"][0]["id"]
    deadline = time.monotonic() + args.time_limit

    warm = Stats()
    asyncio.run(run_phase(args.url, model, args.warmup, args.concurrency, args.seed + 1, warm, args, deadline))
    rss_before = rss_mib(args.pid) if args.pid else None

    stats = Stats()
    t0 = time.monotonic()
    left = asyncio.run(run_phase(args.url, model, args.requests, args.concurrency, args.seed, stats, args, deadline))
    wall = time.monotonic() - t0
    rss_after = rss_mib(args.pid) if args.pid else None
    try:
        healthy = get_json(args.url, "/health", args.api_key).get("status") == "ok"
    except Exception:  # noqa: BLE001
        healthy = False

    result = {
        "label": args.label,
        "url": args.url,
        "model": model,
        "settings": {k: getattr(args, k) for k in ("requests", "concurrency", "warmup", "drop_share", "stream_share",
                                                    "chat_share", "min_tokens", "max_tokens", "seed", "time_limit")},
        "wall_s": wall,
        "requests_done": stats.completed + stats.dropped + len(stats.errors),
        "requests_not_started": left,
        "completed": stats.completed,
        "drop_planned": stats.drop_planned,
        "dropped_mid_stream": stats.dropped,
        "rejected_503_retried": stats.rejected_503,
        "errors": len(stats.errors),
        "error_samples": stats.errors[:10],
        "streamed_tokens_per_s": (len(stats.ttft) + len(stats.itl)) / wall if wall > 0 else 0.0,
        "ttft_s": percentiles(stats.ttft),
        "inter_chunk_s": percentiles(stats.itl),
        "e2e_s": percentiles(stats.e2e),
        "rss_mib_before": rss_before,
        "rss_mib_after": rss_after,
        "rss_bound_mib": args.rss_bound_mib,
        "healthy_after": healthy,
    }
    fails = []
    if stats.errors:
        fails.append(f"{len(stats.errors)} errors")
    if left:
        fails.append(f"time limit: {left} requests not started")
    if rss_before is not None and rss_after - rss_before > args.rss_bound_mib:
        fails.append(f"RSS grew {rss_after - rss_before:.1f} MiB > {args.rss_bound_mib} MiB")
    if not healthy:
        fails.append("/health does not answer ok")
    result["passed"] = not fails
    result["failures"] = fails

    print(f"{'metric':<34} {'value':>12}")
    for k in ("requests_done", "completed", "drop_planned", "dropped_mid_stream", "rejected_503_retried", "errors"):
        print(f"{k:<34} {result[k]:>12}")
    print(f"{'wall_s':<34} {wall:>12.1f}")
    print(f"{'streamed chunks/s':<34} {result['streamed_tokens_per_s']:>12.1f}")
    for name in ("ttft_s", "inter_chunk_s", "e2e_s"):
        p = result[name]
        if p["n"]:
            print(f"{name + ' p50 / p90 / p99':<34} {p['p50']:.3f} / {p['p90']:.3f} / {p['p99']:.3f}")
    if rss_before is not None:
        print(f"{'RSS MiB before / after':<34} {rss_before:.1f} / {rss_after:.1f} (bound +{args.rss_bound_mib})")
    print("passed" if not fails else "FAILED: " + "; ".join(fails))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
