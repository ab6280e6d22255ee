"""GPT-2's byte-level alphabet (bytes_to_unicode in openai/gpt-2 encoder.py, also HF tokenizers' ByteLevel):
the printable character that stands for each byte in byte-level BPE vocabularies."""
from __future__ import annotations


def byte_alphabet() -> list[str]:
    """The 256 stand-in characters, in byte order: printable Latin-1 bytes stand for themselves, the others
    map to U+0100 upwards in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]
