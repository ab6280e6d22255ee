# CPU prefill/decode tokens/s of PreScope against llama.cpp's CPU path on the same GGUF and thread
# count, run side by side in one invocation (interleaved: ours, theirs, ours, theirs, ...).
"""Side-by-side CPU benchmark: prescope bench vs llama-bench.

    python3 bench/cpu/compare_llamacpp.py -m MODEL.gguf --llama-bench /path/to/llama-bench \\
        [-t THREADS] [-p 64] [-n 32] [-r 3] [--rounds 2] [--json-out results.json]

Both tools run the same tests (pp = one batch of -p random tokens from an empty cache, tg = -n single
token steps), with the same repetitions; the script repeats the pair --rounds times, interleaved, so
that machine noise hits both alike, and reports the median of the per-round means and the ratio
PreScope / llama.cpp. llama.cpp is a comparison peer built outside this repository.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_json_lines(cmd: list[str]) -> list[dict]:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        line = line.strip().rstrip(",")
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def prescope_round(binary: Path, a: argparse.Namespace) -> dict[str, float]:
    rows = run_json_lines([str(binary), "bench", "-m", a.model, "-t", str(a.threads), "-p", str(a.p), "-n", str(a.n),
                           "-r", str(a.r), "-o", "json"])
    return {r["test"]: r["avg_ts"] for r in rows}


def llama_round(binary: str, a: argparse.Namespace) -> dict[str, float]:
    # llama-bench -o jsonl prints one object per test with n_prompt / n_gen and avg_ts.
    rows = run_json_lines([binary, "-m", a.model, "-t", str(a.threads), "-p", str(a.p), "-n", str(a.n),
                           "-r", str(a.r), "-o", "jsonl"])
    out = {}
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] > 0 else f"tg{r['n_gen']}"
        out[test] = r["avg_ts"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH", "llama-bench"))
    ap.add_argument("--prescope", type=Path, default=ROOT / "build" / "bin" / "prescope")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("-p", type=int, default=64)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)

    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for k, v in prescope_round(a.prescope, a).items():
            ours.setdefault(k, []).append(v)
        for k, v in llama_round(a.llama_bench, a).items():
            theirs.setdefault(k, []).append(v)

    command = " ".join(["python3", "bench/cpu/compare_llamacpp.py", "-m", a.model, "--llama-bench", a.llama_bench,
                        "-t", str(a.threads), "-p", str(a.p), "-n", str(a.n), "-r", str(a.r),
                        "--rounds", str(a.rounds)])
    rows = []
    for test in ours:
        o, t = statistics.median(ours[test]), statistics.median(theirs.get(test, [float("nan")]))
        rows.append({"model": Path(a.model).name, "test": test, "threads": a.threads, "prescope_tok_s": o,
                     "llama_cpp_tok_s": t, "ratio": o / t if t else float("nan"),
                     "prescope_rounds": ours[test], "llama_cpp_rounds": theirs.get(test, []), "command": command})
    if a.json_out:
        a.json_out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"| model | test | threads | PreScope tok/s | llama.cpp tok/s | ratio |")
    print(f"| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['test']} | {r['threads']} | {r['prescope_tok_s']:.2f} | "
              f"{r['llama_cpp_tok_s']:.2f} | {r['ratio']:.2f}x |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
