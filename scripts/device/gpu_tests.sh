#!/usr/bin/env bash
# The one command for the GPU machine: builds PreScope with CUDA, runs the CUDA op tests against the CPU
# (test-backend-ops test) and times them (perf), and writes every log under $OUT (default ./gpu-out).
#
#   scripts/device/gpu_tests.sh [--no-perf] [--perf-ops=OPS] [--memcheck] [--full-build]
#     --no-perf     skip the timings
#     --perf-ops=a,b  time only these ops (test-backend-ops -o)
#     --memcheck    also run the op tests under compute-sanitizer memcheck (adds about 2 minutes)
#     --full-build  also build every target with CUDA on (compile check of the whole tree)
#
# Missing -dev packages on that machine (no network there): download them here with
#   mkdir -p .carry/debs && (cd .carry/debs && apt-get download <packages>)
# and name .carry in the run's carry list; the script unpacks .carry/debs/*.deb (or $PRESCOPE_DEB_DIR)
# into /tmp/prescope-debroot and points the compiler, pkg-config and CMake at it.
# Read first: $OUT/summary.txt, then $OUT/ops-test.log (one row per case, FAIL rows and the last line)
# and $OUT/ops-perf.log (us, GB/s, share of the H200's 4.3 TB/s).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

OUT=${OUT:-$PWD/gpu-out}
BUILD=${PRESCOPE_GPU_BUILD:-build-gpu}
DEB_DIR=${PRESCOPE_DEB_DIR:-.carry/debs}
JOBS=$(nproc)
PERF=1 MEMCHECK=0 FULL=0 PERF_OPS=()
for a in "$@"; do
    case $a in
    --no-perf) PERF=0 ;;
    --perf-ops=*) PERF_OPS=(-o "${a#--perf-ops=}") ;;
    --memcheck) MEMCHECK=1 ;;
    --full-build) FULL=1 ;;
    *) echo "usage: $0 [--no-perf] [--perf-ops=OPS] [--memcheck] [--full-build]" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
: > "$OUT/summary.txt"
say() { echo "[gpu_tests] $*" | tee -a "$OUT/summary.txt"; }
T0=$SECONDS

# --- the machine -------------------------------------------------------------------------------
{
    nvidia-smi || true
    nvcc --version || true
    cmake --version || true
    echo "ninja $(ninja --version 2>/dev/null)"
    g++ --version | head -1 || true
    grep PRETTY_NAME /etc/os-release || true
} > "$OUT/env.txt" 2>&1
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
say "nvcc: $(nvcc --version 2>/dev/null | tail -1), cmake: $(cmake --version 2>/dev/null | head -1), $JOBS cores"

source scripts/device/common.sh
setup_carried_debs "$DEB_DIR"
check_deps
build_prescope "$BUILD" test-backend-ops || exit 1
say "built test-backend-ops ($((SECONDS - T0)) s)"
BIN=$BUILD/bin/test-backend-ops

# --- op tests: CUDA against the CPU ------------------------------------------------------------
# PRESCOPE_SYNC_DEBUG=1: each launcher synchronizes, so a fault names the op that caused it.
run_bin env PRESCOPE_SYNC_DEBUG=1 timeout 300 "$BIN" test > "$OUT/ops-test.log" 2>&1
rc=$?
say "op tests: exit $rc, $(tail -1 "$OUT/ops-test.log") ($((SECONDS - T0)) s)"
grep -E " FAIL$" "$OUT/ops-test.log" | head -40 | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || tail -5 "$OUT/ops-test.log" | tee -a "$OUT/summary.txt"

if [ $MEMCHECK -eq 1 ]; then
    run_bin timeout 240 compute-sanitizer --tool memcheck --print-limit 20 "$BIN" test \
        > "$OUT/ops-memcheck.log" 2>&1
    say "memcheck: exit $?, $(grep -E 'ERROR SUMMARY' "$OUT/ops-memcheck.log" | tail -1) ($((SECONDS - T0)) s)"
fi

# --- timings -----------------------------------------------------------------------------------
if [ $PERF -eq 1 ]; then
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/clocks.txt" 2>&1
    run_bin timeout 300 "$BIN" perf "${PERF_OPS[@]}" --json "$OUT/ops-perf.jsonl" > "$OUT/ops-perf.log" 2>&1
    prc=$?
    say "op perf: exit $prc, $(grep -c . "$OUT/ops-perf.jsonl" 2> /dev/null || echo 0) rows ($((SECONDS - T0)) s)"
fi

if [ $FULL -eq 1 ]; then
    timeout 900 ninja -C "$BUILD" -j"$JOBS" > "$OUT/build-all.log" 2>&1
    say "full build: exit $? (see build-all.log) ($((SECONDS - T0)) s)"
fi
exit $rc
