# Writes a random-weight MoE GGUF with the shapes of a real model (Qwen3-30B-A3B or Mixtral-8x7B) for throughput
# benchmarks (never committed; routing comes from replayed traces, not from these weights).
"""Benchmark models with real MoE shapes and random weights.

    python3 tools/py/make_bench_model.py --out /tmp/q30b-q8_0.gguf [--shape qwen3-30b-a3b] [--layers 48]
        [--type q8_0|bf16]
    python3 tools/py/make_bench_model.py --out /tmp/mixtral-q8_0.gguf --shape mixtral-8x7b

Shapes (from each model's HF config.json):
- qwen3-30b-a3b (qwen3moe): 48 layers, hidden 2048, 32 query / 4 KV heads of 128 with QK-norm, 128 experts, top-8,
  expert FFN 768, vocab 151936, rope theta 1e6; ~32.5 GB in Q8_0.
- mixtral-8x7b (llama with experts): 32 layers, hidden 4096, 32 query / 8 KV heads of 128, no QK-norm, 8 experts,
  top-2, expert FFN 14336, vocab 32000, rope theta 1e6; ~49.6 GB in Q8_0 (187 MB per expert).
Weights are random with standard deviation ~0.02; the tensor data is streamed one tensor at a time, and a random
pool of 64 MiB is reused across tensors so that writing is disk-bound. The vocabulary is the GPT-2 byte alphabet plus
filler tokens (byte-level BPE for both shapes), enough for llama.cpp and PreScope to load the file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import gguf

from byte_level import byte_alphabet  # tools/py, next to this script

SHAPES = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", name="qwen3-30b-a3b", layers=48, n_embd=2048, n_head=32, n_head_kv=4,
                          head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768, n_ff_dense=6144,
                          n_vocab=151936, n_ctx=40960, qk_norm=True, pre="qwen2"),
    "mixtral-8x7b": dict(arch="llama", name="mixtral-8x7b", layers=32, n_embd=4096, n_head=32, n_head_kv=8,
                         head_dim=128, n_expert=8, n_expert_used=2, n_ff_exp=14336, n_ff_dense=14336, n_vocab=32000,
                         n_ctx=32768, qk_norm=False, pre="llama-bpe"),
}
STD = 0.02


class Pool:
    """Random bytes reused across tensors: fresh values within a tensor, cheap to produce."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.q8 = rng.integers(-127, 128, size=64 << 20, dtype=np.int8)
        self.bf16 = (rng.standard_normal(32 << 20, dtype=np.float32) * STD).view(np.uint32) >> 16
        self.bf16 = self.bf16.astype(np.uint16)
        self.pos = 0

    def take(self, arr: np.ndarray, n: int) -> np.ndarray:
        out = np.empty(n, dtype=arr.dtype)
        done = 0
        while done < n:
            start = self.pos % len(arr)
            k = min(n - done, len(arr) - start)
            out[done:done + k] = arr[start:start + k]
            done += k
            self.pos += k + 4099  # a prime stride so consecutive tensors differ
        return out


