"""Named GPU clusters and kernel rates for the step-time predictor (tools/step_time/model.py).

Every figure is a published per-GPU peak (dense, no sparsity), bandwidths per direction. The kernel rates
(`EFFICIENCY`) are the committed H100 fit (kernel_rates.py) as fractions of the peaks, which every cluster scales
by its own. Overrides: `--set cluster.KEY=VALUE` (a field of `Cluster`) and `--set eff.KEY=VALUE` (a key of
EFFICIENCY), or `--bench FILE`, a JSON object {"efficiency": {KEY: value}} or a GPU run's tools/bench/run.py
results, to which the rates are refitted (`efficiency_of_bench_results`), applied before the --set keys.

Sources (vendor datasheets; the "with sparsity" figures there are halved to dense):
  H100 SXM   https://www.nvidia.com/en-us/data-center/h100/ : BF16 1,979 and FP8 3,958 TFLOP/s with
             sparsity (989 / 1,979 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 per direction);
             DGX H100 https://docs.nvidia.com/dgx/dgxh100-user-guide/ : 8 GPUs, eight 400 Gb/s
             ConnectX-7 compute ports (50 GB/s per GPU).
  H800 SXM   the H100 SXM's compute and HBM (80 GB) with NVLink cut to 400 GB/s (200 per direction); the
             DeepSeek-V3 report (arXiv 2412.19437, 3.2.2) gives IB 50 GB/s and NVLink 160 GB/s achievable
             per GPU on its 2,048-GPU H800 cluster, 8 GPUs per node.
  H200 SXM   https://www.nvidia.com/en-us/data-center/h200/ : the H100's compute, 141 GB HBM3e at 4.8 TB/s,
             NVLink 900 GB/s; DGX H200: 8 GPUs, 400 Gb/s ConnectX-7 per GPU.
  B200       https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200): FP8 9 and BF16 4.5 PFLOP/s per
             GPU with sparsity (4,500 / 2,250 dense), 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s (900 per
             direction); DGX B200: 8 GPUs, 400 Gb/s ConnectX-7 per GPU.
  GB200      https://www.nvidia.com/en-us/data-center/gb200-nvl72/ : per rack of 72 GPUs FP8 720 and
             BF16 360 PFLOP/s with sparsity (5,000 / 2,500 dense per GPU), 13.4 TB HBM3e at 576 TB/s (186 GB
             and 8 TB/s per GPU), NVLink 130 TB/s (1.8 TB/s per GPU); one NVLink domain of 72 GPUs; 400 Gb/s
             ConnectX-7 per GPU scale-out.
  cpu        not a datasheet: built from tools/bench's CPU measurements on this machine (cpu_costs.py,
             gloo_collectives.py, shared_cpu.py; docs/results/steptime) by tools/step_time/cpu.py, which says how.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

from .kernel_rates import committed as committed_fit, fit_kernel_rates


@dataclass(frozen=True)
class Cluster:
    """Per-GPU peaks of one cluster: TFLOP/s dense by precision, GB/s per direction."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_gbps: float  # HBM bandwidth, GB/s
    hbm_gb: float  # HBM capacity, GB (what `--search` fits a layout's planned peak into)
    nvlink_gbps: float  # scale-up (NVLink) bandwidth per GPU per direction, GB/s
    net_gbps: float  # scale-out (InfiniBand / RoCE) bandwidth per GPU per direction, GB/s
    gpus_per_node: int  # GPUs of one NVLink domain
    fp32_tflops: float = 0.0  # 0: half the BF16 peak (TF32 tensor cores); the precision.recipe = "fp32" peak
    # host costs a CPU rank pays on the critical path (0 on GPUs, whose kernel launches run ahead of the kernels):
    op_us: float = 0.0  # per dispatched aten op (Python, modules, autograd, dispatcher), microseconds
    call_us: float = 0.0  # per collective call beyond its bytes (the backend's threads, the wait's wake-up)
    copy_gbps: float = 0.0  # the backend's own copy of a collective's bytes, GB/s; 0: not modelled
    link_latency_us: float = 0.0  # per collective call of the (modelled) link, microseconds
    # a GPU's host under `--impl eager` (tools/step_time/compute.py): what each aten op costs the host to dispatch; a
    # phase takes at least its ops x this (a stream of kernels shorter than their dispatch waits on the host)
    host_op_us: float = 0.0

    def peak_tflops(self, precision: str) -> float:
        """Dense peak of `precision` ("bf16", "fp8", "fp32") in TFLOP/s."""
        if precision == "fp8":
            return self.fp8_tflops
        if precision == "fp32":
            return self.fp32_tflops or self.bf16_tflops / 2
        return self.bf16_tflops


