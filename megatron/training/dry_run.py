"""`--dry-run`: the resolved configuration, parameter count, FLOPs and memory, without building anything."""
from __future__ import annotations

import json

from megatron.config import MegatronConfig
from megatron.training.flops import count_parameters, flops_per_iteration, memory_estimate_bytes


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
             + ", ".join(f"{k.removesuffix('_GiB')} {v:.2f}" for k, v in mem.items())]
    return "\n".join(lines)
