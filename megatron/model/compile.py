"""`--torch-compile`: compile each transformer block's forward (as torchtitan does), and the FP8 quantization.

What is compiled
----------------
- Every `TransformerLayer` is compiled in place with `nn.Module.compile(dynamic=False)`: the module object and
  its parameters stay where they are, so state-dict keys do not gain `_orig_mod.` (checkpoints, optimizers,
  DDP/DeepSpeed wrappers and the Smooth-SwiGLU / FP8 hooks all still see the plain model). Blocks have one
  shape, so they share one compiled graph (dynamo caches on the code object; a block differing in shape or
  in its FP8 recipe gets its own entry). The embedding, the final norm and the LM head stay eager.
- `Fp8Linear.forward` is a graph break inside a compiled block (see linear.py); its quantization runs through
  the compiled functions of `megatron/fp8/fused.py`, which `--torch-compile` switches on for the process.

Startup: compilation happens on a block's first call. So that it is neither inside the first iteration's time
nor in tokens/s, `warm_up` runs one forward and backward on a synthetic micro-batch of the training shape
right after the model is built, restoring everything it touched (RNG streams, the FP8 scaling buffers and
weight caches, gradients), and logs the time in one line. A later recompilation (evaluation runs without
gradients: one more graph per block) is counted where it happens.

The default (`auto`) and why: docs/performance.md ("--torch-compile"). Composes with tensor parallelism,
activation recompute (selective and full) and the plain and DeepSpeed ZeRO 0-2 engines. Pipeline
parallelism and ZeRO-3 (which swaps parameters in and out around each block's forward) are refused by
parse_config under `on`; under `auto` they turn compilation off with a log line saying why.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
from torch import nn

logger = logging.getLogger("megatron")

MODES = ("auto", "on", "off")


def resolve_torch_compile(mode: str, device_type: str) -> bool:
    """`auto`: on for CUDA, off elsewhere (measured, docs/performance.md); `on`/`off` as given."""
    if mode not in MODES:
        raise ValueError(f"--torch-compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return device_type == "cuda"
    return mode == "on"


def unsupported_reason(config: Any) -> Optional[str]:
    """Why block compilation cannot run with this configuration, or None."""
    parallel = config.parallel
    if parallel.pipeline_model_parallel_size > 1:
        return "--pipeline-model-parallel-size > 1 (DeepSpeed's pipeline engine runs the layers itself)"
    if parallel.deepspeed and parallel.zero_stage == 3:
        return "--zero-stage 3 (ZeRO-3 gathers parameters around each block's forward; use 0, 1 or 2)"
    return None


def check_torch_compile_supported(config: Any) -> None:
    """ValueError for the combinations `--torch-compile on` does not support (parse_config calls it)."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"--torch-compile on is not supported with {reason}; use --torch-compile off or auto")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    from megatron.model.transformer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def compile_blocks(model: nn.Module) -> int:
    """Compile every transformer block in place and switch on the fused FP8 quantization; the block count."""
    from megatron.fp8 import fused

    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(dynamic=False)
    fused.set_fused(True)
    return len(blocks)


def warm_up(model: nn.Module, run_micro_batch) -> float:
    """Seconds spent in `run_micro_batch()` (one forward + backward that triggers compilation), leaving the
    model as it was: RNG streams forked, buffers (FP8 amaxes, scales, statistics) restored, FP8 weight caches
    dropped, gradients cleared."""
    model.train()  # the mode training runs in (dynamo guards on it)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    counters = {name: m.fp8_weight_quantizations for name, m in model.named_modules()
                if hasattr(m, "fp8_weight_quantizations")}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    start = time.perf_counter()
    with torch.random.fork_rng(devices=devices):
        run_micro_batch()
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    for name, m in model.named_modules():
        if name in counters:
            m.fp8_weight_quantizations = counters[name]
        if hasattr(m, "invalidate_fp8_weight_cache"):
            m.invalidate_fp8_weight_cache()
    for p in model.parameters():
        p.grad = None
    return elapsed


def apply_torch_compile(config: Any, model: nn.Module, device: torch.device) -> bool:
    """The `--torch-compile` step of building a training run: compile the blocks and warm them up on one
    synthetic micro-batch of the training shape (logged, excluded from tokens/s). False when off."""
    mode = config.training.torch_compile
    if not resolve_torch_compile(mode, device.type):
        return False
    reason = unsupported_reason(config)
    if reason is not None:
        if mode == "on":  # parse_config refuses this already; a config built another way gets the same error
            check_torch_compile_supported(config)
        logger.info("> torch.compile: --torch-compile auto -> off with %s", reason)
        return False
    n = compile_blocks(model)
    from megatron.data.provider import make_batch

    t = config.training
    text = torch.zeros(t.micro_batch_size, config.model.seq_length + 1, dtype=torch.long)
    batch = make_batch(text, None, config.data).to(device)

    def run() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.bf16):
            per_token = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        (per_token * batch.loss_mask).sum().backward()

    seconds = warm_up(model, run)
    fp8 = any(hasattr(m, "fp8_weight_quantizations") for m in model.modules())
    logger.info("> torch.compile: %d transformer blocks%s compiled in %.1f s (startup, not counted in tokens/s)",
                n, " and the FP8 quantization" if fp8 else "", seconds)
    return True
