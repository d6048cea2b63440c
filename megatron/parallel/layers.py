"""Tensor-parallel modules: sharded linears, vocab-parallel embedding and output head, parallel regions.

The linears stay plain `nn.Linear`
----------------------------------
A column- or row-parallel linear is an `nn.Linear` whose weight was cut to this rank's piece
(`shard_column_parallel`, `shard_row_parallel`); the communication lives in its *parent*, the module
that owns the pair (column-parallel in, row-parallel out): `SelfAttention` (linear_qkv -> linear_proj)
and `MLP` (linear_fc1 -> linear_fc2). `make_tensor_parallel_region` turns such a parent into a
subclass of its own class (as FSDP2's `fully_shard` does) whose forward is

    enter (copy-to-TP-region, or all-gather along the sequence)  ->  the parent's own forward
        ->  leave (all-reduce, or reduce-scatter along the sequence)

Why not wrapper modules around each linear: the linears keep their names and state_dict keys
(`decoder.layers.0.self_attention.linear_qkv.weight`), `convert_to_fp8` finds and swaps them for
`Fp8Linear` exactly as on one device, and `print(model)` shows `TensorParallelSelfAttention(...)`.

Row-parallel biases are not supported yet: every rank would add the bias to its partial sum.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.layout import TP_SHARD_DIM, ShardSpec, shard_tensor
from megatron.parallel.tensor_parallel import (
    enter_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    leave_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    sequence_shard,
)

__all__ = ["SEQUENCE_PARALLEL_GRAD", "TP_SHARD_DIM", "SequenceShardedEmbedding", "VocabParallelEmbedding",
           "VocabParallelOutputHead", "make_tensor_parallel_region", "shard_column_parallel", "shard_row_parallel"]

# Parameter attribute: a replicated parameter whose gradient comes from this rank's sequence shard only
# (sequence parallel): it must be summed over the TP group before the optimizer step.
SEQUENCE_PARALLEL_GRAD = "sequence_parallel_grad"


def _shard_parameter(module: nn.Module, name: str, spec: ShardSpec, rank: int, size: int) -> None:
    old: nn.Parameter = getattr(module, name)
    new = nn.Parameter(shard_tensor(old.detach(), spec, rank, size), requires_grad=old.requires_grad)
    setattr(new, TP_SHARD_DIM, spec.dim)
    setattr(module, name, new)


def shard_column_parallel(linear: nn.Linear, rank: int, size: int, chunks: int = 1) -> None:
    """Keep this rank's output rows (and bias) of `linear`; `chunks` = 2 for [gate | up]."""
    spec = ShardSpec(0, chunks)
    _shard_parameter(linear, "weight", spec, rank, size)
    if linear.bias is not None:
        _shard_parameter(linear, "bias", spec, rank, size)
    linear.out_features = linear.weight.shape[0]


def shard_row_parallel(linear: nn.Linear, rank: int, size: int) -> None:
    """Keep this rank's input columns of `linear`; the partial outputs are summed by the parent."""
    if linear.bias is not None:
        raise ValueError("row-parallel linears with a bias are not supported yet under "
                         "--tensor-model-parallel-size > 1: use --disable-bias-linear")
    _shard_parameter(linear, "weight", ShardSpec(1), rank, size)
    linear.in_features = linear.weight.shape[1]


class _TensorParallelRegion:
    """Mixin placed before a module's own class: communication around its forward (module docstring)."""

    tp_group: Any
    sequence_parallel: bool

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = enter_tensor_parallel_region(hidden, self.tp_group, self.sequence_parallel)
        out = super().forward(hidden, *args, **kwargs)  # type: ignore[misc]
        return leave_tensor_parallel_region(out, self.tp_group, self.sequence_parallel)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        tp = f"tensor_parallel={self.tp_group.size()}, sequence_parallel={self.sequence_parallel}"
        return f"{base}, {tp}" if base else tp


_REGION_CLASSES: dict[type, type] = {}


def make_tensor_parallel_region(module: nn.Module, group: Any, sequence_parallel: bool) -> nn.Module:
    """Make `module` (in place) run inside a tensor-parallel region; returns it."""
    cls = type(module)
    if issubclass(cls, _TensorParallelRegion):
        raise ValueError(f"{cls.__name__} is already a tensor-parallel region")
    if cls not in _REGION_CLASSES:
        _REGION_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (_TensorParallelRegion, cls), {})
    module.__class__ = _REGION_CLASSES[cls]
    module.tp_group = group
    module.sequence_parallel = sequence_parallel
    return module


class VocabParallelEmbedding(nn.Embedding):
    """An `nn.Embedding` holding vocabulary rows [start, start + V/tp) of the full table.

    Tokens owned by other ranks look up zeros here; summing over the TP group (all-reduce, or
    reduce-scatter along the sequence under sequence parallel) gives every rank the full embedding.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any, rank: int, sequence_parallel: bool,
                 **kwargs: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.tp_group = group
        self.vocab_start = rank * num_embeddings
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Any, rank: int, size: int,
                       sequence_parallel: bool) -> "VocabParallelEmbedding":
        spec = ShardSpec(0)
        new = cls(embedding.num_embeddings // size, embedding.embedding_dim, group, rank, sequence_parallel,
                  device="meta")
        new.weight = nn.Parameter(shard_tensor(embedding.weight.detach(), spec, rank, size),
                                  requires_grad=embedding.weight.requires_grad)
        setattr(new.weight, TP_SHARD_DIM, 0)
        new.train(embedding.training)
        return new

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        foreign = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_start={self.vocab_start}, sequence_parallel={self.sequence_parallel}"


class SequenceShardedEmbedding(nn.Embedding):
    """A replicated `nn.Embedding` (learned positions) that looks up only this rank's sequence shard."""

    def __init__(self, *args: Any, group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp_group = group

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Any) -> "SequenceShardedEmbedding":
        new = cls(embedding.num_embeddings, embedding.embedding_dim, group=group, device="meta")
        new.weight = embedding.weight
        new.train(embedding.training)
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(sequence_shard(ids, self.tp_group))


class VocabParallelOutputHead(nn.Module):
    """The LM head on vocabulary-sharded weights: local logits [b, s, V/tp] and the parallel cross-entropy.

    Without labels (evaluation of logits, generation) the logits are gathered along the vocabulary.
    """

    def __init__(self, group: Any, sequence_parallel: bool) -> None:
        super().__init__()
        self.tp_group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = enter_tensor_parallel_region(hidden, self.tp_group, self.sequence_parallel)
        logits = F.linear(hidden, weight)
        if labels is None:
            return gather_from_tensor_parallel_region(logits, self.tp_group)
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group)

    def extra_repr(self) -> str:
        return f"tensor_parallel={self.tp_group.size()}, sequence_parallel={self.sequence_parallel}"
