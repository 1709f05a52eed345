"""`tools/plan.py RECIPE --cluster NAME --search [--world N]`: the layouts of a world size that fit the
cluster's memory, ranked by predicted tokens/s/GPU (tools/step_time/model.py), with why each beats the next.

Candidates: pp a divisor of the world with at least two blocks per stage (the recipe's schedule; 1F1B
at pp = 1), tp a power of two up to the node and dividing the heads, cp a power of two keeping at least 4,096
tokens per rank (1 up to 8K tokens) with each hybrid all-to-all size cp_a2a (1, or a power of two dividing
the heads per tp rank whose all-to-all stays inside a node), ep a power of two dividing dp x cp x tp and the
experts; the recipe's batch, model and everything else. A layout the recipe's rules refuse is skipped
(counted by its first reason); one whose parameters and gradients alone exceed the memory is skipped before
planning (planning 671B takes ~15 s a layout); the rest are planned and fit when the planned peak of every
pipeline rank is at most the cluster's HBM (`cluster.hbm_gb`; the CUDA context and NCCL buffers are not in
the plan). Only the recipe's recompute policy is planned (the others' traces would change nothing here).

Planning takes 0.5-5 s a layout on a CPU (a 16B model at 128K, world 64: ~500 of 792 planned), so each planned
layout prints a progress line to stderr (layouts tried / total, elapsed, ETA, the best so far), and Ctrl-C
ends the search with the ranking of the layouts planned until then. When none fits, `nothing_fits` says
in one line what binds (the smallest planned peak, or the parameters and gradients alone, or the rules)
and what to change.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from moe_lc.config import Config, ConfigError, load_config
from moe_lc.model.counting import param_counts
from .clusters import Cluster
from .model import predict

TOP = 5  # layouts explained


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]


def candidates(cfg: Config, world: int, cluster: Cluster) -> list[dict[str, int]]:
    m, seq = cfg.model, cfg.train.seq_len
    experts = m.moe.n_routed_experts if m.n_moe_layers else 1
    out = []
    for pp in (d for d in range(1, world + 1) if world % d == 0 and (d == 1 or 2 * d <= m.n_layers)):
        for tp in (t for t in _powers(cluster.gpus_per_node) if m.n_heads % t == 0 and world % (pp * t) == 0):
            for cp in (c for c in _powers(max(1, seq // 4096)) if world % (pp * tp * c) == 0):
                dp = world // (pp * tp * cp)
                for ep in (e for e in _powers(dp * cp * tp) if experts % e == 0 and (dp * cp * tp) % e == 0):
                    out += [dict(pp=pp, tp=tp, cp=cp, cp_a2a=a, dp=dp, ep=ep) for a in _a2a_sizes(m, cp, tp, cluster)]
    return out


def _a2a_sizes(m, cp: int, tp: int, cluster: Cluster) -> list[int]:
    """Hybrid cp's all-to-all sizes worth trying: 1 (the ring alone) and each power of two up to cp that
    divides the heads per tp rank and keeps the all-to-all inside a node (A x tp <= gpus_per_node)."""
    return [a for a in _powers(cp) if a == 1 or ((m.n_heads // tp) % a == 0 and a * tp <= cluster.gpus_per_node)]


def _static_bytes(cfg: Config, d: dict[str, int]) -> float:
    """A lower bound of one rank's memory: its parameters (compute dtype) and fp32 gradients."""
    c = param_counts(cfg.model)
    mirror = 2 if cfg.parallel.pp_schedule == "dualpipe" and d["pp"] > 1 else 1
    experts = c["routed_experts"] / (d["pp"] * d["ep"])
    dense = (c["total"] - c["routed_experts"]) / (d["pp"] * d["tp"])
    return mirror * (experts + dense) * ((4 if cfg.precision.recipe == "fp32" else 2) + 4)


def name(d: dict[str, int]) -> str:
    short = {"cp_a2a": "a2a"}
    return " ".join(f"{short.get(k, k)}{d[k]}" for k in ("pp", "tp", "cp", "cp_a2a", "ep", "dp")
                    if d.get(k, 1) > 1 or k == "dp")


