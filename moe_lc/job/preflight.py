"""Checks of this machine against a recipe before any process group: paths, devices, the compiler
train.compile needs, memory, the checkpoint a run starts from. The recipe's own rules ran in
`load_config`; these depend on the filesystem and the device. Each failure is a ConfigError naming the
key."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

from moe_lc.job import checkpoint as ckpt
from moe_lc.config import Config, ConfigError
from moe_lc.config.attention_kinds import attention_kind, load
from moe_lc.model.counting import param_counts
from moe_lc.model.memory_floor import activation_floor
from moe_lc.model.transformer import state_shapes
from moe_lc.ops import fp8_te
from moe_lc.ops.attention import keeps_scores, resolved_backend, unusable_reason
from moe_lc.ops.fp8_linear import gemm_recipe

# kernel filesystems where no run directory can be made, whatever os.access says (root may "write" /proc)
PSEUDO_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
                                "bpf", "configfs", "devpts", "efivarfs", "binfmt_misc", "fusectl", "mqueue"})


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def refuse_unusable_fp8(p, device: torch.device) -> None:
    """ConfigError where precision.fp8_backend = 'te' cannot run [precision] `p`'s GEMMs on `device` (the
    trainer asks once its device is known, before building anything)."""
    if p.recipe == "fp8" and p.fp8_backend == "te":
        reason = fp8_te.unsupported_reason(device, gemm_recipe(p.fp8_scaling))
        if reason is not None:
            raise ConfigError([f"precision.fp8_backend='te': {reason}"])


def init_from_checkpoint(cfg: Config) -> Path:
    """The checkpoint `checkpoint.init_from` names, vetted against the recipe's model (ConfigError)."""
    try:
        path = ckpt.find_checkpoint(cfg.checkpoint.init_from)
    except (ckpt.CheckpointError, FileNotFoundError) as exc:
        raise ConfigError([f"checkpoint.init_from: {exc}"]) from None
    kind = attention_kind(cfg.model)  # tensors a training stage adds (DeepSeek-V3.2's warm-up: the indexer)
    fresh = load(kind.fresh_params)(cfg.model) if kind.fresh_params is not None else None
    shapes = state_shapes(cfg.model)  # untie: a tied checkpoint's embedding starts an untied head (load_weights)
    errors = [f"checkpoint.init_from: {e}" for e in ckpt.weight_errors(path, shapes, fresh, untie=True)]
    if errors:
        raise ConfigError(errors[:8] + ([f"... and {len(errors) - 8} more"] if len(errors) > 8 else []))
    return path


# ------------------------------------------------------------------------------------------ paths


def path_error(key: str, value: str) -> str | None:
    """Why directory `value` could not be made or written (None when it could), found by looking, not by
    creating anything: a run must not learn at its first save, hours in, that its output cannot exist, and
    probing by creating would leave directories (or race other ranks) where a used-directory rule looks."""
    path = Path(value)
    for near in (path, *path.parents):  # the nearest existing ancestor (or the path itself)
        try:
            mode = near.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # a file further up is reported when the walk reaches it
        except OSError as exc:
            return f"{key}={value!r}: cannot reach {near}: {exc.strerror}"
        if not stat.S_ISDIR(mode):
            return f"{key}={value!r}: {near} is {_kind(mode)}, not a directory"
        break
    fs = _filesystem_type(near)
    if fs in PSEUDO_FILESYSTEMS:
        return f"{key}={value!r}: {near} is on the kernel's {fs} filesystem, where no run directory can be made"
    if os.statvfs(near).f_flag & os.ST_RDONLY:
        return f"{key}={value!r}: {near} is on a read-only filesystem"
    if not os.access(near, os.W_OK | os.X_OK):
        what = f"{near} is not writable" if near == path else f"cannot create it: {near} is not writable"
        return f"{key}={value!r}: {what} (by uid {os.geteuid()})"
    return None


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISREG, "a file"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _filesystem_type(path: Path) -> str | None:
    """The type of the filesystem `path` lives on (Linux /proc/self/mountinfo; None where unreadable)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    real, best, fstype = os.path.realpath(path), "", None
    for line in lines:
        fields = line.split(" - ")
        if len(fields) < 2 or len(fields[0].split()) < 5:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda o: chr(int(o.group(1), 8)), fields[0].split()[4])
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, fields[1].split()[0]
    return fstype


# ------------------------------------------------------------------------------------------ devices


def device_errors(name: str) -> list[str]:
    """train.device against the devices torch sees: before resolve_device hands out a cuda device."""
    if name == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None and torch.version.hip is None:
            why = f"this torch {torch.__version__} is a CPU build"
        else:
            why = (f"no GPU visible: this torch is built for CUDA {torch.version.cuda or torch.version.hip}, but "
                   f"torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES="
                   f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}, or the driver")
        return [f"train.device='cuda': torch sees no CUDA device ({why}); use train.device=cpu or auto"]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name != "cpu" and torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        return [(f"train.device={name!r}: LOCAL_RANK={local_rank}, but torch sees {torch.cuda.device_count()} CUDA "
                 "device(s) on this node; start at most one rank per GPU")]
    return []


def attention_error(backend: str, device: torch.device) -> str | None:
    """model.attn_backend against this process's kernels and the device (ImportError at step 1 otherwise)."""
    reason = unusable_reason(backend, device)
    if reason is None:
        return None
    return (f"model.attn_backend={backend!r}: {reason}; use 'auto' (here: {resolved_backend('auto', device)!r}), "
            "'torch' or 'reference'")


