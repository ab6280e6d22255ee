# The quantised test files and llama.cpp's expectations in tests/data/quant/ (README.md there) describe
# themselves: each committed GGUF is the file its JSON names (sha256, size, every tensor's type read back with
# the gguf package), the types follow llama-quantize's shape rule, and the recorded outputs are consistent.
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
QUANT = REPO / "tests/data/quant"
EXPECTATIONS = sorted(QUANT.glob("*.json"))

# Types with 256-value blocks (QK_K): llama-quantize gives a tensor whose rows are not a multiple of 256 the
# fallback type instead (llama-quant.cpp tensor_type_fallback).
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}
# The main type of each preset: what the expert tensors (ffn_*_exps) get when their rows allow it.
MAIN_TYPE = {"Q4_0": "Q4_0", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "IQ4_XS": "IQ4_XS"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_expectations_exist():
    names = {p.stem for p in EXPECTATIONS}
    for model in ["demo", "tiny-qwen3moe", "tiny-qwen2moe", "tiny-mixtral", "tiny-olmoe"]:
        for qtype in MAIN_TYPE:
            assert f"{model}-{qtype.lower()}" in names
    assert sum(load(p)["committed"] for p in EXPECTATIONS) >= 4


@pytest.mark.parametrize("path", EXPECTATIONS, ids=lambda p: p.stem)
def test_committed_file_is_the_recorded_one(path: Path):
    doc = load(path)
    assert sha256(REPO / doc["source"]) == doc["source_sha256"], "the source model changed: rerun the script"
    if not doc["committed"]:
        pytest.skip(f"{doc['file']} is rebuilt by tools/py/make_quant_expectations.py, not committed")
    gguf_path = REPO / doc["file"]
    assert gguf_path.stat().st_size == doc["bytes"]
    assert sha256(gguf_path) == doc["sha256"]
    reader = gguf.GGUFReader(str(gguf_path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types == doc["tensor_types"]
    # Tensor data is what the header says (size checks the reader does not make for us).
    for t in reader.tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        assert t.shape[0] % block == 0, t.name
        assert t.n_bytes == int(np.prod(t.shape)) // block * type_size, t.name


@pytest.mark.parametrize("path", EXPECTATIONS, ids=lambda p: p.stem)
def test_types_follow_the_preset(path: Path):
    doc = load(path)
    assert doc["tensor_type_counts"] == dict(sorted(Counter(doc["tensor_types"].values()).items()))
    main = MAIN_TYPE[doc["type"]]
    experts = {n: t for n, t in doc["tensor_types"].items() if n.endswith(("_exps.weight"))}
    assert experts
    # Quantised types only on 2-D weights; norms and routers stay F32 (llama-quantize never touches them).
    for name, t in doc["tensor_types"].items():
        if name.endswith(("norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
            assert t == "F32", name
    if doc["committed"]:
        reader = gguf.GGUFReader(str(REPO / doc["file"]))
        row = {t.name: int(t.shape[0]) for t in reader.tensors}
        for name, t in doc["tensor_types"].items():
            if row[name] % 256 != 0:
                assert t not in FALLBACK, f"{name}: {t} needs rows of 256, has {row[name]}"
        for name, t in experts.items():
            assert t in (main, FALLBACK.get(main), "Q6_K", "Q8_0"), (name, t)
        assert any(t in (main, FALLBACK.get(main)) for t in experts.values())
    elif path.stem.startswith("demo-"):
        assert main in experts.values()  # the demo's gate/up expert rows (256 wide) hold the preset's main type
    else:
        assert set(experts.values()) <= {main, FALLBACK.get(main), "Q8_0"}  # tiny rows: 32 and 64 wide


@pytest.mark.parametrize("path", EXPECTATIONS, ids=lambda p: p.stem)
def test_recorded_outputs_are_consistent(path: Path):
    doc = load(path)
    assert doc["llama_cpp_commit"]
    assert doc["perplexity"]["ppl"] > 1 and doc["perplexity"]["n_chunks"] >= 10
    for p in doc["prompts"]:
        n = len(p["greedy"])
        assert n == len(p["greedy_top1_margin"]) >= 16
        assert all(m >= 0 for m in p["greedy_top1_margin"])
        assert p["top_logits"] == sorted(p["top_logits"], reverse=True)
        assert p["greedy"][0] == p["top_ids"][0]
        assert p["greedy_top1_margin"][0] == pytest.approx(p["top_logits"][0] - p["top_logits"][1], abs=2e-6)
    logits_file = doc["logits"]["first_logits_file"]
    if logits_file:
        logits = np.fromfile(QUANT / logits_file, dtype="<f4")
        assert list(logits.shape) == doc["logits"]["first_logits_shape"]
        top = doc["prompts"][0]
        assert int(np.argmax(logits)) == top["greedy"][0]
        np.testing.assert_array_equal(logits[top["top_ids"]], np.float32(top["top_logits"]))
