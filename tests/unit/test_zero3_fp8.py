"""FP8 linears + Fp8AdamW under DeepSpeed ZeRO-3: the DeepSpeed config keeps one sub-group per parameter group. The
ZeRO-3 runs (2 gloo processes) are in tests/e2e/test_zero3_fp8_launch.py."""
from __future__ import annotations

import pytest

from megatron.arguments import parse_config
from megatron.training.deepspeed_config import DeepSpeedConfigError, build_deepspeed_config
from tests.support.config import tiny_argv
from tests.support.flags import ZERO3_FP8 as FP8

pytest.importorskip("deepspeed")


def test_zero3_fp8adam_keeps_one_sub_group_per_param_group() -> None:
    """DeepSpeed steps each sub-group in a call of its own, where Fp8AdamW would number it as its first tensor."""
    config = parse_config(tiny_argv("--deepspeed", "--zero-stage", "3", *FP8, micro_batch_size=2,
                                    global_batch_size=8))
    assert build_deepspeed_config(config, num_parameters=10**6)["zero_optimization"]["sub_group_size"] >= 10**6
    kept = build_deepspeed_config(config, {"zero_optimization": {"sub_group_size": 10**6}}, num_parameters=10**6)
    assert kept["zero_optimization"]["sub_group_size"] == 10**6
    with pytest.raises(DeepSpeedConfigError, match=r"`zero_optimization.sub_group_size` 1000 splits the model's "
                                                   r"1000000 parameters"):
        build_deepspeed_config(config, {"zero_optimization": {"sub_group_size": 1000}}, num_parameters=10**6)
