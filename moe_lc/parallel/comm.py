"""Counted collectives: the only module that calls torch.distributed communication.

Every op takes a `Group` (a process group along a named mesh dimension) and adds the bytes this
rank sends to the group's `CommCounter`, keyed by (group name, op), with the bytes whose receiver
sits on another node counted again as inter-node. Counts follow the algorithm each op stands for,
so tests and the planner can compare them with closed-form formulas:

  all_reduce      ring: 2 (N-1)/N x buffer bytes     (reduce-scatter then all-gather)
  reduce_scatter  ring: (N-1)/N x input (full) bytes
  all_gather      ring: (N-1)/N x output (full) bytes
  all_to_all      exactly the bytes addressed to other ranks
  send            the tensor's bytes (recv sends nothing)

Ring ops send everything to the next rank of the group, so their bytes are inter-node when that
rank is on another node; all-to-all and send count each destination separately. A group of size 1
is a no-op and counts nothing. A collective that fails or times out (`parallel.timeout_s`) raises
`CollectiveError` naming the op and the group, also when it surfaces later in `work.wait()`.

A group knows the device type its backend moves (`device_type`: "cuda" under NCCL, "cpu" under
gloo), and every op refuses a tensor on another device with a ValueError naming the op, the group
and both devices, also on a size-1 group: a CPU tensor handed to NCCL crashes only on a multi-GPU
run, so the check must fire wherever the call site runs, e.g. in a one-GPU test or a dry run with
fake CUDA tensors.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_lc.parallel.comm_timing import IssuedWork, Link

# torch 2.13 renames the tensor collectives (*_single); torch 2.11 on the GPU machines may lack them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective that failed or timed out, with the op and the group it ran on."""

    def __init__(self, op: str, group: "Group", cause: BaseException):
        super().__init__(f"collective {op} on group '{group.name}' (global ranks {group.ranks}) failed: "
                         f"{type(cause).__name__}: {str(cause).strip()[:400]} -- a peer may have died or not "
                         f"reached this collective (timeout: parallel.timeout_s)")
        self.op, self.group_name = op, group.name


def _call(op: str, group: "Group", call):
    """call()'s torch work(s), refused on a virtual group, failures as CollectiveError."""
    if group.virtual:
        raise RuntimeError(f"collective {op} on virtual group '{group.name}': a virtual mesh builds one rank's "
                           "layout in one process and cannot communicate")
    try:
        return call()
    except Exception as exc:
        raise CollectiveError(op, group, exc) from exc


def _issue(op: str, group: "Group", call, async_op: bool, nbytes: int, inter_nbytes: int | None = None):
    """Issue `call()` (which passes async_op=True) and wrap its work (see comm_timing.py); a
    synchronous op is waited here. Returns the handle for async_op, else None. inter_nbytes: the part
    of nbytes bound for other nodes (None: a ring op, all of it when the next rank is on another node)."""
    if inter_nbytes is None:
        inter_nbytes = nbytes if group.ring_is_inter_node() else 0
    handle = group.issued(_call(op, group, call), op, nbytes, inter_nbytes)
    if async_op:
        return handle
    handle.wait()
    return None


