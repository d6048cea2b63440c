"""Resharding into DeepSpeed ZeRO-3 (megatron/checkpoint/reshard.py): what is refused before any state is touched.
The resharding runs into and out of ZeRO-3 are in tests/e2e/test_reshard_zero3_launch.py."""
from __future__ import annotations

import pytest

from megatron.checkpoint import store as ckpt

pytest.importorskip("deepspeed")


@pytest.mark.parametrize("offload", ["offload_param", "swap_optimizer"])
def test_resharding_into_offloaded_zero3_is_refused(offload):
    """Second line of defence (parse_config refuses ZeRO offload, tests/unit/test_deepspeed.py): a ZeRO-3 engine with
    offloaded parameters or an NVMe-swapped optimizer keeps its partitions off the device, where the loader does
    not write; resharding into it is one CheckpointError, before any state is touched."""
    import types

    from megatron.checkpoint.reshard import _load_zero3_optimizer

    zero = types.SimpleNamespace(offload_param=False, swap_optimizer=False, fp32_partitioned_groups_flat=None)
    setattr(zero, offload, True)
    with pytest.raises(ckpt.CheckpointError, match="offload_param or an NVMe-swapped optimizer is not supported"):
        _load_zero3_optimizer(zero, [], {}, None, None, 0, 1, True)
