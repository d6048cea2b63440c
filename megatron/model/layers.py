"""Small building blocks of the transformer: normalisation and rotary position embeddings."""
from __future__ import annotations

import torch
from torch import nn

from megatron.config import ModelConfig, Normalization
from megatron.dtypes import at_least_fp32


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a norm hands to the next GEMM: the autocast dtype for an FP32 `x` under autocast (`--bf16`
    with FP32 parameters: the residual stream stays FP32, its normalized copy is BF16, which the next GEMM
    would cast it to anyway), else `x`'s dtype. A BF16 GEMM computes the same either way; an FP8 linear
    (qkv, fc1) then quantizes 2-byte inputs and its dgrad writes BF16."""
    if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in at least FP32 whatever the activation dtype (as Llama does); its
    output in `activation_dtype(x)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = at_least_fp32(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(x32.dtype)).to(activation_dtype(x))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (FP32 under autocast) with its output in `activation_dtype(x)`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(activation_dtype(x))


def build_norm(config: ModelConfig) -> nn.Module:
    if config.normalization is Normalization.RMSNORM:
        return RMSNorm(config.hidden_size, config.norm_epsilon)
    return LayerNorm(config.hidden_size, eps=config.norm_epsilon, bias=config.add_bias_linear)


class RotaryEmbedding(nn.Module):
    """RoPE tables (cos, sin) for positions 0..max_positions-1; applied in at least FP32 to q and k."""

    def __init__(self, head_dim: int, max_positions: int, base: float) -> None:
        super().__init__()
        # Computed on the CPU whatever the default device: under the meta device (`build_model`) the tables
        # still exist, and every device gets the CPU's values (`materialize` moves them).
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64, device=cpu), inv_freq)
        # Not saved in checkpoints: fully determined by the config. FP32 (no float64 on some accelerators);
        # `model.double()` widens them like any buffer, so a float64 model rotates in float64.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [b, s] -> [b, 1, s, head_dim/2], broadcast over heads
        return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) (the Llama/HF "rotate_half" layout)."""
    x32 = at_least_fp32(x)
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
