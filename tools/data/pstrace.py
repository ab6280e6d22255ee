# Reader and writer for PreScope routing traces (.pstrace) and their hidden-state sidecars (.hidden.zst),
# exactly as docs/trace-format.md (version 1) specifies. `python3 tools/data/pstrace.py --self-check` round-trips both.
"""PreScope routing traces.

A trace is one zstd frame holding: magic b"PSTRACE1", uint32 LE header length, JSON header, then per token
(sequences in header order) a record of uint32 token id followed, per layer, by top_k uint8 expert ids (router order,
descending gate weight) and top_k uint8 gate weights q (weight = q / gate_weight_scale, scale 255).

The hidden-state sidecar NAME.hidden.zst (for trace NAME.pstrace) is one zstd frame: magic b"PSHIDDN1", uint32 LE
header length, JSON header, then per covered token (in token_ranges order) per layer: float32 LE scale and `dim` int8
values; x = q * scale is the router input of that layer (the post-attention RMSNorm output).
"""
import argparse
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

TRACE_MAGIC = b"PSTRACE1"
HIDDEN_MAGIC = b"PSHIDDN1"
FORMAT_VERSION = 1
GATE_WEIGHT_SCALE = 255
MAX_HEADER_BYTES = 64 << 20
HIDDEN_ENCODING = "int8_absmax"


class TraceFormatError(ValueError):
    """A trace or sidecar file that does not follow docs/trace-format.md; the message names the file."""


def record_dtype(n_layer, top_k):
    """numpy dtype of one token record: token id (uint32 LE) and per layer [ids(top_k), weights(top_k)] uint8."""
    return np.dtype([("token", "<u4"), ("route", "u1", (n_layer, 2, top_k))])


def hidden_dtype(n_layer, dim):
    """numpy dtype of one covered token in a sidecar: per layer a float32 LE scale then `dim` int8 values."""
    return np.dtype([("scale", "<f4"), ("q", "i1", (dim,))]), n_layer


@dataclass
class Trace:
    """A decoded trace. token_ids: uint32 [N]; expert_ids, gate_q: uint8 [N, n_layer, top_k]; header: the JSON."""

    header: dict
    token_ids: np.ndarray
    expert_ids: np.ndarray
    gate_q: np.ndarray

    @property
    def n_layer(self):
        return int(self.header["n_layer"])

    @property
    def n_expert(self):
        return int(self.header["n_expert"])

    @property
    def top_k(self):
        return int(self.header["top_k"])

    @property
    def sequences(self):
        return self.header["sequences"]

    def gate_weights(self):
        """Gate weights as float32 [N, n_layer, top_k] (q / gate_weight_scale)."""
        return self.gate_q.astype(np.float32) / float(self.header["gate_weight_scale"])

    def sequence_bounds(self):
        """[(first_token, end_token)] of each sequence in the flat token axis."""
        out, pos = [], 0
        for s in self.sequences:
            out.append((pos, pos + int(s["n_tokens"])))
            pos += int(s["n_tokens"])
        return out


@dataclass
class HiddenStates:
    """A decoded sidecar. scale: float32 [N, n_layer]; q: int8 [N, n_layer, dim]; header: the JSON."""

    header: dict
    scale: np.ndarray
    q: np.ndarray

    def dequantize(self):
        """Router inputs as float32 [N, n_layer, dim]."""
        return self.q.astype(np.float32) * self.scale[..., None]

    def flat_token_indices(self, trace):
        """Indices into trace's flat token axis of each covered token, in sidecar order (int64 [N])."""
        bounds = trace.sequence_bounds()
        idx = [np.arange(bounds[s][0] + first, bounds[s][0] + first + n) for s, first, n in
               self.header["token_ranges"]]
        return np.concatenate(idx) if idx else np.zeros(0, np.int64)


def _compress(raw, level, threads):
    # One frame with the content size in its header, as the spec asks for one zstd frame.
    return zstandard.ZstdCompressor(level=level, threads=threads, write_content_size=True).compress(raw)


def _decompress_one_frame(path, data):
    d = zstandard.ZstdDecompressor().decompressobj()
    try:
        raw = d.decompress(data)
    except zstandard.ZstdError as e:
        raise TraceFormatError(f"{path}: not a valid zstd frame ({e})") from None
    if not d.eof:
        raise TraceFormatError(f"{path}: zstd frame is truncated")
    if d.unused_data:
        raise TraceFormatError(f"{path}: {len(d.unused_data)} bytes after the zstd frame (expected exactly one frame)")
    return raw


