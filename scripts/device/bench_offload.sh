#!/usr/bin/env bash
# Offload benchmark on the GPU machine: a Qwen3-30B-A3B- or Mixtral-8x7B-shaped Q8_0 model (random weights, written
# here by tools/py/make_bench_model.py), routing replayed from a trace, batch 1: PreScope's prefill (pp512) and
# decode (tg128) tokens/s at several expert budgets, then llama.cpp's llama-bench (-ngl 99 --n-cpu-moe N) on the
# same file with the same threads, N chosen so that its GPU memory matches ours. Peak GPU memory of every run is
# read with nvidia-smi. bench/offload/report.py turns $OUT into bench/results/offload-q30b.json and a table.
#
#   [SHAPE=qwen3-30b-a3b|mixtral-8x7b] [LLAMA_BENCH=/path/to/llama-bench] [LLAMA_WAIT=s] [BUDGETS="12 4 8 24"]
#   [PREDICTOR=recency] [TRACE=...] [ROUTING_KIND=balanced|skewed] OUT=dir scripts/device/bench_offload.sh
#
# Defaults per shape: qwen3-30b-a3b budgets 12 4 8 24 GiB, trace traces/topo-b-test.pstrace; mixtral-8x7b budgets
# 12 24 36 GiB, trace traces/topo-mixtral-test.pstrace (the balanced traces of issue 9, ROUTING_KIND=balanced).
# The device's 64 GB disk holds one benchmark model at a time: each shape writes, uses and deletes its own.
#
# llama-bench is a comparison peer built outside this repository: LLAMA_BENCH, else common.sh's setup_peer (the
# carried binaries of .carry/peer-bin, or .carry/peer/build.sh in the background); the script waits up to
# LLAMA_WAIT seconds for the file to appear and skips the peer if it does not. A budget that holds every expert
# (32 GiB for qwen3-30b-a3b) is matched with --n-cpu-moe 0: llama.cpp with everything on the GPU. Carry .carry/debs (missing -dev packages) and .carry/whl
# (the gguf wheel for the model writer; WHL_DIR overrides).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/bench-out}
SHAPE=${SHAPE:-qwen3-30b-a3b}
case $SHAPE in
    qwen3-30b-a3b) BUDGETS=${BUDGETS:-12 4 8 24}; TRACE=${TRACE:-traces/topo-b-test.pstrace} ;;
    mixtral-8x7b) BUDGETS=${BUDGETS:-12 24 36}; TRACE=${TRACE:-traces/topo-mixtral-test.pstrace} ;;
    *) echo "bench_offload.sh: SHAPE must be qwen3-30b-a3b or mixtral-8x7b" >&2; exit 2 ;;
esac
ROUTING_KIND=${ROUTING_KIND:-balanced}
PREDICTOR=${PREDICTOR:-recency}
LLAMA_WAIT=${LLAMA_WAIT:-0}
THREADS=$(nproc)
MODEL=/tmp/prescope-$SHAPE-q8_0.gguf
mkdir -p "$OUT"
: > "$OUT/summary.txt"
say() { echo "[bench_offload] $*" | tee -a "$OUT/summary.txt"; }
T0=$SECONDS
source scripts/device/common.sh
setup_carried_debs .carry/debs
[ -n "${LLAMA_BENCH:-}" ] || { setup_peer; LLAMA_BENCH=$PEER_BIN/llama-bench; }
build_prescope build-gpu prescope-cli || exit 1
say "built prescope ($((SECONDS - T0)) s)"

setup_carried_wheels "${WHL_DIR:-.carry/whl}"
for other in /tmp/prescope-*-q8_0.gguf; do [ "$other" = "$MODEL" ] || rm -f "$other"; done
write_bench_model "$MODEL" "$OUT/model.log" --shape "$SHAPE"
[ -f "$MODEL" ] || { say "FAIL: could not write $MODEL (model.log)"; tail -3 "$OUT/model.log"; exit 1; }
say "model $MODEL: $(du -h "$MODEL" | cut -f1) ($((SECONDS - T0)) s)"

# Runs a command while sampling the GPU's used memory; writes the peak (MiB) to $1.
with_gpu_peak() {
    local peak_file=$1
    shift
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.2; done) \
        > "$peak_file.samples" 2> /dev/null &
    local sampler=$!
    "$@"
    local rc=$?
    kill $sampler 2> /dev/null
    wait $sampler 2> /dev/null
    sort -n "$peak_file.samples" | tail -1 > "$peak_file"
    rm -f "$peak_file.samples"
    return $rc
}

for b in $BUDGETS; do
    with_gpu_peak "$OUT/gpu-mem-prescope-$b.txt" run_bin timeout 240 build-gpu/bin/prescope bench -m "$MODEL" \
        -t "$THREADS" -p 512 -n 128 -r 1 -o json --gpu-expert-budget "${b}GiB" --routing-trace "$TRACE" \
        --predictor "$PREDICTOR" > "$OUT/prescope-$b.jsonl" 2> "$OUT/prescope-$b.log"
    say "prescope ${b}GiB: exit $?, GPU peak $(cat "$OUT/gpu-mem-prescope-$b.txt") MiB; $(python3 bench/offload/report.py --brief "$OUT/prescope-$b.jsonl")"
done

if [ -n "${LLAMA_BENCH:-}" ]; then
    while [ ! -x "$LLAMA_BENCH" ] && [ $((SECONDS - T0)) -lt "$LLAMA_WAIT" ]; do sleep 5; done
fi
if [ -n "${LLAMA_BENCH:-}" ] && [ -x "$LLAMA_BENCH" ]; then
    say "peer ready after $((SECONDS - T0)) s: $LLAMA_BENCH"
    for b in $BUDGETS; do
        n=$(python3 bench/offload/report.py --match-ncmoe "$(cat "$OUT/gpu-mem-prescope-$b.txt")" --shape "$SHAPE")
        with_gpu_peak "$OUT/gpu-mem-llama-$n.txt" timeout 240 "$LLAMA_BENCH" -m "$MODEL" -ngl 99 -ncmoe "$n" \
            -t "$THREADS" -p 512 -n 128 -r 1 -o jsonl > "$OUT/llama-$n.jsonl" 2> "$OUT/llama-$n.log"
        say "llama.cpp -ncmoe $n (for ${b}GiB): exit $?, GPU peak $(cat "$OUT/gpu-mem-llama-$n.txt") MiB; $(grep -o '"avg_ts": *[0-9.]*' "$OUT/llama-$n.jsonl" | tr '\n' ' ')"
        echo "$b $n" >> "$OUT/pairs.txt"
    done
else
    say "no llama-bench: peer skipped"
fi
echo "$SHAPE $ROUTING_KIND $TRACE" > "$OUT/run.txt"
say "done in $((SECONDS - T0)) s"
