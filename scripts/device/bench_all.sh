#!/usr/bin/env bash
# One device call for the Qwen3-30B-A3B-shaped benchmarks against llama.cpp (issues 13 and 14): bench_offload.sh
# (prefill and decode at BUDGETS, 32 GiB holding every expert, against llama-bench --n-cpu-moe N / -ngl 99) and
# then bench_serve.sh (prescope serve against llama-server), on the same model file, the same balanced routing
# trace and the same peer build. $OUT gets summary.txt (both summaries) and offload.tar.gz + serve.tar.gz (every
# file of each run; the device returns at most 8 files).
#
#   [BUDGETS="32 12 4 24"] [PROFILE=1] OUT=dir bash scripts/device/bench_all.sh
#
# PROFILE=1 first runs profile_decode.sh at 32 GiB (op tests and timings, CUPTI timelines of ours and llama.cpp's
# decode) into profile.tar.gz.
#
# Carry .carry/debs, WHL_DIR (a folder holding the gguf wheel; default .carry/whl) and .carry/peer-bin (llama.cpp binaries, common.sh's setup_peer); the
# working tree must leave room for them (scripts/device/slim-tree.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?OUT=dir}
PARTS=(offload serve)
[ "${PROFILE:-0}" = 1 ] && PARTS=(profile "${PARTS[@]}")
for d in "${PARTS[@]}"; do mkdir -p "$OUT/$d"; done
[ "${PROFILE:-0}" = 1 ] && BUDGETS=32 OUT=$OUT/profile bash scripts/device/profile_decode.sh
BUDGETS=${BUDGETS:-32 12 4 24} OUT=$OUT/offload bash scripts/device/bench_offload.sh
RUN_TESTS=0 OUT=$OUT/serve bash scripts/device/bench_serve.sh
for d in "${PARTS[@]}"; do cat "$OUT/$d/summary.txt"; done > "$OUT/summary.txt"
for d in "${PARTS[@]}"; do tar czf "$OUT/$d.tar.gz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
