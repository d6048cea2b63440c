"""Habana's fused kernels, selected by the upstream switches `--use-fused-sdpa`, `--use-fused-sdpa-with-recompute`,
`--use-fused-rmsnorm` and `--use-fast-softmax` (parsed in megatron/compat.py into `HabanaKernels`).

On HPU, `apply_habana_kernels` swaps the model's modules in place for subclasses that call the kernels of
`habana_frameworks.torch.hpex` (visible in `print(model)`; parameters and state_dict keys are unchanged):

    RMSNorm        -> HpuFusedRMSNorm:  hpex.normalization.FusedRMSNorm.apply(x, weight, eps)
    SelfAttention  -> HpuFusedSDPA...:  hpex.kernels.FusedSDPA.apply(q, k, v, mask, dropout_p, is_causal, scale,
                                        softmax_mode, recompute_mode), softmax_mode "fast" with
                                        --use-fast-softmax (else "None"), as Habana's Megatron-DeepSpeed calls it

On any other device the switches do nothing and one log line says they are not applicable.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from megatron.compat import HabanaKernels
from megatron.dtypes import at_least_fp32
from megatron.model.layers import RMSNorm, activation_dtype
from megatron.model.transformer import SelfAttention

logger = logging.getLogger("megatron")


class HpuFusedRMSNorm(RMSNorm):
    """RMSNorm through Habana's FusedRMSNorm (computed in at least FP32 like ours, output in `activation_dtype`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from habana_frameworks.torch.hpex.normalization import FusedRMSNorm

        x32 = at_least_fp32(x)
        return FusedRMSNorm.apply(x32, self.weight.to(x32.dtype), self.eps).to(activation_dtype(x))


class HpuFusedSDPAMixin:
    """`_core_attention` through Habana's FusedSDPA; mixed in front of the model's attention class."""

    fast_softmax: bool = False
    recompute: bool = False

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask) -> torch.Tensor:
        from habana_frameworks.torch.hpex.kernels import FusedSDPA

        if self.num_kv_heads != self.num_heads:
            repeat = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        dropout = self.config.attention_dropout if self.training else 0.0
        causal = attention_mask is None  # an explicit mask (--reset-attention-mask) already holds causality
        return FusedSDPA.apply(q, k, v, attention_mask, dropout, causal, None,
                               "fast" if self.fast_softmax else "None", self.recompute)


def _swap_class(module: nn.Module, mixin: type, **attrs) -> None:
    cls = type(module)
    module.__class__ = type(f"{mixin.__name__.removesuffix('Mixin')}{cls.__name__}", (mixin, cls), attrs)


def apply_habana_kernels(model: nn.Module, kernels: HabanaKernels, device_type: str) -> list[str]:
    """Swap in the selected Habana kernels when `device_type` is "hpu"; returns the log lines (also logged)."""
    if not kernels.any:
        return []
    if device_type != "hpu":
        lines = [f"Habana fused kernels (--use-fused-sdpa/--use-fused-rmsnorm): not applicable on {device_type}, "
                 "the model keeps torch SDPA and its own RMSNorm"]
    else:
        swapped = {"FusedSDPA": 0, "FusedRMSNorm": 0}
        for module in model.modules():
            if kernels.fused_rmsnorm and type(module) is RMSNorm:
                module.__class__ = HpuFusedRMSNorm
                swapped["FusedRMSNorm"] += 1
            elif kernels.fused_sdpa and isinstance(module, SelfAttention) \
                    and not isinstance(module, HpuFusedSDPAMixin):
                _swap_class(module, HpuFusedSDPAMixin, fast_softmax=kernels.fast_softmax,
                            recompute=kernels.fused_sdpa_recompute)
                swapped["FusedSDPA"] += 1
        lines = [f"Habana {name}: {count} modules" for name, count in swapped.items() if count]
        if kernels.fused_sdpa:
            lines.append(f"FusedSDPA softmax mode {'fast' if kernels.fast_softmax else 'None'}, recompute "
                         f"{kernels.fused_sdpa_recompute}")
    for line in lines:
        logger.info(line)
    return lines
