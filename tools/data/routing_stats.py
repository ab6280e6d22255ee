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
REAL_MODELS = {"OLMoE-1B-7B": "olmoe-1b-7b-0924", "Mixtral-8x7B": "mixtral-8x7b-v0.1"}
REAL_LAYERS = (0, 7, 15)


# ---------------------------------------------------------------- metrics


def popularity_counts(ids, n_expert):
    """Assignments per layer and expert: int64 [L, E] over all top-k slots."""
    n, n_layer, k = ids.shape
    out = np.zeros((n_layer, n_expert), dtype=np.int64)
    for layer in range(n_layer):
        out[layer] = np.bincount(ids[:, layer].reshape(-1).astype(np.int64), minlength=n_expert)
    return out


def popularity_summary(counts):
    """(normalised entropy, share of the top 10% experts) of one layer's count vector."""
    c = np.asarray(counts, dtype=np.float64)
    p = c / c.sum()
    nz = p[p > 0]
    h = float(-(nz * np.log(nz)).sum() / math.log(len(p)))
    top = max(1, int(round(0.1 * len(p))))
    return h, float(np.sort(p)[::-1][:top].sum())


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


def slot_zipped_joint(ids, la, lb, n_expert):
    """Counts of (expert at slot j of layer la, expert at slot j of layer lb) over tokens and slots [E, E]."""
    a = ids[:, la].reshape(-1).astype(np.int64)
    b = ids[:, lb].reshape(-1).astype(np.int64)
    return np.bincount(a * n_expert + b, minlength=n_expert * n_expert).reshape(n_expert, n_expert)


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


def real_model_stats(path):
    """The same summaries for a realdata routing_stats.json (OLMoE or Mixtral): per layer 0/7/15 popularity over all
    domains and the domain JS divergence; slot-zipped I/H for pairs (0,7), (7,15); and matrices for pictures."""
    d = json.loads(Path(path).read_text())
    n_expert = 1 + max(int(e) for dom in d["domains"] for layer in d["expert_counts"][dom] for e in layer)
    per_layer = {}
    for li, layer in enumerate(d["layers_in_expert_counts"]):
        dom_vecs = []
        for dom in d["domains"]:
            v = np.zeros(n_expert)
            for e, c in d["expert_counts"][dom][li].items():
                v[int(e)] = c
            dom_vecs.append(v)
        total = np.sum(dom_vecs, axis=0)
        h, top10 = popularity_summary(total)
        per_layer[layer] = {"norm_entropy": h, "top10_share": top10, "domain_js_bits": mean_pairwise_js(dom_vecs),
                            "counts": total.tolist()}
    pairs = {}
    for pi, (la, lb) in enumerate(d["crosslayer_pairs"]):
        joint = np.zeros((n_expert, n_expert))
        for dom in d["domains"]:
            for a, b, c in d["expert_counts_crosslayer"][dom][pi]:
                joint[a, b] += c
        pairs[f"{la}-{lb}"] = {"mi_share": mutual_info_share(joint), "joint": joint.tolist()}
    return {"n_expert": n_expert, "layers": per_layer, "pairs": pairs, "source": d.get("source", "")}


