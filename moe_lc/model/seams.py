"""Seams: the places where code outside the model changes how a module runs, as context parallelism
swaps an attention module's `.core` for ring attention. The model defines the seams and their plain
defaults and never imports what plugs into them; the layer plan (moe_lc/parallel/layer_plan.py)
decides, in one place, what each module gets.

  replay      `module.replay(fn, *args)` runs one piece of the module's forward. The default runs it
              now and lets autograd keep what that piece saves; recomputation (moe_lc/model/
              recompute.py) plugs in a replay that keeps only the piece's inputs and runs it again in
              backward. Pieces: an RMSNorm's fp32 math, attention's RoPE and core, a whole block.
  activation  `module.activation(down, gate_up, *args)` is a SwiGLU's down(silu(gate) * up, *args);
              recomputation plugs in one that keeps only gate|up for backward, FP8 activation caching
              one that keeps gate|up in FP8.
  logits      a router's `logits(gate, x)`: gate(x) in fp32; recomputation plugs in one that rebuilds
              the fp32 copy of x in backward instead of keeping it.
  core        an attention module's kernel call (LocalAttention; ring attention under CP; either inside
              QK-clip's forward guard, moe_lc/parallel/qk_guard.py, which DSA's sparse stage, calling its
              own kernel, reaches through `logit_guard`).
  out_proj    an attention module's `out_proj(wo, attend)`: wo(attend()), attend() the (B, S, H, Dv)
              attention output; FP8 activation caching (moe_lc/model/fp8_cache.py) plugs in one that
              keeps that output once, in FP8, for both the core's backward and wo's weight gradient.
  gemms / tp  the one Linear's GEMMs (fp8 plugs in there) and tensor-parallel role (moe_lc/ops/linear.py).
  mtp_embed   the embedding the MTP modules use on a pipeline stage that holds none: a `Borrowed`
              reference to the model's embedding, which the rank's first stage holds (DualPipe keeps
              both ends on one rank).
  dispatcher  an MoE layer's `TokenDispatcher` (moe.py): local by default; expert parallelism plugs in
              an all-to-all one whose rows travel as `Transfer`s between the layer's phases.
  run_region  `module.run_region(region, *args)` runs one of the module's compiled regions
              (moe_lc/ops/regions.py): `run_now` by default, the plain function; `train.compile` plugs
              in the rank's compiled runner (moe_lc/parallel/compile.py). A dispatcher has one too.
  hold        `module.hold(chain, modules, backward=True)`: a chain of phases that reads the parameters of
              `modules`, returned as the chain to run. The default returns it as it is; ZeRO-3 (moe_lc/
              parallel/zero/param_gather.py) plugs in one that gathers those parameters before the chain's forward
              and (backward) before its backward, and frees them after each; an offloaded optimizer that
              defers its updates (moe_lc/parallel/zero/host_step.py) one that settles them before the
              forward. The model marks the embedding's, each block's and the head's chains (a block an MTP
              module calls is inside the head's).
  count_loads a router's `count_loads(ctx)`: whether this run of an MoE layer's forward (`ctx`, its
              phase state) books its routing in the step's ForwardStats; every run by default,
              the first only where full recomputation replays the router (moe_lc/model/recompute.py).
"""

from __future__ import annotations


def run_now(fn, *args):
    """The default replay seam: fn(*args), nothing special."""
    return fn(*args)


def hold_now(chain: list, modules, backward: bool = True) -> list:
    """The default hold seam: the chain as it is (every parameter is always present)."""
    return chain


def project_now(wo, attend):
    """The default out_proj seam: wo(attend()) with the (B, S, H, Dv) output flattened over its heads."""
    return wo(attend().flatten(2))


class Borrowed:
    """Calls `module` without owning it: a plain object, so the module it reaches is not registered twice
    (its parameters stay where they are, under their owner's names)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        return self.module(*args)

    def __repr__(self) -> str:
        return f"Borrowed({type(self.module).__name__})"


class Transfer:
    """Rows in flight between two phases of a chain (a dispatcher's all-to-all). A phase returns one in
    place of a tensor; whoever runs the chain (`run_phases`, or a pipeline's phased run) calls `start()`
    right after that phase and gives the next phase `finish(stand_in)`. Work done between the two
    overlaps the transfer.

    start() -> a stand-in tensor with the rows' shape and no data: it carries the autograd edge across
    the phase boundary. finish(stand_in) -> the received rows (waits). In backward the roles swap: the
    reverse transfer of the gradient starts in finish's backward and is waited in start's.
    """

    def start(self):
        raise NotImplementedError

    def finish(self, stand_in):
        raise NotImplementedError


def through(state: tuple) -> tuple:
    """A phase's outputs with every Transfer run to completion at once (start, then finish)."""
    return tuple(t.finish(t.start()) if isinstance(t, Transfer) else t for t in state)
