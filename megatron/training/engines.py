"""`build_engine`: the engine a run's flags ask for (pipeline, DeepSpeed, or the torch engine), around the model that
`parallelize` built (and compiled). The one place that knows every engine: engine.py holds the interface and the
torch engine and imports no subclass."""
from __future__ import annotations

import torch
from torch import nn

from megatron.accelerator import Accelerator
from megatron.optimizer.lr_scheduler import LrScheduler
from megatron.parallel_state import ParallelState
from megatron.training.engine import Engine, TorchEngine


def build_engine(config, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LrScheduler,
                 parallel: ParallelState, accel: Accelerator) -> Engine:
    if config.parallel.pipeline_model_parallel_size > 1:
        from megatron.training.pipeline_engine import PipelineEngine

        return PipelineEngine(config, model, optimizer, scheduler, parallel)
    if config.parallel.deepspeed:
        from megatron.training.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(config, model, optimizer, scheduler, parallel, accel)
    if config.parallel.use_torch_fsdp2:
        from megatron.training.fsdp2 import Fsdp2Engine

        engine = Fsdp2Engine(model, optimizer, scheduler, parallel, config.optimizer.clip_grad, accel=accel,
                             save_optimizer=not config.checkpoint.no_save_optim,
                             verify_checkpoints=config.checkpoint.verify)
        engine.sharded_checkpoints = config.checkpoint.ckpt_format == "torch_dist"
        if engine.sharded_checkpoints:
            engine.check_sharded_checkpoints()
        if config.checkpoint.async_save:
            engine.start_async_saves()
        return engine
    return TorchEngine(model, optimizer, scheduler, parallel, config.optimizer.clip_grad, accel=accel,
                       save_optimizer=not config.checkpoint.no_save_optim,
                       bf16_params=config.training.params_dtype == "bf16",
                       verify_checkpoints=config.checkpoint.verify)
