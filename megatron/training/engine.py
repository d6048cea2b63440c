"""The engine seam: how micro-batch gradients become one optimizer step.

`TorchEngine` covers one process and torch DDP: backward without gradient all-reduce on all but the
last micro-batch, then gradient clipping, a finite check and the optimizer step. A DeepSpeed engine
implements the same small interface (`module`, `micro_batch_context`, `backward`, `step`,
`optimizer_state_dict`, `load_optimizer_state_dict`) so the loop never branches on the engine.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn

from megatron.optimizer.lr_scheduler import LrScheduler
from megatron.parallel import clip_grad_norm, reduce_sequence_parallel_grads
from megatron.parallel_state import ParallelState


class TorchEngine:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LrScheduler,
                 parallel: ParallelState, clip_grad: float) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.parallel = parallel
        self.clip_grad = clip_grad
        self.module: nn.Module = model
        # DDP over the data-parallel group only: tensor-parallel ranks hold different shards.
        self.ddp = parallel.data_parallel_size > 1
        if self.ddp:
            self.module = nn.parallel.DistributedDataParallel(model, process_group=parallel.data_parallel_group)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def micro_batch_context(self, is_last: bool) -> ContextManager:
        """Gradients are all-reduced only on the last micro-batch of the step."""
        if self.ddp and not is_last:
            return self.module.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, iteration: int, loss_finite: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Clip, check, step. Returns (grad norm, stepped); a non-finite step changes nothing.

        `loss_finite` (0-d bool) and the returned norm stay on the device; the one host read is the skip
        decision itself (docs/distributed.md, "Host synchronisation").
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        reduce_sequence_parallel_grads(self.model, self.parallel.tensor_parallel_group)
        grad_norm = clip_grad_norm(params, max_norm, self.parallel.tensor_parallel_group)
        if not bool(loss_finite & torch.isfinite(grad_norm)):
            self.zero_grad()
            return grad_norm, False
        self.scheduler.apply(iteration)
        self.optimizer.step()
        return grad_norm, True

    @property
    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def optimizer_state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def build_engine(config, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LrScheduler,
                 parallel: ParallelState):
    if config.parallel.pipeline_model_parallel_size > 1:
        from megatron.training.pipeline_engine import PipelineEngine

        return PipelineEngine(config, model, optimizer, scheduler, parallel)
    if config.parallel.deepspeed:
        from megatron.training.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(config, model, optimizer, scheduler, parallel)
    return TorchEngine(model, optimizer, scheduler, parallel, config.optimizer.clip_grad)
