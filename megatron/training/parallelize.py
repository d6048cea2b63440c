"""`parallelize`: this rank's training model, built and distributed in one place.

In order: the pipeline stage this rank holds (`--pipeline-model-parallel-size`), the model built on meta and
materialized as this rank's tensor-parallel pieces (`--tensor-model-parallel-size`, `--sequence-parallel`) and, under
ZeRO-3, handed to DeepSpeed's partitioning piece by piece; Habana's fused kernels; the FP8 swap of the linears
(`Fp8Hooks`: recipe, statistics, controller); the pipeline module around the stage; the SwiGLU diagnostics; FSDP2's
sharding (`--use-torch-fsdp2`, megatron/training/fsdp2.py); then
`--torch-compile` (blocks compiled in place and warmed up, after every hook is registered); last, what DeepSpeed's
engines need of the model (`_prepare_for_deepspeed`). The optimizer and the engine are built around the result
(megatron/training/engines.py). One rewrite waits for the optimizer: ZeRO-3's partitions are cast to BF16 after
the optimizer was built on the FP32 ones, where DeepSpeed wraps the model (deepspeed_engine.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from megatron.accelerator import Accelerator
from megatron.config import MegatronConfig, SmoothSwiGLUGranularity
from megatron.hpu_kernels import apply_habana_kernels
from megatron.model.build import build_model
from megatron.model.compile import apply_torch_compile
from megatron.parallel_state import ParallelState
from megatron.training.deepspeed_fp8 import fp8_weights_per_call
from megatron.training.deepspeed_mpu import mark_model_parallel_params, sum_sequence_parallel_grads_in_backward
from megatron.training.deepspeed_zero3 import zero3_partitioner
from megatron.training.fp8_hooks import Fp8Hooks
from megatron.training.swiglu_hooks import SwiGLUHooks

logger = logging.getLogger("megatron")


@dataclass
class Parallelized:
    model: nn.Module  # what the engine wraps: the model, or this rank's pipeline stage module
    fp8: Fp8Hooks  # the FP8 linears' recipe, statistics and controller
    swiglu: SwiGLUHooks  # the SwiGLU diagnostics of this rank's layers


def parallelize(config: MegatronConfig, parallel: ParallelState, accel: Accelerator) -> Parallelized:
    """This rank's model under `config`'s layout (see the module docstring); seed the RNGs before calling."""
    stage = None
    if parallel.pipeline_parallel_size > 1:
        from megatron.training.pipeline_engine import pipeline_stage

        stage = pipeline_stage(config.model.num_layers, parallel)
    # Only this rank's pieces are ever allocated (built on meta, sharded and staged there); sharded before the FP8
    # swap, the optimizer and DDP, which must all see this rank's pieces.
    partition = zero3_partitioner(config, parallel)
    model = build_model(config.model, accel.device, config.training.seed, parallel, config.parallel.sequence_parallel,
                        stage, partition)
    apply_habana_kernels(model, config.compat.kernels, accel.device_type)
    fp8 = Fp8Hooks(model, config.fp8, parallel.amax_group, config.logging.log_fp8_stats, config.fp8_autoheal,
                   parallel.tensor_parallel_group)
    logger.info("> number of parameters: %d", model.num_parameters())
    log_cpu_fp8_gemms(config, accel.device)
    layers_view = model
    if stage is not None:  # keep this rank's stage only (after the FP8 swap)
        from megatron.training.pipeline_engine import build_pipeline_module, stage_layers_view

        model = build_pipeline_module(model, parallel)
        fp8.set_model(model)
        layers_view = stage_layers_view(model)
    # The logging rank summarizes; every rank of its pipeline stage records and takes part in the reductions over
    # the tensor- and data-parallel groups (and in the gather of a sharded weight, under FSDP2).
    swiglu = SwiGLUHooks(layers_view, config.model,
                         config.logging.log_swiglu_diagnostics and parallel.pipeline_parallel_rank == 0,
                         logs=parallel.is_logging_rank, data_parallel_group=parallel.data_parallel_group,
                         tensor_parallel_group=parallel.tensor_parallel_group)
    if config.parallel.use_torch_fsdp2:  # after every hook holds its modules: fully_shard keeps the objects
        from megatron.training.fsdp2 import apply_fsdp2

        apply_fsdp2(model, config, parallel, accel.device)
    apply_torch_compile(config, model, accel.device)  # --torch-compile: blocks compiled in place, warmed up
    if config.parallel.deepspeed or stage is not None:
        _prepare_for_deepspeed(config, model, parallel, zero3=partition is not None)
    return Parallelized(model, fp8, swiglu)


def _prepare_for_deepspeed(config: MegatronConfig, model: nn.Module, parallel: ParallelState, zero3: bool) -> None:
    """For DeepSpeed's engines (ZeRO and the pipeline): under ZeRO-3 each FP8 layer casts its gathered weight per
    call; the tensor-parallel shards carry DeepSpeed's `model_parallel` tag (its norms count them on every TP rank);
    with sequence parallelism each micro-batch's gradient of a replicated parameter is summed over the TP group in
    backward (DeepSpeed moves gradients out of `.grad` before the torch engine's once-per-step sum could run)."""
    if zero3:
        fp8_weights_per_call(model)
    mark_model_parallel_params(model)
    if config.parallel.sequence_parallel and parallel.tensor_parallel_size > 1:
        sum_sequence_parallel_grads_in_backward(model, parallel.tensor_parallel_group)


def log_cpu_fp8_gemms(config: MegatronConfig, device: torch.device) -> None:
    """One start-up line for FP8 runs whose GEMMs the CPU emulates: FP32 or BF16 GEMMs (megatron/fp8/cpu_gemm.py;
    a bad MEGATRON_CPU_FP8_GEMM is refused here, in one line)."""
    from megatron.fp8 import cpu_gemm
    from megatron.fp8.backends import scaled_mm_supports

    recipe = config.fp8
    if recipe is None or device.type != "cpu":
        return
    # On a CPU, auto runs emulated, and so does scaled_mm for scalings it cannot take; hpu is refused where the
    # model is built, so nothing is selected here.
    choice = recipe.backend.value
    if choice in ("auto", "emulated") or (choice in ("scaled_mm", "cuda")
                                          and not scaled_mm_supports(recipe.scaling, device)):
        logger.info(cpu_gemm.describe())
        _compile_fp8_value_conversions(device, cpu_gemm.values_dtype(), config)


def _eager_channel_scales(config: MegatronConfig, blocks_compiled: bool) -> bool:
    """Whether Smooth-SwiGLU's channel form runs in eager blocks without tensor parallelism: the start-up then
    compiles its maxima and scales (`smooth_swiglu.warm_up_channel_scales`)."""
    return (config.model.smooth_swiglu is SmoothSwiGLUGranularity.CHANNEL and not blocks_compiled
            and config.parallel.tensor_model_parallel_size == 1)


def _compile_fp8_value_conversions(device: torch.device, values_dtype: torch.dtype, config: MegatronConfig) -> None:
    """The emulated GEMMs convert FP8 operands to their values in compiled code (eager CPU conversions are scalar).
    BF16 GEMMs (the mode of CPUs with AMX): one graph for every shape, compiled here, before the first iteration,
    with, where the FP8 layers run eagerly (no fused quantization in the --torch-compile plan), their casts
    and (under --log-fp8-stats) statistics (megatron/fp8/fused.py).
    FP32 GEMMs: one graph per operand shape, compiled where a shape is first used (a few per model, in the first
    iterations; compiling for every shape costs more than they take where each process trains only a few steps)."""
    from megatron.fp8 import fused

    if values_dtype == torch.bfloat16:
        from megatron.model.compile import plan_torch_compile

        began = time.perf_counter()
        plan = plan_torch_compile(config, device.type)
        eager_layers = not plan.fp8_quantization  # else fused.py's own graphs
        fused.warm_up_upcasts(device, values_dtype, eager_layers)
        also = []
        if eager_layers and config.logging.log_fp8_stats:
            from megatron.fp8 import stats
            from megatron.fp8.formats import format_spec
            from megatron.fp8.scaling import role_dtypes

            input_spec, weight_spec, grad_spec = (format_spec(d) for d in role_dtypes(config.fp8))
            stats.warm_up_eager_counts(device, values_dtype, {input_spec, grad_spec}, {weight_spec})
            also.append("the eager FP8 layers' statistics")
        if _eager_channel_scales(config, plan.blocks):
            from megatron.model.smooth_swiglu import warm_up_channel_scales

            warm_up_channel_scales(device, torch.bfloat16 if config.training.bf16 else torch.float32)
            also.append("Smooth-SwiGLU's channel scales")
        logger.info("> torch.compile: the FP8 value conversions of the emulated GEMMs%s compiled in %.1f s, before the "
                    "first iteration", f" (and {' and '.join(also)})" if also else "", time.perf_counter() - began)
    else:
        logger.info("> torch.compile: the FP8 value conversions of the emulated GEMMs compile on first use, one graph "
                    "per operand shape (in the first iterations)")
