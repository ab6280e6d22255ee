#!/usr/bin/env python3
# Writes the tiny random-weight test models (qwen3moe, qwen2moe, mixtral, olmoe, deepseekv3, deepseekv2lite, gptoss)
# as HF checkpoints, converts them to GGUF F32 and a quantized variant (Q8_0; gptoss: Q8_0 with MXFP4 experts) with
# our converter, and stores HF transformers reference logits and greedy tokens for each.
"""Tiny MoE test models and their HF references (tests/data/models/<arch>/).

    python3 tools/py/make_tiny_models.py [--arch qwen3moe ...] [--out tests/data/models] [--work /tmp/prescope-tiny]

Per arch, for the first seed whose references keep clear of ties (see MIN_RELATIVE_MARGIN):
    tiny-f32.gguf, tiny-q8_0.gguf (gptoss: tiny-mxfp4.gguf)  converted from the same safetensors
    tiny-<type>.ref.json                              prompt ids, 32 greedy ids, shapes, margins, provenance
    tiny-<type>.ref.f32                               raw little-endian float32 logits [n_pos][n_vocab]
The quantized reference is HF run on that file's weights dequantized with gguf.quants. The HF checkpoints
(safetensors, tokenizer) stay in --work; they are regenerated bit for bit by rerunning this script.
Also writes tests/data/text/wikipedia-20k.txt, the perplexity text. Deterministic: fixed seeds, CPU, float32.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert_hf_to_gguf as conv  # noqa: E402
import hf_reference as hr  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEXT_DIR = Path("/work/shared/realdata/text/olmoe-routing-text")
TEXT_FILES = ["arxiv_texts.txt", "b3g_texts.txt", "c4_texts.txt", "github_oss_with_stack_texts.txt",
              "wikipedia_texts.txt"]
TOKENIZER_TRAIN_BYTES = 400_000  # first bytes of each file: 2 MB of tokenizer training text
PPL_SOURCE = ("wikipedia_texts.txt", 1_000_000, 20_000)  # (file, offset, bytes): outside the tokenizer text
PROMPT_SOURCE = ("b3g_texts.txt", 600_000)  # prompt: first line prefix there that is exactly N_PROMPT tokens
N_PROMPT = 24
N_GEN = 32
N_VOCAB = 1000
SEEDS = range(1, 200)
# Greedy steps and routing must be far from ties so that float rounding cannot flip them: the smallest
# top-1 minus top-2 logit along the sequence, and the smallest k-th minus (k+1)-th router logit, each as a
# fraction of the largest |logit| (resp. |router logit|). Float32 rounding is ~1e-6 of that scale (the
# f32_vs_f64 figure in each .ref.json), so these leave two to three orders of magnitude. The router bound is
# lower because it applies to n_layer x n_pos gaps between 8 experts, which tie far more often than logits.
MIN_RELATIVE_MARGIN = {"logit": 1e-3, "router": 1e-4}
# A greedy run stuck on one token would check little of the decode path (position, KV cache).
MIN_DISTINCT_GREEDY = 12

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# tiktoken's O200K_PAT_STR as openai/gpt-oss's tokenizer.json splits with it (pre-tokenizer "gpt-4o").
O200K_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX = {"qwen2": QWEN2_REGEX, "llama-bpe": LLAMA3_REGEX, "gpt-4o": O200K_REGEX}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
MISTRAL_INST = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}"
                "{% endif %}{% endfor %}")


@dataclass
class TinySpec:
    """One tiny model: HF class, config values, tokenizer kind and the special token strings."""
    arch: str
    hf_class: str
    tokenizer: str  # "qwen2" | "llama-bpe" | "gpt-4o" (byte-level BPE) | "spm" (SentencePiece)
    config: dict = field(default_factory=dict)
    embed_std: float = 1.0  # smaller for a tied head, else each token's own embedding dominates its logits
    # The quantized variants beside F32: (file stem, converter outtype, MXFP4 experts).
    variants: tuple[tuple[str, str, bool], ...] = (("q8_0", "q8_0", False),)
    # The fused expert parameters are [E, in, out] (GptOssExperts), and their gate activations should reach the
    # clamp (swiglu_limit) often enough for the references to depend on it.
    experts_in_out: bool = False


COMMON = dict(vocab_size=N_VOCAB, hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=2048,
              num_experts_per_tok=2)
TINY = {
    "qwen3moe": TinySpec("qwen3moe", "Qwen3MoeForCausalLM", "qwen2", dict(
        COMMON, num_hidden_layers=4, num_key_value_heads=2, num_experts=8, moe_intermediate_size=32,
        intermediate_size=128, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen2moe": TinySpec("qwen2moe", "Qwen2MoeForCausalLM", "qwen2", dict(
        COMMON, num_hidden_layers=3, num_key_value_heads=2, num_experts=8, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, intermediate_size=128, norm_topk_prob=False, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=False)),
    # Mixtral always renormalises the top-k weights (no norm_topk_prob in its config); tied head on purpose,
    # so one test model covers the output = token_embd fallback.
    "mixtral": TinySpec("mixtral", "MixtralForCausalLM", "spm", dict(
        COMMON, num_hidden_layers=3, num_key_value_heads=2, num_local_experts=8, intermediate_size=32,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=True), embed_std=0.1),
    # llama.cpp's olmoe loader needs K-norm of n_embd, so KV heads = heads (docs/references.md).
    "olmoe": TinySpec("olmoe", "OlmoeForCausalLM", "llama-bpe", dict(
        COMMON, num_hidden_layers=3, num_key_value_heads=4, num_experts=8, intermediate_size=32,
        norm_topk_prob=False, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=False)),
}
# DeepSeek: q-LoRA, sigmoid scores + selection bias + 4 groups of 2 (2 used), a dense first layer and one shared
# expert, YaRN as in DeepSeek-V3's config (V3 / Kimi-K2 layout); V2-Lite: plain q, softmax, two shared experts,
# no renormalisation, plain RoPE. rms_norm_eps
# 1e-6 because HF's q_a/kv_a norms always use 1e-6 while llama.cpp uses the file's epsilon for every norm.
DEEPSEEK = dict(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, first_k_dense_replace=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_theta=1e4, tie_word_embeddings=False)
TINY["deepseekv3"] = TinySpec("deepseekv3", "DeepseekV3ForCausalLM", "llama-bpe", dict(
    DEEPSEEK, num_hidden_layers=3, q_lora_rank=32, n_shared_experts=1, routed_scaling_factor=2.5, n_group=4,
    topk_group=2, num_experts_per_tok=2, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0, original_max_position_embeddings=4096,
                         beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)))
TINY["deepseekv2lite"] = TinySpec("deepseekv2lite", "DeepseekV2ForCausalLM", "llama-bpe", dict(
    DEEPSEEK, num_hidden_layers=3, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.0,
    num_experts_per_tok=3, norm_topk_prob=False, topk_method="greedy"))
# gpt-oss: tiny dims, with the real model's sliding/full alternation, attention bias, top-4 routing, swiglu and
# YaRN values (factor 32, original length 4096, rope_theta 150000) but `truncate` true: HF's default for gpt-oss is
# false, which no GGUF key carries and llama.cpp does not do (decision 0140). sliding_window 5 < the 55 positions of
# the references, so the window matters in layers 0 and 2.
TINY["gptoss"] = TinySpec("gptoss", "GptOssForCausalLM", "gpt-4o", dict(
    vocab_size=N_VOCAB, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=4, sliding_window=5,
    max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=True, original_max_position_embeddings=4096)),
    variants=(("mxfp4", "q8_0", True),), experts_in_out=True)
SPECIALS = {"qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "llama-bpe": ["<|endoftext|>", "<|padding|>"],
            # o200k_harmony's special tokens that the harmony chat format uses.
            "gpt-4o": ["<|endoftext|>", "<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                       "<|end|>", "<|message|>", "<|call|>"]}


def read_text(name: str, offset: int = 0, size: int | None = None) -> str:
    """A slice of a realdata text file, cut to whole lines (the slice's first partial line is dropped)."""
    raw = (TEXT_DIR / name).read_bytes()
    chunk = raw[offset:offset + size] if size is not None else raw[offset:]
    text = chunk.decode("utf-8", errors="ignore")
    if offset > 0:
        text = text[text.index("\n") + 1:]
    return text[:text.rindex("\n") + 1] if size is not None else text


def tokenizer_corpus() -> list[str]:
    return [read_text(f, 0, TOKENIZER_TRAIN_BYTES) for f in TEXT_FILES]


def train_bpe(kind: str, out_dir: Path) -> dict:
    """Byte-level BPE with the Qwen2, Llama-3 or o200k pre-tokenizer regex (HF tokenizers), N_VOCAB ids in all, special
    tokens last (as in Qwen). Writes tokenizer.json + tokenizer_config.json; returns special-token ids for config."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS[kind]
    # llama.cpp's llama-bpe pre-tokenizer sets ignore_merges (whole words found in the vocab win), as Llama 3's
    # tokenizer.json does; qwen2 does not.
    tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama-bpe")))
    regex = REGEX[kind]
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=N_VOCAB - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_corpus(), trainer)
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() == N_VOCAB, tok.get_vocab_size()
    eos = "<|return|>" if kind == "gpt-4o" else specials[0]  # gpt-oss ends a reply with <|return|>
    pad = specials[1] if kind == "llama-bpe" else specials[0]
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad)
    if kind == "qwen2":
        hf_tok.chat_template = CHATML
    hf_tok.save_pretrained(str(out_dir))
    return {"bos_token_id": None, "eos_token_id": tok.token_to_id(eos), "pad_token_id": tok.token_to_id(pad)}


def train_spm(out_dir: Path) -> dict:
    """SentencePiece BPE with byte fallback and Llama/Mistral's settings (identity normalisation, dummy prefix,
    split digits, whitespace-only pieces), N_VOCAB pieces: <unk>=0, <s>=1, </s>=2."""
    import sentencepiece as spm

    corpus = out_dir / "spm-corpus.txt"
    corpus.write_text("\n".join(tokenizer_corpus()), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out_dir / "tokenizer"), vocab_size=N_VOCAB, model_type="bpe",
        byte_fallback=True, character_coverage=0.99, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_digits=True,
        allow_whitespace_only_pieces=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, max_sentence_length=1 << 20, num_threads=1, minloglevel=2)
    corpus.unlink()
    (out_dir / "tokenizer.vocab").unlink()
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "chat_template": MISTRAL_INST}, indent=2) + "\n")
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}


class RefTokenizer:
    """The reference tokenizer of a tiny model: HF tokenizers for BPE, the sentencepiece library (+ BOS) for SPM."""

    def __init__(self, hf_dir: Path, kind: str):
        self.kind = kind
        if kind == "spm":
            import sentencepiece as spm
            self.sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
        else:
            from tokenizers import Tokenizer
            self.tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        if self.kind == "spm":
            return [self.sp.bos_id()] + self.sp.encode(text)
        return self.tok.encode(text, add_special_tokens=False).ids

    def special_ids(self) -> set[int]:
        if self.kind == "spm":
            return {i for i in range(self.sp.GetPieceSize()) if self.sp.IsControl(i) or self.sp.IsUnknown(i)}
        return {self.tok.token_to_id(s) for s in SPECIALS[self.kind]}


def pick_prompt(tok: RefTokenizer) -> tuple[str, list[int]]:
    """The first line prefix (whole words) of the prompt source that tokenizes to exactly N_PROMPT ids."""
    name, offset = PROMPT_SOURCE
    for line in read_text(name, offset).splitlines():
        words = line.split(" ")
        for n in range(1, len(words) + 1):
            text = " ".join(words[:n])
            ids = tok.encode(text)
            if len(ids) == N_PROMPT:
                return text, ids
            if len(ids) > N_PROMPT:
                break
    raise RuntimeError("no prompt of exactly N_PROMPT tokens found")


def spread_init(model: torch.nn.Module, seed: int, embed_std: float, experts_in_out: bool = False) -> None:
    """Re-initialises every parameter so that logits and router logits are O(1)-spread rather than HF's
    std-0.02 near-ties: embeddings N(0, embed_std^2); routers N(0, (2/sqrt(fan_in))^2); the output head
    N(0, 0.5^2) (logit std ~4 after the final RMSNorm); other matrices N(0, 1/fan_in); norm weights 1 + N(0, 0.2^2);
    biases and attention sinks N(0, 0.2^2) and N(0, 1). fan_in is the last dimension (nn.Linear and HF's fused
    expert layouts alike), the middle one with experts_in_out, whose fused gate_up then gets N(0, (4/sqrt(fan_in))^2)
    so that about one gate activation in ten passes gpt-oss's clamp at 7."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            n = torch.randn(p.shape, generator=g, dtype=torch.float32)
            fused = experts_in_out and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            fan_in = p.shape[-2] if fused else p.shape[-1]
            if "embed_tokens" in name:
                p.copy_(embed_std * n)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * n)
            elif name.endswith((".bias", "_bias")):
                p.copy_(0.2 * n)
            elif name.endswith(".sinks"):
                p.copy_(n)
            elif name.endswith("lm_head.weight"):
                p.copy_(0.5 * n)
            elif re.search(r"\.(gate|shared_expert_gate|router)\.weight$", name):  # routers [n_expert|1, n_embd]
                p.copy_(2.0 * n / fan_in ** 0.5)
            elif fused and name.endswith("gate_up_proj"):
                p.copy_(4.0 * n / fan_in ** 0.5)
            else:
                p.copy_(n / fan_in ** 0.5)
        # DeepSeek-V3's selection bias is a buffer: small and positive, so that it shifts choices only sometimes.
        for name, buf in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.rand(buf.shape, generator=g))


