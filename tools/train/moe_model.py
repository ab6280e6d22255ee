# Model side of the training jobs (issues 3 and 9): environment checks, the demo/topo Qwen3-MoE and topo-mixtral
# Mixtral configurations, the per-layer load-balancing loss, and a fast expert dispatch (one grouped matrix product per
# projection) registered into transformers' experts interface.
"""Qwen3-MoE and Mixtral model construction for training.

We train transformers' own Qwen3MoeForCausalLM. Its experts module (Qwen3MoeExperts: gate_up_proj [E, 2I, H],
down_proj [E, H, I]) dispatches through transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS; transformers' built-in
"grouped_mm" path feeds the fp32 master weights to torch's grouped_mm, whose fast CUDA kernel takes bf16 only (other
dtypes fall back to a per-expert loop with a host sync). `grouped_bf16` below casts activations and weights to the
compute dtype first, keeping fp32 master weights and the same mathematics as Qwen3MoeExperts.forward.
"""
import math

import torch
import torch.nn.functional as F

MIN_TRANSFORMERS = (5, 0)
EXPERTS_IMPL = "prescope_grouped"
_GROUPED = {"enabled": True}

# Shapes fixed by the lead for issue 3 (see docs/data/models.md). Both share the 8192-token tokenizer.
MODEL_SPECS = {
    "demo": dict(hidden_size=256, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64),
    # Qwen3-30B-A3B's routing topology (48 layers, 128 experts, top-8) at tiny width.
    "topo": dict(hidden_size=64, num_hidden_layers=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32),
    # Issue 9's balanced models (docs/decisions/0090-balanced-routing.md): Qwen3-30B-A3B's topology (48 x 128, top-8)
    # and Mixtral-8x7B's (32 x 8, top-2; llama architecture with experts, GQA, no QK-norm), wider than the first topo.
    "topo-b": dict(hidden_size=128, num_hidden_layers=48, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32),
    "topo-mixtral": dict(arch="mixtral", hidden_size=128, num_hidden_layers=32, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=448),
    # Issue 12's DeepSeek-V2-Lite benchmark topology (decision 0135): its 26 MoE layers (27 blocks less the dense
    # first one) x 64 experts, top-6, softmax scores without renormalisation (V2-Lite's norm_topk_prob false), as a
    # Qwen3-MoE: the trace carries only the routing. Expert FFN 96: V2-Lite's 1408 / 2048 of the hidden size (88)
    # rounded up to a multiple of 32.
    "topo-v2lite": dict(hidden_size=128, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, num_experts=64, num_experts_per_tok=6, moe_intermediate_size=96,
                        norm_topk_prob=False),
    # --smoke shapes: same code paths, Q8_0-compatible row lengths (multiples of 32).
    "demo-smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "topo-smoke": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32),
    "mixtral-smoke": dict(arch="mixtral", hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32),
    "v2lite-smoke": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, num_experts=16, num_experts_per_tok=6, moe_intermediate_size=32,
                         norm_topk_prob=False),
}
ROPE_THETA = 1_000_000.0   # Qwen3-30B-A3B's value
MAX_POSITIONS = 4096


