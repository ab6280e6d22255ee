#!/usr/bin/env bash
# Issue 2 benchmark on the GPU machine's host, CPU only: `prescope bench` against llama.cpp's CPU build
# (`llama-bench`, no -ngl) on the same Qwen3-30B-A3B-shaped Q8_0 file with the same thread count, interleaved
# rounds (bench/cpu/compare_llamacpp.py). Writes $OUT/cpu-q30b-t<THREADS>.json and a summary.
#
#   [LLAMA_BENCH=/path/to/cpu/llama-bench] [LLAMA_WAIT=s] [THREADS="16 8"] [LAYERS=48] OUT=dir \
#       scripts/device/bench_cpu.sh
#
# llama-bench is a comparison peer built outside this repository (a CPU build: a CUDA build would move big
# prompt batches to the GPU); the script waits up to LLAMA_WAIT seconds for it. Carry .carry/debs and .carry/whl
# (the gguf wheel for tools/py/make_bench_model.py). Our binary is the CUDA build, run without
# --gpu-expert-budget, which is the CPU path.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/bench-cpu-out}
THREADS=${THREADS:-$(nproc)}
LAYERS=${LAYERS:-48}
LLAMA_WAIT=${LLAMA_WAIT:-0}
MODEL=/tmp/prescope-q30b-q8_0.gguf
[ "$LAYERS" = 48 ] || MODEL=/tmp/prescope-q30b-${LAYERS}l-q8_0.gguf
mkdir -p "$OUT"
: > "$OUT/summary.txt"
say() { echo "[bench_cpu] $*" | tee -a "$OUT/summary.txt"; }
T0=$SECONDS
source scripts/device/common.sh
setup_carried_debs .carry/debs

setup_carried_wheels "${WHL_DIR:-.carry/whl}"
# The model is written while the build runs.
write_bench_model "$MODEL" "$OUT/model.log" --layers "$LAYERS" &
writer=$!
build_prescope build-gpu prescope-cli || exit 1
say "built prescope ($((SECONDS - T0)) s)"
wait $writer
[ -f "$MODEL" ] || { say "FAIL: could not write $MODEL (model.log)"; exit 1; }
say "model $MODEL: $(du -h "$MODEL" | cut -f1) ($((SECONDS - T0)) s)"

if [ -n "${LLAMA_BENCH:-}" ]; then
    while [ ! -x "$LLAMA_BENCH" ] && [ $((SECONDS - T0)) -lt "$LLAMA_WAIT" ]; do sleep 5; done
fi
[ -n "${LLAMA_BENCH:-}" ] && [ -x "$LLAMA_BENCH" ] || { say "no llama-bench: nothing to compare"; exit 1; }
say "peer ready after $((SECONDS - T0)) s: $LLAMA_BENCH"
[ -n "$RUN_LIBS" ] && export LD_LIBRARY_PATH=$RUN_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for t in $THREADS; do
    timeout 400 python3 bench/cpu/compare_llamacpp.py -m "$MODEL" --llama-bench "$LLAMA_BENCH" \
        --prescope build-gpu/bin/prescope -t "$t" -p 128 -n 32 -r 2 --rounds 3 \
        --json-out "$OUT/cpu-q30b-t$t.json" > "$OUT/compare-t$t.log" 2>&1
    say "threads $t: exit $?"
    grep -v '^\[{' "$OUT/compare-t$t.log" | tail -8 | tee -a "$OUT/summary.txt"
done
say "done in $((SECONDS - T0)) s"
