# Tests of the trace tools (pytest): pstrace round trip and rejection of damaged files, and the vectorised LRU replay
# against a plain OrderedDict LRU written from the rule in tools/data/lru_replay.py.
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "data"))
import lru_replay  # noqa: E402
import pstrace  # noqa: E402


def reference_lru_hits(ids, capacity):
    """Per-layer hit counts of an OrderedDict LRU: hits against the cache before the token, then the token's experts
    become most recent in slot order and the least recent ones are evicted."""
    n, n_layer, _ = ids.shape
    hits = np.zeros(n_layer, dtype=np.int64)
    for layer in range(n_layer):
        cache = OrderedDict()
        for t in range(n):
            s = [int(e) for e in ids[t, layer]]
            hits[layer] += sum(1 for e in s if e in cache)
            for e in s:
                cache.pop(e, None)
                cache[e] = True
            while len(cache) > capacity:
                cache.popitem(last=False)
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
        assert (row == reference_lru_hits(ids, c)).all(), c
    # a cache holding every expert misses only on first use
    first_uses = [len(np.unique(ids[:, layer])) for layer in range(3)]
    assert (fast[-1] == 300 * 4 - np.array(first_uses)).all()


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
    assert abs(rates[8]["mean"] - reference_lru_hits(ids, 8).sum() / (50 * 4 * 2)) < 1e-12


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
