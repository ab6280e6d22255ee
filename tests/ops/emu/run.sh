#!/usr/bin/env bash
# Builds test-backend-ops against the CPU emulation of CUDA (cuda-emu.h) and runs it: checks the CUDA
# kernels' logic (index math, barriers, shuffles, cuBLAS call conventions) against the CPU ops on a
# machine without a GPU. Slow (seconds per small op, about an hour for the whole list): pass -o.
#   tests/ops/emu/run.sh [test-backend-ops arguments]     e.g. tests/ops/emu/run.sh test -o attention,rope
# Needs libprescope.a of a build of this tree ($PRESCOPE_BUILD, default build/); writes build-emu/.
set -euo pipefail
cd "$(dirname "$0")/../../.."
SRC=$PWD
EMU=$SRC/tests/ops/emu
OUT=${PRESCOPE_EMU_BUILD:-build-emu}
LIB=${PRESCOPE_BUILD:-build}/src/libprescope.a
if [ ! -f "$LIB" ]; then
    echo "error: $LIB not found; build the tree first (ninja -C ${PRESCOPE_BUILD:-build})" >&2
    exit 1
fi
mkdir -p "$OUT/gen"
CXX=(g++ -std=c++20 -O1 -g -fopenmp -Wall -Wno-unknown-pragmas -Wno-unused-parameter -I"$EMU/include" -I"$SRC/src"
     -include "$EMU/cuda-emu.h")
objs=()
# An object is rebuilt when its source or any header is newer (a changed struct in a header must not meet a stale
# object: the layouts would disagree).
NEWEST_HEADER=$(find src tests -name '*.h' -o -name '*.cuh' | xargs ls -t | head -1)
compile() {
    local obj
    obj=$OUT/gen/$(basename "$1").o
    if [ ! -f "$obj" ] || [ "$1" -nt "$obj" ] || [ "$NEWEST_HEADER" -nt "$obj" ]; then "${CXX[@]}" -c "$1" -o "$obj"; fi
    objs+=("$obj")
}
for f in src/backend/cuda/*.cu; do
    gen=$OUT/gen/$(basename "$f" .cu).cpp
    python3 "$EMU/prep_cuda.py" "$f" "$gen"
    compile "$gen"
done
for f in src/backend/cuda/common.cpp tests/ops/test-backend-ops.cpp "$EMU/cuda-emu.cpp"; do compile "$f"; done
g++ -fopenmp -o "$OUT/test-backend-ops-emu" "${objs[@]}" "$LIB" -lfmt -lspdlog -lopenblas -lpthread
exec "$OUT/test-backend-ops-emu" "$@"
