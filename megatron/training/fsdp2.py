"""PyTorch FSDP2 (`--use-torch-fsdp2`): the model's parameters sharded over the data-parallel ranks by PyTorch's own
engine, `torch.distributed.fsdp.fully_shard`.

`apply_fsdp2` (called by `parallelize`, after the FP8 swap) shards each transformer block and then the model's root
(embedding, final norm, LM head) over a 1-D mesh of the data-parallel group: every rank keeps 1/dp of each
parameter (a DTensor, Shard(0)), a block's parameters are all-gathered before its forward and backward, its
gradients reduce-scattered after backward. Precision is an explicit `MixedPrecisionPolicy`: the FP32 shards are
gathered in BF16 under `--bf16` (FP32 otherwise), gradients are reduce-scattered in FP32 (`--grad-reduce-in-bf16`:
BF16), and the optimizer steps the FP32 shards. `--no-fsdp-reshard-after-forward` keeps a block's gathered
parameters from its forward to its backward (one all-gather less per block, the memory of a whole model's weights).

FP8 layers cast their weight per call, as under ZeRO-3 (`Fp8LayerSettings.weight_per_call`): the gathered weight
exists only around its block, so no FP8 copy is kept between forwards, nor from forward to backward (backward casts
the re-gathered weight again with the forward's scale: the same bits).

`Fsdp2Engine` is the torch engine without DDP: gradient accumulation without a reduce-scatter until the last
micro-batch (`set_requires_gradient_sync`), the same guarded step (the norm of the sharded gradients, reduced over
the mesh), and checkpoints in the torch engine's layout: the full model and the optimizer state gathered to rank 0
(`torch.distributed.checkpoint.state_dict`, full state dicts) and written as a data-parallel run writes them, so that
every tool and every other engine reads them, and a checkpoint loads at any data-parallel size.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpoint import dcp_io, layouts, reshard
from megatron.checkpoint import store as ckpt
from megatron.config import MegatronConfig
from megatron.parallel_state import ParallelState
from megatron.training.engine import TorchEngine

logger = logging.getLogger("megatron")


def apply_fsdp2(model: nn.Module, config: MegatronConfig, parallel: ParallelState, device: torch.device) -> int:
    """Shard `model` in place (module docstring); the number of `fully_shard` units (blocks + root)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as exc:  # torch < 2.6
        raise RuntimeError(f"--use-torch-fsdp2 needs torch.distributed.fsdp.fully_shard (torch >= 2.6; this is torch "
                           f"{torch.__version__}): {exc}") from exc
    from megatron.model.compile import transformer_blocks
    from megatron.parallel.grads import copy_parallel_roles
    from megatron.training.deepspeed_fp8 import fp8_weights_per_call

    if not dist.is_initialized():  # one process: FSDP2 still needs a process group (of one rank)
        from megatron.training.deepspeed_mpu import ensure_process_group

        ensure_process_group(parallel)
    group = parallel.data_parallel_group if parallel.data_parallel_group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device.type)
    parallel_cfg = config.parallel
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if config.training.bf16 else None,
        reduce_dtype=torch.bfloat16 if parallel_cfg.grad_reduce_in_bf16 else torch.float32)
    reshard = parallel_cfg.fsdp_reshard_after_forward
    # FSDP2 warns that the root returns a view (the per-token loss); the loop only reads it (a masked sum), never
    # writes into it in place, which is what would skip the pre-backward hook.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPTModel\) returned a view tensor")
    before = dict(model.named_parameters())  # the parameters with their TP roles (FP8 gathers wrap them anew)
    fp8_layers = fp8_weights_per_call(model)
    gathered = _fp8_gathered_layers(model, config)
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    for name, param in model.named_parameters():  # fully_shard made new parameters: the TP roles carry over
        copy_parallel_roles(before[name], param)
    if gathered:
        from megatron.training.fp8_gather import GatherScales

        model.fp8_gather_scales = GatherScales(model, gathered, group, policy.param_dtype)
    logger.info("FSDP2: %d blocks and the root sharded over %d data-parallel ranks%s; parameters gathered in %s, "
                "gradients reduced in %s%s; %d FP8 layers cast their gathered weight per call%s", len(blocks),
                mesh.size(), f" (of each of {parallel.tensor_parallel_size} tensor-parallel ranks' pieces)"
                if parallel.tensor_parallel_size > 1 else "", "BF16" if config.training.bf16 else "FP32",
                "BF16" if parallel_cfg.grad_reduce_in_bf16 else "FP32",
                "" if reshard else ", gathered parameters kept from forward to backward", fp8_layers - len(gathered),
                f", {len(gathered)} gather their weight in FP8 (--fp8-param-gather)" if gathered else "")
    return len(blocks) + 1


