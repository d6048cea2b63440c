"""`--dry-run`: the resolved configuration, parameter count, FLOPs and memory, without building anything; with
`--project-on`, the run projected on hardware (megatron/perf/planner.py).

The memory estimate is `flops.memory_estimate_bytes`; `persistent_line` adds what the weight layout
(`--params-dtype`) and ZeRO decide: persistent bytes per parameter on one device.
"""
from __future__ import annotations

import json

from megatron.config import MegatronConfig
from megatron.perf.flops import count_parameters, flops_per_iteration, memory_estimate_bytes


def describe(config: MegatronConfig) -> str:
    m, t = config.model, config.training
    params = count_parameters(m)
    flops = flops_per_iteration(m, t.global_batch_size)
    mem = memory_estimate_bytes(config)
    lines = ["resolved configuration:", json.dumps(config.to_dict(), indent=2, sort_keys=True), "",
             f"parameters: {params:,} ({params / 1e9:.3f} B)",
             f"tokens per iteration: {t.global_batch_size * m.seq_length:,}",
             f"gradient accumulation steps: {t.num_micro_batches}",
             f"FLOPs per iteration (model, fwd+bwd): {flops:.4e}",
             f"total FLOPs for {t.train_iters} iterations: {flops * t.train_iters:.4e}",
             "memory estimate per device (GiB): "
             + ", ".join(f"{k.removesuffix('_GiB')} {v:.2f}" for k, v in mem.items() if k != "fp8_weights_in_step_GiB"),
             persistent_line(config, mem)]
    if mem["fp8_weights_in_step_GiB"]:
        lines.append(f"FP8 weight copies during a step (not in the total; made at the step's first forward, dropped "
                     f"after its optimizer step; real FP8 GEMMs): {mem['fp8_weights_in_step_GiB']:.2f} GiB")
    if t.project_on:
        from megatron.perf.planner import projection_lines

        lines += projection_lines(config)
    return "\n".join(lines)


def persistent_line(config: MegatronConfig, mem: dict[str, float]) -> str:
    """Persistent state (weights, gradients, master, optimizer: not activations) per parameter of this device's
    model piece, the figure the weight layout and ZeRO change."""
    p = config.parallel
    params = count_parameters(config.model) / (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    persistent = sum(mem[k] for k in ("weights_GiB", "grads_GiB", "master_GiB", "optimizer_GiB")) * 2.0**30
    sharding = "FSDP2" if p.use_torch_fsdp2 else f"ZeRO {p.zero_stage or 0}"
    return (f"persistent state per device: {persistent / params:.3f} bytes/param (--params-dtype "
            f"{config.training.params_dtype}, {sharding}, data parallel {config.training.data_parallel_size})")