def search(recipe: str, sets: list[str], world: int, cluster: Cluster, eff: dict[str, float],
           plan_fn, log=print, impl: str = "fused") -> dict:
    """{"ranked": [...fitting layouts, best first], "skipped": {reason: count}, "why": [...], "tried" and
    "total" layouts, "nearest": the layout closest to fitting (None: every one refused), "interrupted":
    Ctrl-C ended the search early (the ranking is of the layouts tried)}. A progress line per planned
    layout goes to `log` (stderr)."""
    base = load_config(recipe, sets)  # the model and batch; the layouts are the candidates'
    todo = candidates(base, world, cluster)
    ranked, skipped, nearest = [], Counter(), None
    tried, interrupted, start = 0, False, time.perf_counter()
    try:
        for d in todo:
            reason, entry = _evaluate(recipe, sets, d, world, cluster, eff, plan_fn, impl)
            tried += 1
            if reason:
                skipped[reason] += 1
            else:
                ranked.append(entry)
            if entry and (nearest is None or _nearer(entry, nearest)):
                nearest = {k: entry[k] for k in ("name", "peak_gb", "bound")}
            if entry and entry["bound"] == PLANNED:  # the slow ones: seconds each
                log(_progress(tried, len(todo), time.perf_counter() - start, entry, ranked, cluster), file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
    ranked.sort(key=lambda r: -r["predicted"]["tokens_per_s_per_gpu"])
    ranked = [{k: v for k, v in r.items() if k != "bound"} for r in ranked]
    return {"world": world, "hbm_gb": cluster.hbm_gb, "ranked": ranked, "skipped": dict(skipped),
            "why": [why(a, b) for a, b in zip(ranked[:TOP], ranked[1:TOP + 1])],
            "tried": tried, "total": len(todo), "nearest": nearest, "interrupted": interrupted}


PLANNED, STATIC = 0, 1  # what a layout's peak_gb is: its planned peak, or its parameters and gradients alone


def _nearer(a: dict, b: dict) -> bool:
    """Whether layout `a` is nearer to fitting than `b`: a planned peak before a bound by parameters and
    gradients alone, then the smaller bytes."""
    return (a["bound"], a["peak_gb"]) < (b["bound"], b["peak_gb"])


def _evaluate(recipe: str, sets: list[str], d: dict[str, int], world: int, cluster: Cluster, eff: dict[str, float],
              plan_fn, impl: str = "fused") -> tuple[str, dict | None]:
    """(why the layout is skipped, "" when it fits; its entry: name, peak_gb, bound and, fitting, predicted;
    None when the rules refuse it)."""
    layout = [f"parallel.{k}={v}" for k, v in d.items()]
    if d["pp"] == 1:
        layout.append("parallel.pp_schedule=1f1b")
    try:
        cfg = load_config(recipe, sets + layout, world_size=world)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        return "refused: " + lines[min(1, len(lines) - 1)].strip(" -")[:100], None
    static = _static_bytes(cfg, d)
    if static > cluster.hbm_gb * 1e9:
        return "parameters + gradients alone exceed the memory", dict(name=name(d), peak_gb=static / 1e9, bound=STATIC)
    p = plan_fn(cfg, world, recipe, policies=(cfg.recompute.policy,))
    peak = max(r.peak_bytes() for r in p.ranks)
    entry = dict(layout=d, name=name(d), peak_gb=peak / 1e9, bound=PLANNED)
    if peak > cluster.hbm_gb * 1e9:
        return "planned peak exceeds the memory", entry
    return "", {**entry, "predicted": predict(cfg, p, cluster, eff, impl)}


def _progress(tried: int, total: int, elapsed: float, entry: dict, ranked: list[dict], cluster: Cluster) -> str:
    """`[tried/total elapsed, ETA] layout: result | best so far`."""
    eta = elapsed / tried * (total - tried)
    if "predicted" in entry:
        result = f"{entry['predicted']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, peak {_gb(entry['peak_gb'])} GB"
    else:
        result = f"peak {_gb(entry['peak_gb'])} GB > {cluster.hbm_gb:g} GB"
    best = max(ranked, key=lambda r: r["predicted"]["tokens_per_s_per_gpu"], default=None)
    best = f"{best['name']} {best['predicted']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU" if best else "none fits yet"
    return (f"[{tried}/{total} {_duration(elapsed)}, ETA {_duration(eta)}] {entry['name']}: {result} | "
            f"best so far: {best}")


def _gb(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:.3g}"


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s" if m else f"{s}s"


def nothing_fits(result: dict, cfg: Config) -> str:
    """One line for a search where no layout fits: what binds (the smallest planned peak, or the
    parameters and gradients alone, or the recipe's rules) and what to change."""
    world, hbm = result["world"], result["hbm_gb"]
    head = f"none of the {result['total']} layouts of {world} GPUs fits {hbm:g} GB per GPU"
    nearest = result["nearest"]
    if not result["total"]:
        return (f"no layout of {world} GPUs to try (pp divides the world with two blocks a stage, tp is a power of "
                f"two up to a node dividing the heads, ...: the module docstring of tools/step_time/search.py); "
                f"give another --world")
    if nearest is None:
        reason, n = max(result["skipped"].items(), key=lambda kv: kv[1])
        return f"{head}: the recipe's rules refuse every one (most often, {n} of them: {reason}); give another --world"
    if nearest["bound"] == STATIC:
        return (f"{head}: parameters and gradients alone need {_gb(nearest['peak_gb'])} GB per GPU in the leanest "
                f"layout ({nearest['name']}); give more GPUs (--world) or more memory per GPU (another --cluster, "
                f"--set cluster.hbm_gb=GB)")
    smaller = "--set recompute.policy=full, " if cfg.recompute.policy != "full" else ""
    return (f"{head}: the smallest planned peak is {_gb(nearest['peak_gb'])} GB ({nearest['name']}); give more GPUs "
            f"(--world), more memory per GPU (another --cluster, --set cluster.hbm_gb=GB) or a smaller peak "
            f"({smaller}a smaller train.micro_batch or train.seq_len)")


def _terms(pred: dict) -> dict[str, float]:
    """Step seconds by cause: bubble, each group's exposed communication, the rest (compute, optimizer)."""
    bubble = pred["bubble_share"] * pred["pipeline_s"]
    exposed = pred["exposed_comm_s"]
    return {"bubble": bubble, **{f"exposed {g}": s for g, s in exposed.items()},
            "compute": pred["step_s"] - bubble - sum(exposed.values())}


def why(a: dict, b: dict) -> str:
    """One line: by how much `a` beats `b` and the two step-time terms that differ most."""
    ta, tb = _terms(a["predicted"]), _terms(b["predicted"])
    diffs = sorted(((k, tb.get(k, 0.0) - ta.get(k, 0.0)) for k in set(ta) | set(tb)), key=lambda kv: -abs(kv[1]))
    gain = a["predicted"]["tokens_per_s_per_gpu"] / b["predicted"]["tokens_per_s_per_gpu"] - 1
    parts = ", ".join(f"{k} {ta.get(k, 0.0):.3g} vs {tb.get(k, 0.0):.3g} s" for k, _ in diffs[:2])
    return f"{a['name']} beats {b['name']} by {gain:.1%}: {parts}"


def render(result: dict) -> str:
    out = [f"Interrupted (Ctrl-C) after {result['tried']} of {result['total']} layouts: the ranking of those "
           f"tried"] if result["interrupted"] else []
    out += [f"Layouts of {result['world']} GPUs that fit, by predicted tokens/s/GPU:",
           f"{'#':>3}  {'layout':<28}{'tokens/s/GPU':>13}{'MFU':>8}{'step s':>9}{'bubble':>8}{'exposed comm s':>16}"
           f"{'peak GB':>9}"]
    for i, r in enumerate(result["ranked"], 1):
        p = r["predicted"]
        out.append(f"{i:>3}  {r['name']:<28}{p['tokens_per_s_per_gpu']:>13,.0f}{p['mfu']:>8.1%}{p['step_s']:>9.3g}"
                   f"{p['bubble_share']:>8.1%}{sum(p['exposed_comm_s'].values()):>16.3g}{r['peak_gb']:>9.1f}")
    if not result["ranked"]:
        out.append("     (none of those tried fits)")
    out += ["Why each beats the next:"] + [f"  {line}" for line in result["why"]]
    out += ["Skipped:"] + [f"  {n} x {reason}" for reason, n in result["skipped"].items()]
    return "\n".join(out)