def _fp8_gathered_layers(model: nn.Module, config: MegatronConfig) -> list[nn.Module]:
    """`--fp8-param-gather`: the FP8 linears whose weight FSDP2 will gather in FP8, their weights wrapped for it
    (megatron/training/fp8_gather.py); the others, if any, are named in the log."""
    if not config.parallel.fp8_param_gather:
        return []
    from megatron.fp8 import Fp8Linear
    from megatron.training.fp8_gather import eligible_layers, wrap_weights

    layers = eligible_layers(model)
    wrap_weights(layers)
    chosen = {id(m) for m in layers}
    others = [name for name, m in model.named_modules() if isinstance(m, Fp8Linear) and id(m) not in chosen]
    if others:
        logger.info("--fp8-param-gather: %d FP8 layers gather their weight in high precision (their weight columns "
                    "are scaled per call, Smooth-SwiGLU's fc2): %s", len(others), ", ".join(others[:4]))
    return layers


class Fsdp2Engine(TorchEngine):
    """The torch engine around an FSDP2-sharded model (module docstring)."""

    wraps_in_ddp = False
    sharded_checkpoints = False  # --ckpt-format torch_dist: each rank writes its shards (checkpoint/dcp_io.py)
    async_saver = None  # --async-save: checkpoint/dcp_async.py's AsyncSaver
    tp_shards = None  # under tensor parallelism, the (tp, dp) mesh of sharded checkpoints (made at the first use)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _is_fp8_adam(self.optimizer):  # per-tensor scales of the whole tensor (optimizer/fp8_adam_shards.py)
            self.optimizer.shard_group = self._data_parallel_group()

    def _data_parallel_group(self) -> Any:
        return self.parallel.data_parallel_group if self.parallel.data_parallel_group is not None else dist.group.WORLD

    def start_async_saves(self) -> None:
        """--async-save: sharded saves written in the background (a collective: every rank makes a process group)."""
        from megatron.checkpoint.dcp_async import AsyncSaver

        self.async_saver = AsyncSaver(self.parallel.rank, self.parallel.host_group)

    def poll_checkpoint(self, wait: bool = False) -> Optional[int]:
        return None if self.async_saver is None else self.async_saver.poll(wait)

    def norm_group(self) -> Any:
        """Each rank holds its shards of the gradients: the squares are summed over every rank (pipeline
        parallelism is refused with FSDP2, so the amax group is the world)."""
        return self.parallel.amax_group

    def micro_batch_context(self, is_last: bool):
        """Gradients are reduce-scattered only after the last micro-batch of the step (as DDP's `no_sync`)."""
        self.model.set_requires_gradient_sync(is_last)
        return super().micro_batch_context(is_last)

    def save_checkpoint(self, save_dir: str, iteration: int, extras: dict, train_state: dict,
                        config: dict) -> None:
        """Every rank takes part in gathering; rank 0 writes the torch engine's files. Sharded (--ckpt-format
        torch_dist): every rank writes its own shards."""
        if self.async_saver is not None or self.sharded_checkpoints:
            flat = self._global_state(self._sharded_state(self.save_optimizer))
            if self.async_saver is not None:
                self.async_saver.start(save_dir, iteration, flat, extras, train_state, config)
            else:
                dcp_io.save_sharded_checkpoint(save_dir, iteration, flat, extras, train_state, config,
                                               self.parallel.rank, self._group(), self.parallel.host_group)
            return
        model_state, optim_state = self._full_states()
        payload = None
        if self.parallel.data_parallel_rank == 0:
            payload = {"model": model_state, **extras}
            if self.save_optimizer:
                payload["optimizer"] = optim_state
        self._write(save_dir, iteration, payload, train_state, config)

    def _full_states(self) -> tuple[dict, Optional[dict]]:
        """(the model's full state dict, the optimizer's in `optimizer.state_dict()`'s numbering), on the CPU of the
        first data-parallel rank of each tensor-parallel rank (what the torch engine's layout writes)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        keep = self.parallel.data_parallel_rank == 0
        model_state = full_model_state(self.model, keep)
        if not self.save_optimizer:
            return model_state, None
        if _is_fp8_adam(self.optimizer):  # the whole-tensor optimizer's own state dict: FP8 codes and scales
            from megatron.optimizer.fp8_adam_shards import unsharded_state_dict

            state = unsharded_state_dict(self.optimizer, self._data_parallel_group())
            return model_state, state if keep else None
        optim_state = full_tensors(get_optimizer_state_dict(self.model, self.optimizer), keep)
        return model_state, _numbered(optim_state) if keep else None

    def _forget_gather_scales(self) -> None:
        _forget_gather_scales_of(self.model)

    def _group(self) -> Any:
        """The ranks of a sharded save or load: every rank (each holds pieces of the global tensors)."""
        return self.parallel.amax_group if self.parallel.amax_group is not None else dist.group.WORLD

    def _sharded_state(self, with_optimizer: bool) -> dict[str, Any]:
        """This rank's shards of the model and (optionally) the optimizer state, as DCP stores them (dcp_io.py)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from megatron.training.fp8_gather import plain_dtensor

        model_state = {name: plain_dtensor(value) for name, value in get_model_state_dict(self.model).items()}
        optim_state = None
        if with_optimizer and _is_fp8_adam(self.optimizer):  # its FP8 codes and scales, sharded as the parameters
            from megatron.optimizer.fp8_adam_shards import sharded_state

            optim_state = sharded_state(self.optimizer, {id(p): n for n, p in self.model.named_parameters()})
        elif with_optimizer:
            optim_state = get_optimizer_state_dict(self.model, self.optimizer)
        return dcp_io.flat_state(model_state, optim_state)

    def check_sharded_checkpoints(self) -> None:
        """--ckpt-format torch_dist: what the optimizer's sharded state needs, checked before training."""
        if _is_fp8_adam(self.optimizer):
            from megatron.optimizer.fp8_adam_shards import check_sharded_checkpoints

            check_sharded_checkpoints(self.optimizer)

    def _global_state(self, flat: dict[str, Any]) -> dict[str, Any]:
        """Under tensor parallelism, the shards as pieces of the global tensors (training/fsdp2_mesh.py)."""
        if self.parallel.tensor_parallel_size == 1:
            return flat
        if self.tp_shards is None:
            from megatron.training.fsdp2_mesh import TensorParallelShards

            self.tp_shards = TensorParallelShards(self.parallel, self.model.config, self.accel.device_type)
        return self.tp_shards.globalize(flat)

    def _load_sharded(self, folder: Path, load_optimizer: bool) -> dict:
        """Each rank reads the pieces of the saved shards its own shards overlap (any data-parallel size; the same
        tensor-parallel size)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        saved = dcp_io.saved_keys(folder)
        shapes = dcp_io.saved_model_shapes(saved, self.parallel.tensor_parallel_size, self.model.config)
        ckpt.check_model_state(self.model, shapes, folder)
        if load_optimizer and dcp_io.GROUPS not in saved:
            raise ckpt.CheckpointError(f"{folder} has no optimizer state (saved with --no-save-optim); pass "
                                       "--no-load-optim or --finetune")
        flat = self._sharded_state(load_optimizer)
        target = self._global_state(flat)  # the same storage: read in place
        dcp_io.read_sharded(folder, target, self._group())
        flat.update({key: value for key, value in target.items() if not isinstance(value, torch.Tensor)})
        model_state, optim_state = dcp_io.nested_state(flat)
        set_model_state_dict(self.model, model_state)
        if optim_state is not None and _is_fp8_adam(self.optimizer):  # its states were read in place
            self.optimizer.load_param_groups(optim_state["param_groups"])
        elif optim_state is not None:
            set_optimizer_state_dict(self.model, self.optimizer, optim_state)
        return {"payload": dcp_io.read_extras(folder), "train_state": ckpt.read_json(folder / "train_state.json"),
                "config": ckpt.read_json(folder / "config.json"), "path": folder}

    def load_checkpoint(self, load_dir: str, load_optimizer: bool, module_only: bool,
                        iteration: Optional[int] = None) -> Optional[dict]:
        """Every rank reads the files of its tensor-parallel rank whole and keeps its shards; a checkpoint of another
        layout or engine through its full state (checkpoint/reshard.py); a sharded one, its overlapping pieces."""
        folder = reshard.newest_folder(load_dir, iteration)
        p = self.parallel
        if folder is not None and dcp_io.is_dcp(folder) and \
                dcp_io.saved_tensor_parallel(folder) == p.tensor_parallel_size:
            loaded = self._load_sharded(folder, load_optimizer and not module_only)
            self._forget_gather_scales()
            return loaded
        if folder is not None:
            saved = reshard.saved_layout(folder)
            same_layout = (saved["layout"] in (layouts.SINGLE, layouts.TENSOR_PARALLEL)
                           and saved["mp_files"] == p.tensor_parallel_size)
            switched = reshard.optimizer_switched(saved, self.optimizer, load_optimizer and not module_only)
            if saved["layout"] is not None and (switched or not same_layout):
                loaded = reshard.load_resharded(
                    folder, model=self.model, full_name=lambda n: n, model_config=self.model.config,
                    tp_rank=p.tensor_parallel_rank, tp_size=p.tensor_parallel_size, optimizer=self.optimizer,
                    load_optimizer=load_optimizer, module_only=module_only,
                    describe=f"FSDP2, tensor parallel {p.tensor_parallel_size}" + (
                        f", optimizer {saved['optimizer']} -> {reshard.optimizer_name(self.optimizer)}"
                        if switched else ""), load_pieces=self._set_full_states)
                self._forget_gather_scales()
                return loaded
        loaded = ckpt.load_checkpoint_files(load_dir, mp_rank=p.tensor_parallel_rank, iteration=iteration)
        if loaded is None:
            return None
        payload = loaded["payload"]
        ckpt.check_model_state(self.model, payload["model"], loaded["path"])
        optimizer_state = None
        if load_optimizer and not module_only:
            if "optimizer" not in payload:
                raise ckpt.CheckpointError(f"{loaded['path']} has no optimizer state (saved with --no-save-optim); "
                                           "pass --no-load-optim or --finetune")
            optimizer_state = payload["optimizer"]
        self._set_full_states(payload["model"], optimizer_state)
        return loaded

    def _set_full_states(self, model_state: dict, optimizer_state: Optional[dict]) -> None:
        """Set the model (full tensors of this tensor-parallel rank, by name: each rank keeps its shards) and the
        optimizer (`optimizer.state_dict()`'s numbering; None: left as it is)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict,
        )

        # strict=False: a resharded checkpoint gives the parameters (no buffer is saved state)
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, model_state, options=options)
        self._forget_gather_scales()
        if optimizer_state is not None and _is_fp8_adam(self.optimizer):
            from megatron.optimizer.fp8_adam_shards import local_state_dict

            self.optimizer.load_state_dict(local_state_dict(self.optimizer, optimizer_state))
        elif optimizer_state is not None:
            named = _named(optimizer_state, self.optimizer, self.model)
            set_optimizer_state_dict(self.model, self.optimizer, named, options=options)


