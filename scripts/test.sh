#!/usr/bin/env bash
# Runs every test: builds if needed, then the C++ suites (ctest: unit, model, cli labels) and the
# Python tool tests (pytest). Needs scripts/setup.sh to have run once (dependencies, .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f build/build.ninja ]; then cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release; fi
ninja -C build
# Test binaries run side by side: sleeping OpenMP workers keep them from starving each other.
export OMP_WAIT_POLICY=PASSIVE
ctest --test-dir build --output-on-failure -j"$(nproc)"
.venv/bin/python3 -m pytest -q tests/py
