# Replays routing traces through a per-layer LRU expert cache and prints the hit rates; `--check` compares them with
# the numbers in docs/data/routing-stats.json that docs/routing-report.md shows.
"""Per-layer LRU and offline-optimum (Belady) replay of .pstrace files.

Model (the one the report uses, and the runtime's): every layer has its own cache of `capacity` experts. Tokens are
replayed in file order (sequences back to back; the cache is not flushed between sequences, as in a server decoding
one request after another). At token t, layer l requests its top-k set S; hits = |S ∩ cache| with the cache as it was
after token t-1. Then the experts of S are used in the runtime's order (ExpertLoader::begin_layer over decide_layer's
ascending ids): first the hits, then the misses, each group in ascending expert id, so a load never evicts an expert
the same token uses; least recently used experts are evicted down to `capacity`. capacity >= top_k, so S always fits.
`prescope eval-predictor --predictor none --cache-slots c` replays the same model (tests/py/test_trace_tools.py).

Belady (MIN, 1966): the same demand-only cache, but a miss with a full layer evicts the resident expert whose next use
is farthest away; the offline optimum that bounds LRU, LFU and ARC on the same replay.

Usage: python3 tools/data/lru_replay.py traces/topo-test.pstrace [--capacity 16 32 64] [--belady]
       [--check docs/data/routing-stats.json]
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pstrace  # noqa: E402


def _check_capacities(caps, k, n_expert):
    if caps.size and (caps.min() < k or caps.max() > n_expert):
        raise ValueError(f"capacities must lie in [top_k={k}, n_expert={n_expert}], got {caps.tolist()}")


def lru_hits(expert_ids, n_expert, capacities):
    """Hit counts of per-layer LRU caches.

    expert_ids: uint8/int [N, L, k] in router order; capacities: iterable of ints in [k, n_expert].
    Returns int64 [len(capacities), L]: hits per capacity and layer (divide by N * k for a hit rate).

    An expert of S_t hits a cache of capacity c iff it was used before and fewer than c distinct experts were used
    more recently than its last use (LRU's stack property; recency key: token index, then the position in the
    runtime's order, hits before misses). Using the resident experts first never evicts, so the test holds against
    the state after token t-1. The order inside a token depends on which experts hit, hence one pass per capacity.
    """
    ids = np.asarray(expert_ids, dtype=np.int64)
    n, n_layer, k = ids.shape
    caps = np.asarray(list(capacities), dtype=np.int64)
    _check_capacities(caps, k, n_expert)
    hits = np.zeros((len(caps), n_layer), dtype=np.int64)
    rows = np.arange(n_layer)[:, None]
    for ci, c in enumerate(caps):
        key = np.full((n_layer, n_expert), -1, dtype=np.int64)   # recency key, -1 = never used
        for t in range(n):
            s = ids[t]                                            # [L, k]
            ks = key[rows, s]                                     # [L, k]
            rank = (key[:, None, :] > ks[:, :, None]).sum(axis=2)  # experts more recent than each requested one
            hit = (ks >= 0) & (rank < c)
            hits[ci] += hit.sum(axis=1)
            order = np.argsort(np.where(hit, 0, n_expert) + s, axis=1, kind="stable")  # hits first, ascending ids
            pos = np.empty_like(order)
            np.put_along_axis(pos, order, np.arange(k)[None, :].repeat(n_layer, 0), axis=1)
            key[rows, s] = t * k + pos
    return hits


def belady_hits(expert_ids, n_expert, capacities):
    """Hit counts of per-layer caches under the offline optimum (module docstring), int64 [len(capacities), L].

    All layers advance together; within a token the misses are handled one router slot at a time, each evicting,
    in every layer that is full, the resident expert not requested by the token with the farthest next use.
    """
    ids = np.asarray(expert_ids, dtype=np.int64)
    n, n_layer, k = ids.shape
    caps = np.asarray(list(capacities), dtype=np.int64)
    _check_capacities(caps, k, n_expert)
    never = np.iinfo(np.int64).max
    # next_use[t, l, j]: the next token after t whose layer l requests ids[t, l, j] (never if none)
    next_use = np.empty_like(ids)
    upcoming = np.full((n_layer, n_expert), never, dtype=np.int64)
    rows = np.arange(n_layer)
    for t in range(n - 1, -1, -1):
        next_use[t] = upcoming[rows[:, None], ids[t]]
        upcoming[rows[:, None], ids[t]] = t
    hits = np.zeros((len(caps), n_layer), dtype=np.int64)
    for ci, c in enumerate(caps):
        nxt = np.full((n_layer, n_expert), -1, dtype=np.int64)   # next use of each resident expert, -1 = not resident
        count = np.zeros(n_layer, dtype=np.int64)
        wanted = np.zeros((n_layer, n_expert), dtype=bool)
        for t in range(n):
            s = ids[t]
            wanted[rows[:, None], s] = True
            resident = nxt[rows[:, None], s] >= 0                 # [L, k] against the state after token t-1
            hits[ci] += resident.sum(axis=1)
            for j in range(k):
                miss = ~resident[:, j]
                full = miss & (count == c)
                if full.any():
                    cand = np.where((nxt >= 0) & ~wanted, nxt, -1)
                    victim = cand.argmax(axis=1)
                    nxt[rows[full], victim[full]] = -1
                    count[full] -= 1
                count[miss] += 1
            nxt[rows[:, None], s] = next_use[t]
            wanted[rows[:, None], s] = False
    return hits


def hit_rates(trace, capacities, policy="lru"):
    """{capacity: {"per_layer": [L floats], "mean": float}} for a Trace; policy "lru" or "belady"."""
    n, _, k = trace.expert_ids.shape
    hits = (lru_hits if policy == "lru" else belady_hits)(trace.expert_ids, trace.n_expert, capacities)
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
    ap.add_argument("--belady", action="store_true", help="also replay the offline optimum")
    ap.add_argument("--check", help="routing-stats.json whose lru (and, with --belady, belady) sections must match "
                                    "(tolerance 1e-9)")
    args = ap.parse_args()
    expected = json.loads(Path(args.check).read_text()) if args.check else None
    policies = ("lru", "belady") if args.belady else ("lru",)
    bad = 0
    for path in args.traces:
        t = pstrace.read_trace(path)
        caps = args.capacity or default_capacities(t.n_expert, t.top_k)
        name = Path(path).name
        print(f"{name}: {len(t.token_ids)} tokens, {t.n_layer} layers, {t.n_expert} experts, top-{t.top_k}")
        trace_bad = 0
        for policy in policies:
            rates = hit_rates(t, caps, policy)
            for c in caps:
                r = rates[c]
                print(f"  {policy:6s} capacity {c:4d} ({c / t.n_expert:5.1%} of experts): mean hit rate {r['mean']:.4f}"
                      f"  first/middle/last layer {r['per_layer'][0]:.3f} {r['per_layer'][t.n_layer // 2]:.3f} "
                      f"{r['per_layer'][-1]:.3f}")
            if expected is None:
                continue
            ref = expected["traces"].get(name, {}).get(policy)
            if ref is None:
                print(f"  check: {args.check} has no {policy} numbers for {name}")
                trace_bad += 1
                continue
            for c in caps:
                want = ref.get(str(c))
                if want is None or abs(want["mean"] - rates[c]["mean"]) > 1e-9 or any(
                        abs(a - b) > 1e-9 for a, b in zip(want["per_layer"], rates[c]["per_layer"])):
                    print(f"  check FAILED ({policy}) at capacity {c}: report {want and want['mean']}, "
                          f"replay {rates[c]['mean']}")
                    trace_bad += 1
        if expected is not None and not trace_bad:
            print(f"  check: matches {args.check}")
        bad += trace_bad
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
