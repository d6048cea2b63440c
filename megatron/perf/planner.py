"""`--dry-run --project-on DEVICE[,DEVICE] [--project-devices N]`: this run projected on hardware, next to the same
run in BF16: step time, tokens/s per device, MFU, wall time and device-hours to --train-iters, and the step's
time per kernel class. Every line says "projected" and names the model's calibration error.

The blocks are extracted once per variant (seconds each at 7B shapes) and timed on every device asked for. The
projection is of compiled blocks (what `--torch-compile auto` runs on CUDA); a run whose blocks stay eager
(`compile.unsupported_reason`: pipeline parallelism, ZeRO-3) is told so, as a line of the output.
Under tensor parallelism the block is one device's (`device_block_model`).
"""
from __future__ import annotations

import dataclasses

from megatron.config import MegatronConfig, ModelConfig
from megatron.model.compile import unsupported_reason
from megatron.perf.calibration import CALIBRATION_SUMMARY
from megatron.perf.extract import extract_block
from megatron.perf.flops import sharding_stage
from megatron.perf.hardware import device
from megatron.perf.kernels import KernelClass
from megatron.perf.step import Projection, days, project


def bf16_twin(config: MegatronConfig) -> MegatronConfig:
    """The same run in BF16: no FP8 recipe, no Smooth-SwiGLU, no FP8 weight gathers, AdamW."""
    return dataclasses.replace(config, fp8=None, model=dataclasses.replace(config.model, smooth_swiglu=None),
                               parallel=dataclasses.replace(config.parallel, fp8_param_gather=False),
                               optimizer=config.optimizer.adamw())


def _line(label: str, p: Projection, iters: int) -> str:
    step = p.step_seconds
    total = step * iters
    return (f"  {label}: step {step:.3f} s, {p.tokens_per_second_per_device:,.0f} tokens/s per device, MFU "
            f"{100 * p.mfu:.1f}%, {iters:,} iterations in {days(total):.1f} days = {total * p.devices / 3600:,.0f} "
            "device-hours")


def _classes(p: Projection) -> str:
    return ", ".join(f"{k.value} {1e3 * v:,.0f}" for k, v in p.by_class.items() if v > 0)


def device_block_model(model: ModelConfig, tp: int) -> ModelConfig:
    """The block one device runs under tensor parallelism `tp`: 1/tp of the heads, key-value heads and FFN channels at
    the full hidden size (its GEMMs and attention are the device's; its norms and residual adds see every token, as
    without --sequence-parallel: with it, those pointwise kernels are overestimated tp times)."""
    if tp == 1:
        return model
    return dataclasses.replace(model, num_attention_heads=model.num_attention_heads // tp,
                               num_key_value_heads=model.num_key_value_heads // tp,
                               ffn_hidden_size=model.ffn_hidden_size // tp, kv_channels=model.kv_channels)


def projection_lines(config: MegatronConfig) -> list[str]:
    t = config.training
    twin = bf16_twin(config)
    mb = t.micro_batch_size
    tp = config.parallel.tensor_model_parallel_size
    bf16_block = extract_block(device_block_model(twin.model, tp), None, mb, bf16=t.bf16)
    fp8_block = extract_block(device_block_model(config.model, tp), config.fp8, mb, bf16=t.bf16) \
        if config.fp8 is not None else None
    recipe = "BF16" if config.fp8 is None else f"FP8 {config.fp8.format.value} {config.fp8.scaling.value}" + (
        " + Smooth-SwiGLU" if config.model.smooth_swiglu is not None else "")
    lines = ["", f"projected (megatron/perf roofline of the compiled blocks; {CALIBRATION_SUMMARY}):"]
    eager = unsupported_reason(config)
    if eager is not None:
        lines.append(f"  note: the transformer blocks stay eager with {eager} (megatron/model/compile.py); the "
                     "projection is of compiled blocks, so it is optimistic for this run")
    for name in t.project_on:
        dev = device(name)
        run = project(config, dev, fp8_block, bf16_block, t.project_devices)
        lines.append(f"{run.devices} x {dev.name} (projected):")
        lines.append(_line(f"this run ({recipe})", run, t.train_iters))
        lines.append(f"    ms per step by class: {_classes(run)}")
        if fp8_block is not None:
            base = project(twin, dev, None, bf16_block, t.project_devices)
            lines.append(_line("the same run in BF16", base, t.train_iters))
            lines.append(f"    ms per step by class: {_classes(base)}")
            lines.append(f"  FP8 / BF16 speed-up (projected): {base.step_seconds / run.step_seconds:.2f}x")
        exposed = run.by_class[KernelClass.COMMUNICATION]
        if exposed > 0.2 * run.step_seconds:
            share = f"  exposed communication is {100 * exposed / run.step_seconds:.0f}% of the step"
            if sharding_stage(config) >= 3:  # ZeRO-3, FSDP2: the weights are gathered again for every micro-batch
                lines.append(share + " (the sharded weights are gathered for every micro-batch): a larger "
                             "--micro-batch-size gathers them fewer times per step")
            else:
                lines.append(share + " (gradients and weights once per step): more micro-batches per step "
                             "(--global-batch-size) amortize it")
    return lines
