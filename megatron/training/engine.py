"""The engine seam: the one interface the training loop drives, and the torch engine.

`Engine` is what the loop calls, whatever runs underneath (torch/DDP, DeepSpeed ZeRO, DeepSpeed's pipeline):

- `train_batch(iteration, batches, loss_fn)`: one optimizer step over a global batch's micro-batches (on this
  data-parallel rank) -> (loss, grad norm, stepped). The loss and norm may stay 0-d device tensors.
- `evaluate(batches, loss_fn)`: the evaluation loss of some micro-batches, reduced over data parallelism.
- `save_checkpoint(save_dir, iteration, extras, train_state, config)` / `load_checkpoint(load_dir,
  load_optimizer, module_only)`: every rank takes part; the engine writes weights and optimizer state in its
  own layout (ours, per TP rank; DeepSpeed's ZeRO partitions or pipeline layers) with the loop's `extras`
  (LR schedule, RNG, FP8 scaling state) beside them, and restores weights and optimizer state in place.
- `module` (what runs forward), `learning_rate`.

`loss_fn(module, batch) -> (masked loss sum, token count)` is the loop's forward. `MicroBatchEngine`
implements `train_batch` and `evaluate` over four primitives (`zero_grad`, `micro_batch_context`, `backward`,
`step`) for the engines that see every micro-batch: `TorchEngine` here and `DeepSpeedEngine`. The pipeline
engine hands the micro-batches to DeepSpeed whole. The loop never asks which engine it has.
"""
from __future__ import annotations

import abc
import contextlib
import logging
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from megatron import comm
from megatron.accelerator import Accelerator
from megatron.checkpoint import layouts
from megatron.checkpoint import store as ckpt
from megatron.checkpoint import reshard
from megatron.checkpoint.tp_shards import save_tensor_parallel_checkpoint
from megatron.checkpoint.verify import verify_file
from megatron.data.provider import Batch
from megatron.optimizer.lr_scheduler import LrScheduler
from megatron.optimizer.main_params import MainParams, ModelIsMaster
from megatron.parallel import clip_grad_norm, reduce_sequence_parallel_grads
from megatron.parallel_state import ParallelState

logger = logging.getLogger("megatron")

LossFn = Callable[[nn.Module, Batch], "tuple[torch.Tensor, torch.Tensor]"]
StepResult = "tuple[torch.Tensor | float, torch.Tensor | float, bool]"


