# Routing statistics of our traces (popularity, temporal reuse, cross-layer co-occurrence, per-layer LRU hit rates),
# the same statistics of OLMoE and Mixtral from ../shared/realdata/moe-routing-stats, pictures and the report.
"""Routing statistics and report.

Usage: python3 tools/data/routing_stats.py [--traces traces] [--json docs/data/routing-stats.json]
           [--img docs/img] [--report docs/routing-report.md]

Reads every traces/*.pstrace, writes the numbers to --json (tools/data/lru_replay.py --check replays the LRU part),
PNG pictures to --img and the markdown report to --report. Definitions (also printed in the report):
- popularity: share of all top-k assignments of a layer that go to each expert; summarised by the normalised
  entropy H/log(E) (1 = uniform) and the share taken by the most popular 10% of experts (uniform: 10%).
- domain specialisation: mean Jensen-Shannon divergence (bits) between the popularity vectors of the five OLMoE text
  domains (arxiv, book, c4, github, wikipedia) at a layer.
- temporal reuse: mean |S_t ∩ S_(t-1)| / k over consecutive tokens of a sequence; random routing gives k/E.
- cross-layer co-occurrence: slot-zipped pairs (slot j at layer a with slot j at layer b), as the OLMoE analysis
  script counts them; summarised by I(A;B)/H(B), the share of layer b's choice explained by layer a's.
- co-occurrence predictor recall: predict S at layer l+1 as the k experts with the highest summed co-occurrence
  with S at layer l (counts from the same trace, so in-sample); random gives k/E.
- LRU: tools/data/lru_replay.py (per-layer cache, hits against the state after the previous token).
- dead experts: share of a layer's experts that no token of the trace chose.
- null baselines (finite-sample bias): I/H with layer b's tokens shuffled; domain JS with the domain labels of
  64-token blocks shuffled (blocks keep the tokens' local correlation). Both average several seeded shuffles.
- depth matching: a real model's layer l of L is compared with our layer round(l * (L_ours - 1) / (L - 1)).
- popularity-only LRU (Che's approximation, in discrete time): the hit rate a per-layer LRU cache would have if
  tokens chose experts independently with the measured per-layer popularity (no temporal locality). A token requests
  expert i with probability q_i = k p_i; the characteristic time T (in tokens) solves
  sum_i (1 - (1 - q_i)^T) = c and the hit rate is sum_i p_i (1 - (1 - q_i)^T). (Che, Tung, Wang, IEEE JSAC 20(7),
  2002, with tokens as time steps so that each token's k distinct requests arrive together; exact at c = k, where it
  is k sum_i p_i^2.) Checked against our traces replayed in shuffled token order, which keeps popularity and removes
  locality, and against replayed synthetic traces in tests/py/test_routing_stats.py.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lru_replay  # noqa: E402
import pstrace  # noqa: E402

OLMOE_DOMAINS = {"arxiv": "arxiv", "b3g": "book", "c4": "c4", "github_oss_with_stack": "github",
                 "wikipedia": "wikipedia"}
# folder in realdata/moe-routing-stats and num_hidden_layers from the model's HF config.json (top-k is read from the
# counts: all-slot assignments / top-1 assignments)
REAL_MODELS = {"OLMoE-1B-7B": ("olmoe-1b-7b-0924", 16), "Mixtral-8x7B": ("mixtral-8x7b-v0.1", 32)}
REAL_LAYERS = (0, 7, 15)
NULL_SHUFFLES = 8
# Realism targets of issue 9, per layer: (statistic, label, lowest, highest); None = unbounded.
REALISM_TARGETS = (("norm_entropy", "normalised load entropy", 0.95, None),
                   ("top_eighth_share", "share of accesses to the top 1/8 of experts", None, 0.25),
                   ("temporal_reuse", "previous-token reuse of the top-k set", 0.30, 0.50),
                   ("lru_half", "LRU hit rate, half of a layer's experts cached", 0.55, 0.80))
# The real Mixtral-8x7B-Instruct trace of ../shared/design/reference-numbers.md (kept outside the repository; per-layer
# medians as reported there): the only real routing with token order we have figures for.
REAL_TRACE_MIXTRAL = {"top_eighth_share": 0.17, "temporal_reuse": 0.38, "lru_half": 0.62, "belady_half": 0.75}
DOMAIN_BLOCK = 64


# ---------------------------------------------------------------- metrics


def popularity_counts(ids, n_expert):
    """Assignments per layer and expert: int64 [L, E] over all top-k slots."""
    n, n_layer, k = ids.shape
    out = np.zeros((n_layer, n_expert), dtype=np.int64)
    for layer in range(n_layer):
        out[layer] = np.bincount(ids[:, layer].reshape(-1).astype(np.int64), minlength=n_expert)
    return out


def top_share_experts(n_expert):
    """Number of experts in the "most popular 10%" (at least one; 1 of 8 for Mixtral, so uniform is 0.125)."""
    return max(1, int(round(0.1 * n_expert)))


def popularity_summary(counts):
    """(normalised entropy, share of the top 10% experts, share of experts never chosen, share of the top 1/8 of
    experts) of one layer's counts."""
    c = np.asarray(counts, dtype=np.float64)
    p = c / c.sum()
    nz = p[p > 0]
    h = float(-(nz * np.log(nz)).sum() / math.log(len(p)))
    top = np.sort(p)[::-1]
    return (h, float(top[:top_share_experts(len(p))].sum()), float(np.mean(c == 0)),
            float(top[:max(1, len(p) // 8)].sum()))


def depth_matched(layer, n_layer_real, n_layer_ours):
    """Our layer at the same relative depth as `layer` of a model with n_layer_real layers."""
    return int(round(layer * (n_layer_ours - 1) / (n_layer_real - 1)))


def che_lru_hit_rate(counts, top_k, capacity):
    """Popularity-only LRU hit rate by Che's approximation in discrete time (module docstring) for one layer's
    assignment counts [E] (any scale) of a top-k router; capacity in experts."""
    c = np.asarray(counts, dtype=np.float64)
    p = c[c > 0] / c.sum()
    if capacity >= len(p):
        return 1.0
    log_miss = np.log1p(-np.minimum(top_k * p, 1 - 1e-12))   # log(1 - q_i)

    def distinct(t):
        return float(np.sum(1 - np.exp(log_miss * t)))
    lo, hi = 0.0, 1.0
    while distinct(hi) < capacity:
        hi *= 2
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if distinct(mid) < capacity else (lo, mid)
    return float(np.sum(p * (1 - np.exp(log_miss * hi))))


def js_divergence(p, q):
    """Jensen-Shannon divergence in bits between two count/probability vectors."""
    p = np.asarray(p, np.float64) / np.sum(p)
    q = np.asarray(q, np.float64) / np.sum(q)
    m = 0.5 * (p + q)

    def kl(a):
        mask = a > 0
        return float((a[mask] * np.log2(a[mask] / m[mask])).sum())
    return 0.5 * kl(p) + 0.5 * kl(q)


def mean_pairwise_js(vectors):
    """Mean JS divergence over all pairs of vectors."""
    vs = list(vectors)
    d = [js_divergence(vs[i], vs[j]) for i in range(len(vs)) for j in range(i + 1, len(vs))]
    return float(np.mean(d)) if d else float("nan")


def temporal_reuse(ids, bounds):
    """Per layer: mean share of a token's experts also used by the previous token of the same sequence."""
    n, n_layer, k = ids.shape
    first = np.zeros(n, dtype=bool)
    for a, _ in bounds:
        if a < n:
            first[a] = True
    cur, prev = ids[1:], ids[:-1]
    valid = ~first[1:]
    overlap = (cur[:, :, :, None] == prev[:, :, None, :]).any(axis=3).sum(axis=2) / k  # [n-1, L]
    return overlap[valid].mean(axis=0)


def mutual_info_share(joint):
    """I(A;B) / H(B) from a joint count matrix [Ea, Eb] (0 when B is constant)."""
    j = np.asarray(joint, dtype=np.float64)
    p = j / j.sum()
    pa, pb = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    mask = p > 0
    mi = float((p[mask] * np.log(p[mask] / (pa @ pb)[mask])).sum())
    pbv = pb[pb > 0]
    hb = float(-(pbv * np.log(pbv)).sum())
    return mi / hb if hb > 0 else 0.0


def slot_zipped_joint(ids, la, lb, n_expert, perm=None):
    """Counts of (expert at slot j of layer la, expert at slot j of layer lb) over tokens and slots [E, E].
    perm: optional token permutation applied to layer lb (the independence null)."""
    a = ids[:, la].reshape(-1).astype(np.int64)
    b = (ids[:, lb] if perm is None else ids[perm, lb]).reshape(-1).astype(np.int64)
    return np.bincount(a * n_expert + b, minlength=n_expert * n_expert).reshape(n_expert, n_expert)


def mi_share_with_null(ids, la, lb, n_expert, seed=0):
    """(I/H of the slot-zipped pair, mean I/H over NULL_SHUFFLES token shuffles of layer lb)."""
    rng = np.random.default_rng(seed)
    null = [mutual_info_share(slot_zipped_joint(ids, la, lb, n_expert, rng.permutation(len(ids))))
            for _ in range(NULL_SHUFFLES)]
    return mutual_info_share(slot_zipped_joint(ids, la, lb, n_expert)), float(np.mean(null))


def domain_js_with_null(ids, dom_rows, n_expert, seed=0):
    """Per layer: (mean pairwise domain JS, its block-shuffle null) from {domain: [(first, end) token ranges]}."""
    n_layer = ids.shape[1]
    blocks, labels = [], []
    for di, rows in enumerate(dom_rows.values()):
        for a, b in rows:
            for s in range(a, b, DOMAIN_BLOCK):
                blocks.append((s, min(b, s + DOMAIN_BLOCK)))
                labels.append(di)
    labels = np.asarray(labels)
    n_dom = len(dom_rows)
    # per block and layer, the expert counts: [blocks, L, E]
    bc = np.zeros((len(blocks), n_layer, n_expert), dtype=np.int64)
    for bi, (a, b) in enumerate(blocks):
        x = ids[a:b].astype(np.int64)                         # [n, L, k]
        flat = (np.arange(n_layer)[None, :, None] * n_expert + x).reshape(-1)
        bc[bi] = np.bincount(flat, minlength=n_layer * n_expert).reshape(n_layer, n_expert)

    def js_per_layer(lab):
        vecs = np.stack([bc[lab == d].sum(axis=0) for d in range(n_dom)])   # [D, L, E]
        return [mean_pairwise_js(vecs[:, layer]) for layer in range(n_layer)]
    rng = np.random.default_rng(seed)
    null = np.mean([js_per_layer(rng.permutation(labels)) for _ in range(NULL_SHUFFLES)], axis=0)
    return js_per_layer(labels), null.tolist()


def cooccurrence_recall(ids, n_expert):
    """Per adjacent layer pair (l, l+1): in-sample recall@k of the summed-co-occurrence predictor."""
    n, n_layer, k = ids.shape
    out = []
    rows = np.arange(n)[:, None]
    for layer in range(n_layer - 1):
        a = np.zeros((n, n_expert), dtype=np.float32)
        b = np.zeros((n, n_expert), dtype=np.float32)
        a[rows, ids[:, layer]] = 1
        b[rows, ids[:, layer + 1]] = 1
        scores = a @ (a.T @ b)
        pred = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        out.append(float(b[rows, pred].sum() / (n * k)))
    return out


def real_model_stats(path, n_layer):
    """The same summaries for a realdata routing_stats.json (OLMoE or Mixtral): per layer 0/7/15 popularity over all
    domains, the domain JS divergence and popularity-only LRU hit rates; slot-zipped I/H for pairs (0,7), (7,15);
    and matrices for pictures."""
    d = json.loads(Path(path).read_text())
    n_expert = 1 + max(int(e) for dom in d["domains"] for layer in d["expert_counts"][dom] for e in layer)
    n_assign = sum(sum(d["expert_counts"][dom][0].values()) for dom in d["domains"])
    n_tokens = sum(sum(d["expert_counts_top1"][dom][0].values()) for dom in d["domains"])
    top_k = int(round(n_assign / n_tokens))
    per_layer = {}
    for li, layer in enumerate(d["layers_in_expert_counts"]):
        dom_vecs = []
        for dom in d["domains"]:
            v = np.zeros(n_expert)
            for e, c in d["expert_counts"][dom][li].items():
                v[int(e)] = c
            dom_vecs.append(v)
        total = np.sum(dom_vecs, axis=0)
        h, top10, dead, top8th = popularity_summary(total)
        per_layer[layer] = {"norm_entropy": h, "top10_share": top10, "dead_share": dead, "top_eighth_share": top8th,
                            "domain_js_bits": mean_pairwise_js(dom_vecs),
                            "che_lru": {str(c): che_lru_hit_rate(total, top_k, c)
                                        for c in lru_replay.default_capacities(n_expert, top_k)},
                            "counts": total.tolist()}
    pairs = {}
    for pi, (la, lb) in enumerate(d["crosslayer_pairs"]):
        joint = np.zeros((n_expert, n_expert))
        for dom in d["domains"]:
            for a, b, c in d["expert_counts_crosslayer"][dom][pi]:
                joint[a, b] += c
        pairs[f"{la}-{lb}"] = {"mi_share": mutual_info_share(joint), "joint": joint.tolist()}
    return {"n_expert": n_expert, "n_layer": n_layer, "top_k": top_k, "n_tokens": n_tokens, "layers": per_layer,
            "pairs": pairs, "source": d.get("source", "")}


def olmoe_domain_rows(trace):
    """{domain: [(first, end)]} of the test-split sequences taken from the OLMoE analysis texts."""
    dom_rows = {}
    for s, (a, b) in zip(trace.sequences, trace.sequence_bounds()):
        parts = s["name"].split("/")
        if parts[0] == "olmoe-text" and len(parts) > 1 and parts[1].replace("_texts", "") in OLMOE_DOMAINS:
            dom_rows.setdefault(OLMOE_DOMAINS[parts[1].replace("_texts", "")], []).append((a, b))
    return dom_rows


def compared_pairs(n_layer):
    """Layer pairs whose I/H is reported: (0, 7), (7, 15) as in the OLMoE analysis, and the same pairs at matched
    relative depth for each real model."""
    pairs = {(0, min(7, n_layer - 1)), (min(7, n_layer - 1), min(15, n_layer - 1))}
    for _, n_real in REAL_MODELS.values():
        m = [depth_matched(layer, n_real, n_layer) for layer in REAL_LAYERS]
        pairs |= {(m[0], m[1]), (m[1], m[2])}
    return sorted(pairs)


def trace_stats(trace, seed=0):
    """All statistics of one Trace (JSON-ready)."""
    ids = trace.expert_ids
    n, n_layer, k = ids.shape
    e = trace.n_expert
    counts = popularity_counts(ids, e)
    summ = [popularity_summary(c) for c in counts]
    reuse = temporal_reuse(ids, trace.sequence_bounds())
    caps = lru_replay.default_capacities(e, k)
    lru = lru_replay.hit_rates(trace, caps)
    belady = lru_replay.hit_rates(trace, caps, "belady")
    perm = np.random.default_rng(seed).permutation(n)
    shuffled = lru_replay.lru_hits(ids[perm], e, caps) / (n * k)
    che = {str(c): [che_lru_hit_rate(cnt, k, c) for cnt in counts] for c in caps}
    dom_rows = olmoe_domain_rows(trace)
    domain_js = domain_js_null = None
    if len(dom_rows) >= 2:
        domain_js, domain_js_null = domain_js_with_null(ids, dom_rows, e, seed)
    pairs = {}
    for a, b in compared_pairs(n_layer):
        mi, null = mi_share_with_null(ids, a, b, e, seed)
        pairs[f"{a}-{b}"] = {"mi_share": mi, "mi_share_null": null}
    adjacent = [mi_share_with_null(ids, layer, layer + 1, e, seed) for layer in range(n_layer - 1)]
    srcs = {}
    for s in trace.sequences:
        srcs[s["source"]] = srcs.get(s["source"], 0) + int(s["n_tokens"])
    return {
        "model": trace.header["model"], "n_tokens": int(n), "n_layer": n_layer, "n_expert": e, "top_k": k,
        "tokens_by_source": srcs,
        "popularity": {"counts": counts.tolist(), "norm_entropy": [x[0] for x in summ],
                       "top10_share": [x[1] for x in summ], "dead_share": [x[2] for x in summ],
                       "top_eighth_share": [x[3] for x in summ]},
        "domain_js_bits": domain_js, "domain_js_null_bits": domain_js_null,
        "domain_tokens": {d: int(sum(b - a for a, b in r)) for d, r in dom_rows.items()},
        "temporal_reuse": reuse.tolist(), "temporal_reuse_random": k / e,
        "pairs": pairs, "adjacent_mi_share": [x[0] for x in adjacent],
        "adjacent_mi_share_null": [x[1] for x in adjacent],
        "cooccurrence_recall": cooccurrence_recall(ids, e),
        "lru": {str(c): v for c, v in lru.items()},
        "belady": {str(c): v for c, v in belady.items()},
        "lru_shuffled": {str(c): {"per_layer": row.tolist(), "mean": float(row.mean())}
                         for c, row in zip(caps, shuffled)},
        "che_lru": {c: {"per_layer": v, "mean": float(np.mean(v))} for c, v in che.items()},
    }


# ---------------------------------------------------------------- pictures

# What each model's routing stands for in benchmarks (issue 9): the balanced models are the headline; the first topo
# (transformers' pooled balancing loss, decision 0090) and demo are kept only as labelled skewed cases; topo-v2lite
# is issue 12's DeepSeek-V2-Lite topology (decision 0135).
ROUTING_KIND = {"topo-b": "balanced (headline)", "topo-mixtral": "balanced (headline)",
                "topo-v2lite": "balanced (DeepSeek-V2-Lite topology)",
                "topo": "skewed (first topo, pooled loss)", "demo": "skewed (demo)"}

DPI = 80   # keeps every PNG well under 200 KB (decision 0002: repository size)


def _stem(name):
    return Path(name).stem


def plot_all(stats, real, img_dir, traces):
    """Writes the report's PNGs; returns {name: file name relative to img_dir}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    img_dir.mkdir(parents=True, exist_ok=True)
    files = {}

    def save(fig, key, fn):
        fig.tight_layout()
        fig.savefig(img_dir / fn, dpi=DPI)
        plt.close(fig)
        files[key] = fn

    for name, st in stats.items():
        c = np.asarray(st["popularity"]["counts"], dtype=np.float64)
        rel = np.log2(np.maximum(c / (c.sum(axis=1, keepdims=True) / st["n_expert"]), 1 / 16))
        rel[c == 0] = -99                                     # drawn in the colormap's "under" colour
        cmap = plt.get_cmap("RdBu_r").copy()
        cmap.set_under("black")
        fig, ax = plt.subplots(figsize=(10, 0.12 * st["n_layer"] + 2.0))
        im = ax.imshow(rel, aspect="auto", cmap=cmap, vmin=-4, vmax=4, interpolation="nearest")
        ax.set_xlabel("expert id")
        ax.set_ylabel("layer")
        dead = float(np.mean(c == 0))
        ax.set_title(f"{_stem(name)}: expert load / uniform load (log2), {st['n_tokens']} tokens; "
                     f"black = never chosen ({dead:.0%} of expert slots)", fontsize=10)
        fig.colorbar(im, ax=ax, label="log2(load / uniform)", extend="min")
        save(fig, f"popularity:{name}", f"routing-popularity-{_stem(name)}.png")

    # sorted popularity at layers 0/7/15 of OLMoE and Mixtral and at OLMoE-matched depths of ours
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [(rname, [(f"L{layer}", r["layers"][layer]["counts"]) for layer in REAL_LAYERS])
              for rname, r in real.items()]
    n_olmoe = REAL_MODELS["OLMoE-1B-7B"][1]
    for name, st in stats.items():
        layers = [depth_matched(layer, n_olmoe, st["n_layer"]) for layer in REAL_LAYERS]
        series.append((_stem(name), [(f"L{layer}", st["popularity"]["counts"][layer]) for layer in layers]))
    for i, (label, curves) in enumerate(series):
        for style, (lname, counts) in zip(styles, curves):
            p = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
            ax.plot(np.linspace(0, 1, len(p)), np.maximum(p / p.sum() * len(p), 1e-3), ls=style,
                    color=colors[i % len(colors)], lw=1.4, label=f"{label} {lname}")
    ax.set_yscale("log")
    ax.set_ylim(8e-4, 20)
    ax.set_xlabel("expert rank / E (most popular first)")
    ax.set_ylabel("load / uniform load (floor 1e-3 = never chosen)")
    ax.set_title("sorted expert popularity: first / middle / last layer (ours at OLMoE's relative depths)",
                 fontsize=10)
    ax.legend(fontsize=6.5, ncol=3, loc="lower left")
    save(fig, "sorted", "routing-popularity-sorted.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for i, (name, st) in enumerate(stats.items()):
        col = colors[(i + len(real)) % len(colors)]
        x = np.arange(st["n_layer"]) / max(1, st["n_layer"] - 1)
        axes[0].plot(x, st["temporal_reuse"], color=col,
                     label=f"{_stem(name)} (random k/E = {st['temporal_reuse_random']:.3f}, dotted)")
        axes[0].axhline(st["temporal_reuse_random"], ls=":", lw=0.8, color=col)
        axes[1].plot(x[:-1], st["adjacent_mi_share"], color=col, label=f"{_stem(name)} (dotted: shuffled null)")
        axes[1].plot(x[:-1], st["adjacent_mi_share_null"], ls=":", lw=0.8, color=col)
    axes[0].set_title("temporal reuse: share of token t's experts also used by token t-1", fontsize=10)
    axes[1].set_title("adjacent layers: I(layer l; layer l+1) / H(layer l+1), slot-zipped", fontsize=10)
    for ax in axes:
        ax.set_xlabel("relative depth (layer / (L-1))")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    save(fig, "reuse", "routing-reuse.png")

    cols = 2
    rows = (len(stats) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.6 * rows), squeeze=False)
    for ax, (name, st) in zip(axes.flat, stats.items()):
        x = np.arange(st["n_layer"])
        for i, (c, v) in enumerate(st["lru"].items()):
            ax.plot(x, v["per_layer"], color=colors[i], label=f"{c} experts ({int(c) / st['n_expert']:.1%})")
            ax.axhline(int(c) / st["n_expert"], ls=":", lw=0.8, color=colors[i])
        ax.set_title(f"{_stem(name)}: per-layer LRU hit rate (dotted: random c/E)", fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(stats):]:
        ax.axis("off")
    save(fig, "lru", "routing-lru.png")

    # mean LRU hit rate against cache size: ours replayed, ours shuffled, popularity-only for all
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, label="random routing (c/E)")
    for i, (rname, r) in enumerate(real.items()):
        caps = sorted(int(c) for c in r["layers"][REAL_LAYERS[0]]["che_lru"])
        y = [np.mean([r["layers"][layer]["che_lru"][str(c)] for layer in REAL_LAYERS]) for c in caps]
        ax.plot(np.array(caps) / r["n_expert"], y, ":o", color=colors[i], ms=4,
                label=f"{rname}: popularity only (layers 0/7/15)")
    for i, (name, st) in enumerate(stats.items()):
        if "prompts" in name:
            continue
        col = colors[(i + len(real)) % len(colors)]
        caps = sorted(int(c) for c in st["lru"])
        f = np.array(caps) / st["n_expert"]
        ax.plot(f, [st["lru"][str(c)]["mean"] for c in caps], "-o", color=col, ms=4,
                label=f"{_stem(name)}: replayed in order")
        ax.plot(f, [st["lru_shuffled"][str(c)]["mean"] for c in caps], "--s", color=col, ms=3,
                label=f"{_stem(name)}: tokens shuffled")
        ax.plot(f, [st["che_lru"][str(c)]["mean"] for c in caps], ":o", color=col, ms=3,
                label=f"{_stem(name)}: popularity only (Che)")
    ax.set_xlabel("cache size c / E (per layer)")
    ax.set_ylabel("mean hit rate")
    ax.set_xlim(0, 0.8)
    ax.set_ylim(0, 1.02)
    ax.set_title("per-layer LRU: ours against the popularity-only estimate for OLMoE and Mixtral", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    save(fig, "lru_vs_real", "routing-lru-vs-real.png")

    # co-occurrence (layer 0 -> 7, slot-zipped), conditional P(b | a), ours next to OLMoE and Mixtral
    panels = []
    for name, t in traces.items():
        b = min(7, t.n_layer - 1)
        panels.append((f"{_stem(name)} 0->{b}", slot_zipped_joint(t.expert_ids, 0, b, t.n_expert)))
    for rname, r in real.items():
        panels.append((f"{rname} 0->7", np.asarray(r["pairs"]["0-7"]["joint"])))
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.8 * rows), squeeze=False)
    for ax, (title, joint) in zip(axes.flat, panels):
        cond = joint / np.maximum(joint.sum(axis=1, keepdims=True), 1)
        im = ax.imshow(cond, aspect="auto", cmap="viridis", interpolation="nearest",
                       vmax=max(np.quantile(cond, 0.995), 1e-9))
        ax.set_title(f"{title}: P(later = b | earlier = a)", fontsize=9)
        ax.set_xlabel("expert b at the later layer")
        ax.set_ylabel("expert a at layer 0")
        fig.colorbar(im, ax=ax, fraction=0.046)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    save(fig, "cooccurrence", "routing-cooccurrence.png")
    return files


# ---------------------------------------------------------------- report

HAND_MARKER = "<!-- Everything below this line is written by hand; tools/data/routing_stats.py keeps it. -->"


def _f(x, nd=3):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _slash(xs, nd=3):
    return "/".join(_f(x, nd) for x in xs)


def comparison_table(rname, r, stats):
    """Markdown rows comparing one real model with each trace at matched relative depth."""
    n_real = r["n_layer"]
    names = list(stats)
    matched = {n: [depth_matched(layer, n_real, stats[n]["n_layer"]) for layer in REAL_LAYERS] for n in names}
    L = [f"| statistic | {rname} (E={r['n_expert']}, k={r['top_k']}) | "
         + " | ".join(f"{_stem(n)} (E={stats[n]['n_expert']}, k={stats[n]['top_k']})" for n in names) + " |",
         "|---|---|" + "---|" * len(names)]
    L.append("| layers compared | " + "/".join(str(x) for x in REAL_LAYERS) + " | "
             + " | ".join("/".join(str(x) for x in matched[n]) for n in names) + " |")

    def row(label, theirs, ours):
        L.append(f"| {label} | {theirs} | " + " | ".join(ours) + " |")
    row("normalised entropy", _slash([r["layers"][x]["norm_entropy"] for x in REAL_LAYERS]),
        [_slash([stats[n]["popularity"]["norm_entropy"][x] for x in matched[n]]) for n in names])
    row("top-10% share (uniform)",
        _slash([r["layers"][x]["top10_share"] for x in REAL_LAYERS])
        + f" ({top_share_experts(r['n_expert']) / r['n_expert']:.3f})",
        [_slash([stats[n]["popularity"]["top10_share"][x] for x in matched[n]])
         + f" ({top_share_experts(stats[n]['n_expert']) / stats[n]['n_expert']:.3f})" for n in names])
    row("experts never chosen", _slash([r["layers"][x]["dead_share"] for x in REAL_LAYERS]),
        [_slash([stats[n]["popularity"]["dead_share"][x] for x in matched[n]]) for n in names])
    row("domain JS, bits (shuffled null)", _slash([r["layers"][x]["domain_js_bits"] for x in REAL_LAYERS])
        + " (about 0)",
        [(_slash([stats[n]["domain_js_bits"][x] for x in matched[n]]) + " ("
          + _slash([stats[n]["domain_js_null_bits"][x] for x in matched[n]]) + ")")
         if stats[n]["domain_js_bits"] else "n/a" for n in names])
    pr = list(r["pairs"])

    def ours_pairs(n):
        m = matched[n]
        ps = [stats[n]["pairs"][f"{m[0]}-{m[1]}"], stats[n]["pairs"][f"{m[1]}-{m[2]}"]]
        return _slash([p["mi_share"] for p in ps]) + " (" + _slash([p["mi_share_null"] for p in ps]) + ")"
    row(f"cross-layer I/H, pairs {' / '.join(pr)} (shuffled null)",
        _slash([r["pairs"][p]["mi_share"] for p in pr]) + " (about 0)", [ours_pairs(n) for n in names])
    for c_real in sorted(int(c) for c in r["layers"][REAL_LAYERS[0]]["che_lru"]):
        frac = c_real / r["n_expert"]
        if frac > 0.5:
            continue
        theirs = float(np.mean([r["layers"][x]["che_lru"][str(c_real)] for x in REAL_LAYERS]))
        ours = []
        for n in names:
            st = stats[n]
            c = str(int(round(frac * st["n_expert"])))
            if c not in st["lru"]:
                ours.append("n/a")
                continue
            ours.append(f"{np.mean([st['che_lru'][c]['per_layer'][x] for x in matched[n]]):.3f} "
                        f"(replayed: {np.mean([st['lru'][c]['per_layer'][x] for x in matched[n]]):.3f})")
        row(f"LRU hit rate at c/E = {frac:.3f}: popularity only (ours replayed in order)", f"{theirs:.3f}", ours)
    return L


def realism_values(st):
    """Per-layer values of the REALISM_TARGETS statistics (and Belady at half) of one trace's stats."""
    half = str(st["n_expert"] // 2)
    return {"norm_entropy": st["popularity"]["norm_entropy"], "top_eighth_share": st["popularity"]["top_eighth_share"],
            "temporal_reuse": st["temporal_reuse"], "lru_half": st["lru"][half]["per_layer"],
            "belady_half": st["belady"][half]["per_layer"]}


def realism_stats(ids, bounds, n_expert):
    """The REALISM_TARGETS statistics (and Belady at half) of routing ids uint8 [N, L, k] with sequence bounds
    [(first, end)]: {"per_layer": {stat: [L floats]}, "median": {stat: float}, "layers_meeting": {stat: int}}."""
    n, _, k = ids.shape
    summ = [popularity_summary(c) for c in popularity_counts(ids, n_expert)]
    half = n_expert // 2
    per_layer = {"norm_entropy": [x[0] for x in summ], "top_eighth_share": [x[3] for x in summ],
                 "temporal_reuse": temporal_reuse(ids, bounds).tolist(),
                 "lru_half": (lru_replay.lru_hits(ids, n_expert, [half])[0] / (n * k)).tolist(),
                 "belady_half": (lru_replay.belady_hits(ids, n_expert, [half])[0] / (n * k)).tolist()}
    meeting = {}
    for key, _, lo, hi in REALISM_TARGETS:
        v = np.asarray(per_layer[key])
        meeting[key] = int(((v >= (lo if lo is not None else -np.inf)) & (v <= (hi if hi is not None else np.inf))).sum())
    return {"per_layer": per_layer, "median": {key: float(np.median(v)) for key, v in per_layer.items()},
            "layers_meeting": meeting}


def realism_table(stats, real):
    """Markdown rows: per trace, the median (min-max) over layers of each realism statistic and how many layers meet
    its target, next to the real models' figures."""
    names = list(stats)
    vals = {n: realism_values(stats[n]) for n in names}
    L = ["| statistic (target) | " + " | ".join(_stem(n) for n in names) + " | " + " | ".join(real)
         + " | real Mixtral trace |", "|---|" + "---|" * (len(names) + len(real) + 1)]
    rows = list(REALISM_TARGETS) + [("belady_half", "offline optimum (Belady), half of the experts cached", None,
                                     None)]
    for key, label, lo, hi in rows:
        target = ("" if lo is None and hi is None else
                  f" (>= {lo})" if hi is None else f" (<= {hi})" if lo is None else f" ({lo}-{hi})")
        cells = []
        for n in names:
            v = np.asarray(vals[n][key], dtype=np.float64)
            ok = np.ones(len(v), dtype=bool)
            if lo is not None:
                ok &= v >= lo
            if hi is not None:
                ok &= v <= hi
            meets = "" if lo is None and hi is None else f", {int(ok.sum())}/{len(v)} layers meet it"
            cells.append(f"{np.median(v):.3f} ({v.min():.3f}-{v.max():.3f}){meets}")
        for r in real.values():
            if key in ("norm_entropy", "top_eighth_share"):
                cells.append(_slash([r["layers"][x][key] for x in REAL_LAYERS]) + " (layers 0/7/15)")
            else:
                cells.append("n/a (no token order)")
        cells.append(_f(REAL_TRACE_MIXTRAL.get(key)) if key in REAL_TRACE_MIXTRAL else "n/a")
        L.append(f"| {label}{target} | " + " | ".join(cells) + " |")
    return L


def write_report(path, stats, real, files, img_rel, command):
    """docs/routing-report.md from the computed numbers; text below HAND_MARKER in an existing report is kept."""
    old = Path(path).read_text() if Path(path).exists() else ""
    hand = old[old.index(HAND_MARKER) + len(HAND_MARKER):] if HAND_MARKER in old else "\n\n(to be written)\n"
    L = []
    L.append("# Routing statistics of our trained MoE models, next to OLMoE and Mixtral\n")
    L.append(f"Generated by `{command}` from the traces in `traces/` (format: `docs/trace-format.md`); numbers in "
             "`docs/data/routing-stats.json`, definitions in the script's docstring. The LRU numbers are checked by "
             "`python3 tools/data/lru_replay.py traces/*.pstrace --check docs/data/routing-stats.json` (and by "
             "`tests/py/test_routing_report.py`). OLMoE-1B-7B-0924 and Mixtral-8x7B-v0.1 figures come from "
             "`../shared/realdata/moe-routing-stats/`: layers 0/7/15 only, 5 text domains of 208,896 tokens each, "
             "counts only (no token order, so no temporal reuse or replayed LRU for them).\n")
    L.append("## Traces\n")
    L.append("| trace | model | routing | tokens | layers | experts | top-k | tokens by source |")
    L.append("|---|---|---|---|---|---|---|---|")
    for name, st in stats.items():
        src = ", ".join(f"{k} {v}" for k, v in st["tokens_by_source"].items())
        L.append(f"| {name} | {st['model']} | {ROUTING_KIND.get(st['model'], 'unlabelled')} | {st['n_tokens']} | "
                 f"{st['n_layer']} | {st['n_expert']} | {st['top_k']} | {src} |")
    L.append("\n## Realism targets (issue 9)\n")
    L.append("Per trace: median over layers (min-max) and the number of layers that meet the target. OLMoE and "
             "Mixtral columns come from their aggregated counts; the last column is the real Mixtral-8x7B-Instruct "
             "trace of `../shared/design/reference-numbers.md` (per-layer medians; the trace is not in this "
             "repository). LRU and Belady replay the runtime's cache model (`tools/data/lru_replay.py`).\n")
    L.extend(realism_table(stats, real))
    L.append("\n## Side by side, at matched relative depth\n")
    L.append("Our layer compared with a real model's layer l of L is round(l (L_ours - 1) / (L - 1)). Values are "
             "per compared layer (a/b/c) or per layer pair. Nulls: the same statistic with token order or domain "
             "labels shuffled, i.e. what finite samples give with no structure at all; the real models' nulls are "
             "about 0 (over a million tokens). Popularity-only LRU: Che's approximation from the per-layer "
             "popularity alone (no temporal locality), the one cache figure the real models' counts allow.\n")
    for rname, r in real.items():
        L.append(f"### {rname} ({r['n_layer']} layers)\n")
        L.extend(comparison_table(rname, r, stats))
        L.append("")
    L.append("## Expert popularity\n")
    L.append("Heatmaps: load of each expert relative to uniform (log2), black where no token chose the expert.\n")
    for name in stats:
        key = f"popularity:{name}"
        if key in files:
            L.append(f"![popularity {name}]({img_rel}/{files[key]})\n")
    L.append("| trace | mean normalised entropy | mean top-10% share | mean share never chosen | "
             "layers with an expert never chosen |")
    L.append("|---|---|---|---|---|")
    for name, st in stats.items():
        pop = st["popularity"]
        L.append(f"| {name} | {_f(float(np.mean(pop['norm_entropy'])))} | {_f(float(np.mean(pop['top10_share'])))} "
                 f"| {_f(float(np.mean(pop['dead_share'])))} | {sum(1 for x in pop['dead_share'] if x > 0)} of "
                 f"{st['n_layer']} |")
    L.append(f"\n![sorted popularity]({img_rel}/{files['sorted']})\n")
    L.append("## Temporal reuse\n")
    L.append("Share of token t's experts that token t-1 (same sequence) also used, against random routing (k/E).\n")
    L.append("| trace | random k/E | mean over layers | first layer | middle layer | last layer |")
    L.append("|---|---|---|---|---|---|")
    for name, st in stats.items():
        r = st["temporal_reuse"]
        L.append(f"| {name} | {_f(st['temporal_reuse_random'])} | {_f(float(np.mean(r)))} | {_f(r[0])} | "
                 f"{_f(r[len(r) // 2])} | {_f(r[-1])} |")
    L.append(f"\n![temporal reuse]({img_rel}/{files['reuse']})\n")
    L.append("## Cross-layer co-occurrence\n")
    L.append("Slot-zipped pairs as the OLMoE analysis counts them; I/H = I(A;B)/H(B), the share of the later "
             "layer's expert choice explained by the earlier layer's (0 = independent). Co-occurrence recall: "
             "in-sample recall@k of predicting layer l+1's set from layer l's by summed co-occurrence.\n")
    L.append("| trace | adjacent-layer I/H, mean (shuffled null) | co-occurrence recall@k, mean | random k/E |")
    L.append("|---|---|---|---|")
    for name, st in stats.items():
        L.append(f"| {name} | {_f(float(np.mean(st['adjacent_mi_share'])))} "
                 f"({_f(float(np.mean(st['adjacent_mi_share_null'])))}) | "
                 f"{_f(float(np.mean(st['cooccurrence_recall'])))} | {_f(st['temporal_reuse_random'])} |")
    L.append(f"\n![co-occurrence]({img_rel}/{files['cooccurrence']})\n")
    L.append("## Per-layer LRU expert cache\n")
    L.append("Hit rate of a per-layer LRU cache of c experts, tokens replayed in file order (model in "
             "`tools/data/lru_replay.py`); random routing would give about c/E. Shuffled: the same trace with its "
             "tokens in a seeded random order (popularity kept, locality removed); popularity only: Che's "
             "approximation, which the shuffled replay checks.\n")
    L.append("| trace | cache (experts) | c/E | mean hit rate | min layer | max layer | shuffled | popularity only "
             "| offline optimum (Belady) |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for name, st in stats.items():
        for c, v in st["lru"].items():
            L.append(f"| {name} | {c} | {_f(int(c) / st['n_expert'])} | {_f(v['mean'])} | "
                     f"{_f(min(v['per_layer']))} | {_f(max(v['per_layer']))} | "
                     f"{_f(st['lru_shuffled'][c]['mean'])} | {_f(st['che_lru'][c]['mean'])} | "
                     f"{_f(st['belady'][c]['mean'])} |")
    L.append(f"\n![LRU]({img_rel}/{files['lru']})\n")
    L.append(f"![LRU against the real models]({img_rel}/{files['lru_vs_real']})\n")
    L.append(HAND_MARKER + hand.rstrip("\n") + "\n")
    Path(path).write_text("\n".join(L))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="traces", help="folder with *.pstrace files, or one file")
    ap.add_argument("--realdata", default=None, help="../shared/realdata (default: next to the repo)")
    ap.add_argument("--json", default="docs/data/routing-stats.json")
    ap.add_argument("--img", default="docs/img")
    ap.add_argument("--report", default="docs/routing-report.md")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[2]
    realdata = Path(args.realdata) if args.realdata else repo.parent / "shared" / "realdata"
    tp = Path(args.traces)
    paths = sorted(tp.glob("*.pstrace")) if tp.is_dir() else [tp]
    if not paths:
        sys.exit(f"routing_stats: no .pstrace files in {tp}")
    traces = {p.name: pstrace.read_trace(p) for p in paths}
    stats = {name: trace_stats(t) for name, t in traces.items()}
    real = {rname: real_model_stats(realdata / "moe-routing-stats" / d / "routing_stats.json", n_layer)
            for rname, (d, n_layer) in REAL_MODELS.items()}
    files = plot_all(stats, real, Path(args.img), traces)
    command = "python3 tools/data/routing_stats.py " + " ".join(sys.argv[1:])
    out = {"command": command.strip(), "traces": stats,
           "real_models": {rname: {**{k: r[k] for k in ("n_expert", "n_layer", "top_k", "n_tokens", "source")},
                                   "layers": {str(k): {kk: vv for kk, vv in v.items() if kk != "counts"}
                                              for k, v in r["layers"].items()},
                                   "pairs": {k: {"mi_share": v["mi_share"]} for k, v in r["pairs"].items()}}
                           for rname, r in real.items()}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out) + "\n")
    img_rel = os.path.relpath(Path(args.img).resolve(), Path(args.report).resolve().parent)
    write_report(args.report, stats, real, files, img_rel, command.strip())
    print(f"wrote {args.json}, {args.report} and {len(files)} pictures in {args.img}")


if __name__ == "__main__":
    main()
