"""Storage formats for optimizer moments: FP8 with per-tensor or per-block scales, BF16 or FP32.

`Fp8AdamW` keeps Adam's two moments in one of these formats between steps. This module owns the
(de)quantization of one moment tensor and nothing else; the Adam arithmetic lives in `fp8_adam.py`.

Layout of an FP8 moment of a parameter with `n` elements:
- `data`: a 1-D FP8 tensor of `n_blocks * block_len` bytes (the flattened moment, zero-padded to whole
  blocks). Per-tensor scaling is the special case of one block of length `n` (no padding).
- `scale_inv`: a 1-D FP32 tensor of `n_blocks` dequantization factors, `x ~ data * scale_inv`.
  We store the *inverse* scale (Transformer Engine's `scale_inv`) rather than `scale = fp8_max / amax`
  because an all-zero block then has the honest factor 0 instead of an arbitrary or infinite scale,
  and the flush-to-zero threshold of a block is simply `min_subnormal * scale_inv` (used by the v floor).
The layout is self-describing (block length = `data.numel() // scale_inv.numel()`), so a checkpoint
written with another block size can be dequantized without extra metadata.
BF16/FP32 moments keep the parameter's shape and have no scale.

Scales come from the *current* amax of each block (just-in-time scaling): the optimizer requantizes
every moment once per step from FP32 values it already holds, so there is no reason to use a delayed
amax history, and a fresh amax can never clip.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.fp8.formats import Fp8Dtype, format_spec

# Below this amax a block is treated as if its amax were this value: keeps `fp8_max / amax` finite in
# fp32 (it overflows below ~1e-34 for E5M2). Moments this small are irrelevant next to eps = 1e-8.
_TINY_AMAX = 1e-30


class MomentDtype(str, enum.Enum):
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    BF16 = "bf16"
    FP32 = "fp32"


@dataclass(frozen=True)
class MomentFormat:
    """How one moment is stored: element dtype, its range, and the block length (0 = per tensor)."""

    dtype: MomentDtype
    torch_dtype: torch.dtype
    max: float  # largest finite magnitude (after scaling)
    min_subnormal: float  # smallest positive magnitude (after scaling)
    mantissa_bits: int
    block_size: int = 0

    @property
    def is_fp8(self) -> bool:
        return self.dtype in (MomentDtype.E4M3, MomentDtype.E5M2)

    @property
    def bits_label(self) -> str:
        return self.dtype.value if not self.is_fp8 or not self.block_size else \
            f"{self.dtype.value}/block{self.block_size}"


def moment_format(dtype: MomentDtype | str, block_size: int = 0, backend: str = "cpu") -> MomentFormat:
    """The `MomentFormat` for `dtype`; FP8 ranges come from `megatron.fp8.formats` for `backend`."""
    dtype = MomentDtype(dtype)
    if dtype in (MomentDtype.E4M3, MomentDtype.E5M2):
        spec = format_spec(Fp8Dtype(dtype.value), backend)
        return MomentFormat(dtype, spec.torch_dtype, spec.max, spec.min_subnormal, spec.mantissa_bits,
                            block_size)
    if dtype is MomentDtype.BF16:
        fi = torch.finfo(torch.bfloat16)
        return MomentFormat(dtype, torch.bfloat16, fi.max, 2.0**-133, 7, 0)
    return MomentFormat(dtype, torch.float32, torch.finfo(torch.float32).max, 2.0**-149, 23, 0)


def block_layout(numel: int, block_size: int) -> Tuple[int, int]:
    """(n_blocks, block_len) of a flattened tensor of `numel` elements; block_size 0 = one block."""
    if block_size <= 0 or numel == 0:
        return 1, max(numel, 1)
    return -(-numel // block_size), block_size


def storage_numel(numel: int, fmt: MomentFormat) -> int:
    """Elements stored for a moment of `numel` elements (FP8 moments are padded to whole blocks)."""
    if not fmt.is_fp8:
        return numel
    n_blocks, block_len = block_layout(numel, fmt.block_size)
    return n_blocks * block_len


def stochastic_round(y: torch.Tensor, fmt: MomentFormat, noise: torch.Tensor) -> torch.Tensor:
    """Round fp32 `y` (already scaled into the format's range) to the format's grid, stochastically.

    Unbiased: a value between two neighbours a < y < b becomes b with probability (y - a) / (b - a).
    The grid spacing (ulp) of |y| in a format with `mantissa_bits` is 2**(floor(log2|y|) - mantissa_bits),
    but never below the smallest subnormal. floor(log2|y|) is read from the fp32 exponent bits, which
    keeps the function free of log2/frexp (exact, and friendly to torch.compile).
    `noise` is uniform in [0, 1) with y's shape; the result lies exactly on the grid, so the later cast
    is exact.
    """
    a = y.abs()
    biased_exp = (a.view(torch.int32) >> 23) & 0xFF
    ulp_exp = biased_exp - fmt.mantissa_bits
    # An fp32 whose exponent field is ulp_exp (mantissa 0) is 2**(ulp_exp - 127); below 1 it would be
    # subnormal/zero, and the clamp to the format's smallest subnormal takes over there anyway.
    ulp = torch.where(ulp_exp >= 1, ulp_exp.clamp_min(1) << 23, torch.zeros_like(ulp_exp)).view(torch.float32)
    ulp = ulp.clamp_min(fmt.min_subnormal)
    rounded = torch.floor(a / ulp + noise) * ulp
    return torch.copysign(rounded.clamp_max(fmt.max), y)


def quantize(x: torch.Tensor, fmt: MomentFormat, noise: Optional[torch.Tensor] = None,
             amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Store fp32 `x` (any shape) in `fmt`: returns (data, scale_inv); scale_inv is None unless FP8.

    `noise` (uniform [0, 1), `storage_numel` elements) selects stochastic rounding; None = nearest.
    `amax` (0-d) overrides the per-block amax: a per-tensor scale for a tensor quantized in chunks.
    """
    if fmt.dtype is MomentDtype.FP32:
        return x.float().clone(), None
    if fmt.dtype is MomentDtype.BF16:
        y = x.float()
        if noise is not None:
            y = stochastic_round(y, fmt, noise.view(y.shape))
        return y.to(torch.bfloat16), None
    numel = x.numel()
    n_blocks, block_len = block_layout(numel, fmt.block_size)
    flat = x.reshape(-1).float()
    pad = n_blocks * block_len - numel
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(n_blocks, block_len)
    amax = blocks.abs().amax(dim=1, keepdim=True) if amax is None else amax.view(1, 1).float()
    amax_safe = amax.clamp_min(_TINY_AMAX)
    # Clamp before the cast: float8_e5m2 overflows to inf, and a backend maximum (Gaudi2 E4M3 = 240)
    # may lie below the dtype's own maximum.
    y = (blocks * (fmt.max / amax_safe)).clamp(-fmt.max, fmt.max)
    if noise is not None:
        y = stochastic_round(y, fmt, noise.view(n_blocks, block_len))
    scale_inv = torch.where(amax > 0, amax_safe / fmt.max, torch.zeros_like(amax))
    return y.to(fmt.torch_dtype).view(-1), scale_inv.view(-1)


def dequantize(data: torch.Tensor, scale_inv: Optional[torch.Tensor], numel: int) -> torch.Tensor:
    """FP32 values of a stored moment, flattened to `numel` elements (padding dropped)."""
    if scale_inv is None:
        return data.float().reshape(-1)
    n_blocks = scale_inv.numel()
    x = data.float().view(n_blocks, -1) * scale_inv.view(n_blocks, 1)
    return x.view(-1)[:numel]


def dequantize_with_floor(data: torch.Tensor, scale_inv: Optional[torch.Tensor], numel: int,
                          fmt: MomentFormat, stochastic: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """`dequantize`, plus per element the largest true value that may have been stored as 0.

    The floor is 0 wherever the stored value is nonzero (or the block is all zeros: scale_inv 0).
    Round-to-nearest flushes values below min_subnormal / 2; stochastic rounding can send anything below
    min_subnormal to 0. `Fp8AdamW` uses it to floor v where v underflowed (see its docstring).
    """
    if scale_inv is None:
        x = data.float().reshape(-1)
        return x, torch.zeros_like(x)
    n_blocks = scale_inv.numel()
    s = scale_inv.view(n_blocks, 1)
    x = data.float().view(n_blocks, -1) * s
    per_block = s * (fmt.min_subnormal if stochastic else fmt.min_subnormal / 2)
    floor = torch.where(x == 0, per_block, torch.zeros_like(x))
    return x.view(-1)[:numel], floor.view(-1)[:numel]


def state_nbytes(*tensors: Optional[torch.Tensor]) -> int:
    """Bytes held by the given state tensors (None ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
