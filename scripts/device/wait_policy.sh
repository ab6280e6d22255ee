#!/usr/bin/env bash
# OpenMP waiting policies on a many-core machine (decision 0102): prefill and decode of the demo model with
# passive waiting (the CLI's default), libgomp's own default (GOMP_SPINCOUNT=300000) and active waiting, on an
# idle machine and beside one busy loop per CPU. Usage: scripts/device/wait_policy.sh [PRESCOPE] [OUT_DIR]
# (PRESCOPE defaults to build/bin/prescope; a carried binary needs its libraries on LD_LIBRARY_PATH).
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="${1:-build/bin/prescope}"
out="${2:-${OUT:-/tmp}}"
model=models/demo/demo-q8_0.gguf
n=$(nproc)
"$bin" --version
run() {  # label, bench sizes, environment...; a run that collapses is cut at 90 s and recorded as such
    local label="$1" sizes="$2"; shift 2
    for t in "$n" 1; do
        if ! timeout 90 env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT "$@" "$bin" bench -m "$model" $sizes -t "$t" -o json \
            | sed "s/^{/{\"setting\": \"$label\", /" >> "$out/wait_policy.jsonl"; then
            echo "{\"setting\": \"$label\", \"threads\": $t, \"timed_out_s\": 90}" >> "$out/wait_policy.jsonl"
        fi
    done
}
: > "$out/wait_policy.jsonl"
for load in idle busy; do
    pids=()
    if [ "$load" = busy ]; then
        for _ in $(seq "$n"); do (while :; do :; done) & pids+=($!); done
    fi
    sizes="-p 256 -n 64 -r 3"
    if [ "$load" = busy ]; then sizes="-p 64 -n 16 -r 1"; fi
    run "passive/$load" "$sizes"
    run "spin300k/$load" "$sizes" GOMP_SPINCOUNT=300000
    run "active/$load" "$sizes" OMP_WAIT_POLICY=ACTIVE
    for p in "${pids[@]}"; do kill "$p"; done
    wait 2>/dev/null || true
done
cat "$out/wait_policy.jsonl"
