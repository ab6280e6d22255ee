# Turns the output folder of scripts/device/bench_offload.sh into the issue 4 result rows (JSON) and a table.
"""Offloading benchmark report.

    python3 bench/offload/report.py OUT_DIR [--json-out bench/results/offload-q30b.json] [--command "..."]
    python3 bench/offload/report.py --brief prescope-12.jsonl      # one line, used by the device script
    python3 bench/offload/report.py --match-ncmoe PEAK_MIB [--shape mixtral-8x7b] [--llama-base-mib B]
                                                                    # llama.cpp --n-cpu-moe for it
    python3 bench/offload/report.py --llama-base PEER_PEAK_MIB --ncmoe N --shape deepseek-v2-lite
                                                                    # llama.cpp's base measured from one run

Row fields (issue 4): model, budget_gib, gpu_mem_gib, decode_tok_s, prefill_tok_s, peer, peer_args,
peer_decode_tok_s, peer_prefill_tok_s, decode_ratio, prefill_ratio, hit_rate, pcie_gb_s, pcie_bytes_per_token,
routing; plus peer_gpu_mem_gib, predictor, and decode_pcie_bound_tok_s / decode_share_of_pcie_bound: the decode
rate the bytes moved over PCIe per token allow at the link's measured pinned peak (55.5 GB/s,
../shared/design/reference-numbers.md), and the share of it reached. GPU memory is the peak of nvidia-smi's
memory.used during the run (device-wide, so both tools are measured alike).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PCIE_PEAK_B_S = 55.5e9
# llama.cpp's GPU memory per shape (../shared/design/reference-numbers.md), as (MiB with every expert on the CPU, MiB
# per layer whose experts stay on the GPU, layers):
# - qwen3-30b-a3b: 2.4 GiB, plus one layer's 128 Q8_0 experts (128 x 3 x 768 x 2048 x 34/32 bytes = 612 MiB);
# - mixtral-8x7b: 8 x 3 x 14336 x 4096 x 34/32 bytes = 1427 MiB per layer; the base is the mean of what -ncmoe 24
#   (14.3 GiB) and -ncmoe 16 (25.7 GiB) leave after their 8 and 16 layers of experts.
# - deepseek-v2-lite: 64 x 3 x 1408 x 2048 x 34/32 bytes = 561 MiB per MoE layer (the shared experts stay on the GPU:
#   -ncmoe moves only ffn_*_exps); 27 blocks of which block 0 is dense, so -ncmoe N leaves the experts of blocks
#   N..26 on the GPU. The base is an estimate until measured (not yet run): the Qwen3 base less its larger weights
#   and logits buffer (GPU weights 1126 MiB against 1281, logits of 512 x 102400 against 512 x 151936 floats).
#   bench_offload.sh measures it from its first peer run (--llama-base) and matches the other budgets with that.
LLAMA_MEMORY = {"qwen3-30b-a3b": (2458.0, 612.0, 48), "mixtral-8x7b": (3356.0, 1427.0, 32),
                "deepseek-v2-lite": (2150.0, 561.0, 27)}
# Leading dense blocks (no experts for -ncmoe to move) per shape; 0 where absent.
LLAMA_DENSE_LEAD = {"deepseek-v2-lite": 1}
MODEL_TEXT = {"qwen3-30b-a3b": "qwen3moe Qwen3-30B-A3B shape, random weights, Q8_0 (tools/py/make_bench_model.py)",
              "mixtral-8x7b": "llama+experts Mixtral-8x7B shape, random weights, Q8_0 (tools/py/make_bench_model.py "
                              "--shape mixtral-8x7b)",
              "deepseek-v2-lite": "deepseek2 DeepSeek-V2-Lite shape, random weights, Q8_0 "
                                  "(tools/py/make_bench_model.py --shape deepseek-v2-lite)"}


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def by_test(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for r in rows:
        test = r.get("test") or (f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r.get('n_gen')}")
        out[test[:2]] = r
    return out


def brief(path: Path) -> str:
    parts = []
    for r in read_jsonl(path):
        parts.append(f"{r['test']} {r['avg_ts']:.1f} tok/s hit {r.get('hit_rate', 0):.3f} "
                     f"pcie {r.get('pcie_gb_s', 0):.1f} GB/s {r.get('pcie_bytes_per_token', 0) / 2**20:.1f} MiB/tok")
    return "; ".join(parts) or "no rows"


def match_ncmoe(peak_mib: float, shape: str = "qwen3-30b-a3b", base_mib: float | None = None) -> int:
    """The --n-cpu-moe that gives llama.cpp about peak_mib of GPU memory on the shape's benchmark model; base_mib
    replaces LLAMA_MEMORY's base (a measured one). An N that covers only leading dense blocks moves nothing: 0."""
    base, per_layer, n_layer = LLAMA_MEMORY[shape]
    base = base if base_mib is None else base_mib
    layers_on_gpu = round((peak_mib - base) / per_layer)
    n = max(0, min(n_layer, n_layer - layers_on_gpu))
    return 0 if n <= LLAMA_DENSE_LEAD.get(shape, 0) else n


