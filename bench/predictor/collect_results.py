# Merges `prescope eval-predictor --json` outputs into bench/results/predictors.json and draws recall@k by layer.
"""Usage: python3 bench/predictor/collect_results.py OUT.json PLOT.png [--plot-predictors A,B,...] RUN1.json ...

OUT.json holds {"rows": [...]} with one row per (predictor, trace, distance, layer_group): recall_at_k,
precision_at_k, exact_match, n, plus the cache replay of each run under "cache" and the per-layer recall of
distances 1 and 3 under "recall_at_k_by_layer_d1" / "_d3". PLOT.png shows recall@k at distances 1 and 3 by
target layer for the runs on the first run's trace (only the listed predictors, when --plot-predictors is given).
"""
import json
import sys
from pathlib import Path


def main():
    out, plot, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
    only = None
    if runs and runs[0] == "--plot-predictors":
        only, runs = runs[1].split(","), runs[2:]
    rows, cache, per_layer, plotted = [], [], {1: {}, 3: {}}, {1: {}, 3: {}}
    plot_trace = json.loads(Path(runs[0]).read_text())["trace"]
    for path in runs:
        r = json.loads(Path(path).read_text())
        label = f"{r['predictor']} ({r['trace']})"
        for row in r["rows"]:
            rows.append({k: row[k] for k in ("predictor", "trace", "distance", "layer_group", "recall_at_k",
                                             "precision_at_k", "exact_match", "n", "layers")})
        if "cache" in r:
            cache.append({"predictor": r["predictor"], "trace": r["trace"], **r["cache"]})
        for d in (1, 3):
            pts = [(p["layer"], p["recall_at_k"]) for p in r["per_layer"] if p["distance"] == d]
            per_layer[d][label] = pts
            if r["trace"] == plot_trace and (only is None or r["predictor"] in only):
                plotted[d][r["predictor"]] = pts
    doc = {"description": "Expert predictors on held-out sequences (docs/predictors.md has the commands)",
           "rows": rows, "cache": cache,
           "recall_at_k_by_layer_d1": {k: [v for _, v in pts] for k, pts in per_layer[1].items()},
           "recall_at_k_by_layer_d3": {k: [v for _, v in pts] for k, pts in per_layer[3].items()}}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, d in zip(axes, (1, 3)):
        for label, pts in plotted[d].items():
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, lw=1.2)
        ax.set_xlabel("predicted layer")
        ax.set_title(f"{plot_trace}, distance {d}")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("recall@k")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(plot, dpi=110)


if __name__ == "__main__":
    main()
