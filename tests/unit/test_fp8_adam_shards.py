"""Fp8AdamW's view of FSDP2's shards (megatron/optimizer/fp8_adam_shards.py), on stand-ins for DTensor parameters:
torch.chunk's row split, the element offsets that key stochastic rounding, and the block-size check
(tests/e2e/test_fsdp2_fp8_adam.py trains)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Shard

from megatron.optimizer.fp8_adam_shards import Rows, check_blocks, flat_offset


def _shard(shape: tuple, world: int, rank: int):
    mesh = SimpleNamespace(size=lambda: world, get_local_rank=lambda: rank)
    return SimpleNamespace(_local_tensor=torch.empty(0), device_mesh=mesh, placements=(Shard(0),), shape=shape)


@pytest.mark.parametrize("rows,world", [(10, 4), (5, 2), (2, 4), (128, 2)])
def test_the_rows_are_torch_chunks_split_and_tile_the_tensor(rows, world):
    pieces = torch.arange(rows * 3).reshape(rows, 3).chunk(world)
    for rank in range(world):
        r = Rows.of(_shard((rows, 3), world, rank))
        piece = pieces[rank] if rank < len(pieces) else torch.empty(0, 3)
        assert r.numel(rank) == piece.numel()
        if piece.numel():
            assert r.start(rank) == int(piece.reshape(-1)[0]) == flat_offset(_shard((rows, 3), world, rank))
    assert sum(Rows.of(_shard((rows, 3), world, 0)).numel(r) for r in range(world)) == rows * 3


def test_a_block_size_that_would_straddle_a_shard_is_refused_naming_the_fix():
    check_blocks(_shard((128, 64), 2, 1), 128)  # shards of 64 x 64 = 4096 elements: blocks of 128 fit
    check_blocks(_shard((128, 64), 2, 1), 0)  # one scale per tensor: nothing to straddle
    check_blocks(_shard((1, 64), 4, 0), 96)  # one rank holds every row: no boundary inside the tensor
    with pytest.raises(ValueError, match="--fp8-optimizer-block-size 96: .* use a block size that divides 4096"):
        check_blocks(_shard((128, 64), 2, 0), 96)


def test_sharded_checkpoints_need_blocks_that_divide_the_rows():
    from megatron.optimizer.fp8_adam_shards import check_sharded_checkpoints

    def optimizer(block_size):
        return SimpleNamespace(block_size=block_size, uses_fp8_states=lambda p, g: True,
                               param_groups=[{"params": [_shard((128, 96), 2, 0)]}])

    check_sharded_checkpoints(optimizer(0))  # one scale per tensor
    check_sharded_checkpoints(optimizer(32))
    with pytest.raises(ValueError, match="has rows of 96 elements, which the block size must divide"):
        check_sharded_checkpoints(optimizer(64))  # shards of 64 x 96 elements fit blocks of 64; rows do not
