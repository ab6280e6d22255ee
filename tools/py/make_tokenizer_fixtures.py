# Makes the tokenizer and chat-template test fixtures in tests/data/tokenizers/ (docs/tokenizer.md): small
# tokenizers trained on real text, written as vocab-only GGUF files, with the reference libraries' token ids.
# Offline tool: python3 tools/py/make_tokenizer_fixtures.py [--corpus DIR] [--out DIR]
"""Tokenizer fixtures for tests/unit/test-tokenizer*.cpp.

Trains three tokenizers on the realdata corpus and writes, for each, `<name>.gguf` (vocab only, through
tools/py/gguf_vocab.py) and `<name>.json` with test strings and the reference outputs:

  qwen2-bpe   HF tokenizers byte-level BPE with Qwen2's tokenizer.json layout: NFC normaliser, Split on the
              Qwen2 regex (isolated), ByteLevel without regex; special tokens <|endoftext|>, <|im_start|>,
              <|im_end|>, user-defined <tool_call>, </tool_call>.  GGUF pre "qwen2".
  llama-bpe   the same with Llama 3's regex (\\p{N}{1,3}), no normaliser, ignore_merges, and a
              TemplateProcessing post-processor adding <|begin_of_text|>.  GGUF pre "llama-bpe".
              Both also learn from a few synthetic lines (ENGINE_PROBES) whose characters regex engines
              classify differently, so that a pre-tokenizer mismatch shows in the ids.
  llama-spm   sentencepiece BPE as Llama/Mistral's tokenizer.model (byte_fallback, split_digits, identity
              normalisation, no extra-whitespace removal, dummy prefix).  GGUF model "llama".

Each case holds `text`, `ids` (add_special=False, parse_special=True), `ids_special` (add_special=True; only
when it differs), `ids_raw` (parse_special=False; only when it differs) and `decoded` (the reference decode
of `ids`). References: HF `tokenizers` encode/decode (special tokens parsed unless `encode_special_tokens`);
for sentencepiece, special-token texts are split out leftmost-longest first (as HF's added tokens and
llama.cpp's tokenizer_st_partition do) and each text run is encoded by `SentencePieceProcessor.encode`;
`decoded` is `SentencePieceProcessor.decode` for runs without special tokens, else the text itself (our
decode inverts encode; sentencepiece has no notion of specials inside text).

Chat templates: `chat/*.jinja` (real model templates, provenance in chat/README.md) go into small GGUF files;
`chat_templates.json` holds each conversation rendered by transformers' render_jinja_template (the HF
apply_chat_template renderer), with the leading BOS text removed (PreScope adds BOS as a token).

Malformed tokenizer GGUFs for the error tests go to bad/.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import unicodedata
from pathlib import Path

import gguf
import sentencepiece as spm
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_vocab  # noqa: E402  (tools/py/gguf_vocab.py, shared with the model converters)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = Path("/work/shared/realdata/text/olmoe-routing-text")

# HF tokenizer.json Split regexes (Qwen2 and Llama 3; llama.cpp llama-vocab.cpp quotes them as "original").
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")

# Byte-level strings (Ġ = space) added to llama-bpe's vocabulary without merges, for ignore_merges.
UNMERGEABLE_WORDS = ["ĠQZXJ", "QZXJ", "ĠÃ©tÃ©"]  # " QZXJ", "QZXJ", " été"
# Training lines (BPE only) with code points whose regex class differs between PCRE2 10.42 (Unicode 14,
# U+180E in \s) and Oniguruma (Unicode 16): learned merges make a wrong pre-token split visible in the ids.
ENGINE_PROBES = ["a\U000105c0b", "\u4e2d\U00031350\u6587", "x\u180e\u180ey", "k\U00011f04\U00011f05m",
                 "q\U0002ebf0r", "a\u1c89b"]
BPE_VOCAB = 4096
SPM_VOCAB = 4000
SEED = 20260


# ---- corpus and test strings --------------------------------------------------------------------------

def read_corpus(corpus: Path) -> dict[str, str]:
    files = sorted(corpus.glob("*.txt"))
    if not files:
        raise SystemExit(f"{corpus}: no .txt files")
    return {f.stem: f.read_text(encoding="utf-8") for f in files}


def hand_written() -> list[str]:
    """Strings chosen for the tokenizer's edge cases: whitespace, digits, scripts, emoji, accents, code."""
    s = [
        "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", " \n \n ", "\t\t\n\t",
        "Hello world", "Hello, World!", "hello   world", "   leading", "trailing   ", "  both  ", "a\tb\tc",
        "line1\nline2\n\nline4", "tab\t\tdouble", "mixed \t \n \t spaces", "x" + " " * 100 + "y", " " * 37,
        "\n" * 20, "a\n\n\n\n\nb", "  \n\n  \n", "\t" * 9 + "indented",
        # contractions, case-insensitive group, long s that folds to s
        "I'm", "don't", "they'll", "we've", "you'd", "it's", "IT'S", "DON'T", "They'RE", "'s", "x'S", "it'ſ",
        "I'm sure you'll see they've done it", "rock'n'roll", "O'Neil's", "‘curly’ quotes", "'''triple'''",
        # digits
        "0", "7", "42", "1234567890", "12345678901234567890123", "3.14159265358979", "1,000,000", "0000",
        "a1b2c3", "v2.0.1-rc3", "2024-01-15T12:34:56Z", "١٢٣٤٥", "Ⅻ and ⅷ", "²³¹ x₂", "१२३", "1st 2nd 3rd 4th",
        "+1 (555) 123-4567", "0x1F 0b1010 1e-9", "99999999999999999999999999999999",
        # scripts
        "你好，世界", "日本語のテキストです。", "한국어 텍스트", "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم",
        "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Tiếng Việt có dấu", "ქართული ენა", "Հայերեն",
        "Hello мир 世界 مرحبا 🌍", "中文English混合text", "カタカナとひらがな", "𠀀𠀁 extension B", "ᚠᚢᚦ runes",
        # emoji
        "👍", "😀😃😄😁", "👨‍👩‍👧‍👦 family", "👋🏽 wave", "🇩🇪🇫🇷🇯🇵", "❤️ heart", "🏳️‍🌈", "a😀b", "emoji at end 🎉",
        "1️⃣ keycap", "🫠 newer emoji",
        # accents: composed, decomposed (NFD), compatibility characters
        "café naïve résumé", unicodedata.normalize("NFD", "café naïve résumé"), "Ångström", "Å (angstrom sign)",
        unicodedata.normalize("NFD", "Tiếng Việt"), unicodedata.normalize("NFD", "한국어"), "q\u0303 x\u0301",
        "e\u0301\u0302 stacked", "ﬁ ligature ﬀ", "Ⓐ circled", "ｆｕｌｌｗｉｄｔｈ", "\u00e9\u0301", "ñ vs n\u0303",
        unicodedata.normalize("NFD", "Müller Straße Ærø"), "Ω Ohm vs Ω omega", "\u0344 combining",
        # unusual whitespace and controls
        "a\u00a0b", "a\u3000b", "a\u2028b", "a\u0085b", "a\u200bb", "\ufeffBOM", "a\u200db", "x\u000by\u000cz",
        # U+180E is \s for PCRE2 10.42 but not for Oniguruma; letters and digits of Unicode 15-16 scripts
        "a\u180eb", "\u180e\u180e x", "\U000105c0\U000105c1 todhri", "x\U00010d40\U00010d41\U00010d42\U00010d43y",
        "\U00031350\U00031351 ext-H", "a\U0002ebf0b", "\U00011f04\U00011f05 kawi", "\U0001e5d0\U0001e5f1\U0001e5f2",
        *ENGINE_PROBES, *(" ".join(ENGINE_PROBES[i:i + 2]) for i in range(len(ENGINE_PROBES) - 1)),
        "nul\u0000byte", "\u0001\u0002\u007f", "a\u2003b\u2009c", "\u1680ogham", "a\ufffdb", "\ufffd",
        # punctuation and symbols
        "!!!???", "...", "—", "«guillemets»", "¿Qué?", "∑∫√∞", "$€£¥₿", "@#%^&*()", "<>[]{}", "~`|\\",
        "email@example.com", "https://example.com/path?q=1&r=2#frag", "C:\\Users\\me\\file.txt", "▁ lower block",
        "pneumonoultramicroscopicsilicovolcanoconiosis", "a" * 40, "ab" * 30, "-" * 50, "=" * 17 + "\n",
        # code
        "def f(x):\n    return x ** 2\n", "int main(void) {\n\treturn 0;\n}\n", '{"key": [1, 2.5, "v"], "n": null}',
        "<div class=\"a\">text</div>", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "x=>x*2 && y||z",
        "    if x:\n        pass\n    else:\n        raise ValueError('bad')\n", "SELECT * FROM t WHERE id = 42;",
        "#include <stdio.h>\n", "// comment\n/* block */", "$ ls -la | grep foo > out.txt 2>&1",
        "fn main() { println!(\"{}\", 1); }", "λx.x", "a_b_c = __init__", "camelCaseIdentifier", "snake_case_id",
    ]
    # runs of spaces, tabs and newlines between words
    s += ["a" + " " * n + "b" for n in range(1, 17)]
    s += ["a" + "\t" * n + "b" for n in (1, 2, 3, 5)]
    s += ["a" + "\n" * n + "b" for n in (1, 2, 3, 4, 7)]
    s += ["word" + " \n" * n for n in (1, 3)]
    # digit runs of every length up to 25
    s += ["".join(str((i * 7 + k) % 10) for k in range(n)) for i, n in enumerate(range(1, 26))]
    return s


