# Records a Qwen3-MoE or Mixtral model's routing (top-k expert ids and gate weights per token and layer, optionally the router
# inputs) with forward hooks on transformers' own router modules, and writes .pstrace files and hidden sidecars.
"""Routing capture.

The hook sits on every layer's `mlp.gate` (Qwen3MoeTopKRouter, MixtralTopKRouter). Its forward returns (router_logits,
top_k_weights, top_k_index): softmax over all experts in fp32, top-k, renormalised (when norm_topk_prob for Qwen3;
always for Mixtral); these are the weights the model multiplies the expert outputs by (transformers'
modeling_qwen3_moe.py, modeling_mixtral.py), so they are recorded as they are. Its input is the post-attention
RMSNorm output, which the hidden sidecar stores.
"""
import hashlib
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
import pstrace  # noqa: E402


class RouterHooks:
    """Context manager: while active, `records[l]` holds layer l's (input, weights, ids) of the last forward."""

    def __init__(self, model, keep_inputs):
        self.layers = model.model.layers
        self.keep_inputs = keep_inputs
        self.records = [None] * len(self.layers)
        self.handles = []

    def _hook(self, layer_idx):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise RuntimeError(f"layer {layer_idx} router returned {type(output).__name__}; expected "
                                   "(router_logits, top_k_weights, top_k_index) as in transformers 5.x")
            _, weights, ids = output
            x = args[0] if args else None
            self.records[layer_idx] = (x.detach().float() if self.keep_inputs else None, weights.detach().float(),
                                       ids.detach())
        return hook

    def __enter__(self):
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


@torch.no_grad()
def route_sequences(model, sequences, pad_id, device, keep_inputs_for=(), max_batch_tokens=16384):
    """Routing of each token sequence (list of int lists), batched by length with right padding (causal attention
    makes padding invisible to real tokens).

    Returns (ids uint8 [N, L, k], weights float32 [N, L, k], inputs {seq_index: float32 [n_i, L, H]}) with N the total
    number of tokens in sequence order; router inputs are kept only for sequence indices in keep_inputs_for.
    """
    model.eval()
    n_layer = len(model.model.layers)
    k = model.config.num_experts_per_tok
    lengths = [len(s) for s in sequences]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(starts[-1])
    ids_out = np.zeros((total, n_layer, k), dtype=np.uint8)
    w_out = np.zeros((total, n_layer, k), dtype=np.float32)
    keep = set(keep_inputs_for)
    inputs = {}
    order = sorted(range(len(sequences)), key=lambda i: -lengths[i])
    pos = 0
    with RouterHooks(model, keep_inputs=bool(keep)) as hooks:
        while pos < len(order):
            max_len = lengths[order[pos]]
            n_batch = max(1, min(len(order) - pos, max_batch_tokens // max(max_len, 1)))
            batch = order[pos:pos + n_batch]
            pos += n_batch
            x = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
            for r, i in enumerate(batch):
                x[r, :lengths[i]] = torch.tensor(sequences[i], dtype=torch.long)
            model.model(input_ids=x.to(device), use_cache=False)
            per_layer = [(inp.reshape(len(batch), max_len, -1) if inp is not None else None,
                          w.reshape(len(batch), max_len, k).cpu().numpy(), e.reshape(len(batch), max_len, k).cpu())
                         for inp, w, e in hooks.records]
            for r, i in enumerate(batch):
                n = lengths[i]
                a, b = starts[i], starts[i] + n
                for layer, (inp, w, e) in enumerate(per_layer):
                    ids_out[a:b, layer] = e[r, :n].numpy().astype(np.uint8)
                    w_out[a:b, layer] = w[r, :n]
                if i in keep:
                    inputs[i] = torch.stack([inp[r, :n] for inp, _, _ in per_layer], dim=1).cpu().numpy()
    return ids_out, w_out, inputs


def select_sequences(tokenizer, candidates, budgets, max_len, min_len=8):
    """Chooses trace sequences: for each source, candidates in the given order, each truncated to max_len tokens,
    until that source's token budget is spent (the last one is cut to fit).

    candidates: [{"name", "source", "text"}]; budgets: {source: tokens}. Returns [{"name", "source", "tokens"}] in
    the order of `budgets` then of candidates.
    """
    by_source = {s: [] for s in budgets}
    for c in candidates:
        if c["source"] in by_source:
            by_source[c["source"]].append(c)
    out = []
    for source, budget in budgets.items():
        left = budget
        texts = by_source[source]
        for start in range(0, len(texts), 256):
            if left < min_len:
                break
            chunk = texts[start:start + 256]
            for c, enc in zip(chunk, tokenizer.encode_batch([c["text"] for c in chunk])):
                toks = enc.ids[:min(max_len, left)]
                if len(toks) < min_len:
                    continue
                out.append({"name": c["name"], "source": source, "tokens": toks})
                left -= len(toks)
                if left < min_len:
                    break
    return out


def round_robin_by_source(docs, source_key):
    """Documents reordered so that consecutive ones come from different groups (groups in sorted order, each group
    in sha256(id) order): the head of the list samples every group."""
    groups = {}
    for d in docs:
        groups.setdefault(source_key(d), []).append(d)
    for g in groups.values():
        g.sort(key=lambda d: hashlib.sha256(d["id"].encode()).hexdigest())
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        for key in sorted(groups):
            if i < len(groups[key]):
                out.append(groups[key][i])
    return out


# GGUF architecture names (llama.cpp writes Mixtral as "llama" with experts), by transformers model_type.
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def gguf_arch(model):
    """The GGUF architecture name of a transformers model, as a trace's "arch" field."""
    return GGUF_ARCH[model.config.model_type]


def write_trace_file(path, model, model_name, seqs, ids, weights, created_by, level, threads):
    """Writes one .pstrace for `seqs` (select_sequences output, optionally with "n_prompt": tokens before a decoded
    continuation) with routing arrays from route_sequences."""
    tokens = np.concatenate([np.asarray(s["tokens"], dtype=np.uint32) for s in seqs])
    n_expert = getattr(model.config, "num_experts", None) or model.config.num_local_experts
    return pstrace.write_trace(
        path, model=model_name, arch=gguf_arch(model), n_expert=n_expert,
        sequences=[{"name": s["name"], "source": s["source"], "n_tokens": len(s["tokens"]),
                    **({"n_prompt": s["n_prompt"]} if "n_prompt" in s else {})} for s in seqs],
        token_ids=tokens, expert_ids=ids, gate_weights=weights, created_by=created_by, level=level, threads=threads)
