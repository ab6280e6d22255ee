# Tests (pytest) of tools/py/make_bench_model.py: the --tiny files of every shape carry the keys, tensors and types the
# full shape would (DeepSeek-V2-Lite's as llama.cpp's converter writes them), and PreScope loads and runs them on the
# CPU; the full V2-Lite plan has the sizes bench/offload/report.py assumes for llama.cpp's --n-cpu-moe match.
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "py"))
sys.path.insert(0, str(ROOT / "bench" / "offload"))
import make_bench_model as mbm  # noqa: E402
import report  # noqa: E402

PRESCOPE = Path(os.environ.get("PRESCOPE_BIN", ROOT / "build" / "bin" / "prescope"))


def _write(tmp_path, shape, *extra):
    out = tmp_path / f"{shape}.gguf"
    assert mbm.main(["--out", str(out), "--shape", shape, "--tiny", *extra]) == 0
    return out


def _value(reader, key):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def v2lite(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("v2lite"), "deepseek-v2-lite")


def test_v2lite_keys_are_llama_cpp_converters(v2lite):
    r = gguf.GGUFReader(v2lite)
    a = "deepseek2"
    t = mbm.TINY["deepseek-v2-lite"]
    want = {
        "general.architecture": a, f"{a}.block_count": 27, f"{a}.leading_dense_block_count": 1,
        f"{a}.embedding_length": t["n_embd"], f"{a}.feed_forward_length": t["n_ff_dense"],
        f"{a}.attention.head_count": t["n_head"], f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.kv_lora_rank": t["kv_lora_rank"],
        f"{a}.attention.key_length": t["kv_lora_rank"] + t["rope"], f"{a}.attention.value_length": t["kv_lora_rank"],
        f"{a}.attention.key_length_mla": t["nope"] + t["rope"], f"{a}.attention.value_length_mla": t["v_head"],
        f"{a}.rope.dimension_count": t["rope"], f"{a}.expert_count": 64, f"{a}.expert_used_count": 6,
        f"{a}.expert_shared_count": 2, f"{a}.expert_feed_forward_length": t["n_ff_exp"],
        f"{a}.expert_group_count": 1, f"{a}.expert_group_used_count": 1, f"{a}.expert_gating_func": 1,
        f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.original_context_length": 4096,
        f"{a}.vocab_size": t["n_vocab"], f"{a}.context_length": 163840, "tokenizer.ggml.pre": "deepseek-llm",
    }
    for k, v in want.items():
        assert _value(r, k) == v, k
    assert _value(r, f"{a}.rope.scaling.factor") == pytest.approx(40.0)
    assert _value(r, f"{a}.rope.scaling.yarn_log_multiplier") == pytest.approx(0.0707, rel=1e-6)
    assert _value(r, f"{a}.expert_weights_scale") == pytest.approx(1.0)
    assert _value(r, f"{a}.rope.freq_base") == pytest.approx(1e4)
    # V2-Lite has no q-LoRA and does not renormalise: llama.cpp's converter writes neither key.
    for k in (f"{a}.attention.q_lora_rank", f"{a}.expert_weights_norm"):
        assert k not in r.fields


def test_v2lite_tensors_and_types(v2lite):
    r = gguf.GGUFReader(v2lite)
    t = mbm.TINY["deepseek-v2-lite"]
    tensors = {x.name: ([int(d) for d in x.shape], x.tensor_type) for x in r.tensors}
    Q8, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    e, nh, r_kv = t["n_embd"], t["n_head"], t["kv_lora_rank"]
    assert tensors["blk.0.attn_k_b.weight"] == ([t["nope"], r_kv, nh], Q8)
    assert tensors["blk.0.attn_v_b.weight"] == ([r_kv, t["v_head"], nh], Q8)
    assert tensors["blk.0.attn_kv_a_mqa.weight"] == ([e, r_kv + t["rope"]], Q8)
    assert tensors["blk.0.attn_kv_a_norm.weight"] == ([r_kv], F32)
    assert tensors["blk.0.ffn_down.weight"] == ([t["n_ff_dense"], e], Q8)
    assert tensors["blk.1.ffn_gate_inp.weight"] == ([e, 64], F32)
    assert tensors["blk.1.ffn_down_exps.weight"] == ([t["n_ff_exp"], e, 64], Q8)
    assert tensors["blk.1.ffn_up_shexp.weight"] == ([e, 2 * t["n_ff_exp"]], Q8)
    names = set(tensors)
    assert "blk.0.ffn_gate_inp.weight" not in names and "blk.1.ffn_gate.weight" not in names
    assert not any(n.endswith(("attn_kv_b.weight", "attn_q_a.weight", "exp_probs_b.bias")) for n in names)
    assert sum(n.endswith("ffn_gate_exps.weight") for n in names) == 26
    for n, (_, typ) in tensors.items():
        if n.endswith("norm.weight") or n.endswith("ffn_gate_inp.weight"):
            assert typ == F32, n
        else:
            assert typ == Q8, n


