# Reference outputs from HF transformers (float32, CPU) for a model given as an HF directory or as a GGUF file
# whose tensors are dequantized back into the HF model, so engine and reference see identical weights.
"""HF transformers references: per-position logits, greedy tokens, router logits.

Used by make_tiny_models.py; runnable on its own:
    python3 tools/py/hf_reference.py HF_DIR [--gguf FILE.gguf] --prompt-ids 1,2,3 [--n-gen 32]
prints the greedy continuation (and with --gguf, the weights come from that file, dequantized).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert_hf_to_gguf as conv  # noqa: E402


def unpermute_from_norm_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of conv.permute_for_norm_rope: interleaved pair rows back to HF rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_state(gguf_path: Path, hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF written by our converter, dequantized to float32 (gguf.quants) and renamed and
    reshaped back to the HF checkpoint's on-disk names (per-expert tensors, HF q/k row order).

    This is an independent inverse of convert_hf_to_gguf.gguf_tensors: applied to an F32 file it must return
    the original safetensors bit for bit, which make_tiny_models.py checks.
    """
    config = json.loads((hf_dir / "config.json").read_text())
    hf_arch = next(a for a in config["architectures"] if a in conv.ARCHS)
    spec = conv.ARCHS[hf_arch]
    hp = conv.read_hparams(config, hf_dir / "config.json", hf_arch)
    reader = gguf.GGUFReader(str(gguf_path))
    g = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
        [int(x) for x in reversed(t.shape)]) for t in reader.tensors}

    if hp.mla is not None:
        return _deepseek_state(g, hp, gguf_path)
    if hp.gpt_oss is not None:
        return _gpt_oss_state(g, hp, gguf_path)
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": g.pop("token_embd.weight"),
                                  "model.norm.weight": g.pop("output_norm.weight")}
    if "output.weight" in g:
        head = g.pop("output.weight")
        if not hp.tied:
            out["lm_head.weight"] = head
    simple = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
              "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
              "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
              "attn_v.bias": "self_attn.v_proj.bias",
              "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
              "ffn_gate_inp.weight": f"{spec.moe_prefix}.gate.weight",
              "ffn_gate_inp_shexp.weight": f"{spec.moe_prefix}.shared_expert_gate.weight",
              "ffn_gate_shexp.weight": f"{spec.moe_prefix}.shared_expert.gate_proj.weight",
              "ffn_up_shexp.weight": f"{spec.moe_prefix}.shared_expert.up_proj.weight",
              "ffn_down_shexp.weight": f"{spec.moe_prefix}.shared_expert.down_proj.weight"}
    for i in range(hp.n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for gk, hk in simple.items():
            if b + gk in g:
                out[p + hk] = g.pop(b + gk)
        q, k = g.pop(b + "attn_q.weight"), g.pop(b + "attn_k.weight")
        if spec.permute_qk:
            q, k = unpermute_from_norm_rope(q, hp.n_head), unpermute_from_norm_rope(k, hp.n_head_kv)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
        _unstack_experts(g, out, b, f"{p}{spec.moe_prefix}.experts", spec.expert_names, hp.n_expert)
    if g:
        raise ValueError(f"{gguf_path}: tensors with no HF counterpart: {sorted(g)}")
    return out


def _unstack_experts(g: dict[str, np.ndarray], out: dict[str, np.ndarray], blk: str, hf_prefix: str,
                     hf_names, n_expert: int) -> None:
    """Moves blk's stacked ffn_{gate,up,down}_exps [n_expert, rows, cols] out of g into out as one HF matrix per
    expert: {hf_prefix}.{e}.{name}.weight, names in gate, up, down order."""
    for gk, hf_name in zip(("gate", "up", "down"), hf_names):
        stacked = g.pop(f"{blk}ffn_{gk}_exps.weight")
        for e in range(n_expert):
            out[f"{hf_prefix}.{e}.{hf_name}.weight"] = np.ascontiguousarray(stacked[e])


def _deepseek_state(g: dict[str, np.ndarray], hp: conv.HParams, gguf_path: Path) -> dict[str, np.ndarray]:
    """gguf_to_hf_state for deepseek2: kv_b_proj rebuilt per head from attn_k_b (transposed back) and attn_v_b."""
    m = hp.mla
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": g.pop("token_embd.weight"),
                                  "model.norm.weight": g.pop("output_norm.weight")}
    if "output.weight" in g:
        out["lm_head.weight"] = g.pop("output.weight")
    simple = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
              "attn_q.weight": "self_attn.q_proj.weight", "attn_q_a.weight": "self_attn.q_a_proj.weight",
              "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attn_q_b.weight": "self_attn.q_b_proj.weight",
              "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
              "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_output.weight": "self_attn.o_proj.weight",
              "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
              "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
              "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
              "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
              "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
              "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}
    for i in range(hp.n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for gk, hk in simple.items():
            if b + gk in g:
                out[p + hk] = g.pop(b + gk)
        k_b, v_b = g.pop(b + "attn_k_b.weight"), g.pop(b + "attn_v_b.weight")  # [H, r, nope], [H, v, r]
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
        out[p + "self_attn.kv_b_proj.weight"] = np.ascontiguousarray(kv_b.reshape(-1, m.kv_lora_rank))
        if i >= m.n_dense:
            _unstack_experts(g, out, b, f"{p}mlp.experts", ("gate_proj", "up_proj", "down_proj"), hp.n_expert)
    if g:
        raise ValueError(f"{gguf_path}: tensors with no HF counterpart: {sorted(g)}")
    return out


def _gpt_oss_state(g: dict[str, np.ndarray], hp: conv.HParams, gguf_path: Path) -> dict[str, np.ndarray]:
    """gguf_to_hf_state for gpt-oss: the fused gate_up_proj [E, D, 2F] (and bias) re-interleaved from gate (even
    columns) and up (odd), down_proj transposed back to [E, F, D] (HF GptOssExperts' layout)."""
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": g.pop("token_embd.weight"),
                                  "model.norm.weight": g.pop("output_norm.weight"),
                                  "lm_head.weight": g.pop("output.weight")}
    simple = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
              "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
              "ffn_gate_inp.bias": "mlp.router.bias"}
    for proj, gk in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        simple[f"{gk}.weight"], simple[f"{gk}.bias"] = f"self_attn.{proj}.weight", f"self_attn.{proj}.bias"
    for i in range(hp.n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for gk, hk in simple.items():
            out[p + hk] = g.pop(b + gk)
        gate, up = g.pop(b + "ffn_gate_exps.weight"), g.pop(b + "ffn_up_exps.weight")  # [E, F, D] each
        gu = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
        gu[:, 0::2], gu[:, 1::2] = gate, up
        out[p + "mlp.experts.gate_up_proj"] = np.ascontiguousarray(gu.transpose(0, 2, 1))
        gate_b, up_b = g.pop(b + "ffn_gate_exps.bias"), g.pop(b + "ffn_up_exps.bias")  # [E, F] each
        gu_b = np.empty((gate_b.shape[0], 2 * gate_b.shape[1]), np.float32)
        gu_b[:, 0::2], gu_b[:, 1::2] = gate_b, up_b
        out[p + "mlp.experts.gate_up_proj_bias"] = gu_b
        out[p + "mlp.experts.down_proj"] = np.ascontiguousarray(g.pop(b + "ffn_down_exps.weight").transpose(0, 2, 1))
        out[p + "mlp.experts.down_proj_bias"] = g.pop(b + "ffn_down_exps.bias")
    if g:
        raise ValueError(f"{gguf_path}: tensors with no HF counterpart: {sorted(g)}")
    return out


def router_choice_scores(gate, logits: torch.Tensor) -> tuple[np.ndarray, float]:
    """What a DeepSeek router chooses on, from its logits [n_tok, n_expert]: scores (+ e_score_correction_bias)
    with the experts of unchosen groups at -inf, and the smallest gap between the last chosen and the first
    unchosen group score (inf without groups), mirroring HF DeepseekV3TopkRouter / DeepseekV2TopkRouter."""
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is not None:
        scores = logits.float().sigmoid() + bias
    else:
        scores = logits.float().softmax(-1)
    n_group = getattr(gate, "num_group", None) or 1
    gap = float("inf")
    if n_group > 1 and bias is not None:
        grouped = scores.view(scores.shape[0], n_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        s = group_scores.sort(-1, descending=True)[0]
        gap = float((s[:, gate.topk_group - 1] - s[:, gate.topk_group]).min())
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(gate.topk_group, dim=-1)[1], True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(scores.shape[0], -1)
    return scores.numpy(), gap


def load_hf_model(hf_dir: Path, state: dict[str, np.ndarray] | None = None):
    """The HF model in float32 eval mode; with `state`, its weights are replaced by these on-disk tensors
    (written to a temporary checkpoint next to hf_dir's config so HF's own loader does the renaming)."""
    from transformers import AutoModelForCausalLM
    from safetensors.numpy import save_file

    # The plain per-expert loop and eager attention: the most literal implementations, and they run in float64.
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    if state is None:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(hf_dir / "config.json", tmp)
            save_file(state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            model = AutoModelForCausalLM.from_pretrained(tmp, **kwargs)
    model.eval()
    model.generation_config.eos_token_id = None  # always generate the full n_gen tokens
    model.generation_config.pad_token_id = 0
    return model


@dataclass
class Reference:
    """HF outputs for one prompt.

    greedy: n_gen token ids from generate(do_sample=False).
    sequence: prompt + greedy[:-1]; logits[j] (float32 [n_pos, n_vocab]) is the distribution after sequence[:j+1],
    so logits[n_prompt-1+s] predicts greedy[s].
    router_logits: [n_layer, n_pos, n_expert] float32 pre-softmax router outputs along `sequence`; for DeepSeek
    the scores the router chooses on (router_choice_scores; -inf outside the chosen groups), MoE layers only.
    group_margin: the smallest group-choice gap (DeepSeek-V3 groups), inf when there are none.
    """
    prompt: list[int]
    greedy: list[int]
    sequence: list[int]
    logits: np.ndarray
    router_logits: np.ndarray
    group_margin: float = float("inf")

    def logit_margin(self) -> float:
        """Smallest top-1 minus top-2 logit over all positions (how far greedy is from a tie)."""
        s = np.sort(self.logits, axis=-1)
        return float((s[:, -1] - s[:, -2]).min())

    def router_margin(self, k: int) -> float:
        """Smallest gap between the k-th and (k+1)-th router logit over all layers and positions."""
        s = np.sort(self.router_logits, axis=-1)[..., ::-1]
        return float(min((s[..., k - 1] - s[..., k]).min(), self.group_margin))


@torch.no_grad()
def reference(model, prompt: list[int], n_gen: int) -> Reference:
    """Greedy generation, then one teacher-forced forward pass over prompt + greedy[:-1] for all logits."""
    ids = torch.tensor([prompt], dtype=torch.long)
    gen = model.generate(ids, max_new_tokens=n_gen, min_new_tokens=n_gen, do_sample=False,
                         attention_mask=torch.ones_like(ids))
    greedy = gen[0, len(prompt):].tolist()
    seq = prompt + greedy[:-1]
    group_margin = float("inf")
    if model.config.model_type.startswith("deepseek"):
        # No output_router_logits in HF DeepSeek: the routers' outputs, taken with forward hooks.
        captured = []
        hooks = [mod.register_forward_hook(lambda mod, args, res: captured.append(router_choice_scores(mod, res[0])))
                 for name, mod in model.named_modules() if name.endswith("mlp.gate")]
        out = model(torch.tensor([seq]))
        for h in hooks:
            h.remove()
        router = np.stack([c[0] for c in captured])
        group_margin = min(c[1] for c in captured)
    else:
        out = model(torch.tensor([seq]), output_router_logits=True)
        router = np.stack([r.reshape(len(seq), -1).float().numpy() for r in out.router_logits])
    logits = out.logits[0].float().numpy()
    # generate() runs with a KV cache; the teacher-forced pass must agree on every greedy token.
    forced = logits[len(prompt) - 1:].argmax(-1).tolist()
    if forced != greedy:
        raise RuntimeError(f"generate() and the full forward pass disagree: {greedy} vs {forced}")
    return Reference(prompt, greedy, seq, logits, router, group_margin)


def main() -> int:
    ap = argparse.ArgumentParser(description="greedy continuation from HF transformers")
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("--gguf", type=Path, help="take the weights from this GGUF (dequantized)")
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--n-gen", type=int, default=32)
    args = ap.parse_args()
    state = gguf_to_hf_state(args.gguf, args.hf_dir) if args.gguf else None
    ref = reference(load_hf_model(args.hf_dir, state), [int(x) for x in args.prompt_ids.split(",")], args.n_gen)
    print(json.dumps({"greedy": ref.greedy, "logit_margin": ref.logit_margin()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
