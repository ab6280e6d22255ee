# Tokenizer metadata for GGUF files: byte-level BPE (tokenizer.json) and SentencePiece (tokenizer.model).
# Writes the same tokenizer.ggml.* keys llama.cpp's converter writes (conversion/base.py, gguf-py/gguf/vocab.py),
# so llama.cpp and our engine read the tokenizer from the GGUF alone. Offline tool; never used at runtime.
"""Reusable tokenizer-to-GGUF helpers.

Entry points:
    add_tokenizer(writer, hf_dir, pre=None, n_vocab=None) -> str
        Detects the tokenizer kind in an HF directory and writes all tokenizer metadata.
    write_vocab_only(hf_dir, out_path, arch="llama", pre=None) -> None
        A GGUF holding only tokenizer metadata (like llama.cpp's models/ggml-vocab-*.gguf).
    detect_bpe_pre(tokenizer_json) -> str | None
        Pre-tokenizer name ("qwen2", "llama-bpe", "deepseek-v3", ...) from the pre_tokenizer of a tokenizer.json.

Token types follow gguf.TokenType: NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4, UNUSED=5, BYTE=6.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

# A Split regex of HF tokenizer.json files and the llama.cpp pre-tokenizer it identifies (llama-vocab.cpp;
# runtime/pre-tokenizer.cpp holds the same regexes, decision 0070).
_PRE_REGEX = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "qwen35",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+": "gpt-4o",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+"
    "[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+": "deepseek-v3",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+": "deepseek-llm",
}

KNOWN_PRE = sorted(set(_PRE_REGEX.values()) | {"olmo", "gpt-2"})
SPECIAL_TOKEN_KINDS = ("bos", "eos", "unk", "pad")


class VocabError(ValueError):
    """A tokenizer directory that cannot be turned into GGUF metadata; the message names the file."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise VocabError(f"{path}: cannot read JSON: {e}") from e


def _split_regexes(pre_tokenizer: dict[str, Any] | None) -> list[str]:
    """All Split-pattern regexes inside a (possibly nested Sequence) HF pre_tokenizer."""
    if not pre_tokenizer:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        out: list[str] = []
        for p in pre_tokenizer.get("pretokenizers", []):
            out += _split_regexes(p)
        return out
    if pre_tokenizer.get("type") == "Split":
        pattern = pre_tokenizer.get("pattern", {})
        if "Regex" in pattern:
            return [pattern["Regex"]]
    return []


def detect_bpe_pre(tokenizer_json: Path) -> str | None:
    """Name of the llama.cpp pre-tokenizer matching tokenizer.json's Split regex, or None if unknown.

    llama.cpp itself identifies pre-tokenizers by hashing the token ids of a probe string
    (convert_hf_to_gguf.py get_vocab_base_pre); we compare the regex text instead, which needs no
    table of hashes and fails loudly (None) for anything we have not checked.
    """
    tok = _read_json(tokenizer_json)
    for rx in _split_regexes(tok.get("pre_tokenizer")):
        if rx in _PRE_REGEX:
            return _PRE_REGEX[rx]
    # ByteLevel with its own (GPT-2) regex: OLMo's GPT-NeoX tokenizer normalises to NFC, GPT-2's does not.
    pre, norm = tok.get("pre_tokenizer") or {}, tok.get("normalizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "olmo" if norm.get("type") == "NFC" else "gpt-2"
    return None


def _bpe_merges(model: dict[str, Any], path: Path) -> list[str]:
    """Merges as "left right" strings; pairs (tokenizers >= 0.20 format) are joined, with spaces inside a
    part encoded as U+0120+... the way gguf-py's SpecialVocab does (chr(ord(' ') + 256))."""
    merges = model.get("merges") or []
    out: list[str] = []
    for m in merges:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in p) for p in m))
        else:
            raise VocabError(f"{path}: unknown merges entry {m!r} (expected 'a b' or ['a', 'b'])")
    if not out:
        raise VocabError(f"{path}: BPE model has no merges")
    return out


