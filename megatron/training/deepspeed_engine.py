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
  are full and all-reduced: we clip them with TorchEngine's function (`megatron.parallel.clip_grad_norm`,
  tensor-parallel aware; DeepSpeed's own `gradient_clipping` is set to 0 then) and skip a non-finite step
  ourselves. With ZeRO, DeepSpeed clips (its `gradient_clipping` is `--clip-grad`, same formula as torch's),
  computes the norm of the partitioned gradients and, when it is not finite, skips the step and clears its
  partitions (its own overflow path). Non-finite steps change nothing. A non-finite *loss* with finite
  gradients (possible when the non-finite token is masked out) must skip too: its last backward is
  multiplied by NaN instead of 1.0, so the gradients become non-finite and take the same path on
  every rank (multiplying by 1.0 is exact, and the flag stays a tensor: no host sync per micro-batch).
- Checkpoints: `save_checkpoint` / `load_checkpoint` at the end of this file.

Tensor parallelism (`--tensor-model-parallel-size`, ZeRO 0-2): DeepSpeed gets `ModelParallelUnit` as its `mpu`, so
it sizes the batch, broadcasts the initial weights, reduces gradients and partitions the optimizer over the
data-parallel group only, and names its files per TP rank (mp_rank_<tp>_model_states.pt,
zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt). ZeRO's gradient norm sums over the TP group, counting a
parameter on every TP rank when it is marked `model_parallel` (our TP shards: `mark_model_parallel_params`) and
on TP rank 0 only otherwise (the replicated norms). Under sequence parallelism each replicated parameter's
gradient of a micro-batch covers only this rank's part of the sequence: `sum_sequence_parallel_grads_in_backward`
sums it over the TP group as backward produces it, before DeepSpeed accumulates, reduces or partitions it.
ZeRO-3 is refused with TP (`deepspeed_config.py` says why).

`--params-dtype bf16` (Megatron's layout) is DeepSpeed's bf16 mode, set up by `deepspeed_config.py`: DeepSpeed
casts the module's parameters to BF16 and keeps the FP32 masters in its partitions (ZeRO-1: its BF16_Optimizer,
whose partition files are named `bf16_zero_pp_rank_...`; ZeRO-2 and 3: its ZeRO optimizers); our AdamW/Fp8AdamW,
built on the FP32 model before the cast, steps those partitions. ZeRO-3 builds the model partitioned in FP32, and
DeepSpeed does not cast partitioned parameters: `zero3_cast_partitions_to_bf16` does, after the optimizer is built.

FP8 linears under ZeRO-3: an `Fp8Linear` quantizes its gathered weight in forward and, by default, keeps the FP8
copy as an optimizer-step cache on the module and for its backward in the autograd context. Under ZeRO-3 both
would keep the FP8 copy (and, on the emulated backend, its exact FP32 values: 5 bytes per parameter) of every FP8
layer on every rank: the whole model again. The cache also mostly misses there (each gather makes new storage).
So `fp8_weights_per_call` sets `Fp8Linear.fp8_weight_per_call`: each forward quantizes the gathered weight and
keeps nothing; backward requantizes the re-gathered weight with the forward's scale, which gives the same bits
(tests/unit/test_fp8_linear.py checks outputs and gradients bitwise against the cached path).

Fp8AdamW: ZeRO 1-3 hand the optimizer one flattened 1-D FP32 partition per param group, which defeats
its "matrices get FP8 states" rule, so every group is tagged with `"fp8_states"` before wrapping: our
groups are all-matrix (weight decay) or all-vector (no decay). Per-tensor scaling then means one
scale per *partition* (all matrices of a rank's slice share it); use `--fp8-optimizer-block-size`
(e.g. 128) to keep scales local.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.accelerator import Accelerator
from megatron.checkpoint import deepspeed_io
from megatron.optimizer.lr_scheduler import LrScheduler
from megatron.parallel import clip_grad_norm
from megatron.parallel.layers import SEQUENCE_PARALLEL_GRAD, TP_SHARD_DIM
from megatron.parallel.tensor_parallel import all_reduce_sum
from megatron.parallel_state import ParallelState
from megatron.partitioned import full_numel, full_shape, zero3_partitions_in_groups
from megatron.training.deepspeed_config import build_deepspeed_config, zero_stage
from megatron.training.deepspeed_shm import release_deepspeed_shm
from megatron.training.engine import MicroBatchEngine

logger = logging.getLogger("megatron")


def zero3_partitioner(config, parallel: ParallelState) -> Optional[Callable[[nn.Module], None]]:
    """`build_model`'s `partition` under DeepSpeed ZeRO-3 (None otherwise): DeepSpeed's `zero.Init(module=part)`,
    which splits each parameter of a just-materialized part of the model over the data-parallel ranks, keeping this
    rank's slice (`ds_tensor`). `deepspeed.initialize` then finds the parameters partitioned already."""
    if not config.parallel.deepspeed:
        return None
    ds_config = build_deepspeed_config(config)
    if zero_stage(ds_config) != 3:
        return None
    import deepspeed

    # zero.Init reads the world size from DeepSpeed's communication layer, which wraps our process group.
    _ensure_process_group(parallel)
    deepspeed.init_distributed()
    release_deepspeed_shm()

    def partition(part: nn.Module) -> None:
        # Over all ranks, as the engine partitions without an mpu: ZeRO-3 runs at TP = PP = 1 (deepspeed_config.py).
        deepspeed.zero.Init(module=part, config_dict_or_path=ds_config)

    return partition


def zero3_held_line(model: nn.Module) -> str:
    """What this rank holds of the model's parameters, for the log: its ZeRO-3 slices, or whole tensors."""
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor")
               else p.numel() * p.element_size() for p in model.parameters())
    full = sum(full_numel(p) * p.element_size() for p in model.parameters())
    return (f"ZeRO-3: this rank holds {held:,} bytes of parameters after build, {held / full:.3f} of the model's "
            f"{full:,}")


def zero3_cast_partitions_to_bf16(model: nn.Module) -> None:
    """ZeRO-3 with --params-dtype bf16: round this rank's FP32 partitions (and the empty placeholders) to BF16, once.

    DeepSpeed casts a module to BF16 only when it does not find it partitioned (its engine's
    `_cast_module_mixed_precision`), and `zero.Init(module=...)` partitions parameters in the dtype they have,
    so without this the ZeRO-3 module would train in FP32. Done here, after the optimizer was built on the FP32
    partitions (Fp8AdamW accepts FP32 parameters only) and before `deepspeed.initialize`, which makes the FP32
    masters from these BF16 partitions: the same order as ZeRO 1/2, where DeepSpeed casts the FP32 module in
    `initialize` (masters = the initial values rounded once to BF16). Parameters only: buffers stay FP32."""
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            param.ds_tensor.data = param.ds_tensor.data.to(torch.bfloat16)
        param.data = param.data.to(torch.bfloat16)


def fp8_weights_per_call(model: nn.Module) -> int:
    """ZeRO-3: every FP8 layer quantizes its gathered weight per forward and keeps no FP8 copy, neither across
    forwards nor from forward to backward (module docstring); the number of layers set."""
    from megatron.fp8 import Fp8Linear

    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.fp8_weight_per_call = True
        layer.invalidate_fp8_weight_cache()
    return len(layers)


def tag_fp8_state_groups(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Give every group of an Fp8AdamW an explicit `fp8_states`, decided on the unflattened shapes."""
    from megatron.optimizer.fp8_adam import Fp8AdamW

    if not isinstance(optimizer, Fp8AdamW):
        return
    for i, group in enumerate(optimizer.param_groups):
        if group.get("fp8_states") is not None or not group["params"]:
            continue
        kinds = {len(full_shape(p)) >= 2 for p in group["params"]}
        if len(kinds) > 1:
            raise ValueError(f"Fp8AdamW param group {i} mixes matrices and vectors; under ZeRO each group is "
                             "flattened into one tensor, so it needs an explicit 'fp8_states' True/False")
        group["fp8_states"] = kinds.pop()
    if stage >= 1 and optimizer.block_size == 0:
        logger.warning("Fp8AdamW under ZeRO stage %d with per-tensor scaling: each rank's flattened partition of "
                       "all matrices shares one scale; --fp8-optimizer-block-size 128 keeps scales local", stage)


class ModelParallelUnit:
    """Our tensor-parallel and data-parallel groups under the getter names of DeepSpeed's `mpu` (Megatron's).

    For `deepspeed.initialize(mpu=...)` without pipeline parallelism (the pipeline engine builds the equivalent,
    its grid, from `PipeModelDataParallelTopology`). "Model parallel" is tensor parallel here.
    """

    def __init__(self, parallel: ParallelState) -> None:
        if parallel.pipeline_parallel_size != 1 or parallel.tensor_parallel_group is None:
            raise ValueError("ModelParallelUnit is for tensor parallelism without pipeline parallelism")
        self._parallel = parallel

    def get_model_parallel_rank(self) -> int:
        return self._parallel.tensor_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return self._parallel.tensor_parallel_size

    def get_model_parallel_group(self):
        return self._parallel.tensor_parallel_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self._parallel.data_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return self._parallel.data_parallel_size

    def get_data_parallel_group(self):
        return self._parallel.data_parallel_group


def mark_model_parallel_params(model: nn.Module) -> None:
    """Set DeepSpeed's `model_parallel` on our TP shards (`tensor_parallel_dim`): its norms count them on every TP
    rank (each holds a different piece) and the unmarked, replicated parameters on TP rank 0 only."""
    for param in model.parameters():
        if hasattr(param, TP_SHARD_DIM):
            param.model_parallel = True


def sum_sequence_parallel_grads_in_backward(model: nn.Module, tp_group) -> None:
    """Sum each micro-batch's gradient of the sequence-parallel replicated parameters over the TP group.

    TorchEngine does it once per step on the accumulated gradients (`reduce_sequence_parallel_grads`). Under
    DeepSpeed the gradients leave `.grad` during backward (ZeRO reduces or partitions them as they become ready,
    the pipeline reduces them in its schedule), so the sum happens earlier: a tensor hook sees the gradient of
    this backward before it is accumulated, and sums are linear, so the result is the same up to rounding. It costs
    one small all-reduce per replicated parameter (the norms: 2 per layer + 1) per micro-batch.
    """
    for param in model.parameters():
        if getattr(param, SEQUENCE_PARALLEL_GRAD, False) and param.requires_grad:
            param.register_hook(lambda grad: all_reduce_sum(grad.clone(), tp_group))


def _precision(config) -> str:
    if config.training.params_dtype == "bf16":  # DeepSpeed's bf16 mode (deepspeed_config._check_bf16_params)
        return "BF16 autocast, BF16 weights with FP32 main gradients and FP32 masters in the ZeRO partitions"
    return "BF16 autocast" if config.training.bf16 else "FP32"


def _ensure_process_group(parallel: ParallelState) -> None:
    """DeepSpeed needs torch.distributed and LOCAL_RANK even for one process: give it a 1-rank group."""
    if parallel.is_distributed or dist.is_initialized():
        return
    os.environ.setdefault("LOCAL_RANK", "0")
    # A HashStore lives in this process: no port to pick, nothing to collide with a concurrent run.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


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
            if config.training.params_dtype == "bf16":
                zero3_cast_partitions_to_bf16(model)
                logger.info("--params-dtype bf16: %s", zero3_held_line(model).replace("after build", "in BF16"))
            fp8_weights_per_call(model)
        mark_model_parallel_params(model)
        if config.parallel.sequence_parallel and parallel.tensor_parallel_size > 1:
            sum_sequence_parallel_grads_in_backward(model, parallel.tensor_parallel_group)

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
        deepspeed_io.save_checkpoint(self.engine, save_dir, iteration, extras, train_state, config)

    def load_checkpoint(self, load_dir: str, load_optimizer: bool, module_only: bool) -> Optional[dict]:
        from megatron.checkpoint import reshard

        folder = reshard.newest_folder(load_dir)
        if folder is not None and not reshard.deepspeed_layout_matches(self, reshard.saved_layout(folder)):
            return reshard.load_into_deepspeed(self, folder, load_optimizer=load_optimizer, module_only=module_only)
        return deepspeed_io.load_checkpoint(self.engine, load_dir, load_optimizer=load_optimizer,
                                            module_only=module_only)


class DeepSpeedEngine(DeepSpeedBase, MicroBatchEngine):
    def __init__(self, config, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LrScheduler,
                 parallel: ParallelState, accel: Accelerator) -> None:
        import deepspeed

        self._initialize(config, model, optimizer, scheduler, parallel, (0, 1, 2, 3), "--deepspeed")
        self.accel = accel
        self.clip_grad = float(self.ds_config.get("gradient_clipping", 0.0))
        if self.zero_stage == 0:  # we clip (step), TP-aware; DeepSpeed's clipping would only repeat it
            self.ds_config = {**self.ds_config, "gradient_clipping": 0.0}
        _ensure_process_group(parallel)
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
            # Fills, not torch.tensor(..., device=): a host-to-device copy would synchronise the CUDA stream.
            poison = torch.where(self._loss_nonfinite, torch.full((), float("nan"), device=loss.device),
                                 torch.ones((), device=loss.device))
            loss = loss * poison.to(loss.dtype)
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
            max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
            grad_norm = clip_grad_norm(params, max_norm, self.parallel.tensor_parallel_group)
            if not bool(loss_finite & torch.isfinite(grad_norm)):  # the step's decision: one host read
                self.engine.zero_grad()
                return grad_norm, False
            self.scheduler.apply(iteration)
            self.engine.step()
            return grad_norm, True
        previous_lrs = self._apply_lr_and_remember(iteration)
        self.engine.step()
        stepped = bool(self.engine.was_step_applied())
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        if stepped and not bool(loss_finite):
            raise RuntimeError("DeepSpeed applied a step whose loss was not finite; the NaN-poisoned gradients "
                               "should have made it skip. Please report this with the DeepSpeed version.")
        if not stepped:
            self._restore_lr(previous_lrs)
        return grad_norm, stepped
