#!/usr/bin/env bash
# Issue 12's benchmark in one device call, the DeepSeek-V2-Lite sibling of bench_all.sh: bench_offload.sh with
# SHAPE=deepseek-v2-lite (a deepseek2 Q8_0 file of V2-Lite's shape with random weights, 16.7 GB, written here by
# tools/py/make_bench_model.py), routing replayed from the balanced traces/topo-v2lite-test.pstrace (26 MoE layers x
# 64 experts, top-6: scripts/device/train_v2lite.sh, decision 0135), prefill pp512 and decode tg128 at BUDGETS GiB of
# experts (default 4 and 8 of the 14.2 GiB of routed experts) against llama.cpp -ngl 99 --n-cpu-moe N at the same GPU
# memory (N from the first peer run's measured base, report.py --llama-base). $OUT gets summary.txt (the run's lines
# and report.py's table), offload-v2lite.json (report.py's rows) and offload.tar.gz (every file of the run).
#
#   [BUDGETS="4 8"] [WHL_DIR=.carry/whl-gguf] OUT=dir bash scripts/device/bench_v2lite.sh
#
# Needs, beyond what bench_all.sh needs (.carry/debs, the gguf wheel in WHL_DIR, .carry/peer-bin): the trace committed
# and the GPU runtime and routing replay for deepseek2 (leading dense layers). Before the call, here:
#   scripts/device/slim-tree.sh hide tests/data tests/fuzz docs bench/results models \
#       $(git ls-files traces | grep -v '^traces/topo-v2lite-test.pstrace$')
# the call: run(command="OUT=$OUT WHL_DIR=.carry/whl-gguf bash scripts/device/bench_v2lite.sh",
#               carry=[".carry/debs", ".carry/whl-gguf", ".carry/peer-bin"], timeout_s=600)
# after it: scripts/device/slim-tree.sh restore
#           python3 bench/offload/report.py <files_at>/offload --json-out bench/results/offload-v2lite.json
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?OUT=dir}
mkdir -p "$OUT/offload"
SHAPE=deepseek-v2-lite BUDGETS=${BUDGETS:-4 8} OUT=$OUT/offload bash scripts/device/bench_offload.sh
rc=$?
cp "$OUT/offload/summary.txt" "$OUT/summary.txt"
python3 bench/offload/report.py "$OUT/offload" --json-out "$OUT/offload-v2lite.json" \
    --command "OUT=dir bash scripts/device/bench_v2lite.sh (BUDGETS=\"${BUDGETS:-4 8}\")" >> "$OUT/summary.txt" 2>&1
tar czf "$OUT/offload.tar.gz" -C "$OUT" offload && rm -rf "${OUT:?}/offload"
cat "$OUT/summary.txt"
exit "$rc"
