#!/usr/bin/env python3
# Quantised test files and llama.cpp's outputs on them (tests/data/quant/, README.md there): runs an already built
# llama.cpp (a peer outside the repository, never built or vendored by us) on the demo and the tiny models.
"""llama-quantize the demo and tiny models, then record llama.cpp's perplexity, logits and greedy runs.

    python3 tools/py/make_quant_expectations.py --llama-bin /tmp/peer/llama.cpp/build/bin --commit d32676d77 \
        [--only tiny-qwen3moe-q4_0 ...] [--work /tmp/prescope-quant]

For each model of models() and type of TYPES: `llama-quantize --allow-requantize SOURCE OUT TYPE 2`, then
  - the tensor types of OUT (gguf package), per tensor and counted per type;
  - llama-perplexity on tests/data/text/wikipedia-20k.txt (F32 KV cache, no flash attention, 2 threads);
  - through libllama's C API (ctypes; the same calls as llama-completion: the prompt as one batch, then one token
    per llama_decode): the logits after each prompt (top 16; for the tiny models every logit of prompt 0 in
    <name>.logits.f32) and a greedy continuation with the top-1 minus top-2 logit margin at every step.
--completion-check and --repack-diff write nothing: the first checks the recorded greedy runs against
llama-completion's output, the second measures how far llama.cpp's logits move with its weight repacking off.
Writes tests/data/quant/<name>.json (format: tests/data/quant/README.md). The GGUFs in COMMITTED go to
tests/data/quant/, all others (the demo's are 14-21 MB each) to --work; every JSON records the file's sha256.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests/data/quant"
PPL_TEXT = "tests/data/text/wikipedia-20k.txt"
THREADS = 2
TOP_K = 16
TYPES = ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"]
ARCHS = ["qwen3moe", "qwen2moe", "mixtral", "olmoe"]
# The files committed under tests/data/quant/: one type per architecture, together every type the tiny shapes can
# hold (Q4_0, Q5_0, Q5_1, Q8_0, IQ4_NL). The tree must stay under 64 MiB (decision 0002), so the other files are
# rebuilt by this script into --work; their JSON records the sha256 that the rebuilt file must have.
COMMITTED = {"tiny-qwen3moe-q4_0", "tiny-olmoe-q4_k_m", "tiny-qwen2moe-q5_k_m", "tiny-mixtral-iq4_xs"}


def models() -> dict[str, dict]:
    """name -> source GGUF, prompts (token ids), greedy length, perplexity context."""
    out = {}
    demo_ref = json.loads((REPO / "tests/data/demo/reference.json").read_text())
    out["demo"] = {"source": "models/demo/demo-q8_0.gguf", "n_gen": 32, "n_ctx": 256,
                   "prompts": [p["prompt_ids"] for p in demo_ref["prompts"]],
                   "prompt_text": demo_ref["prompts"][0]["text"],
                   "prompt_source": "tests/data/demo/reference.json prompts[*].prompt_ids"}
    for arch in ARCHS:
        ref = json.loads((REPO / f"tests/data/models/{arch}/tiny-f32.ref.json").read_text())
        out[f"tiny-{arch}"] = {"source": f"tests/data/models/{arch}/tiny-f32.gguf", "n_gen": ref["n_gen"], "n_ctx": 128,
                               "prompts": [ref["prompt_ids"]], "prompt_text": ref["prompt_text"],
                               "prompt_source": f"tests/data/models/{arch}/tiny-f32.ref.json prompt_ids"}
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rel(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def tensor_types(path: Path) -> dict[str, str]:
    """Tensor name -> ggml type name (gguf package), in file order."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


# ---- libllama through ctypes (struct layouts of include/llama.h at the recorded commit) -------------------------

class ModelParams(ctypes.Structure):
    _fields_ = [("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
                ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
                ("main_gpu", ctypes.c_int32), ("tensor_split", ctypes.c_void_p), ("progress_callback", ctypes.c_void_p),
                ("progress_callback_user_data", ctypes.c_void_p), ("kv_overrides", ctypes.c_void_p),
                ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool), ("use_extra_bufts", ctypes.c_bool),
                ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool), ("load_mtp", ctypes.c_bool)]


