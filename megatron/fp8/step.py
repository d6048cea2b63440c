"""`fp8_optimizer_step`: the once-per-optimizer-step FP8 update, called by the training loop.

What it does, for every `Fp8Linear` in the model:
1. Max-reduce this step's amaxes (the running max over all micro-batches) across the module's amax group.
   All modules sharing a group are reduced in ONE all-reduce of a stacked [n_modules, 3] fp32 tensor: one
   collective per step instead of 3 per layer, and fp32 because no backend reduces FP8 (and amaxes are
   fp32 anyway). `megatron.comm` sends NaN as +inf (a MAX over NaN is backend-defined, inf is ordered);
   either way the step amax is non-finite and handled the same (see `scaling.py`).
2. Roll the amax histories, recompute the delayed scales, count non-finite steps.
3. Reset the running step amax and drop the cached FP8 weights (the optimizer has just changed them).

Modules using current scaling (tensorwise, rowwise, blockwise, mxfp8) skip 1-2 (their scales never come from
a history) but still count the roles whose step amax was not finite (rank-local: no collective for a counter).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from megatron import comm
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import Fp8Scaling
from megatron.fp8.scaling import close_current_step, delayed_update, write_delayed_updates


def _fp8_maxes(module: Fp8Linear) -> torch.Tensor:
    """The three roles' FP8 maxima on the module's device, each divided by 2^(the controller's extra margin, exact),
    made once per module, device and extra margins (not a host-to-device copy per layer and step)."""
    device = module.fp8_scale.device
    extra = tuple(module.fp8.extra_margin)
    cached = getattr(module, "_fp8_maxes_cache", None)
    if cached is None or cached[0] != (device, extra):
        specs = module.fp8.specs(module.fp8.backend(module.weight.device))
        maxes = torch.tensor([s.max / 2.0**e for s, e in zip(specs, extra)], dtype=torch.float32, device=device)
        cached = module._fp8_maxes_cache = ((device, extra), maxes)
    return cached[1]


def _update_key(module: Fp8Linear) -> tuple:
    """Modules whose delayed-scaling update is the same arithmetic on same-shaped buffers are updated together."""
    r = module.fp8.recipe
    return (r.amax_compute_algo, r.margin, r.power_of_two_scales, tuple(module.fp8_amax_history.shape),
            module.fp8_scale.device)


@torch.no_grad()
def fp8_optimizer_step(model: nn.Module, batched: bool = True) -> None:
    """Reduce amaxes (one all-reduce per amax group), update delayed scales, invalidate FP8 weight caches.
    `batched=False` updates each module on its own (the same bits; bench/bench_host_overhead.py times both)."""
    groups: dict[int, tuple[Any, list[Fp8Linear]]] = {}
    for module in model.modules():
        if not isinstance(module, Fp8Linear):
            continue
        if module.fp8.recipe.scaling is Fp8Scaling.DELAYED:
            groups.setdefault(id(module.fp8.amax_group), (module.fp8.amax_group, []))[1].append(module)
        module.fp8.forget_weights()
        if module.fp8.recipe.scaling is not Fp8Scaling.DELAYED:  # tensorwise and the fine-grained recipes
            close_current_step(module.fp8.buffers)

    for group, modules in groups.values():
        batches: dict[tuple, list[Fp8Linear]] = {}
        for m in modules:
            batches.setdefault(_update_key(m) if batched else id(m), []).append(m)
        # Stacked batch by batch, so that each batch's rows are a slice (a list index would copy the indices
        # from the host to the device: a synchronisation per step on a GPU).
        amaxes = torch.stack([m.fp8_step_amax for batch in batches.values() for m in batch])
        # amax_group None means the default group (when torch.distributed is initialized).
        comm.all_reduce(amaxes, group if group is not None else comm.world_group(), comm.ReduceOp.MAX)
        start = 0
        for batch in batches.values():
            _delayed_update_batch(batch, amaxes[start:start + len(batch)])
            start += len(batch)
    _learn_scale_validity([m for _, modules in groups.values() for m in modules])


def _learn_scale_validity(modules: list[Fp8Linear]) -> None:
    """Tell the layers whose delayed scales turned valid (`Fp8Linear.fp8.known_valid`): from then on they
    cast with the history's scale and compute no current scale. One host read for the whole model, at the step's
    end, while some role is not valid yet: the first step or two of a run (and after a checkpoint load), never
    in steady state. Validity never turns back, so nothing is read once every role is valid."""
    pending = [m for m in modules if not all(m.fp8.known_valid)]
    if not pending:
        return
    flags = torch.stack([m.fp8_scale_valid for m in pending]).tolist()
    for m, valid in zip(pending, flags):
        m.fp8.learn_scale_validity(valid)


def _delayed_update_batch(modules: list[Fp8Linear], step_amax: torch.Tensor) -> None:
    """`delayed_update` of many modules at once: their buffers stacked ([n, 3, history], [n, 3]), one update
    (the same elementwise arithmetic as per module, so the same bits), written back with foreach copies. A
    handful of kernels per step instead of ~25 per layer: on a GPU each is a launch (docs/performance.md)."""
    history, scale, valid, nonfinite = delayed_update(
        torch.stack([m.fp8_amax_history for m in modules]), torch.stack([m.fp8_scale for m in modules]),
        torch.stack([m.fp8_scale_valid for m in modules]), step_amax,
        torch.stack([_fp8_maxes(m) for m in modules]), modules[0].fp8.recipe)
    write_delayed_updates([m.fp8.buffers for m in modules], history, scale, valid, nonfinite)
    for m in modules:
        m.fp8.count_update()