# PyTorch's own cost per dispatched aten op (Python, modules, autograd, the dispatcher) with no kernel work:
# tools/bench/cpu_costs.py's `framework_op_s` on this repo's CPU, 6.39 us (docs/results/steptime/cpu_costs.json)
HOST_OP_US = 6.4

CLUSTERS = {
    "h800": Cluster("h800", 989.0, 1979.0, 3350.0, 80.0, 200.0, 50.0, 8, host_op_us=HOST_OP_US),
    "h100": Cluster("h100", 989.0, 1979.0, 3350.0, 80.0, 450.0, 50.0, 8, host_op_us=HOST_OP_US),
    "h200": Cluster("h200", 989.0, 1979.0, 4800.0, 141.0, 450.0, 50.0, 8, host_op_us=HOST_OP_US),
    "b200": Cluster("b200", 2250.0, 4500.0, 8000.0, 180.0, 900.0, 50.0, 8, host_op_us=HOST_OP_US),
    "gb200": Cluster("gb200", 2500.0, 5000.0, 8000.0, 186.0, 900.0, 50.0, 72, host_op_us=HOST_OP_US),
    # this 2-core machine, one of recipes/overlap_cpu.toml's 4 gloo ranks: achieved fp32 rates and host costs
    # built from tools/bench's CPU measurements (tools/step_time/cpu.py; efficiencies 1: ACHIEVED_RATES), its
    # modelled link (parallel.link = "50:0.1", exact)
    "cpu": Cluster("cpu", 0.034381, 0.034381, 41.0818, 1000.0, 0.1, 0.1, 4, fp32_tflops=0.034381, op_us=51.392,
                   call_us=2371.9, copy_gbps=6.7983, link_latency_us=50.0),
}

# Kernel rates by kind (tools/step_time/kernel_rates.py: a roofline with a per-launch cost fitted to an H100's
# GEMM, grouped-GEMM and attention tables, kernel_rates_h100.json), as a flat table of fractions every cluster
# scales by its own peaks: KIND is the compute rate large kernels reach over the dense peak of the kind's
# precision (memory: the bandwidth over the HBM's), KIND.bw the bandwidth bound over the HBM's, KIND.launch_us
# the cost every launch adds, KIND.p how sharply the two bounds meet. grouped_gemm_fp8 has no table: the grouped
# GEMM's shape at the blockwise FP8 GEMM's speed-up over BF16. attention_fa2_*: FlashAttention-2's rates, which a
# run's attention implementation may put in place of the fastest kernel's (attention_impls.py).
KINDS = ("gemm", "gemm_fp8_tensorwise", "gemm_fp8_blockwise", "grouped_gemm", "grouped_gemm_fp8", "attention_fwd",
         "attention_bwd", "attention_fa2_fwd", "attention_fa2_bwd", "memory")
PRECISION = {"gemm": "bf16", "gemm_fp8_tensorwise": "fp8", "gemm_fp8_blockwise": "fp8", "grouped_gemm": "bf16",
             "grouped_gemm_fp8": "fp8", "attention_fwd": "bf16", "attention_bwd": "bf16", "attention_fa2_fwd": "bf16",
             "attention_fa2_bwd": "bf16"}
# collectives: DeepEP (github.com/deepseek-ai/DeepEP) measures ~153 GB/s intranode of the H800's ~160-200 and
# 43-58 GB/s internode of the 50 GB/s NIC: ~0.8 of a link's bandwidth
LINK = 0.80


def efficiency_of_fit(fit: dict) -> dict[str, float]:
    """The flat table (above) of a kernel_rates fit {"meta": {peak_tflops, hbm_gbps}, "kinds": {...}}."""
    peak, hbm = fit["meta"]["peak_tflops"], fit["meta"]["hbm_gbps"] * 1e9
    kinds = dict(fit["kinds"])
    if {"grouped_gemm", "gemm_fp8_blockwise", "gemm"} <= set(kinds):
        speedup = kinds["gemm_fp8_blockwise"]["flops_per_s"] / kinds["gemm"]["flops_per_s"]
        kinds["grouped_gemm_fp8"] = {**kinds["grouped_gemm"], "flops_per_s": kinds["grouped_gemm"]["flops_per_s"] * speedup}
    out = {}
    for kind in KINDS:
        k = kinds[kind]
        if kind == "memory":
            out.update({"memory": k["bytes_per_s"] / hbm, "memory.launch_us": k["launch_s"] * 1e6})
            continue
        out.update({kind: k["flops_per_s"] / (peak[PRECISION[kind]] * 1e12), f"{kind}.bw": k["bytes_per_s"] / hbm,
                    f"{kind}.launch_us": k["launch_s"] * 1e6, f"{kind}.p": k["p"]})
    return {**out, "link": LINK}


