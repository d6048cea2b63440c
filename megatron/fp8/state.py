"""Checkpointing of the FP8 scaling state (amax histories and scales), separate from the model's weights.

The model's own state_dict is unchanged by the FP8 swap (the scaling buffers are non-persistent), so a BF16
checkpoint loads into an FP8 model and back. The FP8 state is saved next to it as plain data:

    {"format_version": 1,
     "recipe": {"format": "hybrid", "scaling": "delayed", ...},          # Fp8Recipe.to_dict()
     "layers": {"decoder.layers.0.self_attention.linear_qkv": {
                    "num_updates": 12,
                    "input":       {"amax_history": Tensor[L], "scale": Tensor[], "scale_valid": Tensor[]},
                    "weight":      {...},
                    "grad_output": {...},
                    # Only when the FP8 controller (training/fp8_autoheal.py) raised a margin, switched a role to
                    # current scaling, or put the layer in high precision:
                    "extra_margin": [0, 1, 0], "current_roles": [False, True, False], "high_precision": True},
                ...}}

Only tensors, ints, strings and dicts: loadable with `torch.load(..., weights_only=True)`, keyed by layer
name and role (not by position) so it survives changes of layer order or module code. The FP8 copies of the
weights are not saved: they are re-derived from the weights on the first forward.

Loading checks that the checkpoint's recipe equals the current one, because histories and scales mean
something else under another recipe (another history length, format or margin); the error lists every
differing field as `field: saved vs current`. The `backend` field is exempt: resuming a run on other hardware
is legitimate, and the next step's update recomputes the scales with the new backend's FP8 maximum.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import Fp8Recipe
from megatron.fp8.scaling import ROLE_NAMES, load_role

FORMAT_VERSION = 1
_RECIPE_FIELDS_ALLOWED_TO_DIFFER = frozenset({"backend"})


def _fp8_modules(model: nn.Module) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def fp8_state_dict(model: nn.Module, recipe: Fp8Recipe) -> dict[str, Any]:
    """The FP8 scaling state of every Fp8Linear in `model`, as plain CPU tensors and values."""
    layers: dict[str, Any] = {}
    for name, m in _fp8_modules(model).items():
        entry: dict[str, Any] = {"num_updates": int(m.fp8.num_updates)}
        if any(m.fp8.extra_margin):  # the FP8 controller's margins (training/fp8_autoheal.py); absent = none raised
            entry["extra_margin"] = [int(e) for e in m.fp8.extra_margin]
        if any(m.fp8.current_roles):  # roles it switched to current scaling
            entry["current_roles"] = [bool(c) for c in m.fp8.current_roles]
        if m.fp8.high_precision:  # a layer it put in high precision
            entry["high_precision"] = True
        for r, role in enumerate(ROLE_NAMES):
            entry[role] = {
                "amax_history": m.fp8_amax_history[r].detach().cpu().clone(),
                "scale": m.fp8_scale[r].detach().cpu().clone(),
                "scale_valid": m.fp8_scale_valid[r].detach().cpu().clone(),
            }
        layers[name] = entry
    return {"format_version": FORMAT_VERSION, "recipe": recipe.to_dict(), "layers": layers}


def _recipe_differences(saved: dict[str, Any], current: Fp8Recipe) -> list[str]:
    now = current.to_dict()
    diffs = []
    for key in sorted(set(saved) | set(now)):
        if key in _RECIPE_FIELDS_ALLOWED_TO_DIFFER:
            continue
        old, new = saved.get(key, "<absent>"), now.get(key, "<absent>")
        if old != new:
            diffs.append(f"{key}: saved {old!r} vs current {new!r}")
    return diffs


@torch.no_grad()
def load_fp8_state_dict(model: nn.Module, recipe: Fp8Recipe, state: dict[str, Any]) -> None:
    """Restore the state made by `fp8_state_dict`; ValueError on another recipe or other layers."""
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"FP8 state has format_version {version!r}; this code reads {FORMAT_VERSION}")
    diffs = _recipe_differences(state.get("recipe", {}), recipe)
    if diffs:
        raise ValueError("FP8 state was saved with another FP8 recipe (check the --fp8-* flags):\n  "
                         + "\n  ".join(diffs))
    modules = _fp8_modules(model)
    saved_layers: dict[str, Any] = state.get("layers", {})
    missing = sorted(set(modules) - set(saved_layers))
    extra = sorted(set(saved_layers) - set(modules))
    if missing or extra:
        raise ValueError(
            "FP8 state does not match the model's FP8 layers:\n"
            f"  in the model but not in the checkpoint: {missing}\n"
            f"  in the checkpoint but not in the model: {extra}")
    for name, m in modules.items():
        entry = saved_layers[name]
        for r, role in enumerate(ROLE_NAMES):
            history = entry[role]["amax_history"]
            if history.shape != m.fp8_amax_history[r].shape:
                raise ValueError(f"{name}/{role}: amax_history of shape {tuple(history.shape)}, "
                                 f"expected {tuple(m.fp8_amax_history[r].shape)}")
            load_role(m.fp8.buffers, r, history, entry[role]["scale"], entry[role]["scale_valid"])
        m.fp8.num_updates = int(entry["num_updates"])
        m.fp8.configure(extra_margin=entry.get("extra_margin", (0, 0, 0)),
                        current_roles=entry.get("current_roles", (False, False, False)),
                        high_precision=entry.get("high_precision", False))
        m.fp8.forget_weights()
        m.fp8.forget_scale_validity()