def special_strings(specials: list[str]) -> list[str]:
    """Special tokens inside text, at edges, doubled, partial and nested in other characters."""
    a, b = specials[0], specials[1 % len(specials)]
    c = specials[-1]
    return [
        a, f"{a}hello{b}", f"a {b} b", f"{b}{b}", f"{a}\n{c}", a[:-1], f"<{a}>", f"x{a[:3]}{a}y", f"  {c}  ",
        f"{a}{b}{c}", f"text{c}", f"{c}text", f"{a} leading space", f"trailing space {b}", f"{a}日本{b}",
        f"{b}\n\n{b}", f"{a.lower()} is not special", f"{a}{a[:-1]}",
    ]


def corpus_samples(corpus: dict[str, str], rng: random.Random, per_file: int) -> list[str]:
    """Random windows of the corpus (20..400 characters) and lines that contain CJK characters."""
    out = []
    for name in sorted(corpus):
        text = corpus[name]
        for _ in range(per_file):
            n = rng.randint(20, 400)
            i = rng.randrange(0, max(1, len(text) - n))
            out.append(text[i:i + n])
    cjk = [ln for t in corpus.values() for ln in t.splitlines() if re.search(r"[\u3040-\u9fff\uac00-\ud7af]", ln)]
    out += [ln[:300] for ln in rng.sample(cjk, min(15, len(cjk)))]
    return out


