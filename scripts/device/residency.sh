#!/usr/bin/env bash
# Issue 14 in one device call: the GPU suite (gpu_tests.sh --no-perf, offload_tests.sh), the Qwen3-30B-A3B-shaped
# benchmark at BUDGETS against llama.cpp (bench_offload.sh: 32 GiB holds every expert, matched with -ngl 99
# -ncmoe 0), then an A/B of FLAG (default --device-steps) at the values AB_VALUES (default "on off") and the budget
# AB_BUDGET GiB (default 32), alternating, ROUNDS rounds of `prescope bench -p 16 -n 128 -r 1` with the balanced
# trace replayed. $OUT gets summary.txt, ab.txt and one tarball per part (the device returns at most 8 files).
#
#   OUT=dir [BUDGETS="32 12"] [FLAG=--device-steps] [AB_VALUES="on off"] [AB_BUDGET=32] [ROUNDS=2] [TESTS=1] \
#       [BENCH=1] WHL_DIR=.carry/whl-gguf bash scripts/device/residency.sh
#
# Decisions 0146 and 0147 after the sweep: FLAG=--link-price AB_VALUES="on off" AB_BUDGET=4 (and 12), then
# FLAG=--load-balance AB_VALUES="link off".
#
# TESTS=0 or BENCH=0 leave out a part (the model is written either way; a warm machine keeps it and the build for
# the next call). Carry .carry/debs, WHL_DIR and, for the benchmark, .carry/peer-bin (common.sh's setup_peer);
# slim the tree first (scripts/device/slim-tree.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?OUT=dir}
BUDGETS=${BUDGETS:-32 12}
FLAG=${FLAG:---device-steps}
AB_VALUES=${AB_VALUES:-on off}
AB_BUDGET=${AB_BUDGET:-32}
ROUNDS=${ROUNDS:-2}
TRACE=traces/topo-b-test.pstrace
MODEL=/tmp/prescope-qwen3-30b-a3b-q8_0.gguf
mkdir -p "$OUT"
: > "$OUT/summary.txt"
say() { echo "[residency] $*" | tee -a "$OUT/summary.txt"; }
finish() {  # one tarball per part that ran
    say "done in $((SECONDS - T0)) s"
    for d in "${parts[@]}"; do tar czf "$OUT/$d.tar.gz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
    exit 0
}
T0=$SECONDS
source scripts/device/common.sh
setup_carried_debs .carry/debs
setup_carried_wheels "${WHL_DIR:-.carry/whl}"
export WHL_DIR=${WHL_DIR:-.carry/whl}
# The model is written while the tests run (CPU work beside GPU work).
write_bench_model "$MODEL" /tmp/residency-model.log --shape qwen3-30b-a3b &
MODEL_PID=$!
parts=()
if [ "${TESTS:-1}" = 1 ]; then
    OUT=$OUT/ops bash scripts/device/gpu_tests.sh --no-perf > /dev/null 2>&1
    say "gpu_tests: exit $?; $(tail -2 "$OUT/ops/summary.txt" 2> /dev/null | tr '\n' ' ')"
    OUT=$OUT/off bash scripts/device/offload_tests.sh > /dev/null 2>&1
    say "offload_tests: exit $?; $(tail -2 "$OUT/off/summary.txt" 2> /dev/null | tr '\n' ' ')"
    parts+=(ops off)
fi
wait $MODEL_PID
say "model ready ($((SECONDS - T0)) s)"
[ "${BENCH:-1}" = 1 ] || finish
BUDGETS=$BUDGETS OUT=$OUT/offload bash scripts/device/bench_offload.sh > /dev/null 2>&1
cat "$OUT/offload/summary.txt" >> "$OUT/summary.txt"
parts+=(offload)

mkdir -p "$OUT/ab"
THREADS=$(nproc)
for r in $(seq "$ROUNDS"); do
    for v in $AB_VALUES; do
        run_bin timeout 120 build-gpu/bin/prescope bench -m "$MODEL" -t "$THREADS" -p 16 -n 128 -r 1 -o json \
            --gpu-expert-budget "${AB_BUDGET}GiB" --routing-trace "$TRACE" --predictor recency "$FLAG" "$v" \
            > "$OUT/ab/$r-$v.jsonl" 2> "$OUT/ab/$r-$v.log"
        echo "round $r $FLAG $v: exit $?; $(python3 bench/offload/report.py --brief "$OUT/ab/$r-$v.jsonl")" \
            | tee -a "$OUT/ab.txt"
    done
done
parts+=(ab)
finish
