# Makes tests/data/quant/blocks.gguf: random blocks of every weight type PreScope supports, each with its
# dequantization by the gguf package (gguf.quants.dequantize), the independent reference of
# tests/unit/test-quant.cpp (decision 0060). Deterministic; tests/py/test_quant_fixtures.py checks the
# committed file against a fresh run.
# Offline tool: python3 tools/py/make_quant_fixtures.py [--out tests/data/quant/blocks.gguf]
"""Random quantized blocks and their gguf-py dequantization.

For each type the tensor `<type>` holds 1024 weights (ne = [1024]) of random bytes in which the scale fields
are set to finite F16 values (uniform magnitudes in [2^-12, 1], either sign, a few subnormal); MXFP4's E8M0
exponents take every value 0..255 across the blocks, the extremes included. `<type>.f32` holds
gguf.quants.dequantize of those bytes as F32.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

N_ELEMENTS = 1024
SEED = 11

# Byte offsets of the F16 scale fields inside each block (ggml-common.h).
F16_FIELDS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
    Q.IQ4_NL: [0],
    Q.IQ4_XS: [0],
    Q.MXFP4: [],
}


def random_blocks(rng: np.random.Generator, qtype: Q) -> np.ndarray:
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = N_ELEMENTS // block_elems
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        mag = np.exp2(rng.uniform(-12.0, 0.0, size=n_blocks))
        mag[rng.random(n_blocks) < 0.1] = 2.0**-20  # F16 subnormal
        val = (mag * rng.choice([-1.0, 1.0], size=n_blocks)).astype(np.float16)
        blocks[:, off:off + 2] = val.view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.MXFP4:
        e = rng.permutation(256)[:n_blocks].astype(np.uint8)
        e[:4] = [0, 1, 2, 255]
        blocks[:, 0] = e
    return blocks.reshape(-1)


def make(out: Path) -> None:
    rng = np.random.default_rng(SEED)
    w = GGUFWriter(str(out), "prescope-quant-fixtures")
    w.add_description("random blocks per weight type with gguf.quants.dequantize (tools/py/make_quant_fixtures.py)")
    for qtype in F16_FIELDS:
        raw = random_blocks(rng, qtype)
        with np.errstate(over="ignore"):  # the largest MXFP4 exponents give inf, in ggml as here
            ref = dequantize(raw, qtype).astype(np.float32).reshape(-1)
        assert ref.size == N_ELEMENTS
        name = qtype.name.lower()
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        w.add_tensor(name + ".f32", ref)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests/data/quant/blocks.gguf")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    make(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
