#!/usr/bin/env bash
# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer (GCC, CPU build) in build-asan: the
# unit, cli and model labels of scripts/test.sh. Any report (memory error, leak, undefined behaviour) fails
# the test that met it. Extra arguments go to ctest (e.g. -R Tokenizer).
set -euo pipefail
cd "$(dirname "$0")/.."

B=build-asan
if [ ! -f "$B/build.ninja" ]; then
    cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1" \
        -DPRESCOPE_CUDA=OFF -DPRESCOPE_BUILD_BENCH=OFF \
        -DPRESCOPE_SANITIZE_ADDRESS=ON -DPRESCOPE_SANITIZE_UNDEFINED=ON > /dev/null
fi
ninja -C "$B" -j"$(nproc)"
export OMP_WAIT_POLICY=PASSIVE
export ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir "$B" --output-on-failure -j"$(nproc)" -L 'unit|cli|model' "$@"