# ---- training -----------------------------------------------------------------------------------------

def train_bpe(docs: list[str], regex: str, nfc: bool, specials: list[str], user_defined: list[str],
              ignore_merges: bool, bos: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    if user_defined:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    if ignore_merges:  # Llama 3's tokenizer.json sets model.ignore_merges; the trainer cannot
        j = json.loads(tok.to_str())
        j["model"]["ignore_merges"] = True
        # Words in the vocabulary that no merge sequence reaches (as in Llama 3's tiktoken-made vocab):
        # only a whole-word lookup finds them.
        next_id = 1 + max(max(j["model"]["vocab"].values()), *(a["id"] for a in j["added_tokens"]))
        for k, word in enumerate(UNMERGEABLE_WORDS):
            assert word not in j["model"]["vocab"], word
            j["model"]["vocab"][word] = next_id + k
        tok = Tokenizer.from_str(json.dumps(j))
    return tok


def train_spm(lines: list[str], model_path: Path) -> spm.SentencePieceProcessor:
    spm.set_random_generator_seed(SEED)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(model_path.with_suffix("")), model_type="bpe",
        vocab_size=SPM_VOCAB, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, max_sentence_length=1 << 16,
        num_threads=2, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(model_path))


# ---- reference outputs --------------------------------------------------------------------------------

