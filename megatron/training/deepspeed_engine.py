"""DeepSpeed behind the loop's engine seam: ZeRO 0-3 driving our model, optimizer and LR schedule.

`deepspeed.initialize(model, optimizer=<our AdamW or Fp8AdamW>, config=<validated dict>)` wraps the
model. `DeepSpeedBase` holds what this engine and the pipeline engine share (building, wrapping, the LR of
a skipped step, checkpoint delegation); `DeepSpeedEngine` is a `MicroBatchEngine` (engine.py), so the loop
drives it exactly like `TorchEngine`, through these primitives:

- `micro_batch_context(is_last)` tells DeepSpeed where the accumulation boundary is
  (`set_gradient_accumulation_boundary`), so one `step()` per global batch is enough and gradients
  are reduced only after the last micro-batch, as with DDP's `no_sync`.
- `backward(loss)` calls DeepSpeed's backward with `scale_wrt_gas=False`: the loop has already divided
  the loss by the number of micro-batches, so gradients equal the torch path's.
- `step(iteration, loss_finite)` sets the LR from our scheduler, clips and steps. Without ZeRO the gradients
  are full and all-reduced: we take TorchEngine's guarded step (`engine.guarded_step`: clipping with
  `grads.clip_grad_norm`, tensor-parallel aware, DeepSpeed's own `gradient_clipping` set to 0; skipping a non-finite
  step ourselves). With ZeRO, DeepSpeed clips (its `gradient_clipping` is `--clip-grad`, same formula as torch's),
  computes the norm of the partitioned gradients and, when it is not finite, skips the step and clears its
  partitions (its own overflow path). Non-finite steps change nothing. A non-finite *loss* with finite
  gradients (possible when the non-finite token is masked out) must skip too: its last backward is
  multiplied by NaN instead of 1.0, so the gradients become non-finite and take the same path on
  every rank (multiplying by 1.0 is exact, and the flag stays a tensor: no host sync per micro-batch).
- Checkpoints: `megatron.checkpoint.deepspeed_io` (DeepSpeed's files inside our atomic layout).

The jobs around it have files of their own: the ZeRO-3 partitioned build (`deepspeed_zero3.py`), FP8
adaptations (`deepspeed_fp8.py`), the model-parallel unit and process group (`deepspeed_mpu.py`), and checkpoint
I/O (`megatron/checkpoint/deepspeed_io.py`).
"""
from __future__ import annotations

import contextlib
import logging
from typing import ContextManager, Optional

import torch
from torch import nn

from megatron.accelerator import Accelerator
from megatron.checkpoint import deepspeed_io
from megatron.optimizer.lr_scheduler import LrScheduler
from megatron.parallel_state import ParallelState
from megatron.partitioned import full_numel, zero3_partitions_in_groups
from megatron.training.deepspeed_config import build_deepspeed_config, zero_stage
from megatron.training.deepspeed_fp8 import tag_fp8_state_groups
from megatron.training.deepspeed_mpu import ModelParallelUnit, ensure_process_group
from megatron.training.deepspeed_shm import release_deepspeed_shm
from megatron.training.deepspeed_zero3 import zero3_cast_partitions_to_bf16, zero3_held_line
from megatron.training.engine import MicroBatchEngine, check_skipped, guarded_step, nan_unless

logger = logging.getLogger("megatron")


def _precision(config) -> str:
    if config.training.params_dtype == "bf16":  # DeepSpeed's bf16 mode (deepspeed_config._check_bf16_params)
        return "BF16 autocast, BF16 weights with FP32 main gradients and FP32 masters in the ZeRO partitions"
    return "BF16 autocast" if config.training.bf16 else "FP32"


