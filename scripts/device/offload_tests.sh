#!/usr/bin/env bash
# The one command for the GPU machine, for the offloading runtime (issue 4): builds PreScope with CUDA, runs
# the GPU tests (label gpu: tests/gpu/test-gpu-offload.cpp, and test-nccl-all-to-all.cpp when NCCL is there) and
# an end-to-end generate on the GPU with its counters, next to the CPU run of the same prompt; every log goes
# under $OUT (default ./offload-out).
#
#   scripts/device/offload_tests.sh [--big]
#     --big   also write an 8-layer Qwen3-30B-A3B-shaped Q8_0 model (tools/py/make_bench_model.py, ~4 GB in
#             /tmp) and run `prescope bench` on it at two expert budgets (adds about 2 minutes)
#
# Missing -dev packages on that machine (no network there): download them here with
#   mkdir -p .carry/debs && (cd .carry/debs && apt-get download <packages>)
# and name .carry in the run's carry list; they are unpacked into /tmp/prescope-debroot.
# Read first: $OUT/summary.txt; then, in $OUT/offload-logs.tar.gz, test-gpu.log (gtest output) and
# generate-*.log (start-up facts, counters), bench-*.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$PWD/offload-out}
BUILD=${PRESCOPE_GPU_BUILD:-build-gpu}
DEB_DIR=${PRESCOPE_DEB_DIR:-.carry/debs}
BIG=0
for a in "$@"; do
    case $a in
    --big) BIG=1 ;;
    *) echo "usage: $0 [--big]" >&2; exit 2 ;;
    esac
done
LOG=$OUT/logs  # packed into $OUT/offload-logs.tar.gz at exit: few files come back from the device
mkdir -p "$LOG"
: > "$OUT/summary.txt"
trap 'tar czf "$OUT/offload-logs.tar.gz" -C "$OUT" logs && rm -rf "$LOG"' EXIT
say() { echo "[offload_tests] $*" | tee -a "$OUT/summary.txt"; }
T0=$SECONDS
RC=0

{
    nvidia-smi || true
    nvcc --version || true
    cmake --version | head -1 || true
    grep PRETTY_NAME /etc/os-release || true
    ulimit -l
} > "$LOG/env.txt" 2>&1
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
say "locked-memory limit (ulimit -l): $(ulimit -l) (page-locking the experts needs it large or unlimited)"

source scripts/device/common.sh
setup_carried_debs "$DEB_DIR"
check_deps
build_prescope "$BUILD" test-gpu prescope-cli || exit 1
say "built test-gpu and prescope ($((SECONDS - T0)) s)"
BIN=$BUILD/bin

# --- GPU tests -------------------------------------------------------------------------------------
run_bin timeout 240 "$BIN/test-gpu" --gtest_output=xml:"$LOG/test-gpu.xml" > "$LOG/test-gpu.log" 2>&1
rc=$?
say "test-gpu: exit $rc, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \]' "$LOG/test-gpu.log" | head -3 | tr '\n' ' ') ($((SECONDS - T0)) s)"
grep -E '^\[  FAILED  \]' "$LOG/test-gpu.log" | head -20 | tee -a "$OUT/summary.txt"
if [ $rc -eq 77 ]; then
    say "test-gpu skipped: $(head -1 "$LOG/test-gpu.log")"
    RC=1
elif [ $rc -ne 0 ]; then
    RC=1
    # Again with a sync after every launch, so an asynchronous fault names the kernel that caused it.
    run_bin env PRESCOPE_SYNC_DEBUG=1 timeout 180 "$BIN/test-gpu" --gtest_filter="$(grep -E '^\[  FAILED  \] [A-Za-z]' \
        "$LOG/test-gpu.log" | awk '{print $4}' | sort -u | paste -sd: -)" > "$LOG/test-gpu-syncdebug.log" 2>&1
    say "re-run of the failures with PRESCOPE_SYNC_DEBUG=1: exit $? (test-gpu-syncdebug.log)"
fi

# --- NCCL all-to-all (issue 16): NcclAllToAll against FakeAllToAll on one GPU and on every GPU here ---------
if timeout 300 ninja -C "$BUILD" test-nccl >> "$LOG/build.log" 2>&1; then
    run_bin timeout 120 "$BIN/test-nccl" > "$LOG/test-nccl.log" 2>&1
    rc=$?
    say "test-nccl: exit $rc, $(grep -E '^NCCL |^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \]' "$LOG/test-nccl.log" |
        tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$LOG/test-nccl.log" | head -10 | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || RC=1
else
    say "test-nccl not built: no NCCL found (configure.log: 'NCCL:'; pass NCCL_ROOT, see docs/expert-parallel.md)"
fi

