# Replays routing traces through a per-layer LRU expert cache and prints the hit rates; `--check` compares them with
# the numbers in docs/data/routing-stats.json that docs/routing-report.md shows.
"""Per-layer LRU replay of .pstrace files.

Model (the one the report uses): every layer has its own cache of `capacity` experts. Tokens are replayed in file
order (sequences back to back; the cache is not flushed between sequences, as in a server decoding one request after
another). At token t, layer l requests its top-k set S; hits = |S ∩ cache| with the cache as it was after token t-1.
Then the experts of S become most recently used, in router order (slot 0 first, so slot k-1 ends most recent), and
least recently used experts are evicted down to `capacity`. capacity >= top_k, so S itself always fits.

Usage: python3 tools/data/lru_replay.py traces/topo-test.pstrace [--capacity 16 32 64] [--check docs/data/routing-stats.json]
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pstrace  # noqa: E402


def lru_hits(expert_ids, n_expert, capacities):
    """Hit counts of per-layer LRU caches.

    expert_ids: uint8/int [N, L, k] in router order; capacities: iterable of ints in [k, n_expert].
    Returns int64 [len(capacities), L]: hits per capacity and layer (divide by N * k for a hit rate).

    An expert e of S_t hits a cache of capacity c iff it was used before and fewer than c distinct experts were used
    more recently than e's last use (recency key: token index, then slot), which is exactly LRU with the update rule
    in the module docstring; one pass serves every capacity.
    """
    ids = np.asarray(expert_ids, dtype=np.int64)
    n, n_layer, k = ids.shape
    caps = np.asarray(list(capacities), dtype=np.int64)
    if caps.size and (caps.min() < k or caps.max() > n_expert):
        raise ValueError(f"capacities must lie in [top_k={k}, n_expert={n_expert}], got {caps.tolist()}")
    key = np.full((n_layer, n_expert), -1, dtype=np.int64)   # recency key: t * k + slot, -1 = never used
    hits = np.zeros((len(caps), n_layer), dtype=np.int64)
    rows = np.arange(n_layer)[:, None]
    slot_keys = np.arange(k, dtype=np.int64)[None, :]
    for t in range(n):
        s = ids[t]                                            # [L, k]
        ks = key[rows, s]                                     # [L, k]
        # number of experts more recent than each requested one
        rank = (key[:, None, :] > ks[:, :, None]).sum(axis=2)  # [L, k]
        used = ks >= 0
        hits += ((rank[None] < caps[:, None, None]) & used[None]).sum(axis=2)
        key[rows, s] = t * k + slot_keys
    return hits


def hit_rates(trace, capacities):
    """{capacity: {"per_layer": [L floats], "mean": float}} for a Trace."""
    n, _, k = trace.expert_ids.shape
    hits = lru_hits(trace.expert_ids, trace.n_expert, capacities)
    out = {}
    for c, h in zip(capacities, hits):
        per_layer = (h / max(n * k, 1)).tolist()
        out[int(c)] = {"per_layer": per_layer, "mean": float(np.mean(per_layer))}
    return out


def default_capacities(n_expert, top_k):
    """Cache sizes the report uses: 1/8, 1/4, 1/2 and 3/4 of the experts, at least top_k."""
    return sorted({max(top_k, n_expert * f // 8) for f in (1, 2, 4, 6)})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--capacity", type=int, nargs="*", help="cache sizes in experts per layer (default: 1/8..3/4)")
    ap.add_argument("--check", help="routing-stats.json whose lru section must match (tolerance 1e-9)")
    args = ap.parse_args()
    expected = json.loads(Path(args.check).read_text()) if args.check else None
    bad = 0
    for path in args.traces:
        t = pstrace.read_trace(path)
        caps = args.capacity or default_capacities(t.n_expert, t.top_k)
        rates = hit_rates(t, caps)
        name = Path(path).name
        print(f"{name}: {len(t.token_ids)} tokens, {t.n_layer} layers, {t.n_expert} experts, top-{t.top_k}")
        for c in caps:
            r = rates[c]
            print(f"  capacity {c:4d} ({c / t.n_expert:5.1%} of experts): mean hit rate {r['mean']:.4f}  "
                  f"first/middle/last layer {r['per_layer'][0]:.3f} {r['per_layer'][t.n_layer // 2]:.3f} "
                  f"{r['per_layer'][-1]:.3f}")
        if expected is not None:
            ref = expected["traces"].get(name, {}).get("lru")
            if ref is None:
                print(f"  check: {args.check} has no LRU numbers for {name}")
                bad += 1
                continue
            for c in caps:
                want = ref.get(str(c))
                if want is None or abs(want["mean"] - rates[c]["mean"]) > 1e-9 or any(
                        abs(a - b) > 1e-9 for a, b in zip(want["per_layer"], rates[c]["per_layer"])):
                    print(f"  check FAILED at capacity {c}: report {want and want['mean']}, replay {rates[c]['mean']}")
                    bad += 1
            if not bad:
                print(f"  check: matches {args.check}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