def hf_cases(tok: Tokenizer, texts: list[str]) -> list[dict]:
    cases = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        case = {"text": text, "ids": ids}
        with_special = tok.encode(text, add_special_tokens=True).ids
        if with_special != ids:
            case["ids_special"] = with_special
        tok.encode_special_tokens = True
        raw = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        if raw != ids:
            case["ids_raw"] = raw
        case["decoded"] = tok.decode(ids, skip_special_tokens=False)
        cases.append(case)
    return cases


def spm_cases(sp: spm.SentencePieceProcessor, texts: list[str]) -> list[dict]:
    specials = sorted((sp.id_to_piece(i) for i in range(sp.get_piece_size())
                       if sp.is_control(i) or sp.is_unknown(i)), key=len, reverse=True)
    split = re.compile("|".join(re.escape(s) for s in specials))  # longest alternative first at each position

    def encode(text: str) -> list[int]:
        out, pos = [], 0
        for m in split.finditer(text):
            if m.start() > pos:
                out += sp.encode(text[pos:m.start()])
            out.append(sp.piece_to_id(m.group()))
            pos = m.end()
        if pos < len(text):
            out += sp.encode(text[pos:])
        return out

    cases = []
    for text in texts:
        ids = encode(text)
        case = {"text": text, "ids": ids, "ids_special": [sp.bos_id()] + ids}
        raw = sp.encode(text)
        if raw != ids:
            case["ids_raw"] = raw
        case["decoded"] = sp.decode(ids) if not split.search(text) else text
        cases.append(case)
    return cases


def write_cases(path: Path, gguf_name: str, reference: str, cases: list[dict]) -> None:
    doc = {"gguf": gguf_name, "reference": reference, "cases": cases}
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{path}: {len(cases)} cases")


# ---- chat templates -----------------------------------------------------------------------------------

