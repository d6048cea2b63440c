"""`--fp8-autoheal`: the FP8 controller. It watches each FP8 tensor's clipping and repairs that tensor's scaling
mid-run.

Delayed scaling quantizes with a scale from earlier steps, so a tensor whose amax grows faster than its history
clips: values beyond the FP8 maximum saturate. docs/stability.md measured it on fc2's input (0.2-0.5% of its values
clipped, a worse training loss in 2 of 3 seeds), and a margin of 2 (`--fp8-margin 2`) removed it, for every tensor of
the model. The controller gives that margin only to the tensors that need it, when they need it:

- Signal: at each log iteration the FP8 statistics (stats.py, recorded in that iteration only) give every tensor's
  clipped fraction. The fractions are max-reduced over `group`, the ranks that hold the same layers (data and tensor
  parallel), so every rank sees the same numbers and takes the same decision at the same iteration. One small
  collective and one host read per log iteration; nothing per step.
- Action: a tensor (layer and role: input, weight or grad_output) whose clipped fraction exceeds `clip_threshold` at
  `patience` consecutive log iterations gets one more power of two of margin (`Fp8LayerState.extra_margin`), up to
  `max_margin`. The next scaling update (and every per-call scale) uses it; nothing else changes.
- Undo (`undo_after` > 0): after that many clean log iterations in a row a raised margin is lowered by one.
- Each action is one log line (iteration, layer, tensor, the clipped fraction and the threshold, the margin before
  and after) and counts in the TensorBoard scalar `fp8/autoheal-actions`. The margins are part of the FP8 checkpoint
  state and the controller's counters (`state_dict`) travel with the checkpoint, so a resumed run makes the
  decisions the uninterrupted run would have made.

Free when nothing is wrong: with no action taken the margins stay 0, so the run computes exactly what it computes
without the flag (statistics only observe).

Not done yet (see the issue tracker): switching a tensor to current scaling, Smooth-SwiGLU's channel scaling for one
layer's fc2, BF16 for one layer; the lab's learning-rate sweep that decides the default.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from megatron import comm
from megatron.fp8.recipe import Fp8AutohealConfig
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.scaling import ROLE_NAMES

logger = logging.getLogger("megatron")


class Fp8Controller:
    """The decisions of `--fp8-autoheal` for one model (module docstring)."""

    def __init__(self, model: nn.Module, config: Fp8AutohealConfig, group: Any = None) -> None:
        self.config = config
        self.group = group
        self.actions = 0
        self.bind(model)

    def bind(self, model: nn.Module) -> None:
        """Watch `model`'s FP8 layers under the names its statistics carry (again after a pipeline stage is cut
        out of the model)."""
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
        n = len(ROLE_NAMES)
        self.streak = {name: [0] * n for name, _ in self.layers}  # consecutive log iterations over the threshold
        self.clean = {name: [0] * n for name, _ in self.layers}  # consecutive clean ones (for undo_after)

    def clipped_fractions(self, stats: dict[str, float]) -> torch.Tensor:
        """[layers, roles] clipped fractions from `collect_fp8_stats`'s values (0 where nothing was recorded),
        max-reduced over the ranks holding the same layers."""
        values = [[stats.get(f"fp8/{name}/{role}/clipped_frac" if name else f"fp8/{role}/clipped_frac", 0.0)
                   for role in ROLE_NAMES] for name, _ in self.layers]
        fractions = torch.tensor(values, dtype=torch.float64).reshape(len(self.layers), len(ROLE_NAMES))
        if self.group is not None or comm.world_group() is not None:
            device = self.layers[0][1].fp8_scale.device if self.layers else torch.device("cpu")
            on_device = fractions.to(device=device, dtype=torch.float32)
            comm.all_reduce(on_device, self.group if self.group is not None else comm.world_group(),
                            comm.ReduceOp.MAX)
            fractions = on_device.cpu().double()
        return fractions

    def step(self, iteration: int, stats: dict[str, float]) -> list[str]:
        """Decide at log iteration `iteration` from its statistics; the actions taken, as log lines (also logged)."""
        fractions = self.clipped_fractions(stats).tolist()
        cfg = self.config
        lines = []
        for (name, layer), row in zip(self.layers, fractions):
            extra = layer.fp8.extra_margin
            for role, clipped in enumerate(row):
                if clipped > cfg.clip_threshold:
                    self.streak[name][role] += 1
                    self.clean[name][role] = 0
                else:
                    self.streak[name][role] = 0
                    self.clean[name][role] += 1
                before = extra[role]
                if self.streak[name][role] >= cfg.patience and extra[role] < cfg.max_margin:
                    extra[role] += 1
                    self.streak[name][role] = 0
                    why = (f"clipped {clipped:.2e} of its values (> {cfg.clip_threshold:.1e}) at {cfg.patience} "
                           "log iterations in a row")
                elif cfg.undo_after and extra[role] > 0 and self.clean[name][role] >= cfg.undo_after:
                    extra[role] -= 1
                    self.clean[name][role] = 0
                    why = f"clean at {cfg.undo_after} log iterations in a row"
                else:
                    continue
                self.actions += 1
                lines.append(f"fp8 autoheal: iteration {iteration}: {name or '(model)'} {ROLE_NAMES[role]} {why}: "
                             f"extra margin {before} -> {extra[role]} (scale / {2 ** extra[role]})")
        for line in lines:
            logger.warning("%s", line)
        return lines

    def state_dict(self) -> dict:
        return {"streak": {k: list(v) for k, v in self.streak.items()},
                "clean": {k: list(v) for k, v in self.clean.items()}, "actions": self.actions}

    def load_state_dict(self, state: dict) -> None:
        """The counters of a checkpoint (the margins themselves come with the FP8 scaling state)."""
        for key in ("streak", "clean"):
            for name, values in state.get(key, {}).items():
                if name in getattr(self, key):
                    getattr(self, key)[name] = [int(v) for v in values]
        self.actions = int(state.get("actions", 0))