def _version_tuple(v):
    out = []
    for part in v.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def check_environment(require_cuda):
    """Fails early, with one clear line, if the Python stack cannot run this pipeline; returns version strings."""
    import transformers
    problems = []
    if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
        problems.append(f"transformers {transformers.__version__} < 5.0 (needs the fused Qwen3MoeExperts)")
    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: F401
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: F401
        from transformers.models.qwen3_moe import modeling_qwen3_moe as mq
        if not hasattr(mq, "Qwen3MoeExperts") or not hasattr(mq, "Qwen3MoeTopKRouter"):
            problems.append("transformers' qwen3_moe lacks Qwen3MoeExperts/Qwen3MoeTopKRouter")
    except ImportError as e:
        problems.append(f"transformers import failed: {e}")
    for mod in ("gguf", "zstandard", "safetensors", "tokenizers", "numpy"):
        try:
            __import__(mod)
        except ImportError:
            problems.append(f"python module {mod} missing (carry it as a wheel in .whl/)")
    if require_cuda and not torch.cuda.is_available():
        problems.append("CUDA is not available to torch")
    if grouped_mm_fn() is None:
        problems.append(f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm")
    if problems:
        raise SystemExit("environment check failed: " + "; ".join(problems))
    from importlib.metadata import version
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "gguf": version("gguf"), "zstandard": version("zstandard"),
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def spec_arch(spec):
    """"qwen3moe" or "mixtral" for a MODEL_SPECS entry."""
    return spec.get("arch", "qwen3moe")


def make_config(name, vocab_size, eos_token_id, aux_loss_coef, overrides=None):
    """Qwen3MoeConfig or MixtralConfig for MODEL_SPECS[name] (with `overrides`, e.g. a probe's layer count or width);
    every MoE-relevant field set explicitly (norm_topk_prob=True for qwen3moe unless the spec says otherwise, as
    llama.cpp's qwen3moe graph always renormalises the top-k weights; topo-v2lite routes like DeepSeek-V2-Lite,
    without; Mixtral always renormalises)."""
    spec = dict(MODEL_SPECS[name])
    spec.update(overrides or {})
    arch = spec.pop("arch", "qwen3moe")
    norm_topk_prob = spec.pop("norm_topk_prob", True)
    if arch == "mixtral" and not norm_topk_prob:
        raise SystemExit(f"make_config({name}): Mixtral always renormalises its top-k weights")
    common = dict(vocab_size=vocab_size, hidden_act="silu", max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, output_router_logits=True, router_aux_loss_coef=aux_loss_coef,
                  use_cache=True, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    if arch == "mixtral":
        from transformers import MixtralConfig
        kw = dict(common, hidden_size=spec["hidden_size"], num_hidden_layers=spec["num_hidden_layers"],
                  num_attention_heads=spec["num_attention_heads"], num_key_value_heads=spec["num_key_value_heads"],
                  head_dim=spec["head_dim"], num_local_experts=spec["num_experts"],
                  num_experts_per_tok=spec["num_experts_per_tok"], intermediate_size=spec["moe_intermediate_size"],
                  router_jitter_noise=0.0, sliding_window=None)
        try:
            cfg = MixtralConfig(rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, **kw)
        except TypeError:
            cfg = MixtralConfig(rope_theta=ROPE_THETA, **kw)
        if cfg.num_local_experts != spec["num_experts"]:
            raise SystemExit(f"make_config({name}): transformers did not keep num_local_experts")
        return cfg
    from transformers import Qwen3MoeConfig
    kw = dict(common, intermediate_size=4 * spec["hidden_size"], attention_bias=False, decoder_sparse_step=1,
              mlp_only_layers=[], norm_topk_prob=norm_topk_prob, **spec)
    try:
        cfg = Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, **kw)
    except TypeError:
        cfg = Qwen3MoeConfig(rope_theta=ROPE_THETA, **kw)
    if bool(cfg.norm_topk_prob) != norm_topk_prob or cfg.num_experts != spec["num_experts"]:
        raise SystemExit(f"make_config({name}): transformers did not keep norm_topk_prob/num_experts")
    return cfg


def n_experts_of(config):
    """Routed experts per layer of a Qwen3MoeConfig (num_experts) or MixtralConfig (num_local_experts)."""
    return getattr(config, "num_experts", None) or config.num_local_experts


def per_layer_balance_loss(router_logits, top_k, group_tokens=None):
    """Load-balancing loss computed per layer and averaged over layers (Switch Transformer, Fedus et al. 2021,
    eqs. 4-6, at each layer as Mixtral/Switch apply it): E * sum_e f_e P_e, f_e = top-k assignments to expert e per
    token, P_e = mean router probability of e; k at perfect balance, the scale of transformers' loss.

    router_logits: tuple of [tokens, E] per layer. With group_tokens, f and P are taken over each run of that many
    consecutive tokens (one training window) and the losses averaged: DeepSeek-V3's sequence-wise balance loss
    (arXiv 2412.19437, eqs. 17-20), which penalises a window that keeps to a few experts even when the batch is
    balanced. transformers' load_balancing_loss_func sums f and P over all layers before the product, so it balances
    only the layer average: each layer may stay skewed as long as the skews of the layers cancel (the cause of the
    first topo's skew, decision 0090)."""
    losses = []
    for g in router_logits:
        p = torch.softmax(g.float(), dim=-1)
        n_tok, n_exp = p.shape
        groups = n_tok // group_tokens if group_tokens else 1
        p = p.reshape(groups, -1, n_exp)                                  # [groups, tokens per group, E]
        idx = torch.topk(p, top_k, dim=-1).indices.reshape(groups, -1)
        f = torch.zeros(groups, n_exp, dtype=torch.float32, device=p.device).scatter_add_(
            1, idx, torch.ones_like(idx, dtype=torch.float32)) / p.shape[1]
        losses.append(n_exp * torch.sum(f * p.mean(dim=1), dim=1).mean())
    return torch.stack(losses).mean()


def grouped_mm_fn():
    """torch's grouped matrix product (2-D input x 3-D weights with group offsets), or None if torch lacks one."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _autocast_on(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_enabled()


def grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Qwen3MoeExperts.forward, registered as EXPERTS_IMPL.

    hidden_states [T, H]; top_k_index int [T, k]; top_k_weights [T, k] (already renormalised by the router).
    Returns [T, H] in hidden_states' dtype: sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)), e = top_k_index[:, j],
    gate/up from gate_up_proj[e] = [gate; up] (HF layout). Under CUDA autocast (training) the two products are bf16
    grouped matrix products with no host synchronisation; on the CPU fp32 grouped products (a per-expert Python loop
    over 128 experts x 48 layers costs more than the arithmetic there); otherwise (fp32 evaluation and traces on CUDA)
    an fp32 loop over the experts with one host synchronisation per call, which needs nothing beyond torch.matmul.
    """
    if _GROUPED["enabled"] and hidden_states.is_cuda and _autocast_on("cuda"):
        return experts_grouped(self, hidden_states, top_k_index, top_k_weights, torch.bfloat16)
    if _GROUPED["enabled"] and not hidden_states.is_cuda and grouped_mm_fn() is not None:
        return experts_grouped(self, hidden_states, top_k_index, top_k_weights, torch.float32)
    return experts_looped(self, hidden_states, top_k_index, top_k_weights)


def set_grouped_enabled(flag):
    """Turns the grouped bf16 path off (after a failed self-test): training then uses the looped path."""
    _GROUPED["enabled"] = bool(flag)


def grouped_enabled():
    """Whether training uses the grouped bf16 path (see set_grouped_enabled)."""
    return _GROUPED["enabled"]


def _sorted_assignments(top_k_index, n_exp):
    """(order, counts): token-expert pairs sorted by expert (stable) and the number of pairs per expert (int32)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_exp, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    return order, counts


def _combine(y_sorted, order, top_k_weights, n_tok, k, out_dtype):
    y = y_sorted.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.empty_like(y)
    out[order] = y
    return out.view(n_tok, k, -1).sum(dim=1).to(out_dtype)


def experts_grouped(self, hidden_states, top_k_index, top_k_weights, dtype):
    """Both expert projections as torch grouped products (2-D tokens x 3-D weights, group offsets) in `dtype`."""
    mm = grouped_mm_fn()
    n_tok, k = top_k_index.shape
    order, counts = _sorted_assignments(top_k_index, self.gate_up_proj.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = hidden_states[order // k].to(dtype)
    gate, up = mm(x, self.gate_up_proj.to(dtype).transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = mm(self.act_fn(gate) * up, self.down_proj.to(dtype).transpose(1, 2), offs=offs)
    return _combine(y, order, top_k_weights, n_tok, k, hidden_states.dtype)


def experts_looped(self, hidden_states, top_k_index, top_k_weights):
    """The same arithmetic as experts_grouped, one matmul pair per non-empty expert, in the weights' dtype."""
    n_tok, k = top_k_index.shape
    order, counts = _sorted_assignments(top_k_index, self.gate_up_proj.shape[0])
    x = hidden_states[order // k].to(self.gate_up_proj.dtype)
    y = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = (x[start:start + n] @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            y[start:start + n] = (self.act_fn(gate) * up) @ self.down_proj[e].t()
            start += n
    return _combine(y, order, top_k_weights, n_tok, k, hidden_states.dtype)


def reference_experts_forward(gate_up_proj, down_proj, hidden_states, top_k_index, top_k_weights):
    """Plain per-expert loop in fp32 (the arithmetic of Qwen3MoeExperts.forward), for self-tests."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e in range(gate_up_proj.shape[0]):
        tok, pos = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        g, u = F.linear(hidden_states[tok].float(), gate_up_proj[e].float()).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down_proj[e].float()) * top_k_weights[tok, pos, None].float()
        out.index_add_(0, tok, y)
    return out


def register_experts_impl():
    """Adds EXPERTS_IMPL to transformers' experts interface (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, grouped_experts_forward)


def self_test_experts(device):
    """Checks the expert implementations (values and gradients) against the fp32 reference loop on random data.

    On CUDA it tests the training path (bf16 grouped products under autocast) and the fp32 loop; on CPU the fp32
    grouped products and the loop. Returns {"ok", "results": {path: (rel_err_out, rel_err_grad, tol)}}.
    """
    g = torch.Generator(device="cpu").manual_seed(1)
    n_exp, hid, inter, n_tok, k = 16, 64, 32, 200, 4

    class _E(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(n_exp, 2 * inter, hid, generator=g) * 0.1)
            self.down_proj = torch.nn.Parameter(torch.randn(n_exp, hid, inter, generator=g) * 0.1)
            self.act_fn = F.silu

    m = _E().to(device)
    x0 = torch.randn(n_tok, hid, generator=g).to(device)
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(n_tok)]).to(device)
    idx[:, 0] = 3  # one crowded expert (a repeated id in a row is summed twice by every implementation)
    idx[idx == 9] = 10  # and one empty expert
    w = torch.softmax(torch.randn(n_tok, k, generator=g), -1).to(device)

    def run(fn):
        x = x0.clone().requires_grad_(True)
        m.zero_grad()
        y = fn(x)
        y.float().square().sum().backward()
        return y.detach().float(), [x.grad.float(), m.gate_up_proj.grad.float(), m.down_proj.grad.float()]

    def rel(a, b):
        return float((a - b).norm() / (b.norm() + 1e-12))

    y_ref, g_ref = run(lambda x: reference_experts_forward(m.gate_up_proj, m.down_proj, x, idx, w))
    paths = {"looped_fp32": (lambda x: experts_looped(m, x, idx, w), 1e-4)}
    if torch.device(device).type == "cuda":
        def train_path(x):
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                return grouped_experts_forward(m, x, idx, w)
        paths["grouped_bf16_autocast"] = (train_path, 3e-2)
    else:
        paths["grouped_fp32"] = (lambda x: experts_grouped(m, x, idx, w, torch.float32), 1e-4)
    results, ok = {}, True
    for name, (fn, tol) in paths.items():
        try:
            y, grads = run(fn)
            e_out, e_grad = rel(y, y_ref), max(rel(a, b) for a, b in zip(grads, g_ref))
        except Exception as e:  # an unsupported kernel is a failed check, not a crash
            results[name] = f"{type(e).__name__}: {e}"
            ok = False
            continue
        results[name] = (e_out, e_grad, tol)
        ok = ok and math.isfinite(e_out) and math.isfinite(e_grad) and e_out < tol and e_grad < tol
    return {"ok": ok, "results": results}


def build_model(name, vocab_size, eos_token_id, aux_loss_coef, device, seed, experts_impl=EXPERTS_IMPL,
                overrides=None):
    """A freshly initialised Qwen3MoeForCausalLM or MixtralForCausalLM (fp32 weights, seed `seed`) on `device` with
    the given experts implementation ("eager", "grouped_mm" or EXPERTS_IMPL); overrides as in make_config."""
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM
    register_experts_impl()
    cfg = make_config(name, vocab_size, eos_token_id, aux_loss_coef, overrides)
    torch.manual_seed(seed)
    model = (MixtralForCausalLM if cfg.model_type == "mixtral" else Qwen3MoeForCausalLM)(cfg)
    model.set_experts_implementation(experts_impl)
    return model.to(device)
