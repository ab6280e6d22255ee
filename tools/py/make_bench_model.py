# Writes a random-weight MoE GGUF with the shapes of a real model (Qwen3-30B-A3B, Mixtral-8x7B or DeepSeek-V2-Lite) for
# throughput benchmarks (never committed; routing comes from replayed traces, not from these weights).
"""Benchmark models with real MoE shapes and random weights.

    python3 tools/py/make_bench_model.py --out /tmp/q30b-q8_0.gguf [--shape qwen3-30b-a3b] [--layers 48]
        [--type q8_0|bf16] [--tiny]
    python3 tools/py/make_bench_model.py --out /tmp/mixtral-q8_0.gguf --shape mixtral-8x7b
    python3 tools/py/make_bench_model.py --out /tmp/v2lite-q8_0.gguf --shape deepseek-v2-lite

Shapes (from each model's HF config.json):
- qwen3-30b-a3b (qwen3moe): 48 layers, hidden 2048, 32 query / 4 KV heads of 128 with QK-norm, 128 experts, top-8,
  expert FFN 768, vocab 151936, rope theta 1e6; ~32.5 GB in Q8_0.
- mixtral-8x7b (llama with experts): 32 layers, hidden 4096, 32 query / 8 KV heads of 128, no QK-norm, 8 experts,
  top-2, expert FFN 14336, vocab 32000, rope theta 1e6; ~49.6 GB in Q8_0 (187 MB per expert).
- deepseek-v2-lite (deepseek2): 27 layers, the first dense (FFN 10944), hidden 2048, 16 heads of multi-head latent
  attention without q-LoRA (kv_lora_rank 512, nope 128 + rope 64 key dims, value 128), 64 routed experts of 1408,
  top-6, softmax scores without renormalisation (weights scale 1, one expert group), 2 shared experts (one FFN of
  2 x 1408), vocab 102400, YaRN (factor 40, original context 4096, mscale = mscale_all_dim = 0.707), rope theta
  1e4; ~16.7 GB (15.6 GiB) in Q8_0, 14.2 GiB of it the 26 x 64 routed experts (561 MiB a layer). Keys and
  tensors as llama.cpp's converter (conversion/deepseek.py DeepseekV2Model, 0c1e57098) writes V2-Lite: the MQA
  view of MLA (head_count_kv 1, key_length 576, value_length 512, *_mla keys 192 / 128), attn_kv_b split into
  attn_k_b / attn_v_b, no q_lora_rank and no expert_weights_norm key (V2-Lite has neither), no exp_probs_b.
  llama.cpp loads a deepseek2 file without q_lora_rank only at 26 or 27 layers (src/models/deepseek2.cpp
  is_lite), so keep --layers at 27 (or 26) for it.
Weights are random with standard deviation ~0.02; the tensor data is streamed one tensor at a time, and a random
pool of 64 MiB is reused across tensors so that writing is disk-bound. The vocabulary is the GPT-2 byte alphabet plus
filler tokens (byte-level BPE for every shape), enough for llama.cpp and PreScope to load the file.
Types as llama.cpp's converter gives them for --outtype q8_0: every matrix Q8_0 (3-D expert stacks and attn_k_b /
attn_v_b included), norms and routers (ffn_gate_inp) F32.

--tiny keeps a shape's layers, experts and top-k (its routing topology: a trace of the full shape replays into it)
and shrinks every width and the vocabulary, for tests on the CPU (tests/py/test_make_bench_model.py).
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
    # DeepSeek-V2-Lite's config.json: first_k_dense_replace 1, intermediate_size 10944, q_lora_rank null,
    # kv_lora_rank 512, qk_nope/rope_head_dim 128/64, v_head_dim 128, n_routed_experts 64, num_experts_per_tok 6,
    # n_shared_experts 2, moe_intermediate_size 1408, scoring_func softmax, topk_method greedy, n_group = topk_group
    # = 1, norm_topk_prob false, routed_scaling_factor 1.0, rms_norm_eps 1e-6, max_position_embeddings 163840,
    # rope_theta 10000, rope_scaling yarn (factor 40, original 4096, beta_fast 32, beta_slow 1, mscale and
    # mscale_all_dim 0.707).
    "deepseek-v2-lite": dict(arch="deepseek2", name="deepseek-v2-lite", layers=27, n_dense=1, n_embd=2048,
                             n_head=16, kv_lora_rank=512, nope=128, rope=64, v_head=128, n_expert=64,
                             n_expert_used=6, n_shared=2, n_ff_exp=1408, n_ff_dense=10944, n_vocab=102400,
                             n_ctx=163840, rope_theta=1e4, pre="deepseek-llm",
                             yarn=dict(factor=40.0, original_context=4096, beta_fast=32.0, beta_slow=1.0,
                                       mscale_all_dim=0.707)),
}
# --tiny: widths and vocabulary of a CPU test model; layers, experts and top-k stay (every row a whole number of
# Q8_0 blocks of 32).
TINY = {
    "qwen3-30b-a3b": dict(n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff_exp=32, n_ff_dense=128, n_vocab=512),
    "mixtral-8x7b": dict(n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff_exp=128, n_ff_dense=128, n_vocab=512),
    "deepseek-v2-lite": dict(n_embd=128, n_head=4, kv_lora_rank=64, nope=32, rope=16, v_head=32, n_ff_exp=64,
                             n_ff_dense=256, n_vocab=512),
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


# (name, ggml shape with ne[0] first, quantised?) for every tensor, in file order.
Plan = list[tuple[str, list[int], bool]]


def gqa_keys(w: gguf.GGUFWriter, sh: dict, ftype: gguf.LlamaFileType) -> None:
    """Hyper-parameter keys of the qwen3moe and llama (Mixtral) shapes."""
    # llama.cpp reads a llama-architecture (Mixtral) expert's width from feed_forward_length.
    w.add_feed_forward_length(sh["n_ff_dense"])
    if sh["arch"] == "qwen3moe":
        w.add_expert_feed_forward_length(sh["n_ff_exp"])
    w.add_head_count(sh["n_head"])
    w.add_head_count_kv(sh["n_head_kv"])
    w.add_key_length(sh["head_dim"])
    w.add_value_length(sh["head_dim"])
    w.add_rope_dimension_count(sh["head_dim"])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6 if sh["arch"] == "qwen3moe" else 1e-5)
    w.add_expert_count(sh["n_expert"])
    w.add_expert_used_count(sh["n_expert_used"])
    w.add_file_type(ftype)


def deepseek2_keys(w: gguf.GGUFWriter, sh: dict, ftype: gguf.LlamaFileType) -> None:
    """deepseek2 keys as llama.cpp's converter writes them for DeepSeek-V2-Lite's config (TextModel's common and
    group keys, then DeepseekV2Model's), read back by src/arch/deepseek2.cpp."""
    y = sh["yarn"]
    w.add_feed_forward_length(sh["n_ff_dense"])  # the leading dense layers' FFN
    w.add_head_count(sh["n_head"])
    w.add_head_count_kv(1)  # MLA written as MQA over the latent
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(y["factor"])
    w.add_rope_scaling_orig_ctx_len(y["original_context"])
    w.add_rope_scaling_yarn_beta_fast(y["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(y["beta_slow"])
    w.add_rope_freq_base(sh["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(sh["n_expert"])
    w.add_expert_used_count(sh["n_expert_used"])
    w.add_expert_group_count(1)
    w.add_expert_group_used_count(1)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_file_type(ftype)
    w.add_leading_dense_block_count(sh["n_dense"])
    w.add_vocab_size(sh["n_vocab"])
    # No q_lora_rank: V2-Lite projects q directly (attn_q). No expert_weights_norm: llama.cpp writes it only when
    # norm_topk_prob is true, and V2-Lite's is false (both readers default to false).
    w.add_kv_lora_rank(sh["kv_lora_rank"])
    w.add_key_length(sh["kv_lora_rank"] + sh["rope"])
    w.add_value_length(sh["kv_lora_rank"])
    w.add_key_length_mla(sh["nope"] + sh["rope"])
    w.add_value_length_mla(sh["v_head"])
    w.add_expert_feed_forward_length(sh["n_ff_exp"])
    w.add_expert_shared_count(sh["n_shared"])
    w.add_expert_weights_scale(1.0)
    w.add_rope_dimension_count(sh["rope"])
    # llama.cpp's converter stores 0.1 x mscale_all_dim here and its loader divides by 0.1 again
    # ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]); src/arch/arch.cpp read_rope_scaling does the same.
    w.add_rope_scaling_yarn_log_mul(0.1 * y["mscale_all_dim"])


def gqa_plan(sh: dict, n_layers: int) -> Plan:
    """Tensors of the qwen3moe and llama (Mixtral) shapes."""
    n_embd, head_dim, n_vocab, n_expert = sh["n_embd"], sh["head_dim"], sh["n_vocab"], sh["n_expert"]
    plan: Plan = [("token_embd.weight", [n_embd, n_vocab], True), ("output_norm.weight", [n_embd], False),
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
    return plan


def deepseek2_plan(sh: dict, n_layers: int) -> Plan:
    """Tensors of the deepseek2 shape with the ggml shapes src/arch/deepseek2.cpp and llama.cpp's
    llama_model_deepseek2::load_arch_tensors check: plain attn_q (no q-LoRA), attn_kv_a_mqa and its norm, the
    split attn_k_b {nope, kv_lora_rank, n_head} / attn_v_b {kv_lora_rank, v, n_head}; a dense FFN in the leading
    layers; a router, routed expert stacks and the shared experts as one FFN of n_shared x n_ff_exp elsewhere."""
    n_embd, n_vocab, n_expert, n_head = sh["n_embd"], sh["n_vocab"], sh["n_expert"], sh["n_head"]
    r, nope, rope, dv = sh["kv_lora_rank"], sh["nope"], sh["rope"], sh["v_head"]
    ff, ff_sh, ff_dense = sh["n_ff_exp"], sh["n_shared"] * sh["n_ff_exp"], sh["n_ff_dense"]
    plan: Plan = [("token_embd.weight", [n_embd, n_vocab], True), ("output_norm.weight", [n_embd], False),
                  ("output.weight", [n_embd, n_vocab], True)]
    for i in range(n_layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", [n_embd], False),
                 (p + "attn_q.weight", [n_embd, n_head * (nope + rope)], True),
                 (p + "attn_kv_a_mqa.weight", [n_embd, r + rope], True),
                 (p + "attn_kv_a_norm.weight", [r], False),
                 (p + "attn_k_b.weight", [nope, r, n_head], True),
                 (p + "attn_v_b.weight", [r, dv, n_head], True),
                 (p + "attn_output.weight", [n_head * dv, n_embd], True),
                 (p + "ffn_norm.weight", [n_embd], False)]
        if i < sh["n_dense"]:
            plan += [(p + "ffn_gate.weight", [n_embd, ff_dense], True), (p + "ffn_up.weight", [n_embd, ff_dense], True),
                     (p + "ffn_down.weight", [ff_dense, n_embd], True)]
            continue
        plan += [(p + "ffn_gate_inp.weight", [n_embd, n_expert], False),
                 (p + "ffn_gate_exps.weight", [n_embd, ff, n_expert], True),
                 (p + "ffn_up_exps.weight", [n_embd, ff, n_expert], True),
                 (p + "ffn_down_exps.weight", [ff, n_embd, n_expert], True),
                 (p + "ffn_gate_shexp.weight", [n_embd, ff_sh], True),
                 (p + "ffn_up_shexp.weight", [n_embd, ff_sh], True),
                 (p + "ffn_down_shexp.weight", [ff_sh, n_embd], True)]
    return plan


def shape_of(name: str, tiny: bool = False) -> dict:
    """SHAPES[name], with TINY[name]'s widths when tiny."""
    return dict(SHAPES[name], **(TINY[name] if tiny else {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, help="fewer layers than the real model (default: all)")
    ap.add_argument("--type", choices=["q8_0", "bf16"], default="q8_0")
    ap.add_argument("--tiny", action="store_true",
                    help="small widths and vocabulary, the shape's layers, experts and top-k (CPU tests)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    sh = shape_of(args.shape, args.tiny)
    n_layers = args.layers or sh["layers"]
    if sh["arch"] == "deepseek2" and n_layers <= sh["n_dense"]:
        ap.error(f"--layers {n_layers}: {args.shape} needs more than its {sh['n_dense']} leading dense layer(s)")
    n_vocab = sh["n_vocab"]
    qtype = gguf.GGMLQuantizationType.Q8_0 if args.type == "q8_0" else gguf.GGMLQuantizationType.BF16
    ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if args.type == "q8_0" else gguf.LlamaFileType.MOSTLY_BF16
    w = gguf.GGUFWriter(str(args.out), sh["arch"])
    w.add_name(f"{sh['name']}-shape-random-{n_layers}l" + ("-tiny" if args.tiny else ""))
    w.add_context_length(sh["n_ctx"])
    w.add_embedding_length(sh["n_embd"])
    w.add_block_count(n_layers)
    if sh["arch"] == "deepseek2":
        deepseek2_keys(w, sh, ftype)
        plan = deepseek2_plan(sh, n_layers)
    else:
        gqa_keys(w, sh, ftype)
        plan = gqa_plan(sh, n_layers)
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
