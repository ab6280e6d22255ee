# Tests of the routing statistics in tools/data/routing_stats.py on traces with known answers: the popularity-only
# LRU estimate (Che's approximation) against a replayed LRU, the null baselines, depth matching and summaries.
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "data"))
import lru_replay  # noqa: E402
import routing_stats as rs  # noqa: E402


def independent_trace(rng, n, n_layer, n_expert, k, popularity):
    """Tokens that choose k distinct experts independently of each other, with the given per-expert weights."""
    ids = np.zeros((n, n_layer, k), dtype=np.uint8)
    for t in range(n):
        for layer in range(n_layer):
            ids[t, layer] = rng.choice(n_expert, k, replace=False, p=popularity)
    return ids


def test_che_uniform_popularity_is_c_over_e():
    assert rs.che_lru_hit_rate(np.full(64, 100), 8, 16) == pytest.approx(16 / 64, abs=1e-9)
    assert rs.che_lru_hit_rate(np.full(64, 100), 8, 64) == 1.0


def test_che_matches_replayed_lru_without_locality():
    rng = np.random.default_rng(7)
    n_expert, k = 64, 8
    zipf = 1.0 / np.arange(1, n_expert + 1) ** 0.9
    ids = independent_trace(rng, 3000, 1, n_expert, k, zipf / zipf.sum())
    counts = rs.popularity_counts(ids, n_expert)[0]
    caps = [8, 12, 16, 32, 48]
    replayed = lru_replay.lru_hits(ids, n_expert, caps)[:, 0] / (len(ids) * k)
    for c, r in zip(caps, replayed):
        est = rs.che_lru_hit_rate(counts, k, c)
        if k < c <= 2 * k:
            # Che's model takes a token's k requests as simultaneous; the replay makes a token's misses more recent
            # than its hits (the runtime's order), which costs a cache barely larger than one token's set a few points
            assert r < est < r + 0.04, (c, est, r)
        else:
            assert est == pytest.approx(r, abs=0.015), (c, est, r)
        assert est > c / n_expert + 0.05          # skewed popularity must beat c/E
    # exact where the cache holds one token's set: E|S_t & S_t-1| / k = k sum p_i^2
    p = counts / counts.sum()
    assert rs.che_lru_hit_rate(counts, k, k) == pytest.approx(k * np.sum(p ** 2), rel=1e-6)


def test_mi_null_is_small_and_planted_dependence_is_found():
    rng = np.random.default_rng(8)
    n, n_expert, k = 4000, 16, 2
    a = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n)])
    b = (a + 3) % n_expert                        # layer 1 is a function of layer 0, slot by slot
    ids = np.stack([a, b], axis=1).astype(np.uint8)
    mi, null = rs.mi_share_with_null(ids, 0, 1, n_expert)
    assert mi == pytest.approx(1.0, abs=1e-9)
    assert null < 0.02
    c = np.stack([a, np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n)])], axis=1).astype(np.uint8)
    mi, null = rs.mi_share_with_null(c, 0, 1, n_expert)
    assert mi < 0.03 and abs(mi - null) < 0.01


def test_domain_js_separates_planted_domains_from_null():
    rng = np.random.default_rng(9)
    n_expert, k = 16, 2
    # domain 0 uses experts 0..7, domain 1 experts 8..15: JS = 1 bit
    first = np.stack([rng.choice(8, k, replace=False) for _ in range(640)])
    second = 8 + np.stack([rng.choice(8, k, replace=False) for _ in range(640)])
    ids = np.concatenate([first, second])[:, None, :].astype(np.uint8)
    js, null = rs.domain_js_with_null(ids, {"a": [(0, 640)], "b": [(640, 1280)]}, n_expert)
    assert js[0] == pytest.approx(1.0, abs=1e-9)
    assert null[0] < 0.7


def test_popularity_summary_and_depth_matching():
    h, top, dead, eighth = rs.popularity_summary(np.array([10, 10, 10, 10, 0, 0, 0, 0, 0, 0]))
    assert h == pytest.approx(np.log(4) / np.log(10))
    assert top == pytest.approx(0.25) and dead == pytest.approx(0.6)
    assert eighth == pytest.approx(0.25)  # 10 // 8 = 1 expert of the 10
    _, _, _, eighth = rs.popularity_summary(np.array([4, 3, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]))
    assert eighth == pytest.approx(7 / 22)  # the two most popular of 16
    assert [rs.depth_matched(x, 16, 48) for x in (0, 7, 15)] == [0, 22, 47]
    assert [rs.depth_matched(x, 32, 12) for x in (0, 7, 15)] == [0, 2, 5]
