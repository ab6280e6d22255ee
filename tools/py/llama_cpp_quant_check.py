# Quantizes a GGUF with llama.cpp's llama-quantize into several presets and compares PreScope with llama.cpp
# on each file: greedy text of the demo test prompts and perplexity (decision 0060). Offline tool; the
# llama.cpp peer is built outside this repository and the quantized files stay in a temporary folder.
#   python3 tools/py/llama_cpp_quant_check.py --llama-bin /tmp/peer/llama.cpp/build/bin \
#       [-m models/demo/demo-q8_0.gguf] [--presets Q4_0 Q4_K_M ...] [-t 2] [--out bench/results/X.json]
"""PreScope against llama.cpp on llama-quantize's presets of one model.

For each preset: the tensor types llama-quantize chose (counted from the file), the greedy continuations of
the prompts in tests/data/demo/reference.json (`prescope generate` and `llama-completion`, --temp 0, the same
number of tokens; identical, or the first differing byte), and the perplexity of a text (`prescope perplexity`
and `llama-perplexity`, same context, F32 KV cache, no flash attention) with the relative difference; and,
as a reference neither engine's quantized kernels touch, the perplexity of the same file with every tensor
dequantized to F32 by gguf-py (`gguf.quants.dequantize`), in both engines.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, errors="backslashreplace").stdout


def tensor_types(path: Path) -> dict[str, int]:
    return dict(collections.Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def write_dequantized(src: Path, dst: Path) -> None:
    """src with every tensor as F32 (gguf-py's dequantization) and the same metadata."""
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"]
    w = GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        t = f.types[0]
        text = lambda i: bytes(f.parts[i]).decode("utf-8", errors="surrogateescape")  # noqa: E731
        if t == GGUFValueType.ARRAY:
            sub = f.types[1]
            val = [text(i) if sub == GGUFValueType.STRING else f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, val, t, sub_type=sub)
        else:
            w.add_key_value(name, text(f.data[0]) if t == GGUFValueType.STRING else f.parts[f.data[0]].tolist()[0], t)
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]
        w.add_tensor(t.name, dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def perplexity(out: str) -> float:
    m = re.findall(r"Final estimate: PPL = ([0-9.]+)", out) or re.findall(r"\[\d+\]([0-9.]+)", out)
    return float(m[-1])


def first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-quantize, llama-completion, llama-perplexity")
    ap.add_argument("-m", "--model", type=Path, default=ROOT / "models/demo/demo-q8_0.gguf")
    ap.add_argument("--prescope", type=Path, default=ROOT / "build/bin/prescope")
    ap.add_argument("--presets", nargs="+", default=["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"])
    ap.add_argument("--text", type=Path, default=ROOT / "tests/data/text/wikipedia-20k.txt")
    ap.add_argument("--text-bytes", type=int, default=6000, help="perplexity over this prefix of --text")
    ap.add_argument("-c", "--ctx", type=int, default=128)
    ap.add_argument("-n", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    prompts = [p["text"] for p in json.loads((ROOT / "tests/data/demo/reference.json").read_text())["prompts"]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_bytes(a.text.read_bytes()[: a.text_bytes])
        for preset in a.presets:
            q = Path(tmp) / f"{a.model.stem}-{preset}.gguf"
            run([str(a.llama_bin / "llama-quantize"), "--allow-requantize", str(a.model), str(q), preset])
            row = {"preset": preset, "bytes": q.stat().st_size, "tensor_types": tensor_types(q), "prompts": []}
            for p in prompts:
                ours = run([str(a.prescope), "generate", "-m", str(q), "-p", p, "-n", str(a.n), "--temp", "0",
                            "-t", str(a.threads)])
                theirs = run([str(a.llama_bin / "llama-completion"), "-m", str(q), "-p", p, "-n", str(a.n),
                              "--temp", "0", "-t", str(a.threads), "-c", "512", "-no-cnv", "--no-warmup", "-ctk",
                              "f32", "-ctv", "f32", "-fa", "off", "--no-display-prompt"])
                ours, theirs = ours.rstrip("\n"), theirs.rstrip("\n")
                diff = first_difference(ours, theirs)
                row["prompts"].append({"identical": diff is None, "first_difference": diff, "ours": ours,
                                       "llama_cpp": theirs})
            def ppl_ours(model: Path) -> float:
                return perplexity(run([str(a.prescope), "perplexity", "-m", str(model), "-f", str(text), "-c",
                                       str(a.ctx), "-t", str(a.threads)]))

            def ppl_theirs(model: Path) -> float:
                return perplexity(run([str(a.llama_bin / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c",
                                       str(a.ctx), "-b", str(a.ctx), "-t", str(a.threads), "-ctk", "f32", "-ctv",
                                       "f32", "-fa", "off", "--no-warmup"]))

            f32 = Path(tmp) / f"{q.stem}-dequantized-f32.gguf"
            write_dequantized(q, f32)
            ours, theirs = ppl_ours(q), ppl_theirs(q)
            ref_ours, ref_theirs = ppl_ours(f32), ppl_theirs(f32)
            f32.unlink()
            row["perplexity"] = {"ours": ours, "llama_cpp": theirs, "relative_difference": abs(ours - theirs) / theirs,
                                 "dequantized_f32_ours": ref_ours, "dequantized_f32_llama_cpp": ref_theirs,
                                 "ours_vs_dequantized": abs(ours - ref_ours) / ref_ours,
                                 "llama_cpp_vs_dequantized": abs(theirs - ref_theirs) / ref_theirs}
            rows.append(row)
            print(f"{preset}: {sum(p['identical'] for p in row['prompts'])}/{len(prompts)} greedy texts identical, "
                  f"PPL {ours:.4f} vs {theirs:.4f} (file dequantized to F32: {ref_ours:.4f} / {ref_theirs:.4f})",
                  flush=True)
    result = {"model": str(a.model.relative_to(ROOT)) if a.model.is_relative_to(ROOT) else str(a.model),
              "command": "python3 tools/py/llama_cpp_quant_check.py " + " ".join(
                  ["--llama-bin", "$LLAMA_BIN", "-t", str(a.threads), "-n", str(a.n), "-c", str(a.ctx),
                   "--text-bytes", str(a.text_bytes), "--presets", *a.presets, "--out", str(a.out)]),
              "llama_cpp": run(["git", "-C", str(a.llama_bin.parents[1]), "rev-parse", "--short", "HEAD"]).strip()
              if (a.llama_bin.parents[1] / ".git").exists() else "unknown",
              "presets": rows}
    a.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
