#!/usr/bin/env bash
# Trains and evaluates every expert predictor on held-out sequences of a 48-layer (or Mixtral-shaped) trace, then
# merges the results (with the demo runs of run_demo.sh, when present) into bench/results/predictors[-MODEL].json and a
# recall-by-layer plot.
#   bench/predictor/run_topo.sh            # B=build/bin/prescope, work files in /tmp/prescope-predictors[-MODEL]
#   MODEL=topo-b bench/predictor/run_topo.sh          # the balanced traces of issue 9 (also MODEL=topo-mixtral)
# Needs traces/MODEL-test.pstrace, traces/MODEL-prompts.pstrace, traces/MODEL-routers.safetensors and the
# uncommitted sidecar traces/MODEL-test.hidden.zst (HIDDEN=... to point elsewhere). MODEL=topo (the default) is the
# first, skewed topo model. A predictor file already in the work folder is reused (delete it to retrain). About 20
# minutes on 2 cores for topo (2026-11-29). Commands and results: docs/predictors.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${B:-build/bin/prescope}
MODEL=${MODEL:-topo}
SUFFIX=$([ "$MODEL" = topo ] || echo "-$MODEL")  # topo keeps the names of issue 5's results
W=${WORK:-/tmp/prescope-predictors$SUFFIX}
DEMO=${DEMO_WORK:-/tmp/prescope-demo}
T=traces/$MODEL-test.pstrace
P=traces/$MODEL-prompts.pstrace
HIDDEN=${HIDDEN:-traces/$MODEL-test.hidden.zst}
R=traces/$MODEL-routers.safetensors
H=3          # held out: sequences 2, 5, 8, ... (--holdout-every 3); the sidecar covers sequences 0-8
# hot-expert table replay, LRU: 32 of 128 experts per layer (25%); half of Mixtral's 8 (a quarter would be its top-2)
case $MODEL in *mixtral*) SLOTS=${SLOTS:-4} ;; *) SLOTS=${SLOTS:-32} ;; esac
RESULTS=bench/results/predictors$SUFFIX.json
mkdir -p "$W"

# train NAME ARGS...: trains $W/NAME.pred on the train split unless it exists (every 10th training sequence, or
# the last the sidecar covers, is kept aside for model selection).
train() {
    local name=$1
    shift
    [ -f "$W/$name.pred" ] || $B train-predictor --trace $T --holdout-every $H -t 1 "$@" --out "$W/$name.pred"
}
train lstm --kind llapor-lstm --epochs 3
train lstm-1group --kind llapor-lstm --epochs 3 --groups 1
train mlp --hidden $HIDDEN --kind llapor-mlp --epochs 12 --lr 4e-3
train mlp-1group --hidden $HIDDEN --kind llapor-mlp --epochs 12 --lr 4e-3 --groups 1
# The same network with the loss LLaPor-MLP-prior uses (each target against the non-targets): chosen with 24
# epochs on the validation sequence (docs/predictors.md, "LLaPor-MLP-prior: validation behind the defaults").
train mlp-negloss --hidden $HIDDEN --kind llapor-mlp --epochs 24 --lr 4e-3 --loss negatives
# LLaPor-MLP-prior (decision 0054): the routers of layers l+1..l+3 on the router input moved by a ridge-fitted
# drift map (reading the previous token's router inputs in decode), plus an MLP correction kept only when it
# beats the prior alone on validation. Ablations: no correction; drift from the current token only; no drift
# (Fate's logits plus the correction); one group for all layers.
PRIOR="--hidden $HIDDEN --routers $R --kind llapor-mlp-prior"
CORR="--epochs 4 --lr 1e-3 --width 64 --weight-decay 1e-2 --dropout 0.3"  # the correction's settings (validation)
train prior $PRIOR $CORR
train prior-1group $PRIOR $CORR --groups 1
train prior-alone $PRIOR --correction none
train prior-current $PRIOR --correction none --drift current
train prior-fate-mlp $PRIOR $CORR --drift none

# 1. Every predictor on the held-out tokens the sidecar covers (the hidden-state predictors need them).
for p in none frequency recency oracle fate lstm lstm-1group mlp mlp-1group mlp-negloss prior prior-1group \
        prior-alone prior-current prior-fate-mlp; do
    spec=$p
    [ -f "$W/$p.pred" ] && spec=$W/$p.pred
    label=()
    [ $p = mlp-negloss ] && label=(--label llapor-mlp-negloss)
    $B eval-predictor --trace $T --hidden $HIDDEN --routers $R --holdout-every $H --predictor $spec \
        --cache-slots $SLOTS --json $W/hidden-$p.json "${label[@]}"
done
# 2. Routing-only predictors on every held-out token of topo-test, and on topo-prompts (other sources, unseen).
GS=$(python3 -c "import json; g=json.load(open('$W/hidden-lstm.json'))['group_start']; print(f'{g[1]},{g[2]}')")
for p in frequency oracle lstm lstm-1group; do
    spec=$p
    [ -f "$W/$p.pred" ] && spec=$W/$p.pred
    $B eval-predictor --trace $T --holdout-every $H --predictor $spec --cache-slots $SLOTS --json $W/test-$p.json
    $B eval-predictor --trace $P --split all --groups $GS --predictor $spec --cache-slots $SLOTS \
        --json $W/prompts-$p.json
done
PLOT=frequency,recency,fate,llapor-lstm,llapor-mlp,llapor-mlp-negloss,llapor-mlp-prior,llapor-mlp-prior-drift-none,oracle
python3 bench/predictor/collect_results.py $RESULTS ${RESULTS%.json}-recall-by-layer.png \
    --plot-predictors $PLOT $W/hidden-*.json $W/test-*.json $W/prompts-*.json $(ls $DEMO/eval-*.json 2>/dev/null || true)
