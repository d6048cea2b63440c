"""Host reads of tensors in the training loop: one per step (its skip decision), the rest at log iterations.

On an accelerator, reading a tensor's value on the host (`.item()`, `float()`, `bool()`, `.tolist()`, `.cpu()`)
waits for the device. We count such reads made from megatron/ code during a CPU run (docs/distributed.md,
"Host synchronisation", lists the ones that remain and why).
"""
from __future__ import annotations

import collections
import sys

import torch

from conftest import REPO, tiny_argv
from megatron.arguments import parse_config
from megatron.training.loop import pretrain

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
    at the end and the divergence guard's weight check before the first step; FP8 (delayed scaling) and
    Smooth-SwiGLU add none."""
    argv = tiny_argv("--fp8-format", "hybrid", "--smooth-swiglu", "--device", "cpu", train_iters=6,
                     log_interval=1000, eval_interval=1000, eval_iters=0, clip_grad=1.0)
    counts = _count_reads(monkeypatch, argv)
    assert counts == {"training/engine.py:step:__bool__": 6, "training/log.py:host_floats:tolist": 1,
                      "training/loop.py:_check_weights:__float__": 1}, counts


def test_log_iterations_read_the_interval_at_once(monkeypatch):
    """Negative control of the counter, and the log iterations' reads: one batch of losses per interval."""
    argv = tiny_argv("--device", "cpu", train_iters=6, log_interval=3, eval_interval=1000, eval_iters=0)
    counts = _count_reads(monkeypatch, argv)
    assert counts["training/engine.py:step:__bool__"] == 6
    # Per log iteration: the loop's pending losses and the logger's mean loss (one .tolist() each); the
    # grad norm of the log line.
    assert counts["training/log.py:host_floats:tolist"] == 2 * 2  # nothing left for the final flush
    assert counts["training/log.py:record:__float__"] == 2
    assert counts["training/loop.py:_check_weights:__float__"] == 1 + 2  # at the start, then per log iteration
