#!/usr/bin/env python3
# Cross-checks the tiny test models with an already built llama.cpp (a peer, never built or vendored by us):
# prompt tokenization, 32-token greedy continuation and perplexity; results go into the golden .ref.json files.
"""llama.cpp cross-check of tests/data/models/<arch>/tiny-*.gguf.

    python3 tools/py/llama_cpp_check.py --llama-bin /tmp/llama.cpp/build/bin --commit d32676d77 [--arch gptoss ...]

For each GGUF with a .ref.json next to it:
  - llama-tokenize on prompt_text must give prompt_ids (so the text prompt below is exactly HF's prompt);
  - llama-completion greedy (--temp 0), 32 tokens, F32 KV cache: its stdout must equal, byte for byte, the
    concatenated pieces of HF's greedy ids (llama-completion prints pieces, not ids; with random weights a
    different id almost never yields the same bytes for the rest of 32 steps);
  - llama-perplexity -c 128 on tests/data/text/wikipedia-20k.txt.
Writes "llama_cpp_greedy" and "llama_cpp_perplexity" into each .ref.json. Exits 1 if a greedy run or a
tokenization disagrees with HF on an F32 file (Q8_0 disagreements are reported: llama.cpp quantizes activations
to Q8_0 there, while the HF reference runs float32 activations).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import gguf

from byte_level import byte_alphabet  # tools/py, next to this script

REPO = Path(__file__).resolve().parents[2]
PPL_TEXT = "tests/data/text/wikipedia-20k.txt"
THREADS = 2


def token_pieces(model: Path) -> list[bytes]:
    """Each token's detokenized bytes from the GGUF vocabulary (as llama.cpp's token_to_piece produces them)."""
    r = gguf.GGUFReader(str(model))
    kind = r.fields["tokenizer.ggml.model"].contents()
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    out = []
    if kind == "gpt2":
        dec = {c: b for b, c in enumerate(byte_alphabet())}
        for t, ty in zip(tokens, types):
            out.append(t.encode() if ty in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
                       else bytes(dec[c] for c in t))
    elif kind == "llama":
        for t, ty in zip(tokens, types):
            if ty == gguf.TokenType.BYTE:
                out.append(bytes([int(t[3:5], 16)]))
            else:
                out.append(t.replace("\u2581", " ").encode())
    else:
        raise ValueError(f"{model}: tokenizer {kind!r} not handled")
    return out


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, timeout=600)


def shown(cmd: list[str], bin_dir: Path) -> str:
    """The command as documented: binaries relative to the llama.cpp build, paths relative to the repo."""
    parts = [str(Path(c).relative_to(bin_dir)) if c.startswith(str(bin_dir)) else
             str(Path(c).relative_to(REPO)) if c.startswith(str(REPO)) else c for c in cmd]
    return shlex.join(parts)


def check_model(model: Path, ref_path: Path, bin_dir: Path, commit: str) -> list[str]:
    """Runs the three checks for one GGUF, updates its .ref.json; returns the disagreements found."""
    ref = json.loads(ref_path.read_text())
    problems = []

    tok_cmd = [str(bin_dir / "llama-tokenize"), "-m", str(model), "-p", ref["prompt_text"], "--ids", "--log-disable"]
    res = run(tok_cmd)
    m = re.search(r"\[[\d, ]*\]", res.stdout.decode())
    ids = json.loads(m.group(0)) if m else None
    if ids != ref["prompt_ids"]:
        problems.append(f"{model}: llama-tokenize gives {ids}, HF prompt_ids are {ref['prompt_ids']}")

    gen_cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", ref["prompt_text"], "-n", str(ref["n_gen"]),
               "--temp", "0", "-t", str(THREADS), "-c", "256", "-no-cnv", "--no-warmup", "-ctk", "f32", "-ctv", "f32",
               "-fa", "off", "--no-display-prompt"]
    # llama.cpp's logger writes from a worker thread; on this loaded 2-core machine a run's stdout was seen cut
    # short. A complete run ends with the blank line llama-completion prints last, so rerun until it does.
    for _ in range(5):
        res = run(gen_cmd)
        if res.stdout.endswith(b"\n\n"):
            break
    pieces = token_pieces(model)
    expected = b"".join(pieces[i] for i in ref["greedy"])
    got = res.stdout
    match = res.returncode == 0 and got == expected + b"\n\n"
    # Length of the common prefix in whole HF tokens: where llama.cpp's greedy path leaves HF's.
    agree, pos = 0, 0
    for i in ref["greedy"]:
        if got[pos:pos + len(pieces[i])] != pieces[i]:
            break
        pos += len(pieces[i])
        agree += 1
    ref["llama_cpp_greedy"] = {
        "llama_cpp_commit": commit,
        "command": shown(gen_cmd, bin_dir),
        "stdout": got.decode("utf-8", errors="backslashreplace"),
        "matches_hf_greedy": match,
        "hf_tokens_reproduced": agree,
        "method": "stdout bytes compared with the concatenated GGUF pieces of HF's greedy ids",
        "tokenize_command": shown(tok_cmd, bin_dir),
        "prompt_ids_match": ids == ref["prompt_ids"],
    }
    if not match:
        problems.append(f"{model}: llama.cpp greedy leaves HF's after {agree} of {ref['n_gen']} tokens "
                        f"(rc {res.returncode})")

    ppl_cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(REPO / PPL_TEXT), "-c", "128",
               "-b", "128", "-t", str(THREADS), "-ctk", "f32", "-ctv", "f32", "-fa", "off",
               "--no-warmup"]
    # stdout holds the running estimate after each chunk, "[i]ppl,"; the last one is the final PPL (same formula
    # as the "Final estimate" line on stderr, which is parsed only for its +/-). Rerun if the output is cut short.
    for _ in range(5):
        res = run(ppl_cmd)
        out, err = res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace")
        running = re.findall(r"\[(\d+)\]([\d.]+),", out)
        n_chunks = re.search(r"calculating perplexity over (\d+) chunks", err)
        if running and n_chunks and int(running[-1][0]) == int(n_chunks.group(1)):
            break
    else:
        running = []
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", err)
    ref["llama_cpp_perplexity"] = {
        "llama_cpp_commit": commit,
        "command": shown(ppl_cmd, bin_dir),
        "text": PPL_TEXT,
        "ppl": float(running[-1][1]) if running else None,
        "ppl_stderr": float(m.group(2)) if m else None,
        "n_chunks": int(running[-1][0]) if running else None,
        "n_ctx": 128,
        "protocol": "text tokenized whole, cut into floor(n_tokens/n_ctx) chunks of n_ctx tokens; the first token "
                    "of each chunk replaced by BOS if add_bos_token; logits at positions n_ctx/2 .. n_ctx-2 score "
                    "the next token (n_ctx/2 - 1 tokens per chunk); PPL = exp(mean NLL over all scored tokens)",
    }
    if not running:
        problems.append(f"{model}: llama-perplexity gave no result (rc {res.returncode})")
    ref_path.write_text(json.dumps(ref, indent=1) + "\n")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp build/bin with llama-completion etc.")
    ap.add_argument("--commit", required=True, help="llama.cpp commit of that build, recorded in the JSON")
    ap.add_argument("--models", type=Path, default=REPO / "tests/data/models")
    ap.add_argument("--arch", nargs="+", help="only these folders of --models (e.g. gptoss deepseekv3)")
    args = ap.parse_args()
    bin_dir = args.llama_bin.resolve()
    fatal = []
    for ref_path in sorted(args.models.glob("*/tiny-*.ref.json")):
        if args.arch and ref_path.parent.name not in args.arch:
            continue
        model = ref_path.with_name(ref_path.name.replace(".ref.json", ".gguf"))
        problems = check_model(model, ref_path, bin_dir, args.commit)
        r = json.loads(ref_path.read_text())
        print(f"{model.relative_to(REPO)}: greedy {'same' if r['llama_cpp_greedy']['matches_hf_greedy'] else 'DIFFERS'}"
              f" ({r['llama_cpp_greedy']['hf_tokens_reproduced']}/{r['n_gen']}), prompt ids "
              f"{'same' if r['llama_cpp_greedy']['prompt_ids_match'] else 'DIFFER'}, "
              f"ppl {r['llama_cpp_perplexity']['ppl']}")
        for p in problems:
            print("  " + p)
        if "f32" in model.name:
            fatal += problems
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
