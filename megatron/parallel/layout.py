"""Which parameters tensor parallelism shards, along which dimension, and how: the layout facts in one place.

    parameter (state_dict key suffix)         dim  how                     kind
    embedding.word_embeddings.weight          0    contiguous vocab rows   vocab-parallel
    output_layer.weight                       0    contiguous vocab rows   vocab-parallel (column)
    self_attention.linear_qkv.{weight,bias}   0    contiguous rows         column-parallel
    self_attention.linear_proj.weight         1    contiguous columns      row-parallel
    mlp.linear_fc1.{weight,bias}              0    [gate_r | up_r]         column-parallel
    mlp.linear_fc2.weight                     1    contiguous columns      row-parallel
    everything else (norms, position emb.)    -    replicated

- `linear_qkv` rows are grouped per key/value head ([q heads of the group | k | v] per group), so a
  contiguous split hands each rank whole KV groups when num_kv_heads % tp == 0; its query heads come
  out in the same order as the columns of `linear_proj`, which are split the same contiguous way.
- `linear_fc1` rows are [gate | up] and h = silu(gate) * up needs matching gate and up channels on a
  rank, so each half is split separately and rank r holds [gate_r | up_r]: the same layout as the full
  layer, at 1/tp of the width. `linear_fc2` columns are split like those channels.
- The padded vocabulary is a multiple of tp (`--make-vocab-size-divisible-by` x tp).

`shard_tensor` and `merge_shards` are exact inverses; they work on checkpoints as well as modules, and on
meta tensors (the model is sharded before its parameters exist, `megatron/model/build.py`).
`shard_indices` says which positions of the full tensor a piece holds, by cutting an index vector with
`shard_tensor` itself: the per-tensor initialization generates only those (`megatron/model/init.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.config import ModelConfig


# Parameter attribute: the dimension along which this parameter is sharded over the TP group.
TP_SHARD_DIM = "tensor_parallel_dim"


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    # The tensor is `chunks` equal blocks along `dim`, each split over the ranks separately ([gate | up]: 2).
    chunks: int = 1


def shard_spec(name: str, config: ModelConfig) -> Optional[ShardSpec]:
    """The ShardSpec of state_dict key `name`, or None for a replicated tensor."""
    if name.endswith("embedding.word_embeddings.weight") or name.endswith("output_layer.weight"):
        return ShardSpec(0)
    if name.endswith("self_attention.linear_qkv.weight") or name.endswith("self_attention.linear_qkv.bias"):
        return ShardSpec(0)
    if name.endswith("mlp.linear_fc1.weight") or name.endswith("mlp.linear_fc1.bias"):
        return ShardSpec(0, 2 if config.swiglu else 1)
    if name.endswith("self_attention.linear_proj.weight") or name.endswith("mlp.linear_fc2.weight"):
        return ShardSpec(1)
    return None


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full` (a copy)."""
    length = full.shape[spec.dim]
    if length % (spec.chunks * size):
        raise ValueError(f"dimension {spec.dim} of size {length} does not split into {spec.chunks} x {size} pieces")
    blocks = full.chunk(spec.chunks, dim=spec.dim)
    return torch.cat([b.chunk(size, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).clone()


def shard_indices(length: int, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Positions along `spec.dim` of the full tensor (of that length there) that rank `rank`'s piece holds,
    in the piece's order; int64 on the CPU. Defined by `shard_tensor`, so the two cannot disagree."""
    return shard_tensor(torch.arange(length), ShardSpec(0, spec.chunks), rank, size)


def merge_shards(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order (inverse of `shard_tensor`)."""
    per_rank = [s.chunk(spec.chunks, dim=spec.dim) for s in shards]
    return torch.cat([torch.cat([p[c] for p in per_rank], dim=spec.dim) for c in range(spec.chunks)], dim=spec.dim)


def shard_state_dict(full: dict[str, torch.Tensor], config: ModelConfig, rank: int,
                     size: int) -> dict[str, torch.Tensor]:
    """A TP=1 state dict cut into rank `rank`'s piece of a TP=`size` model (replicated tensors copied)."""
    out = {}
    for name, tensor in full.items():
        spec = shard_spec(name, config)
        out[name] = tensor.clone() if spec is None or size == 1 else shard_tensor(tensor, spec, rank, size)
    return out


def merge_state_dicts(shards: list[dict[str, torch.Tensor]], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A TP=1 state dict from the state dicts of every TP rank, in rank order (replicas taken from rank 0)."""
    out = {}
    for name, tensor in shards[0].items():
        spec = shard_spec(name, config)
        replicated = spec is None or len(shards) == 1
        out[name] = tensor.clone() if replicated else merge_shards([s[name] for s in shards], spec)
    return out
