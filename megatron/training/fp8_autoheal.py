"""`--fp8-autoheal`: the FP8 controller. It watches each FP8 tensor's clipping, flushing and inf/NaN counts and
repairs that tensor's scaling mid-run, climbing a ladder of actions from the least costly.

Delayed scaling quantizes with a scale from earlier steps, so a tensor whose amax grows faster than its history
clips: values beyond the FP8 maximum saturate. docs/stability.md measured it on fc2's input (0.2-0.5% of its values
clipped, a worse training loss in 2 of 3 seeds), and a margin of 2 (`--fp8-margin 2`) removed it, for every tensor of
the model. The controller gives the repair only to the tensors that need it, when they need it.

- Signal: at each log iteration the FP8 statistics (stats.py, recorded in that iteration only) give every tensor's
  clipped fraction, flushed fraction and inf/NaN count. They are max-reduced over `group`, the ranks that hold the
  same layers (data and tensor parallel), so every rank sees the same numbers and takes the same decision at the
  same iteration. One small collective and one host read per log iteration; nothing per step.
- The ladder of one tensor (layer and role: input, weight or grad_output), each rung taken after `patience`
  consecutive log iterations in trouble, only the rungs in `config.actions` (`--fp8-autoheal-actions`):
    1. `margin`, up to `max_margin` times: one more power of two of margin (`Fp8LayerState.extra_margin`); in
       trouble = clipped fraction over `clip_threshold`, or an inf/NaN;
    2. `current` (delayed recipe only): the tensor is cast with a scale from its own amax at every cast
       (`Fp8LayerState.current_roles`); same trouble;
    3. `smooth` (fc2's input behind a SwiGLU only): Smooth-SwiGLU's channel scaling for that layer's MLP, an exact
       re-parametrisation with no weight change (megatron/model/smooth_swiglu.py); in trouble = also a flushed
       fraction over `flush_threshold` (once current-scaled, an outlier shows as the rest flushing to zero);
    4. `bf16`: the layer runs nn.Linear's GEMM in the compute dtype (`Fp8LayerState.high_precision`); same.
- Undo (`undo_after` > 0): after that many clean log iterations in a row the last rung is stepped down.
- Each action is one log line (iteration, layer, tensor, the signal and its value, the action; written by the first
  rank of `group`) and counts in the
  TensorBoard scalar `fp8/autoheal-actions`. The layers' margins, current roles and high precision are part of the
  FP8 checkpoint state, and the controller's levels and counters (`state_dict`) travel with the checkpoint, so a
  resumed run makes the decisions the uninterrupted run would have made.

Free when nothing is wrong: with no action taken every layer computes exactly what it computes without the flag
(statistics only observe).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from megatron import comm
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import Fp8AutohealConfig, Fp8Scaling
from megatron.fp8.scaling import ROLE_NAMES, Fp8Role

logger = logging.getLogger("megatron")

def _smoothable_mlps(model: nn.Module) -> dict[str, nn.Module]:
    """{name of an FP8 fc2: its MLP} for SwiGLU MLPs without Smooth-SwiGLU of their own (the `smooth` rung)."""
    out = {}
    for name, module in model.named_modules():
        fc2 = getattr(module, "linear_fc2", None)
        if getattr(module, "swiglu", False) and isinstance(fc2, Fp8Linear):
            smooth = getattr(module, "smooth_swiglu", None)
            if smooth is None or getattr(smooth, "from_autoheal", False):
                out[f"{name}.linear_fc2" if name else "linear_fc2"] = module
    return out


class Fp8Controller:
    """The decisions of `--fp8-autoheal` for one model (module docstring). `tp_group`: the tensor-parallel group,
    which a Smooth-SwiGLU the controller turns on reduces over (as `--smooth-swiglu`'s does)."""

    def __init__(self, model: nn.Module, config: Fp8AutohealConfig, group: Any = None, tp_group: Any = None) -> None:
        self.config = config
        self.group = group
        self.tp_group = tp_group
        self.actions = 0
        self.bind(model)

    def bind(self, model: nn.Module) -> None:
        """Watch `model`'s FP8 layers under the names its statistics carry (again after a pipeline stage is cut
        out of the model)."""
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
        self.mlps = _smoothable_mlps(model)
        n = len(ROLE_NAMES)
        self.level = {name: [0] * n for name, _ in self.layers}  # rungs climbed per tensor
        self.streak = {name: [0] * n for name, _ in self.layers}  # consecutive log iterations in trouble
        self.clean = {name: [0] * n for name, _ in self.layers}  # consecutive clean ones (for undo_after)

    def rungs(self, name: str, layer: Fp8Linear, role: int) -> list[str]:
        """The ladder of one tensor: the configured actions that apply to it, each margin rung once per power."""
        out: list[str] = []
        for action in self.config.actions:
            if action == "margin":
                out += ["margin"] * self.config.max_margin
            elif action == "current" and layer.fp8.recipe.scaling is Fp8Scaling.DELAYED:
                out.append("current")
            elif action == "smooth" and role == Fp8Role.INPUT and name in self.mlps:
                out.append("smooth")
            elif action == "bf16":
                out.append("bf16")
        return out

    # --- signals --------------------------------------------------------------------------------------------------

    def signals(self, stats: dict[str, float]) -> torch.Tensor:
        """[layers, roles, 3]: clipped fraction, flushed fraction, inf/NaN count from `collect_fp8_stats`'s values
        (0 where nothing was recorded), max-reduced over the ranks holding the same layers."""
        def get(name: str, role: str, signal: str) -> float:
            return stats.get(f"fp8/{name}/{role}/{signal}" if name else f"fp8/{role}/{signal}", 0.0)

        values = [[[get(n, r, "clipped_frac"), get(n, r, "flushed_frac"),
                    get(n, r, "nan_count") + get(n, r, "inf_count")] for r in ROLE_NAMES] for n, _ in self.layers]
        out = torch.tensor(values, dtype=torch.float64).reshape(len(self.layers), len(ROLE_NAMES), 3)
        group = self._deciding_group()
        if group is not None:
            device = self.layers[0][1].fp8_scale.device if self.layers else torch.device("cpu")
            on_device = out.to(device=device, dtype=torch.float32)
            comm.all_reduce(on_device, group, comm.ReduceOp.MAX)
            out = on_device.cpu().double()
        return out

    def _deciding_group(self) -> Any:
        """The ranks that decide alike: `group`, else the default group when torch.distributed is initialized."""
        return self.group if self.group is not None else comm.world_group()

    def _trouble(self, next_rung: str | None, clipped: float, flushed: float, nonfinite: float) -> str | None:
        """What counts against a tensor whose next rung is `next_rung`, as the log line's words; None: clean."""
        cfg = self.config
        if nonfinite > 0:
            return f"held {int(nonfinite)} inf/NaN values"
        if clipped > cfg.clip_threshold:
            return f"clipped {clipped:.2e} of its values (> {cfg.clip_threshold:.1e})"
        if next_rung in ("smooth", "bf16") and flushed > cfg.flush_threshold:
            return f"flushed {flushed:.2e} of its nonzero values to 0 (> {cfg.flush_threshold:.1e})"
        return None

    # --- decisions ------------------------------------------------------------------------------------------------

    def step(self, iteration: int, stats: dict[str, float]) -> list[str]:
        """Decide at log iteration `iteration` from its statistics; the actions taken, as log lines (also logged)."""
        signals = self.signals(stats).tolist()
        cfg = self.config
        lines = []
        for (name, layer), rows in zip(self.layers, signals):
            for role, (clipped, flushed, nonfinite) in enumerate(rows):
                rungs = self.rungs(name, layer, role)
                level = self.level[name][role]
                next_rung = rungs[level] if level < len(rungs) else None
                why = self._trouble(next_rung, clipped, flushed, nonfinite)
                if why is not None:
                    self.streak[name][role] += 1
                    self.clean[name][role] = 0
                else:
                    self.streak[name][role] = 0
                    self.clean[name][role] += 1
                if why is not None and next_rung is not None and self.streak[name][role] >= cfg.patience:
                    text = self._move(name, layer, role, rungs, level + 1)
                    self.streak[name][role] = 0
                    why = f"{why} at {cfg.patience} log iterations in a row"
                elif cfg.undo_after and level > 0 and self.clean[name][role] >= cfg.undo_after:
                    text = self._move(name, layer, role, rungs, level - 1)
                    self.clean[name][role] = 0
                    why = f"clean at {cfg.undo_after} log iterations in a row"
                else:
                    continue
                self.actions += 1
                lines.append(f"fp8 autoheal: iteration {iteration}: {name or '(model)'} {ROLE_NAMES[role]} {why}: "
                             f"{text}")
        if self._speaks():
            for line in lines:
                logger.warning("%s", line)
        return lines

    def _speaks(self) -> bool:
        """Whether this rank logs the actions: the first rank of the group that decides alike (one line per action
        and pipeline stage, not one per rank)."""
        import torch.distributed as dist

        group = self._deciding_group()  # None: one process, which speaks
        return group is None or dist.get_rank(group) == 0

    def _move(self, name: str, layer: Fp8Linear, role: int, rungs: list[str], level: int) -> str:
        """Set one tensor's level and apply it; the log line's description of the change."""
        before = self.level[name][role]
        rung = rungs[max(before, level) - 1]
        margin_before = layer.fp8.extra_margin[role]
        self.level[name][role] = level
        self.apply(name, layer)
        on = level > before
        if rung == "margin":
            extra = layer.fp8.extra_margin[role]
            return f"extra margin {margin_before} -> {extra} (scale / {2 ** extra})"
        if rung == "current":
            return "current scaling (its own amax at every cast)" if on else "back to delayed scaling"
        if rung == "smooth":
            mlp = name.rsplit(".", 1)[0] if "." in name else "(model)"
            return f"Smooth-SwiGLU channel scaling {'on' if on else 'off'} for {mlp}"
        return "the layer runs in high precision (no FP8 cast)" if on else "the layer is back in FP8"

    def apply(self, name: str, layer: Fp8Linear) -> None:
        """Make one layer (and its MLP's smoothing, for an fc2) what its tensors' levels say."""
        climbed = [self.rungs(name, layer, r)[:self.level[name][r]] for r in range(len(ROLE_NAMES))]
        # A changed role's scaling drops the cached FP8 weight (`configure`): the weight's cast follows it.
        layer.fp8.configure(extra_margin=[c.count("margin") for c in climbed],
                            current_roles=["current" in c for c in climbed],
                            high_precision=any("bf16" in c for c in climbed))
        mlp = self.mlps.get(name)
        if mlp is not None:
            self._set_smoothing(mlp, "smooth" in climbed[Fp8Role.INPUT])

    def _set_smoothing(self, mlp: nn.Module, on: bool) -> None:
        from megatron.model.smooth_swiglu import SmoothSwiGLU, SmoothSwiGLUGranularity

        smooth = getattr(mlp, "smooth_swiglu", None)
        if smooth is None:
            if not on:
                return
            smooth = SmoothSwiGLU(SmoothSwiGLUGranularity.CHANNEL, has_bias=mlp.linear_fc2.bias is not None)
            smooth.from_autoheal = True
            smooth.tp_group = self.tp_group
            mlp.smooth_swiglu = smooth
        smooth.enabled = on

    # --- checkpoint -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"level": {k: list(v) for k, v in self.level.items()},
                "streak": {k: list(v) for k, v in self.streak.items()},
                "clean": {k: list(v) for k, v in self.clean.items()}, "actions": self.actions,
                "ladder": {"actions": list(self.config.actions), "max_margin": self.config.max_margin}}

    def load_state_dict(self, state: dict) -> None:
        """The levels and counters of a checkpoint, applied to the layers. A checkpoint written before levels were
        kept has the margins only (in the FP8 state): they count as margin rungs."""
        ladder = state.get("ladder")
        mine = {"actions": list(self.config.actions), "max_margin": self.config.max_margin}
        if ladder is not None and ladder != mine:
            logger.warning("fp8 autoheal: the checkpoint's ladder (actions %s, max margin %s) differs from this "
                           "run's (--fp8-autoheal-actions %s, --fp8-autoheal-max-margin %s): its levels are read "
                           "as rungs of this run's ladder", ",".join(ladder["actions"]), ladder["max_margin"],
                           ",".join(mine["actions"]), mine["max_margin"])
        for key in ("streak", "clean"):
            for name, values in state.get(key, {}).items():
                if name in getattr(self, key):
                    getattr(self, key)[name] = [int(v) for v in values]
        levels = state.get("level")
        for name, layer in self.layers:
            if levels is not None and name in levels:
                self.level[name] = [min(int(v), len(self.rungs(name, layer, r))) for r, v in enumerate(levels[name])]
            elif levels is None:
                self.level[name] = [min(int(e), self.config.max_margin) for e in layer.fp8.extra_margin]
            self.apply(name, layer)
        self.actions = int(state.get("actions", 0))
