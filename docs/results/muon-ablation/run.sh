#!/bin/bash
# AdamW vs Muon on the debug MoE (issue #47): each optimizer's learning rate tuned on seed 0, then 3 seeds
# at the best one. Run from the repository root: bash docs/results/muon-ablation/run.sh [RUNS_DIR]
set -e
OUT=${1:-/tmp/muon_ablate}
COMMON="--set train.threads=1 --quiet"
python tools/ablate.py recipes/debug_cpu.toml $COMMON --grid train.optimizer=adamw --grid train.lr=1.5e-3,3e-3 \
    --out $OUT/tune_adamw
python tools/ablate.py recipes/debug_cpu.toml $COMMON --grid train.optimizer=muon --grid train.lr=1.5e-3,3e-3,6e-3 \
    --out $OUT/tune
python tools/ablate.py recipes/debug_cpu.toml $COMMON --grid train.optimizer=muon --grid train.lr=1.2e-2 --out $OUT/tune3
# the best of both was at the top of its range: one step further each
python tools/ablate.py recipes/debug_cpu.toml $COMMON --grid train.optimizer=adamw --grid train.lr=6e-3 --out $OUT/tune_adamw2
python tools/ablate.py recipes/debug_cpu.toml $COMMON --grid train.optimizer=muon --grid train.lr=2.4e-2 --out $OUT/tune4
# seeds 1 and 2 at each optimizer's best seed-0 learning rate (ADAMW_LR, MUON_LR: read off the tuning runs)
python tools/ablate.py recipes/debug_cpu.toml $COMMON --set train.optimizer=adamw --set train.lr=${ADAMW_LR:-3e-3} \
    --grid train.seed=1,2 --out $OUT/seeds_adamw
python tools/ablate.py recipes/debug_cpu.toml $COMMON --set train.optimizer=muon --set train.lr=${MUON_LR:-1.2e-2} \
    --grid train.seed=1 --out $OUT/seeds_muon
python tools/ablate.py recipes/debug_cpu.toml $COMMON --set train.optimizer=muon --set train.lr=${MUON_LR:-1.2e-2} \
    --grid train.seed=2 --out $OUT/seeds_muon2  # (run beside the first, on the other core)
python docs/results/muon-ablation/summarize.py $OUT docs/results/muon-ablation
