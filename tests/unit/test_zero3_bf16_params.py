"""`--params-dtype bf16` (Megatron's layout: BF16 weights, FP32 main gradients, FP32 masters) under DeepSpeed ZeRO-3:
the DeepSpeed config it generates (DeepSpeed's bf16 mode with FP32 gradient accumulation). The ZeRO-3 runs are in
tests/e2e/test_zero3_bf16_params_launch.py."""
from __future__ import annotations

import pytest

from megatron.arguments import parse_config
from megatron.training.deepspeed_config import build_deepspeed_config
from tests.support.config import tiny_argv
from tests.support.flags import ZERO3_BF16_PARAMS as LAYOUT

pytest.importorskip("deepspeed")


def test_deepspeed_config_at_zero3_is_bf16_mode_with_fp32_accumulation() -> None:
    ds = build_deepspeed_config(parse_config(tiny_argv("--deepspeed", "--zero-stage", "3", *LAYOUT)),
                                num_parameters=10**6)
    assert ds["bf16"]["enabled"] is True and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["zero_optimization"]["stage"] == 3
