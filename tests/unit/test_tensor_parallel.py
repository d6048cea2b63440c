"""Tensor parallelism's flags, checked before any process starts: the sizes and switches refused, with the flag to
change. The TP runs (2 processes) are in tests/e2e/test_tensor_parallel_launch.py."""
from __future__ import annotations

import pytest

from megatron.arguments import parse_config
from tests.support.config import tiny_argv


@pytest.mark.parametrize("overrides, switches, message", [
    (dict(num_key_value_heads=1), [], "--num-key-value-heads 1 must be divisible by --tensor-model-parallel-size 2"),
    (dict(seq_length=31, max_position_embeddings=32), ["--sequence-parallel"],
     "--sequence-parallel needs --seq-length"),
    (dict(ffn_hidden_size=171), [], "--ffn-hidden-size 171 must be divisible"),
])
def test_tensor_parallel_validation(overrides, switches, message):
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(tiny_argv(*switches, tensor_model_parallel_size=2, **overrides), world_size=2)


def test_bias_and_world_size_validation():
    argv = [a for a in tiny_argv(tensor_model_parallel_size=2) if a != "--disable-bias-linear"]
    with pytest.raises(ValueError, match="--disable-bias-linear"):
        parse_config(argv, world_size=2)
    with pytest.raises(ValueError, match="world size 3 is not divisible"):
        parse_config(tiny_argv(tensor_model_parallel_size=2), world_size=3)
    assert not parse_config(tiny_argv("--sequence-parallel"), world_size=1).parallel.sequence_parallel
