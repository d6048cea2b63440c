"""The torch engine's weight layouts. `MainParams`: Megatron's (`--params-dtype bf16`): BF16 weights, FP32 main gradients,
FP32 master weights owned by the optimizer.

Default layout (`--params-dtype fp32`): the model's FP32 weights are the master weights; BF16 autocast runs the
matmuls; gradients are FP32 in `.grad`. Per parameter: 4 (weights) + 4 (grads) + the optimizer's moments.

This layout (Megatron-LM's `--bf16`, its distributed optimizer's `main_param`/`main_grad`):

- the model's parameters are cast to BF16 in place: the forward reads them as they are (an FP8 layer quantizes
  from the BF16 weight; its amax and scale come from those values), and they take 2 bytes;
- each parameter gets an FP32 *main gradient*, a view into one flat buffer. A post-accumulate-grad hook adds the
  BF16 gradient of every backward into it and frees `.grad`, so accumulation over micro-batches is FP32 (a BF16
  sum of 8+ micro-batches would lose bits of each), and one all-reduce of the flat buffer averages it over data
  parallelism (in FP32, as DDP does in the default layout);
- the optimizer's param groups hold FP32 *master* copies instead of the model's parameters: AdamW or Fp8AdamW
  updates them exactly as it updates FP32 weights today, with the main gradient as their `.grad`; after the step
  each master is rounded into its BF16 parameter (round to nearest even, `copy_`).

Persistent bytes per parameter without ZeRO: 2 + 4 + 4 + moments (8 AdamW, ~2 Fp8AdamW), i.e. more than the
default layout's 4 + 4 + moments: the layout pays off when ZeRO shards the master with the moments (DeepSpeed,
`deepspeed_config.py`): 2 + 4 + (4 + moments) / DP. The torch engine implements it so that the recipe and its
numerics are the same with or without DeepSpeed, and for tests.

Checkpoints: the engine saves the masters under the weights' names (`state_dict`), FP32, so resume is exact
and every reader of checkpoints (resharding, conversion to HF) sees FP32 master weights; loading a checkpoint
of either layout fills both the BF16 parameters and the masters from its FP32 values, also when it was written
at another TP/DP/PP layout or by DeepSpeed (resharding fills the masters, `named_masters`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from megatron import comm
from megatron.parallel.grads import copy_parallel_roles


class ModelIsMaster:
    """The default layout (`--params-dtype fp32`) behind `MainParams`'s interface, so that the engine has one code
    path: the model's FP32 parameters are the masters, their `.grad` the gradients (data parallelism averages them
    in DDP), checkpoints hold the model's own state."""

    reduces_gradients = False  # DDP does

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def reduce_and_attach(self, dp_group: Optional[Any], dp_size: int) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def copy_to_model(self) -> None:
        """Nothing to copy: the optimizer stepped the model's parameters."""

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def named_masters(self) -> None:
        """None: resharding loads into the model's own parameters."""
        return None

    def load(self, saved: dict[str, torch.Tensor]) -> None:
        """Nothing beyond the model's state dict, which the engine loaded."""


class MainParams:
    """The BF16 parameters of `model`, their FP32 main gradients and the FP32 masters `optimizer` steps."""

    reduces_gradients = True  # one FP32 all-reduce of the flat main-gradient buffer, in `reduce_and_attach`

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:
            raise ValueError("MainParams must take over the optimizer before its first step")
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("--params-dtype bf16 starts from an FP32 model (the masters are copied from it)")
        self.names = [names[id(p)] for p in params]
        self.params = params
        self.masters = [nn.Parameter(p.detach().clone(), requires_grad=True) for p in params]
        for p, m in zip(params, self.masters):  # what gradient clipping reads of a parameter: its TP role
            copy_parallel_roles(p, m)
        total = sum(p.numel() for p in params)
        self.flat_grad = torch.zeros(total, dtype=torch.float32, device=params[0].device if params else "cpu")
        self.main_grads = []
        offset = 0
        for p in params:
            self.main_grads.append(self.flat_grad[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        master_of = {id(p): m for p, m in zip(params, self.masters)}
        for group in optimizer.param_groups:
            group["params"] = [master_of[id(p)] for p in group["params"]]
        for p, main_grad in zip(params, self.main_grads):
            p.data = p.data.to(torch.bfloat16)
            p.register_post_accumulate_grad_hook(self._accumulator(main_grad))
        self.optimizer = optimizer

    @staticmethod
    def _accumulator(main_grad: torch.Tensor):
        def accumulate(param: torch.Tensor) -> None:
            main_grad.add_(param.grad)  # BF16 -> FP32 in the add: accumulation is FP32
            param.grad = None
        return accumulate

    # ----------------------------------------------------------------------------- the step
    def zero_grad(self) -> None:
        self.flat_grad.zero_()
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    def reduce_and_attach(self, dp_group: Optional[Any], dp_size: int) -> list[torch.Tensor]:
        """Average the main gradients over data parallelism (one FP32 all-reduce) and make them the masters'
        `.grad`; returns the masters (what clipping and the optimizer see)."""
        if dp_size > 1:
            comm.all_reduce(self.flat_grad, dp_group)
            self.flat_grad.div_(dp_size)
        for m, g in zip(self.masters, self.main_grads):
            m.grad = g
        return self.masters

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the updated masters into the BF16 parameters the forward reads."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model.state_dict()` with each parameter's FP32 master in place of its BF16 value."""
        masters = dict(zip(self.names, self.masters))
        return {k: (masters[k].detach() if k in masters else v) for k, v in model.state_dict().items()}

    def named_masters(self) -> list[tuple[str, nn.Parameter]]:
        """(parameter name, its FP32 master): what resharding fills and keys the optimizer state by."""
        return list(zip(self.names, self.masters))

    @torch.no_grad()
    def load(self, saved: dict[str, torch.Tensor]) -> None:
        """Masters (and BF16 parameters) from a saved model state dict of either layout."""
        for name, p, m in zip(self.names, self.params, self.masters):
            m.copy_(saved[name])
            p.copy_(m)
