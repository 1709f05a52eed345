"""Golden runs: refactors must leave fp32 training bit-identical (losses, grad norms, final parameters).

Each case trains the debug recipe for a few steps on one layout and compares with tests/golden/<case>.json
exactly (==, not a tolerance): per-step losses and grad norms as Python floats, and a SHA-256 of every
final parameter's bytes. A change that is meant to move the numbers re-records them, and says so:

    MOE_LC_RECORD_GOLDEN="why the numbers moved" python -m pytest -q tests/test_golden.py

(the reason is kept in the JSON as "recorded_because").

Bits depend on the CPU's vector unit (torch's kernels differ between AVX2 and AVX-512: the same code gives
losses 1e-8 apart), so goldens are kept per `torch.backends.cpu.get_cpu_capability()`, as Megatron keeps
golden values per hardware: tests/golden/<case>.<capability>.json (<case>.json: recorded before the
capability was kept, on another machine). Where this machine's capability has a golden, the run must
match it bit for bit; where it has none, losses and grad norms must agree with every recorded golden within
1e-6 (what a vector unit moves), and the test says how to record one for this capability.

Cases: one process, and a 5-D layout (pp 2 DualPipe x dp 2 x cp 2 x tp 2, ep 2 folded into dp*cp*tp)
on 16 gloo processes (~25 s on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from tests.harness import RECIPES, run_layout

GOLDEN = RECIPES.parent / "tests" / "golden"
RECIPE = RECIPES / "debug_cpu.toml"
BASE = ["train.steps=4", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2", "train.micro_batch=1"]
CASES = {
    "debug_fp32_1proc": (BASE, 1),
    "debug_fp32_5d": (BASE + ["parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.dp=2", "parallel.cp=2",
                              "parallel.tp=2", "parallel.ep=2"], 16),
}


def _digest(final_state: dict) -> dict[str, str]:
    return {name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:24]
            for name, t in sorted(final_state.items())}


@pytest.mark.parametrize("case", [pytest.param(k, marks=pytest.mark.slow) if k == "debug_fp32_5d" else k for k in CASES])
def test_fp32_training_is_bit_identical_to_golden(case):
    overrides, world = CASES[case]
    got = run_layout(RECIPE, overrides, world=world, timeout_s=1200)
    result = {"overrides": overrides, "world": world, "losses": got.losses, "grad_norms": got.grad_norms,
              "params": _digest(got.final_state)}
    capability = torch.backends.cpu.get_cpu_capability()
    path = GOLDEN / f"{case}.{capability}.json"
    if os.environ.get("MOE_LC_RECORD_GOLDEN"):
        result["recorded_because"] = os.environ["MOE_LC_RECORD_GOLDEN"]
        result["cpu_capability"] = capability
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        pytest.skip(f"recorded {path}")
    if not path.exists():
        others = sorted(GOLDEN.glob(f"{case}.*json"))
        assert others, f"no golden for {case}"
        for other in others:
            want = json.loads(other.read_text())
            for key in ("losses", "grad_norms"):
                assert result[key] == pytest.approx(want[key], rel=1e-6), (other.name, key)
        print(f"note: no golden for CPU capability {capability} ({path.name}): checked within 1e-6 of "
              f"{', '.join(o.name for o in others)}; record one: MOE_LC_RECORD_GOLDEN=... pytest {__file__}")
        return
    want = json.loads(path.read_text())
    assert result["losses"] == want["losses"]
    assert result["grad_norms"] == want["grad_norms"]
    changed = [n for n in want["params"] if result["params"].get(n) != want["params"][n]]
    assert not changed and result["params"].keys() == want["params"].keys(), changed[:5]