def make_hf_model(spec: TinySpec, hf_dir: Path, special_ids: dict, seed: int) -> None:
    """Builds the HF model from its config class, re-initialises it with `seed` and saves safetensors + config."""
    import transformers

    cls = getattr(transformers, spec.hf_class)
    cfg_cls = cls.config_class
    cfg = cfg_cls(**spec.config, **special_ids)
    torch.manual_seed(seed)
    model = cls(cfg)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    spread_init(model, seed, spec.embed_std, spec.experts_in_out)
    for f in hf_dir.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(str(hf_dir))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_margins(ref: hr.Reference, k: int, specials: set[int]) -> str | None:
    """Why a reference is unfit for a golden file, or None."""
    logit_scale = float(np.abs(ref.logits).max())
    router_scale = float(np.abs(ref.router_logits[np.isfinite(ref.router_logits)]).max())
    if ref.logit_margin() < MIN_RELATIVE_MARGIN["logit"] * logit_scale:
        return f"logit margin {ref.logit_margin():.4f} of {logit_scale:.2f}"
    if ref.router_margin(k) < MIN_RELATIVE_MARGIN["router"] * router_scale:
        return f"router margin {ref.router_margin(k):.4f} of {router_scale:.2f}"
    if specials & set(ref.greedy):
        return "greedy emits a special token"
    if len(set(ref.greedy)) < MIN_DISTINCT_GREEDY:
        return f"greedy has only {len(set(ref.greedy))} distinct tokens"
    return None