# --- end-to-end: the same greedy prompt on the CPU and on the GPU -----------------------------------
MODEL=$(ls models/demo/*.gguf 2> /dev/null | head -1)
[ -n "$MODEL" ] || MODEL=tests/data/models/qwen3moe/tiny-q8_0.gguf
PROMPT="The history of the printing press begins"
gen() {  # name, extra flags...
    local name=$1
    shift
    run_bin timeout 120 "$BIN/prescope" generate -m "$MODEL" -p "$PROMPT" -n 64 --temp 0 -v "$@" \
        > "$LOG/generate-$name.txt" 2> "$LOG/generate-$name.log"
    local r=$?
    say "generate $name: exit $r; $(grep -E '^stats:' "$LOG/generate-$name.log" | cut -c1-150)"
    grep -E '^hit rate|^PCIe' "$LOG/generate-$name.log" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
    [ $r -eq 0 ] || { RC=1; tail -3 "$LOG/generate-$name.log" | tee -a "$OUT/summary.txt"; }
}
gen cpu
gen gpu-all --gpu-expert-budget 1GiB --predictor fate --prefetch-window 2
# A budget of a few slots per layer: demand loads, prefetches and evictions every step.
# The smallest budget the cache accepts is in its error message ("... (N bytes)"); take 1.5 times that.
MIN=$(run_bin "$BIN/prescope" generate -m "$MODEL" -p x -n 1 --gpu-expert-budget 1B 2>&1 | grep -oE '\(([0-9]+) bytes\)' |
    grep -oE '[0-9]+' | head -1)
SMALL=$(( ${MIN:-16777216} * 3 / 2 ))B
say "minimum expert budget of $MODEL: ${MIN:-?} bytes; small budget $SMALL"
gen gpu-small --gpu-expert-budget "$SMALL" --predictor fate --prefetch-window 2
gen gpu-small-cpu --gpu-expert-budget "$SMALL" --cpu-threshold 2 --predictor frequency
gen gpu-zero --gpu-expert-budget 0
for v in gpu-all gpu-small gpu-small-cpu gpu-zero; do
    if cmp -s "$LOG/generate-cpu.txt" "$LOG/generate-$v.txt"; then
        say "text $v = cpu: identical"
    else
        say "text $v = cpu: DIFFERENT (diff generate-cpu.txt generate-$v.txt)"
        RC=1
    fi
done
TRACE=$(ls traces/demo-test.pstrace 2> /dev/null | head -1)
if [ -n "$TRACE" ] && [[ $MODEL == models/demo/* ]]; then
    gen gpu-replay --gpu-expert-budget "$SMALL" --routing-trace "$TRACE" --predictor oracle --prefetch-window 2
    grep -E '^routing' "$LOG/generate-gpu-replay.log" | head -2 | sed 's/^/    /' | tee -a "$OUT/summary.txt"
fi
run_bin timeout 120 "$BIN/prescope" bench -m "$MODEL" -p 128 -n 64 -r 2 -o json --gpu-expert-budget "$SMALL" \
    > "$LOG/bench-small.jsonl" 2> "$LOG/bench-small.log"
say "bench (budget $SMALL): exit $?; $(python3 -c "
import json,sys
for l in open('$LOG/bench-small.jsonl'):
    j=json.loads(l); print(f\"{j['test']} {j['avg_ts']:.1f} tok/s hit {j.get('hit_rate',0):.3f} pcie {j.get('pcie_gb_s',0):.1f} GB/s\", end='; ')
" 2> /dev/null)"

# --- optional: a real shape -------------------------------------------------------------------------
if [ $BIG -eq 1 ]; then
    BIGM=/tmp/prescope-q30b-8l-q8_0.gguf
    write_bench_model "$BIGM" "$LOG/big-model.log" --layers 8
    for b in 1GiB 4GiB; do
        run_bin timeout 200 "$BIN/prescope" bench -m "$BIGM" -p 512 -n 64 -r 2 -o json --gpu-expert-budget $b \
            --predictor fate > "$LOG/bench-big-$b.jsonl" 2> "$LOG/bench-big-$b.log"
        say "bench 8-layer Qwen3-30B shape, budget $b: exit $?; $(python3 -c "
import json
for l in open('$LOG/bench-big-$b.jsonl'):
    j=json.loads(l); print(f\"{j['test']} {j['avg_ts']:.1f} tok/s hit {j.get('hit_rate',0):.3f} pcie {j.get('pcie_gb_s',0):.1f} GB/s {j.get('pcie_bytes_per_token',0)/2**20:.1f} MiB/tok\", end='; ')
" 2> /dev/null)"
    done
fi
say "done in $((SECONDS - T0)) s, exit $RC"
exit $RC
