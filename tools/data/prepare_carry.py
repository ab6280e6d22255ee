# Prepares the git-ignored .carry/ folder that travels to the device for scripts/device/train_models.sh: the corpus
# splits (xz), the real prompts as trace candidates, and a checksummed manifest; optionally the wheels in .whl/.
"""Build .carry/ (and .whl/) for the device run.

Usage: python3 tools/data/prepare_carry.py [--corpus build-data/corpus] [--wheels]

.carry/corpus/{train,validation,test}.jsonl.xz   the splits written by tools/data/build_corpus.py
.carry/trace_prompts.jsonl.xz                    {"name","source","text"} per real prompt, each source in sha256(name)
                                                 order: sharegpt (first user turns), mt-bench and vicuna-bench (turns
                                                 joined by a blank line), gsm8k and humaneval (prompt + Mixtral's answer)
.carry/manifest.json                             sha256 and size of each file; the device job checks them
"""
import argparse
import hashlib
import json
import lzma
import subprocess
import sys
from pathlib import Path

from build_corpus import sha256_file  # same folder: run as python3 tools/data/prepare_carry.py

WHEELS = ["gguf==0.19.0", "zstandard==0.25.0"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
CARRY_LIMIT_BYTES = 40 << 20


def load_prompts(pdir):
    """Real prompts from ../shared/realdata/prompts as [{"name", "source", "text"}], each source hash-ordered."""
    out = []

    def add(source, name, text):
        if text and text.strip():
            out.append({"name": name, "source": source, "text": text})

    for conv in json.loads((pdir / "sharegpt_first_turn_2978.json").read_text(encoding="utf-8")):
        turns = [t["value"] for t in conv["conversations"] if t.get("from") == "human"]
        if turns:
            add("sharegpt", f"sharegpt/{conv['id']}", turns[0])
    for fname, source in (("mt_bench_question.jsonl", "mt-bench"), ("vicuna_bench_question.jsonl", "vicuna-bench")):
        for line in (pdir / fname).read_text(encoding="utf-8").splitlines():
            q = json.loads(line)
            add(source, f"{source}/{q['question_id']}", "\n\n".join(q["turns"]))
    for fname, source in (("gsm8k_test_1319_mixtral8x7b_greedy_outputs.jsonl", "gsm8k"),
                          ("humaneval_164_mixtral8x7b_greedy_outputs.jsonl", "humaneval")):
        for line in (pdir / fname).read_text(encoding="utf-8").splitlines():
            q = json.loads(line)
            add(source, f"{source}/{q['task_id'].split('/')[-1].replace('gsm8k_', '')}", q["prompt"] + q["generated"])
    out.sort(key=lambda p: (p["source"], hashlib.sha256(p["name"].encode()).hexdigest()))
    return out


def write_xz(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as f:
        for line in lines:
            f.write(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="build-data/corpus")
    ap.add_argument("--realdata", default=None, help="../shared/realdata (default: next to the repo)")
    ap.add_argument("--carry", default=None, help="output folder (default REPO/.carry)")
    ap.add_argument("--wheels", action="store_true", help="also pip-download the wheels the device lacks into .whl/")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[2]
    carry = Path(args.carry) if args.carry else repo / ".carry"
    realdata = Path(args.realdata) if args.realdata else repo.parent / "shared" / "realdata"
    corpus = Path(args.corpus)

    files = {}
    for split in ("train", "validation", "test"):
        src = corpus / f"{split}.jsonl"
        if not src.exists():
            sys.exit(f"prepare_carry: {src} not found; run tools/data/build_corpus.py first")
        dst = carry / "corpus" / f"{split}.jsonl.xz"
        with open(src, encoding="utf-8") as f:
            write_xz(dst, f)
        files[f"corpus/{split}.jsonl.xz"] = dst
    prompts = load_prompts(realdata / "prompts")
    write_xz(carry / "trace_prompts.jsonl.xz", (json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    files["trace_prompts.jsonl.xz"] = carry / "trace_prompts.jsonl.xz"
    manifest = {"created_by": "python3 tools/data/prepare_carry.py",
                "corpus_jsonl_sha256": {s: sha256_file(corpus / f"{s}.jsonl") for s in ("train", "validation", "test")},
                "files": {k: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for k, p in files.items()},
                "prompts_per_source": {s: sum(1 for p in prompts if p["source"] == s)
                                       for s in sorted({p["source"] for p in prompts})}}
    (carry / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(v["bytes"] for v in manifest["files"].values())
    print(f".carry: {total / 2**20:.1f} MiB in {len(files)} files; prompts {manifest['prompts_per_source']}")
    if total > CARRY_LIMIT_BYTES:
        sys.exit(f"prepare_carry: {total / 2**20:.1f} MiB is over the {CARRY_LIMIT_BYTES >> 20} MiB planned")

    if args.wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "-d", str(repo / ".whl")]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd + WHEELS, check=True)


if __name__ == "__main__":
    main()