# (gguf name, template file or None, architecture, tokenizer model, tokens, bos id, eos id)
CHAT_MODELS = [
    ("chat-qwen3", "qwen3.jinja", "qwen3moe", "gpt2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, 2),
    ("chat-qwen2.5", "qwen2.5.jinja", "qwen2moe", "gpt2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, 2),
    ("chat-qwen2", "qwen2.jinja", "qwen2moe", "gpt2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, 2),
    ("chat-chatml", "chatml.jinja", "qwen3moe", "gpt2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, 2),
    ("chat-mistral-v0", "mistral-v0.jinja", "llama", "llama", ["<unk>", "<s>", "</s>"], 1, 2),
    ("chat-mistral-v1", "mistral-v1.jinja", "llama", "llama", ["<unk>", "<s>", "</s>"], 1, 2),
    # no tokenizer.chat_template: chosen by architecture / tokenizer model (expected as chatml / mistral-v1)
    ("chat-none-qwen3moe", None, "qwen3moe", "gpt2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, 2),
    ("chat-none-mixtral", None, "llama", "llama", ["<unk>", "<s>", "</s>"], 1, 2),
]
# Fallback templates the C++ code uses when the GGUF has none (decision 0022).
CHAT_FALLBACK = {"chat-none-qwen3moe": "chatml.jinja", "chat-none-mixtral": "mistral-v1.jinja"}
# GGUFs whose template PreScope must refuse with a clear error.
CHAT_BAD = [
    ("chat-bad-unknown", "{% for m in messages %}{{ m['content'] }}{% endfor %}", "qwen3moe", "gpt2",
     ["<|endoftext|>"], None, 0),
    ("chat-bad-none-olmoe", None, "olmoe", "gpt2", ["<|endoftext|>"], None, 0),
    ("chat-bad-none-qwen-no-im", None, "qwen3moe", "gpt2", ["<|endoftext|>"], None, 0),
]

CONVERSATIONS = [
    [("user", "Hello!")],
    [("system", "You are terse."), ("user", "What is 2+2?")],
    [("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a joke.")],
    [("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2"), ("assistant", "A2")],
    [("user", "  spaces around  ")],
    [("user", "Solve it"), ("assistant", "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4."), ("user", "Thanks")],
    [("user", "Q"), ("assistant", "<think>\nr\n</think>\n\nfinal")],
    [("user", "Where?"), ("assistant", "Answer</think>\n\nreal answer")],
    [("user", "a"), ("user", "b")],
    [("system", "s1"), ("user", "u"), ("system", "s2")],
    [("user", "日本語 😀 café\n\ttab"), ("assistant", " padded reply "), ("user", "<tool_response>x</tool_response>")],
    [("assistant", "first")],
    [("user", "line1\nline2"), ("assistant", "ok"), ("user", "more\n")],
]


def render_chat(template: str, messages: list[tuple[str, str]], gen: bool, bos: str, eos: str) -> str | None:
    """transformers' own chat-template renderer; None when the template raises (e.g. roles must alternate)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    conv = [{"role": r, "content": c} for r, c in messages]
    try:
        rendered, _ = render_jinja_template(conversations=[conv], chat_template=template,
                                            add_generation_prompt=gen, bos_token=bos, eos_token=eos)
    except Exception:  # noqa: BLE001  (jinja2 TemplateError from raise_exception or undefined access)
        return None
    text = rendered[0]
    return text[len(bos):] if bos and text.startswith(bos) else text


def write_chat_gguf(path: Path, arch: str, model: str, tokens: list[str], bos: int | None, eos: int,
                    template: str | None) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    if bos is not None:
        w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def make_chat_fixtures(out: Path) -> None:
    chat_dir = out / "chat"
    cases = []
    for name, tfile, arch, model, tokens, bos, eos in CHAT_MODELS:
        template = (chat_dir / tfile).read_text(encoding="utf-8") if tfile else None
        write_chat_gguf(out / f"{name}.gguf", arch, model, tokens, bos, eos, template)
        ref = template if template is not None else (chat_dir / CHAT_FALLBACK[name]).read_text(encoding="utf-8")
        bos_text = tokens[bos] if bos is not None else ""
        for conv in CONVERSATIONS:
            for gen in (True, False):
                expected = render_chat(ref, conv, gen, bos_text, tokens[eos])
                cases.append({"gguf": f"{name}.gguf", "messages": [list(m) for m in conv],
                              "add_generation_prompt": gen, "expected": expected})
    for name, template, arch, model, tokens, bos, eos in CHAT_BAD:
        write_chat_gguf(out / f"{name}.gguf", arch, model, tokens, bos, eos, template)
        cases.append({"gguf": f"{name}.gguf", "messages": [["user", "Hello!"]], "add_generation_prompt": True,
                      "expected": None})
    path = out / "chat_templates.json"
    path.write_text(json.dumps({"renderer": "transformers.utils.chat_template_utils.render_jinja_template",
                                "cases": cases}, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{path}: {len(cases)} cases")


# ---- malformed tokenizer metadata ---------------------------------------------------------------------

def byte_level_alphabet() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def make_bad_fixtures(out: Path) -> None:
    """One GGUF per kind of bad tokenizer metadata; the test checks the error names file and key."""
    bad = out / "bad"
    bad.mkdir(exist_ok=True)
    alphabet = byte_level_alphabet()
    gpt2_tokens = alphabet + ["ĠĠ", "<|endoftext|>"]

    def write(name: str, fill) -> None:
        w = gguf.GGUFWriter(str(bad / f"{name}.gguf"), "qwen3moe")
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()

    def gpt2(w, tokens=gpt2_tokens, merges=("Ġ Ġ",), pre="qwen2"):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(list(tokens))
        w.add_token_merges(list(merges))

    def llama(w, n_scores=3, n_types=3):
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"])
        w.add_token_scores([0.0] * n_scores)
        w.add_token_types([2, 3, 3, 1][:n_types] + [1] * max(0, n_types - 4))

    write("model-unknown", lambda w: (w.add_tokenizer_model("wordpiece"), w.add_token_list(["a"])))
    write("model-missing", lambda w: w.add_token_list(["a"]))
    write("pre-unknown", lambda w: gpt2(w, pre="chameleon"))
    write("pre-missing", lambda w: (w.add_tokenizer_model("gpt2"), w.add_token_list(gpt2_tokens),
                                    w.add_token_merges(["Ġ Ġ"])))
    write("tokens-missing", lambda w: (w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2")))
    write("scores-short", lambda w: llama(w, n_scores=2))
    write("types-long", lambda w: llama(w, n_types=4))
    write("merge-unknown-token", lambda w: gpt2(w, merges=("Ġ Ġ", "Ġ zz")))
    write("merge-unknown-result", lambda w: gpt2(w, merges=("Ġ Ġ", "a b")))
    write("merge-malformed", lambda w: gpt2(w, merges=("ĠĠ",)))
    write("byte-missing", lambda w: gpt2(w, tokens=[t for t in gpt2_tokens if t != "a"], merges=()))
    write("bos-out-of-range", lambda w: (gpt2(w), w.add_bos_token_id(9999)))
    write("add-bos-without-bos", lambda w: (gpt2(w), w.add_add_bos_token(True)))
    write("tokens-duplicate", lambda w: gpt2(w, tokens=gpt2_tokens + ["ĠĠ"]))
    write("merges-wrong-type", lambda w: (w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2"),
                                          w.add_token_list(gpt2_tokens), w.add_array("tokenizer.ggml.merges", [1, 2])))
    print(f"{bad}: {len(list(bad.glob('*.gguf')))} malformed GGUFs")


# ---- main ---------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--out", type=Path, default=REPO / "tests/data/tokenizers")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    corpus = read_corpus(args.corpus)
    docs = [d for t in corpus.values() for d in t.split("\n\n") if d.strip()]
    docs += [" ".join([probe] * 3000) for probe in ENGINE_PROBES]
    lines = [ln for t in corpus.values() for ln in t.splitlines() if ln.strip()]
    rng = random.Random(SEED)
    base = hand_written() + corpus_samples(corpus, rng, per_file=20)

    qwen_specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    qwen_user = ["<tool_call>", "</tool_call>"]
    llama3_specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>"]
    bpe_configs = [
        ("qwen2-bpe", "qwen3moe", "qwen2", QWEN2_REGEX, True, qwen_specials, qwen_user, False, None,
         {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False},
         special_strings(qwen_specials) + special_strings(qwen_user)
         + ["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "<tool_call><|im_end|>"]),
        ("llama-bpe", "llama", "llama-bpe", LLAMA3_REGEX, False, llama3_specials, [], True, "<|begin_of_text|>",
         {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True},
         special_strings(llama3_specials) + ["a QZXJ b", "QZXJ", "QZXJQZXJ", "en été", "été"]
         + ["<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"]),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for (name, arch, pre, regex, nfc, specials, user, ignore_merges, bos, config, extra) in bpe_configs:
            tok = train_bpe(docs, regex, nfc, specials, user, ignore_merges, bos)
            hf_dir = Path(tmp) / name
            hf_dir.mkdir()
            tok.save(str(hf_dir / "tokenizer.json"))
            (hf_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
            gguf_vocab.write_vocab_only(hf_dir, out / f"{name}.gguf", arch=arch, pre=pre)
            write_cases(out / f"{name}.json", f"{name}.gguf", f"tokenizers {__import__('tokenizers').__version__}",
                        hf_cases(tok, base + extra))

        hf_dir = Path(tmp) / "llama-spm"
        hf_dir.mkdir()
        sp = train_spm(lines, hf_dir / "tokenizer.model")
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}), encoding="utf-8")
        gguf_vocab.write_vocab_only(hf_dir, out / "llama-spm.gguf", arch="llama")
        write_cases(out / "llama-spm.json", "llama-spm.gguf", f"sentencepiece {spm.__version__}",
                    spm_cases(sp, base + special_strings(["<s>", "</s>", "<unk>"])))

    make_chat_fixtures(out)
    make_bad_fixtures(out)


if __name__ == "__main__":
    main()
