"""Per-tensor scaling state: the three tensor roles, amax histories and the delayed-scale update.

Each `Fp8Linear` quantizes three tensors and keeps one scale per *role*: the input (activations), the weight,
and the output gradient. Their state lives in small buffers on the module, one row per role:

    fp8_amax_history [3, amax_history_len]  newest amax in column 0
    fp8_scale        [3]                    scale used by the next step (delayed scaling)
    fp8_scale_valid  [3]                    False until the history has seen a usable (finite, > 0) amax
    fp8_step_amax    [3]                    running max |x| over every micro-batch of the current step
    fp8_nonfinite_steps [3]                 steps in which the role's tensor held an inf/NaN (cumulative)
    fp8_step_nonfinite  [3]                 whether it did in the step just finished (read after a skip)

Delayed scaling (the recipe of the paper and of Transformer Engine): during an optimizer step every
forward/backward only *accumulates* its amax into `fp8_step_amax` and quantizes with the scale computed at the
end of the previous step. Once per optimizer step `fp8_optimizer_step` (in `step.py`) reduces the step amaxes
across ranks, pushes them into the history and recomputes the scales from `max` or `most_recent` of the
history. So the scale of step t is decided by steps < t, and all micro-batches of a step use the same scale.

First step: with an empty history there is no previous amax. We then use the *current* amax of each tensor
(current scaling) until the first update; the alternative (scale 1.0) clips or flushes most values of
badly-scaled tensors in the first step, and the first step's gradients are as real as any other's.

Current ("tensorwise") scaling: the scale comes from this tensor's amax right now; no history is used, but
the amax is still accumulated so statistics and checkpoints look the same.

A non-finite step amax (an inf or NaN somewhere in the tensor) is counted in `fp8_nonfinite_steps` and
recorded in the history as 0 (no information), so it neither poisons `max` over the history nor changes the
scale: no scale can represent inf, and the training loop will see the NaN/inf in the loss and skip the step.

Every write of these buffers is a function of this file: `record_step_amax` between optimizer steps,
`write_delayed_updates` and `close_current_step` at a step's end (`step.py`), `load_role` from a checkpoint
(`state.py`). Each takes the buffers as the dict `new_scaling_buffers` made (the module's own buffer dict).
"""
from __future__ import annotations

import enum

import torch

from megatron.fp8.formats import Fp8Dtype
from megatron.fp8.quantize import compute_scale
from megatron.fp8.recipe import AmaxComputeAlgo, Fp8Format, Fp8Recipe


class Fp8Role(enum.IntEnum):
    """Row index of a tensor role in the per-module scaling buffers."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


ROLE_NAMES: tuple[str, ...] = ("input", "weight", "grad_output")


def record_step_amax(step_amax_row: torch.Tensor, amax: torch.Tensor, scale_row: torch.Tensor | None = None,
                     current_scale: torch.Tensor | None = None) -> None:
    """A training use of a role's tensor: its `amax` into the step's running max (`step_amax_row`, the role's 0-d
    view of `fp8_step_amax`) and, with `current_scale` (tensorwise scaling), that scale into `scale_row` (its view
    of `fp8_scale`). In place, one kernel each. The one write of the scaling state between optimizer steps."""
    torch.maximum(step_amax_row, amax, out=step_amax_row)
    if current_scale is not None:
        scale_row.copy_(current_scale)


def role_dtypes(recipe: Fp8Recipe) -> tuple[Fp8Dtype, Fp8Dtype, Fp8Dtype]:
    """FP8 format of (input, weight, grad_output): hybrid uses E5M2's range for gradients."""
    grad = Fp8Dtype.E5M2 if recipe.format is Fp8Format.HYBRID else Fp8Dtype.E4M3
    return Fp8Dtype.E4M3, Fp8Dtype.E4M3, grad


