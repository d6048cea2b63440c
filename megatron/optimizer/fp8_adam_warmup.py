"""Fp8AdamW's compiled update, compiled before training: its first call would otherwise compile inside the first
iteration (seconds on CPU) and be counted in that iteration's time.

The warm-up runs the optimizer's own update path (`_step_stored`) on scratch tensors, once per distinct variant of
the update (moment formats, device, the group's hyperparameters, which the graph is specialized on) and per path its
parameters take (both passes in one call, or by chunks: `Fp8AdamW.one_call`), at two lengths: torch compiles the
first length statically and turns the length dynamic on the second, the graph every chunk of every parameter then
shares. Nothing of the optimizer changes: no parameter, state or step counter is
touched. Under FSDP2 the per-tensor pass reduces its amax over the shard group, so every rank warms up, in the same
order (every rank holds the same param groups).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from megatron.optimizer import fp8_adam_shards as shards
from megatron.optimizer.fp8_adam import Fp8AdamW


def _variants(opt: Fp8AdamW, sharded: bool) -> dict:
    """{(device, formats, betas, eps, weight decay): (its first group, the update paths its parameters take)} of the
    FP8-state parameters; a path is `Fp8AdamW.one_call`'s answer (one call for both passes, or passes by chunks),
    never one call where the parameters will be `sharded` (FSDP2 sets the shard group after the warm-up)."""
    out: dict = {}
    for group in opt.param_groups:
        for p in group["params"]:
            fmts = opt._formats(p, group)
            if not any(f.is_fp8 for f in fmts):
                continue  # FP32 states: the foreach path, nothing compiled
            key = (p.device, fmts, tuple(group["betas"]), group["eps"], group["weight_decay"] > 0)
            one_call = not sharded and opt.one_call(shards.local(p).numel(), p.device, fmts)
            out.setdefault(key, (group, set()))[1].add(one_call)
    return out


@torch.no_grad()  # as Fp8AdamW.step runs: grad mode is part of what a compiled graph is specialized on
def warm_up_fp8_adam(opt: torch.optim.Optimizer, sharded: bool = False) -> Optional[float]:
    """Compile `opt`'s update now (see the module docstring); the seconds it took, or None where there is nothing
    to compile (another optimizer, compilation off or failed, no FP8 states). `sharded`: the run shards the
    parameters with FSDP2, whose engine gives the optimizer its shard group later."""
    if not isinstance(opt, Fp8AdamW) or opt.runs_eager:
        return None
    variants = _variants(opt, sharded)
    if not variants:
        return None
    began = time.perf_counter()
    block = max(opt.block_size, 16)
    generator = torch.Generator().manual_seed(0)
    for (device, fmts, *_), (group, paths) in variants.items():
        for one_call in sorted(paths):
            for rows in (4, 8):
                # A matrix (the FP8-state rule looks at ndim) that requires grad, as a parameter's view does.
                scratch = torch.zeros(rows, block, dtype=torch.float32, device=device, requires_grad=True)
                grad = torch.randn(rows, block, generator=generator).to(device)
                state = opt._init_state(scratch, group)
                opt._step_stored(scratch, grad, state, group, 1.0, fmts, 0, 0, one_call=one_call)
    return time.perf_counter() - began