class CommCounter:
    """Bytes sent by this rank, per (group name, op); `inter_node` holds the cross-node part."""

    def __init__(self):
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.inter_node: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.time_s: dict[tuple[str, str], float] = defaultdict(float)  # issue to done, summed over ops
        self.exposed_s: dict[tuple[str, str], float] = defaultdict(float)  # the part blocked in wait
        self.link: Link | None = None  # the run's modelled network (parallel.link), None = the real one
        self.timeline: list[tuple] | None = None  # a list while a step is traced: every booked op

    def add(self, group: str, op: str, nbytes: int, inter_node: int = 0) -> None:
        self.bytes[(group, op)] += int(nbytes)
        self.inter_node[(group, op)] += int(inter_node)
        self.calls[(group, op)] += 1

    def reset(self) -> None:
        self.bytes.clear(), self.inter_node.clear(), self.calls.clear()
        self.time_s.clear(), self.exposed_s.clear()

    def book(self, group: str, op: str, issued: float, done: float, wait_start: float, wait_end: float) -> None:
        """One op's times (time.perf_counter()): issued, done (stamped, plus the modelled link), and the
        wait that blocked on it. Blocked past `done` is waking up, not the link: not exposed."""
        took = max(done - issued, 0.0)
        self.time_s[(group, op)] += took
        self.exposed_s[(group, op)] += min(wait_end - wait_start, took)
        if self.timeline is not None:
            self.timeline.append((group, op, issued, done, wait_start, wait_end))

    def times(self) -> dict[str, float]:
        """Seconds per group, and per group and op, since the last reset (CPU groups; comm_timing.py):
        {"comm/<group>/time_s", "comm/<group>/exposed_s", "comm/<group>/<op>_time_s", ...}."""
        out: dict[str, float] = defaultdict(float)
        for (g, o), t in sorted(self.time_s.items()):
            e = self.exposed_s[(g, o)]
            out[f"comm/{g}/time_s"] += t
            out[f"comm/{g}/exposed_s"] += e
            out[f"comm/{g}/{o}_time_s"], out[f"comm/{g}/{o}_exposed_s"] = t, e
        return dict(out)

    def total(self, group: str | None = None, op: str | None = None, inter_node: bool = False) -> int:
        table = self.inter_node if inter_node else self.bytes
        return sum(v for (g, o), v in table.items() if (group is None or g == group) and (op is None or o == op))

    def as_dict(self) -> dict[str, int]:
        """Flat {"comm/<group>/<op>_bytes": n, ...} for metrics logs."""
        out = {f"comm/{g}/{o}_bytes": v for (g, o), v in sorted(self.bytes.items())}
        out.update({f"comm/{g}/{o}_inter_node_bytes": v for (g, o), v in sorted(self.inter_node.items()) if v})
        return out


@dataclass
class Group:
    """A process group along one named mesh dimension (or a flattened combination of them).

    ranks: global ranks in group order; rank: this process's index in `ranks`; pg: the torch
    ProcessGroup (None when size == 1 or without torch.distributed); node_size: ranks per node;
    device_type: the device type of the tensors its backend takes (None: not checked).
    """

    name: str
    ranks: list[int]
    rank: int = 0
    pg: object = None
    node_size: int = 1 << 30
    counter: CommCounter = field(default_factory=CommCounter)
    device_type: str | None = None
    virtual: bool = False  # no process group behind it (a one-process build of one rank's layout)

    def check_device(self, op: str, *tensors: torch.Tensor) -> None:
        """ValueError unless every tensor lives on this group's device type (see the module docstring)."""
        if self.device_type is None:
            return
        for t in tensors:
            if t.device.type != self.device_type:
                raise ValueError(f"collective {op} on group '{self.name}' got a tensor on {t.device}, but the group "
                                 f"runs on {self.device_type} ({'NCCL takes CUDA tensors only' if self.device_type == 'cuda' else 'its backend'}); "
                                 f"create the tensor on the run's device")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def node_of(self, group_rank: int) -> int:
        return self.ranks[group_rank] // self.node_size

    def n_nodes(self) -> int:
        return len({self.node_of(i) for i in range(self.size)})

    def ring_is_inter_node(self) -> bool:
        return self.node_of((self.rank + 1) % self.size) != self.node_of(self.rank)

    def issued(self, work, op: str, nbytes: int, inter_nbytes: int = 0) -> IssuedWork:
        """A handle for `work` just issued on this group, moving `nbytes` (inter_nbytes of them to other
        nodes) over the (modelled) link."""
        return IssuedWork(work, self.device_type == "cpu" and not self.virtual, self.counter.link, nbytes,
                          lambda *times: self.counter.book(self.name, op, *times),
                          lambda exc: CollectiveError(op, self, exc), instant=self.device_type == "meta",
                          inter_nbytes=inter_nbytes)

    def _count_ring(self, op: str, nbytes: int) -> int:
        self.counter.add(self.name, op, nbytes, nbytes if self.ring_is_inter_node() else 0)
        return nbytes

    def __repr__(self) -> str:
        return f"Group({self.name}, size={self.size}, rank={self.rank})"


