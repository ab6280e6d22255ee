#!/usr/bin/env bash
# Serving benchmark on the GPU machine (issue 13): a Qwen3-30B-A3B-shaped Q8_0 model (random weights, written here
# by tools/py/make_bench_model.py), routing replayed from the balanced trace, expert budget BUDGET GiB:
# `prescope serve -np NP` against llama.cpp's `llama-server -ngl 99 --n-cpu-moe N -np NP` at matched GPU memory,
# the same client (bench/serve/bench_serve.py) at concurrency CONC. Also runs test-gpu (the GPU runtime's tests,
# several sequences among them) first. Every log goes into $OUT/serve-logs.tar.gz; read $OUT/summary.txt first.
#
#   [RUN_TESTS=1] [BUDGET=12] [NP=64] [CONC="1 8 32 64"] [GEN=32] [ROUNDS=1] [PROMPT_WORDS=16] [PEER_DEADLINE=s] OUT=dir bash scripts/device/bench_serve.sh
#
# llama-server is a comparison peer built outside this repository (common.sh's setup_peer: carried binaries in
# .carry/peer-bin, or .carry/peer/build.sh started in the background); the peer is skipped when it is not there by
# PEER_DEADLINE seconds. Carry .carry/debs (missing -dev packages), .carry/whl or WHL_DIR (the gguf wheel for the model
# writer; the client needs only httpx, which the machine has) and .carry/peer-bin or .carry/peer.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/serve-out}
BUDGET=${BUDGET:-12}
NP=${NP:-64}
CONC=${CONC:-1 8 32 64}
GEN=${GEN:-32}
ROUNDS=${ROUNDS:-1}
PROMPT_WORDS=${PROMPT_WORDS:-16}  # about 95 tokens with the benchmark model's tokenizer
PEER_DEADLINE=${PEER_DEADLINE:-420}
TRACE=traces/topo-b-test.pstrace
SHAPE=qwen3-30b-a3b
CTX=$((NP * 256))  # 256 tokens per slot: the prompt and the generated tokens fit
THREADS=$(nproc)
MODEL=/tmp/prescope-$SHAPE-q8_0.gguf
LOG=$OUT/logs
mkdir -p "$LOG"
: > "$OUT/summary.txt"
trap 'tar czf "$OUT/serve-logs.tar.gz" -C "$OUT" logs && rm -rf "$LOG"' EXIT
say() { echo "[bench_serve] $*" | tee -a "$OUT/summary.txt"; }
T0=$SECONDS
source scripts/device/common.sh
setup_carried_debs .carry/debs

setup_peer
RUN_TESTS=${RUN_TESTS:-1}  # 0: skip test-gpu (a working tree without models/demo and tests/data)
LOG=$LOG build_prescope build-gpu prescope-cli $([ "$RUN_TESTS" = 1 ] && echo test-gpu) || exit 1
say "built prescope ($((SECONDS - T0)) s)"

setup_carried_wheels "${WHL_DIR:-.carry/whl}"
write_bench_model "$MODEL" "$LOG/model.log" --shape "$SHAPE" &
MODEL_PID=$!

if [ "$RUN_TESTS" = 1 ]; then
    run_bin timeout 120 build-gpu/bin/test-gpu > "$LOG/test-gpu.log" 2>&1
    say "test-gpu: exit $?, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$LOG/test-gpu.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]|steps above the margin' "$LOG/test-gpu.log" | head -12 | tee -a "$OUT/summary.txt"
fi
wait $MODEL_PID
[ -f "$MODEL" ] || { say "FAIL: could not write $MODEL (model.log)"; exit 1; }
say "model $MODEL: $(du -h "$MODEL" | cut -f1) ($((SECONDS - T0)) s)"

