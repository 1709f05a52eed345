#!/bin/bash
# The four balance variants on the debug MoE, one `tools.ablate` call each (their overrides are not a
# grid), then the summary. Run from the repository root: bash docs/results/balance-ablation/run.sh [RUNS_DIR]
set -e
OUT=${1:-/tmp/balance-ablation/runs}
COMMON="--set train.steps=300 --set train.threads=1 --set train.log_interval=50 --set checkpoint.interval=0"
python -m tools.ablate recipes/debug_cpu.toml $COMMON --grid model.moe.bias_update_speed=0.01 --out $OUT/bias --quiet
python -m tools.ablate recipes/debug_cpu.toml $COMMON --set model.moe.bias_update_speed=0 \
    --grid model.moe.aux_loss_weight=0.01 --out $OUT/sequence_aux --quiet
python -m tools.ablate recipes/debug_cpu.toml $COMMON --set model.moe.bias_update_speed=0 \
    --grid model.moe.global_aux_loss_weight=0.01 --out $OUT/global_aux --quiet
python -m tools.ablate recipes/debug_cpu.toml $COMMON --set model.moe.z_loss_weight=0.001 \
    --grid model.moe.capacity_factor=1.25 --out $OUT/zloss_capacity --quiet
python docs/results/balance-ablation/summarize.py $OUT docs/results/balance-ablation
