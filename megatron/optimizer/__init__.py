"""Optimizer factory: Megatron's parameter groups and AdamW or Fp8AdamW.

Norm weights and biases (every 1-D parameter) get no weight decay, as in Megatron.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from megatron.config import OptimizerConfig
from megatron.partitioned import full_shape

logger = logging.getLogger(__name__)


def get_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if len(full_shape(param)) < 2 else decay).append(param)  # full: ZeRO-3 partitions are 1-D
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = get_param_groups(model, cfg.weight_decay)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optimizer == "adam":
        # On CUDA torch's fused kernel (as Megatron's Apex FusedAdam): one pass over parameter, gradient and both
        # moments instead of one per foreach op (docs/performance.md has the GPU figures). Elsewhere foreach: one
        # multi-tensor kernel per op instead of a Python loop over parameters.
        fused = bool(groups[0]["params"]) and all(p.device.type == "cuda" for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                                 **({"fused": True} if fused else {"foreach": True}))
    if cfg.optimizer == "fp8adam":
        from megatron.optimizer.fp8_adam import Fp8AdamW

        opt = Fp8AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                       m_dtype=cfg.fp8_m_dtype, v_dtype=cfg.fp8_v_dtype, block_size=cfg.fp8_block_size,
                       stochastic_rounding=cfg.fp8_stochastic_rounding, compile=cfg.fp8_compile)
        logger.info("%s", opt.state_summary())
        return opt
    raise ValueError(f"--optimizer must be 'adam' or 'fp8adam', got {cfg.optimizer!r}")