def trace_stats(trace):
    """All statistics of one Trace (JSON-ready)."""
    ids = trace.expert_ids
    n, n_layer, k = ids.shape
    e = trace.n_expert
    bounds = trace.sequence_bounds()
    counts = popularity_counts(ids, e)
    summ = [popularity_summary(c) for c in counts]
    reuse = temporal_reuse(ids, bounds)
    caps = lru_replay.default_capacities(e, k)
    lru = lru_replay.hit_rates(trace, caps)
    # domain specialisation on the OLMoE text domains (test-split sequences named olmoe-text/<domain>/...)
    dom_rows = {}
    for s, (a, b) in zip(trace.sequences, bounds):
        parts = s["name"].split("/")
        if parts[0] == "olmoe-text" and len(parts) > 1 and parts[1].replace("_texts", "") in OLMOE_DOMAINS:
            dom_rows.setdefault(OLMOE_DOMAINS[parts[1].replace("_texts", "")], []).append((a, b))
    domain_js = None
    if len(dom_rows) >= 2:
        domain_js = []
        for layer in range(n_layer):
            vecs = [np.bincount(np.concatenate([ids[a:b, layer].reshape(-1) for a, b in rows]).astype(np.int64),
                                minlength=e) for rows in dom_rows.values()]
            domain_js.append(mean_pairwise_js(vecs))
    pair_layers = [(0, min(7, n_layer - 1)), (min(7, n_layer - 1), min(15, n_layer - 1))]
    pairs = {f"{a}-{b}": {"mi_share": mutual_info_share(slot_zipped_joint(ids, a, b, e))} for a, b in pair_layers}
    adjacent_mi = [mutual_info_share(slot_zipped_joint(ids, layer, layer + 1, e)) for layer in range(n_layer - 1)]
    srcs = {}
    for s in trace.sequences:
        srcs[s["source"]] = srcs.get(s["source"], 0) + int(s["n_tokens"])
    return {
        "model": trace.header["model"], "n_tokens": int(n), "n_layer": n_layer, "n_expert": e, "top_k": k,
        "tokens_by_source": srcs,
        "popularity": {"counts": counts.tolist(), "norm_entropy": [x[0] for x in summ],
                       "top10_share": [x[1] for x in summ]},
        "domain_js_bits": domain_js, "domain_tokens": {d: int(sum(b - a for a, b in r)) for d, r in dom_rows.items()},
        "temporal_reuse": reuse.tolist(), "temporal_reuse_random": k / e,
        "pairs": pairs, "adjacent_mi_share": adjacent_mi,
        "cooccurrence_recall": cooccurrence_recall(ids, e),
        "lru": {str(c): v for c, v in lru.items()},
    }


# ---------------------------------------------------------------- pictures


