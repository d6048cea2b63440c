"""What code outside DeepSpeed reads of ZeRO-3's partitioned parameters and optimizer (and of FSDP2's sharded ones:
`local_data`).

A parameter built partitioned under ZeRO-3 (megatron/model/build.py) holds an empty placeholder as its data; its
full shape and size are DeepSpeed's `ds_shape` and `ds_numel`. Between steps ZeRO-3's optimizer keeps the client
optimizer's param groups empty (each step call fills in one sub-group's flat FP32 partition);
`zero3_partitions_in_groups` puts this rank's partitions back for a block, as DeepSpeed's own state_dict does.
Everything here also takes unpartitioned parameters and ZeRO 0-2 optimizers, and then changes nothing.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's shape, also when ZeRO-3 has partitioned it."""
    return getattr(param, "ds_shape", param.shape)


def full_numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


def local_data(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of the parameter, detached: ZeRO-3's partition (`ds_tensor`) while the parameter is not
    gathered, FSDP2's shard (a DTensor's local tensor), else the whole tensor."""
    partition = getattr(param, "ds_tensor", None)
    if partition is not None and param.numel() == 0:
        return partition.detach()
    data = param.detach()
    return data.to_local() if hasattr(data, "to_local") else data


@contextlib.contextmanager
def gathered(param: torch.Tensor) -> Iterator[torch.Tensor]:
    """The whole parameter, detached, to read inside the block: ZeRO-3 gathers it from its partitions and FSDP2 its
    DTensor from the shards (both collectives: every rank holding a part calls this); anything else is itself."""
    if hasattr(param, "ds_tensor"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield param.detach()
        return
    data = param.detach()
    yield data.full_tensor() if hasattr(data, "full_tensor") else data


@contextlib.contextmanager
def zero3_partitions_in_groups(zero_optimizer: Any) -> Iterator[None]:
    """This rank's flat FP32 partitions in the client optimizer's param groups for the block (ZeRO-3 only)."""
    fill = getattr(zero_optimizer, "_set_fp32_optimizer_param_groups", None)
    if fill is None:  # ZeRO 0-2: the groups hold their tensors
        yield
        return
    fill()
    try:
        yield
    finally:
        zero_optimizer._clear_fp32_optimizer_param_groups()
