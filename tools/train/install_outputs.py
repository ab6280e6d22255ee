# Reassembles what scripts/device/train_models.sh (or train_balanced.sh) returned (results.tar.part-NN + summary.json), checks every
# checksum recorded on the device, and unpacks the files into the repository (models/demo, traces, docs/data).
"""Install the device job's outputs.

Usage: python3 tools/train/install_outputs.py FOLDER [--repo .] [--dry-run]

FOLDER holds summary.json, train-log.txt and results.tar.part-00, -01, ... Equivalent by hand:
    cat FOLDER/results.tar.part-* > /tmp/results.tar && sha256sum /tmp/results.tar   # = summary.json package.tar_sha256
    tar -xf /tmp/results.tar -C REPO
The tar holds only relative paths under models/demo/, traces/ and docs/data/; anything else is refused.
"""
import argparse
import hashlib
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

ALLOWED_PREFIXES = ("models/demo/", "traces/", "docs/data/")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[2]))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--summary-as", default="docs/data/device-run-summary.json",
                    help="where summary.json goes in the repository ('' to skip)")
    args = ap.parse_args()
    src, repo = Path(args.folder), Path(args.repo)
    summary = json.loads((src / "summary.json").read_text())
    pkg = summary.get("package")
    if not pkg:
        sys.exit(f"{src}/summary.json has no package section: the device job failed before packing "
                 f"(errors: {summary.get('errors')})")
    blob = bytearray()
    for part in pkg["parts"]:
        data = (src / part["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != part["sha256"]:
            sys.exit(f"{src / part['file']}: sha256 differs from summary.json")
        blob += data
    if hashlib.sha256(blob).hexdigest() != pkg["tar_sha256"]:
        sys.exit("reassembled results.tar: sha256 differs from summary.json")
    with tarfile.open(fileobj=io.BytesIO(bytes(blob))) as tf:
        members = tf.getmembers()
        for m in members:
            if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts or \
                    not m.name.startswith(ALLOWED_PREFIXES):
                sys.exit(f"results.tar: refusing member {m.name!r}")
        for m in members:
            data = tf.extractfile(m).read()
            want = pkg["contents"][m.name]["sha256"]
            if hashlib.sha256(data).hexdigest() != want:
                sys.exit(f"results.tar: {m.name}: sha256 differs from summary.json")
            dest = repo / m.name
            print(f"{'would write' if args.dry_run else 'wrote'} {dest} ({len(data) / 2**20:.2f} MiB)")
            if not args.dry_run:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
    if not args.dry_run and args.summary_as:
        shutil.copy(src / "summary.json", repo / args.summary_as)
        print(f"wrote {repo / args.summary_as}")
    if pkg.get("left_out_for_size"):
        print(f"note: left out on the device for size: {pkg['left_out_for_size']}")
    if summary.get("errors"):
        print(f"note: phases that failed on the device: {summary['errors']}")


if __name__ == "__main__":
    main()
