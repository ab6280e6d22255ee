# The committed routing report against the committed traces: replaying traces/*.pstrace through the per-layer LRU
# model must give the hit rates in docs/data/routing-stats.json and the tables of docs/routing-report.md.
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STATS = REPO / "docs" / "data" / "routing-stats.json"
REPORT = REPO / "docs" / "routing-report.md"
TRACES = sorted((REPO / "traces").glob("*.pstrace"))


def replay_check(stats_path):
    """Runs the documented command `lru_replay.py traces/*.pstrace --check STATS`; returns (exit code, stdout)."""
    r = subprocess.run([sys.executable, str(REPO / "tools" / "data" / "lru_replay.py"), *map(str, TRACES),
                        "--check", str(stats_path)], capture_output=True, text=True, cwd=REPO, timeout=900)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def stats():
    return json.loads(STATS.read_text())


def test_every_trace_is_in_the_report(stats):
    assert TRACES, "no traces/*.pstrace"
    assert sorted(stats["traces"]) == sorted(p.name for p in TRACES)


def test_replay_reproduces_report_hit_rates():
    rc, out = replay_check(STATS)
    assert rc == 0, out
    assert out.count("check: matches") == len(TRACES), out


def test_replay_check_detects_a_changed_number(stats, tmp_path):
    # the check must be able to fail: move one layer's hit rate of one trace by 1e-6
    name = sorted(stats["traces"])[0]
    cap = sorted(stats["traces"][name]["lru"], key=int)[0]
    stats["traces"][name]["lru"][cap]["per_layer"][0] += 1e-6
    bad = tmp_path / "routing-stats.json"
    bad.write_text(json.dumps(stats))
    rc, out = replay_check(bad)
    assert rc == 1 and f"check FAILED (lru) at capacity {cap}" in out, out


def test_report_tables_show_the_json_numbers(stats):
    # rows of the LRU table: | trace | cache | c/E | mean | min | max | shuffled | popularity only |
    rows = {}
    for line in REPORT.read_text().splitlines():
        m = re.match(r"\| (\S+\.pstrace) \| (\d+) \| [0-9.]+ \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|", line)
        if m:
            rows[(m.group(1), m.group(2))] = [float(x) for x in m.group(3, 4, 5)]
    want = {(name, c): [v["mean"], min(v["per_layer"]), max(v["per_layer"])]
            for name, st in stats["traces"].items() for c, v in st["lru"].items()}
    assert rows.keys() == want.keys()
    for key, shown in rows.items():
        assert shown == pytest.approx(want[key], abs=5e-4), key
