"""Tensor parallelism with sequence parallelism (Megatron-style): the collectives and roles of the one
Linear. Which module gets which role and shards is the plan table in tp/plan.py.

Legend: B batch, S full sequence (this rank's CP shard under context parallelism), s = S/N the
sequence shard, N tp size, D model dim, V vocabulary (V/N per rank), H/K query/kv heads, Dh head dim.

Layout of one block under TP+SP (activations between blocks are (B, s, D), sharded on dim 1 over tp):

    x (B, s, D) -> attn_norm (on the shard; weight replicated, grad group "dp_cp_tp")
      -> wqkv  column-parallel: all-gather S (bwd: reduce-scatter dx) -> (B, S, (H/N + 2 K_loc) Dh);
               keeps the (B, s, D) shard for its weight gradient, all-gathered again in backward
               beside the input-gradient GEMM (`KeepSequenceShard`; an FP8 cache: `KeepFp8SequenceShard`)
      -> attention over the local heads (full sequence)
      -> wo    row-parallel: GEMM -> (B, S, D) partial sums -> reduce-scatter S (bwd: all-gather) -> (B, s, D)
    + residual on the shard, ffn_norm on the shard
      -> dense SwiGLU / MoE shared experts: w13 column-parallel ([gate | up] each split), w2 row-parallel
      -> MoE routed experts: router (replicated gate, "dp_cp_tp") and experts see the (B*s, D) tokens of
         this rank's shard; routed experts are not tensor-parallel (expert parallelism folds over
         dp x cp x tp; with ep = 1 they are replicated and their "edp" gradient group includes tp).

Embedding: vocab-parallel (rows [r V/N, (r+1) V/N) on tp rank r); tokens outside the shard give zero,
then one reduce-scatter along S sums the ranks' rows and leaves (B, s, D) (bwd: all-gather).
Head: column-parallel over the vocabulary (all-gather S inside) -> logits (B, S, V/N); the loss is
`VocabParallelCrossEntropy` (max and sum-exp all-reduced over tp, the target logit from its owner),
which returns the same summed loss on every tp rank and never builds (B, S, V) on one rank.

Kv heads: split over tp when N <= K; when K < N each kv head is replicated on the N/K consecutive tp
ranks whose query heads use it. Each of those ranks computes only its own heads' share of the kv
rows' gradient, so a gradient hook sums those rows over the "tp_kv" subgroup (the ranks sharing the
head), and a grad-norm weight of 1/(N/K) on those rows (in the placement) lets ZeRO-1 count them once in the
global gradient norm.

MLA: the latent projection wa (x -> [c_q | c_kv | k_rope]) is replicated and runs on the sequence
shard; one all-gather of those latents (narrower than x) replaces the column-parallel gather; the
up-projections wq_b / wkv_b are split by heads with no collective of their own (their input is the
gathered latent, whose gradient the gather's reduce-scatter sums); wo is row-parallel. The latent
norms and wa are "dp_cp_tp". MTP: the input projection eh_proj is replicated on the shard
("dp_cp_tp"); the MTP block is split like any block.

Gradient groups: tp-sharded weights "dp_cp" (each tp rank holds distinct values); norm weights and
router gates "dp_cp_tp" (replicated over tp, each rank's gradient covers only its sequence shard).
Per block, forward: 2 all-gathers + 2 reduce-scatters of (B, S, D); backward the same plus the 2
re-gathers of the kept shards (an FP8 cache's: its FP8 data, and blockwise scales; tensorwise adds a 4-byte
all-reduce (max) of the amax in forward). Plus the embedding (1 reduce-scatter fwd, 1 all-gather bwd), the
head (1 all-gather fwd, 1 all-gather of its kept shard and 1 reduce-scatter bwd) and the loss (2
all-reduces of B*S and 2*B*S fp32). All collectives go through `comm`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_lc.model.transformer import masked_sum
from moe_lc.ops.fp8_linear import KeepFp8ForWgrad
from moe_lc.ops.linear import KeepInput
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.tp.fp8_sequence_shard import KeepFp8SequenceShard

SEQ_DIM = 1  # activations are (B, S, D)


# -- collectives along the sequence dim (no autograd) ------------------------------------------------
def _check_seq(x: torch.Tensor, group: Group, divisible: bool) -> None:
    if x.dim() < 2:
        raise ValueError(f"sequence parallelism needs (B, S, ...) activations, got shape {tuple(x.shape)}")
    if divisible and x.shape[SEQ_DIM] % group.size:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} is not divisible by tp={group.size} "
                         "(sequence parallelism shards dim 1 over tp)")


def start_gather_sequence(x_BsD: torch.Tensor, group: Group):
    """gather_sequence issued asynchronously: returns finish(), which waits and gives (B, N*s, ...)."""
    _check_seq(x_BsD, group, divisible=False)
    x_sBD = x_BsD.transpose(0, SEQ_DIM).contiguous()  # comm gathers along dim 0
    out = x_sBD.new_empty((group.size * x_sBD.shape[0], *x_sBD.shape[1:]))
    work = comm.all_gather(out.view(-1), x_sBD.view(-1), group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out.transpose(0, SEQ_DIM)

    return finish


def gather_sequence(x_BsD: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, s, ...) sharded on dim 1 -> (B, N*s, ...) replicated (shards concatenated in group order)."""
    return start_gather_sequence(x_BsD, group)()


