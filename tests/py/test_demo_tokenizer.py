"""The engine's tokenizer (prescope tokenize, from the demo GGUF's metadata) is token-exact against HF tokenizers
(models/demo/tokenizer.json) on held-out test-split documents: a committed sample of every 5th document, and the
whole test split when the corpus has been built (python3 tools/data/build_corpus.py)."""
from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import zstandard
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
PRESCOPE = Path(os.environ.get("PRESCOPE_BIN", ROOT / "build" / "bin" / "prescope"))
MODEL = ROOT / "models" / "demo" / "demo-q8_0.gguf"


def engine_ids(jsonl: Path) -> list[list[int]]:
    out = subprocess.run([str(PRESCOPE), "tokenize", "-m", str(MODEL), "-f", str(jsonl), "--jsonl"],
                         check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def check(jsonl: Path) -> int:
    hf = Tokenizer.from_file(str(ROOT / "models" / "demo" / "tokenizer.json"))
    docs = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines() if line]
    ours = engine_ids(jsonl)
    assert len(ours) == len(docs)
    for doc, ids in zip(docs, ours):
        assert ids == hf.encode(doc["text"]).ids, doc["id"]
    return sum(len(i) for i in ours)


@pytest.mark.skipif(not PRESCOPE.exists(), reason="build/bin/prescope not built")
def test_committed_sample(tmp_path: Path) -> None:
    raw = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO((ROOT / "tests/data/demo/test-split-sample.jsonl.zst").read_bytes())).read()
    sample = tmp_path / "sample.jsonl"
    sample.write_bytes(raw)
    assert check(sample) > 50_000


@pytest.mark.skipif(not (ROOT / "build-data/corpus/test.jsonl").exists() or not PRESCOPE.exists(),
                    reason="corpus not built here (tools/data/build_corpus.py)")
def test_whole_test_split() -> None:
    assert check(ROOT / "build-data/corpus/test.jsonl") > 700_000