class ContextParams(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "n_outputs_max")] + \
               [("n_threads", ctypes.c_int32), ("n_threads_batch", ctypes.c_int32)] + \
               [(n, ctypes.c_int) for n in ("ctx_type", "rope_scaling_type", "pooling_type", "attention_type",
                                            "flash_attn_type")] + \
               [(n, ctypes.c_float) for n in ("rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
                                              "yarn_beta_fast", "yarn_beta_slow")] + \
               [("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
                ("cb_eval", ctypes.c_void_p), ("cb_eval_user_data", ctypes.c_void_p),
                ("type_k", ctypes.c_int), ("type_v", ctypes.c_int),
                ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p)] + \
               [(n, ctypes.c_bool) for n in ("embeddings", "offload_kqv", "no_perf", "op_offload", "swa_full",
                                             "kv_unified")] + \
               [("samplers", ctypes.c_void_p), ("n_samplers", ctypes.c_size_t), ("ctx_other", ctypes.c_void_p)]


class Batch(ctypes.Structure):
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)),
                ("embd", ctypes.POINTER(ctypes.c_float)), ("pos", ctypes.POINTER(ctypes.c_int32)),
                ("n_seq_id", ctypes.POINTER(ctypes.c_int32)), ("seq_id", ctypes.c_void_p),
                ("logits", ctypes.POINTER(ctypes.c_int8))]


class Llama:
    """The few libllama calls llama-completion makes for a greedy run, on the CPU backend."""

    def __init__(self, lib: Path):
        L = self.lib = ctypes.CDLL(str(lib))
        L.llama_backend_init.restype = None
        L.llama_model_default_params.restype = ModelParams
        L.llama_context_default_params.restype = ContextParams
        L.llama_model_load_from_file.restype = ctypes.c_void_p
        L.llama_model_load_from_file.argtypes = [ctypes.c_char_p, ModelParams]
        L.llama_init_from_model.restype = ctypes.c_void_p
        L.llama_init_from_model.argtypes = [ctypes.c_void_p, ContextParams]
        L.llama_model_get_vocab.restype = ctypes.c_void_p
        L.llama_model_get_vocab.argtypes = [ctypes.c_void_p]
        L.llama_vocab_n_tokens.restype = ctypes.c_int32
        L.llama_vocab_n_tokens.argtypes = [ctypes.c_void_p]
        L.llama_batch_get_one.restype = Batch
        L.llama_batch_get_one.argtypes = [ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
        L.llama_decode.restype = ctypes.c_int32
        L.llama_decode.argtypes = [ctypes.c_void_p, Batch]
        L.llama_get_logits_ith.restype = ctypes.POINTER(ctypes.c_float)
        L.llama_get_logits_ith.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        L.llama_free.argtypes = [ctypes.c_void_p]
        L.llama_model_free.argtypes = [ctypes.c_void_p]
        L.llama_backend_init()
        # The layouts above must be this commit's: its defaults (llama-context.cpp, llama-model.cpp) read back.
        cp, mp = L.llama_context_default_params(), L.llama_model_default_params()
        got = (cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.flash_attn_type, cp.yarn_attn_factor, cp.type_k, cp.offload_kqv,
               cp.kv_unified, cp.n_samplers, mp.n_gpu_layers, mp.use_extra_bufts, mp.load_mtp)
        if got != (512, 2048, 512, -1, -1.0, 1, True, False, 0, -1, True, False):
            raise SystemExit(f"{lib}: llama.h struct layouts differ from this script's ({got}); use the recorded commit")

    def run(self, model_path: Path, prompts: list[list[int]], n_gen: int, n_ctx: int, repack: bool = True):
        """Per prompt: (logits after the prompt, greedy ids, top-1 minus top-2 logit at each greedy step).
        repack=False turns the CPU backend's weight repacking off (llama.cpp's --no-repack)."""
        L = self.lib
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = repack
        model = L.llama_model_load_from_file(str(model_path).encode(), mp)
        if not model:
            raise SystemExit(f"{model_path}: llama.cpp cannot load it")
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        results = []
        for prompt in prompts:
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, n_ctx
            cp.n_threads = cp.n_threads_batch = THREADS
            cp.flash_attn_type = 0            # LLAMA_FLASH_ATTN_TYPE_DISABLED, as -fa off
            cp.type_k = cp.type_v = 0         # GGML_TYPE_F32, as -ctk f32 -ctv f32
            ctx = L.llama_init_from_model(model, cp)
            tokens = (ctypes.c_int32 * len(prompt))(*prompt)
            if L.llama_decode(ctx, L.llama_batch_get_one(tokens, len(prompt))) != 0:
                raise SystemExit(f"{model_path}: llama_decode failed on the prompt")
            first = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
            logits, greedy, margins = first, [], []
            for _ in range(n_gen):
                order = np.argsort(-logits.astype(np.float64), kind="stable")
                greedy.append(int(order[0]))
                margins.append(float(logits[order[0]] - logits[order[1]]))
                one = (ctypes.c_int32 * 1)(greedy[-1])
                if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
                    raise SystemExit(f"{model_path}: llama_decode failed at a greedy step")
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
            L.llama_free(ctx)
            results.append((first, greedy, margins))
        L.llama_model_free(model)
        return results


# ---- the llama.cpp tools ---------------------------------------------------------------------------------------

def shown(cmd: list[str], bin_dir: Path) -> str:
    return shlex.join(str(Path(c).relative_to(bin_dir)) if c.startswith(str(bin_dir)) else rel(Path(c))
                      if c.startswith("/") else c for c in cmd)


def quantize(bin_dir: Path, src: Path, out: Path, qtype: str) -> str:
    cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(src), str(out), qtype, str(THREADS)]
    res = subprocess.run(cmd, capture_output=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{shown(cmd, bin_dir)} failed:\n{res.stderr.decode(errors='replace')[-2000:]}")
    return shown(cmd, bin_dir)


def perplexity(bin_dir: Path, model: Path, n_ctx: int) -> dict:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(REPO / PPL_TEXT), "-c", str(n_ctx),
           "-b", str(n_ctx), "-t", str(THREADS), "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--no-warmup"]
    # The last running estimate "[i]ppl," on stdout is the final PPL; rerun if the output was cut short (the
    # asynchronous logger lost lines on this loaded machine before, docs/references.md).
    for _ in range(5):
        res = subprocess.run(cmd, capture_output=True, timeout=1800)
        out, err = res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace")
        running = re.findall(r"\[(\d+)\]([\d.]+),", out)
        chunks = re.search(r"calculating perplexity over (\d+) chunks", err)
        if running and chunks and int(running[-1][0]) == int(chunks.group(1)):
            break
    else:
        raise SystemExit(f"{shown(cmd, bin_dir)}: no complete result")
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", err)
    return {"command": shown(cmd, bin_dir), "text": PPL_TEXT, "n_ctx": n_ctx, "ppl": float(running[-1][1]),
            "ppl_stderr": float(m.group(2)) if m else None, "n_chunks": int(running[-1][0]),
            "protocol": "text tokenized whole, cut into floor(n_tokens/n_ctx) chunks of n_ctx tokens (BOS first if "
                        "add_bos_token); logits at positions n_ctx/2 .. n_ctx-2 score the next token; "
                        "PPL = exp(mean NLL)"}


