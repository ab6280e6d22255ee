#!/usr/bin/env bash
# The one command for the GPU machine: builds PreScope with CUDA, runs the CUDA op tests against the CPU
# (test-backend-ops test) and times them (perf), and writes every log under $OUT (default ./gpu-out).
#
#   scripts/device/gpu_tests.sh [--no-perf] [--memcheck] [--full-build]
#     --no-perf     skip the timings
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
RUN_LIBS=""
JOBS=$(nproc)
PERF=1 MEMCHECK=0 FULL=0
for a in "$@"; do
    case $a in
    --no-perf) PERF=0 ;;
    --memcheck) MEMCHECK=1 ;;
    --full-build) FULL=1 ;;
    *) echo "usage: $0 [--no-perf] [--memcheck] [--full-build]" >&2; exit 2 ;;
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

# --- carried Debian packages -------------------------------------------------------------------
if compgen -G "$DEB_DIR/*.deb" > /dev/null; then
    ROOT=/tmp/prescope-debroot
    mkdir -p "$ROOT"
    for f in "$DEB_DIR"/*.deb; do dpkg-deb -x "$f" "$ROOT" || dpkg -x "$f" "$ROOT"; done
    LIBDIR=$ROOT/usr/lib/x86_64-linux-gnu
    # pkg-config files say prefix=/usr: point them at the unpacked tree.
    find "$ROOT" -name '*.pc' -exec sed -i "s|^prefix=/usr\$|prefix=$ROOT/usr|" {} +
    # A -dev package's libfoo.so links to its runtime package's libfoo.so.N; when that package was not
    # carried, use the machine's own copy of the same soname.
    for l in "$LIBDIR"/*.so; do
        if [ ! -L "$l" ] || [ -e "$l" ]; then continue; fi
        target=$(readlink "$l")
        soname=$(basename "$target" | sed -E 's/^(lib[^.]+\.so\.[0-9]+).*/\1/')
        sys=$(ls /usr/lib/x86_64-linux-gnu/"$soname"* 2>/dev/null | head -1)
        [ -n "$sys" ] && ln -sf "$sys" "$l"
    done
    export PKG_CONFIG_PATH=$LIBDIR/pkgconfig:$ROOT/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    export CMAKE_PREFIX_PATH=$ROOT/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
    export CPATH=$ROOT/usr/include${CPATH:+:$CPATH}
    export LIBRARY_PATH=$LIBDIR${LIBRARY_PATH:+:$LIBRARY_PATH}
    # Only our binaries load the carried runtime libraries; the machine's tools keep their own.
    RUN_LIBS=$LIBDIR
    say "unpacked $(ls "$DEB_DIR"/*.deb | wc -l) carried packages from $DEB_DIR into $ROOT"
fi

# --- dependencies the CMake configuration requires ---------------------------------------------
missing=()
need_header() {  # header, Debian package, extra preprocessor flags
    echo "#include <$1>" | g++ -std=c++20 -E -x c++ ${3:+"$3"} - > /dev/null 2>&1 || missing+=("$2 (no <$1>)")
}
need_header CLI/CLI.hpp libcli11-dev
need_header nlohmann/json.hpp nlohmann-json3-dev
need_header yaml-cpp/yaml.h libyaml-cpp-dev
need_header spdlog/spdlog.h libspdlog-dev
need_header fmt/format.h libfmt-dev
need_header gtest/gtest.h libgtest-dev
need_header benchmark/benchmark.h libbenchmark-dev
need_header cblas.h libopenblas-dev
need_header pcre2.h libpcre2-dev -DPCRE2_CODE_UNIT_WIDTH=8
need_header zstd.h libzstd-dev
need_header utf8proc.h libutf8proc-dev
for m in libpcre2-8:libpcre2-dev libzstd:libzstd-dev libutf8proc:libutf8proc-dev; do
    pkg-config --exists "${m%%:*}" 2> /dev/null || missing+=("${m##*:} (pkg-config: no ${m%%:*}.pc)")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "missing on this machine: ${missing[*]}"
    say "fix: on the dev machine, mkdir -p .carry/debs && cd .carry/debs && apt-get download <the packages above"
    say "     and their runtime libraries, e.g. libpcre2-8-0 libzstd1 libutf8proc2>; carry .carry; run again"
fi

# --- configure and build the op tests ----------------------------------------------------------
if ! timeout 300 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPRESCOPE_CUDA=ON \
        -DPRESCOPE_CUDA_ARCHS=90 > "$OUT/configure.log" 2>&1; then
    say "FAIL configure (see configure.log):"
    grep -E -A3 "CMake Error|No package|Could NOT find|Could not find" "$OUT/configure.log" | head -20 |
        tee -a "$OUT/summary.txt"
    exit 1
fi
say "configured $BUILD ($((SECONDS - T0)) s)"
if ! timeout 600 ninja -C "$BUILD" -j"$JOBS" test-backend-ops > "$OUT/build-ops.log" 2>&1; then
    say "FAIL build of test-backend-ops (see build-ops.log):"
    grep -E "error|FAILED" "$OUT/build-ops.log" | head -20 | tee -a "$OUT/summary.txt"
    exit 1
fi
say "built test-backend-ops ($((SECONDS - T0)) s)"
BIN=$BUILD/bin/test-backend-ops
run_bin() {
    if [ -n "$RUN_LIBS" ]; then LD_LIBRARY_PATH=$RUN_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$@"; else "$@"; fi
}

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
    run_bin timeout 300 "$BIN" perf --json "$OUT/ops-perf.jsonl" > "$OUT/ops-perf.log" 2>&1
    prc=$?
    say "op perf: exit $prc, $(grep -c . "$OUT/ops-perf.jsonl" 2> /dev/null || echo 0) rows ($((SECONDS - T0)) s)"
fi

if [ $FULL -eq 1 ]; then
    timeout 900 ninja -C "$BUILD" -j"$JOBS" > "$OUT/build-all.log" 2>&1
    say "full build: exit $? (see build-all.log) ($((SECONDS - T0)) s)"
fi
exit $rc
