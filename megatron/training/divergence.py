"""The divergence guard: stop a run that is exploding without a NaN before it overwrites its healthy checkpoints.

Non-finite steps are skipped and counted by the loop (`--max-consecutive-nan-steps`). A run can also be destroyed
with every number finite: a huge learning rate sends the weights to 1e9 and the loss to ln(vocab) with a zero
gradient norm; a huge init trains a dead model to the end. The guard watches three signs, on values the loop reads
anyway (the losses and gradient norms of each log interval, and one weight maximum per log interval and per save),
so it adds no host synchronisation to a step:

    sign                        rule (flags)                                                   default
    loss far above its median   loss > factor x median of the last `window` healthy losses,    factor 2.5, 20
                                for `patience` iterations in a row (after warm-up)             iterations, window 100
    gradient norm stuck at 0    `zero_grad_iters` iterations in a row with a norm of exactly 0 10
    weights exploding           max |w| over every parameter (all ranks) > `max_weight`        1e4

A loss spike that comes back below the threshold within `patience` iterations only pauses saving while it lasts
(a checkpoint taken mid-spike is marked unhealthy); 2x spikes do not reach the default threshold at all. When a
rule fires the loop stops without saving (exit code 3) and names the newest healthy checkpoint. Each checkpoint
records its health in train_state.json; resuming from a folder whose newest checkpoint is unhealthy loads the newest
healthy one instead (`checkpointing.read_tracker`). `--no-divergence-guard` turns all of this off for experiments
that study divergence.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Iterable, Optional

import torch
from torch import nn

from megatron import comm
from megatron.config import DivergenceConfig
from megatron.partitioned import local_data


def max_abs_weight(params: Iterable[nn.Parameter], group) -> torch.Tensor:
    """max |w| over `params` of every rank in `group` (0-d, on the parameters' device; ZeRO-3 shards included)."""
    values = []
    for p in params:
        data = local_data(p)  # ZeRO-3's partition or FSDP2's shard: the max over the group covers the rest
        if data.numel():
            values.append(data.abs().max().float())
    if not values:
        return torch.zeros(())
    result = torch.stack(values).max()
    comm.all_reduce(result, group, comm.ReduceOp.MAX)
    return result


class DivergenceGuard:
    """Feed it every iteration's (loss, grad norm) in order and the weight maximum when measured; `reason` is set
    once the run must stop, `healthy` says whether a checkpoint taken now is one to resume from."""

    def __init__(self, config: DivergenceConfig, warmup_iters: int) -> None:
        self.config = config
        self.warmup_iters = warmup_iters
        self.history: deque[float] = deque(maxlen=config.window)
        self.above = 0  # consecutive iterations above the loss threshold
        self.zero_grad = 0  # consecutive iterations with a zero gradient norm
        self.reason: Optional[str] = None

    @property
    def healthy(self) -> bool:
        return not self.config.enabled or (self.reason is None and self.above == 0 and self.zero_grad == 0)

    def observe(self, iteration: int, loss: float, grad_norm: float) -> None:
        """One iteration's values; skipped (non-finite) steps are the NaN counter's business and are ignored."""
        cfg = self.config
        if not cfg.enabled or self.reason is not None or not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return
        self.zero_grad = self.zero_grad + 1 if grad_norm == 0.0 else 0
        if self.zero_grad >= cfg.zero_grad_iters:
            self.reason = (f"the gradient norm has been exactly 0 for {self.zero_grad} iterations (up to {iteration}): "
                           f"the model no longer learns (weights saturated or exploded; --divergence-zero-grad-iters "
                           f"{cfg.zero_grad_iters})")
            return
        if iteration > self.warmup_iters and len(self.history) >= min(cfg.window, 10):
            median = statistics.median(self.history)
            if loss > cfg.loss_factor * median:
                self.above += 1
                if self.above >= cfg.patience:
                    self.reason = (f"the loss has stayed above {cfg.loss_factor:g} x its running median ({median:.4f}) "
                                   f"for {self.above} iterations, up to iteration {iteration} (loss {loss:.4f}; "
                                   f"--divergence-loss-factor {cfg.loss_factor:g}, --divergence-patience {cfg.patience})")
                return
            self.above = 0
        self.history.append(loss)

    def observe_weights(self, iteration: int, max_weight: float) -> None:
        cfg = self.config
        if cfg.enabled and self.reason is None and not max_weight <= cfg.max_weight:  # NaN counts as exploded
            when = "at initialization" if iteration == 0 else f"at iteration {iteration}"
            hint = " (check --init-method-std)" if iteration == 0 else " (check --lr and --clip-grad)"
            self.reason = (f"the largest weight is {max_weight:.3g} {when}, above --divergence-max-weight "
                           f"{cfg.max_weight:g}: the weights exploded{hint}")
