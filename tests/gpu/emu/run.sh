#!/usr/bin/env bash
# Builds the GPU offloading tests (tests/gpu/test-gpu-offload.cpp) against the CPU emulation of CUDA
# (tests/ops/emu/cuda-emu.h plus cuda-emu-runtime.h here) and runs them: the GPU runtime's buffers, pointers,
# launches and step arrays are exercised on a machine without a GPU. Synchronous, no timing: the device run
# stays the real test. Slow (emulated kernels): pick tests with a gtest filter.
#   tests/gpu/emu/run.sh [gtest arguments]    e.g. tests/gpu/emu/run.sh --gtest_filter='GpuOffload.*'
# Needs libprescope.a of a CPU build of this tree ($PRESCOPE_BUILD, default build/); writes build-gpu-emu/.
# spdlog and fmt are used as the library build uses them (compiled spdlog, external fmt), one logger for all.
set -euo pipefail
cd "$(dirname "$0")/../../.."
SRC=$PWD
EMU=$SRC/tests/ops/emu
HERE=$SRC/tests/gpu/emu
OUT=${PRESCOPE_GPU_EMU_BUILD:-build-gpu-emu}
LIB=${PRESCOPE_BUILD:-build}/src/libprescope.a
CUDA_INC=${CUDA_INC:-/usr/local/cuda/include}  # for nvtx3 only; the emulation's headers come first
if [ ! -f "$LIB" ]; then
    echo "error: $LIB not found; build the tree first (ninja -C ${PRESCOPE_BUILD:-build})" >&2
    exit 1
fi
mkdir -p "$OUT/gen"
CXX=(g++ -std=c++20 -O1 -g -fopenmp -Wall -Wno-unknown-pragmas -Wno-unused-parameter -I"$EMU/include" -I"$SRC/src"
     -isystem "$CUDA_INC" -include "$EMU/cuda-emu.h" -include "$HERE/cuda-emu-runtime.h" -DPRESCOPE_USE_CUDA
     -DPRESCOPE_SOURCE_DIR="\"$SRC\"" -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL -DSPDLOG_SHARED_LIB -DFMT_SHARED)
objs=()
# An object is rebuilt when its source or any header is newer (a changed struct in a header must not meet a stale
# object: the layouts would disagree).
NEWEST_HEADER=$(find src tests -name '*.h' -o -name '*.cuh' | xargs ls -t | head -1)
compile() {
    local obj
    obj=$OUT/gen/$(basename "$1").o
    if [ ! -f "$obj" ] || [ "$1" -nt "$obj" ] || [ "$NEWEST_HEADER" -nt "$obj" ]; then
        "${CXX[@]}" -c "$1" -o "$obj"
    fi
    objs+=("$obj")
}
for f in src/backend/cuda/*.cu; do
    gen=$OUT/gen/$(basename "$f" .cu).cpp
    python3 "$EMU/prep_cuda.py" "$f" "$gen"
    compile "$gen"
done
# gpu-calibrate.cpp is left out: the CPU library already holds calibrate_gpu's "no CUDA" stand-in, and the
# tests do not calibrate (the emulation has no meaningful timings). nccl-all-to-all.cpp too: NCCL is not emulated
# and these tests do not use it (tests/gpu/test-nccl-all-to-all.cpp runs on the GPU machine).
for f in $(ls src/backend/cuda/*.cpp | grep -v nccl-) $(ls src/runtime/gpu-*.cpp | grep -v gpu-calibrate) \
    src/runtime/engine.cpp \
    tests/gpu/test-gpu-offload.cpp "$EMU/cuda-emu.cpp" "$HERE/cuda-emu-runtime.cpp"; do
    compile "$f"
done
g++ -fopenmp -o "$OUT/test-gpu-emu" "${objs[@]}" "$LIB" -lgtest -lfmt -lspdlog -lyaml-cpp -lopenblas -lzstd \
    -lpcre2-8 -lutf8proc -lglpk -lnuma -ldl -lpthread
exec "$OUT/test-gpu-emu" "$@"
