#!/usr/bin/env bash
# Isolated kernel times on the GPU machine: builds test-backend-ops and the CUPTI tracer
# (bench/profile/cupti-trace.cpp), runs `test-backend-ops perf -o OPS` under the tracer and writes, per kernel
# name, the average and least duration (us) and the launch count to $OUT/kernel-times.txt (the CSV as
# kernel-times.csv.gz). A kernel's least duration is its time without queueing behind another; the op's
# perf cases (tests/ops/test-backend-ops.cpp, perf list) say which shapes ran.
#
#   OUT=dir OPS=router_topk,rms_norm [VARS=regex] bash scripts/device/kernel_times.sh
#
# VARS: only the perf cases whose parameters the regex finds (test-backend-ops -p), e.g. 'n_tok=1,|n_rows=1,'.
# Carry .carry/debs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/kernel-times-out}
OPS=${OPS:?OPS=op,op: the test-backend-ops ops to time}
mkdir -p "$OUT"
say() { echo "[kernel_times] $*" | tee -a "$OUT/summary.txt"; }
source scripts/device/common.sh
setup_carried_debs .carry/debs
build_prescope build-gpu test-backend-ops prescope-cupti-trace || exit 1
run_traced /tmp/kernel-times.csv timeout 300 build-gpu/bin/test-backend-ops perf -o "$OPS" ${VARS:+-p "$VARS"} \
    > "$OUT/perf.log" 2>&1
say "test-backend-ops perf -o $OPS ${VARS:+-p '$VARS' }under the tracer: exit $?"
# K,start,end,stream,0,0,"name": duration per name (ns -> us)
awk -F, '$1 == "K" { n = $0; sub(/^[^"]*"/, "", n); sub(/"$/, "", n); sub(/\(.*/, "", n); d = ($3 - $2) / 1000;
                     s[n] += d; c[n]++; if (!(n in m) || d < m[n]) m[n] = d }
         END { for (n in s) printf "%9.2f avg %9.2f min %6d  %s\n", s[n] / c[n], m[n], c[n], n }' \
    /tmp/kernel-times.csv | sort -k5 | tee "$OUT/kernel-times.txt"
gzip -c /tmp/kernel-times.csv > "$OUT/kernel-times.csv.gz"
