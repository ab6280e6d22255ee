#!/usr/bin/env bash
# Issue 12's routing trace, ONE call on the H200 (about 7 minutes): trains topo-v2lite (DeepSeek-V2-Lite's routing
# topology: 26 MoE layers x 64 experts, top-6, softmax without renormalisation, as a tiny Qwen3-MoE; decision 0135)
# with the per-layer balance loss of topo-b (decision 0090) and writes what train_balanced.sh writes for topo-b:
# traces/topo-v2lite-{test,prompts}.pstrace, -config.json, -routers.safetensors and docs/data/train-topo-v2lite.json,
# packed into $OUT (results.tar.part-NN, summary.json, train-log.txt).
#
# Before the call, here:  python3 tools/data/build_corpus.py && python3 tools/data/prepare_carry.py --wheels
#                         scripts/device/slim-tree.sh hide tests/data models traces bench/results
# The call:               run(command="bash scripts/device/train_v2lite.sh", carry=[".carry/corpus",
#                             ".carry/trace_prompts.jsonl.xz", ".carry/manifest.json", ".whl"], timeout_s=600)
# After it, here:         scripts/device/slim-tree.sh restore
#                         python3 tools/train/install_outputs.py <files_at> \
#                             --summary-as docs/data/device-run-v2lite.json
# CPU dry run, here:      OUT=/tmp/smoke-v2lite bash scripts/device/train_v2lite.sh --smoke
#
# BUDGET_S (default 400) is the training job's whole budget from the script's start: about 30 s of set-up, the
# training up to 75 s before the end, then the traces (~45 s for 26 layers, after topo-b's 65 s for 48).
set -uo pipefail
cd "$(dirname "$0")/../.."
BUDGET_S=${BUDGET_S:-400} exec bash scripts/device/train_balanced.sh --models topo-v2lite "$@"
