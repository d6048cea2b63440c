"""Dtype rules shared by the model and the parallel layers."""
from __future__ import annotations

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in FP32 when it is narrower (BF16, FP16), unchanged when FP32 or wider: float64 runs stay float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
