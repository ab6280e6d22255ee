# Local check of the shipped demo model: validation perplexity of the Q8_0 GGUF (loaded by transformers' own GGUF
# reader, fp32 on the CPU) next to the unigram baseline, and greedy continuations of held-out test prompts.
"""Evaluate models/demo on the CPU.

Usage: python3 tools/train/eval_demo.py [--gguf models/demo/demo-q8_0.gguf] [--corpus build-data/corpus]
           [--windows 64] [--json docs/data/eval-demo.json]

Needs torch, transformers and accelerate (transformers' GGUF loading requires it). Perplexity protocol: the
validation split tokenised as in training (documents each followed by <|endoftext|>), cut into non-overlapping
windows of --seq + 1 tokens from the start; --windows of them, evenly spaced over the split (all of them, as the
device run's validation in train_models.py scores, when --windows is at least their number: 1308); every position
after the first of a window is scored. The unigram baseline uses add-one smoothed counts of the train split and
scores the same positions.
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "train"))
import moe_model  # noqa: E402


def stream(tok, path, eos_id, max_docs=None):
    """uint16 token stream of a split's .jsonl (each document followed by <|endoftext|>)."""
    docs = [json.loads(line)["text"] for line in open(path, encoding="utf-8")][:max_docs]
    parts = []
    for e in tok.encode_batch(docs):
        parts += [np.asarray(e.ids, np.uint16), np.asarray([eos_id], np.uint16)]
    return np.concatenate(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="models/demo")
    ap.add_argument("--gguf", default=None, help="default: MODEL_DIR/demo-q8_0.gguf")
    ap.add_argument("--corpus", default="build-data/corpus")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--greedy", type=int, default=64, help="tokens generated per held-out prompt")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--max-train-docs", type=int, default=None, help="unigram counts from the first N train docs")
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    mdir = Path(args.model_dir)
    gguf_path = Path(args.gguf) if args.gguf else mdir / "demo-q8_0.gguf"
    for p in (gguf_path, mdir / "config.json", mdir / "tokenizer.json", Path(args.corpus) / "validation.jsonl"):
        if not p.exists():
            sys.exit(f"eval_demo: {p} not found")
    tok = Tokenizer.from_file(str(mdir / "tokenizer.json"))
    eos_id = tok.token_to_id("<|endoftext|>")
    moe_model.register_experts_impl()
    config = Qwen3MoeConfig.from_pretrained(mdir)
    # transformers' GGUF reader does not map expert_feed_forward_length, hence the explicit config
    model = Qwen3MoeForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=str(gguf_path), config=config,
                                                dtype=torch.float32).eval()
    model.set_experts_implementation(moe_model.EXPERTS_IMPL)

    t = time.time()
    train = stream(tok, Path(args.corpus) / "train.jsonl", eos_id, args.max_train_docs)
    counts = np.bincount(train, minlength=tok.get_vocab_size()).astype(np.float64) + 1
    uni_lp = np.log(counts / counts.sum())
    val = stream(tok, Path(args.corpus) / "validation.jsonl", eos_id)
    n_all = (len(val) - 1) // args.seq
    n = min(args.windows, n_all)
    # evenly spaced so that a bounded CPU run samples every source of the split, not only its first documents
    picks = np.unique(np.linspace(0, n_all - 1, n).round().astype(np.int64))
    windows = np.stack([val[i * args.seq:i * args.seq + args.seq + 1] for i in picks]).astype(np.int64)
    n = len(picks)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n, 8):
            w = torch.from_numpy(windows[i:i + 8])
            logits = model(input_ids=w[:, :-1], use_cache=False).logits.float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += w[:, 1:].numel()
    uni = float(-uni_lp[windows[:, 1:]].mean())
    res = {"command": "python3 tools/train/eval_demo.py " + " ".join(sys.argv[1:]),
           "gguf": str(gguf_path), "windows": n, "windows_in_split": n_all, "seq": args.seq, "tokens_scored": count,
           "ppl": math.exp(total / count), "unigram_ppl": math.exp(uni),
           "bits_per_token": total / count / math.log(2), "seconds": round(time.time() - t, 1)}
    print(f"validation ({count} tokens): perplexity {res['ppl']:.2f}, unigram baseline {res['unigram_ppl']:.1f}")

    test = [json.loads(line) for line in open(Path(args.corpus) / "test.jsonl", encoding="utf-8")]
    seen, samples = set(), []
    for d in test:
        if d["source"] in ("debian-handbook", "python3.11-doc", "bible-kjv", "linux-doc") and d["source"] not in seen:
            seen.add(d["source"])
            prompt = tok.encode(d["text"]).ids[:32]
            with torch.no_grad():
                y = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=args.greedy, do_sample=False,
                                   pad_token_id=eos_id)
            samples.append({"doc": d["id"], "prompt": tok.decode(prompt),
                            "continuation": tok.decode(y[0, len(prompt):].tolist())})
            print(f"--- {d['id']}\n{samples[-1]['prompt']}[[{samples[-1]['continuation']}]]")
    res["greedy_samples"] = samples
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
