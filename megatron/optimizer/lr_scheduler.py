"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay to `--min-lr`.

The schedule is a pure function of the iteration (`lr_at`), so resuming needs only the iteration;
the scheduler still saves its config in checkpoints to detect a changed schedule on load.
"""
from __future__ import annotations

import math

import torch

from megatron.config import LrDecayStyle, SchedulerConfig


def lr_at(cfg: SchedulerConfig, iteration: int) -> float:
    """The learning rate used for the optimizer step that produces iteration `iteration + 1`."""
    if cfg.warmup_iters > 0 and iteration < cfg.warmup_iters:
        return cfg.lr * (iteration + 1) / cfg.warmup_iters
    if cfg.decay_style is LrDecayStyle.CONSTANT:
        return cfg.lr
    if iteration >= cfg.decay_iters:
        return cfg.min_lr
    span = cfg.decay_iters - cfg.warmup_iters
    progress = (iteration - cfg.warmup_iters) / span if span > 0 else 1.0
    if cfg.decay_style is LrDecayStyle.LINEAR:
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


class LrScheduler:
    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig) -> None:
        self.optimizer = optimizer
        self.cfg = cfg

    def apply(self, iteration: int) -> float:
        lr = lr_at(self.cfg, iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        c = self.cfg
        return {"lr": c.lr, "min_lr": c.min_lr, "decay_style": c.decay_style.value,
                "warmup_iters": c.warmup_iters, "decay_iters": c.decay_iters}

    def check_state_dict(self, state: dict) -> list[str]:
        """Differences between a saved schedule and this one (the current flags win)."""
        mine = self.state_dict()
        return [f"{k}: checkpoint {state.get(k)!r} vs flags {v!r}" for k, v in mine.items() if state.get(k) != v]
