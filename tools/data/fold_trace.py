#!/usr/bin/env python3
"""Folds a routing trace onto a model with fewer experts and layers (e.g. Qwen3-shaped topo routing onto the
Mixtral-8x7B shape: 128 -> 8 experts, top-8 -> top-2, 48 -> 32 layers), for the scheduler's simulator when no
trace of the target model is at hand. Per token and kept layer: expert e -> e % n_expert, the gate weights of
each group summed, the top_k groups by summed weight (ties: lower id), their weights renormalised. The result
keeps the source's token order and sequences; its routing statistics are the source's, folded, not a real
model's, and the header says so.

  .venv/bin/python3 tools/data/fold_trace.py traces/topo-test.pstrace /tmp/topo-mixtral.pstrace \\
      --n-expert 8 --top-k 2 --n-layer 32
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pstrace  # noqa: E402


def fold(expert_ids, gate_w, n_expert, top_k, n_layer):
    """expert_ids, gate_w: [N, L, K] -> (ids, weights) [N, n_layer, top_k] as the module docstring says."""
    n, layers, k = expert_ids.shape
    if n_layer > layers:
        raise ValueError(f"--n-layer {n_layer}: the source has {layers} layers")
    if top_k > n_expert or top_k > k:
        raise ValueError(f"--top-k {top_k}: at most n_expert {n_expert} and the source's top-{k}")
    ids = expert_ids[:, :n_layer, :].astype(np.int64) % n_expert
    w = gate_w[:, :n_layer, :].astype(np.float64)
    sums = np.zeros((n, n_layer, n_expert))
    np.add.at(sums, (np.arange(n)[:, None, None], np.arange(n_layer)[None, :, None], ids), w)
    # Groups the token never routed to must not be picked over routed ones: they rank below any positive sum.
    routed = np.zeros((n, n_layer, n_expert), bool)
    np.put_along_axis(routed, ids, True, axis=2)
    key = np.where(routed, sums, -1.0)
    order = np.argsort(-key, axis=2, kind="stable")[:, :, :top_k]  # stable: ties keep the lower id first
    top_w = np.take_along_axis(sums, order, axis=2)
    total = top_w.sum(axis=2, keepdims=True)
    top_w = np.where(total > 0, top_w / np.where(total > 0, total, 1), 1.0 / top_k)
    return order.astype(np.uint8), top_w.astype(np.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--n-expert", type=int, required=True)
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--n-layer", type=int, required=True)
    ap.add_argument("--zstd-level", type=int, default=12)
    a = ap.parse_args(argv)
    t = pstrace.read_trace(a.src)
    ids, w = fold(t.expert_ids, t.gate_weights(), a.n_expert, a.top_k, a.n_layer)
    h = t.header
    created = (f"{h['created_by']}; folded by tools/data/fold_trace.py from {Path(a.src).name}: experts e % "
               f"{a.n_expert}, top-{a.top_k} by summed gate weight, layers 0-{a.n_layer - 1}")
    pstrace.write_trace(a.dst, model=f"{h['model']} (folded to {a.n_layer}x{a.n_expert} top-{a.top_k})",
                        arch=h["arch"], n_expert=a.n_expert, sequences=t.sequences, token_ids=t.token_ids,
                        expert_ids=ids, gate_weights=w, created_by=created, level=a.zstd_level)
    print(f"{a.dst}: {len(t.token_ids)} tokens, {a.n_layer} layers, {a.n_expert} experts, top-{a.top_k}")


if __name__ == "__main__":
    main()
