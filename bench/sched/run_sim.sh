#!/usr/bin/env bash
# Simulated comparison of the cost-model scheduler against the threshold rule (offload/simulator.h), and the
# ILP check of the scheduler on the layer states those runs dump. CPU only; every number is simulated from the
# cost profile (default: the built-in H200 reference), none is measured.
#   bench/sched/run_sim.sh [TRACE ...]      (default: the balanced traces/topo-b-test.pstrace, topo-mixtral-test.pstrace)
# A 128-expert trace runs on the Qwen3-30B-A3B expert shape, an 8-expert one on the Mixtral-8x7B shape; without an
# 8-expert trace among the arguments, the first kind is also folded to 32 layers, 8 experts, top-2
# (tools/data/fold_trace.py). The main runs have the load balancer off (--load-balance off: the profile as it is, the link free);
# the balancer runs turn it on.
# Environment: OUT (default bench/results), PRESCOPE (default build/bin/prescope), PROFILE (a cost profile),
# ROUTING (label of the traces' routing, default "balanced"), CHECK_EVERY (schedule-check takes every n-th state).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results}
PRESCOPE=${PRESCOPE:-build/bin/prescope}
PY=${PY:-.venv/bin/python3}
ROUTING=${ROUTING:-balanced}
CHECK_EVERY=${CHECK_EVERY:-1}
TRACES=("$@")
[ ${#TRACES[@]} -gt 0 ] || TRACES=(traces/topo-b-test.pstrace traces/topo-mixtral-test.pstrace)
PROFILE_ARGS=()
[ -n "${PROFILE:-}" ] && PROFILE_ARGS=(--profile "$PROFILE")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"
rows=$OUT/sched-sim.jsonl
: > "$rows"
states=()
n_expert_of() { $PY -c "import sys; sys.path.insert(0, 'tools/data'); import pstrace; print(pstrace.read_trace('$1').n_expert)"; }
HAVE_MIXTRAL_TRACE=0
for trace in "${TRACES[@]}"; do [ "$(n_expert_of "$trace")" -le 8 ] && HAVE_MIXTRAL_TRACE=1; done
for trace in "${TRACES[@]}"; do
    name=$(basename "$trace" .pstrace)
    n_expert=$(n_expert_of "$trace")
    if [ "$n_expert" -le 8 ]; then
        runs=("$trace|mixtral-8x7b|12GiB 24GiB 36GiB")
    else
        runs=("$trace|qwen3-30b-a3b|4GiB 8GiB 12GiB 24GiB")
        # No Mixtral-shaped trace among the arguments: fold this one onto the Mixtral shape.
        if [ "$HAVE_MIXTRAL_TRACE" = 0 ]; then
            $PY tools/data/fold_trace.py "$trace" "$TMP/$name-mixtral.pstrace" --n-expert 8 --top-k 2 --n-layer 32 >&2
            runs+=("$TMP/$name-mixtral.pstrace|mixtral-8x7b|12GiB 24GiB 36GiB")
        fi
    fi
    for run in "${runs[@]}"; do
        IFS='|' read -r t shape budgets <<< "$run"
        for b in $budgets; do
            for rule in 0 2 auto; do
                dump=()
                if [ "$rule" = auto ] && [ "$b" != 8GiB ] && [ "$b" != 36GiB ]; then
                    st=$TMP/states-$name-$shape-$b.jsonl
                    dump=(--dump-layer-states "$st")
                    states+=("$st")
                fi
                "$PRESCOPE" simulate --trace "$t" --shape "$shape" --budget "$b" --cpu-threshold "$rule" \
                    --predictor recency --prefetch-window 1 -p 512 -n 128 --load-balance off "${PROFILE_ARGS[@]}" "${dump[@]}" \
                    --label "$ROUTING ($name)" 2>/dev/null >> "$rows"
            done
        done
        # The load balancer: the simulated machine's CPU 1.5x slower and its link 1.25x slower than the profile,
        # or its CPU 0.6x (faster), with and without online corrections (Qwen3 shape at 4 GiB: many misses per
        # layer, so the split between the CPU and the link can move).
        if [ "$shape" = qwen3-30b-a3b ]; then
            for truth in cpu=1.5,link=1.25 cpu=0.6; do
                for bal in on link off; do
                    "$PRESCOPE" simulate --trace "$t" --shape "$shape" --budget 4GiB --predictor recency -p 512 -n 128 \
                        --truth "$truth" --load-balance $bal "${PROFILE_ARGS[@]}" --label "$ROUTING ($name) truth $truth balance $bal" \
                        2>/dev/null >> "$rows"
                done
            done
        fi
    done
done
"$PRESCOPE" schedule-check "${states[@]}" --every "$CHECK_EVERY" --json "$OUT/sched-ilp-gap.json"
$PY bench/sched/report.py "$rows" "$OUT/sched-ilp-gap.json" > "$OUT/sched-sim.md"
echo "wrote $rows, $OUT/sched-ilp-gap.json, $OUT/sched-sim.md" >&2