def moe_layers_on_gpu(ncmoe: int, shape: str) -> int:
    """Blocks whose experts llama.cpp -ngl 99 --n-cpu-moe ncmoe keeps on the GPU (blocks ncmoe.. that have experts)."""
    _, _, n_layer = LLAMA_MEMORY[shape]
    return n_layer - max(min(ncmoe, n_layer), LLAMA_DENSE_LEAD.get(shape, 0))


def llama_base(peer_peak_mib: float, ncmoe: int, shape: str) -> float:
    """llama.cpp's GPU memory with every expert on the CPU, from one run's peak at --n-cpu-moe ncmoe: the peak less
    the expert layers that run left on the GPU (LLAMA_MEMORY's per-layer size, which is the file's arithmetic)."""
    return peer_peak_mib - moe_layers_on_gpu(ncmoe, shape) * LLAMA_MEMORY[shape][1]


def run_facts(out_dir: Path) -> tuple[str, str]:
    """(shape, routing kind) from the run.txt bench_offload.sh writes ("SHAPE KIND TRACE"), or ("", "")."""
    f = out_dir / "run.txt"
    parts = f.read_text().split() if f.exists() else []
    return (parts[0], parts[1]) if len(parts) >= 2 else ("", "")


def report(out_dir: Path, command: str, shape: str = "", routing_kind: str = "",
           peer_text: str = "llama.cpp (llama-bench)") -> list[dict]:
    """One row per budget (module docstring); routing_kind labels the replayed routing ("balanced", "skewed").
    shape and routing_kind default to what the run recorded in run.txt (shape: qwen3-30b-a3b without one)."""
    recorded_shape, recorded_kind = run_facts(out_dir)
    shape = shape or recorded_shape or "qwen3-30b-a3b"
    routing_kind = routing_kind or recorded_kind
    pairs = {}
    if (out_dir / "pairs.txt").exists():
        for line in (out_dir / "pairs.txt").read_text().split("\n"):
            if line.strip():
                b, n = line.split()
                pairs[b] = n
    rows = []
    for f in sorted(out_dir.glob("prescope-*.jsonl"), key=lambda p: float(p.stem.split("-")[1])):
        b = f.stem.split("-")[1]
        ours = by_test(read_jsonl(f))
        if "tg" not in ours or "pp" not in ours:
            continue
        tg, pp = ours["tg"], ours["pp"]
        mem = out_dir / f"gpu-mem-prescope-{b}.txt"
        row = {"model": MODEL_TEXT[shape], "shape": shape,
               "budget_gib": float(b),
               "gpu_mem_gib": float(mem.read_text()) / 1024 if mem.exists() else None,
               "decode_tok_s": tg["avg_ts"], "prefill_tok_s": pp["avg_ts"],
               "hit_rate": tg.get("hit_rate"), "prefill_hit_rate": pp.get("hit_rate"),
               "pcie_gb_s": tg.get("pcie_gb_s"), "pcie_bytes_per_token": tg.get("pcie_bytes_per_token"),
               "prefill_pcie_bytes_per_token": pp.get("pcie_bytes_per_token"),
               "routing": f"replayed:{tg['offload']['routing_trace']}" if tg.get("offload", {}).get("routing_trace")
               else tg.get("routing", "router"), "routing_kind": routing_kind or None,
               "predictor": tg.get("predictor"), "threads": tg.get("threads"),
               "peer": None, "peer_args": None, "peer_gpu_mem_gib": None,
               "peer_decode_tok_s": None, "peer_prefill_tok_s": None, "decode_ratio": None, "prefill_ratio": None,
               "command": command}
        bpt = tg.get("pcie_bytes_per_token") or 0
        row["decode_pcie_bound_tok_s"] = PCIE_PEAK_B_S / bpt if bpt else None
        row["decode_share_of_pcie_bound"] = tg["avg_ts"] / row["decode_pcie_bound_tok_s"] if bpt else None
        n = pairs.get(b)
        if n is not None:
            peer = by_test(read_jsonl(out_dir / f"llama-{n}.jsonl"))
            pmem = out_dir / f"gpu-mem-llama-{n}.txt"
            row.update(peer=peer_text,
                       peer_args=f"-ngl 99 --n-cpu-moe {n} -t {tg.get('threads')} -p 512 -n 128 -r 1",
                       peer_gpu_mem_gib=float(pmem.read_text()) / 1024 if pmem.exists() and pmem.read_text().strip() else None)
            if "tg" in peer:
                row["peer_decode_tok_s"] = peer["tg"]["avg_ts"]
                row["decode_ratio"] = tg["avg_ts"] / peer["tg"]["avg_ts"]
            if "pp" in peer:
                row["peer_prefill_tok_s"] = peer["pp"]["avg_ts"]
                row["prefill_ratio"] = pp["avg_ts"] / peer["pp"]["avg_ts"]
        rows.append(row)
    return rows


def fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", type=Path)
    ap.add_argument("--brief", type=Path)
    ap.add_argument("--match-ncmoe", type=float)
    ap.add_argument("--llama-base-mib", type=float, help="with --match-ncmoe: llama.cpp's measured base (--llama-base)")
    ap.add_argument("--llama-base", type=float, metavar="PEER_PEAK_MIB",
                    help="print llama.cpp's base (MiB, every expert on the CPU) from a run's peak at --ncmoe")
    ap.add_argument("--ncmoe", type=int, help="the --n-cpu-moe of the --llama-base run")
    ap.add_argument("--shape", choices=sorted(LLAMA_MEMORY), default="",
                    help="model shape (default: the run's run.txt, else qwen3-30b-a3b)")
    ap.add_argument("--peer", default="llama.cpp (llama-bench)", help="the peer's name and build, for the rows")
    ap.add_argument("--routing-kind", default="", help='label of the replayed routing: "balanced" or "skewed"')
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--command", default="scripts/device/bench_offload.sh (see bench/offload/README.md)")
    a = ap.parse_args(argv)
    if a.brief:
        print(brief(a.brief))
        return 0
    if a.match_ncmoe is not None:
        print(match_ncmoe(a.match_ncmoe, a.shape or "qwen3-30b-a3b", a.llama_base_mib))
        return 0
    if a.llama_base is not None:
        if a.ncmoe is None:
            ap.error("--llama-base needs --ncmoe")
        print(f"{llama_base(a.llama_base, a.ncmoe, a.shape or 'qwen3-30b-a3b'):.0f}")
        return 0
    rows = report(a.out_dir, a.command, a.shape, a.routing_kind, a.peer)
    print("| budget | GPU mem ours / peer | decode tok/s ours / llama.cpp | ratio | prefill tok/s ours / llama.cpp | ratio "
          "| hit rate | PCIe GB/s | PCIe MiB/token | share of PCIe bound |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['budget_gib']:g} GiB | {fmt(r['gpu_mem_gib'], '.1f')} / {fmt(r['peer_gpu_mem_gib'], '.1f')} GiB "
              f"| {r['decode_tok_s']:.1f} / {fmt(r['peer_decode_tok_s'], '.1f')} | {fmt(r['decode_ratio'], '.2f')}x "
              f"| {r['prefill_tok_s']:.1f} / {fmt(r['peer_prefill_tok_s'], '.1f')} | {fmt(r['prefill_ratio'], '.2f')}x "
              f"| {fmt(r['hit_rate'], '.3f')} | {fmt(r['pcie_gb_s'], '.1f')} "
              f"| {fmt((r['pcie_bytes_per_token'] or 0) / 2**20, '.1f')} | {fmt(r['decode_share_of_pcie_bound'], '.2f')} |")
    if a.json_out:
        a.json_out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
