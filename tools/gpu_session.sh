#!/usr/bin/env bash
# One short device call: the GPU facts, the `gpu` tests, then the benchmark parts one by one, each under
# its own time limit (a hang costs one part, not the call). Everything lands in $OUT, in 8 files with the
# default parts (a device call returns at most 8): steps.txt (each part's exit code and seconds), log.txt,
# the results <device>-<date>.{json,md}, muon.md and fp8.md (model_step with Muon, with FP8), ratios.txt and
# all.tgz (every file); compile.md, optimizer_offloaded.md, optimizer_in_step.md and zero3.md when those
# parts run (then some .md may not come back: all.tgz has them).
#
#     OUT=/tmp/gpu bash tools/gpu_session.sh           # on the GPU machine (9 min at most)
#     DRY=1 OUT=/tmp/gpu bash tools/gpu_session.sh     # on a CPU: tiny shapes, proves the sequence runs
#     PARTS="env tests gemm model_step muon_step" OUT=/tmp/gpu bash tools/gpu_session.sh   # a subset
#
# Parts: env, tests, attention, gemm, grouped_gemm, model_step (with --profile), muon_step (the same
# step with train.optimizer = muon), fp8_step (the same with precision.recipe = fp8), dsa_attention (one V3
# MLA attention sublayer, dense vs DSA k = 2048, at 32K and 128K), fp8_linear (the Linear fwd+bwd, bf16 vs
# FP8, at V3's shapes), moe_layer (a V3-shaped MoE layer of 32 local experts, bf16 vs FP8), optimizer_offload_step (the same step with the fp32 master and moments
# in pinned host memory, parallel.placement.optimizer = offloaded; its updates deferred into the next forward),
# optimizer_offload_in_step (the same with every update in the step: the overlap's gain is the difference),
# zero3_step (the step with parallel.placement.params = sharded_gather), layer, compile (model_step with
# train.compile on).
#
# Limits in seconds; the sum stays under a 10-minute call with room for the start-up. At the end
# tools/bench/ratios.py puts issue #64's headline ratios (`ratios`, `ratio_met`) into the results JSON and
# ratios.txt. The default parts are the ratios' (PARTS="env tests attention gemm grouped_gemm model_step layer
# compile" was the earlier sessions' set).
set -u
OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
DRY_FLAG=${DRY:+--dry-run}
FAST=(--warmup 2 --iters 10 --max-s 0.3)

PARTS=" ${PARTS:-env tests model_step muon_step fp8_step dsa_attention fp8_linear moe_layer} "

part() {  # part NAME LIMIT_S COMMAND...   (skipped unless NAME is in $PARTS)
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    [[ $PARTS == *" $name "* ]] || return 0
    echo "==== $name (limit ${limit}s): $*" >>"$WORK/log.txt"
    timeout -k 10 "$limit" "$@" >>"$WORK/log.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
}

nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
part env 40 python -m tools.gpu_check --steps env --out "$WORK" $DRY_FLAG
part tests 120 python -m pytest -m gpu -rsP -q -p no:cacheprovider -o timeout=90 --junitxml="$WORK/gpu_tests.xml"
part attention 90 python -m tools.bench.run --out "$WORK" --parts attention --quick "${FAST[@]}" $DRY_FLAG
part gemm 45 python -m tools.bench.run --out "$WORK" --parts gemm --quick "${FAST[@]}" $DRY_FLAG
part grouped_gemm 40 python -m tools.bench.run --out "$WORK" --parts grouped_gemm --quick "${FAST[@]}" $DRY_FLAG
part model_step 70 python -m tools.bench.run --out "$WORK" --parts model_step --quick --profile $DRY_FLAG
mkdir -p "$WORK/muon"
part muon_step 60 python -m tools.bench.run --out "$WORK/muon" --parts model_step --quick --set train.optimizer=muon $DRY_FLAG
mkdir -p "$WORK/fp8"
part fp8_step 80 python -m tools.bench.run --out "$WORK/fp8" --parts model_step --quick --set precision.recipe=fp8 $DRY_FLAG
part dsa_attention 100 python -m tools.bench.run --out "$WORK" --parts dsa_attention --quick $DRY_FLAG
part fp8_linear 45 python -m tools.bench.run --out "$WORK" --parts fp8_linear --quick $DRY_FLAG
part moe_layer 45 python -m tools.bench.run --out "$WORK" --parts moe_layer --quick $DRY_FLAG
mkdir -p "$WORK/optimizer_offloaded"
part optimizer_offload_step 70 python -m tools.bench.run --out "$WORK/optimizer_offloaded" --parts model_step --quick \
    --set parallel.placement.optimizer=offloaded $DRY_FLAG
mkdir -p "$WORK/optimizer_in_step" "$WORK/zero3"
part optimizer_offload_in_step 70 python -m tools.bench.run --out "$WORK/optimizer_in_step" --parts model_step --quick \
    --set parallel.placement.optimizer=offloaded --set parallel.placement.optimizer_overlap=false $DRY_FLAG
part zero3_step 70 python -m tools.bench.run --out "$WORK/zero3" --parts model_step --quick \
    --set parallel.placement.params=sharded_gather $DRY_FLAG
part layer 55 python -m tools.bench.run --out "$WORK" --parts layer --quick $DRY_FLAG
mkdir -p "$WORK/compile"
part compile 75 python -m tools.bench.run --out "$WORK/compile" --parts model_step --quick --set train.compile=true $DRY_FLAG

main_json=$(ls "$WORK"/*.json 2>/dev/null | grep -v -e env.json -e gpu_tests | head -1)
[ -n "$main_json" ] && python -m tools.bench.ratios "$main_json" "$WORK"/muon/*.json "$WORK"/fp8/*.json \
    >"$OUT/ratios.txt" 2>&1
cp "$WORK/log.txt" "$OUT/"
for f in "$WORK"/*.json "$WORK"/*.md; do
    case $f in *env.json|*summary.md) ;; *) cp "$f" "$OUT/" ;; esac
done
for f in "$WORK"/compile/*.md; do [ -e "$f" ] && cp "$f" "$OUT/compile.md"; done
for f in "$WORK"/muon/*.md; do [ -e "$f" ] && cp "$f" "$OUT/muon.md"; done
for f in "$WORK"/fp8/*.md; do [ -e "$f" ] && cp "$f" "$OUT/fp8.md"; done
for f in "$WORK"/optimizer_offloaded/*.md; do [ -e "$f" ] && cp "$f" "$OUT/optimizer_offloaded.md"; done
for f in "$WORK"/optimizer_in_step/*.md; do [ -e "$f" ] && cp "$f" "$OUT/optimizer_in_step.md"; done
for f in "$WORK"/zero3/*.md; do [ -e "$f" ] && cp "$f" "$OUT/zero3.md"; done
tar czf "$OUT/all.tgz" -C "$WORK" .
ls -la "$OUT"