def make(name: str, qtype: str, spec: dict, args, llama: Llama) -> Path:
    src = REPO / spec["source"]
    fname = f"{name}-{qtype.lower()}"
    out_dir = OUT if fname in COMMITTED else args.work
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = out_dir / f"{fname}.gguf"
    qcmd = quantize(args.llama_bin, src, gguf_path, qtype)
    types = tensor_types(gguf_path)
    ppl = perplexity(args.llama_bin, gguf_path, spec["n_ctx"])
    runs = llama.run(gguf_path, spec["prompts"], spec["n_gen"], max(spec["n_ctx"], 256))
    prompts = []
    for ids, (first, greedy, margins) in zip(spec["prompts"], runs):
        top = np.argsort(-first.astype(np.float64), kind="stable")[:TOP_K]
        prompts.append({"prompt_ids": ids, "top_ids": [int(i) for i in top],
                        "top_logits": [float(first[i]) for i in top], "greedy": greedy,
                        "greedy_top1_margin": [round(m, 6) for m in margins]})
    # Every logit of prompt 0 for the tiny models (4 KB); the demo's 8192-wide rows keep only the top 16.
    first0 = runs[0][0].astype("<f4")
    if first0.size <= 1000:
        first0.tofile(OUT / f"{fname}.logits.f32")
    doc = {
        "file": rel(gguf_path) if out_dir == OUT else f"{fname}.gguf",
        "committed": out_dir == OUT,
        "bytes": gguf_path.stat().st_size, "sha256": sha256(gguf_path),
        "source": spec["source"], "source_sha256": sha256(src), "type": qtype,
        "llama_cpp_commit": args.commit, "quantize_command": qcmd,
        "tensor_type_counts": dict(sorted(Counter(types.values()).items())), "tensor_types": types,
        "perplexity": ppl,
        "logits": {"how": "libllama via ctypes: llama_decode of the prompt as one batch (n_batch = n_ubatch = n_ctx), "
                          "then one token per llama_decode, as llama-completion does; F32 KV cache, flash attention "
                          f"off, {THREADS} threads, CPU backend with its default weight repacking",
                   "n_ctx": max(spec["n_ctx"], 256), "prompt_source": spec["prompt_source"],
                   "first_logits_file": f"{fname}.logits.f32" if first0.size <= 1000 else None,
                   "first_logits_shape": [int(first0.size)],
                   "first_logits_note": "float32 logits after prompts[0] (the position that predicts greedy[0])"},
        "prompts": prompts,
    }
    (OUT / f"{fname}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{fname}: {gguf_path.stat().st_size} bytes, {doc['tensor_type_counts']}, ppl {ppl['ppl']}, "
          f"min margin {min(min(p['greedy_top1_margin']) for p in prompts):.4f}")
    return gguf_path


