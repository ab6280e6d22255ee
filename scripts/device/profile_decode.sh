#!/usr/bin/env bash
# Issue 14: where a decode token's time goes on the GPU, ours and llama.cpp's, from a CUPTI timeline
# (bench/profile/cupti-trace.cpp; Nsight Systems cannot make reports on the GPU machine). Builds prescope, the
# tracer and test-backend-ops; writes the Qwen3-30B-A3B-shaped Q8_0 model; times the CUDA ops (test-backend-ops
# perf); runs `prescope bench -p 16 -n 64` at each budget of BUDGETS (default 32 GiB: every expert resident) with
# routing replayed from the balanced trace, once plain and once traced; then, when the peer is there, llama-bench
# -ngl 99 -ncmoe 0 -p 0 -n 64 traced the same way. bench/profile/timeline.py summarises each trace.
#
#   OUT=dir [BUDGETS="32"] [TRACE=traces/topo-b-test.pstrace] [PEER_WAIT=s] [OPS_TEST=op,op] [OPS_PERF=0|1] \
#       bash scripts/device/profile_decode.sh
#
# OPS_TEST: the ops whose CUDA-against-CPU tests run first (test-backend-ops test -o; default the products).
# OPS_PERF=0 leaves out the op timings (test-backend-ops perf, about 30 s).
# GPU_TESTS='gtest filter' also builds test-gpu and runs those tests first (e.g. 'GpuOffload.*': the decode paths,
# graphs among them; needs tests/data in the tree, so the peer's binaries will not fit beside it: PEER_WAIT=0).
#
# The peer: common.sh's setup_peer (carried binaries, else .carry/peer/build.sh in the background with
# PEER_PACK=$OUT/peer-bin, so the binaries come back to be carried next time). Carry .carry/debs, .carry/whl-gguf
# (WHL_DIR) and .carry/peer or .carry/peer-bin.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/profile-out}
BUDGETS=${BUDGETS:-32}
TRACE=${TRACE:-traces/topo-b-test.pstrace}
PEER_WAIT=${PEER_WAIT:-420}
OPS_TEST=${OPS_TEST:-matmul,matmul_parts,expert_matmul,moe_ffn}
MODEL=/tmp/prescope-qwen3-30b-a3b-q8_0.gguf
THREADS=$(nproc)
mkdir -p "$OUT"
: > "$OUT/summary.txt"
say() { echo "[profile_decode] $*" | tee -a "$OUT/summary.txt"; }
T0=$SECONDS
source scripts/device/common.sh
setup_carried_debs .carry/debs

setup_carried_wheels "${WHL_DIR:-.carry/whl}"
export PEER_PACK=$OUT/peer-bin PEER_JOBS=$(nproc)
setup_peer  # first: the peer's build is the longest part of a call on a fresh machine
write_bench_model "$MODEL" "$OUT/model.log" --shape qwen3-30b-a3b &
MODEL_PID=$!
build_prescope build-gpu prescope-cli test-backend-ops prescope-cupti-trace ${GPU_TESTS:+test-gpu} || exit 1
say "built ($((SECONDS - T0)) s)"
if [ -n "${GPU_TESTS:-}" ]; then
    run_bin timeout 300 build-gpu/bin/test-gpu --gtest_filter="$GPU_TESTS" > "$OUT/test-gpu.log" 2>&1
    say "test-gpu ($GPU_TESTS): exit $?, $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/test-gpu.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$OUT/test-gpu.log" | head -10 | tee -a "$OUT/summary.txt"
fi

traced() {  # traced NAME cmd...: runs cmd under the tracer, summarises into $OUT/NAME-timeline.{txt,json}
    local name=$1
    shift
    run_traced "/tmp/$name.csv" "$@"
    local rc=$?
    python3 bench/profile/timeline.py /tmp/$name.csv --json "$OUT/$name-timeline.json" > "$OUT/$name-timeline.txt" 2>&1
    say "$name: exit $rc; $(head -1 "$OUT/$name-timeline.txt")"
    gzip -c /tmp/$name.csv > "$OUT/$name.csv.gz"
}

# The op tests of the products first (CUDA against the CPU): a timeline of wrong kernels is worth nothing.
run_bin env PRESCOPE_SYNC_DEBUG=1 timeout 200 build-gpu/bin/test-backend-ops test -o "$OPS_TEST" > "$OUT/ops-test.log" 2>&1
say "op tests ($OPS_TEST): exit $?, $(tail -1 "$OUT/ops-test.log")"
if [ "${OPS_PERF:-1}" = 1 ]; then
    run_bin timeout 200 build-gpu/bin/test-backend-ops perf --json "$OUT/ops-perf.jsonl" > "$OUT/ops-perf.log" 2>&1
    say "op perf: exit $?, $(grep -c . "$OUT/ops-perf.jsonl" 2> /dev/null || echo 0) rows ($((SECONDS - T0)) s)"
fi

wait $MODEL_PID
[ -f "$MODEL" ] || { say "FAIL: no model (model.log)"; exit 1; }
say "model ready ($((SECONDS - T0)) s)"
for b in $BUDGETS; do
    args=(bench -m "$MODEL" -t "$THREADS" -p 16 -n 64 -r 1 -o json --gpu-expert-budget "${b}GiB"
          --routing-trace "$TRACE" --predictor recency)
    run_bin timeout 120 build-gpu/bin/prescope "${args[@]}" > "$OUT/prescope-$b.jsonl" 2> "$OUT/prescope-$b.log"
    say "prescope ${b}GiB plain: exit $?; $(python3 bench/offload/report.py --brief "$OUT/prescope-$b.jsonl")"
    traced "prescope-$b" timeout 180 build-gpu/bin/prescope "${args[@]}" > "$OUT/prescope-$b-traced.jsonl" \
        2> "$OUT/prescope-$b-traced.log"
done

# The binary appears before its link ends: wait for the whole build (and its packing).
while [ $((SECONDS - T0)) -lt "$PEER_WAIT" ] && pgrep -f peer/build.sh > /dev/null; do sleep 5; done
if [ -x "$PEER_BIN/llama-bench" ]; then
    timeout 120 "$PEER_BIN/llama-bench" -m "$MODEL" -ngl 99 -ncmoe 0 -t "$THREADS" -p 0 -n 64 -r 1 -o jsonl \
        > "$OUT/llama-0.jsonl" 2> "$OUT/llama-0.log"
    say "llama-bench -ncmoe 0 plain: exit $?; $(grep -o '"avg_ts": *[0-9.]*' "$OUT/llama-0.jsonl")"
    traced llama-0 timeout 120 "$PEER_BIN/llama-bench" -m "$MODEL" -ngl 99 -ncmoe 0 -t "$THREADS" -p 0 -n 64 -r 1 \
        -o jsonl > "$OUT/llama-0-traced.jsonl" 2> "$OUT/llama-0-traced.log"
else
    say "peer not ready after $((SECONDS - T0)) s (peer-build.log)"
fi
pgrep -f peer/build.sh > /dev/null && say "peer build still running: its binaries will not come back"
say "done in $((SECONDS - T0)) s"
# Few files come back from a call: everything but the summary and the peer's binaries goes into one archive.
# (Written outside $OUT and moved in: tar of a folder that grows under it exits 1, "file changed as we read it".)
(cd "$OUT" && tar czf /tmp/profile.tgz --exclude=summary.txt --exclude=peer-bin . && mv /tmp/profile.tgz . &&
    find . -mindepth 1 -maxdepth 1 ! -name profile.tgz ! -name summary.txt ! -name peer-bin -exec rm -rf {} +)
