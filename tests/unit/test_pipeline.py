"""Pipeline parallelism's flags, checked before any process starts: the combinations refused and why. The runs
(DeepSpeed PipelineModule, 2 stages under torchrun) are in tests/e2e/test_pipeline_launch.py."""
import re

import pytest

from megatron.arguments import parse_config
from tests.support.config import tiny_argv

pytest.importorskip("deepspeed")


@pytest.mark.parametrize("switches, overrides, message", [
    ((), {}, "needs --deepspeed"),
    (("--deepspeed",), dict(zero_stage=2), "needs --zero-stage 0 or 1 (got 2)"),
    (("--deepspeed",), dict(zero_stage=3), "needs --zero-stage 0 or 1 (got 3)"),
    (("--deepspeed", "--reset-position-ids"), {}, "--reset-position-ids / --reset-attention-mask"),
    (("--deepspeed",), dict(recompute_granularity="full", recompute_method="block"),
     "--recompute-granularity full needs --recompute-method uniform"),
    (("--deepspeed",), dict(num_layers=3), "needs --num-layers (3) divisible by it"),
])
def test_unsupported_pipeline_combinations_are_rejected(switches, overrides, message):
    argv = tiny_argv(*switches, pipeline_model_parallel_size=2, **overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(argv, world_size=4)


@pytest.mark.parametrize("flag", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_parallel_sizes_below_one_are_rejected(flag):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be >= 1, got 0"):
        parse_config(tiny_argv(**{flag: 0}))


def test_pipeline_needs_untied_embeddings():
    argv = [a for a in tiny_argv("--deepspeed", pipeline_model_parallel_size=2)
            if a != "--untie-embeddings-and-output-weights"]
    with pytest.raises(ValueError, match="needs --untie-embeddings-and-output-weights"):
        parse_config(argv, world_size=2)
