# Merges `prescope eval-predictor --json` outputs into bench/results/predictors.json and draws recall@k by layer.
"""Usage: python3 bench/predictor/collect_results.py OUT.json PLOT.png RUN1.json RUN2.json ...

OUT.json holds {"rows": [...]} with one row per (predictor, trace, distance, layer_group): recall_at_k,
precision_at_k, exact_match, n, plus the cache replay of each run under "cache" and the per-layer recall of
distance 1 under "per_layer". PLOT.png shows recall@k at distance 1 by target layer for the runs on the first
run's trace.
"""
import json
import sys
from pathlib import Path


def main():
    out, plot, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
    rows, cache, per_layer, plotted = [], [], {}, {}
    plot_trace = json.loads(Path(runs[0]).read_text())["trace"]
    for path in runs:
        r = json.loads(Path(path).read_text())
        label = f"{r['predictor']} ({r['trace']})"
        for row in r["rows"]:
            rows.append({k: row[k] for k in ("predictor", "trace", "distance", "layer_group", "recall_at_k",
                                             "precision_at_k", "exact_match", "n", "layers")})
        if "cache" in r:
            cache.append({"predictor": r["predictor"], "trace": r["trace"], **r["cache"]})
        per_layer[label] = [(p["layer"], p["recall_at_k"]) for p in r["per_layer"] if p["distance"] == 1]
        if r["trace"] == plot_trace:
            plotted[r["predictor"]] = per_layer[label]
    doc = {"description": "Expert predictors on held-out sequences (docs/predictors.md has the commands)",
           "rows": rows, "cache": cache,
           "recall_at_k_by_layer_d1": {k: [v for _, v in pts] for k, pts in per_layer.items()}}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, pts in plotted.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, lw=1.2)
    ax.set_xlabel("predicted layer")
    ax.set_ylabel("recall@k, distance 1")
    ax.set_title(plot_trace)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(plot, dpi=110)


if __name__ == "__main__":
    main()
