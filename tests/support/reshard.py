"""The runs of the resharding tests (tests/e2e/test_reshard.py, tests/e2e/test_reshard_zero3_launch.py) and the
comparison of a resharded checkpoint's state with its source's."""
from __future__ import annotations

import torch

from megatron.optimizer.fp8_state_quant import moment_format
from tests.support import launch

# Fp8AdamW eager: this module tests its state across layouts, which the kernel (compiled or eager) does not shape;
# compiling costs seconds per process. The compiled kernel runs under each engine in test_deepspeed_launch.py,
# test_deepspeed_tp_launch.py and test_pipeline_launch.py, and against eager in test_fp8_adam_compiled.py.
FP8 = ("--fp8-format", "hybrid", "--optimizer", "fp8adam", "--fp8-optimizer-block-size", "24",
       "--no-fp8-optimizer-compile")
BASE = dict(micro_batch_size=2, global_batch_size=8, train_iters=2, eval_iters=1, eval_interval=100,
            lr_warmup_iters=0, lr_decay_iters=3, log_interval=1)
# TP pads the vocabulary to a multiple of 128 x TP: TP=1 runs keep the TP=2 runs' 256 rows.
V256 = ("--make-vocab-size-divisible-by", "256")
Z1 = ("--deepspeed", "--zero-stage", "1")


def run(nproc: int, *switches: str, **overrides) -> str:
    """`pretrain_gpt.py` with FP8 on this module's BASE (tests/support/launch.py's `run`); its log."""
    return launch.run(nproc, *FP8, *switches, base=BASE, **overrides)


def requantization_bound(source: torch.Tensor, dtype: str) -> torch.Tensor:
    """Per element, the most one more round-to-nearest into `dtype` under a new block scale can move a value:
    half a unit in the last place of a normal number (eps/2 relative), or half the smallest subnormal times the
    new scale's inverse, which is at most amax / fmt.max for any block of the tensor (x2 for a power-of-two scale),
    plus the FP32 product of the dequantization (2^-23 relative, twice: before and after)."""
    fmt = moment_format(dtype, 24)
    eps = torch.finfo(fmt.torch_dtype).eps
    amax = source.abs().max()
    return 0.5 * eps * source.abs() + fmt.min_subnormal * amax / fmt.max + 2 * 2.0 ** -23 * source.abs()


def assert_same_state(target, source) -> float:
    """Everything equal, FP8 moments within `requantization_bound`; returns the worst error / bound ratio."""
    assert target.model.keys() == source.model.keys()
    for name, tensor in source.model.items():
        assert torch.equal(target.model[name], tensor), name
    assert target.train_state["iteration"] == source.train_state["iteration"]
    assert target.train_state["consumed_train_samples"] == source.train_state["consumed_train_samples"]
    assert target.extras["lr_scheduler"] == source.extras["lr_scheduler"]
    layers = source.fp8["layers"]
    assert target.fp8["layers"].keys() == layers.keys()
    for layer, entry in layers.items():
        for role, values in entry.items():
            if role == "num_updates":
                assert target.fp8["layers"][layer][role] == values, layer
                continue
            for key, t in values.items():
                assert torch.equal(target.fp8["layers"][layer][role][key], t), (layer, role, key)
    worst = 0.0
    for name, saved in source.optimizer["params"].items():
        got = target.optimizer["params"][name]
        assert got["step"] == saved["step"], name
        for moment, dtype in (("exp_avg", "e4m3"), ("exp_avg_sq", "e5m2")):
            if source.model[name].ndim < 2:  # FP32 moments (vectors) move exactly
                assert torch.equal(got[moment], saved[moment]), (name, moment)
                continue
            error = (got[moment] - saved[moment]).abs()
            bound = requantization_bound(saved[moment], dtype)
            assert bool((error <= bound).all()), (name, moment, float((error / bound).max()))
            worst = max(worst, float((error / bound.clamp(min=1e-30)).max()))
    return worst
