#!/usr/bin/env python3
# Converts an HF Mixture-of-Experts checkpoint (config.json + *.safetensors + tokenizer) into a GGUF file that
# both llama.cpp and PreScope load. Our own code over the `gguf` package; conventions follow llama.cpp's converter.
"""HF safetensors -> GGUF for qwen3moe, qwen2moe, llama (Mixtral), olmoe, deepseek2 (DeepSeek-V2/V3) and gpt-oss.

Usage:
    python3 tools/py/convert_hf_to_gguf.py HF_DIR --outtype f32|f16|bf16|q8_0 --outfile OUT.gguf [--pre qwen2]
                                           [--mxfp4-experts]

Conventions (each checked against llama.cpp d32676d77, conversion/{base,llama,qwen,olmo}.py):
- Experts are stacked into ffn_{gate,up,down}_exps with numpy shape [n_expert, rows, cols], i.e. ggml
  ne = {cols, rows, n_expert}: the expert index is the slowest dimension.
- 1-D tensors, *_norm.weight, biases and the routers ffn_gate_inp / ffn_gate_inp_shexp stay F32;
  every other 2-D/3-D weight gets --outtype (Q8_0 via gguf.quants; a row not divisible by 32 falls back to
  F16 with a warning, as llama.cpp does).
- Mixtral (llama arch) q_proj/k_proj rows are permuted per head from HF's rotate-half order to the
  interleaved pair order that ggml's NORM RoPE expects (llama.cpp LlamaModel.permute).
- `{arch}.expert_weights_norm` carries HF norm_topk_prob (Mixtral: always true). llama.cpp reads this key
  only for deepseek-style archs and ignores it here; PreScope reads it.
- deepseek2 (conversion/deepseek.py DeepseekV2Model): MLA written as MQA (head_count_kv 1, key_length
  kv_lora_rank + rope, value_length kv_lora_rank, per-head sizes in *_mla keys); kv_b_proj split per head into
  attn_k_b (transposed: ne {nope, kv_lora_rank, n_head}) and attn_v_b; the selection bias as exp_probs_b.bias;
  no q/k permutation (HF rotates interleaved pairs already, ggml NORM RoPE).
- gpt-oss (conversion/gpt_oss.py GptOssModel): the fused experts gate_up_proj [E, D, 2F] (and its bias) are
  de-interleaved, gate = [..., ::2], up = [..., 1::2] (HF GptOssExperts._apply_gate), and transposed to ggml's
  [E, F, D]; down_proj [E, F, D] to [E, D, F]; sinks become attn_sinks.weight, the FFN norm post_attention_norm.
  A checkpoint whose experts are MXFP4 blocks/scales (the released ones) is repacked to ggml MXFP4 as llama.cpp
  does; --mxfp4-experts quantizes float experts to MXFP4 (gguf.quants). Only the settings llama.cpp hard-codes are
  accepted: layer_types alternating sliding/full from layer 0, swiglu_alpha 1.702, swiglu_limit 7.
Errors are one line naming the file and the tensor or key, and exit with status 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_vocab  # noqa: E402

log = logging.getLogger("convert_hf_to_gguf")

# What llama.cpp's gpt-oss graph hard-codes (LLM_FFN_SWIGLU_OAI_MOE, set_swa_pattern(2)).
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}

OUTTYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


class ConvertError(Exception):
    """A checkpoint we cannot convert; str() is the one-line message shown to the user."""


@dataclass(frozen=True)
class ArchSpec:
    """How one HF architecture maps onto a GGUF architecture.

    moe_prefix: the HF module holding router and experts ("mlp" or "block_sparse_moe").
    expert_names: HF names of the (gate, up, down) expert projections.
    permute_qk: reorder q/k rows for NORM (interleaved) RoPE; False for the NEOX-RoPE archs.
    """
    gguf_arch: str
    default_pre: str
    moe_prefix: str
    expert_names: tuple[str, str, str]
    permute_qk: bool
    qk_norm: str | None  # None, "head" (per-head RMSNorm over head_dim) or "full" (over all heads, OLMoE)
    shared_expert: bool
    attn_bias: bool
    output_required: bool  # llama.cpp's loader has no tied-embedding fallback for this arch
    gating: str = "softmax"  # router scores: "softmax" or "sigmoid" (DeepSeek-V3)


ARCHS: dict[str, ArchSpec] = {
    "Qwen3MoeForCausalLM": ArchSpec("qwen3moe", "qwen2", "mlp", ("gate_proj", "up_proj", "down_proj"),
                                    permute_qk=False, qk_norm="head", shared_expert=False, attn_bias=False,
                                    output_required=False),
    "Qwen2MoeForCausalLM": ArchSpec("qwen2moe", "qwen2", "mlp", ("gate_proj", "up_proj", "down_proj"),
                                    permute_qk=False, qk_norm=None, shared_expert=True, attn_bias=True,
                                    output_required=True),
    "MixtralForCausalLM": ArchSpec("llama", "llama-bpe", "block_sparse_moe", ("w1", "w3", "w2"),
                                   permute_qk=True, qk_norm=None, shared_expert=False, attn_bias=False,
                                   output_required=False),
    "OlmoeForCausalLM": ArchSpec("olmoe", "llama-bpe", "mlp", ("gate_proj", "up_proj", "down_proj"),
                                 permute_qk=False, qk_norm="full", shared_expert=False, attn_bias=False,
                                 output_required=True),
    "DeepseekV3ForCausalLM": ArchSpec("deepseek2", "llama-bpe", "mlp", ("gate_proj", "up_proj", "down_proj"),
                                      permute_qk=False, qk_norm=None, shared_expert=True, attn_bias=False,
                                      output_required=False, gating="sigmoid"),
    "DeepseekV2ForCausalLM": ArchSpec("deepseek2", "llama-bpe", "mlp", ("gate_proj", "up_proj", "down_proj"),
                                      permute_qk=False, qk_norm=None, shared_expert=True, attn_bias=False,
                                      output_required=False),
    "GptOssForCausalLM": ArchSpec("gpt-oss", "gpt-4o", "mlp", ("gate_proj", "up_proj", "down_proj"),
                                  permute_qk=False, qk_norm=None, shared_expert=False, attn_bias=True,
                                  output_required=True, gating="softmax_weight"),
}


@dataclass
class HParams:
    """The config.json values the converter needs, validated."""
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_explicit: bool
    n_ctx: int
    n_ff: int
    n_ff_exp: int | None
    n_ff_shexp: int | None
    n_expert: int
    n_expert_used: int
    rope_theta: float
    rms_eps: float
    norm_topk_prob: bool
    tied: bool
    mla: MlaParams | None = None
    gpt_oss: GptOssParams | None = None


@dataclass
class GptOssParams:
    """gpt-oss config values: the sliding window and YaRN (rope_parameters of rope_type "yarn", or None)."""
    sliding_window: int
    yarn: dict[str, Any] | None


def read_gpt_oss(config: dict[str, Any], path: Path) -> GptOssParams:
    """The gpt-oss config.json values; refuses what llama.cpp's gpt-oss graph does not read but hard-codes."""
    n_layer = _cfg(config, path, "num_hidden_layers")
    window = _cfg(config, path, "sliding_window")
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    if config.get("layer_types", expected) != expected:
        raise ConvertError(f"{path}: layer_types {config['layer_types']} are not supported (expected sliding "
                           f"attention on the even layers, full on the odd ones, as llama.cpp's gpt-oss assumes)")
    for key, want in GPT_OSS_SWIGLU.items():
        if _cfg(config, path, key, default=want, kind=float) != want:
            raise ConvertError(f"{path}: {key} {config[key]} is not supported (llama.cpp's gpt-oss uses {want})")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    yarn = None
    if rope.get("rope_type", rope.get("type")) == "yarn":
        # llama.cpp multiplies an explicit attention_factor by its own mscale where HF replaces it, and has no
        # mscale keys for gpt-oss; HF's `truncate` has no GGUF key either (llama.cpp always truncates, decision 0140).
        if (rope.get("factor") is None or rope.get("original_max_position_embeddings") is None
                or any(rope.get(k) is not None for k in ("attention_factor", "mscale", "mscale_all_dim"))):
            raise ConvertError(f"{path}: YaRN rope parameters {rope} are not supported (expected factor and "
                               f"original_max_position_embeddings, no attention_factor / mscale)")
        yarn = rope
    return GptOssParams(sliding_window=window, yarn=yarn)


