# tests/data/quant/blocks.gguf (the reference of tests/unit/test-quant.cpp) is what the gguf package's
# dequantization gives for its blocks, and what tools/py/make_quant_fixtures.py writes today.
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests/data/quant/blocks.gguf"
sys.path.insert(0, str(ROOT / "tools" / "py"))
import make_quant_fixtures  # noqa: E402


def test_references_are_gguf_dequantize():
    reader = GGUFReader(str(FIXTURE))
    tensors = {t.name: t for t in reader.tensors}
    quantized = [t for name, t in tensors.items() if not name.endswith(".f32")]
    assert len(quantized) == 13
    for t in quantized:
        ref = np.asarray(tensors[t.name + ".f32"].data, dtype=np.float32).reshape(-1)
        with np.errstate(over="ignore"):
            got = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(-1)
        assert got.tobytes() == ref.tobytes(), t.name


def test_generator_reproduces_the_committed_file(tmp_path):
    out = tmp_path / "blocks.gguf"
    make_quant_fixtures.make(out)
    assert out.read_bytes() == FIXTURE.read_bytes()
