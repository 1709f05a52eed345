#!/bin/bash
# mHC on / off x hash routing of the first MoE layer on / off, 3 seeds, on the tiny DeepSeek-V4 (issue #66).
# Run from the repository root: bash docs/results/v4-ablation/run.sh [RUNS_DIR]   (~12 x 1-2 minutes on 2 cores)
set -e
OUT=${1:-/tmp/v4_ablate}
python tools/ablate.py recipes/debug_v4_cpu.toml --set train.threads=1 --set train.steps=300 --set train.log_interval=50 \
    --quiet --grid model.residual=mhc,plain --grid model.moe.hash_layers=1,0 --grid train.seed=0,1,2 --out $OUT
python docs/results/v4-ablation/summarize.py $OUT docs/results/v4-ablation