http_ok() { python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2> /dev/null; }
gpu_used_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
# Starts a server (the rest of the arguments), waits for /health, runs the client, stops the server; $1 = name.
serve_and_bench() {
    local name=$1 port=$2 label=$3
    shift 3
    "$@" > "$LOG/$name-server.log" 2>&1 &
    local pid=$! up=0
    for _ in $(seq 1 240); do
        if http_ok "http://127.0.0.1:$port/health"; then up=1; break; fi
        kill -0 $pid 2> /dev/null || break
        sleep 0.5
    done
    if [ $up -eq 0 ]; then
        say "FAIL: $name did not come up ($LOG/$name-server.log):"
        tail -5 "$LOG/$name-server.log" | tee -a "$OUT/summary.txt"
        kill $pid 2> /dev/null
        return 1
    fi
    say "$name up after $((SECONDS - T0)) s, GPU memory $(gpu_used_mib) MiB"
    (while true; do gpu_used_mib; sleep 0.2; done) > "$LOG/$name-gpu-mem.samples" 2> /dev/null &
    local sampler=$!
    timeout 240 python3 bench/serve/bench_serve.py --url "http://127.0.0.1:$port" --concurrency $CONC \
        --gen-tokens "$GEN" --rounds "$ROUNDS" --prompt-words "$PROMPT_WORDS" --label "$label" --out "$OUT/$name.json" > "$LOG/$name-client.log" 2>&1
    say "$name client: exit $?"
    head -7 "$LOG/$name-client.log" | tee -a "$OUT/summary.txt"
    python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())" \
        "http://127.0.0.1:$port/metrics" > "$LOG/$name-metrics.txt" 2> /dev/null
    kill $sampler 2> /dev/null
    kill -INT $pid 2> /dev/null
    for _ in $(seq 1 20); do kill -0 $pid 2> /dev/null || break; sleep 0.5; done
    kill -9 $pid 2> /dev/null
    wait $pid 2> /dev/null
    sort -n "$LOG/$name-gpu-mem.samples" | tail -1 > "$OUT/$name-gpu-peak-mib.txt"
    say "$name GPU peak $(cat "$OUT/$name-gpu-peak-mib.txt") MiB ($((SECONDS - T0)) s)"
}

serve_and_bench prescope 8181 \
    "prescope serve -np $NP -c $CTX --gpu-expert-budget ${BUDGET}GiB, routing replayed: $TRACE (balanced)" \
    env LD_LIBRARY_PATH=${RUN_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} build-gpu/bin/prescope serve -m "$MODEL" \
    -t "$THREADS" -np "$NP" -c "$CTX" --port 8181 --gpu-expert-budget "${BUDGET}GiB" --routing-trace "$TRACE" \
    --predictor recency

PEER=$PEER_BIN/llama-server
while [ ! -x "$PEER" ] && [ $((SECONDS - T0)) -lt "$PEER_DEADLINE" ] && pgrep -f peer/build.sh > /dev/null; do sleep 5; done
if [ -x "$PEER" ] && [ -s "$OUT/prescope-gpu-peak-mib.txt" ]; then
    # llama-server's F16 KV cache of CTX tokens (48 layers x 4 KV heads x 128 x K,V x 2 bytes) is not in report.py's
    # llama-bench figures: take it off our peak before matching the --n-cpu-moe.
    kv_mib=$((CTX * 48 * 4 * 128 * 2 * 2 / 1048576))
    n=$(python3 bench/offload/report.py --match-ncmoe $(($(cat "$OUT/prescope-gpu-peak-mib.txt") - kv_mib)) --shape "$SHAPE")
    say "peer ready after $((SECONDS - T0)) s; llama-server --n-cpu-moe $n (KV $kv_mib MiB)"
    serve_and_bench llama 8182 "llama.cpp 0c1e57098 llama-server -ngl 99 --n-cpu-moe $n -np $NP -c $CTX, its own router" \
        "$PEER" -m "$MODEL" -ngl 99 --n-cpu-moe "$n" -np "$NP" -c "$CTX" -t "$THREADS" --host 127.0.0.1 --port 8182
    echo "$n" > "$OUT/llama-ncmoe.txt"
else
    say "no llama-server by $((SECONDS - T0)) s: peer skipped ($(tail -2 "$LOG/peer-build.log" 2> /dev/null | tr '\n' ' '))"
fi
cp /tmp/peer/build.log "$LOG/peer-ninja.log" 2> /dev/null
echo "$SHAPE balanced $TRACE $BUDGET $NP $CTX $GEN $ROUNDS" > "$OUT/run.txt"
say "done in $((SECONDS - T0)) s"