def f64_deviation(model, ref: hr.Reference) -> float:
    """Max |logit| difference between this float32 reference and the same model in float64: the size of plain
    float32 rounding noise, which the stated tolerance must exceed comfortably."""
    m64 = model.to(torch.float64)
    with torch.no_grad():
        l64 = m64(torch.tensor([ref.sequence])).logits[0].numpy()
    model.to(torch.float32)
    return float(np.abs(l64 - ref.logits).max())


def write_golden(out_dir: Path, stem: str, gguf_path: Path, ref: hr.Reference, meta: dict) -> None:
    """tiny-<type>.ref.f32 (raw logits) and tiny-<type>.ref.json next to the GGUF."""
    logits_path = out_dir / f"{stem}.ref.f32"
    ref.logits.astype("<f4").tofile(logits_path)
    scale = float(np.abs(ref.logits).max())
    doc = dict(meta)
    doc.update({
        "model": gguf_path.name,
        "model_sha256": sha256(gguf_path),
        "prompt_ids": ref.prompt,
        "n_prompt": len(ref.prompt),
        "greedy": ref.greedy,
        "n_gen": len(ref.greedy),
        "sequence_ids": ref.sequence,
        "logits_file": logits_path.name,
        "logits_dtype": "float32 little-endian, row-major",
        "logits_shape": list(ref.logits.shape),
        "logits_rows": "row j = next-token logits after sequence_ids[0..j]; row n_prompt-1+s predicts greedy[s]",
        "logits_max_abs": scale,
        "logits_std": float(ref.logits.std()),
        "min_top1_top2_logit_gap": ref.logit_margin(),
        "min_router_topk_gap": ref.router_margin(meta["expert_used_count"]),
        "router_logits_max_abs": float(np.abs(ref.router_logits[np.isfinite(ref.router_logits)]).max()),
        "tolerance": {
            "max_abs_logit_error": 1e-4 * scale,
            "rule": "1e-4 x logits_max_abs, for an engine with float32 activations (docs/references.md)",
            "greedy": "identical for all n_gen steps",
        },
    })
    (out_dir / f"{stem}.ref.json").write_text(json.dumps(doc, indent=1) + "\n")