def new_scaling_buffers(history_len: int, device: torch.device | str | None) -> dict[str, torch.Tensor]:
    """Fresh buffers for the three roles (see the module docstring)."""
    n = len(ROLE_NAMES)
    return {
        "fp8_amax_history": torch.zeros(n, history_len, dtype=torch.float32, device=device),
        "fp8_scale": torch.ones(n, dtype=torch.float32, device=device),
        "fp8_scale_valid": torch.zeros(n, dtype=torch.bool, device=device),
        "fp8_step_amax": torch.zeros(n, dtype=torch.float32, device=device),
        "fp8_nonfinite_steps": torch.zeros(n, dtype=torch.int64, device=device),
        "fp8_step_nonfinite": torch.zeros(n, dtype=torch.bool, device=device),
    }


def amax_from_history(history: torch.Tensor, algo: AmaxComputeAlgo) -> torch.Tensor:
    """The amax each role's scale is computed from: max over the history, or its newest entry."""
    if AmaxComputeAlgo(algo) is AmaxComputeAlgo.MAX:
        return history.amax(dim=-1)
    return history[..., 0]


def roll_history(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """New history with `amax` in column 0 and the oldest entry dropped."""
    rolled = torch.roll(history, shifts=1, dims=-1)
    rolled[..., 0] = amax
    return rolled


def delayed_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_valid: torch.Tensor,
    step_amax: torch.Tensor,
    fp8_max: torch.Tensor,
    recipe: Fp8Recipe,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One end-of-step update for all roles: (history, scale, scale_valid, nonfinite_mask)."""
    finite = torch.isfinite(step_amax)
    history = roll_history(history, torch.where(finite, step_amax, torch.zeros_like(step_amax)))
    amax = amax_from_history(history, recipe.amax_compute_algo)
    new_scale = compute_scale(amax, fp8_max, recipe.margin, recipe.power_of_two_scales, previous=scale)
    valid = scale_valid | (history > 0).any(dim=-1)
    return history, new_scale, valid, ~finite


@torch.no_grad()
def write_delayed_updates(buffers: list[dict[str, torch.Tensor]], history: torch.Tensor, scale: torch.Tensor,
                          valid: torch.Tensor, nonfinite: torch.Tensor) -> None:
    """`delayed_update`'s results for many layers at once (row i for `buffers[i]`), written with foreach copies; the
    non-finite roles counted, the step's running amaxes cleared."""
    def each(name: str) -> list[torch.Tensor]:
        return [b[name] for b in buffers]

    torch._foreach_copy_(each("fp8_amax_history"), list(history.unbind(0)))
    torch._foreach_copy_(each("fp8_scale"), list(scale.unbind(0)))
    torch._foreach_copy_(each("fp8_scale_valid"), list(valid.unbind(0)))
    torch._foreach_copy_(each("fp8_step_nonfinite"), list(nonfinite.unbind(0)))
    torch._foreach_add_(each("fp8_nonfinite_steps"), list(nonfinite.to(torch.int64).unbind(0)))
    torch._foreach_zero_(each("fp8_step_amax"))


@torch.no_grad()
def close_current_step(buffers: dict[str, torch.Tensor]) -> None:
    """A step's end under current scaling (no history): count the roles whose step amax was not finite, as delayed
    scaling does, and clear the running amaxes."""
    buffers["fp8_step_nonfinite"].copy_(~torch.isfinite(buffers["fp8_step_amax"]))
    buffers["fp8_nonfinite_steps"] += buffers["fp8_step_nonfinite"].to(torch.int64)
    buffers["fp8_step_amax"].zero_()


@torch.no_grad()
def load_role(buffers: dict[str, torch.Tensor], role: int, history: torch.Tensor, scale: torch.Tensor,
              valid: torch.Tensor) -> None:
    """One role's saved history, scale and validity (a checkpoint's), into the buffers; the running amax cleared."""
    buffers["fp8_amax_history"][role].copy_(history)
    buffers["fp8_scale"][role].copy_(scale)
    buffers["fp8_scale_valid"][role].copy_(valid)
    buffers["fp8_step_amax"][role].zero_()