def _is_fp8_adam(optimizer: torch.optim.Optimizer) -> bool:
    from megatron.optimizer.fp8_adam import Fp8AdamW

    return isinstance(optimizer, Fp8AdamW)


def _forget_gather_scales_of(model: nn.Module) -> None:
    gather_scales = getattr(model, "fp8_gather_scales", None)
    if gather_scales is not None:  # --fp8-param-gather: the scales of the loaded weights
        gather_scales.forget()


def full_tensors(state: dict[str, Any], keep: bool) -> dict[str, Any]:
    """Each DTensor of `state` (a model's or an optimizer's named state, nested) gathered whole over its mesh, one at a
    time (a collective: every rank calls it), and kept on the CPU where `keep` (the first data-parallel rank of each
    tensor-parallel rank); other values as they are. An FP8-gathered shard (`--fp8-param-gather`) gathers its
    high-precision values."""
    from torch.distributed.tensor import DTensor

    from megatron.training.fp8_gather import plain_dtensor

    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = full_tensors(value, keep)
            continue
        if isinstance(value, DTensor):
            value = plain_dtensor(value).full_tensor()
        if keep:
            out[key] = value.cpu() if isinstance(value, torch.Tensor) else value
    return out


def full_model_state(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The FSDP2 model's full state dict (this tensor-parallel rank's pieces, whole over the data-parallel ranks) on
    the CPU where `keep`; a collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return full_tensors(get_model_state_dict(model), keep)


def _param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[str]]:
    """The parameter names of each optimizer group, in the optimizer's order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _numbered(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (torch.distributed.checkpoint's) as `optimizer.state_dict()`
    numbers it: the parameters counted across the groups in order."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _named(state: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """`_numbered`'s inverse, by this optimizer's groups (the saved run's grouping, checked by the group sizes)."""
    names = _param_names(optimizer, model)
    saved_sizes = [len(g["params"]) for g in state["param_groups"]]
    if saved_sizes != [len(n) for n in names]:
        raise ckpt.CheckpointError(f"the checkpoint's optimizer groups hold {saved_sizes} parameters, this model's "
                                   f"{[len(n) for n in names]}: another model or --weight-decay grouping")
    by_index = {i: name for group, saved in zip(names, state["param_groups"])
                for i, name in zip(saved["params"], group)}
    groups = [{**saved, "params": group} for saved, group in zip(state["param_groups"], names)]
    return {"state": {by_index[i]: value for i, value in state["state"].items()}, "param_groups": groups}