def _split_header(path, raw, magic):
    if len(raw) < len(magic) + 4 or raw[:len(magic)] != magic:
        raise TraceFormatError(f"{path}: bad magic {raw[:len(magic)]!r}, expected {magic!r}")
    (hlen,) = struct.unpack_from("<I", raw, len(magic))
    start = len(magic) + 4
    if hlen > MAX_HEADER_BYTES or start + hlen > len(raw):
        raise TraceFormatError(f"{path}: header length {hlen} exceeds the {len(raw) - start} bytes after it")
    try:
        header = json.loads(raw[start:start + hlen].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceFormatError(f"{path}: header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise TraceFormatError(f"{path}: header is not a JSON object")
    if header.get("format_version") != FORMAT_VERSION:
        raise TraceFormatError(f"{path}: format_version {header.get('format_version')!r}, expected {FORMAT_VERSION}")
    return header, memoryview(raw)[start + hlen:]


def _int_field(path, header, key, lo, hi):
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise TraceFormatError(f"{path}: header field {key}={v!r}, expected an integer in [{lo}, {hi}]")
    return v


def validate_trace_header(path, header):
    """Checks the header fields of docs/trace-format.md; raises TraceFormatError naming the file."""
    for key in ("model", "arch", "sequences", "n_tokens", "created_by"):
        if key not in header:
            raise TraceFormatError(f"{path}: header lacks field {key!r}")
    n_layer = _int_field(path, header, "n_layer", 1, 4096)
    if "first_moe_layer" in header:
        _int_field(path, header, "first_moe_layer", 0, 4095)
    n_expert = _int_field(path, header, "n_expert", 1, 256)
    top_k = _int_field(path, header, "top_k", 1, n_expert)
    if header.get("gate_weight_scale") != GATE_WEIGHT_SCALE:
        raise TraceFormatError(f"{path}: gate_weight_scale {header.get('gate_weight_scale')!r}, "
                               f"expected {GATE_WEIGHT_SCALE}")
    n_tokens = _int_field(path, header, "n_tokens", 0, 1 << 40)
    seqs = header["sequences"]
    if not isinstance(seqs, list):
        raise TraceFormatError(f"{path}: header field sequences is not a list")
    total = 0
    for i, s in enumerate(seqs):
        if not isinstance(s, dict) or not {"name", "source", "n_tokens"} <= set(s):
            raise TraceFormatError(f"{path}: sequences[{i}] lacks name/source/n_tokens")
        n_seq = _int_field(path, s, "n_tokens", 0, 1 << 40)
        if "n_prompt" in s:
            _int_field(path, s, "n_prompt", 0, n_seq)
        total += n_seq
    if total != n_tokens:
        raise TraceFormatError(f"{path}: sequences hold {total} tokens but header n_tokens is {n_tokens}")
    return n_layer, n_expert, top_k, n_tokens


def write_trace(path, *, model, arch, n_expert, sequences, token_ids, expert_ids, gate_weights=None, gate_q=None,
                created_by, first_moe_layer=0, level=19, threads=0):
    """Writes a .pstrace file.

    first_moe_layer: the model layer of trace layer 0 (its leading dense layers); written only when not 0.
    sequences: [{"name", "source", "n_tokens"[, "n_prompt"]}] in body order; token_ids: int [N]; expert_ids: int [N, n_layer, top_k]
    in router order; gate weights either as float [N, n_layer, top_k] (quantised to round(w * 255)) or as gate_q
    uint8. Raises ValueError on inconsistent shapes or ids >= n_expert. Returns the compressed size in bytes.
    """
    expert_ids = np.asarray(expert_ids)
    n, n_layer, top_k = expert_ids.shape
    if gate_q is None:
        w = np.asarray(gate_weights, dtype=np.float64)
        gate_q = np.clip(np.rint(w * GATE_WEIGHT_SCALE), 0, GATE_WEIGHT_SCALE).astype(np.uint8)
    gate_q = np.asarray(gate_q)
    token_ids = np.asarray(token_ids)
    if gate_q.shape != expert_ids.shape or token_ids.shape != (n,):
        raise ValueError(f"write_trace {path}: shapes token_ids {token_ids.shape}, expert_ids {expert_ids.shape}, "
                         f"gates {gate_q.shape} disagree")
    if n and (expert_ids.min() < 0 or expert_ids.max() >= n_expert):
        raise ValueError(f"write_trace {path}: expert id out of [0, {n_expert})")
    seqs = [{"name": str(s["name"]), "source": str(s["source"]), "n_tokens": int(s["n_tokens"]),
             **({"n_prompt": int(s["n_prompt"])} if "n_prompt" in s else {})} for s in sequences]
    bad = [s["name"] for s in seqs if not 0 <= s.get("n_prompt", 0) <= s["n_tokens"]]
    if bad:
        raise ValueError(f"write_trace {path}: n_prompt outside [0, n_tokens] in sequences {bad[:3]}")
    if sum(s["n_tokens"] for s in seqs) != n:
        raise ValueError(f"write_trace {path}: sequences hold {sum(s['n_tokens'] for s in seqs)} tokens, arrays {n}")
    header = {"format_version": FORMAT_VERSION, "model": model, "arch": arch, "n_layer": int(n_layer),
              "n_expert": int(n_expert), "top_k": int(top_k), "gate_weight_scale": GATE_WEIGHT_SCALE,
              "sequences": seqs, "n_tokens": int(n), "created_by": created_by}
    if first_moe_layer:
        header["first_moe_layer"] = int(first_moe_layer)
    rec = np.empty(n, dtype=record_dtype(n_layer, top_k))
    rec["token"] = token_ids.astype(np.uint32)
    rec["route"][:, :, 0, :] = expert_ids.astype(np.uint8)
    rec["route"][:, :, 1, :] = gate_q.astype(np.uint8)
    hjson = json.dumps(header, ensure_ascii=False).encode("utf-8")
    raw = TRACE_MAGIC + struct.pack("<I", len(hjson)) + hjson + rec.tobytes()
    data = _compress(raw, level, threads)
    Path(path).write_bytes(data)
    return len(data)


def read_trace(path):
    """Reads and validates a .pstrace file; returns Trace. Raises TraceFormatError naming the file."""
    data = Path(path).read_bytes()
    raw = _decompress_one_frame(path, data)
    header, body = _split_header(path, raw, TRACE_MAGIC)
    n_layer, n_expert, top_k, n_tokens = validate_trace_header(path, header)
    dt = record_dtype(n_layer, top_k)
    if len(body) != n_tokens * dt.itemsize:
        raise TraceFormatError(f"{path}: body has {len(body)} bytes, expected n_tokens {n_tokens} x record "
                               f"{dt.itemsize} = {n_tokens * dt.itemsize}")
    rec = np.frombuffer(body, dtype=dt)
    ids = rec["route"][:, :, 0, :]
    if n_tokens and ids.max() >= n_expert:
        bad = np.argwhere(ids >= n_expert)[0]
        raise TraceFormatError(f"{path}: token {bad[0]} layer {bad[1]} has expert id {ids[tuple(bad)]} >= "
                               f"n_expert {n_expert}")
    return Trace(header=header, token_ids=rec["token"].copy(), expert_ids=ids.copy(),
                 gate_q=rec["route"][:, :, 1, :].copy())


def head_sequences(trace, max_tokens):
    """(sequences, slice) of the leading whole sequences of `trace` holding at most max_tokens tokens."""
    seqs, n = [], 0
    for s in trace.sequences:
        if n + int(s["n_tokens"]) > max_tokens:
            break
        seqs.append(s)
        n += int(s["n_tokens"])
    return seqs, slice(0, n)


def write_head(src, dst, max_tokens, level=19, threads=0):
    """Writes to dst the leading whole sequences of trace src (at most max_tokens tokens); a hidden sidecar that
    covers only those sequences stays valid for the shorter trace. Returns (tokens kept, compressed bytes)."""
    t = read_trace(src)
    seqs, sl = head_sequences(t, max_tokens)
    h = dict(t.header)
    created = f"{h['created_by']}; head of {Path(src).name}: {sl.stop} tokens"
    nbytes = write_trace(dst, model=h["model"], arch=h["arch"], n_expert=t.n_expert, sequences=seqs,
                         token_ids=t.token_ids[sl], expert_ids=t.expert_ids[sl], gate_q=t.gate_q[sl],
                         created_by=created, first_moe_layer=h.get("first_moe_layer", 0), level=level, threads=threads)
    return sl.stop, nbytes


def quantize_int8_absmax(x):
    """x float [..., dim] -> (scale float32 [...], q int8 [..., dim]) with scale = max|x| / 127, q = round(x/scale)."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1)
    scale = (amax / 127.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(x / safe[..., None]), -127, 127).astype(np.int8)
    return scale, q


def write_hidden(path, *, trace_name, token_ranges, hidden=None, scale=None, q=None, level=19, threads=0):
    """Writes a NAME.hidden.zst sidecar.

    trace_name: file name of the trace (NAME.pstrace); token_ranges: [[seq_index, first_token, n_tokens]];
    hidden: float [N, n_layer, dim] router inputs (quantised here), or scale float32 [N, n_layer] and q int8
    [N, n_layer, dim] already quantised. Returns the compressed size in bytes.
    """
    if hidden is not None:
        scale, q = quantize_int8_absmax(hidden)
    q = np.asarray(q, dtype=np.int8)
    n, n_layer, dim = q.shape
    ranges = [[int(a), int(b), int(c)] for a, b, c in token_ranges]
    if sum(r[2] for r in ranges) != n:
        raise ValueError(f"write_hidden {path}: token_ranges cover {sum(r[2] for r in ranges)} tokens, arrays {n}")
    header = {"format_version": FORMAT_VERSION, "trace": trace_name, "n_layer": int(n_layer), "dim": int(dim),
              "encoding": HIDDEN_ENCODING, "n_tokens": int(n), "token_ranges": ranges}
    dt, _ = hidden_dtype(n_layer, dim)
    rec = np.empty((n, n_layer), dtype=dt)
    rec["scale"] = np.asarray(scale, dtype=np.float32)
    rec["q"] = q
    hjson = json.dumps(header).encode("utf-8")
    data = _compress(HIDDEN_MAGIC + struct.pack("<I", len(hjson)) + hjson + rec.tobytes(), level, threads)
    Path(path).write_bytes(data)
    return len(data)


def read_hidden(path, trace=None):
    """Reads and validates a sidecar; with `trace` also checks n_layer and that every range lies in its sequence."""
    raw = _decompress_one_frame(path, Path(path).read_bytes())
    header, body = _split_header(path, raw, HIDDEN_MAGIC)
    for key in ("trace", "token_ranges"):
        if key not in header:
            raise TraceFormatError(f"{path}: header lacks field {key!r}")
    if header.get("encoding") != HIDDEN_ENCODING:
        raise TraceFormatError(f"{path}: encoding {header.get('encoding')!r}, expected {HIDDEN_ENCODING!r}")
    n_layer = _int_field(path, header, "n_layer", 1, 4096)
    dim = _int_field(path, header, "dim", 1, 1 << 20)
    n_tokens = _int_field(path, header, "n_tokens", 0, 1 << 40)
    ranges = header["token_ranges"]
    if not isinstance(ranges, list) or any(not isinstance(r, list) or len(r) != 3 for r in ranges):
        raise TraceFormatError(f"{path}: token_ranges must be a list of [seq_index, first_token, n_tokens]")
    if sum(int(r[2]) for r in ranges) != n_tokens:
        raise TraceFormatError(f"{path}: token_ranges cover {sum(int(r[2]) for r in ranges)} tokens, "
                               f"header n_tokens is {n_tokens}")
    dt, _ = hidden_dtype(n_layer, dim)
    if len(body) != n_tokens * n_layer * dt.itemsize:
        raise TraceFormatError(f"{path}: body has {len(body)} bytes, expected {n_tokens} tokens x {n_layer} layers x "
                               f"{dt.itemsize} = {n_tokens * n_layer * dt.itemsize}")
    if trace is not None:
        if trace.n_layer != n_layer:
            raise TraceFormatError(f"{path}: n_layer {n_layer} but the trace has {trace.n_layer}")
        seqs = trace.sequences
        for s, first, n in ranges:
            if not (0 <= s < len(seqs) and first >= 0 and n >= 0 and first + n <= int(seqs[s]["n_tokens"])):
                raise TraceFormatError(f"{path}: token range {[s, first, n]} lies outside the trace's sequences")
    rec = np.frombuffer(body, dtype=dt).reshape(n_tokens, n_layer)
    return HiddenStates(header=header, scale=rec["scale"].copy(), q=rec["q"].copy())


def self_check(tmpdir):
    """Round-trips a random trace and sidecar and checks that damaged files are rejected; returns None or raises."""
    rng = np.random.default_rng(0)
    tmp = Path(tmpdir)
    n_layer, n_expert, top_k = 3, 16, 4
    seqs = [{"name": "a", "source": "test-split", "n_tokens": 5}, {"name": "b", "source": "gsm8k", "n_tokens": 7}]
    n = 12
    ids = np.stack([np.stack([rng.permutation(n_expert)[:top_k] for _ in range(n_layer)]) for _ in range(n)])
    w = rng.random((n, n_layer, top_k))
    w = -np.sort(-w / w.sum(-1, keepdims=True), axis=-1)
    tok = rng.integers(0, 8192, n)
    p = tmp / "x.pstrace"
    write_trace(p, model="t", arch="qwen3moe", n_expert=n_expert, sequences=seqs, token_ids=tok, expert_ids=ids,
                gate_weights=w, created_by="self-check")
    t = read_trace(p)
    assert (t.expert_ids == ids).all() and (t.token_ids == tok).all()
    assert np.abs(t.gate_weights() - w).max() <= 0.5 / 255 + 1e-7
    assert t.sequence_bounds() == [(0, 5), (5, 12)]
    raw = zstandard.ZstdDecompressor().decompress(p.read_bytes())
    hlen = struct.unpack_from("<I", raw, 8)[0]
    assert len(raw) == 12 + hlen + n * (4 + n_layer * 2 * top_k)
    # byte layout of the first record: token id LE, then layer 0 ids, layer 0 weights
    body = raw[12 + hlen:]
    assert struct.unpack_from("<I", body, 0)[0] == tok[0] and list(body[4:4 + top_k]) == list(ids[0, 0])
    bad = bytearray(raw)
    bad[12 + hlen + 4] = n_expert  # first expert id out of range
    for damaged, what in ((bytes(bad), "expert id"), (raw[:-1], "body has"), (b"XSTRACE1" + raw[8:], "bad magic")):
        q = tmp / "bad.pstrace"
        q.write_bytes(zstandard.ZstdCompressor().compress(damaged))
        try:
            read_trace(q)
        except TraceFormatError as e:
            assert what in str(e) and str(q) in str(e), e
        else:
            raise AssertionError(f"damaged trace ({what}) was accepted")
    assert "first_moe_layer" not in t.header  # 0: left out
    write_trace(p, model="t", arch="deepseek2", n_expert=n_expert, sequences=seqs, token_ids=tok, expert_ids=ids,
                gate_weights=w, created_by="self-check", first_moe_layer=1)
    assert read_trace(p).header["first_moe_layer"] == 1
    q = tmp / "two.pstrace"
    q.write_bytes(p.read_bytes() + p.read_bytes())
    try:
        read_trace(q)
    except TraceFormatError as e:
        assert "after the zstd frame" in str(e)
    else:
        raise AssertionError("two frames were accepted")

    dim = 8
    h = rng.standard_normal((7, n_layer, dim)).astype(np.float32)
    h[0, 0] = 0.0
    hp = tmp / "x.hidden.zst"
    write_hidden(hp, trace_name="x.pstrace", token_ranges=[[1, 0, 7]], hidden=h)
    hs = read_hidden(hp, trace=t)
    err = np.abs(hs.dequantize() - h).max(axis=-1)
    assert (err <= hs.scale * 0.5 + 1e-6).all() and hs.scale[0, 0] == 0
    assert (hs.flat_token_indices(t) == np.arange(5, 12)).all()
    write_hidden(hp, trace_name="x.pstrace", token_ranges=[[1, 3, 7]], hidden=h)
    try:
        read_hidden(hp, trace=t)
    except TraceFormatError as e:
        assert "outside" in str(e)
    else:
        raise AssertionError("out-of-range sidecar was accepted")


def main():
    ap = argparse.ArgumentParser(description="Inspect or self-check PreScope trace files.")
    ap.add_argument("files", nargs="*", help=".pstrace or .hidden.zst files to validate and summarise")
    ap.add_argument("--self-check", action="store_true", help="round-trip test in a temporary directory")
    ap.add_argument("--head", nargs=3, metavar=("IN", "OUT", "MAX_TOKENS"),
                    help="write the leading whole sequences of IN (at most MAX_TOKENS tokens) to OUT")
    args = ap.parse_args()
    if args.head:
        n, nbytes = write_head(args.head[0], args.head[1], int(args.head[2]))
        print(f"{args.head[1]}: {n} tokens, {nbytes} bytes")
    if args.self_check:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            self_check(d)
        print("pstrace self-check: OK")
    for f in args.files:
        try:
            if f.endswith(".hidden.zst"):
                h = read_hidden(f)
                print(f"{f}: hidden sidecar of {h.header['trace']}, {h.header['n_tokens']} tokens, "
                      f"{h.header['n_layer']} layers, dim {h.header['dim']}")
            else:
                t = read_trace(f)
                srcs = {}
                for s in t.sequences:
                    srcs[s["source"]] = srcs.get(s["source"], 0) + int(s["n_tokens"])
                print(f"{f}: model {t.header['model']} ({t.header['arch']}), {len(t.token_ids)} tokens in "
                      f"{len(t.sequences)} sequences, {t.n_layer} MoE layers from model layer "
                      f"{t.header.get('first_moe_layer', 0)}, {t.n_expert} experts, top-{t.top_k}; "
                      f"tokens by source {srcs}")
        except TraceFormatError as e:
            sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