def add_bpe_vocab(writer: gguf.GGUFWriter, tokenizer_json: Path, pre: str,
                  n_vocab: int | None = None) -> tuple[list[str], dict[str, int]]:
    """Writes tokenizer.ggml.{model=gpt2, pre, tokens, token_type, merges} from an HF tokenizer.json.

    tokens[i] is the byte-level (GPT-2 byte-to-unicode) string of id i exactly as in tokenizer.json; added
    tokens keep their content; ids missing below n_vocab become "[PAD{i}]" of type UNUSED (as llama.cpp's
    get_vocab_base does). Added tokens are CONTROL when "special", else USER_DEFINED.
    Returns (tokens, added-token content -> id) for the caller's special-token lookup.
    Errors: VocabError naming the file for a non-BPE model, missing merges or ids past n_vocab.
    """
    tok = _read_json(tokenizer_json)
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise VocabError(f"{tokenizer_json}: model.type is {model.get('type')!r}, expected 'BPE'")
    vocab: dict[str, int] = model.get("vocab", {})
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    id_to_tok: dict[int, str] = {i: t for t, i in vocab.items()}
    for content, a in added.items():
        id_to_tok[a["id"]] = content
    max_id = max(id_to_tok) if id_to_tok else -1
    if n_vocab is None:
        n_vocab = max_id + 1
    if max_id >= n_vocab:
        raise VocabError(f"{tokenizer_json}: token id {max_id} is past the model's vocab_size {n_vocab}")

    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        t = id_to_tok.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif t in added and added[t]["id"] == i:
            tokens.append(t)
            types.append(gguf.TokenType.CONTROL if added[t].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(t)
            types.append(gguf.TokenType.NORMAL)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_bpe_merges(model, tokenizer_json))
    return tokens, {c: a["id"] for c, a in added.items()}


