#!/usr/bin/env bash
# Issue 3 device job, ONE call on the H200: trains demo + topo, exports demo to GGUF (Q8_0 back, BF16 checked there
# only), writes routing traces, the topo hidden sidecar and router weights, packs it all into $OUT (<= 8 files).
#
# Before the call, here:  python3 tools/data/build_corpus.py && python3 tools/data/prepare_carry.py --wheels
# The call:               run(command="bash scripts/device/train_models.sh", carry=[".carry", ".whl"], timeout_s=600)
# After it, here:         bash tools/train/install_outputs.sh /work/.device/<files_at folder>
# CPU dry run, here:      OUT=/tmp/smoke-out bash scripts/device/train_models.sh --smoke
set -uo pipefail
START=$(date +%s.%N)
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true

if [[ " $* " != *" --smoke "* ]]; then
    # The device image lacks gguf and zstandard: install the carried wheels (see /work/.library/device/README.md).
    ls .whl/*.whl >/dev/null 2>&1 || { echo "train_models.sh: .whl/ has no wheels (carry .whl)" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "train_models.sh: wheel install failed" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
[[ -f .carry/manifest.json ]] || { echo "train_models.sh: .carry/manifest.json missing (carry .carry)" >&2; exit 2; }

# The budget counts from this script's start (wheel install included); 525 s keeps the call under 9 minutes.
python3 tools/train/train_models.py --out "$OUT" --start-time "$START" --budget-s "${BUDGET_S:-525}" "$@" 2>&1 \
    | tee "$OUT/train-log.txt"
rc=${PIPESTATUS[0]}
ls -l "$OUT"
exit "$rc"
