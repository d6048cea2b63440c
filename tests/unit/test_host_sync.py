"""Host reads of tensors in the training loop: one per step (its skip decision), the rest at log iterations.

On an accelerator, reading a tensor's value on the host (`.item()`, `float()`, `bool()`, `.tolist()`, `.cpu()`)
waits for the device. We count such reads made from megatron/ code during a CPU run (docs/distributed.md,
"Host synchronisation", lists the ones that remain and why).
"""
from __future__ import annotations

import collections
import sys

import pytest
import torch

from megatron.arguments import parse_config
from megatron.training.loop import pretrain
from tests.support.config import REPO, tiny_argv

READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")
PACKAGE = str(REPO / "megatron") + "/"


def _count_reads(monkeypatch, argv: list[str]) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for name in READS:
        real = getattr(torch.Tensor, name)

        def read(self, *args, _real=real, _name=name, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE):
                where = frame.f_code.co_filename[len(PACKAGE):]
                counts[f"{where}:{frame.f_code.co_name}:{_name}"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    pretrain(parse_config(argv))
    monkeypatch.undo()
    return counts


def test_one_host_read_per_step_between_log_iterations(monkeypatch):
    """6 iterations, no log iteration, no evaluation: the engine's 6 skip decisions, one read of the run's losses
    at the end and the divergence guard's weight check before the first step; FP8 delayed scaling adds one, for
    the whole model, after the first update (which roles' scales are valid: megatron/fp8/step.py), none after it;
    Smooth-SwiGLU adds none."""
    argv = tiny_argv("--fp8-format", "hybrid", "--smooth-swiglu", "--device", "cpu", train_iters=6,
                     log_interval=1000, eval_interval=1000, eval_iters=0, clip_grad=1.0)
    counts = _count_reads(monkeypatch, argv)
    assert counts == {"training/engine.py:guarded_step:__bool__": 6, "training/log.py:host_floats:tolist": 1,
                      "training/loop.py:_check_weights:__float__": 1,
                      "fp8/step.py:_learn_scale_validity:tolist": 1}, counts


def test_log_iterations_read_the_interval_at_once(monkeypatch):
    """Negative control of the counter, and the log iterations' reads: one batch of losses per interval."""
    argv = tiny_argv("--device", "cpu", train_iters=6, log_interval=3, eval_interval=1000, eval_iters=0)
    counts = _count_reads(monkeypatch, argv)
    assert counts["training/engine.py:guarded_step:__bool__"] == 6
    # Per log iteration: the loop's pending losses and the logger's mean loss (one .tolist() each); the
    # grad norm of the log line.
    assert counts["training/log.py:host_floats:tolist"] == 2 * 2  # nothing left for the final flush
    assert counts["training/log.py:record:__float__"] == 2
    assert counts["training/loop.py:_check_weights:__float__"] == 1 + 2  # at the start, then per log iteration


@pytest.mark.parametrize("engine", [(), ("--deepspeed", "--zero-stage", "1"), ("--deepspeed", "--zero-stage", "3")],
                         ids=["torch", "zero1", "zero3"])
def test_no_host_to_device_copies_in_the_steps(monkeypatch, engine):
    """`torch.tensor(value, device=d)` and `torch.as_tensor(value, device=d)` copy a host value to the device; with
    a pageable source on CUDA that copy synchronises the stream (the host waits for every queued kernel), so inside
    the steps device-side constants are made by `torch.full` (a fill kernel, asynchronous). Counted here on CPU:
    calls with a device from megatron/ code after the first iteration, in a run with every per-step path of the
    recipe (FP8 linears with power-of-two scales, Smooth-SwiGLU, Fp8AdamW with stochastic rounding, statistics at
    the log iterations)."""
    from megatron.training import loop as loop_module

    calls: collections.Counter = collections.Counter()
    started = {"on": False}
    real_step = loop_module.Trainer.train_step

    def train_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        started["on"] = True  # from the second iteration on: the first one builds state
        return out

    def counting(real):
        def make(*args, **kwargs):
            frame = sys._getframe(1)
            if started["on"] and kwargs.get("device") is not None and frame.f_code.co_filename.startswith(PACKAGE):
                calls[f"{frame.f_code.co_filename[len(PACKAGE):]}:{frame.f_lineno}"] += 1
            return real(*args, **kwargs)
        return make

    if engine:
        pytest.importorskip("deepspeed")
        # DeepSpeed reads LOCAL_RANK; the engine sets it only when it creates the 1-rank process group, which an
        # earlier in-process DeepSpeed test in the same pytest process may have created already.
        monkeypatch.setenv("LOCAL_RANK", "0")
    argv = tiny_argv("--fp8-format", "hybrid", "--fp8-power-of-two-scales", "--smooth-swiglu", "--optimizer",
                     "fp8adam", "--log-fp8-stats", "--device", "cpu", *engine, train_iters=4, log_interval=2,
                     eval_interval=1000, eval_iters=0)
    with pytest.MonkeyPatch.context() as patch:  # only these three: the autouse fixture's environment stays
        patch.setattr(loop_module.Trainer, "train_step", train_step)
        patch.setattr(torch, "tensor", counting(torch.tensor))
        patch.setattr(torch, "as_tensor", counting(torch.as_tensor))
        pretrain(parse_config(argv))
    assert not calls, calls
