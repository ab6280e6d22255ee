#!/usr/bin/env bash
# Offload benchmark on the GPU machine: a Qwen3-30B-A3B-, Mixtral-8x7B- or DeepSeek-V2-Lite-shaped Q8_0 model
# (random weights, written here by tools/py/make_bench_model.py), routing replayed from a trace, batch 1: PreScope's
# prefill (pp512) and decode (tg128) tokens/s at several expert budgets, then llama.cpp's llama-bench (-ngl 99
# --n-cpu-moe N) on the same file with the same threads, N chosen so that its GPU memory matches ours. Peak GPU
# memory of every run is read with nvidia-smi. bench/offload/report.py turns $OUT into bench/results/offload-q30b.json
# and a table.
#
#   [SHAPE=qwen3-30b-a3b|mixtral-8x7b|deepseek-v2-lite] [LLAMA_BENCH=/path/to/llama-bench] [LLAMA_WAIT=s]
#   [BUDGETS="12 4 8 24"] [PREDICTOR=recency] [TRACE=...] [ROUTING_KIND=balanced|skewed] [MATCH_CALIBRATE=0|1]
#   OUT=dir scripts/device/bench_offload.sh
#
# Defaults per shape: qwen3-30b-a3b budgets 12 4 8 24 GiB, trace traces/topo-b-test.pstrace; mixtral-8x7b budgets
# 12 24 36 GiB, trace traces/topo-mixtral-test.pstrace (the balanced traces of issue 9, ROUTING_KIND=balanced);
# deepseek-v2-lite budgets 4 8 GiB (of its 14.2 GiB of routed experts), trace traces/topo-v2lite-test.pstrace (26
# MoE layers x 64 experts, top-6: the model's 27 blocks less the dense first one; decision 0135).
# MATCH_CALIBRATE=1 (the default for deepseek-v2-lite only, whose llama.cpp base is not yet measured): the first
# peer run's peak gives llama.cpp's base (report.py --llama-base), the later budgets are matched with it, and the
# first budget runs again when its match changes with it.
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
    deepseek-v2-lite) BUDGETS=${BUDGETS:-4 8}; TRACE=${TRACE:-traces/topo-v2lite-test.pstrace}
        MATCH_CALIBRATE=${MATCH_CALIBRATE:-1} ;;
    *) echo "bench_offload.sh: SHAPE must be qwen3-30b-a3b, mixtral-8x7b or deepseek-v2-lite" >&2; exit 2 ;;
esac
MATCH_CALIBRATE=${MATCH_CALIBRATE:-0}
ROUTING_KIND=${ROUTING_KIND:-balanced}
PREDICTOR=${PREDICTOR:-recency}
LLAMA_WAIT=${LLAMA_WAIT:-0}
THREADS=$(nproc)
MODEL=/tmp/prescope-$SHAPE-q8_0.gguf
mkdir -p "$OUT"
: > "$OUT/summary.txt"
say() { echo "[bench_offload] $*" | tee -a "$OUT/summary.txt"; }
[ -f "$TRACE" ] || { say "FAIL: routing trace $TRACE not found"; exit 2; }
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
    # One llama-bench run at --n-cpu-moe $1 for budget $2 (files keyed by N).
    run_peer() {
        local n=$1 b=$2
        with_gpu_peak "$OUT/gpu-mem-llama-$n.txt" timeout 240 "$LLAMA_BENCH" -m "$MODEL" -ngl 99 -ncmoe "$n" \
            -t "$THREADS" -p 512 -n 128 -r 1 -o jsonl > "$OUT/llama-$n.jsonl" 2> "$OUT/llama-$n.log"
        say "llama.cpp -ncmoe $n (for ${b}GiB): exit $?, GPU peak $(cat "$OUT/gpu-mem-llama-$n.txt") MiB; $(grep -o '"avg_ts": *[0-9.]*' "$OUT/llama-$n.jsonl" | tr '\n' ' ')"
    }
    BASE_ARGS=()
    for b in $BUDGETS; do
        peak=$(cat "$OUT/gpu-mem-prescope-$b.txt")
        n=$(python3 bench/offload/report.py --match-ncmoe "$peak" --shape "$SHAPE" "${BASE_ARGS[@]}")
        run_peer "$n" "$b"
        if [ "$MATCH_CALIBRATE" = 1 ] && [ ${#BASE_ARGS[@]} -eq 0 ] && [ -s "$OUT/gpu-mem-llama-$n.txt" ]; then
            base=$(python3 bench/offload/report.py --llama-base "$(cat "$OUT/gpu-mem-llama-$n.txt")" --ncmoe "$n" \
                --shape "$SHAPE")
            BASE_ARGS=(--llama-base-mib "$base")
            m=$(python3 bench/offload/report.py --match-ncmoe "$peak" --shape "$SHAPE" "${BASE_ARGS[@]}")
            say "llama.cpp base measured: $base MiB (every expert on the CPU); ${b}GiB matches -ncmoe $m with it"
            echo "$base" > "$OUT/llama-base-mib.txt"
            if [ "$m" != "$n" ]; then n=$m; run_peer "$n" "$b"; fi
        fi
        echo "$b $n" >> "$OUT/pairs.txt"
    done
else
    say "no llama-bench: peer skipped"
fi
echo "$SHAPE $ROUTING_KIND $TRACE" > "$OUT/run.txt"
say "done in $((SECONDS - T0)) s"
