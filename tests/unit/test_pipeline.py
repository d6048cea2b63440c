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


def test_zero0_guard_clips_by_the_norm_over_replicas_and_skips_non_finite_steps(monkeypatch):
    """The ZeRO-0 pipeline's optimizer step: grads.clip_grad_norm over every rank (here one, with collectives
    forced), each gradient counted once although `replicas` data-parallel copies were summed into the norm."""
    import torch
    import torch.distributed as dist

    from megatron import comm
    from megatron.training.pipeline_engine import _guard_non_finite_steps

    monkeypatch.setenv(comm.FORCE_ENV, "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([w], lr=1.0)
        _guard_non_finite_steps(opt, 1.0, 2)
        w.grad = torch.tensor([3.0, 4.0])  # squares 25, over 2 replicas: 12.5
        opt.step()
        norm = torch.tensor(12.5).sqrt()  # IEEE square root: correctly rounded, as the guard's
        assert not opt.overflow and opt._global_grad_norm == float(norm)
        coef = torch.tensor(1.0) / (norm + 1e-6)  # below 1: clipped, with torch's formula
        assert torch.equal(w.detach(), -torch.tensor([3.0, 4.0]) * coef)

        before = w.detach().clone()
        w.grad = torch.tensor([float("inf"), 1.0])
        opt.step()
        assert opt.overflow and torch.equal(w.detach(), before)  # skipped: the weights are untouched
    finally:
        dist.destroy_process_group()
