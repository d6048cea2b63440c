"""The communication of tensor parallelism, as autograd functions (each one's backward is its dual).

Activations are batch-first, [b, s, h]: the sequence dimension of sequence parallelism is dim 1, the
feature dimension the last one. `group` is the tensor-parallel process group; with None (TP = 1)
every function is the identity.

    function                          forward                         backward
    copy_to_tensor_parallel_region    identity                        all-reduce
    reduce_from_tensor_parallel_region all-reduce                     identity
    gather_from_tensor_parallel_region all-gather along features      split along features
    scatter_to_sequence_parallel_region split along the sequence      all-gather along the sequence
    gather_from_sequence_parallel_region all-gather along the sequence reduce-scatter along the sequence
    reduce_scatter_to_sequence_parallel_region reduce-scatter (seq.)  all-gather along the sequence

Why these pairs: a column-parallel linear reads the same input on every TP rank, so the gradient of
that input is the sum of every rank's contribution (copy -> all-reduce in backward). A row-parallel
linear produces partial sums, added once across ranks (all-reduce in forward); the gradient of a sum
is passed unchanged to each term. Sequence parallelism splits the all-reduce into its two halves,
reduce-scatter then all-gather, and keeps the activations between them (norms, dropout, residual)
sharded along the sequence: the same communication volume, 1/tp of the activation memory.

Communication runs in the tensor's own dtype (bf16 partial sums under autocast, as Megatron does), through
`megatron.comm` (which places it on the backend's device).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron import comm

SEQUENCE_DIM = 1


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else 0


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return comm.all_reduce(x.contiguous().clone(), group)


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    return torch.cat(comm.all_gather(x.contiguous(), group), dim=dim)


def _split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} over {size} tensor-parallel ranks")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} over {size} ranks")
    return comm.reduce_scatter([p.contiguous() for p in x.chunk(size, dim=dim)], group)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, -1, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, SEQUENCE_DIM, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank used the whole gathered sequence: each shard's gradient sums over all ranks.
        return _reduce_scatter(grad, SEQUENCE_DIM, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, SEQUENCE_DIM, ctx.group), None


def _active(group: Any) -> bool:
    return comm.is_active(group)


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToRegion.apply(x, group) if _active(group) else x


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group) if _active(group) else x


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherFeatures.apply(x, group) if _active(group) else x


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ScatterSequence.apply(x, group) if _active(group) else x


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherSequence.apply(x, group) if _active(group) else x


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceScatterSequence.apply(x, group) if _active(group) else x


def enter_tensor_parallel_region(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """Input of column-parallel linears: the full activation on every rank."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_parallel_region(x, group)


def leave_tensor_parallel_region(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """Output of row-parallel linears: sum the partial results (and shard them along the sequence)."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group)
    return reduce_from_tensor_parallel_region(x, group)


def sequence_shard(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's slice of the sequence dimension, without autograd (for integer ids)."""
    return _split(x, SEQUENCE_DIM, group) if _active(group) else x


def all_reduce_max(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """In-place MAX all-reduce (no gradient; NaN is sent as +inf)."""
    return comm.all_reduce(x, group, comm.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """In-place SUM all-reduce (no gradient)."""
    return comm.all_reduce(x, group)
