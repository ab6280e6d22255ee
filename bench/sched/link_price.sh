#!/usr/bin/env bash
# Decision 0147 in the simulator: decode tok/s of the Qwen3-30B-A3B shape with balanced routing replayed
# (traces/topo-b-test.pstrace, recency predictor, window 1, pp512 then tg128, 16 threads) at 4 / 8 / 12 / 24 GiB, with
# the load balancer off (the profile's link, free) and at `link` (the default: the link's speed learned and its time
# priced), on two profiles (the built-in H200 reference and the H100 host's CPU terms) and three machines: as
# profiled, a link 2x slower, a link 4x and a CPU 1.5x slower. Simulated, not measured. Prints a Markdown table.
#
#   bash bench/sched/link_price.sh [PRESCOPE=build/bin/prescope] > bench/results/link-price-0147/sim.md
set -euo pipefail
cd "$(dirname "$0")/../.."
PRESCOPE=${PRESCOPE:-build/bin/prescope}
H100=bench/results/link-price-0147/h100-host-profile.json
echo "| profile | budget | machine (--truth) | tok/s off | tok/s link | gain | MB/token off / link | prefetch loads off / link | CPU experts/token off / link |"
echo "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for prof in reference h100-host; do
    args=()
    [ "$prof" = h100-host ] && args=(--profile "$H100")
    for b in 4GiB 8GiB 12GiB 24GiB; do
        for truth in "" link=2 link=4,cpu=1.5; do
            row=()
            for lb in off link; do
                row+=("$("$PRESCOPE" simulate --trace traces/topo-b-test.pstrace --shape qwen3-30b-a3b --predictor recency \
                    --prefetch-window 1 -p 512 -n 128 -t 16 --budget "$b" ${truth:+--truth "$truth"} --load-balance "$lb" \
                    "${args[@]}" -o json 2> /dev/null | tail -1)")
            done
            python3 - "$prof" "$b" "${truth:-as profiled}" "${row[@]}" <<'PY'
import json, sys
prof, budget, truth, off, link = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
o, l = off["decode"], link["decode"]
print(f"| {prof} | {budget} | {truth} | {o['tok_s']:.2f} | {l['tok_s']:.2f} | {l['tok_s'] / o['tok_s']:.2f}x | "
      f"{o['pcie_bytes_per_token'] / 1e6:.0f} / {l['pcie_bytes_per_token'] / 1e6:.0f} | "
      f"{o['prefetch_loads']} / {l['prefetch_loads']} | {o['cpu_experts_per_token']:.0f} / {l['cpu_experts_per_token']:.0f} |")
PY
        done
    done
done
