#!/usr/bin/env python3
"""Per-token GPU timeline of a decode run, from bench/profile/cupti-trace.cpp's CSV.

Tokens are the windows between consecutive device-to-host copies of the logits: copies of exactly
--token-copy-bytes, by default the size of the trace's last device-to-host copy of at least 64 KiB (the last
token's logits; the layers' routing copies of a decode step are far smaller, a prefill's are not). The first --skip windows (prefill and the
first decode steps) are left out. Per window: span (one token's time), busy (the union of kernel, memcpy and memset
intervals on the device), idle = span - busy; per kernel name (and per copy direction and size): launches (copies)
and device time per token; the idle time by
where it falls (the record that ended before each gap and the one that starts it), so that an idle share names the
host work it waits for. Prints tables and, with --json, writes the numbers.

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


def label(record):
    """A record's name in the gap table: the kernel's, or the copy's direction and size."""
    kind, _, _, nbytes, copy_kind, name = record
    if kind == "K":
        return name[:60]
    direction = {1: "HtoD", 2: "DtoH", 8: "DtoD"}.get(copy_kind, str(copy_kind))
    return f"{'memcpy' if kind == 'C' else 'memset'} {direction} {nbytes} B"


def gaps(records, w0, w1, by_gap):
    """Adds each idle gap of a window (records sorted by start, clipped to it) to by_gap[(before, after)] (ns)."""
    last_end, last = w0, "token start"
    for r in records:
        if r[1] > last_end:
            by_gap[(last, label(r))] += r[1] - last_end
        if min(r[2], w1) >= last_end:
            last_end, last = min(r[2], w1), label(r)
    if w1 > last_end:
        by_gap[(last, "token end")] += w1 - last_end


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
    by_gap = defaultdict(int)  # (record before, record after) -> idle ns over all windows
    i = 0
    for w0, w1 in windows:
        while i < len(rows) and rows[i][1] < w0:
            i += 1
        j = i
        inside = []
        launches = 0
        window = []
        while j < len(rows) and rows[j][1] < w1:
            window.append(rows[j])
            k, s, e, _, _, name = rows[j]
            inside.append((s, min(e, w1)))
            launches += k == "K"
            key = name if k == "K" else label(rows[j])
            by_name[key][0] += 1
            by_name[key][1] += e - s
            j += 1
        busy = union_ns(inside)
        gaps(window, w0, w1, by_gap)
        per_token.append({"span_us": (w1 - w0) / 1e3, "busy_us": busy / 1e3, "idle_us": (w1 - w0 - busy) / 1e3,
                          "launches": launches})
    n = len(windows)
    mean = {k: statistics.fmean(t[k] for t in per_token) for k in per_token[0]}
    kernels = sorted(({"name": k, "launches_per_token": v[0] / n, "us_per_token": v[1] / 1e3 / n}
                      for k, v in by_name.items()), key=lambda d: -d["us_per_token"])
    idle = sorted(({"before": b, "after": a, "us_per_token": ns / 1e3 / n} for (b, a), ns in by_gap.items()),
                  key=lambda d: -d["us_per_token"])
    return {"tokens": n, "mean": mean, "median_span_us": statistics.median(t["span_us"] for t in per_token),
            "kernels": kernels, "idle": idle}


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
    print(f"{'us/token':>9} {'launches':>8} {'us/launch':>9}  kernel or copy")
    for k in s["kernels"][:a.top]:
        print(f"{k['us_per_token']:>9.1f} {k['launches_per_token']:>8.1f} "
              f"{k['us_per_token'] / max(k['launches_per_token'], 1e-9):>9.2f}  {k['name'][:110]}")
    print(f"{'idle us/token':>13}  between")
    for g in s["idle"][:10]:
        print(f"{g['us_per_token']:>13.1f}  {g['before']} -> {g['after']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
