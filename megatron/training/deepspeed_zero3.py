"""The model built partitioned under DeepSpeed ZeRO-3, and what this rank holds of it.

`--params-dtype bf16` (Megatron's layout) is DeepSpeed's bf16 mode, set up by `deepspeed_config.py`: DeepSpeed
casts the module's parameters to BF16 and keeps the FP32 masters in its partitions (ZeRO-1: its BF16_Optimizer,
whose partition files are named `bf16_zero_pp_rank_...`; ZeRO-2 and 3: its ZeRO optimizers); our AdamW/Fp8AdamW,
built on the FP32 model before the cast, steps those partitions. ZeRO-3 builds the model partitioned in FP32, and
DeepSpeed does not cast partitioned parameters: `zero3_cast_partitions_to_bf16` does, after the optimizer is built.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megatron.parallel_state import ParallelState
from megatron.partitioned import full_numel
from megatron.training.deepspeed_config import build_deepspeed_config, zero_stage
from megatron.training.deepspeed_mpu import ensure_process_group
from megatron.training.deepspeed_shm import release_deepspeed_shm


def zero3_partitioner(config, parallel: ParallelState) -> Optional[Callable[[nn.Module], None]]:
    """`build_model`'s `partition` under DeepSpeed ZeRO-3 (None otherwise): DeepSpeed's `zero.Init(module=part)`,
    which splits each parameter of a just-materialized part of the model over the data-parallel ranks, keeping this
    rank's slice (`ds_tensor`). `deepspeed.initialize` then finds the parameters partitioned already."""
    if not config.parallel.deepspeed:
        return None
    ds_config = build_deepspeed_config(config)
    if zero_stage(ds_config) != 3:
        return None
    import deepspeed

    # zero.Init reads the world size from DeepSpeed's communication layer, which wraps our process group.
    ensure_process_group(parallel)
    deepspeed.init_distributed()
    release_deepspeed_shm()

    def partition(part: nn.Module) -> None:
        # Over all ranks, as the engine partitions without an mpu: ZeRO-3 runs at TP = PP = 1 (deepspeed_config.py).
        deepspeed.zero.Init(module=part, config_dict_or_path=ds_config)

    return partition


def zero3_held_line(model: nn.Module) -> str:
    """What this rank holds of the model's parameters, for the log: its ZeRO-3 slices, or whole tensors."""
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor")
               else p.numel() * p.element_size() for p in model.parameters())
    full = sum(full_numel(p) * p.element_size() for p in model.parameters())
    return (f"ZeRO-3: this rank holds {held:,} bytes of parameters after build, {held / full:.3f} of the model's "
            f"{full:,}")


def zero3_cast_partitions_to_bf16(model: nn.Module) -> None:
    """ZeRO-3 with --params-dtype bf16: round this rank's FP32 partitions (and the empty placeholders) to BF16, once.

    DeepSpeed casts a module to BF16 only when it does not find it partitioned (its engine's
    `_cast_module_mixed_precision`), and `zero.Init(module=...)` partitions parameters in the dtype they have,
    so without this the ZeRO-3 module would train in FP32. Done here, after the optimizer was built on the FP32
    partitions (Fp8AdamW accepts FP32 parameters only) and before `deepspeed.initialize`, which makes the FP32
    masters from these BF16 partitions: the same order as ZeRO 1/2, where DeepSpeed casts the FP32 module in
    `initialize` (masters = the initial values rounded once to BF16). Parameters only: buffers stay FP32."""
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            param.ds_tensor.data = param.ds_tensor.data.to(torch.bfloat16)
        param.data = param.data.to(torch.bfloat16)