def add_spm_vocab(writer: gguf.GGUFWriter, tokenizer_model: Path,
                  n_vocab: int | None = None,
                  added_tokens: dict[int, tuple[str, bool]] | None = None) -> tuple[list[str], dict[str, int]]:
    """Writes tokenizer.ggml.{model=llama, pre=default, tokens, scores, token_type} from a SentencePiece model.

    Token types: UNKNOWN for <unk>, CONTROL for control pieces, UNUSED, BYTE for <0xNN> byte-fallback pieces,
    NORMAL otherwise (llama.cpp _create_vocab_sentencepiece). added_tokens maps id -> (content, special) from
    tokenizer_config.json's added_tokens_decoder; they get score -1000 and type CONTROL/USER_DEFINED.
    Ids beyond the SentencePiece model up to n_vocab are "[PAD{i}]" UNUSED with score -1000.
    Returns (tokens, piece -> id) for special-token lookup.
    """
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    if not sp.Load(str(tokenizer_model)):
        raise VocabError(f"{tokenizer_model}: not a SentencePiece model")
    sp_size = sp.GetPieceSize()
    if n_vocab is None:
        n_vocab = sp_size
    if sp_size > n_vocab:
        raise VocabError(f"{tokenizer_model}: {sp_size} pieces but the model's vocab_size is {n_vocab}")

    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i >= sp_size:
            tokens.append(f"[PAD{i}]")
            scores.append(-1000.0)
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        if sp.IsUnknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.IsControl(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.IsUnused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.IsByte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    for i, (content, special) in (added_tokens or {}).items():
        if i >= n_vocab:
            raise VocabError(f"{tokenizer_model}: added token {content!r} id {i} is past vocab_size {n_vocab}")
        tokens[i] = content
        scores[i] = -1000.0
        types[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    return tokens, {t: i for i, t in enumerate(tokens)}


def _token_content(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _chat_template(hf_dir: Path, tok_config: dict[str, Any]) -> str | None:
    """chat_template from tokenizer_config.json, else chat_template.jinja, else chat_template.json."""
    tmpl = tok_config.get("chat_template")
    if isinstance(tmpl, str):
        return tmpl
    if isinstance(tmpl, list):  # named templates: keep the default one, as a single string
        for t in tmpl:
            if t.get("name") == "default":
                return t["template"]
    if (hf_dir / "chat_template.jinja").is_file():
        return (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (hf_dir / "chat_template.json").is_file():
        t = _read_json(hf_dir / "chat_template.json").get("chat_template")
        if isinstance(t, str):
            return t
    return None


def add_special_tokens(writer: gguf.GGUFWriter, hf_dir: Path, token_ids: dict[str, int], n_vocab: int,
                       default_add_bos: bool, fallback_ids: dict[str, int] | None = None) -> dict[str, int]:
    """Writes tokenizer.ggml.{bos,eos,unk,pad}_token_id, add_bos_token, add_eos_token and chat_template.

    Ids come first from tokenizer_config.json's "<kind>_token" contents looked up in token_ids, then from
    config.json's "<kind>_token_id" (the order gguf-py's SpecialVocab uses), then from fallback_ids (for
    SentencePiece: the model's own bos/eos/unk/pad ids). add_bos_token / add_eos_token are
    always written (tokenizer_config.json's value, else default_add_bos / False) so that readers never have to
    guess a per-tokenizer default. Returns the ids written.
    """
    tok_config = _read_json(hf_dir / "tokenizer_config.json") if (hf_dir / "tokenizer_config.json").is_file() else {}
    config = _read_json(hf_dir / "config.json") if (hf_dir / "config.json").is_file() else {}
    ids: dict[str, int] = {}
    for kind in SPECIAL_TOKEN_KINDS:
        content = _token_content(tok_config.get(f"{kind}_token"))
        tid = token_ids.get(content) if content is not None else None
        if tid is None and isinstance(config.get(f"{kind}_token_id"), int):
            tid = config[f"{kind}_token_id"]
        if tid is None:
            tid = (fallback_ids or {}).get(kind)
        if tid is None:
            continue
        if not 0 <= tid < n_vocab:
            raise VocabError(f"{hf_dir}: {kind} token id {tid} is outside the vocabulary (size {n_vocab})")
        ids[kind] = tid
        getattr(writer, f"add_{kind}_token_id")(tid)
    add_bos = tok_config.get("add_bos_token")
    add_eos = tok_config.get("add_eos_token")
    writer.add_add_bos_token(add_bos if isinstance(add_bos, bool) else default_add_bos)
    writer.add_add_eos_token(add_eos if isinstance(add_eos, bool) else False)
    if (tmpl := _chat_template(hf_dir, tok_config)) is not None:
        writer.add_chat_template(tmpl)
    return ids


def _spm_added_tokens(hf_dir: Path, spm: Path) -> tuple[dict[int, tuple[str, bool]], dict[str, int]]:
    """(id -> (content, special) from tokenizer_config.json's added_tokens_decoder, the SentencePiece model's
    own bos/eos/unk/pad ids). Entries that are just the model's pieces (<unk>, <s>, </s>) are skipped so they
    keep their SentencePiece types and scores."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    if not sp.Load(str(spm)):
        raise VocabError(f"{spm}: not a SentencePiece model")
    own = {k: i for k, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()),
                             ("pad", sp.pad_id())) if i >= 0}
    path = hf_dir / "tokenizer_config.json"
    added: dict[int, tuple[str, bool]] = {}
    if path.is_file():
        for k, v in _read_json(path).get("added_tokens_decoder", {}).items():
            i = int(k)
            if i < sp.GetPieceSize() and sp.IdToPiece(i) == v["content"]:
                continue
            added[i] = (v["content"], bool(v.get("special")))
    return added, own


def add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, pre: str | None = None,
                  n_vocab: int | None = None) -> str:
    """Writes all tokenizer metadata for an HF model directory; returns "llama" (SentencePiece) or "gpt2".

    tokenizer.model present -> SentencePiece (as llama.cpp prefers it for llama-family models); otherwise
    tokenizer.json with a BPE model -> gpt2 with pre-tokenizer `pre`, or the one detected from its regex.
    Errors: VocabError naming the file when there is no tokenizer, or the pre-tokenizer is unknown and not given.
    """
    hf_dir = Path(hf_dir)
    spm = hf_dir / "tokenizer.model"
    tj = hf_dir / "tokenizer.json"
    if spm.is_file():
        added, own_ids = _spm_added_tokens(hf_dir, spm)
        tokens, ids = add_spm_vocab(writer, spm, n_vocab, added)
        add_special_tokens(writer, hf_dir, ids, len(tokens), default_add_bos=True, fallback_ids=own_ids)
        return "llama"
    if tj.is_file():
        if pre is None:
            pre = detect_bpe_pre(tj)
            if pre is None:
                raise VocabError(f"{tj}: pre-tokenizer is not one we know ({', '.join(KNOWN_PRE)}); pass --pre")
        tokens, added = add_bpe_vocab(writer, tj, pre, n_vocab)
        add_special_tokens(writer, hf_dir, added, len(tokens), default_add_bos=False)
        return "gpt2"
    raise VocabError(f"{hf_dir}: no tokenizer.model or tokenizer.json")


def write_vocab_only(hf_dir: Path, out_path: Path, arch: str = "llama", pre: str | None = None) -> None:
    """Writes a GGUF with general.* and tokenizer metadata only (no tensors), for tokenizer tests.

    llama.cpp loads such files with vocab_only (llama-tokenize does), like its models/ggml-vocab-*.gguf.
    """
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(Path(hf_dir).name)
    add_tokenizer(writer, Path(hf_dir), pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
