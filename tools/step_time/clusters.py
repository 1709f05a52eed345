"""Named GPU clusters and kernel efficiencies for the step-time predictor (tools/step_time/model.py).

Every figure is a published per-GPU peak (dense, no sparsity), bandwidths per direction. Overrides:
`--set cluster.KEY=VALUE` (a field of `Cluster`) and `--set eff.KEY=VALUE` (a key of EFFICIENCY), or
`--bench FILE`, a JSON object {"efficiency": {KEY: fraction}} of measured efficiencies or a GPU run's
tools/bench/run.py results (gemm, grouped_gemm and attention parts read as efficiencies), applied
before the --set keys.

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
import statistics
from dataclasses import dataclass, fields, replace


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

    def peak_tflops(self, precision: str) -> float:
        """Dense peak of `precision` ("bf16", "fp8", "fp32") in TFLOP/s."""
        if precision == "fp8":
            return self.fp8_tflops
        if precision == "fp32":
            return self.fp32_tflops or self.bf16_tflops / 2
        return self.bf16_tflops


CLUSTERS = {
    "h800": Cluster("h800", 989.0, 1979.0, 3350.0, 80.0, 200.0, 50.0, 8),
    "h100": Cluster("h100", 989.0, 1979.0, 3350.0, 80.0, 450.0, 50.0, 8),
    "h200": Cluster("h200", 989.0, 1979.0, 4800.0, 141.0, 450.0, 50.0, 8),
    "b200": Cluster("b200", 2250.0, 4500.0, 8000.0, 180.0, 900.0, 50.0, 8),
    "gb200": Cluster("gb200", 2500.0, 5000.0, 8000.0, 186.0, 900.0, 50.0, 72),
    # this 2-core machine, one of recipes/overlap_cpu.toml's 4 gloo ranks: achieved fp32 rates and host costs
    # built from tools/bench's CPU measurements (tools/step_time/cpu.py; efficiencies 1: ACHIEVED_RATES), its
    # modelled link (parallel.link = "50:0.1", exact)
    "cpu": Cluster("cpu", 0.034381, 0.034381, 41.0818, 1000.0, 0.1, 0.1, 4, fp32_tflops=0.034381, op_us=51.392,
                   call_us=2371.9, copy_gbps=6.7983, link_latency_us=50.0),
}

# Achieved fraction of the peak per kernel kind: one set of defaults for every cluster and recipe.
EFFICIENCY = {
    # large dense BF16 GEMMs in cuBLAS reach ~700 of the H100's 989 TFLOP/s (Megatron-LM's GPT runs report
    # 47% MFU end to end with GEMMs the bulk of the time; 0.70 is the kernel-level figure we assume)
    "gemm": 0.70,
    # FP8 GEMMs with 1x128 / 128x128 block scaling: Transformer Engine's blockwise recipe measures ~1.4x
    # its BF16 GEMMs with the quantization included, i.e. 1.4 x 0.70 x 989 / 1979 = 0.49 of the FP8 peak
    "gemm_fp8": 0.49,
    # routed experts' grouped GEMM in BF16: torch._grouped_mm ~525 TFLOP/s on Llama-4-like shapes (PyTorch
    # / torchtitan MoE benchmarks), 525 / 989 = 0.53; FP8 grouped GEMMs at the same 1.4x as dense
    "grouped_gemm": 0.53,
    "grouped_gemm_fp8": 0.37,
    # causal flash attention forward + backward, head dim 128: FlashAttention-3 (arXiv 2407.08608) reaches
    # ~600 TFLOP/s forward on H100 and less backward; 0.45 of the BF16 peak for the pair
    "attention": 0.45,
    # norms, SwiGLU activation, residual adds, MoE permutation, the loss: a fraction of the HBM bandwidth
    # (STREAM-like copies reach ~80-90% of it)
    "memory": 0.80,
    # collectives: DeepEP (github.com/deepseek-ai/DeepEP) measures ~153 GB/s intranode of the H800's
    # ~160-200 and 43-58 GB/s internode of the 50 GB/s NIC: ~0.8 of a link's bandwidth
    "link": 0.80,
}


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


# tools/bench/run.py parts -> (efficiency, the entries' shape keys, their TFLOP/s key, peak, which entries)
BENCH_PARTS = [
    ("gemm", "gemm", ("recipe", "layers", "M", "K", "N"), "tflops", "bf16", lambda e: e.get("variant") == "bf16"),
    ("gemm", "gemm_fp8", ("recipe", "layers", "M", "K", "N"), "tflops", "fp8", lambda e: e.get("variant") != "bf16"),
    ("grouped_gemm", "grouped_gemm", ("model", "gemm", "experts", "K", "N", "tokens"), "fwd_bwd_tflops", "bf16",
     lambda e: True),
    ("attention", "attention", ("heads", "seq", "batch"), "fwd_bwd_tflops", "bf16", lambda e: True),
]


def efficiency_of_bench_results(data: dict, path: str) -> dict[str, float]:
    """Per kind, the median over the bench's shapes of the fastest kernel's TFLOP/s over the bench
    device's dense peak (its meta's `peak_tflops`): what the best available kernel reaches on that GPU."""
    peak = (data.get("meta") or {}).get("peak_tflops")
    if not peak:
        raise ClusterError(f"--bench {path}: its meta has no peak_tflops (a CPU or dry run): no efficiency to read")
    out = {}
    for part, kind, shape_keys, metric, precision, keep in BENCH_PARTS:
        best: dict[tuple, float] = {}
        for key, body in data["parts"].items():
            if key.split("[")[0] != part:
                continue
            for e in body.get("entries", []):
                if e.get("status") == "ok" and e.get(metric) and keep(e):
                    shape = tuple(e.get(k) for k in shape_keys)
                    best[shape] = max(best.get(shape, 0.0), e[metric])
        if best:
            out[kind] = statistics.median(best.values()) / peak[precision]
    if not out:
        raise ClusterError(f"--bench {path}: no measured gemm, grouped_gemm or attention entry")
    return out
