#!/usr/bin/env bash
# Fresh Debian 12 -> running PreScope: installs the dependencies (apt + a Python venv for the offline
# tools), builds (with CUDA when nvcc is on PATH), then generates text with the bundled demo model.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
    build-essential cmake ninja-build pkg-config git ca-certificates \
    libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev libyaml-cpp-dev \
    libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libpcre2-dev libzstd-dev \
    libnuma-dev libcpp-httplib-dev libglpk-dev libutf8proc-dev \
    clang libclang-rt-14-dev libomp-dev \
    python3 python3-venv python3-pip

if [ ! -x .venv/bin/python3 ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements.txt

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
ninja -C build

build/bin/prescope generate -m models/demo/demo-q8_0.gguf \
    -p "The Debian project is" -n 64 --temp 0
