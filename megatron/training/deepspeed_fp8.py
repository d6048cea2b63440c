"""FP8 under DeepSpeed: the FP8 layers' weights under ZeRO-3 and Fp8AdamW's flattened ZeRO partitions.

FP8 linears under ZeRO-3: an `Fp8Linear` quantizes its gathered weight in forward and, by default, keeps the FP8
copy as an optimizer-step cache on the module and for its backward in the autograd context. Under ZeRO-3 both
would keep the FP8 copy (and, on the emulated backend, its exact FP32 values: 5 bytes per parameter) of every FP8
layer on every rank: the whole model again. The cache also mostly misses there (each gather makes new storage).
So `fp8_weights_per_call` sets `Fp8Linear.fp8.weight_per_call`: each forward quantizes the gathered weight and
keeps nothing; backward requantizes the re-gathered weight with the forward's scale, which gives the same bits
(tests/unit/test_fp8_linear.py checks outputs and gradients bitwise against the cached path).

Fp8AdamW: ZeRO 1-3 hand the optimizer one flattened 1-D FP32 partition per param group, which defeats
its "matrices get FP8 states" rule, so every group is tagged with `"fp8_states"` before wrapping: our
groups are all-matrix (weight decay) or all-vector (no decay). Per-tensor scaling then means one
scale per *partition* (all matrices of a rank's slice share it); use `--fp8-optimizer-block-size`
(e.g. 128) to keep scales local.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from megatron.partitioned import full_shape

logger = logging.getLogger("megatron")


def fp8_weights_per_call(model: nn.Module) -> int:
    """ZeRO-3: every FP8 layer quantizes its gathered weight per forward and keeps no FP8 copy, neither across
    forwards nor from forward to backward (module docstring); the number of layers set."""
    from megatron.fp8 import Fp8Linear

    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.fp8.configure(weight_per_call=True)
        layer.fp8.forget_weights()
    return len(layers)


def tag_fp8_state_groups(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Give every group of an Fp8AdamW an explicit `fp8_states`, decided on the unflattened shapes."""
    from megatron.optimizer.fp8_adam import Fp8AdamW

    if not isinstance(optimizer, Fp8AdamW):
        return
    for i, group in enumerate(optimizer.param_groups):
        if group.get("fp8_states") is not None or not group["params"]:
            continue
        kinds = {len(full_shape(p)) >= 2 for p in group["params"]}
        if len(kinds) > 1:
            raise ValueError(f"Fp8AdamW param group {i} mixes matrices and vectors; under ZeRO each group is "
                             "flattened into one tensor, so it needs an explicit 'fp8_states' True/False")
        group["fp8_states"] = kinds.pop()
    if stage >= 1 and optimizer.block_size == 0:
        logger.warning("Fp8AdamW under ZeRO stage %d with per-tensor scaling: each rank's flattened partition of "
                       "all matrices shares one scale; --fp8-optimizer-block-size 128 keeps scales local", stage)
