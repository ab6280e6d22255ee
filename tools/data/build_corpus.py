# Builds the training corpus of issue 3: real text from Debian packages (apt-get download + dpkg -x) and
# ../shared/realdata/text, cleaned to NFC UTF-8, deduplicated by paragraph, split train/validation/test by document.
# Writes OUT/{train,validation,test}.jsonl ({"id","source","text"} per line) and a manifest (docs/data/corpus.json).
"""Corpus builder.

Usage: python3 tools/data/build_corpus.py [--work build-data] [--manifest docs/data/corpus.json]

Every step is deterministic given the same package versions: documents are visited in sorted order, splits come from
sha256(document id), and subsampling of large sources also hashes the id. The manifest records the .deb versions and
sha256 of what was used, so a rebuild that sees different package versions says so.
"""
import argparse
import gzip
import hashlib
import html.parser
import json
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

PACKAGES = [
    "debian-handbook", "linux-doc-6.1", "python3.11-doc", "perl-doc", "dict-gcide",
    "bible-kjv-text", "bible-kjv", "golang-1.19-src",
]
SPLITS = ("train", "validation", "test")
# Per-mille buckets of sha256(id): [0, test) test, [test, test + validation) validation, rest train. The OLMoE
# routing-analysis texts get a larger test share so that our traces cover the domains of the OLMoE/Mixtral statistics.
SPLIT_PERMILLE = {"default": (20, 20), "olmoe-text": (200, 50)}
MIN_DOC_CHARS = 200
MIN_DEDUP_PARAGRAPH_CHARS = 64
LONG_PARAGRAPH_CHARS = 4000
CHUNK_CHARS = 16000          # pseudo-documents cut from long undivided texts (gcide, OLMoE text files)
GCIDE_KEEP_PERMILLE = 250    # the dictionary is large and repetitive: keep about a quarter of its chunks
GO_MAX_CHARS = 16_000_000    # cap for Go source, filled in hash order

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_TRAILING_WS = re.compile(r"[ \t]+\n")
_MANY_BLANK = re.compile(r"\n{3,}")


def id_hash(doc_id):
    """First 8 hex digits of sha256(doc_id) as int: the basis of the split and of subsampling."""
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest()[:8], 16)


def split_of(doc_id):
    """Split name for a document id from sha256(id): test 2% / validation 2% (OLMoE texts 20% / 5%), else train."""
    test, val = SPLIT_PERMILLE.get(doc_id.split("/")[0], SPLIT_PERMILLE["default"])
    b = id_hash(doc_id) % 1000
    if b < test:
        return "test"
    if b < test + val:
        return "validation"
    return "train"