@dataclass
class MlaParams:
    """deepseek2 config values: attention ranks and head parts, dense lead layers, shared experts, routing."""
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int
    n_dense: int
    n_shared: int
    scale: float
    n_group: int | None
    topk_group: int | None
    yarn: dict[str, Any] | None  # rope_parameters of rope_type "yarn"


def read_mla(config: dict[str, Any], path: Path, hf_arch: str) -> MlaParams:
    """The DeepSeek-specific config.json values; refuses routing that llama.cpp's keys cannot express."""
    m = MlaParams(q_lora_rank=_cfg(config, path, "q_lora_rank", default=None),
                  kv_lora_rank=_cfg(config, path, "kv_lora_rank"), nope=_cfg(config, path, "qk_nope_head_dim"),
                  rope=_cfg(config, path, "qk_rope_head_dim"), v=_cfg(config, path, "v_head_dim"),
                  n_dense=_cfg(config, path, "first_k_dense_replace", default=0),
                  n_shared=_cfg(config, path, "n_shared_experts", default=0),
                  scale=_cfg(config, path, "routed_scaling_factor", default=1.0, kind=float),
                  n_group=_cfg(config, path, "n_group", default=None),
                  topk_group=_cfg(config, path, "topk_group", default=None), yarn=None)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        # llama.cpp runs deepseek2 YaRN with cos/sin unscaled and mscale(mscale_all_dim)^2 on the scores, which
        # is HF's formula only when mscale == mscale_all_dim and no explicit attention_factor is given.
        if (rope.get("mscale") is None or rope.get("mscale") != rope.get("mscale_all_dim")
                or rope.get("attention_factor") is not None or rope.get("factor") is None):
            raise ConvertError(f"{path}: YaRN rope parameters {rope} are not supported (expected a factor and "
                               f"mscale == mscale_all_dim, no attention_factor)")
        m.yarn = rope
    method = config.get("topk_method")
    if hf_arch == "DeepseekV2ForCausalLM" and method not in (None, "greedy"):
        # HF DeepseekV2 ranks groups by their best expert, llama.cpp's expert_group_count by the two best.
        raise ConvertError(f"{path}: topk_method {method!r} is not supported for DeepseekV2 (only 'greedy')")
    if hf_arch == "DeepseekV3ForCausalLM" and config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConvertError(f"{path}: scoring_func {config['scoring_func']!r}, expected 'sigmoid' for DeepseekV3")
    return m


