#!/usr/bin/env bash
# Trains and evaluates every expert predictor on held-out topo sequences and writes bench/results/predictors.json
# (+ bench/results/predictors-recall-by-layer.png). Commands and results: docs/predictors.md.
#   bench/predictor/run_topo.sh            # B=build/bin/prescope, work files in /tmp/prescope-predictors
# Needs traces/topo-test.pstrace, traces/topo-routers.safetensors and the uncommitted sidecar
# traces/topo-test.hidden.zst (HIDDEN=... to point elsewhere). About 40 minutes on 2 busy cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${B:-build/bin/prescope}
W=${WORK:-/tmp/prescope-predictors}
T=traces/topo-test.pstrace
P=traces/topo-prompts.pstrace
HIDDEN=${HIDDEN:-traces/topo-test.hidden.zst}
R=traces/topo-routers.safetensors
H=3          # held out: sequences 2, 5, 8, ... (--holdout-every 3); the sidecar covers sequences 0-8
SLOTS=32     # hot-expert table replay: 32 of 128 experts per layer (25%), LRU
mkdir -p "$W"

# Training (train split only; every 10th training sequence is kept aside for model selection).
$B train-predictor --trace $T --holdout-every $H --kind llapor-lstm --epochs 3 --out $W/lstm.pred
$B train-predictor --trace $T --holdout-every $H --kind llapor-lstm --epochs 3 --groups 1 --out $W/lstm-1group.pred
$B train-predictor --trace $T --hidden $HIDDEN --holdout-every $H --kind llapor-mlp --epochs 12 --lr 4e-3 \
    --out $W/mlp.pred
$B train-predictor --trace $T --hidden $HIDDEN --holdout-every $H --kind llapor-mlp --epochs 12 --lr 4e-3 \
    --groups 1 --out $W/mlp-1group.pred

# 1. Every predictor on the held-out tokens the sidecar covers (the hidden-state predictors need them).
for p in none frequency recency oracle fate $W/lstm.pred $W/lstm-1group.pred $W/mlp.pred $W/mlp-1group.pred; do
    $B eval-predictor --trace $T --hidden $HIDDEN --routers $R --holdout-every $H --predictor $p \
        --cache-slots $SLOTS --json $W/hidden-$(basename $p .pred).json
done
# 2. Routing-only predictors on every held-out token of topo-test, and on topo-prompts (other sources, unseen).
for p in frequency oracle $W/lstm.pred $W/lstm-1group.pred; do
    $B eval-predictor --trace $T --holdout-every $H --predictor $p --cache-slots $SLOTS \
        --json $W/test-$(basename $p .pred).json
    $B eval-predictor --trace $P --split all --groups $(python3 -c "import json,sys; g=json.load(open('$W/hidden-lstm.json'))['group_start']; print(f'{g[1]},{g[2]}')") \
        --predictor $p --cache-slots $SLOTS --json $W/prompts-$(basename $p .pred).json
done
python3 bench/predictor/collect_results.py bench/results/predictors.json bench/results/predictors-recall-by-layer.png \
    $W/hidden-*.json $W/test-*.json $W/prompts-*.json
