# Tests (pytest) that our training expert dispatch computes what transformers' Qwen3MoeForCausalLM and
# MixtralForCausalLM compute, that the per-layer balancing loss balances each layer, and that the routing capture
# records the router's own top-k output. Skipped where torch/transformers are absent.
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "train"))
import moe_model  # noqa: E402
import routing_capture as rc  # noqa: E402


def _pair(spec):
    ref = moe_model.build_model(spec, 512, 0, 0.01, "cpu", 0, experts_impl="eager").eval()
    ours = moe_model.build_model(spec, 512, 0, 0.01, "cpu", 0).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("spec", ["demo-smoke", "topo-smoke", "mixtral-smoke"])
def test_forward_matches_transformers_eager(spec):
    ref, ours = _pair(spec)
    x = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ref(input_ids=x).logits
        b = ours(input_ids=x).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())


def test_grouped_and_looped_agree_with_gradients():
    r = moe_model.self_test_experts("cpu")
    assert r["ok"], r


def test_training_loss_gradients_match_eager():
    ref, ours = _pair("demo-smoke")
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    grads = []
    for m in (ref, ours):
        m.train()
        out = m(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-4), n


def test_routing_capture_matches_router():
    _, m = _pair("topo-smoke")
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    ids, w, inputs = rc.route_sequences(m, seqs, 0, torch.device("cpu"), keep_inputs_for=[1])
    assert ids.shape == (9, m.config.num_hidden_layers, m.config.num_experts_per_tok)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)        # norm_topk_prob renormalises
    assert (np.diff(w, axis=-1) <= 1e-7).all()                     # router order: descending weight
    # recompute layer 0 of sequence 1 from its recorded router input and the router weight
    x = torch.from_numpy(inputs[1][:, 0])
    probs = torch.softmax(x @ m.model.layers[0].mlp.gate.weight.detach().t(), -1)
    top = torch.topk(probs, m.config.num_experts_per_tok, -1)
    assert (top.indices.numpy() == ids[6:, 0]).all()
    np.testing.assert_allclose((top.values / top.values.sum(-1, keepdim=True)).numpy(), w[6:, 0], atol=1e-6)
    # padding in a batch must not change routing: route sequence 1 alone
    ids1, w1, _ = rc.route_sequences(m, seqs[1:], 0, torch.device("cpu"))
    assert (ids1 == ids[6:]).all()
    np.testing.assert_allclose(w1, w[6:], atol=1e-6)


def test_mixtral_spec_builds_mixtral():
    m = moe_model.build_model("mixtral-smoke", 512, 0, 0.01, "cpu", 0)
    assert m.config.model_type == "mixtral" and moe_model.n_experts_of(m.config) == 8
    assert rc.gguf_arch(m) == "llama"
    big = moe_model.make_config("topo-mixtral", 8192, 0, 0.01)
    assert (big.num_hidden_layers, big.num_local_experts, big.num_experts_per_tok) == (32, 8, 2)
    assert big.num_key_value_heads < big.num_attention_heads  # GQA
    assert moe_model.make_config("topo-b", 8192, 0, 0.01, {"num_hidden_layers": 4}).num_hidden_layers == 4


def test_v2lite_spec_routes_like_deepseek_v2_lite():
    # DeepSeek-V2-Lite's routing topology (decision 0135): 26 MoE layers x 64 experts, top-6, and the raw softmax
    # probabilities of the top-6 as weights (norm_topk_prob false), as a Qwen3-MoE
    cfg = moe_model.make_config("topo-v2lite", 8192, 0, 0.01)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 26, 64, 6)
    assert cfg.norm_topk_prob is False and cfg.mlp_only_layers == []
    m = moe_model.build_model("v2lite-smoke", 512, 0, 0.01, "cpu", 0).eval()
    ids, w, _ = rc.route_sequences(m, [[5, 6, 7, 8, 9]], 0, torch.device("cpu"))
    assert ids.shape == (5, 3, 6) and (w.sum(-1) < 1 - 1e-3).all()
    assert moe_model.make_config("topo-b", 8192, 0, 0.01).norm_topk_prob  # the others still renormalise
    with pytest.raises(SystemExit):
        moe_model.make_config("topo-mixtral", 8192, 0, 0.01, {"norm_topk_prob": False})


def test_per_layer_balance_loss_sees_what_the_pooled_loss_misses():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    n_tok, n_exp, k = 400, 8, 2
    uniform = (torch.zeros(n_tok, n_exp),) * 3
    assert float(moe_model.per_layer_balance_loss(uniform, k)) == pytest.approx(k)
    # layer 0 prefers experts 0-3, layer 1 experts 4-7: each layer is skewed, their pool is balanced
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(n_tok, n_exp, generator=g) * 0.1
    bias = torch.tensor([4.0] * 4 + [0.0] * 4)
    skewed = (noise + bias, noise + bias.flip(0))
    pooled = float(load_balancing_loss_func(skewed, n_exp, k))
    per_layer = float(moe_model.per_layer_balance_loss(skewed, k))
    assert pooled == pytest.approx(k, rel=0.05)      # the pooled loss calls this balanced
    assert per_layer > 1.8 * k                        # each layer sends about all its load to half the experts
    # and it is differentiable towards balance
    logits = (noise + bias).requires_grad_(True)
    moe_model.per_layer_balance_loss((logits,), k).backward()
    assert (logits.grad[:, :4].sum() > 0) and (logits.grad[:, 4:].sum() < 0)


def test_sequence_wise_balance_sees_windows_that_keep_to_few_experts():
    n_exp, k, window = 8, 2, 50
    g = torch.Generator().manual_seed(1)
    bias = torch.tensor([4.0] * 4 + [0.0] * 4)
    # window 0 prefers experts 0-3, window 1 experts 4-7: the batch is balanced, each window is not
    logits = torch.cat([torch.randn(window, n_exp, generator=g) * 0.1 + bias,
                        torch.randn(window, n_exp, generator=g) * 0.1 + bias.flip(0)])
    batch = float(moe_model.per_layer_balance_loss((logits,), k))
    windows = float(moe_model.per_layer_balance_loss((logits,), k, group_tokens=window))
    assert batch == pytest.approx(k, rel=0.05) and windows > 1.8 * k
