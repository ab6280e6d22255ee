#!/usr/bin/env bash
# The demo model's predictors: records a trace with router inputs (150 GSM8K prompts of ../shared/realdata, 16
# greedy tokens each, about 14.5k tokens) with our engine, trains on 4 of every 5 sequences and evaluates every
# predictor on the 5th; then merges everything (with run_topo.sh's topo runs, when present) into
# bench/results/predictors.json. About 20 minutes on 2 busy cores. Results: docs/predictors.md.
#   bench/predictor/run_demo.sh            # B=build/bin/prescope, work files in /tmp/prescope-demo
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${B:-build/bin/prescope}
D=${DEMO_WORK:-/tmp/prescope-demo}
W=${WORK:-/tmp/prescope-predictors}
M=models/demo/demo-q8_0.gguf
T=$D/demo-gsm8k.pstrace
HID=$D/demo-gsm8k.hidden.zst
SLOTS=8      # 8 of 32 experts per layer (25%), LRU
PLOT=frequency,recency,fate,llapor-lstm,llapor-mlp,llapor-mlp-negloss,llapor-mlp-prior,llapor-mlp-prior-drift-none,oracle
CORR="--epochs 4 --lr 1e-3 --width 64 --weight-decay 1e-2 --dropout 0.3"  # LLaPor-MLP-prior's correction (as topo)
mkdir -p "$D"
[ -f $T ] || $B trace -m $M -i ../shared/realdata/prompts/gsm8k_test_1319_mixtral8x7b_greedy_outputs.jsonl \
    --max-prompts 150 --source gsm8k -n 16 -o $T --hidden $HID -t 1

train() {  # train NAME ARGS...: $D/NAME.pred on the train split (held out: every 5th sequence) unless it exists
    local name=$1
    shift
    [ -f "$D/$name.pred" ] || $B train-predictor --trace $T -t 1 "$@" --out "$D/$name.pred"
}
train lstm --kind llapor-lstm --epochs 4
train mlp --hidden $HID --kind llapor-mlp --epochs 8 --lr 4e-3
train mlp-negloss --hidden $HID --kind llapor-mlp --epochs 8 --lr 4e-3 --loss negatives
train prior --hidden $HID -m $M --kind llapor-mlp-prior $CORR
train prior-alone --hidden $HID -m $M --kind llapor-mlp-prior --correction none

for p in none frequency fate oracle lstm mlp mlp-negloss prior prior-alone; do
    spec=$p
    [ -f "$D/$p.pred" ] && spec=$D/$p.pred
    label=()
    [ $p = mlp-negloss ] && label=(--label llapor-mlp-negloss)
    $B eval-predictor --trace $T --hidden $HID -m $M --predictor $spec --cache-slots $SLOTS \
        --json $D/eval-gsm8k-$p.json "${label[@]}"
done
# Routing only, on the committed demo test-split trace (no router inputs recorded there).
[ -f $D/lstm-test.pred ] || $B train-predictor --trace traces/demo-test.pstrace --kind llapor-lstm --epochs 4 -t 1 \
    --out $D/lstm-test.pred
for p in frequency oracle lstm-test; do
    spec=$p
    [ -f "$D/$p.pred" ] && spec=$D/$p.pred
    $B eval-predictor --trace traces/demo-test.pstrace --predictor $spec --cache-slots $SLOTS \
        --json $D/eval-test-$p.json
done
python3 bench/predictor/collect_results.py bench/results/predictors.json bench/results/predictors-recall-by-layer.png \
    --plot-predictors $PLOT $(ls $W/hidden-*.json $W/test-*.json $W/prompts-*.json 2>/dev/null || true) $D/eval-*.json