def test_v2lite_needs_a_moe_layer(tmp_path):
    with pytest.raises(SystemExit):
        mbm.main(["--out", str(tmp_path / "x.gguf"), "--shape", "deepseek-v2-lite", "--layers", "1"])


def test_full_v2lite_sizes_match_the_report():
    """The full shape: 16.7 GB, 561 MiB of routed experts per MoE layer (report.py's per-layer figure for the
    --n-cpu-moe match) in 26 MoE layers of 27 blocks."""
    sh = mbm.shape_of("deepseek-v2-lite")
    plan = mbm.deepseek2_plan(sh, sh["layers"])

    def nbytes(shape, quant):
        n = int(np.prod(shape))
        return n // 32 * 34 if quant else 4 * n

    total = sum(nbytes(s, q) for _, s, q in plan)
    experts = sum(nbytes(s, q) for n, s, q in plan if n.endswith("_exps.weight"))
    assert 16.6e9 < total < 16.8e9
    base, per_layer, n_layer = report.LLAMA_MEMORY["deepseek-v2-lite"]
    assert experts / 26 / 2**20 == pytest.approx(per_layer, abs=0.5)
    assert n_layer == sh["layers"] and report.LLAMA_DENSE_LEAD["deepseek-v2-lite"] == sh["n_dense"]


def test_ncmoe_match_counts_the_dense_block():
    # blocks N..26 keep their experts on the GPU; N = 1 moves nothing (block 0 is dense), so it is written 0
    assert report.moe_layers_on_gpu(0, "deepseek-v2-lite") == 26
    assert report.moe_layers_on_gpu(1, "deepseek-v2-lite") == 26
    assert report.moe_layers_on_gpu(19, "deepseek-v2-lite") == 8
    base, per_layer, _ = report.LLAMA_MEMORY["deepseek-v2-lite"]
    assert report.match_ncmoe(base + 8 * per_layer, "deepseek-v2-lite") == 19
    assert report.match_ncmoe(base + 26 * per_layer, "deepseek-v2-lite") == 0
    assert report.match_ncmoe(base + 40 * per_layer, "deepseek-v2-lite") == 0
    assert report.match_ncmoe(base, "deepseek-v2-lite") == 27
    # a measured base replaces the table's, and llama_base inverts the match
    assert report.match_ncmoe(3000 + 8 * per_layer, "deepseek-v2-lite", base_mib=3000) == 19
    assert report.llama_base(3000 + 8 * per_layer, 19, "deepseek-v2-lite") == pytest.approx(3000)
    # the Qwen3 match is what it was (bench/results/offload-q30b-residency-0133-logs: 14805 MiB -> 28, 31893 -> 0)
    assert report.match_ncmoe(14805) == 28 and report.match_ncmoe(31893) == 0


@pytest.mark.skipif(not PRESCOPE.exists(), reason="build/bin/prescope not built")
@pytest.mark.parametrize("shape,summary", [
    ("deepseek-v2-lite", "deepseek2 | 27 layers | n_embd 128 | heads 4/1 x 80 | experts 64 top-6"),
    ("qwen3-30b-a3b", "qwen3moe | 48 layers | n_embd 128 | heads 4/2 x 32 | experts 128 top-8"),
    ("mixtral-8x7b", "llama | 32 layers | n_embd 128 | heads 4/2 x 32 | experts 8 top-2"),
])
def test_prescope_loads_and_runs_the_tiny_files(tmp_path, shape, summary):
    path = _write(tmp_path, shape)
    info = subprocess.run([str(PRESCOPE), "inspect", str(path)], capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    assert summary in info.stdout + info.stderr
    run = subprocess.run([str(PRESCOPE), "bench", "-m", str(path), "-p", "16", "-n", "4", "-r", "1", "-t", "2",
                          "-o", "json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