class DeepSpeedBase:
    """What the DeepSpeed engines share: building and wrapping (`_initialize`), the LR of a skipped step,
    checkpoint delegation (DeepSpeed's files inside our atomic layout, below) and the learning rate."""

    engine: object
    optimizer: torch.optim.Optimizer

    def _initialize(self, config, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LrScheduler,
                    parallel: ParallelState, allowed_stages: tuple[int, ...], what: str) -> None:
        self.ds_config = build_deepspeed_config(config, num_parameters=sum(full_numel(p) for p in model.parameters()))
        self.zero_stage = zero_stage(self.ds_config)
        if self.zero_stage not in allowed_stages:
            raise ValueError(f"{what} needs ZeRO stage {' or '.join(map(str, allowed_stages))}, but the DeepSpeed "
                             f"config gives stage {self.zero_stage}: set zero_optimization.stage accordingly "
                             "(or pass --zero-stage)")
        self.config = config
        self.model, self.optimizer, self.scheduler, self.parallel = model, optimizer, scheduler, parallel
        tag_fp8_state_groups(optimizer, self.zero_stage)
        if self.zero_stage == 3:
            logger.info("%s", zero3_held_line(model))
            if config.training.params_dtype == "bf16":  # after the optimizer was built on the FP32 partitions
                zero3_cast_partitions_to_bf16(model)
                logger.info("--params-dtype bf16: %s", zero3_held_line(model).replace("after build", "in BF16"))

    def _wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              mpu: Optional[ModelParallelUnit] = None) -> None:
        import deepspeed

        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config, mpu=mpu)
        release_deepspeed_shm()  # after DeepSpeed's backend is up (initialize starts it if nothing did)
        deepspeed_io.use_weights_only_loading(self.engine)
        # The loop calls `module(...)`, `.train()` and `.eval()`: the DeepSpeed engine is itself an nn.Module
        # whose forward runs ZeRO-3 gathering and the torch_autocast section around our model.
        self.module: nn.Module = self.engine
        summary = getattr(optimizer, "state_summary", None)
        if summary is not None:
            with zero3_partitions_in_groups(self.engine.optimizer):
                logger.info("%s", summary())

    def _apply_lr_and_remember(self, iteration: int) -> list[float]:
        previous = [g["lr"] for g in self.optimizer.param_groups]
        self.scheduler.apply(iteration)
        return previous

    def _restore_lr(self, previous: list[float]) -> None:
        """A skipped step leaves the LR where TorchEngine would (DeepSpeed's skip comes after we set it)."""
        for group, lr in zip(self.optimizer.param_groups, previous):
            group["lr"] = lr

    @property
    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def save_checkpoint(self, save_dir: str, iteration: int, extras: dict, train_state: dict,
                        config: dict) -> None:
        deepspeed_io.save_checkpoint(self.engine, save_dir, iteration, extras, train_state, config,
                                     verify_group=self.parallel.host_group, verify=self.config.checkpoint.verify)

    def load_checkpoint(self, load_dir: str, load_optimizer: bool, module_only: bool,
                        iteration: Optional[int] = None) -> Optional[dict]:
        from megatron.checkpoint import reshard

        folder = reshard.newest_folder(load_dir, iteration)
        if folder is not None and not reshard.deepspeed_layout_matches(self, reshard.saved_layout(folder)):
            return reshard.load_into_deepspeed(self, folder, load_optimizer=load_optimizer, module_only=module_only)
        return deepspeed_io.load_checkpoint(self.engine, load_dir, load_optimizer=load_optimizer,
                                            module_only=module_only, iteration=iteration)


class DeepSpeedEngine(DeepSpeedBase, MicroBatchEngine):
    def __init__(self, config, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LrScheduler,
                 parallel: ParallelState, accel: Accelerator) -> None:
        import deepspeed

        self._initialize(config, model, optimizer, scheduler, parallel, (0, 1, 2, 3), "--deepspeed")
        self.accel = accel
        self.clip_grad = float(self.ds_config.get("gradient_clipping", 0.0))
        if self.zero_stage == 0:  # we clip (step), TP-aware; DeepSpeed's clipping would only repeat it
            self.ds_config = {**self.ds_config, "gradient_clipping": 0.0}
        ensure_process_group(parallel)
        tensor_parallel = parallel.tensor_parallel_size > 1
        self._wrap(model, optimizer, ModelParallelUnit(parallel) if tensor_parallel else None)
        logger.info("DeepSpeed %s: ZeRO stage %d, %s, optimizer %s wrapped by %s", deepspeed.__version__,
                    self.zero_stage, _precision(config), type(optimizer).__name__,
                    type(self.engine.optimizer).__name__)
        self._loss_nonfinite: Optional[torch.Tensor] = None
        self._is_last = True

    def zero_grad(self) -> None:
        self.engine.zero_grad()
        self._loss_nonfinite = None

    def micro_batch_context(self, is_last: bool) -> ContextManager:
        self.engine.set_gradient_accumulation_boundary(is_last)
        self._is_last = is_last
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())
        self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad
        if self._is_last:
            loss = nan_unless(~self._loss_nonfinite, loss)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, iteration: int, loss_finite: torch.Tensor) -> tuple[torch.Tensor | float, bool]:
        """Set the LR, clip, step; (grad norm, stepped). A non-finite step changes neither weights nor state.

        `loss_finite` is a 0-d bool tensor on the device. ZeRO 0 reads the host once (the skip decision);
        ZeRO >= 1 leaves the decision to DeepSpeed's overflow check (which reads the host itself) and we read
        `loss_finite` only to check that DeepSpeed skipped a non-finite loss.
        """
        self._loss_nonfinite = None
        if self.zero_stage == 0:
            # Gradients are full and already all-reduced over data parallelism: clip and check them the way
            # TorchEngine does (the norm of the whole model over the TP shards, the same on every rank).
            params = [p for p in self.model.parameters() if p.grad is not None]

            def step() -> None:
                self.scheduler.apply(iteration)
                self.engine.step()

            return guarded_step(params, self.clip_grad, self.parallel.tensor_parallel_group, loss_finite,
                                self.engine.zero_grad, step)
        previous_lrs = self._apply_lr_and_remember(iteration)
        self.engine.step()
        stepped = bool(self.engine.was_step_applied())
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        check_skipped(stepped, bool(loss_finite), "DeepSpeed")
        if not stepped:
            self._restore_lr(previous_lrs)
        return grad_norm, stepped
