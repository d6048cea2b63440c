"""Dtype rules shared by the model and the parallel layers."""
from __future__ import annotations

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in FP32 when it is narrower (BF16, FP16), unchanged when FP32 or wider: float64 runs stay float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# Powers of two from the fp32 bit pattern (int32 views, shifts, masks, adds): exact, no frexp/ldexp/log2, so they
# run as the same elementwise integer ops on every backend (Gaudi's included) and inside compiled graphs.
_EXPONENT_MASK = 0xFF << 23
_NOT_EXPONENT = ~_EXPONENT_MASK  # sign and mantissa bits


def frexp_fp32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.frexp` of an fp32 tensor, bit for bit: x = m 2^e with |m| in [0.5, 1), e int32; (x, 0) for 0, inf,
    NaN. Subnormals are scaled by 2^24 first (exact) and their exponent corrected."""
    x = x.float()
    subnormal = ((x.view(torch.int32) >> 23) & 0xFF) == 0
    scaled = torch.where(subnormal, x * 16777216.0, x)
    bits = scaled.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    exponent = biased - 126 - torch.where(subnormal, 24, 0).to(torch.int32)
    mantissa = ((bits & _NOT_EXPONENT) | (126 << 23)).view(torch.float32)
    special = (biased == 0xFF) | (x == 0)
    return torch.where(special, x, mantissa), torch.where(special, 0, exponent).to(torch.int32)


def exp2_int(k: torch.Tensor) -> torch.Tensor:
    """2^k in fp32 for integer `k` (any integer dtype), exactly: subnormal below -126, inf above 127 (as
    `torch.ldexp(1, k)`); k below -149 gives 0."""
    k = k.to(torch.int32).clamp(-150, 128)
    normal = (k.clamp(-126, 128) + 127) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    bits = torch.where(k >= -126, normal, torch.where(k >= -149, subnormal, torch.zeros_like(k)))
    return bits.view(torch.float32)


def ldexp_fp32(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """x 2^k for fp32 `x` and integer `k` whose 2^k is a normal fp32 number (|k| <= 126): one exact multiply
    unless the result leaves the normal range, rounded then as `torch.ldexp` rounds it."""
    return x.float() * exp2_int(k)
