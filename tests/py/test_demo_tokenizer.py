"""The engine's tokenizer (prescope tokenize, from the demo GGUF's metadata) is token-exact against HF tokenizers
(models/demo/tokenizer.json) on the whole held-out test split of the corpus (tests/data/demo/test-split.jsonl.zst,
the file tools/data/build_corpus.py writes, checked against the sha256 in docs/data/corpus.json)."""
from __future__ import annotations

import hashlib
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
def test_whole_test_split(tmp_path: Path) -> None:
    raw = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO((ROOT / "tests/data/demo/test-split.jsonl.zst").read_bytes())).read()
    manifest = json.loads((ROOT / "docs/data/corpus.json").read_text())
    assert hashlib.sha256(raw).hexdigest() == manifest["splits"]["test"]["sha256"]
    split = tmp_path / "test.jsonl"
    split.write_bytes(raw)
    assert check(split) > 700_000