def build_arch(spec: TinySpec, out_root: Path, work: Path, command: str) -> None:
    import transformers

    work_arch = work / spec.arch / "hf"
    work_arch.mkdir(parents=True, exist_ok=True)
    special_ids = train_spm(work_arch) if spec.tokenizer == "spm" else train_bpe(spec.tokenizer, work_arch)
    tok = RefTokenizer(work_arch, spec.tokenizer)
    prompt_text, prompt_ids = pick_prompt(tok)
    k = spec.config["num_experts_per_tok"]
    out_dir = out_root / spec.arch
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = work / spec.arch
    for seed in SEEDS:
        make_hf_model(spec, work_arch, special_ids, seed)
        refs = {}
        reason = None
        for stem, outtype, mxfp4 in (("f32", "f32", False),) + spec.variants:
            path = tmp / f"tiny-{stem}.gguf"
            conv.convert(work_arch, path, outtype, pre=None if spec.tokenizer == "spm" else spec.tokenizer,
                         name=f"prescope-tiny-{spec.arch}", mxfp4_experts=mxfp4)
            state = hr.gguf_to_hf_state(path, work_arch)
            if stem == "f32":
                from safetensors.numpy import load_file
                orig = load_file(str(work_arch / "model.safetensors"))
                if set(orig) != set(state) or any(not np.array_equal(orig[n], state[n]) for n in orig):
                    raise RuntimeError(f"{path}: F32 GGUF does not round-trip to the HF checkpoint")
            model = hr.load_hf_model(work_arch, state)
            ref = hr.reference(model, prompt_ids, N_GEN)
            reason = check_margins(ref, k, tok.special_ids())
            if reason:
                break
            refs[stem] = (path, ref, f64_deviation(model, ref))
        print(f"{spec.arch}: seed {seed}: {reason or 'ok'}", flush=True)
        if reason is None:
            break
    else:
        raise RuntimeError(f"{spec.arch}: no seed in {SEEDS} meets the margins")

    meta_common = {
        "arch": spec.arch,
        "hf_architecture": spec.hf_class,
        "tokenizer": spec.tokenizer,
        "expert_used_count": k,
        "seed": seed,
        "prompt_text": prompt_text,
        "prompt_source": f"realdata/text/olmoe-routing-text/{PROMPT_SOURCE[0]} from byte {PROMPT_SOURCE[1]}",
        "hf_config": json.loads((work_arch / "config.json").read_text()),
        "reference_impl": {"library": "transformers", "version": transformers.__version__,
                           "torch": torch.__version__, "dtype": "float32", "device": "cpu",
                           "attn_implementation": "eager", "gguf_py": gguf_version()},
        "command": command,
    }
    for stem, (path, ref, dev64) in refs.items():
        final = out_dir / f"tiny-{stem}.gguf"
        shutil.copy(path, final)
        meta = dict(meta_common)
        meta["weights"] = ("float32, identical to the HF safetensors" if stem == "f32" else
                           f"the {stem} file's tensors dequantized with gguf.quants and loaded into the HF model")
        meta["f32_vs_f64_max_abs_logit_diff"] = dev64
        write_golden(out_dir, f"tiny-{stem}", final, ref, meta)
        print(f"{spec.arch}: wrote {final} ({final.stat().st_size} bytes), greedy {ref.greedy[:8]}..., "
              f"margins {ref.logit_margin():.3f}/{ref.router_margin(k):.3f}, f64 dev {dev64:.2e}", flush=True)


def gguf_version() -> str:
    from importlib.metadata import version
    return version("gguf")


def write_ppl_text(path: Path) -> None:
    name, offset, size = PPL_SOURCE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(read_text(name, offset, size), encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="*", choices=sorted(TINY), default=sorted(TINY))
    ap.add_argument("--out", type=Path, default=REPO / "tests/data/models")
    ap.add_argument("--work", type=Path, default=Path("/tmp/prescope-tiny"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # bitwise-reproducible references
    write_ppl_text(REPO / "tests/data/text/wikipedia-20k.txt")
    command = "python3 tools/py/make_tiny_models.py --arch " + " ".join(args.arch)
    for arch in args.arch:
        build_arch(TINY[arch], args.out, args.work, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
