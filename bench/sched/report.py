#!/usr/bin/env python3
"""Markdown tables of bench/sched/run_sim.sh's results: the simulated runs (sched-sim.jsonl) and the ILP gap
distribution (sched-ilp-gap.json). Usage: report.py ROWS.jsonl GAP.json > TABLE.md"""
import json
import sys


def main(rows_path, gap_path):
    rows = [json.loads(line) for line in open(rows_path) if line.strip()]
    gap = json.load(open(gap_path))
    out = ["# PreSched, simulated (not measured)", "",
           "Every number below comes from `prescope simulate` (offload/simulator.h) with the cost profile named in "
           "each row (by default the built-in H200 reference derived from ../shared/design/reference-numbers.md); "
           "nothing ran on a GPU. Routing: the committed traces, **skewed** (topo); the Mixtral rows fold them to "
           "8 experts top-2 (tools/data/fold_trace.py). Prefill: one batch of 512 trace tokens on a cold cache; "
           "decode: the next 128 tokens; predictor recency, window 1, LRU, 16 CPU threads.", "",
           "| routing | shape | budget | rule | decode tok/s | x fetch-all | x best threshold | prefill tok/s | "
           "x fetch-all | hit rate | PCIe MB/token | CPU experts/token | bound tok/s | share of bound |",
           "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = {}
    for r in rows:
        if "truth" in r["label"]:
            continue
        base.setdefault((r["label"], r["shape"], r["budget"]), {})[r["rule"]] = r
    for (label, shape, budget), by_rule in base.items():
        fetch_all = by_rule.get("threshold 0")
        thresholds = [v for k, v in by_rule.items() if k.startswith("threshold")]
        best = max(thresholds, key=lambda v: v["decode"]["tok_s"]) if thresholds else None
        for rule in ("threshold 0", "threshold 2", "cost"):
            r = by_rule.get(rule)
            if not r:
                continue
            d, p = r["decode"], r["prefill"]
            x_fetch = d["tok_s"] / fetch_all["decode"]["tok_s"] if fetch_all else float("nan")
            x_best = d["tok_s"] / best["decode"]["tok_s"] if best else float("nan")
            px = p["tok_s"] / fetch_all["prefill"]["tok_s"] if fetch_all else float("nan")
            out.append(f"| {label} | {shape} | {budget} | {rule} | {d['tok_s']:.2f} | {x_fetch:.2f} | {x_best:.2f} | "
                       f"{p['tok_s']:.0f} | {px:.2f} | {d['hit_rate']:.3f} | {d['pcie_bytes_per_token'] / 1e6:.1f} | "
                       f"{d['cpu_experts_per_token']:.2f} | {d['bound_tok_s']:.2f} | {d['share_of_bound']:.2f} |")
    out += ["", "threshold 0 = every miss fetched (the old default); threshold 2 = a decode miss runs on the CPU "
            "(`--cpu-threshold 2`); cost = the scheduler (the new default). Bound: per layer the hits on the GPU "
            "against the misses split ideally between the link and the CPU at the profile's speeds, plus the "
            "layer's non-expert time; share = bound time / simulated time.", ""]
    lb = [r for r in rows if "truth" in r["label"]]
    if lb:
        out += ["## Load balancer (Qwen3 shape, 4 GiB; the simulated machine differs from the profile by `truth`)", "",
                "| run | decode tok/s | prefill tok/s | CPU experts/token | corrections counted | final cpu / link factor |",
                "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in lb:
            d = r["decode"]
            c = r["corrections"]
            out.append(f"| {r['label']} | {d['tok_s']:.2f} | {r['prefill']['tok_s']:.0f} | "
                       f"{d['cpu_experts_per_token']:.2f} | {d['corrections'] + r['prefill']['corrections']} | "
                       f"{c['cpu']:.3f} / {c['link']:.3f} |")
        out.append("")
    out += ["## Heuristic against the ILP optimum (prescope schedule-check on the dumped layer states)", "",
            "| states | count | proven optimal | within 5% | gap p50 | p95 | p99 | max | exactly optimal |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind in ("all", "with a choice", "decode", "prefill"):
        g = gap.get(kind)
        if not g:
            continue
        out.append(f"| {kind} | {g['states']} | {g['proven_optimal']} | {100 * g['share_within_target']:.1f}% | "
                   f"{g['gap_p50']:.4f} | {g['gap_p95']:.4f} | {g['gap_p99']:.4f} | {g['gap_max']:.4f} | "
                   f"{100 * g['zero_gap_share']:.1f}% |")
    out += ["", "Gap = (heuristic objective - optimum) / the optimal plan's critical path (objective: critical path + "
            "expected stall of the next layers - residency credit; it can be negative, hence the normalisation). "
            "'with a choice': states with a missed expert or a prefetch candidate. Histogram (all states):", "",
            "| gap from | to | states |", "| ---: | ---: | ---: |"]
    for h in gap["histogram"]:
        out.append(f"| {h['from']:g} | {'inf' if h['to'] < 0 else format(h['to'], 'g')} | {h['states']} |")
    out += ["", "Reproduce: `bench/sched/run_sim.sh` (every row of sched-sim.jsonl carries its `prescope simulate` "
            "command; the layer states are that script's temporary files). Its check: `" + gap["command"] + "`", ""]
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
