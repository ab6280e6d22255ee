# Tests of the trace tools (pytest): pstrace round trip and rejection of damaged files, the vectorised LRU and Belady
# replays against plain per-layer caches written from the rules in tools/data/lru_replay.py, and the engine's
# eval-predictor cache replay against the Python one on a committed trace.
import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "data"))
import lru_replay  # noqa: E402
import pstrace  # noqa: E402

PRESCOPE = Path(os.environ.get("PRESCOPE_BIN", ROOT / "build" / "bin" / "prescope"))


def reference_hits(ids, capacity, policy="lru"):
    """Per-layer hit counts of a plain cache: hits against the cache before the token; then the token's experts are
    used hits first, then misses, each in ascending id (the runtime's order); a miss in a full cache evicts, among
    the experts the token does not use, the least recent (lru) or the one used again farthest ahead (belady)."""
    n, n_layer, _ = ids.shape
    hits = np.zeros(n_layer, dtype=np.int64)
    for layer in range(n_layer):
        cache = OrderedDict()
        for t in range(n):
            s = [int(e) for e in ids[t, layer]]
            hit = sorted(e for e in s if e in cache)
            hits[layer] += len(hit)
            for e in hit + sorted(e for e in s if e not in cache):
                if e in cache:
                    cache.move_to_end(e)
                    continue
                if len(cache) == capacity:
                    others = [x for x in cache if x not in s]
                    if policy == "lru":
                        victim = others[0]
                    else:
                        def next_use(x):
                            return next((u for u in range(t + 1, n) if x in ids[u, layer]), n)
                        victim = max(others, key=next_use)
                    del cache[victim]
                cache[e] = True
    return hits


def planted_trace(rng, n, n_layer, n_expert, k):
    """Top-k sets with temporal locality: each token keeps about half of the previous token's experts."""
    ids = np.zeros((n, n_layer, k), dtype=np.uint8)
    for layer in range(n_layer):
        prev = rng.choice(n_expert, k, replace=False)
        for t in range(n):
            keep = prev[rng.random(k) < 0.5]
            rest = rng.choice(np.setdiff1d(np.arange(n_expert), keep), k - len(keep), replace=False)
            cur = rng.permutation(np.concatenate([keep, rest]))
            ids[t, layer] = cur
            prev = cur
    return ids


def test_lru_matches_reference():
    rng = np.random.default_rng(3)
    ids = planted_trace(rng, 300, 3, 32, 4)
    caps = [4, 6, 8, 16, 32]
    fast = lru_replay.lru_hits(ids, 32, caps)
    for c, row in zip(caps, fast):
        assert (row == reference_hits(ids, c)).all(), c
    # a cache holding every expert misses only on first use
    first_uses = [len(np.unique(ids[:, layer])) for layer in range(3)]
    assert (fast[-1] == 300 * 4 - np.array(first_uses)).all()


def test_lru_takes_hits_before_loads():
    # 2 slots; token 1 routes {2, 0} in router order with {0, 1} cached: using 2 first would evict 0 and miss it
    ids = np.array([[[0, 1]], [[2, 0]], [[0, 2]]], dtype=np.uint8)
    assert lru_replay.lru_hits(ids, 4, [2])[0].tolist() == [3]  # 0 at token 1; 0 and 2 at token 2


def test_belady_matches_reference_and_bounds_lru():
    rng = np.random.default_rng(7)
    ids = planted_trace(rng, 120, 3, 16, 4)
    caps = [4, 6, 8, 12]
    opt = lru_replay.belady_hits(ids, 16, caps)
    lru = lru_replay.lru_hits(ids, 16, caps)
    for c, row, lrow in zip(caps, opt, lru):
        assert (row == reference_hits(ids, c, "belady")).all(), c
        assert (row >= lrow).all(), c
        assert row.sum() > lrow.sum() or c == 4, c  # with capacity = top_k there is no choice to make
    # cyclic top-1 over 3 experts with 2 slots: LRU never hits, the optimum hits every other token after the first 2
    cyc = np.array([0, 1, 2, 0, 1, 2, 0], dtype=np.uint8).reshape(7, 1, 1)
    assert lru_replay.lru_hits(cyc, 3, [2])[0, 0] == 0 and lru_replay.belady_hits(cyc, 3, [2])[0, 0] == 2


@pytest.mark.skipif(not PRESCOPE.exists(), reason="build/bin/prescope not built")
@pytest.mark.parametrize("slots", [4, 12])
def test_engine_replay_equals_python_replay(tmp_path, slots):
    trace = ROOT / "traces" / "demo-test.pstrace"
    out = tmp_path / "eval.json"
    subprocess.run([str(PRESCOPE), "eval-predictor", "--trace", str(trace), "--split", "all", "--predictor", "none",
                    "--cache-slots", str(slots), "--json", str(out)], check=True, capture_output=True, timeout=600)
    cache = json.loads(out.read_text())["cache"]
    t = pstrace.read_trace(trace)
    for policy, key in (("lru", "hit_rate"), ("belady", "belady_hit_rate")):
        want = lru_replay.hit_rates(t, [slots], policy)[slots]["mean"]
        assert abs(cache[key] - want) < 1e-12, (policy, cache[key], want)


def test_lru_locality_beats_random():
    rng = np.random.default_rng(4)
    local = planted_trace(rng, 400, 2, 64, 8)
    rand = np.stack([np.stack([rng.choice(64, 8, replace=False) for _ in range(2)]) for _ in range(400)])
    hl = lru_replay.lru_hits(local, 64, [16])[0].sum()
    hr = lru_replay.lru_hits(rand.astype(np.uint8), 64, [16])[0].sum()
    assert hl > 1.3 * hr
    # random routing with a cache of c experts hits about c / E of the time once warm
    assert abs(hr / (400 * 8 * 2) - 16 / 64) < 0.05


def test_pstrace_self_check(tmp_path):
    pstrace.self_check(tmp_path)


def test_replay_from_file(tmp_path):
    rng = np.random.default_rng(5)
    ids = planted_trace(rng, 50, 2, 16, 4)
    w = np.full(ids.shape, 0.25)
    p = tmp_path / "t.pstrace"
    pstrace.write_trace(p, model="t", arch="qwen3moe", n_expert=16,
                        sequences=[{"name": "a", "source": "test-split", "n_tokens": 50}],
                        token_ids=np.arange(50), expert_ids=ids, gate_weights=w, created_by="test")
    rates = lru_replay.hit_rates(pstrace.read_trace(p), [8])
    assert abs(rates[8]["mean"] - reference_hits(ids, 8).sum() / (50 * 4 * 2)) < 1e-12


def test_head_keeps_whole_leading_sequences(tmp_path):
    rng = np.random.default_rng(6)
    ids = planted_trace(rng, 12, 2, 16, 4)
    seqs = [{"name": "a", "source": "test-split", "n_tokens": 5}, {"name": "b", "source": "gsm8k", "n_tokens": 7}]
    src, dst = tmp_path / "a.pstrace", tmp_path / "b.pstrace"
    pstrace.write_trace(src, model="t", arch="qwen3moe", n_expert=16, sequences=seqs, token_ids=np.arange(12),
                        expert_ids=ids, gate_weights=np.full(ids.shape, 0.25), created_by="test")
    n, _ = pstrace.write_head(src, dst, 11)
    t = pstrace.read_trace(dst)
    assert n == 5 and t.sequences == seqs[:1] and (t.expert_ids == ids[:5]).all()
