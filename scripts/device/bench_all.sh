#!/usr/bin/env bash
# One device call for the Qwen3-30B-A3B-shaped benchmarks against llama.cpp (issues 13 and 14): bench_offload.sh
# (prefill and decode at BUDGETS, 32 GiB holding every expert, against llama-bench --n-cpu-moe N / -ngl 99) and
# then bench_serve.sh (prescope serve against llama-server), on the same model file, the same balanced routing
# trace and the same peer build. $OUT gets summary.txt (both summaries) and offload.tar.gz + serve.tar.gz (every
# file of each run; the device returns at most 8 files).
#
#   [BUDGETS="32 12 4 24"] OUT=dir bash scripts/device/bench_all.sh
#
# Carry .carry/debs, WHL_DIR (a folder holding the gguf wheel; default .carry/whl) and .carry/peer-bin (llama.cpp binaries, common.sh's setup_peer); the
# working tree must leave room for them (scripts/device/slim-tree.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?OUT=dir}
mkdir -p "$OUT/offload" "$OUT/serve"
BUDGETS=${BUDGETS:-32 12 4 24} OUT=$OUT/offload bash scripts/device/bench_offload.sh
RUN_TESTS=0 OUT=$OUT/serve bash scripts/device/bench_serve.sh
cat "$OUT/offload/summary.txt" "$OUT/serve/summary.txt" > "$OUT/summary.txt"
for d in offload serve; do tar czf "$OUT/$d.tar.gz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
