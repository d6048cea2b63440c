"""Gradients under tensor parallelism: sequence-parallel reduction of replicated parameters, global-norm clipping.

- Sequence parallel: a replicated parameter (norm weights, learned position embeddings) sees only this
  rank's sequence shard, so its gradient is a partial sum: `reduce_sequence_parallel_grads` sums it over
  the TP group (one flat all-reduce) before clipping and the optimizer step. Without sequence
  parallel the replicated regions compute identical full gradients on every TP rank: nothing to do.
- Clipping: the norm must be that of the full logical gradient, the same number on every rank (or ranks
  would clip differently and their replicas drift apart). Sharded parameters contribute the sum of their
  shards' squares over the TP group; replicated ones are counted once, not tp times. DDP has already
  made gradients identical across data-parallel replicas, so no data-parallel reduction is needed.
- FSDP2 (its gradients DTensors sharded over the data-parallel ranks): each rank works on its local shards, and
  the squares are summed over every rank holding a piece (`norm_group`: data- and tensor-parallel ranks).
  `fully_shard` replaces the parameters, so their TP roles are copied onto the new ones (`copy_parallel_roles`).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from megatron import comm
from megatron.dtypes import at_least_fp32
from megatron.parallel.layers import SEQUENCE_PARALLEL_GRAD, TP_SHARD_DIM
from megatron.parallel.tensor_parallel import all_reduce_sum, group_rank


PARALLEL_ROLES = (TP_SHARD_DIM, SEQUENCE_PARALLEL_GRAD)


def copy_parallel_roles(source: nn.Parameter, target: nn.Parameter) -> None:
    """Give `target` the tensor-parallel roles of `source` (what clipping and the sequence-parallel sum read)."""
    for attr in PARALLEL_ROLES:
        if hasattr(source, attr):
            setattr(target, attr, getattr(source, attr))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters and gradients); any other tensor as it is."""
    return getattr(tensor, "_local_tensor", tensor)


@torch.no_grad()
def reduce_sequence_parallel_grads(model: nn.Module, tp_group: Any) -> None:
    """Sum the gradients of sequence-parallel replicated parameters over the TP group, in place."""
    grads = [local(p.grad) for p in model.parameters()
             if getattr(p, SEQUENCE_PARALLEL_GRAD, False) and p.grad is not None]
    if not grads or not comm.is_active(tp_group):
        return
    flat = torch.cat([at_least_fp32(g.reshape(-1)) for g in grads])
    all_reduce_sum(flat, tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, tp_group: Any, norm_group: Any = None,
                   replicas: int = 1) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the logical (unsharded) model; returns the total L2 norm. `max_norm` 0
    (`--clip-grad 0`, Megatron's "no clipping") computes the norm and clips nothing.

    The squares are summed over `norm_group` (default: the tensor-parallel group; a pipeline sums over every rank,
    stages included) and divided by `replicas`, the number of copies of each gradient that group holds (a
    pipeline's data-parallel replicas). At TP size 1 with no other group it is exactly torch's function (unless
    MEGATRON_FORCE_COLLECTIVES=1 gives TP a one-rank group). The norm stays on the device: no host
    synchronisation here.
    """
    params = [p for p in params if p.grad is not None]
    max_norm = max_norm if max_norm > 0 else float("inf")  # a coefficient of exactly 1: the gradients unchanged
    norm_group = tp_group if norm_group is None else norm_group
    if not comm.is_active(norm_group):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # FSDP2's sharded gradients give a DTensor norm, reduced over the mesh: the plain value, on every rank.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    device = params[0].grad.device if params else torch.device("cpu")
    sharded = [local(p.grad) for p in params if hasattr(p, TP_SHARD_DIM)]
    replicated = [local(p.grad) for p in params if not hasattr(p, TP_SHARD_DIM)]

    def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([at_least_fp32(g).pow(2).sum().to(device) for g in grads]).sum()

    # One all-reduce: every rank's shards, plus the replicated part from TP rank 0 only.
    total = sum_of_squares(sharded)
    if group_rank(tp_group) == 0:
        total = total + sum_of_squares(replicated)
    total = all_reduce_sum(total.reshape(1), norm_group)[0]
    total_norm = (total / replicas).sqrt()  # exact for one replica
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        grad = local(p.grad)
        grad.mul_(clip_coef.to(grad.device, grad.dtype))
    return total_norm