def clean_text(text):
    """NFC-normalise, drop control characters, unify newlines, strip trailing blanks, cap blank runs at one line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = unicodedata.normalize("NFC", text)
    text = _CONTROL.sub("", text)
    text = _TRAILING_WS.sub("\n", text)
    text = _MANY_BLANK.sub("\n\n", text)
    return text.strip("\n") + "\n"


def chunk_text(text, size=CHUNK_CHARS):
    """Cut text into pieces of about `size` characters: at a blank line once `size` is reached, at any line break
    once twice `size` is reached (some inputs have no blank lines)."""
    chunks, cur, n = [], [], 0
    for line in text.split("\n"):
        if cur and ((n >= size and not line.strip()) or n >= 2 * size):
            chunks.append("\n".join(cur).strip("\n"))
            cur, n = [], 0
        cur.append(line)
        n += len(line) + 1
    if cur:
        chunks.append("\n".join(cur).strip("\n"))
    return [c for c in chunks if c]


class _HtmlText(html.parser.HTMLParser):
    """Visible text of a docbook/publican HTML page, paragraphs separated by blank lines, navigation dropped."""

    BLOCK = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "pre", "table", "tr", "br",
             "blockquote", "ul", "ol", "dl", "section", "title"}
    SKIP_TAGS = {"head", "script", "style"}
    SKIP_CLASSES = {"docnav", "toc", "banner", "title"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out = []
        self.skip_stack = []   # tag names of open elements that started a skipped region
        self.depth_tags = []
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = set((a.get("class") or "").split()) | {a.get("id") or ""}
        if tag in self.SKIP_TAGS or (classes & self.SKIP_CLASSES and tag in ("div", "ul", "p")):
            self.skip_stack.append(len(self.depth_tags))
        if tag not in ("br", "img", "meta", "link", "hr", "input"):
            self.depth_tags.append(tag)
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.out.append("\n\n" if tag != "br" else "\n")

    def handle_endtag(self, tag):
        if tag not in self.depth_tags:
            return
        while self.depth_tags:
            t = self.depth_tags.pop()
            if self.skip_stack and self.skip_stack[-1] == len(self.depth_tags):
                self.skip_stack.pop()
            if t == "pre":
                self.pre -= 1
            if t == tag:
                break
        if tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_data(self, data):
        if self.skip_stack:
            return
        if self.pre:
            self.out.append(data)
        else:
            self.out.append(re.sub(r"\s+", " ", data))

    def text(self):
        raw = "".join(self.out)
        lines = [ln.strip() if not self.pre else ln for ln in raw.split("\n")]
        return "\n".join(lines)


def html_to_text(data):
    """Text of an HTML document (str) with navigation, tables of contents and scripts removed."""
    p = _HtmlText()
    p.feed(data)
    p.close()
    return p.text()


def fetch_packages(work):
    """apt-get download + dpkg -x each package into work/x/NAME; returns [{name, version, file, sha256, bytes}]."""
    debs = work / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    have = {p.name.split("_")[0]: p for p in debs.glob("*.deb")}
    missing = [p for p in PACKAGES if p not in have]
    if missing:
        r = subprocess.run(["apt-get", "download", *missing], cwd=debs, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"build_corpus: apt-get download {' '.join(missing)} failed: {r.stderr.strip()[-400:]}"
                     " (run apt-get update first)")
        have = {p.name.split("_")[0]: p for p in debs.glob("*.deb")}
    info = []
    for name in PACKAGES:
        deb = have[name]
        dest = work / "x" / name
        if not dest.exists():
            tmp = dest.with_suffix(".tmp")
            subprocess.run(["rm", "-rf", str(tmp)], check=True)
            tmp.mkdir(parents=True)
            subprocess.run(["dpkg", "-x", str(deb), str(tmp)], check=True)
            tmp.rename(dest)
        data = deb.read_bytes()
        info.append({"name": name, "version": deb.name.split("_")[1], "file": deb.name,
                     "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    return info


def docs_handbook(x):
    """debian-handbook, every language: one document per HTML page."""
    root = x / "debian-handbook/usr/share/doc/debian-handbook/html"
    langs = sorted(d.name for d in root.iterdir() if d.is_dir())
    # English first, so that untranslated pages of other languages dedupe away against it.
    langs.sort(key=lambda s: (s != "en-US", s))
    for lang in langs:
        for page in sorted((root / lang).glob("*.html")):
            yield f"debian-handbook/{lang}/{page.name}", "debian-handbook", html_to_text(
                page.read_text(encoding="utf-8", errors="replace"))


def docs_rst_sources(x, pkg, sub, source):
    """Sphinx reStructuredText sources (html/_sources/**/*.rst.txt), one document per file."""
    root = x / pkg / sub
    for f in sorted(root.rglob("*.txt")):
        yield f"{source}/{f.relative_to(root)}", source, f.read_text(encoding="utf-8", errors="replace")


def docs_perl(x):
    """perl-doc POD files, one document per file."""
    root = x / "perl-doc/usr/share/perl"
    for f in sorted(root.rglob("*.pod")):
        yield f"perl-doc/{f.relative_to(root)}", "perl-doc", f.read_text(encoding="utf-8", errors="replace")


def docs_gcide(x):
    """GCIDE dictionary (dictd format, gzip-compatible .dz), cut into chunks; about a quarter kept."""
    data = gzip.decompress((x / "dict-gcide/usr/share/dictd/gcide.dict.dz").read_bytes()).decode("utf-8", "replace")
    for i, chunk in enumerate(chunk_text(data)):
        doc_id = f"dict-gcide/chunk{i:05d}"
        if id_hash(doc_id + "#keep") % 1000 < GCIDE_KEEP_PERMILLE:
            yield doc_id, "dict-gcide", chunk


def docs_bible(x):
    """King James Bible through the package's own `bible` program, one document per chapter."""
    exe = x / "bible-kjv/usr/bin/bible"
    lib = x / "bible-kjv-text/usr/lib"
    r = subprocess.run([str(exe), "-p", str(lib), "-f", "gen1:1-rev22:21"], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0 or not r.stdout:
        sys.exit(f"build_corpus: {exe} failed to print the KJV text: {r.stderr.strip()[-300:]}")
    chapters = {}
    order = []
    for line in r.stdout.splitlines():
        m = re.match(r"^(\S+?)(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        key = f"{m.group(1)}{m.group(2)}"
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(f"{m.group(3)} {m.group(4)}")
    for key in order:
        yield f"bible-kjv/{key}", "bible-kjv", "\n".join(chapters[key])


def docs_go(x):
    """Go 1.19 standard library source (.go files outside testdata), capped in sha256 order of the path."""
    root = x / "golang-1.19-src/usr/share/go-1.19/src"
    files = [f for f in root.rglob("*.go") if f.is_file() and "testdata" not in f.parts]
    files.sort(key=lambda f: id_hash(str(f.relative_to(root))))
    total = 0
    chosen = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > GO_MAX_CHARS:
            continue
        total += len(text)
        chosen.append((f"golang-1.19-src/{f.relative_to(root)}", text))
    for doc_id, text in sorted(chosen):
        yield doc_id, "golang-1.19-src", text


def docs_olmoe_text(realdata):
    """../shared/realdata/text/olmoe-routing-text/*.txt (the OLMoE routing-analysis inputs), cut into chunks."""
    root = realdata / "text/olmoe-routing-text"
    for f in sorted(root.glob("*.txt")):
        for i, chunk in enumerate(chunk_text(f.read_text(encoding="utf-8", errors="replace"))):
            yield f"olmoe-text/{f.stem}/chunk{i:04d}", f"olmoe-text-{f.stem.replace('_texts', '')}", chunk


def all_documents(x, realdata):
    """Every raw document as (id, source, text), sources in a fixed order."""
    yield from docs_handbook(x)
    yield from docs_rst_sources(x, "linux-doc-6.1", "usr/share/doc/linux-doc-6.1/html/_sources", "linux-doc")
    yield from docs_rst_sources(x, "python3.11-doc", "usr/share/doc/python3.11/html/_sources", "python3.11-doc")
    yield from docs_perl(x)
    yield from docs_gcide(x)
    yield from docs_bible(x)
    yield from docs_go(x)
    yield from docs_olmoe_text(realdata)


def _first_sighting(unit, seen):
    h = hashlib.sha256(unit.encode("utf-8")).digest()[:12]
    if h in seen:
        return False
    seen.add(h)
    return True


def dedupe_paragraphs(text, seen):
    """Drop paragraphs (blank-line separated, >= 64 chars) already seen anywhere earlier in the corpus; paragraphs
    longer than LONG_PARAGRAPH_CHARS (texts with one paragraph per line) are deduplicated line by line instead."""
    keep = []
    for para in text.split("\n\n"):
        if len(para) > LONG_PARAGRAPH_CHARS:
            lines = [ln for ln in para.split("\n")
                     if len(ln) < MIN_DEDUP_PARAGRAPH_CHARS or _first_sighting(ln, seen)]
            if lines:
                keep.append("\n".join(lines))
        elif len(para) < MIN_DEDUP_PARAGRAPH_CHARS or _first_sighting(para, seen):
            keep.append(para)
    return "\n\n".join(keep)


def sha256_file(path):
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="build-data", help="cache for .debs and unpacked trees (git-ignored)")
    ap.add_argument("--out", default=None, help="where the split .jsonl files go (default WORK/corpus)")
    ap.add_argument("--realdata", default=None, help="../shared/realdata (default: next to the repo)")
    ap.add_argument("--manifest", default="docs/data/corpus.json")
    args = ap.parse_args()

    repo = Path(__file__).resolve().parents[2]
    work = Path(args.work).resolve()
    out = Path(args.out).resolve() if args.out else work / "corpus"
    realdata = Path(args.realdata) if args.realdata else repo.parent / "shared" / "realdata"
    if not (realdata / "text/olmoe-routing-text").is_dir():
        sys.exit(f"build_corpus: {realdata}/text/olmoe-routing-text not found (pass --realdata)")

    packages = fetch_packages(work)
    out.mkdir(parents=True, exist_ok=True)
    files = {s: open(out / f"{s}.jsonl", "w", encoding="utf-8") for s in SPLITS}
    seen = set()
    stats = {}
    for doc_id, source, raw in all_documents(work / "x", realdata):
        text = clean_text(dedupe_paragraphs(clean_text(raw), seen))
        if len(text) < MIN_DOC_CHARS:
            continue
        split = split_of(doc_id)
        files[split].write(json.dumps({"id": doc_id, "source": source, "text": text}, ensure_ascii=False) + "\n")
        st = stats.setdefault(source, {s: {"docs": 0, "chars": 0, "utf8_bytes": 0} for s in SPLITS})
        st[split]["docs"] += 1
        st[split]["chars"] += len(text)
        st[split]["utf8_bytes"] += len(text.encode("utf-8"))
    for f in files.values():
        f.close()

    split_files = {}
    for s in SPLITS:
        p = out / f"{s}.jsonl"
        split_files[s] = {"file": f"{s}.jsonl", "bytes": p.stat().st_size, "sha256": sha256_file(p),
                          "docs": sum(v[s]["docs"] for v in stats.values()),
                          "chars": sum(v[s]["chars"] for v in stats.values())}
    manifest = {
        "format": "jsonl, one {\"id\", \"source\", \"text\"} object per line; text is NFC UTF-8",
        "created_by": "python3 tools/data/build_corpus.py",
        "split_rule": "b = sha256(id)[:8] as int mod 1000; (test, validation) per-mille by the id's first path "
                      f"component {SPLIT_PERMILLE}: b < test -> test, b < test + validation -> validation, "
                      "else train",
        "cleaning": "NFC, control characters dropped, CRLF->LF, trailing blanks stripped, >1 blank line collapsed, "
                    f"paragraphs >= {MIN_DEDUP_PARAGRAPH_CHARS} chars deduplicated corpus-wide, documents < "
                    f"{MIN_DOC_CHARS} chars dropped",
        "packages": packages,
        "realdata_text": "../shared/realdata/text/olmoe-routing-text/*.txt",
        "splits": split_files,
        "sources": stats,
    }
    mpath = Path(args.manifest)
    mpath.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(mpath.read_text()) if mpath.exists() else None
    if old and old.get("splits") != split_files:
        print(f"build_corpus: note: split checksums differ from the committed {mpath} "
              f"(package versions: {[p['version'] for p in packages]})", file=sys.stderr)
    mpath.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    for s in SPLITS:
        print(f"{s}: {split_files[s]['docs']} docs, {split_files[s]['chars'] / 1e6:.1f} M chars, "
              f"{split_files[s]['bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