def _cfg(config: dict[str, Any], path: Path, *keys: str, default: Any = ..., kind: type = int) -> Any:
    for k in keys:
        if config.get(k) is not None:
            v = config[k]
            if kind is float and isinstance(v, int):
                v = float(v)
            if not isinstance(v, kind) or isinstance(v, bool) != (kind is bool):
                raise ConvertError(f"{path}: key {k!r} is {v!r}, expected {kind.__name__}")
            return v
    if default is ...:
        raise ConvertError(f"{path}: missing key {' or '.join(repr(k) for k in keys)}")
    return default


def read_hparams(config: dict[str, Any], path: Path, hf_arch: str) -> HParams:
    """Reads and checks config.json; rejects features the GGUF architectures cannot express."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    spec = ARCHS[hf_arch]
    if rope_type not in ("default", None) and not (rope_type == "yarn" and spec.gguf_arch in ("deepseek2", "gpt-oss")):
        raise ConvertError(f"{path}: rope type {rope_type!r} is not supported (only unscaled RoPE; YaRN for "
                           f"DeepSeek and gpt-oss)")
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ConvertError(f"{path}: dense layers (mlp_only_layers / decoder_sparse_step) are not supported")
    if config.get("clip_qkv") is not None:
        raise ConvertError(f"{path}: clip_qkv={config['clip_qkv']} is not supported")
    n_embd = _cfg(config, path, "hidden_size")
    n_head = _cfg(config, path, "num_attention_heads")
    head_dim = config.get("head_dim")
    gpt_oss = spec.gguf_arch == "gpt-oss"
    # Mixtral always renormalises; gpt-oss's softmax over the chosen logits sums to 1 by itself.
    norm_topk = (True if hf_arch == "MixtralForCausalLM" else False if gpt_oss
                 else _cfg(config, path, "norm_topk_prob", kind=bool))
    hp = HParams(
        n_vocab=_cfg(config, path, "vocab_size"),
        n_embd=n_embd,
        n_layer=_cfg(config, path, "num_hidden_layers"),
        n_head=n_head,
        n_head_kv=_cfg(config, path, "num_key_value_heads", default=n_head),
        head_dim=head_dim if isinstance(head_dim, int) else n_embd // n_head,
        head_dim_explicit=isinstance(head_dim, int),
        n_ctx=_cfg(config, path, "max_position_embeddings"),
        n_ff=_cfg(config, path, "intermediate_size"),
        # gpt-oss's intermediate_size is the experts' (llama.cpp writes it as both ff lengths).
        n_ff_exp=_cfg(config, path, "intermediate_size" if gpt_oss else "moe_intermediate_size", default=None),
        n_ff_shexp=_cfg(config, path, "shared_expert_intermediate_size", default=None),
        n_expert=_cfg(config, path, "num_local_experts", "num_experts", "n_routed_experts"),
        n_expert_used=_cfg(config, path, "num_experts_per_tok"),
        rope_theta=float(rope_theta),
        rms_eps=_cfg(config, path, "rms_norm_eps", kind=float),
        norm_topk_prob=norm_topk,
        tied=bool(config.get("tie_word_embeddings", False)),
        mla=read_mla(config, path, hf_arch) if spec.gguf_arch == "deepseek2" else None,
        gpt_oss=read_gpt_oss(config, path) if gpt_oss else None,
    )
    if hp.n_head % hp.n_head_kv != 0:
        raise ConvertError(f"{path}: num_attention_heads {hp.n_head} is not a multiple of "
                           f"num_key_value_heads {hp.n_head_kv}")
    if not 0 < hp.n_expert_used <= hp.n_expert:
        raise ConvertError(f"{path}: num_experts_per_tok {hp.n_expert_used} not in 1..{hp.n_expert}")
    if spec.shared_expert and hp.mla is None and hp.n_ff_shexp is None:
        raise ConvertError(f"{path}: missing key 'shared_expert_intermediate_size'")
    return hp


class TensorSource:
    """Lazy access to every tensor of the checkpoint's *.safetensors files, as float32 numpy arrays."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{hf_dir}: no *.safetensors files")
        self._where: dict[str, Path] = {}
        self._handles = {}
        for f in files:
            h = safe_open(str(f), framework="pt")
            self._handles[f] = h
            for k in h.keys():
                if k in self._where:
                    raise ConvertError(f"{f}: tensor {k!r} also in {self._where[k]}")
                self._where[k] = f
        self.used: set[str] = set()

    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as float32, checked to have `shape`; errors name the file and tensor."""
        return self._tensor(name, shape).float().numpy()

    def get_u8(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A uint8 tensor (MXFP4 blocks or scales) as stored, checked as get() checks; other dtypes are errors."""
        t = self._tensor(name, shape)
        if str(t.dtype) != "torch.uint8":
            raise ConvertError(f"{self._where[name]}: tensor {name!r} has dtype {t.dtype}, expected uint8")
        return t.numpy()

    def _tensor(self, name: str, shape: tuple[int, ...]):
        if name not in self._where:
            raise ConvertError(f"{next(iter(self._handles))}: missing tensor {name!r}")
        t = self._handles[self._where[name]].get_tensor(name)
        if tuple(t.shape) != shape:
            raise ConvertError(f"{self._where[name]}: tensor {name!r} has shape {tuple(t.shape)}, "
                               f"expected {shape}")
        self.used.add(name)
        return t


