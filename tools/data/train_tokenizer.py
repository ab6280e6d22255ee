# Trains the byte-level BPE tokenizer of the demo/topo models on the corpus train split with HF `tokenizers`,
# using Qwen2's normaliser (NFC) and pre-tokenizer regex, so GGUF metadata can say tokenizer.ggml.pre = "qwen2".
"""Tokenizer training.

Usage: python3 tools/data/train_tokenizer.py [--corpus build-data/corpus] [--out tools/data/tokenizer]

Writes OUT/tokenizer.json and OUT/tokenizer_config.json (HF format). The pipeline mirrors Qwen2's tokenizer.json:
normalizer NFC; pre-tokenizer Split(QWEN2_PATTERN, Isolated) then ByteLevel(add_prefix_space=False, use_regex=False);
BPE model without unk/byte fallback; ByteLevel decoder. Special tokens <|endoftext|>, <|im_start|>, <|im_end|> take
ids 0, 1, 2.
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Qwen2's split pattern, as in Qwen2's tokenizer.json and llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 (llama-vocab.cpp).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")


def build_empty_tokenizer():
    """A Qwen2-style byte-level BPE pipeline with an empty model, ready for training."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def qwen2_byte_level_tail(tokenizer_json):
    """Sets post_processor and decoder to Qwen2's exact ByteLevel settings (add_prefix_space, trim_offsets and
    use_regex all false); the Python constructors do not expose every flag. Neither changes token ids."""
    tj = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    tail = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tj["post_processor"] = dict(tail)
    tj["decoder"] = dict(tail)
    Path(tokenizer_json).write_text(json.dumps(tj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return Tokenizer.from_file(str(tokenizer_json))


def sample_texts(train_jsonl, max_chars):
    """Train-split documents in sha256(id) order until max_chars characters (a deterministic, mixed sample)."""
    docs = []
    with open(train_jsonl, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            docs.append((hashlib.sha256(d["id"].encode()).hexdigest(), d["text"]))
    docs.sort()
    out, n = [], 0
    for _, text in docs:
        if n >= max_chars:
            break
        out.append(text)
        n += len(text)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="build-data/corpus")
    ap.add_argument("--out", default="tools/data/tokenizer")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-chars", type=int, default=40_000_000, help="train-split characters to learn merges from")
    args = ap.parse_args()

    train = Path(args.corpus) / "train.jsonl"
    if not train.exists():
        sys.exit(f"train_tokenizer: {train} not found; run tools/data/build_corpus.py first")
    texts = sample_texts(train, args.max_chars)
    tok = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            sys.exit(f"train_tokenizer: special token {s} got id {tok.token_to_id(s)}, expected {i}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    tok = qwen2_byte_level_tail(out / "tokenizer.json")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    val = [json.loads(line)["text"] for line in open(Path(args.corpus) / "validation.jsonl", encoding="utf-8")]
    n_tok = sum(len(e.ids) for e in tok.encode_batch(val))
    n_chr = sum(len(t) for t in val)
    print(f"vocab {tok.get_vocab_size()}, trained on {sum(len(t) for t in texts) / 1e6:.1f} M chars; validation: "
          f"{n_chr / n_tok:.2f} chars/token ({n_tok} tokens)")


if __name__ == "__main__":
    main()