def reduce_scatter_sequence(y_BSD: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, S, ...) partial sums on every rank -> (B, S/N, ...): this rank's shard of the sum."""
    _check_seq(y_BSD, group, divisible=True)
    y_SBD = y_BSD.transpose(0, SEQ_DIM).contiguous()
    out = y_SBD.new_empty((y_SBD.shape[0] // group.size, *y_SBD.shape[1:]))
    comm.reduce_scatter(out.view(-1), y_SBD.view(-1), group)
    return out.transpose(0, SEQ_DIM)


# -- autograd mappings: forward and backward collectives in the open ------------------------------
class GatherSequence(torch.autograd.Function):
    """Forward all-gather along S: (B, s, D) shard -> (B, S, D) replicated over tp.
    Backward reduce-scatter: each rank's (B, S, D) partial input grad -> its summed (B, s, D) shard."""

    @staticmethod
    def forward(ctx, x_BsD, group):
        ctx.group = group
        return gather_sequence(x_BsD, group)

    @staticmethod
    def backward(ctx, dx_BSD):
        return reduce_scatter_sequence(dx_BSD, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """Forward reduce-scatter along S: (B, S, D) partial sums -> (B, s, D) shard of the sum.
    Backward all-gather: the (B, s, D) shard grads -> (B, S, D), the grad of every rank's partial."""

    @staticmethod
    def forward(ctx, y_BSD, group):
        ctx.group = group
        return reduce_scatter_sequence(y_BSD, group)

    @staticmethod
    def backward(ctx, dy_BsD):
        return gather_sequence(dy_BsD, ctx.group), None


class CopyToTP(torch.autograd.Function):
    """TP without SP, before a column-parallel GEMM: forward identity (x replicated over tp);
    backward all-reduce of the partial input grads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        dx = dx.contiguous().clone()
        comm.all_reduce(dx, ctx.group)
        return dx, None


class ReduceFromTP(torch.autograd.Function):
    """TP without SP, after a row-parallel GEMM: forward all-reduce of the partial outputs;
    backward identity (the output grad is replicated over tp)."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        comm.all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class KeepSequenceShard(KeepInput):
    """A column-parallel Linear's input kept for its weight gradient as this rank's (B, s, D) sequence
    shard, all-gathered again in backward: started before the input-gradient GEMM, waited after it
    (`begin_restore`). One use: made per forward call for that call's shard, which `save` hands to
    autograd (so saved-tensor hooks, offload and recomputation see it) and forgets. `inner`, a keep that
    keeps the input as is, decides what a deferred W holds (HoldFp8ForWgrad: FP8 operands)."""

    def __init__(self, shard_BsD: torch.Tensor, group: Group, inner: KeepInput):
        self._shard, self.group, self.inner = shard_BsD, group, inner

    def save(self, x2, counts, gemms) -> tuple:
        shard, self._shard = self._shard, None
        return (shard,)

    def begin_restore(self, saved, counts, gemms):
        (shard_BsD,) = saved
        gathered = start_gather_sequence(shard_BsD, self.group)
        return lambda: gathered().reshape(-1, shard_BsD.shape[-1])  # x2's (B S, D) rows

    def restore(self, saved, counts, gemms):
        return self.begin_restore(saved, counts, gemms)()

    def hold_dy(self, dy2, counts, gemms):
        return self.inner.hold_dy(dy2, counts, gemms)

    def hold_input(self, saved, counts, gemms):
        return self.inner.hold_input((self.restore(saved, counts, gemms),), counts, gemms)


# -- TP roles of the one Linear (`linear.tp`) -------------------------------------------------------
class ColumnParallel:
    """Weight rows (output features) split over tp; output (B, S, out/N). With SP the input is the
    (B, s, D) sequence shard, gathered in `enter`; without SP it is replicated."""

    def __init__(self, group: Group, sequence_parallel: bool = True):
        self.group, self.sequence_parallel = group, sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return (GatherSequence if self.sequence_parallel else CopyToTP).apply(x, self.group)

    def keep(self, x_BsD: torch.Tensor, keep: KeepInput) -> KeepInput:
        """How the Linear keeps its input for the weight gradient: under SP the (B, s, D) shard, not the
        gathered (B, S, D) (1/N of the bytes; Megatron-LM does the same), where `keep` keeps the input as
        is; an FP8 cached copy as the FP8 copy of the shard (tp/fp8_sequence_shard.py, where exact)."""
        if self.sequence_parallel and type(keep).save is KeepInput.save:
            return KeepSequenceShard(x_BsD, self.group, keep)
        if self.sequence_parallel and type(keep) is KeepFp8ForWgrad:  # a shared copy (DSA's) stays as made
            return KeepFp8SequenceShard(x_BsD, self.group, keep)
        return keep

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def __repr__(self) -> str:
        return f"column(tp={self.group.size}{', sp' if self.sequence_parallel else ''})"


class RowParallel:
    """Weight columns (input features) split over tp; input (B, S, in/N); the partial (B, S, D)
    outputs are summed in `exit`: reduce-scattered to (B, s, D) with SP, all-reduced without. A bias
    (replicated, grad group "dp_cp_tp") is added by the Linear after that sum, once."""

    sums_outputs = True

    def __init__(self, group: Group, sequence_parallel: bool = True):
        self.group, self.sequence_parallel = group, sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def keep(self, x: torch.Tensor, keep: KeepInput) -> KeepInput:
        return keep

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        return (ReduceScatterSequence if self.sequence_parallel else ReduceFromTP).apply(y, self.group)

    def __repr__(self) -> str:
        return f"row(tp={self.group.size}{', sp' if self.sequence_parallel else ''})"


# -- vocabulary-parallel embedding and cross-entropy ------------------------------------------------
class VocabParallelEmbedding(nn.Module):
    """tokens (B, S) int64, replicated over tp -> hidden (B, s, D) sharded on S over tp.
    weight: (V/N, D), rows [r V/N, (r+1) V/N) of the full table on tp rank r (`Shard("tp", 0)`)."""

    def __init__(self, weight: nn.Parameter, group: Group):
        super().__init__()
        self.weight, self.group = weight, group

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        v_local = self.weight.shape[0]
        local_BS = tokens_BS - self.group.rank * v_local
        outside_BS = (local_BS < 0) | (local_BS >= v_local)
        e_BSD = F.embedding(local_BS.masked_fill(outside_BS, 0), self.weight)
        e_BSD = e_BSD.masked_fill(outside_BS.unsqueeze(-1), 0.0)  # another rank owns these tokens
        return ReduceScatterSequence.apply(e_BSD, self.group)

    def extra_repr(self) -> str:
        return f"vocab/tp={self.weight.shape[0]}, dim={self.weight.shape[1]}, tp={self.group.size}"


VOCAB_CE_ROWS = 1024  # token rows the vocab-parallel cross entropy holds in fp32 at once (the planner's too)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token -log softmax(logits)[label] from vocab shards.  logits (B, S, V/N) on each tp rank
    (vocab entries [r V/N, (r+1) V/N)), labels (B, S) replicated -> loss (B, S) fp32, replicated.
    Backward: (softmax - onehot) restricted to this rank's vocab shard; no communication.

    `VOCAB_CE_ROWS` token rows at a time, in fp32: backward keeps the logits themselves (in their dtype) and
    each row's fp32 max and sum of exponentials, and recomputes the softmax row block by row block with the same
    operations as the forward (so the numbers are the unchunked ones bit for bit), instead of an fp32
    softmax of every logit (Megatron-LM's vocab-parallel cross entropy keeps that: 4 bytes an entry, twice
    16-bit logits) made from a full fp32 copy. Two all-reduces in all, as unchunked: the rows' maxima, then
    their sums and target logits."""

    @staticmethod
    def forward(ctx, logits_BSv, labels_BS, group, ignore_index):
        logits_Tv, labels_T = logits_BSv.flatten(0, 1), labels_BS.flatten()
        v_local = logits_Tv.shape[-1]
        max_T = logits_Tv.amax(dim=-1).float()  # exact in any dtype: no fp32 copy needed
        comm.all_reduce(max_T, group, op=dist.ReduceOp.MAX)
        local_T = labels_T - group.rank * v_local
        owned_T = (local_T >= 0) & (local_T < v_local)
        idx_T = local_T.clamp(0, v_local - 1)
        target_T = (logits_Tv.gather(-1, idx_T.unsqueeze(-1)).squeeze(-1).float() - max_T) * owned_T
        sumexp_T = torch.cat([_shifted_exp(x, m).sum(-1) for x, m in _row_blocks(logits_Tv, max_T)])
        stats_2T = torch.stack([sumexp_T, target_T])  # one all-reduce for both sums
        comm.all_reduce(stats_2T, group)
        sumexp_T, target_T = stats_2T.unbind(0)
        valid_T = labels_T != ignore_index
        loss_T = (sumexp_T.log() - target_T) * valid_T
        ctx.save_for_backward(logits_Tv, max_T, sumexp_T, idx_T, owned_T & valid_T, valid_T)
        ctx.shape = logits_BSv.shape
        return loss_T.view_as(labels_BS)

    @staticmethod
    def backward(ctx, dloss_BS):
        logits_Tv, max_T, sumexp_T, idx_T, hit_T, valid_T = ctx.saved_tensors
        scale_T = dloss_BS.flatten() * valid_T
        out_Tv = torch.empty_like(logits_Tv)
        for lo in range(0, len(logits_Tv), VOCAB_CE_ROWS):
            r = slice(lo, lo + VOCAB_CE_ROWS)
            grad = _shifted_exp(logits_Tv[r], max_T[r]).div_(sumexp_T[r].unsqueeze(-1))  # the softmax
            grad.scatter_add_(-1, idx_T[r].unsqueeze(-1), -hit_T[r].unsqueeze(-1).to(grad.dtype))
            out_Tv[r] = grad.mul_(scale_T[r].unsqueeze(-1))
        return out_Tv.view(ctx.shape), None, None, None


def _row_blocks(logits_Tv: torch.Tensor, max_T: torch.Tensor):
    """(VOCAB_CE_ROWS, V/N) blocks of the logits with their rows' maxima."""
    return zip(logits_Tv.split(VOCAB_CE_ROWS), max_T.split(VOCAB_CE_ROWS))


def _shifted_exp(logits_Rv: torch.Tensor, max_R: torch.Tensor) -> torch.Tensor:
    """exp(logits - row max) (R, V/N) fp32, one new fp32 tensor (the subtraction's; exp in place)."""
    return (logits_Rv.float() - max_R.unsqueeze(-1)).exp_()


class VocabParallelCrossEntropy(nn.Module):
    """The vocab-parallel `CrossEntropySum`: logits (B, S, V/N), labels (B, S), loss_mask (B, S) or
    None -> fp32 loss summed over valid tokens, the same value on every tp rank; `token_losses`: the
    per-token losses (B, S) fp32, replicated."""

    def __init__(self, group: Group, ignore_index: int = -100):
        super().__init__()
        self.group, self.ignore_index = group, ignore_index

    def forward(self, logits_BSv, labels_BS, loss_mask_BS=None):
        return masked_sum(self.token_losses(logits_BSv, labels_BS), loss_mask_BS)

    def token_losses(self, logits_BSv, labels_BS):
        return _VocabParallelCE.apply(logits_BSv, labels_BS, self.group, self.ignore_index)


# -- a norm over a whole row whose features are split over tp (qk_norm = "full") --------------------
class SumOverTP(torch.autograd.Function):
    """Forward all-reduce (sum) over tp; backward all-reduce too: every rank's output feeds only its
    own features' path, so each rank's gradient is a partial of the sum's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous().clone()
        comm.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, dx):
        dx = dx.contiguous().clone()
        comm.all_reduce(dx, ctx.group)
        return dx, None


class RowSquaresOverTP:
    """The `sum_squares` seam of a `WideRMSNorm` under TP: this rank's per-row sum of squares (..., 1) ->
    the whole row's. `copies`: how many tp ranks hold each slice (kv heads replicated when K < N), whose
    squares the all-reduce counts that many times."""

    def __init__(self, group: Group, copies: int = 1):
        self.group, self.copies = group, copies

    def __call__(self, sum_squares: torch.Tensor) -> torch.Tensor:
        total = SumOverTP.apply(sum_squares, self.group)
        return total / self.copies if self.copies > 1 else total

    def __repr__(self) -> str:
        return f"sum_squares(tp={self.group.size}, copies={self.copies})"


# -- replicated kv heads (K < N) --------------------------------------------------------------------
def kv_share_group(dims: ParallelDims, n_kv_heads: int) -> Group:
    """The "tp_kv" subgroup: the N/K consecutive tp ranks sharing this rank's kv head (collective on
    first use: every rank creates every subgroup)."""
    if "tp_kv" not in dims.groups:
        share = dims.tp // n_kv_heads
        partition = [ranks[i:i + share] for ranks in dims.group_ranks("tp") for i in range(0, dims.tp, share)]
        dims.add_group("tp_kv", partition)
    return dims["tp_kv"]


def replicated_rows_grad(param: nn.Parameter, start: int, group: Group):
    """Rows [start:] of `param` are replicated over `group` and each rank computes a partial gradient.
    Returns (hook, weight): the gradient hook that sums those rows over the group before the gradient is
    accumulated (also on the deferred weight-gradient path, which fires tensor hooks), and the rows'
    grad-norm weight (1/|group| for the replicated ones, so the global norm counts them once)."""

    def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:  # the weight gradient was deferred: its "W" pass calls this hook later
            return None
        rows = grad[start:].contiguous().clone()
        comm.all_reduce(rows, group)
        return torch.cat([grad[:start], rows])

    weight = torch.ones(param.shape[0], *([1] * (param.dim() - 1)))
    weight[start:] = 1.0 / group.size
    return hook, weight


class SequenceGather(nn.Module):
    """All-gather of sequence shards as a module (MLA's latents): (B, s, C) -> (B, S, C)."""

    def __init__(self, group: Group):
        super().__init__()
        self.group = group

    def forward(self, x_BsC: torch.Tensor) -> torch.Tensor:
        return GatherSequence.apply(x_BsC, self.group)
