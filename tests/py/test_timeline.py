# Tests (pytest) of bench/profile/timeline.py on a hand-written CUPTI CSV: the token windows between logits copies,
# busy and idle time, and the idle time attributed to the records on either side of each gap.
import csv
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "profile"))
import timeline  # noqa: E402


def _write(path: Path, tokens: int) -> None:
    """Each 3000 ns token: kernel A [0, 1000), kernel B [1500, 2000), the logits copy [2100, 2200); a routing copy
    overlapping A adds no busy time."""
    rows = [("kind", "start_ns", "end_ns", "stream", "bytes", "copy_kind", "name")]
    for t in range(0, 3000 * tokens, 3000):
        rows += [("K", t, t + 1000, 1, 0, 0, "kA"), ("C", t + 200, t + 300, 2, 64, 2, ""),
                 ("K", t + 1500, t + 2000, 1, 0, 0, "kB"), ("C", t + 2100, t + 2200, 1, 100000, 2, "")]
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_idle_time_is_split_by_the_records_around_each_gap(tmp_path):
    _write(tmp_path / "t.csv", 8)
    s = timeline.summarise(timeline.load(tmp_path / "t.csv"), None, 1)
    assert s["tokens"] == 6
    assert s["mean"]["span_us"] == pytest.approx(3.0)
    assert s["mean"]["busy_us"] == pytest.approx(1.6)  # A, B and the logits copy; the routing copy is inside A
    idle = {(g["before"], g["after"]): g["us_per_token"] for g in s["idle"]}
    assert idle == pytest.approx({("token start", "kA"): 0.8, ("kA", "kB"): 0.5, ("kB", "memcpy DtoH 100000 B"): 0.1})
    assert sum(idle.values()) == pytest.approx(s["mean"]["idle_us"])
    # Copies are listed beside the kernels (per direction and size); only kernels count as launches.
    us = {k["name"]: k["us_per_token"] for k in s["kernels"]}
    assert us == pytest.approx({"kA": 1.0, "kB": 0.5, "memcpy DtoH 64 B": 0.1, "memcpy DtoH 100000 B": 0.1})
    assert all(k["launches_per_token"] == pytest.approx(1) for k in s["kernels"])
    assert s["mean"]["launches"] == pytest.approx(2)
