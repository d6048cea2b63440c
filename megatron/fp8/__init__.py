"""FP8 training: formats, recipes, FP8 linear layers, module swap, scaling update, checkpoints, statistics.

Typical use (the training loop does this, driven by `--fp8-*` flags):

    recipe = Fp8Recipe(format=Fp8Format.HYBRID, scaling=Fp8Scaling.DELAYED, amax_history_len=16,
                       amax_compute_algo=AmaxComputeAlgo.MAX)
    convert_to_fp8(model, recipe, amax_group=data_and_tensor_parallel_group)
    for step in ...:
        for micro_batch in ...:
            loss(model(micro_batch)).backward()
        optimizer.step()
        fp8_optimizer_step(model)          # amax all-reduce, delayed scales, FP8 weight cache reset
    checkpoint["fp8"] = fp8_state_dict(model, recipe)
"""
from megatron.fp8.convert import (collect_fp8_stats, convert_to_fp8, enable_fp8_stats, set_fp8_tracing,
                                  set_fused_quantization)
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import AmaxComputeAlgo, Fp8Backend, Fp8Format, Fp8Gemm, Fp8Recipe, Fp8Scaling
from megatron.fp8.state import fp8_state_dict, load_fp8_state_dict
from megatron.fp8.stats import worst_fp8_layer
from megatron.fp8.step import fp8_optimizer_step

__all__ = [
    "AmaxComputeAlgo",
    "Fp8Backend",
    "Fp8Format",
    "Fp8Linear",
    "Fp8Recipe",
    "Fp8Gemm",
    "Fp8Scaling",
    "collect_fp8_stats",
    "convert_to_fp8",
    "enable_fp8_stats",
    "fp8_optimizer_step",
    "fp8_state_dict",
    "load_fp8_state_dict",
    "set_fp8_tracing",
    "set_fused_quantization",
    "worst_fp8_layer",
]