def nan_unless(finite: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`loss` times exactly 1.0 where `finite` (a 0-d bool on the device), else times NaN: a non-finite token masked
    out of the loss, or an earlier micro-batch's non-finite loss, then makes every gradient non-finite, so the step
    is skipped on every rank and stage. The factor is made by `where` on the device (no host copy, no sync)."""
    one = torch.ones((), dtype=loss.dtype, device=loss.device)
    return loss * torch.where(finite, one, torch.full((), float("nan"), dtype=loss.dtype, device=loss.device))


def guarded_step(params: Sequence[nn.Parameter], clip_grad: float, tp_group, loss_finite: torch.Tensor,
                 skip: Callable[[], None], step: Callable[[], None], norm_group: Any = None
                 ) -> tuple[torch.Tensor, bool]:
    """The step of every engine that clips itself: clip to `clip_grad` by the norm of the whole logical gradient
    (`grads.clip_grad_norm`, over the tensor-parallel shards; 0: no clipping), then `skip()` when the loss or the
    norm is not finite (one host read: the decision), else `step()` (set the LR, step the optimizer).
    `norm_group`: the ranks whose pieces make up the gradient, where not the tensor-parallel group (FSDP2's).
    Returns (grad norm, stepped); the norm stays on the device."""
    grad_norm = clip_grad_norm(params, clip_grad, tp_group, norm_group)
    if not bool(loss_finite & torch.isfinite(grad_norm)):
        skip()
        return grad_norm, False
    step()
    return grad_norm, True


def check_skipped(stepped: bool, loss_finite: bool, what: str) -> None:
    """A step that an engine applied although the loss was not finite would corrupt the weights: stop loudly."""
    if stepped and not loss_finite:
        raise RuntimeError(f"{what} applied a step whose loss was not finite; the NaN-poisoned gradients should have "
                           "made it skip. Please report this with the DeepSpeed version.")


class Engine(abc.ABC):
    """See the module docstring."""

    module: nn.Module
    optimizer: torch.optim.Optimizer

    @abc.abstractmethod
    def train_batch(self, iteration: int, batches: Sequence[Batch], loss_fn: LossFn) -> StepResult: ...

    @abc.abstractmethod
    def evaluate(self, batches: Sequence[Batch], loss_fn: LossFn,
                 progress: Optional[Callable[[int], None]] = None) -> float:
        """Token-weighted mean loss over `batches` and the data-parallel replicas; `progress(done)` after each
        micro-batch (or pipeline batch) evaluated."""

    @abc.abstractmethod
    def save_checkpoint(self, save_dir: str, iteration: int, extras: dict, train_state: dict,
                        config: dict) -> None: ...

    @abc.abstractmethod
    def load_checkpoint(self, load_dir: str, load_optimizer: bool, module_only: bool,
                        iteration: Optional[int] = None) -> Optional[dict]:
        """None when `load_dir` holds no checkpoint; else {"payload": extras, "train_state", "path"}. `iteration`:
        the one to load (`fallback.resume_iteration`'s choice); None: the tracker's."""

    def poll_checkpoint(self, wait: bool = False) -> Optional[int]:
        """Commit a checkpoint written in the background (--async-save) once every rank has written it; `wait`:
        block until then. The iteration committed, or None (engines that save synchronously: always)."""
        return None

    @property
    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


class MicroBatchEngine(Engine):
    """`train_batch` and `evaluate` for engines that run each micro-batch's forward and backward themselves."""

    accel: Accelerator
    parallel: ParallelState
    model: nn.Module  # the bare model (`module` may wrap it)

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def micro_batch_context(self, is_last: bool) -> ContextManager: ...

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def step(self, iteration: int, loss_finite: torch.Tensor) -> tuple[torch.Tensor | float, bool]:
        """Clip, check, step: (grad norm, stepped); a non-finite step changes nothing."""

    def train_batch(self, iteration: int, batches: Sequence[Batch], loss_fn: LossFn) -> StepResult:
        """Each micro-batch loss is the mean over its unmasked tokens; the step averages them (Megatron's
        convention). The averaged loss stays on the device (one all-reduce over data parallelism)."""
        device, n = self.accel.device, len(batches)
        self.module.train()
        self.zero_grad()
        loss_sum = torch.zeros((), device=device)
        for i, batch in enumerate(batches):
            with self.micro_batch_context(is_last=i == n - 1):
                masked, count = loss_fn(self.module, batch.to(device))
                loss = masked / count.clamp(min=1.0)
                self.backward(loss / n)
                self.accel.mark_step()
            loss_sum += loss.detach().float()
        loss_avg = loss_sum / n
        comm.all_reduce(loss_avg, self.parallel.data_parallel_group)  # stays on the device
        loss_avg /= self.parallel.data_parallel_size
        grad_norm, stepped = self.step(iteration, torch.isfinite(loss_avg))
        return loss_avg, grad_norm, stepped

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch], loss_fn: LossFn,
                 progress: Optional[Callable[[int], None]] = None) -> float:
        """Token-weighted mean loss over `batches` and the data-parallel replicas (one host read)."""
        self.module.eval()
        sums = []  # (masked loss sum, token count) per micro-batch, kept on the device: one read at the end
        for batch in batches:  # the bare model: no DDP/DeepSpeed wrapper is needed without gradients
            masked, count = loss_fn(self.model, batch.to(self.accel.device))
            self.accel.mark_step()
            sums.append(torch.stack([masked.float(), count.float()]))
            if progress is not None:
                progress(len(sums))
        # Added in float64 on the host (Gaudi has no float64 arithmetic), in micro-batch order.
        total = torch.zeros(2, dtype=torch.float64)
        for row in torch.stack(sums).cpu().double() if sums else []:
            total += row
        comm.all_reduce(total, self.parallel.data_parallel_group)  # comm moves it to the backend's device
        self.module.train()
        return float(total[0] / total[1].clamp(min=1.0))


class TorchEngine(MicroBatchEngine):
    """One process or torch DDP over the data-parallel group; checkpoints in our layout (mp_rank_XX)."""

    wraps_in_ddp = True  # False: the model reduces its own gradients (FSDP2, megatron/training/fsdp2.py)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LrScheduler,
                 parallel: ParallelState, clip_grad: float, *, accel: Optional[Accelerator] = None,
                 save_optimizer: bool = True, bf16_params: bool = False, verify_checkpoints: bool = False) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.parallel = parallel
        # Default: the accelerator of the device the model lives on (tests build engines around CPU models).
        self.accel = accel or Accelerator(next(model.parameters()).device.type)
        self.clip_grad = clip_grad
        self.save_optimizer = save_optimizer
        self.verify = verify_file if verify_checkpoints else None  # --verify-checkpoint (checkpoint/verify.py)
        self.module: nn.Module = model
        # The weight layout: --params-dtype bf16 = BF16 weights, FP32 main gradients (all-reduced in step), FP32
        # masters in the optimizer; fp32 = the model's parameters are the masters.
        self.weights: ModelIsMaster | MainParams = (MainParams if bf16_params else ModelIsMaster)(model, optimizer)
        # DDP over the data-parallel group only: tensor-parallel ranks hold different shards.
        self.ddp = parallel.data_parallel_size > 1 and not self.weights.reduces_gradients and self.wraps_in_ddp
        if self.ddp:
            self.module = nn.parallel.DistributedDataParallel(model, process_group=parallel.data_parallel_group)

    def zero_grad(self) -> None:
        self.weights.zero_grad()

    def micro_batch_context(self, is_last: bool) -> ContextManager:
        """Gradients are all-reduced only on the last micro-batch of the step."""
        if self.ddp and not is_last:
            return self.module.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, iteration: int, loss_finite: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """`loss_finite` (0-d bool) and the returned norm stay on the device; the one host read is the skip
        decision itself (docs/distributed.md, "Host synchronisation")."""
        # The gradients clipping and the optimizer see (bf16 layout: the FP32 main gradients, averaged over data
        # parallelism, attached to the masters).
        params = self.weights.reduce_and_attach(self.parallel.data_parallel_group, self.parallel.data_parallel_size)
        reduce_sequence_parallel_grads(self.model, self.parallel.tensor_parallel_group)

        def step() -> None:
            self.scheduler.apply(iteration)
            self.optimizer.step()
            self.weights.copy_to_model()

        return guarded_step(params, self.clip_grad, self.parallel.tensor_parallel_group, loss_finite, self.zero_grad,
                            step, self.norm_group())

    def norm_group(self) -> Any:
        """The ranks over which the gradient norm's squares are summed; None: the tensor-parallel group (DDP has
        made the data-parallel replicas' gradients equal)."""
        return None

    def save_checkpoint(self, save_dir: str, iteration: int, extras: dict, train_state: dict,
                        config: dict) -> None:
        """The first data-parallel replica writes: one shard per tensor-parallel rank (mp_rank_XX)."""
        payload = None
        if self.parallel.data_parallel_rank == 0:
            payload = {"model": self.weights.state_dict(self.model), **extras}
            if self.save_optimizer:
                payload["optimizer"] = self.optimizer.state_dict()
        self._write(save_dir, iteration, payload, train_state, config)

    def _write(self, save_dir: str, iteration: int, payload: Optional[dict], train_state: dict, config: dict) -> None:
        """Write `payload` (None on the ranks that do not write) atomically; every rank takes part."""
        if self.parallel.tensor_parallel_size > 1:  # every rank raises when any shard failed
            save_tensor_parallel_checkpoint(save_dir, iteration, payload, train_state, config, self.parallel,
                                            verify=self.verify)
        else:
            error: Optional[ckpt.CheckpointError] = None
            if self.parallel.is_logging_rank:
                try:
                    ckpt.save_checkpoint(save_dir, iteration, payload, train_state, config, verify=self.verify)
                except ckpt.CheckpointError as exc:
                    error = exc
            # every rank takes the same branch: a rank that went on while rank 0 raised would wait in the barrier
            if ckpt.any_rank_failed(error is not None, self.parallel.host_group):
                raise error or ckpt.CheckpointError(f"rank 0 could not write the checkpoint of iteration {iteration} "
                                                    f"into {save_dir} (see its error); the previous one is intact")
        comm.barrier(comm.world_group())

    def load_checkpoint(self, load_dir: str, load_optimizer: bool, module_only: bool,
                        iteration: Optional[int] = None) -> Optional[dict]:
        folder = reshard.newest_folder(load_dir, iteration)
        if folder is not None:
            saved = reshard.saved_layout(folder)
            tp = self.parallel.tensor_parallel_size
            switched = reshard.optimizer_switched(saved, self.optimizer, load_optimizer and not module_only)
            same_layout = saved["layout"] in (layouts.SINGLE, layouts.TENSOR_PARALLEL) and saved["mp_files"] == tp
            if saved["layout"] is not None and (switched or not same_layout):
                # --params-dtype bf16: the FP32 masters take the checkpoint's FP32 values (and key the optimizer
                # state); the BF16 weights are rounded from them, as after every step.
                loaded = reshard.load_resharded(
                    folder, model=self.model, full_name=lambda n: n, model_config=self.model.config,
                    tp_rank=self.parallel.tensor_parallel_rank, tp_size=tp, optimizer=self.optimizer,
                    load_optimizer=load_optimizer, module_only=module_only,
                    describe=f"tensor parallel {tp}" + (f", optimizer {saved['optimizer']} -> "
                                                        f"{reshard.optimizer_name(self.optimizer)}" if switched else ""),
                    weights=self.weights.named_masters())
                self.weights.copy_to_model()
                return loaded
        loaded = ckpt.load_checkpoint_files(load_dir, mp_rank=self.parallel.tensor_parallel_rank, iteration=iteration)
        if loaded is None:
            return None
        payload = loaded["payload"]
        ckpt.load_model_state(self.model, payload["model"], loaded["path"])
        self.weights.load(payload["model"])  # bf16 layout: the saved FP32 weights are the masters (either layout)
        if load_optimizer and not module_only:
            if "optimizer" not in payload:
                raise ckpt.CheckpointError(f"{loaded['path']} has no optimizer state (saved with --no-save-optim); "
                                           "pass --no-load-optim or --finetune")
            self.optimizer.load_state_dict(payload["optimizer"])
        return loaded