def single_group(name: str, counter: CommCounter | None = None, device_type: str | None = None) -> Group:
    """A size-1 group (single device, or a degree of 1)."""
    return Group(name, [dist.get_rank() if dist.is_initialized() else 0], 0, None, counter=counter or CommCounter(),
                 device_type=device_type)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of t over the group."""
    group.check_device("all_reduce", t)
    if group.size == 1:
        return None
    n = group._count_ring("all_reduce", 2 * (group.size - 1) * _nbytes(t) // group.size)
    return _issue("all_reduce", group, lambda: dist.all_reduce(t, op=op, group=group.pg, async_op=True), async_op, n)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """out (n,) <- this rank's 1/N slice of the sum of every rank's inp (N*n,) (dim 0 concatenation)."""
    group.check_device("reduce_scatter", out, inp)
    if group.size == 1:
        out.copy_(inp)
        return None
    n = group._count_ring("reduce_scatter", (group.size - 1) * _nbytes(inp) // group.size)
    return _issue("reduce_scatter", group,
                  lambda: _reduce_scatter_single(out, inp, op=op, group=group.pg, async_op=True), async_op, n)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """out (N*n, ...) <- every rank's inp (n, ...) concatenated along dim 0 in group order."""
    group.check_device("all_gather", out, inp)
    if group.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    n = group._count_ring("all_gather", (group.size - 1) * _nbytes(out) // group.size)
    return _issue("all_gather", group, lambda: _all_gather_single(out, inp, group=group.pg, async_op=True),
                  async_op, n)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: Group, async_op: bool = False):
    """Rows of inp split by in_splits go to ranks 0..N-1; out receives out_splits rows from each."""
    group.check_device("all_to_all", out, inp)
    if group.size == 1:
        out.copy_(inp)
        return None
    row = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else inp.element_size()
    sent = inter = 0
    for peer, n in enumerate(in_splits):
        if peer != group.rank:
            sent += n * row
            inter += n * row if group.node_of(peer) != group.node_of(group.rank) else 0
    group.counter.add(group.name, "all_to_all", sent, inter)
    received = (sum(out_splits) - out_splits[group.rank]) * row  # the link carries the larger direction
    inter_in = sum(n * row for peer, n in enumerate(out_splits) if group.node_of(peer) != group.node_of(group.rank))
    return _issue("all_to_all", group, lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group.pg,
                                                                      async_op=True), async_op, max(sent, received),
                  max(inter, inter_in))


def all_gather_object(obj, group: Group) -> list:
    """Every rank's picklable `obj`, in group order (for small metadata and final-state gathering;
    counted as its pickled size)."""
    if group.size == 1:
        return [obj]
    import pickle

    nbytes = len(pickle.dumps(obj))
    n = group._count_ring("all_gather_object", (group.size - 1) * nbytes)
    out = [None] * group.size
    _issue("all_gather_object", group, lambda: dist.all_gather_object(out, obj, group=group.pg), False, n)
    return out


def p2p_op(kind: str, t: torch.Tensor, peer: int, group: Group) -> dist.P2POp:
    """A send ("send") or receive ("recv") of t with `peer` (an index into group.ranks), counted."""
    group.check_device(kind, t)
    if kind == "send":
        inter = _nbytes(t) if group.node_of(peer) != group.node_of(group.rank) else 0
        group.counter.add(group.name, "send", _nbytes(t), inter)
        return dist.P2POp(dist.isend, t, group.ranks[peer], group.pg)
    if kind == "recv":
        return dist.P2POp(dist.irecv, t, group.ranks[peer], group.pg)
    raise ValueError(f"p2p kind {kind!r} must be 'send' or 'recv'")


def batch_isend_irecv(ops: list[dist.P2POp], group: Group | None = None) -> list[IssuedWork]:
    """Post a group of p2p ops together; returns one handle per op, in order (wait on each where its
    tensor is used). `group` names the group in errors and books the time."""
    if not ops:
        return []
    named = group or Group("p2p", [])
    works = _call("batch_isend_irecv", named, lambda: dist.batch_isend_irecv(ops))
    me = named.ranks[named.rank] // named.node_size if named.ranks else 0
    inter = [_nbytes(o.tensor) if o.peer // named.node_size != me else 0 for o in ops]  # o.peer: a global rank
    if len(works) != len(ops):  # NCCL coalesces a batch into one work: every op waits for all of it
        batch = named.issued(_AllOf(works), "batch_isend_irecv", sum(_nbytes(o.tensor) for o in ops), sum(inter))
        return [batch] * len(ops)
    return [named.issued(w, "send" if o.op is dist.isend else "recv", _nbytes(o.tensor), i)
            for w, o, i in zip(works, ops, inter)]


class _AllOf:
    """Several torch works as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def broadcast(t: torch.Tensor, src: int, group: Group):
    """In-place broadcast from group rank `src`; ring (pipelined) model: every rank but the one
    just before `src` in the ring forwards the buffer once."""
    group.check_device("broadcast", t)
    if group.size == 1:
        return None
    group._count_ring("broadcast", _nbytes(t) if group.rank != (src - 1) % group.size else 0)
    return _issue("broadcast", group, lambda: dist.broadcast(t, group.ranks[src], group=group.pg, async_op=True),
                  False, _nbytes(t))
