#!/usr/bin/env bash
# Issue 9 device job, ONE call on the H200: trains the balanced routing models topo-b (Qwen3-30B-A3B's 48 x 128 top-8
# topology) and topo-mixtral (Mixtral-8x7B's 32 x 8 top-2) with per-layer load balancing, writes their traces
# (test split, real prompts, prompts continued by the model), router weights and router-input sidecars, and packs
# them into $OUT (<= 8 files).
#
# Before the call, here:  python3 tools/data/build_corpus.py && python3 tools/data/prepare_carry.py --wheels
# The call:               run(command="bash scripts/device/train_balanced.sh", carry=[".carry", ".whl"], timeout_s=600)
# After it, here:         python3 tools/train/install_outputs.py <files_at> --summary-as docs/data/device-run-balanced.json
# CPU dry run, here:      OUT=/tmp/smoke-balanced bash scripts/device/train_balanced.sh --smoke
set -uo pipefail
START=$(date +%s)
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true

if [[ " $* " != *" --smoke "* ]]; then
    # The device image lacks gguf and zstandard: install the carried wheels (see /work/.library/device/README.md).
    ls .whl/*.whl >/dev/null 2>&1 || { echo "train_balanced.sh: .whl/ has no wheels (carry .whl)" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "train_balanced.sh: wheel install failed" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
[[ -f .carry/manifest.json ]] || { echo "train_balanced.sh: .carry/manifest.json missing (carry .carry)" >&2; exit 2; }

# The budget counts from this script's start; 540 s minus the wheel install keeps the call under 10 minutes.
BUDGET=$(( ${BUDGET_S:-540} - ($(date +%s) - START) ))
python3 tools/train/train_balanced.py full --out "$OUT" --budget-s "$BUDGET" "$@" 2>&1 | tee "$OUT/train-log.txt"
rc=${PIPESTATUS[0]}
ls -l "$OUT"
exit "$rc"
