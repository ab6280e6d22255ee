"""tools/data/fold_trace.py: experts e -> e % n_expert, top_k groups by summed gate weight (ties: lower id),
weights renormalised, leading layers kept; worked out by hand on a two-token trace."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "data"))
import fold_trace  # noqa: E402
import pstrace  # noqa: E402


def test_groups_sum_their_weights_and_the_top_k_groups_are_kept():
    # token 0, layer 0: experts 1, 5, 2 (weights .5 .3 .2) -> groups 1, 1, 2 (mod 4): group 1 = .8, group 2 = .2
    # token 1, layer 0: experts 0, 3, 7 (.4 .35 .25) -> groups 0, 3, 3: group 3 = .6, group 0 = .4
    ids = np.array([[[1, 5, 2], [0, 1, 2]], [[0, 3, 7], [4, 5, 6]]])
    w = np.array([[[.5, .3, .2], [.4, .4, .2]], [[.4, .35, .25], [.5, .3, .2]]], np.float32)
    out_ids, out_w = fold_trace.fold(ids, w, n_expert=4, top_k=2, n_layer=1)
    assert out_ids.shape == (2, 1, 2)
    assert out_ids[0, 0].tolist() == [1, 2]
    np.testing.assert_allclose(out_w[0, 0], [.8, .2], rtol=1e-6)
    assert out_ids[1, 0].tolist() == [3, 0]
    np.testing.assert_allclose(out_w[1, 0], [.6, .4], rtol=1e-6)


def test_a_token_with_fewer_groups_than_top_k_takes_unrouted_groups_last_at_weight_zero():
    ids = np.array([[[0, 4]]])  # both in group 0 of 4
    w = np.array([[[.7, .3]]], np.float32)
    out_ids, out_w = fold_trace.fold(ids, w, n_expert=4, top_k=2, n_layer=1)
    assert out_ids[0, 0, 0] == 0 and out_ids[0, 0, 1] != 0
    np.testing.assert_allclose(out_w[0, 0], [1.0, 0.0], atol=1e-6)


def test_bad_shapes_are_refused(tmp_path):
    ids = np.zeros((1, 2, 2), np.int64)
    with pytest.raises(ValueError, match="--n-layer 3"):
        fold_trace.fold(ids, np.ones((1, 2, 2)), n_expert=4, top_k=2, n_layer=3)
    with pytest.raises(ValueError, match="--top-k 3"):
        fold_trace.fold(ids, np.ones((1, 2, 2)), n_expert=4, top_k=3, n_layer=1)


def test_the_committed_demo_trace_folds_into_a_valid_trace(tmp_path):
    src = Path(__file__).resolve().parents[2] / "traces" / "demo-test.pstrace"
    dst = tmp_path / "folded.pstrace"
    fold_trace.main([str(src), str(dst), "--n-expert", "8", "--top-k", "2", "--n-layer", "6", "--zstd-level", "1"])
    t = pstrace.read_trace(dst)
    assert (t.n_layer, t.n_expert, t.top_k) == (6, 8, 2)
    assert t.expert_ids.max() < 8
    assert "folded" in t.header["created_by"]
    assert len(t.token_ids) == len(pstrace.read_trace(src).token_ids)