EFFICIENCY = efficiency_of_fit(committed_fit())


# clusters whose figures are achieved rates measured on the machine (not datasheet peaks): every default
# efficiency is 1 for them (--bench and --set still apply)
ACHIEVED_RATES = ("cpu",)


class ClusterError(ValueError):
    """A bad --cluster name, --set cluster./eff. key or --bench file: one line naming it."""


CLUSTER_PREFIXES = ("cluster.", "eff.")


def split_sets(sets: list[str]) -> tuple[list[str], list[str]]:
    """(recipe --set items, cluster./eff. items): the planner's --set takes both."""
    ours = [s for s in sets if s.startswith(CLUSTER_PREFIXES)]
    return [s for s in sets if s not in ours], ours


def _number(item: str, value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ClusterError(f"--set {item}: {value!r} is not a number") from None
    if not x > 0 or x == float("inf"):
        raise ClusterError(f"--set {item}: must be a positive finite number")
    return x


def resolve(name: str, sets: list[str] = (), bench: str | None = None) -> tuple[Cluster, dict[str, float]]:
    """The cluster called `name` and the efficiencies, with the --bench file and --set overrides applied."""
    if name not in CLUSTERS:
        raise ClusterError(f"--cluster {name!r} is not a known cluster; choose one of {', '.join(CLUSTERS)}")
    cluster, eff = CLUSTERS[name], {k: 1.0 if name in ACHIEVED_RATES else v for k, v in EFFICIENCY.items()}
    if bench:
        eff.update(_bench_efficiency(bench))
    changes = {}
    known = {f.name: f.type for f in fields(Cluster) if f.name != "name"}
    for item in sets:
        key, sep, value = item.partition("=")
        section, _, field_name = key.partition(".")
        if not sep:
            raise ClusterError(f"--set {item}: expected KEY=VALUE")
        if section == "cluster":
            if field_name not in known:
                raise ClusterError(f"--set {item}: unknown cluster key {field_name!r}; keys are {', '.join(known)}")
            x = _number(item, value)
            changes[field_name] = int(x) if known[field_name] in ("int", int) else x
        else:
            if field_name not in EFFICIENCY:
                raise ClusterError(f"--set {item}: unknown efficiency {field_name!r}; keys are {', '.join(EFFICIENCY)}")
            eff[field_name] = _number(item, value)
    return replace(cluster, **changes), eff


def _bench_efficiency(path: str) -> dict[str, float]:
    """{kind: fraction} from a bench file: {"efficiency": {...}}, or tools/bench/run.py's results JSON
    (`efficiency_of_bench_results`); ClusterError naming the file otherwise."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ClusterError(f"--bench {path}: {exc}") from None
    if isinstance(data, dict) and "parts" in data and "efficiency" not in data:
        return efficiency_of_bench_results(data, path)
    table = data.get("efficiency") if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise ClusterError(f"--bench {path}: expected a JSON object with an \"efficiency\" object of kind -> fraction, "
                           "or tools/bench/run.py's results")
    out = {}
    for key, value in table.items():
        if key not in EFFICIENCY:
            raise ClusterError(f"--bench {path}: unknown efficiency {key!r}; keys are {', '.join(EFFICIENCY)}")
        out[key] = _number(f"{path}:{key}", str(value))
    return out


def efficiency_of_bench_results(data: dict, path: str) -> dict[str, float]:
    """The efficiency table refitted to a GPU bench's results (tools/bench/run.py's JSON: kernel_rates.py's
    `fit_kernel_rates`, relative to the bench device's peaks); a kind the bench has too few rows of keeps the
    committed fit's constants."""
    try:
        fit = fit_kernel_rates([data])
    except ValueError as exc:
        raise ClusterError(f"--bench {path}: {exc}") from None
    if not fit["kinds"].keys() - {"memory"}:
        raise ClusterError(f"--bench {path}: no measured gemm, grouped_gemm or attention entry")
    base = committed_fit()
    scale = {"hbm": fit["meta"]["hbm_gbps"] / base["meta"]["hbm_gbps"]}
    kinds = {k: {**v, "bytes_per_s": v["bytes_per_s"] * scale["hbm"]} for k, v in base["kinds"].items()}
    for k, v in base["kinds"].items():  # (the committed constants, re-expressed against the bench device's peaks)
        if k in PRECISION:
            kinds[k]["flops_per_s"] = v["flops_per_s"] * (fit["meta"]["peak_tflops"][PRECISION[k]]
                                                         / base["meta"]["peak_tflops"][PRECISION[k]])
    kinds.update(fit["kinds"])
    return efficiency_of_fit({"meta": fit["meta"], "kinds": kinds})