def completion_check(args) -> int:
    """llama-completion --temp 0 on prompt 0's text: its stdout must be the pieces of the JSON's greedy ids."""
    from llama_cpp_check import token_pieces  # tools/py
    bad = 0
    for name, spec in models().items():
        for qtype in TYPES:
            fname = f"{name}-{qtype.lower()}"
            path = (OUT if fname in COMMITTED else args.work) / f"{fname}.gguf"
            if (args.only and fname not in args.only) or not path.exists():
                continue
            greedy = json.loads((OUT / f"{fname}.json").read_text())["prompts"][0]["greedy"]
            cmd = [str(args.llama_bin / "llama-completion"), "-m", str(path), "-p", spec["prompt_text"], "-n",
                   str(len(greedy)), "--temp", "0", "-t", str(THREADS), "-c", "256", "-no-cnv", "--no-warmup",
                   "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--no-display-prompt"]
            for _ in range(5):  # complete runs end with a blank line (docs/references.md)
                got = subprocess.run(cmd, capture_output=True, timeout=600).stdout
                if got.endswith(b"\n\n"):
                    break
            # llama-completion prints each piece with printf("%s"), so a piece that is a NUL byte prints nothing.
            pieces = token_pieces(path)
            same = got == b"".join(pieces[i] for i in greedy).replace(b"\0", b"") + b"\n\n"
            bad += not same
            print(f"{fname}: llama-completion {'reproduces' if same else 'DIFFERS from'} the recorded greedy run")
    return 1 if bad else 0


def repack_diff(args, llama: Llama) -> int:
    """llama.cpp against itself: max |logit difference| after each prompt, repacking on vs off, relative to the
    largest |logit|, and the first greedy step where the two runs differ (docs/decisions/0071, margin rule)."""
    for name, spec in models().items():
        for qtype in TYPES:
            fname = f"{name}-{qtype.lower()}"
            if args.only and fname not in args.only:
                continue
            path = (OUT if fname in COMMITTED else args.work) / f"{fname}.gguf"
            if not path.exists():
                print(f"{fname}: {path} missing, skipped")
                continue
            on = llama.run(path, spec["prompts"], spec["n_gen"], max(spec["n_ctx"], 256))
            off = llama.run(path, spec["prompts"], spec["n_gen"], max(spec["n_ctx"], 256), repack=False)
            for k, ((a, ga, _), (b, gb, _)) in enumerate(zip(on, off)):
                same = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), len(ga))
                print(f"{fname} prompt {k}: max |dlogit| {np.abs(a - b).max() / np.abs(a).max():.2e} of max |logit|, "
                      f"greedy identical for {same}/{len(ga)} steps")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp build/bin (llama-quantize, libllama.so)")
    ap.add_argument("--commit", required=True, help="llama.cpp commit of that build, recorded in the JSON")
    ap.add_argument("--work", type=Path, default=Path("/tmp/prescope-quant"),
                    help="where the files that are not committed go")
    ap.add_argument("--only", nargs="*", help="names like tiny-qwen3moe-q4_0 or demo-q4_k_m")
    ap.add_argument("--completion-check", action="store_true",
                    help="write nothing; check that llama-completion's greedy output on the text of prompt 0 is the "
                         "recorded greedy run (shows the ctypes layouts and calls are right)")
    ap.add_argument("--repack-diff", action="store_true",
                    help="write nothing; print how far llama.cpp's logits move with weight repacking off, for the "
                         "files already made (committed ones here, the others in --work)")
    args = ap.parse_args()
    args.llama_bin = args.llama_bin.resolve()
    llama = Llama(args.llama_bin / "libllama.so")
    if args.repack_diff:
        return repack_diff(args, llama)
    if args.completion_check:
        return completion_check(args)
    for name, spec in models().items():
        for qtype in TYPES:
            if args.only and f"{name}-{qtype.lower()}" not in args.only:
                continue
            make(name, qtype, spec, args, llama)
    return 0


if __name__ == "__main__":
    sys.exit(main())