@dataclass(frozen=True)
class RawTensor:
    """Bytes already in a GGML type (MXFP4 experts repacked from the checkpoint's blocks), written as they are."""
    data: np.ndarray  # uint8, rows of whole blocks
    qtype: gguf.GGMLQuantizationType


def permute_for_norm_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head from HF rotate-half order [x0..x(d/2-1), y0..] to interleaved [x0, y0, x1, y1, ...].

    Shape [n_head * head_dim, ...] in and out. Same mapping as llama.cpp LlamaModel.permute (reshape to
    (n_head, 2, head_dim/2, ...), swap axes 1 and 2).
    """
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _expert_stack(src: TensorSource, hp: HParams, layer: int, spec: ArchSpec, n_ff_exp: int
                  ) -> dict[str, np.ndarray]:
    """{"gate","up","down"} -> [n_expert, rows, cols] from per-expert tensors or fused 3-D HF tensors."""
    pre = f"model.layers.{layer}.{spec.moe_prefix}.experts"
    fused_gu = f"{pre}.gate_up_proj"
    if src.has(fused_gu) or src.has(fused_gu + ".weight"):
        # transformers >= 5 in-memory layout: gate_up [E, 2*F, D] (gate rows first), down [E, D, F].
        gu_name = fused_gu if src.has(fused_gu) else fused_gu + ".weight"
        dn_name = f"{pre}.down_proj" if src.has(f"{pre}.down_proj") else f"{pre}.down_proj.weight"
        gu = src.get(gu_name, (hp.n_expert, 2 * n_ff_exp, hp.n_embd))
        return {"gate": np.ascontiguousarray(gu[:, :n_ff_exp]), "up": np.ascontiguousarray(gu[:, n_ff_exp:]),
                "down": src.get(dn_name, (hp.n_expert, hp.n_embd, n_ff_exp))}
    g_name, u_name, d_name = spec.expert_names
    out = {}
    for key, hf, shape in (("gate", g_name, (n_ff_exp, hp.n_embd)), ("up", u_name, (n_ff_exp, hp.n_embd)),
                           ("down", d_name, (hp.n_embd, n_ff_exp))):
        out[key] = np.stack([src.get(f"{pre}.{e}.{hf}.weight", shape) for e in range(hp.n_expert)])
    return out


def repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF/OpenAI MXFP4 (blocks [..., G, 16] uint8, element 2j in the low nibble of byte j and 2j+1 in the high one;
    scales [..., G] uint8, value = FP4 x 2^(scale - 127): transformers.integrations.mxfp4) to ggml's block_mxfp4
    rows [..., G * 17]: the scale byte, then byte j holding element j (low nibble) and j + 16 (high nibble).
    Same bytes as llama.cpp GptOssModel.repack_mxfp4 (ggml's e8m0 half scale with doubled E2M1 values)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*blocks.shape[:-2], -1)


def gpt_oss_experts(src: TensorSource, hp: HParams, i: int) -> Iterator[tuple[str, np.ndarray | RawTensor]]:
    """blk.i's expert tensors (llama.cpp GptOssModel): fused gate_up de-interleaved (gate = even rows of the
    2F outputs, up = odd), float experts transposed to ggml's [E, rows, cols], MXFP4 blocks repacked."""
    pre, b = f"model.layers.{i}.mlp.experts", f"blk.{i}"
    E, D, F = hp.n_expert, hp.n_embd, hp.n_ff_exp
    gu_b = src.get(f"{pre}.gate_up_proj_bias", (E, 2 * F))
    if src.has(f"{pre}.gate_up_proj_blocks"):
        if D % 32 or F % 32:
            raise ConvertError(f"{src.file_of(pre + '.gate_up_proj_blocks')}: MXFP4 experts need hidden_size and "
                               f"intermediate_size divisible by 32, got {D} and {F}")
        gu = src.get_u8(f"{pre}.gate_up_proj_blocks", (E, 2 * F, D // 32, 16))
        gu_s = src.get_u8(f"{pre}.gate_up_proj_scales", (E, 2 * F, D // 32))
        dn = src.get_u8(f"{pre}.down_proj_blocks", (E, D, F // 32, 16))
        dn_s = src.get_u8(f"{pre}.down_proj_scales", (E, D, F // 32))
        mx = gguf.GGMLQuantizationType.MXFP4
        gate, up = RawTensor(repack_mxfp4(gu[:, ::2], gu_s[:, ::2]), mx), RawTensor(repack_mxfp4(gu[:, 1::2], gu_s[:, 1::2]), mx)
        down = RawTensor(repack_mxfp4(dn, dn_s), mx)
    else:
        gu = src.get(f"{pre}.gate_up_proj", (E, D, 2 * F)).transpose(0, 2, 1)
        gate, up = np.ascontiguousarray(gu[:, ::2]), np.ascontiguousarray(gu[:, 1::2])
        down = np.ascontiguousarray(src.get(f"{pre}.down_proj", (E, F, D)).transpose(0, 2, 1))
    yield f"{b}.ffn_gate_exps.weight", gate
    yield f"{b}.ffn_gate_exps.bias", np.ascontiguousarray(gu_b[:, ::2])
    yield f"{b}.ffn_up_exps.weight", up
    yield f"{b}.ffn_up_exps.bias", np.ascontiguousarray(gu_b[:, 1::2])
    yield f"{b}.ffn_down_exps.weight", down
    yield f"{b}.ffn_down_exps.bias", src.get(f"{pre}.down_proj_bias", (E, D))


def deepseek_layer(src: TensorSource, hp: HParams, spec: ArchSpec, i: int) -> Iterator[tuple[str, np.ndarray]]:
    """Attention and FFN tensors of deepseek2 block i (llama.cpp conversion/deepseek.py names and layouts)."""
    m = hp.mla
    p, b = f"model.layers.{i}", f"blk.{i}"
    a = f"{p}.self_attn"
    n_q = hp.n_head * (m.nope + m.rope)
    if m.q_lora_rank is not None:
        yield f"{b}.attn_q_a.weight", src.get(f"{a}.q_a_proj.weight", (m.q_lora_rank, hp.n_embd))
        yield f"{b}.attn_q_a_norm.weight", src.get(f"{a}.q_a_layernorm.weight", (m.q_lora_rank,))
        yield f"{b}.attn_q_b.weight", src.get(f"{a}.q_b_proj.weight", (n_q, m.q_lora_rank))
    else:
        yield f"{b}.attn_q.weight", src.get(f"{a}.q_proj.weight", (n_q, hp.n_embd))
    yield f"{b}.attn_kv_a_mqa.weight", src.get(f"{a}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.rope, hp.n_embd))
    yield f"{b}.attn_kv_a_norm.weight", src.get(f"{a}.kv_a_layernorm.weight", (m.kv_lora_rank,))
    kv_b = src.get(f"{a}.kv_b_proj.weight", (hp.n_head * (m.nope + m.v), m.kv_lora_rank))
    kv_b = kv_b.reshape(hp.n_head, m.nope + m.v, m.kv_lora_rank)
    # k_b per head transposed to [kv_lora_rank, nope] (absorbed into the query), v_b per head [v, kv_lora_rank].
    yield f"{b}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :m.nope].transpose(0, 2, 1))
    yield f"{b}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, m.nope:])
    yield f"{b}.attn_output.weight", src.get(f"{a}.o_proj.weight", (hp.n_embd, hp.n_head * m.v))
    yield f"{b}.ffn_norm.weight", src.get(f"{p}.post_attention_layernorm.weight", (hp.n_embd,))
    if i < m.n_dense:
        for g in ("gate", "up"):
            yield f"{b}.ffn_{g}.weight", src.get(f"{p}.mlp.{g}_proj.weight", (hp.n_ff, hp.n_embd))
        yield f"{b}.ffn_down.weight", src.get(f"{p}.mlp.down_proj.weight", (hp.n_embd, hp.n_ff))
        return
    yield f"{b}.ffn_gate_inp.weight", src.get(f"{p}.mlp.gate.weight", (hp.n_expert, hp.n_embd))
    if src.has(f"{p}.mlp.gate.e_score_correction_bias"):
        yield f"{b}.exp_probs_b.bias", src.get(f"{p}.mlp.gate.e_score_correction_bias", (hp.n_expert,))
    ex = _expert_stack(src, hp, i, spec, hp.n_ff_exp)
    yield f"{b}.ffn_gate_exps.weight", ex["gate"]
    yield f"{b}.ffn_up_exps.weight", ex["up"]
    yield f"{b}.ffn_down_exps.weight", ex["down"]
    if m.n_shared > 0:
        f = m.n_shared * hp.n_ff_exp
        for g in ("gate", "up"):
            yield f"{b}.ffn_{g}_shexp.weight", src.get(f"{p}.mlp.shared_experts.{g}_proj.weight", (f, hp.n_embd))
        yield f"{b}.ffn_down_shexp.weight", src.get(f"{p}.mlp.shared_experts.down_proj.weight", (hp.n_embd, f))


def gguf_tensors(src: TensorSource, hp: HParams, spec: ArchSpec) -> Iterator[tuple[str, np.ndarray | RawTensor]]:
    """(GGUF name, float32 array in HF [rows, cols] order, or RawTensor) for every tensor of the model, in file
    order."""
    q_dim = hp.n_head * hp.head_dim
    kv_dim = hp.n_head_kv * hp.head_dim
    n_ff_exp = hp.n_ff_exp if hp.n_ff_exp is not None else hp.n_ff
    yield "token_embd.weight", src.get("model.embed_tokens.weight", (hp.n_vocab, hp.n_embd))
    for i in range(hp.n_layer):
        p = f"model.layers.{i}"
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", src.get(f"{p}.input_layernorm.weight", (hp.n_embd,))
        if hp.mla is not None:
            yield from deepseek_layer(src, hp, spec, i)
            continue
        q = src.get(f"{p}.self_attn.q_proj.weight", (q_dim, hp.n_embd))
        k = src.get(f"{p}.self_attn.k_proj.weight", (kv_dim, hp.n_embd))
        if spec.permute_qk:
            q = permute_for_norm_rope(q, hp.n_head)
            k = permute_for_norm_rope(k, hp.n_head_kv)
        yield f"{b}.attn_q.weight", q
        yield f"{b}.attn_k.weight", k
        yield f"{b}.attn_v.weight", src.get(f"{p}.self_attn.v_proj.weight", (kv_dim, hp.n_embd))
        if spec.attn_bias:
            yield f"{b}.attn_q.bias", src.get(f"{p}.self_attn.q_proj.bias", (q_dim,))
            yield f"{b}.attn_k.bias", src.get(f"{p}.self_attn.k_proj.bias", (kv_dim,))
            yield f"{b}.attn_v.bias", src.get(f"{p}.self_attn.v_proj.bias", (kv_dim,))
        yield f"{b}.attn_output.weight", src.get(f"{p}.self_attn.o_proj.weight", (hp.n_embd, q_dim))
        if hp.gpt_oss is not None:
            yield f"{b}.attn_output.bias", src.get(f"{p}.self_attn.o_proj.bias", (hp.n_embd,))
            yield f"{b}.attn_sinks.weight", src.get(f"{p}.self_attn.sinks", (hp.n_head,))
            yield f"{b}.post_attention_norm.weight", src.get(f"{p}.post_attention_layernorm.weight", (hp.n_embd,))
            yield f"{b}.ffn_gate_inp.weight", src.get(f"{p}.mlp.router.weight", (hp.n_expert, hp.n_embd))
            yield f"{b}.ffn_gate_inp.bias", src.get(f"{p}.mlp.router.bias", (hp.n_expert,))
            yield from gpt_oss_experts(src, hp, i)
            continue
        if spec.qk_norm == "head":
            yield f"{b}.attn_q_norm.weight", src.get(f"{p}.self_attn.q_norm.weight", (hp.head_dim,))
            yield f"{b}.attn_k_norm.weight", src.get(f"{p}.self_attn.k_norm.weight", (hp.head_dim,))
        elif spec.qk_norm == "full":
            yield f"{b}.attn_q_norm.weight", src.get(f"{p}.self_attn.q_norm.weight", (q_dim,))
            yield f"{b}.attn_k_norm.weight", src.get(f"{p}.self_attn.k_norm.weight", (kv_dim,))
        yield f"{b}.ffn_norm.weight", src.get(f"{p}.post_attention_layernorm.weight", (hp.n_embd,))
        m = f"{p}.{spec.moe_prefix}"
        yield f"{b}.ffn_gate_inp.weight", src.get(f"{m}.gate.weight", (hp.n_expert, hp.n_embd))
        ex = _expert_stack(src, hp, i, spec, n_ff_exp)
        yield f"{b}.ffn_gate_exps.weight", ex["gate"]
        yield f"{b}.ffn_up_exps.weight", ex["up"]
        yield f"{b}.ffn_down_exps.weight", ex["down"]
        if spec.shared_expert:
            f = hp.n_ff_shexp
            yield f"{b}.ffn_gate_inp_shexp.weight", src.get(f"{m}.shared_expert_gate.weight", (1, hp.n_embd))
            yield f"{b}.ffn_gate_shexp.weight", src.get(f"{m}.shared_expert.gate_proj.weight", (f, hp.n_embd))
            yield f"{b}.ffn_up_shexp.weight", src.get(f"{m}.shared_expert.up_proj.weight", (f, hp.n_embd))
            yield f"{b}.ffn_down_shexp.weight", src.get(f"{m}.shared_expert.down_proj.weight", (hp.n_embd, f))
    yield "output_norm.weight", src.get("model.norm.weight", (hp.n_embd,))
    if src.has("lm_head.weight"):
        yield "output.weight", src.get("lm_head.weight", (hp.n_vocab, hp.n_embd))
    elif not hp.tied:
        raise ConvertError(f"{src.file_of('model.embed_tokens.weight')}: missing tensor 'lm_head.weight' "
                           f"(tie_word_embeddings is false)")
    elif spec.output_required:
        # llama.cpp's loader for this arch has no fallback to token_embd, so store the tied head explicitly.
        yield "output.weight", src.get("model.embed_tokens.weight", (hp.n_vocab, hp.n_embd))


def storage_type(name: str, data: np.ndarray, outtype: gguf.GGMLQuantizationType,
                 mxfp4_experts: bool = False) -> gguf.GGMLQuantizationType:
    """The GGML type a tensor is stored in (llama.cpp ModelBase.prepare_tensors' rules for these archs); with
    mxfp4_experts the routed experts' matrices are MXFP4 whatever the outtype."""
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    if re.search(r"\.ffn_gate_inp(_shexp)?\.weight$", name):
        return gguf.GGMLQuantizationType.F32
    if mxfp4_experts and re.search(r"\.ffn_(gate|up|down)_exps\.weight$", name):
        return gguf.GGMLQuantizationType.MXFP4
    return outtype


def encode(name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType
           ) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The bytes (or typed array) to store; Q8_0 / MXFP4 rows that are not whole blocks fall back to F16."""
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError as e:
        log.warning("%s: %s, storing F16", name, e)
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def write_hparams(w: gguf.GGUFWriter, hp: HParams, spec: ArchSpec, ftype: gguf.LlamaFileType) -> None:
    """Architecture keys as llama.cpp's TextModel.set_gguf_parameters and the per-arch subclasses write them."""
    w.add_block_count(hp.n_layer)
    w.add_context_length(hp.n_ctx)
    w.add_embedding_length(hp.n_embd)
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(1 if hp.mla else hp.n_head_kv)
    w.add_rope_freq_base(hp.rope_theta)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    w.add_expert_count(hp.n_expert)
    w.add_expert_used_count(hp.n_expert_used)
    if hp.mla is not None:
        write_mla_hparams(w, hp, spec)
    elif hp.head_dim_explicit:
        w.add_key_length(hp.head_dim)
        w.add_value_length(hp.head_dim)
    if hp.n_ff_exp is not None:
        w.add_expert_feed_forward_length(hp.n_ff_exp)
    if spec.shared_expert and hp.mla is None:
        w.add_expert_shared_feed_forward_length(hp.n_ff_shexp)
    if spec.gguf_arch == "llama":
        w.add_vocab_size(hp.n_vocab)
        w.add_rope_dimension_count(hp.head_dim)
    if hp.gpt_oss is not None:
        write_gpt_oss_hparams(w, hp)
    elif hp.mla is None or hp.norm_topk_prob:  # llama.cpp's DeepseekV2Model writes the key only when true
        w.add_expert_weights_norm(hp.norm_topk_prob)
    w.add_file_type(ftype)


def write_gpt_oss_hparams(w: gguf.GGUFWriter, hp: HParams) -> None:
    """gpt-oss keys beyond the common ones, as llama.cpp's TextModel (YaRN) and GptOssModel write them."""
    g = hp.gpt_oss
    if g.yarn is not None:
        write_yarn(w, g.yarn)
    w.add_sliding_window(g.sliding_window)


def write_yarn(w: gguf.GGUFWriter, yarn: dict[str, Any]) -> None:
    """rope.scaling.* of rope_type yarn as llama.cpp's TextModel.set_gguf_parameters writes them."""
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(yarn["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(yarn["original_max_position_embeddings"]))
    if yarn.get("beta_fast") is not None:
        w.add_rope_scaling_yarn_beta_fast(float(yarn["beta_fast"]))
    if yarn.get("beta_slow") is not None:
        w.add_rope_scaling_yarn_beta_slow(float(yarn["beta_slow"]))


def write_mla_hparams(w: gguf.GGUFWriter, hp: HParams, spec: ArchSpec) -> None:
    """deepseek2 keys as llama.cpp's DeepseekV2Model.set_gguf_parameters (+ TextModel's group keys) writes them."""
    m = hp.mla
    w.add_leading_dense_block_count(m.n_dense)
    w.add_vocab_size(hp.n_vocab)
    if m.q_lora_rank is not None:
        w.add_q_lora_rank(m.q_lora_rank)
    w.add_kv_lora_rank(m.kv_lora_rank)
    w.add_key_length(m.kv_lora_rank + m.rope)
    w.add_value_length(m.kv_lora_rank)
    w.add_key_length_mla(m.nope + m.rope)
    w.add_value_length_mla(m.v)
    w.add_expert_shared_count(m.n_shared)
    w.add_expert_weights_scale(m.scale)
    w.add_rope_dimension_count(m.rope)
    if m.yarn is not None:  # llama.cpp TextModel (type, factor, length, betas) + DeepseekV2Model (log multiplier)
        write_yarn(w, m.yarn)
        w.add_rope_scaling_yarn_log_mul(0.1 * float(m.yarn["mscale_all_dim"]))
    if m.n_group is not None:
        w.add_expert_group_count(m.n_group)
    if m.topk_group is not None:
        w.add_expert_group_used_count(m.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if spec.gating == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)


def convert(hf_dir: Path, outfile: Path, outtype: str, pre: str | None = None, name: str | None = None,
            alignment: int = 32, mxfp4_experts: bool = False) -> None:
    """Converts one checkpoint directory; raises ConvertError (one line) on any problem. mxfp4_experts: store
    the routed experts' float matrices as MXFP4 (checkpoints with MXFP4 experts keep them MXFP4 regardless)."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{config_path}: not found")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConvertError(f"{config_path}: invalid JSON: {e}") from e
    archs = config.get("architectures") or []
    hf_arch = next((a for a in archs if a in ARCHS), None)
    if hf_arch is None:
        raise ConvertError(f"{config_path}: architectures {archs} not supported "
                           f"(expected one of {', '.join(ARCHS)})")
    spec = ARCHS[hf_arch]
    hp = read_hparams(config, config_path, hf_arch)
    qtype, ftype = OUTTYPES[outtype]
    src = TensorSource(hf_dir)

    w = gguf.GGUFWriter(str(outfile), spec.gguf_arch)
    w.add_custom_alignment(alignment)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or hf_dir.name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_hparams(w, hp, spec, ftype)
    tok_pre = pre
    if tok_pre is None and not (hf_dir / "tokenizer.model").is_file() and (hf_dir / "tokenizer.json").is_file():
        tok_pre = gguf_vocab.detect_bpe_pre(hf_dir / "tokenizer.json") or spec.default_pre
    try:
        gguf_vocab.add_tokenizer(w, hf_dir, tok_pre, hp.n_vocab)
    except gguf_vocab.VocabError as e:
        raise ConvertError(str(e)) from e

    for gname, data in gguf_tensors(src, hp, spec):
        if isinstance(data, RawTensor):
            stored, t = data.data, data.qtype
        else:
            stored, t = encode(gname, data, storage_type(gname, data, qtype, mxfp4_experts))
        w.add_tensor(gname, stored, raw_dtype=t)
        log.info("%-28s %-14s -> %s", gname, "x".join(map(str, stored.shape)), t.name)
    unused = sorted(n for n in src.names() - src.used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ConvertError(f"{src.file_of(unused[0])}: tensor {unused[0]!r} is not used by {spec.gguf_arch} "
                           f"({len(unused)} unused in all)")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir", type=Path, help="directory with config.json, *.safetensors and a tokenizer")
    ap.add_argument("--outtype", choices=sorted(OUTTYPES), default="f32")
    ap.add_argument("--outfile", type=Path, required=True)
    ap.add_argument("--pre", help="BPE pre-tokenizer name (qwen2, llama-bpe); default: detected from "
                                  "tokenizer.json's regex, else the architecture's default")
    ap.add_argument("--name", help="general.name (default: the directory name)")
    ap.add_argument("--alignment", type=int, default=32, help="general.alignment in bytes (power of two)")
    ap.add_argument("--mxfp4-experts", action="store_true",
                    help="store the routed experts' matrices as MXFP4 (as the released gpt-oss checkpoints are)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.alignment <= 0 or args.alignment & (args.alignment - 1):
        print(f"error: --alignment {args.alignment} is not a power of two", file=sys.stderr)
        return 1
    try:
        convert(args.hf_dir, args.outfile, args.outtype, args.pre, args.name, args.alignment, args.mxfp4_experts)
    except ConvertError as e:
        args.outfile.unlink(missing_ok=True)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
