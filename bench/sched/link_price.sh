#!/usr/bin/env bash
# Decision 0147 in the simulator: decode tok/s of the Qwen3-30B-A3B shape with balanced routing replayed
# (traces/topo-b-test.pstrace, recency predictor, window 1, PREFILL (default 512) then tg128, 16 threads) at 4 / 8 /
# 12 / 24 GiB: the load balancer off (the profile's link, free), `link` with `--link-price off` (the link's speed
# learned, decision 0146) and `link` (the default: its speed learned and its time priced, 0147), on two profiles (the built-in H200 reference and the H100 host's CPU terms) and three machines: as
# profiled, a link 2x slower, a link 4x and a CPU 1.5x slower. Simulated, not measured. Prints a Markdown table.
#
#   [PREFILL=512] [PRESCOPE=build/bin/prescope] bash bench/sched/link_price.sh > bench/results/link-price-0147/sim.md
set -euo pipefail
cd "$(dirname "$0")/../.."
PRESCOPE=${PRESCOPE:-build/bin/prescope}
PREFILL=${PREFILL:-512}
H100=bench/results/link-price-0147/h100-host-profile.json
echo "| profile | budget | machine (--truth) | tok/s off | speed learned | and priced | priced / learned | MB/token off / learned / priced | prefetch loads off / learned / priced |"
echo "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for prof in reference h100-host; do
    args=()
    [ "$prof" = h100-host ] && args=(--profile "$H100")
    for b in 4GiB 8GiB 12GiB 24GiB; do
        for truth in "" link=2 link=4,cpu=1.5; do
            row=()
            for mode in "off on" "link off" "link on"; do
                set -- $mode
                row+=("$("$PRESCOPE" simulate --trace traces/topo-b-test.pstrace --shape qwen3-30b-a3b --predictor recency \
                    --prefetch-window 1 -p "$PREFILL" -n 128 -t 16 --budget "$b" ${truth:+--truth "$truth"} --load-balance "$1" \
                    --link-price "$2" "${args[@]}" -o json 2> /dev/null | tail -1)")
            done
            python3 - "$prof" "$b" "${truth:-as profiled}" "${row[@]}" <<'PY'
import json, sys
prof, budget, truth = sys.argv[1:4]
o, s, p = (json.loads(a)["decode"] for a in sys.argv[4:7])
print(f"| {prof} | {budget} | {truth} | {o['tok_s']:.2f} | {s['tok_s']:.2f} | {p['tok_s']:.2f} | {p['tok_s'] / s['tok_s']:.3f}x | "
      f"{o['pcie_bytes_per_token'] / 1e6:.0f} / {s['pcie_bytes_per_token'] / 1e6:.0f} / {p['pcie_bytes_per_token'] / 1e6:.0f} | "
      f"{o['prefetch_loads']} / {s['prefetch_loads']} / {p['prefetch_loads']} |")
PY
        done
    done
done