def q8_0_tensor(pool: Pool, shape: list[int]) -> np.ndarray:
    """Q8_0 bytes for a tensor of ggml shape `shape` (ne[0] fastest), blocks of F16 scale + 32 int8."""
    n = int(np.prod(shape))
    n_blocks = n // 32
    qs = pool.take(pool.q8, n).reshape(n_blocks, 32)
    scale = np.full((n_blocks, 1), STD / 73.0, dtype=np.float16).view(np.uint8).reshape(n_blocks, 2)
    blocks = np.concatenate([scale, qs.view(np.uint8)], axis=1)
    return blocks.reshape(*reversed(shape[1:]), shape[0] // 32 * 34)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, help="fewer layers than the real model (default: all)")
    ap.add_argument("--type", choices=["q8_0", "bf16"], default="q8_0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    sh = SHAPES[args.shape]
    n_layers = args.layers or sh["layers"]
    n_embd, head_dim, n_vocab, n_expert = sh["n_embd"], sh["head_dim"], sh["n_vocab"], sh["n_expert"]
    qtype = gguf.GGMLQuantizationType.Q8_0 if args.type == "q8_0" else gguf.GGMLQuantizationType.BF16
    w = gguf.GGUFWriter(str(args.out), sh["arch"])
    w.add_name(f"{sh['name']}-shape-random-{n_layers}l")
    w.add_context_length(sh["n_ctx"])
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layers)
    # llama.cpp reads a llama-architecture (Mixtral) expert's width from feed_forward_length.
    w.add_feed_forward_length(sh["n_ff_dense"])
    if sh["arch"] == "qwen3moe":
        w.add_expert_feed_forward_length(sh["n_ff_exp"])
    w.add_head_count(sh["n_head"])
    w.add_head_count_kv(sh["n_head_kv"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6 if sh["arch"] == "qwen3moe" else 1e-5)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(sh["n_expert_used"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if args.type == "q8_0" else gguf.LlamaFileType.MOSTLY_BF16)
    # One merge (two spaces) because llama.cpp requires a non-empty merges list for gpt2 vocabularies.
    tokens = byte_alphabet() + ["\u0120\u0120"] + [f"<filler{i}>" for i in range(n_vocab - 256 - 2)] + ["<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(sh["pre"])
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (n_vocab - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(["\u0120 \u0120"])
    w.add_eos_token_id(n_vocab - 1)
    w.add_bos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)

    # (name, ggml shape, quantised?) in file order.
    plan: list[tuple[str, list[int], bool]] = [("token_embd.weight", [n_embd, n_vocab], True),
                                               ("output_norm.weight", [n_embd], False),
                                               ("output.weight", [n_embd, n_vocab], True)]
    q, kv, ff = sh["n_head"] * head_dim, sh["n_head_kv"] * head_dim, sh["n_ff_exp"]
    for i in range(n_layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", [n_embd], False), (p + "attn_q.weight", [n_embd, q], True),
                 (p + "attn_k.weight", [n_embd, kv], True), (p + "attn_v.weight", [n_embd, kv], True),
                 (p + "attn_output.weight", [q, n_embd], True)]
        if sh["qk_norm"]:
            plan += [(p + "attn_q_norm.weight", [head_dim], False), (p + "attn_k_norm.weight", [head_dim], False)]
        plan += [(p + "ffn_norm.weight", [n_embd], False), (p + "ffn_gate_inp.weight", [n_embd, n_expert], False),
                 (p + "ffn_gate_exps.weight", [n_embd, ff, n_expert], True),
                 (p + "ffn_up_exps.weight", [n_embd, ff, n_expert], True),
                 (p + "ffn_down_exps.weight", [ff, n_embd, n_expert], True)]

    def nbytes(shape: list[int], quant: bool) -> int:
        n = int(np.prod(shape))
        if not quant:
            return 4 * n
        return n // 32 * 34 if qtype == gguf.GGMLQuantizationType.Q8_0 else 2 * n

    for name, shape, quant in plan:
        raw = qtype if quant else gguf.GGMLQuantizationType.F32
        dtype = np.uint8 if raw == gguf.GGMLQuantizationType.Q8_0 else (np.uint16 if quant else np.float32)
        rshape = list(reversed(shape))
        if raw == gguf.GGMLQuantizationType.Q8_0:
            rshape[-1] = rshape[-1] // 32 * 34  # gguf-py takes the byte shape of quantised tensors
        w.add_tensor_info(name, rshape, np.dtype(dtype), nbytes(shape, quant), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    pool = Pool(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    for i, (name, shape, quant) in enumerate(plan):
        if not quant:
            n = int(np.prod(shape))
            data = (np.ones(n, np.float32) if name.endswith("norm.weight")
                    else rng.standard_normal(n, dtype=np.float32) * STD).reshape(list(reversed(shape)))
        elif qtype == gguf.GGMLQuantizationType.Q8_0:
            data = q8_0_tensor(pool, shape)
        else:
            data = pool.take(pool.bf16, int(np.prod(shape))).reshape(list(reversed(shape)))
        w.write_tensor_data(data)
        if i % 12 == 0:
            print(f"{i + 1}/{len(plan)} {name}", file=sys.stderr, flush=True)
    w.close()
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
