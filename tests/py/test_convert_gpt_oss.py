# Tests (pytest) of convert_hf_to_gguf.py's gpt-oss path: the committed tiny model's config reads back, the files
# carry llama.cpp's gpt-oss keys and tensor names, MXFP4 checkpoint blocks are repacked to the values
# transformers' dequantizer gives them, and settings llama.cpp hard-codes are refused in one line.
import copy
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "py"))
import convert_hf_to_gguf as conv  # noqa: E402

TINY = REPO / "tests/data/models/gptoss"
# transformers.integrations.mxfp4.FP4_VALUES: the E2M1 code of each nibble.
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _config() -> dict:
    return json.loads((TINY / "tiny-f32.ref.json").read_text())["hf_config"]


def test_tiny_config_reads_back():
    hp = conv.read_hparams(_config(), Path("config.json"), "GptOssForCausalLM")
    assert hp.gpt_oss.sliding_window == 5 and hp.gpt_oss.yarn["factor"] == 32.0
    assert (hp.n_ff_exp, hp.n_expert, hp.n_expert_used, hp.norm_topk_prob) == (32, 8, 4, False)


def test_files_have_llama_cpp_gpt_oss_keys_and_names():
    for name, expert_type in (("tiny-f32.gguf", gguf.GGMLQuantizationType.F32),
                              ("tiny-mxfp4.gguf", gguf.GGMLQuantizationType.MXFP4)):
        r = gguf.GGUFReader(str(TINY / name))
        keys = set(r.fields)
        for k in ("attention.sliding_window", "expert_feed_forward_length", "feed_forward_length", "rope.freq_base",
                  "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
                  "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "attention.key_length"):
            assert f"gpt-oss.{k}" in keys, k
        assert "gpt-oss.expert_weights_norm" not in keys  # llama.cpp's GptOssModel does not write it
        tensors = {t.name: t for t in r.tensors}
        per_layer = ["attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias",
                     "attn_v.weight", "attn_v.bias", "attn_output.weight", "attn_output.bias", "attn_sinks.weight",
                     "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias",
                     "ffn_gate_exps.weight", "ffn_gate_exps.bias", "ffn_up_exps.weight", "ffn_up_exps.bias",
                     "ffn_down_exps.weight", "ffn_down_exps.bias"]
        want = {"token_embd.weight", "output_norm.weight", "output.weight"}
        want |= {f"blk.{i}.{n}" for i in range(4) for n in per_layer}
        assert set(tensors) == want
        assert tensors["blk.0.ffn_down_exps.weight"].tensor_type == expert_type
        assert tensors["blk.0.ffn_gate_exps.bias"].tensor_type == gguf.GGMLQuantizationType.F32
        assert [int(x) for x in tensors["blk.0.ffn_gate_exps.bias"].shape] == [32, 8]


def _hf_dequant(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' _convert_moe_packed_tensors without its final transpose: [..., G, 16] -> [..., G * 32]."""
    lut = np.array(FP4_VALUES, np.float64)
    vals = np.stack([lut[blocks & 0x0F], lut[blocks >> 4]], axis=-1).reshape(*blocks.shape, 2)
    vals = vals.reshape(*blocks.shape[:-1], 32)
    return np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).reshape(*blocks.shape[:-2], -1)


def test_mxfp4_repack_gives_transformers_values():
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(2, 3, 4, 16), dtype=np.uint8)  # [E, rows, G, 16]
    scales = rng.integers(110, 140, size=(2, 3, 4), dtype=np.uint8)
    want = _hf_dequant(blocks, scales)  # transformers' low nibble first, then ldexp by scale - 127
    packed = conv.repack_mxfp4(blocks, scales)
    assert packed.shape == (2, 3, 4 * 17) and packed.dtype == np.uint8
    got = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(got.reshape(2, 3, 128), want.astype(np.float32))


def test_released_mxfp4_experts_are_split_and_repacked(tmp_path):
    """An expert block as the released checkpoints store it (gate_up rows interleaved gate, up, gate, ...): the
    converter's gate / up / down tensors dequantize to the even / odd / all rows HF's dequantizer gives."""
    pytest.importorskip("torch")  # TensorSource reads safetensors through torch
    from safetensors.numpy import save_file

    hp = conv.read_hparams(_config(), Path("config.json"), "GptOssForCausalLM")
    E, D, F = hp.n_expert, hp.n_embd, hp.n_ff_exp
    rng = np.random.default_rng(5)
    pre = "model.layers.0.mlp.experts"
    t = {f"{pre}.gate_up_proj_blocks": rng.integers(0, 256, (E, 2 * F, D // 32, 16), dtype=np.uint8),
         f"{pre}.gate_up_proj_scales": rng.integers(118, 130, (E, 2 * F, D // 32), dtype=np.uint8),
         f"{pre}.down_proj_blocks": rng.integers(0, 256, (E, D, F // 32, 16), dtype=np.uint8),
         f"{pre}.down_proj_scales": rng.integers(118, 130, (E, D, F // 32), dtype=np.uint8),
         f"{pre}.gate_up_proj_bias": rng.standard_normal((E, 2 * F)).astype(np.float32),
         f"{pre}.down_proj_bias": rng.standard_normal((E, D)).astype(np.float32)}
    save_file(t, str(tmp_path / "model.safetensors"))
    out = dict(conv.gpt_oss_experts(conv.TensorSource(tmp_path), hp, 0))
    gate_up = _hf_dequant(t[f"{pre}.gate_up_proj_blocks"], t[f"{pre}.gate_up_proj_scales"])  # [E, 2F, D]
    down = _hf_dequant(t[f"{pre}.down_proj_blocks"], t[f"{pre}.down_proj_scales"])  # [E, D, F]
    mx = gguf.GGMLQuantizationType.MXFP4
    for name, want in (("gate", gate_up[:, 0::2]), ("up", gate_up[:, 1::2]), ("down", down)):
        raw = out[f"blk.0.ffn_{name}_exps.weight"]
        assert raw.qtype == mx
        np.testing.assert_array_equal(gguf.quants.dequantize(raw.data, mx), want.astype(np.float32))
    np.testing.assert_array_equal(out["blk.0.ffn_gate_exps.bias"], t[f"{pre}.gate_up_proj_bias"][:, 0::2])
    np.testing.assert_array_equal(out["blk.0.ffn_up_exps.bias"], t[f"{pre}.gate_up_proj_bias"][:, 1::2])


@pytest.mark.parametrize("edit,needle", [
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ({"swiglu_limit": 8.0}, "swiglu_limit 8.0 is not supported"),
    ({"swiglu_alpha": 1.0}, "swiglu_alpha 1.0 is not supported"),
    ({"sliding_window": None}, "missing key 'sliding_window'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                          "original_max_position_embeddings": 4096, "attention_factor": 1.2}}, "YaRN rope parameters"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 150000.0, "factor": 2.0}}, "rope type 'linear'"),
])
def test_inexpressible_settings_are_one_line_errors(edit, needle):
    config = copy.deepcopy(_config())
    config.update(edit)
    with pytest.raises(conv.ConvertError) as e:
        conv.read_hparams(config, Path("/x/config.json"), "GptOssForCausalLM")
    assert needle in str(e.value) and str(e.value).startswith("/x/config.json: ") and "\n" not in str(e.value)