def compile_error(device: torch.device) -> str | None:
    """train.compile against this machine: torch.compile's inductor builds CPU kernels with a C++ compiler
    (the first of torch._inductor.config.cpp.cxx that answers --version: $CXX, else g++), and GPU kernels
    with Triton. Without them the first step dies in a long inductor traceback; here it is one line."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else ("train.compile=true: torch.compile needs Triton for CUDA kernels, which "
                                          "is not importable (pip install triton), or set train.compile=false")
    from torch._inductor import config as inductor_config

    tried = [c for c in inductor_config.cpp.cxx if c]
    for cxx in tried:
        try:
            subprocess.run([cxx, "--version"], capture_output=True, check=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        return _compiler_build_error(cxx)
    return (f"train.compile=true: torch.compile's CPU backend (inductor) needs a C++ compiler, and none answers "
            f"(tried {', '.join(tried)}: the CXX environment variable, else g++); install one (e.g. g++) or point "
            "CXX at it, or set train.compile=false")


def _compiler_build_error(cxx: str) -> str | None:
    """Why `cxx` cannot build a shared library, as inductor has it do (None when it can)."""
    with tempfile.TemporaryDirectory(prefix="moe_lc_cxx_") as folder:
        try:
            proc = subprocess.run([cxx, "-x", "c++", "-shared", "-fPIC", "-o", str(Path(folder) / "probe.so"), "-"],
                                  input="int moe_lc_probe() { return 0; }\n", capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"train.compile=true: the C++ compiler {cxx} (inductor's) did not run: {exc}"
    if proc.returncode == 0:
        return None
    said = next((line.strip() for line in proc.stderr.splitlines() if line.strip()), f"exit status {proc.returncode}")
    return (f"train.compile=true: the C++ compiler {cxx} (inductor's: $CXX, else g++) cannot build a shared library "
            f"({said}); fix it or point CXX at another, or set train.compile=false")


# ------------------------------------------------------------------------------------------ memory


def memory_per_rank(device: torch.device, world: int) -> float:
    """Bytes a rank may use: the GPU's memory, or this machine's available RAM over its local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _available_ram() / max(int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1)


def _available_ram() -> int:
    """MemAvailable (free pages plus reclaimable cache) where /proc/meminfo tells it, else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_errors(cfg: Config, world: int, device: torch.device, per_rank: float) -> list[str]:
    """Refuse what surely cannot fit: the parameters, perfectly sharded, and then the floor of one
    micro-batch's activations (moe_lc/model/memory_floor.py); never what might."""
    counts = param_counts(cfg.model)
    n_params = counts["total"] + counts.get("mtp", 0)
    params = n_params * (4 if cfg.precision.recipe == "fp32" else 2) / world  # parameters alone, perfectly sharded
    has = f"the {_gib(per_rank)} this machine has per rank ({device.type})"
    if params > per_rank:
        return [(f"the model has {n_params:.3g} parameters: even spread evenly over {world} rank(s) they need "
                 f"{_gib(params)} per rank, more than {has}; check model sizes or use more ranks")]
    m, t, p = cfg.model, cfg.train, cfg.parallel
    floor = activation_floor(cfg, keeps_scores(m.attn_backend, device, cfg.precision.compute_dtype, m.qk_head_dim,
                                               m.value_head_dim))
    need = floor.total + (params if p.pp == 1 else 0)  # without pp every rank holds >= params / world
    if need <= per_rank:
        return []
    parts = [f"{floor.n_blocks} block(s) keep {_gib(floor.blocks)} for backward",
             f"the loss over {m.vocab_size} logits per token {_gib(floor.loss)}"]
    parts += [f"the (S x S) attention scores {_gib(floor.scores)}"] if floor.scores else []
    parts += [f"parameters {_gib(params)}"] if p.pp == 1 else []
    fixes = "lower train.micro_batch or train.seq_len, or raise parallel.cp (sequence shards)"
    fixes += ", or set recompute.policy = 'full'" if cfg.recompute.policy != "full" else ""
    fixes += ", or use model.attn_backend = 'auto'" if floor.scores and m.attn_backend != "auto" else ""
    return [(f"train.seq_len={t.seq_len} with train.micro_batch={t.micro_batch}: one micro-batch needs at least "
             f"{_gib(need)} per rank ({', '.join(parts)}), more than {has}; {fixes}")]


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


# ------------------------------------------------------------------------------------------ all


def preflight(cfg: Config, world: int) -> None:
    """Checks of this machine against the recipe, before any process group: ConfigError naming the problem.
    (The recipe's own rules ran in load_config; these depend on the filesystem and the device.)"""
    paths = (("train.output_dir", cfg.train.output_dir), ("checkpoint.dir", cfg.checkpoint.dir))
    errors = [e for key, value in paths if value and (e := path_error(key, value))]
    device_problems = device_errors(cfg.train.device)
    errors += device_problems
    if not device_problems:  # the checks below ask the device
        device = resolve_device(cfg.train.device)
        attention = attention_error(cfg.model.attn_backend, device)
        errors += [attention] if attention else []
        compiler = compile_error(device) if cfg.train.compile else None
        errors += [compiler] if compiler else []
        errors += memory_errors(cfg, world, device, memory_per_rank(device, world))
    if cfg.checkpoint.init_from:
        try:
            init_from_checkpoint(cfg)
        except ConfigError as exc:
            errors += exc.errors
    if errors:
        raise ConfigError(errors)
