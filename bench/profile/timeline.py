#!/usr/bin/env python3
"""Per-token GPU timeline of a decode run, from bench/profile/cupti-trace.cpp's CSV.

Tokens are the windows between consecutive device-to-host copies of the logits: copies of exactly
--token-copy-bytes, by default the size of the trace's last device-to-host copy of at least 64 KiB (the last
token's logits; the layers' routing copies of a decode step are far smaller, a prefill's are not). The first --skip windows (prefill and the
first decode steps) are left out. Per window: span (one token's time), busy (the union of kernel, memcpy and memset
intervals on the device), idle = span - busy; per kernel name: launches and device time per token. Prints a table
and, with --json, writes the numbers.

    python3 bench/profile/timeline.py trace.csv [--skip 4] [--top 25] [--json out.json]
"""
import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict


def load(path):
    """Records as (kind, start_ns, end_ns, bytes, copy_kind, name), sorted by start."""
    with open(path, newline="") as f:
        rows = [(r["kind"], int(r["start_ns"]), int(r["end_ns"]), int(r["bytes"]), int(r["copy_kind"]), r["name"])
                for r in csv.DictReader(f)]
    rows.sort(key=lambda r: r[1])
    return rows


def union_ns(intervals):
    """Total length of the union of [start, end) intervals (sorted by start)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarise(rows, token_copy_bytes, skip):
    """Mean per-token span, busy, idle (us), launches and the per-kernel table over the decode windows."""
    if token_copy_bytes is None:
        big = [r[3] for r in rows if r[0] == "C" and r[4] == 2 and r[3] >= 64 << 10]
        if not big:
            sys.exit("timeline.py: no device-to-host copy of 64 KiB or more (logits); pass --token-copy-bytes")
        token_copy_bytes = big[-1]
    marks = [r[2] for r in rows if r[0] == "C" and r[4] == 2 and r[3] == token_copy_bytes]
    if len(marks) < skip + 2:
        sys.exit(f"timeline.py: {len(marks)} token copies of {token_copy_bytes} bytes; need more than {skip + 1}")
    windows = list(zip(marks[skip:-1], marks[skip + 1:]))
    per_token = []
    by_name = defaultdict(lambda: [0, 0])  # name -> [launches, ns] over all windows
    i = 0
    for w0, w1 in windows:
        while i < len(rows) and rows[i][1] < w0:
            i += 1
        j = i
        inside = []
        launches = 0
        while j < len(rows) and rows[j][1] < w1:
            k, s, e, _, _, name = rows[j]
            inside.append((s, min(e, w1)))
            if k == "K":
                launches += 1
                by_name[name][0] += 1
                by_name[name][1] += e - s
            j += 1
        busy = union_ns(inside)
        per_token.append({"span_us": (w1 - w0) / 1e3, "busy_us": busy / 1e3, "idle_us": (w1 - w0 - busy) / 1e3,
                          "launches": launches})
    n = len(windows)
    mean = {k: statistics.fmean(t[k] for t in per_token) for k in per_token[0]}
    kernels = sorted(({"name": k, "launches_per_token": v[0] / n, "us_per_token": v[1] / 1e3 / n}
                      for k, v in by_name.items()), key=lambda d: -d["us_per_token"])
    return {"tokens": n, "mean": mean, "median_span_us": statistics.median(t["span_us"] for t in per_token),
            "kernels": kernels}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--token-copy-bytes", type=int, help="bytes of one token's logits copy (default: see above)")
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    a = ap.parse_args()
    s = summarise(load(a.trace), a.token_copy_bytes, a.skip)
    m = s["mean"]
    print(f"{s['tokens']} decode tokens: span {m['span_us']:.0f} us (median {s['median_span_us']:.0f}), GPU busy "
          f"{m['busy_us']:.0f} us, idle {m['idle_us']:.0f} us ({100 * m['idle_us'] / m['span_us']:.1f}%), "
          f"{m['launches']:.0f} kernel launches per token")
    print(f"{'us/token':>9} {'launches':>8} {'us/launch':>9}  kernel")
    for k in s["kernels"][:a.top]:
        print(f"{k['us_per_token']:>9.1f} {k['launches_per_token']:>8.1f} "
              f"{k['us_per_token'] / max(k['launches_per_token'], 1e-9):>9.2f}  {k['name'][:110]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