def plot_all(stats, real, img_dir, traces):
    """Writes the report's PNGs; returns {name: relative file name}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    img_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, st in stats.items():
        c = np.asarray(st["popularity"]["counts"], dtype=np.float64)
        rel = c / (c.sum(axis=1, keepdims=True) / st["n_expert"])
        fig, ax = plt.subplots(figsize=(10, 0.16 * st["n_layer"] + 2.2))
        im = ax.imshow(np.log2(np.maximum(rel, 1 / 64)), aspect="auto", cmap="RdBu_r", vmin=-4, vmax=4,
                       interpolation="nearest")
        ax.set_xlabel("expert id")
        ax.set_ylabel("layer")
        ax.set_title(f"{name}: expert load relative to uniform (log2), {st['n_tokens']} tokens")
        fig.colorbar(im, ax=ax, label="log2(load / uniform)")
        fn = f"routing-popularity-{Path(name).stem}.png"
        fig.tight_layout()
        fig.savefig(img_dir / fn, dpi=110)
        plt.close(fig)
        files[f"popularity:{name}"] = fn

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, st in stats.items():
        x = np.arange(st["n_layer"]) / max(1, st["n_layer"] - 1)
        axes[0].plot(x, st["temporal_reuse"], label=f"{Path(name).stem} (k/E={st['temporal_reuse_random']:.3f})")
        axes[0].axhline(st["temporal_reuse_random"], ls=":", lw=0.8, color=axes[0].lines[-1].get_color())
        axes[1].plot(x[:-1], st["adjacent_mi_share"], label=Path(name).stem)
    axes[0].set_title("temporal reuse: share of token t's experts used by token t-1")
    axes[1].set_title("adjacent layers: I(layer l; layer l+1) / H(layer l+1), slot-zipped")
    for ax in axes:
        ax.set_xlabel("relative depth (layer / (L-1))")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img_dir / "routing-reuse.png", dpi=110)
    plt.close(fig)
    files["reuse"] = "routing-reuse.png"

    fig, axes = plt.subplots(1, len(stats), figsize=(6 * len(stats), 4), squeeze=False)
    for ax, (name, st) in zip(axes[0], stats.items()):
        x = np.arange(st["n_layer"])
        for c, v in st["lru"].items():
            line, = ax.plot(x, v["per_layer"], label=f"{c} experts ({int(c) / st['n_expert']:.0%})")
            ax.axhline(int(c) / st["n_expert"], ls=":", lw=0.8, color=line.get_color())
        ax.set_title(f"{Path(name).stem}: per-layer LRU hit rate (dotted: random c/E)")
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img_dir / "routing-lru.png", dpi=110)
    plt.close(fig)
    files["lru"] = "routing-lru.png"

    # co-occurrence (layer 0 -> 7, slot-zipped), conditional P(b | a), ours next to OLMoE and Mixtral
    panels = []
    for name, t in traces.items():
        b = min(7, t.n_layer - 1)
        panels.append((f"{Path(name).stem} 0->{b}", slot_zipped_joint(t.expert_ids, 0, b, t.n_expert)))
    for rname, r in real.items():
        panels.append((f"{rname} 0->7", np.asarray(r["pairs"]["0-7"]["joint"])))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (title, joint) in zip(axes[0], panels):
        cond = joint / np.maximum(joint.sum(axis=1, keepdims=True), 1)
        ax.imshow(cond, aspect="auto", cmap="viridis", interpolation="nearest",
                  vmax=max(np.quantile(cond, 0.995), 1e-9))
        ax.set_title(f"{title}: P(b | a)", fontsize=9)
        ax.set_xlabel("expert at later layer")
        ax.set_ylabel("expert at earlier layer")
    fig.tight_layout()
    fig.savefig(img_dir / "routing-cooccurrence.png", dpi=110)
    plt.close(fig)
    files["cooccurrence"] = "routing-cooccurrence.png"

    fig, ax = plt.subplots(figsize=(7, 4))
    for rname, r in real.items():
        for layer in REAL_LAYERS:
            p = np.sort(np.asarray(r["layers"][layer]["counts"]))[::-1]
            ax.plot(np.linspace(0, 1, len(p)), p / p.sum() * len(p), ls="--", lw=1, label=f"{rname} L{layer}")
    for name, st in stats.items():
        for layer in sorted({0, min(7, st["n_layer"] - 1), min(15, st["n_layer"] - 1)}):
            p = np.sort(np.asarray(st["popularity"]["counts"][layer], dtype=np.float64))[::-1]
            ax.plot(np.linspace(0, 1, len(p)), p / p.sum() * len(p), lw=1.5, label=f"{Path(name).stem} L{layer}")
    ax.set_yscale("log")
    ax.set_xlabel("expert rank / E (most popular first)")
    ax.set_ylabel("load / uniform load")
    ax.set_title("expert popularity, sorted (layers 0/7/15)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(img_dir / "routing-popularity-sorted.png", dpi=110)
    plt.close(fig)
    files["sorted"] = "routing-popularity-sorted.png"
    return files


# ---------------------------------------------------------------- report


def _f(x, nd=3):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def write_report(path, stats, real, files, img_rel, command):
    """docs/routing-report.md from the computed numbers."""
    L = []
    L.append("# Routing statistics of our trained MoE models, next to OLMoE and Mixtral\n")
    L.append(f"Generated by `{command}` from the traces in `traces/` (format: `docs/trace-format.md`). "
             "The LRU numbers are checked by `python3 tools/data/lru_replay.py traces/*.pstrace --check "
             "docs/data/routing-stats.json`. OLMoE-1B-7B-0924 and Mixtral-8x7B-v0.1 figures come from "
             "`../shared/realdata/moe-routing-stats/` (layers 0/7/15 only, about 204,800 tokens per domain).\n")
    L.append("## Traces\n")
    L.append("| trace | model | tokens | layers | experts | top-k | tokens by source |")
    L.append("|---|---|---|---|---|---|---|")
    for name, st in stats.items():
        src = ", ".join(f"{k} {v}" for k, v in st["tokens_by_source"].items())
        L.append(f"| {name} | {st['model']} | {st['n_tokens']} | {st['n_layer']} | {st['n_expert']} | "
                 f"{st['top_k']} | {src} |")
    L.append("\n## Expert popularity\n")
    L.append("Normalised entropy of the per-layer load (1 = every expert equally loaded) and the share of assignments "
             "taken by the 10% most popular experts (uniform: 0.10). Domain JS: mean Jensen-Shannon divergence "
             "(bits) between the five OLMoE text domains' load vectors (ours: the OLMoE texts in our test split).\n")
    L.append("| model | layer | norm. entropy | top-10% share | domain JS (bits) |")
    L.append("|---|---|---|---|---|")
    for rname, r in real.items():
        for layer in REAL_LAYERS:
            x = r["layers"][layer]
            L.append(f"| {rname} ({r['n_expert']} experts) | {layer} | {_f(x['norm_entropy'])} | "
                     f"{_f(x['top10_share'])} | {_f(x['domain_js_bits'])} |")
    for name, st in stats.items():
        for layer in sorted({0, min(7, st["n_layer"] - 1), min(15, st["n_layer"] - 1), st["n_layer"] - 1}):
            js = st["domain_js_bits"][layer] if st["domain_js_bits"] else None
            L.append(f"| {name} ({st['n_expert']} experts) | {layer} | {_f(st['popularity']['norm_entropy'][layer])} "
                     f"| {_f(st['popularity']['top10_share'][layer])} | {_f(js)} |")
    for name in stats:
        key = f"popularity:{name}"
        if key in files:
            L.append(f"\n![popularity {name}]({img_rel}/{files[key]})")
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
    L.append("| model | pair | I/H |")
    L.append("|---|---|---|")
    for rname, r in real.items():
        for pair, v in r["pairs"].items():
            L.append(f"| {rname} | {pair} | {_f(v['mi_share'])} |")
    for name, st in stats.items():
        for pair, v in st["pairs"].items():
            L.append(f"| {name} | {pair} | {_f(v['mi_share'])} |")
    L.append("\n| trace | adjacent-layer I/H (mean) | co-occurrence recall@k (mean) | random k/E |")
    L.append("|---|---|---|---|")
    for name, st in stats.items():
        L.append(f"| {name} | {_f(float(np.mean(st['adjacent_mi_share'])))} | "
                 f"{_f(float(np.mean(st['cooccurrence_recall'])))} | {_f(st['temporal_reuse_random'])} |")
    L.append(f"\n![co-occurrence]({img_rel}/{files['cooccurrence']})\n")
    L.append("## Per-layer LRU expert cache\n")
    L.append("Hit rate of a per-layer LRU cache of c experts, tokens replayed in file order (model in "
             "`tools/data/lru_replay.py`); random routing would give about c/E.\n")
    L.append("| trace | cache (experts) | c/E | mean hit rate | min layer | max layer |")
    L.append("|---|---|---|---|---|---|")
    for name, st in stats.items():
        for c, v in st["lru"].items():
            L.append(f"| {name} | {c} | {_f(int(c) / st['n_expert'])} | {_f(v['mean'])} | "
                     f"{_f(min(v['per_layer']))} | {_f(max(v['per_layer']))} |")
    L.append(f"\n![LRU]({img_rel}/{files['lru']})\n")
    L.append("## Where ours differ from OLMoE and Mixtral\n")
    L.extend(comparison_notes(stats, real))
    Path(path).write_text("\n".join(L) + "\n")


def comparison_notes(stats, real):
    """Bullet points stating, with numbers, how our statistics compare with the real models'."""
    out = []
    for name, st in stats.items():
        mids = [min(7, st["n_layer"] - 1), min(15, st["n_layer"] - 1)]
        ours_h = [st["popularity"]["norm_entropy"][layer] for layer in [0] + mids]
        for rname, r in real.items():
            theirs = [r["layers"][layer]["norm_entropy"] for layer in REAL_LAYERS]
            out.append(f"- {name} vs {rname}, popularity entropy at layers 0/7/15: ours "
                       f"{'/'.join(_f(x, 2) for x in ours_h)}, theirs {'/'.join(_f(x, 2) for x in theirs)} "
                       f"({'more' if np.mean(ours_h) > np.mean(theirs) else 'less'} uniform on average).")
            if st["domain_js_bits"]:
                ojs = [st["domain_js_bits"][layer] for layer in [0] + mids]
                tjs = [r["layers"][layer]["domain_js_bits"] for layer in REAL_LAYERS]
                out.append(f"- {name} vs {rname}, domain JS at layers 0/7/15: ours "
                           f"{'/'.join(_f(x, 3) for x in ojs)}, theirs {'/'.join(_f(x, 3) for x in tjs)} bits "
                           "(ours from far fewer tokens per domain, which biases JS upwards).")
            ours_mi = [v["mi_share"] for v in st["pairs"].values()]
            theirs_mi = [v["mi_share"] for v in r["pairs"].values()]
            out.append(f"- {name} vs {rname}, cross-layer I/H for pairs 0-7 / 7-15: ours "
                       f"{'/'.join(_f(x, 3) for x in ours_mi)}, theirs {'/'.join(_f(x, 3) for x in theirs_mi)}.")
    return out


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
    real = {rname: real_model_stats(realdata / "moe-routing-stats" / d / "routing_stats.json")
            for rname, d in REAL_MODELS.items()}
    files = plot_all(stats, real, Path(args.img), traces)
    command = "python3 tools/data/routing_stats.py " + " ".join(sys.argv[1:])
    out = {"command": command.strip(), "traces": stats,
           "real_models": {rname: {"n_expert": r["n_expert"], "source": r["source"],
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
