"""FP8 quantization, the one numerics core: scales, saturating casts, stochastic rounding, inf/NaN counting.

Everything here is a small pure function of tensors; the modules that keep state (amax histories,
cached weights) live in `scaling.py` and `linear.py`. The FP8 layers and the optimizer's FP8 moments
(`megatron/optimizer/fp8_state_quant.py`) both quantize through `compute_scale` + `quantize`; the
optimizer applies them per block and stores `1 / scale` (its `scale_inv`) next to the data.

Conventions (the same as Transformer Engine and torchao):
- `scale` multiplies: `q = cast(clamp(x * scale, -max, max))`, and dequantization divides: `x ~ q / scale`.
  The GEMM backends that want a dequantization factor receive `scale.reciprocal()`.
- `scale = fp8_max / amax / 2**margin`, optionally rounded *down* to a power of two. Rounding down keeps
  `amax * scale <= fp8_max` (no extra clipping), and a power-of-two scale makes `x * scale` and `q / scale`
  exact in binary floating point, so the only error left is the FP8 rounding itself.
- A scale must never become 0, inf or NaN: one bad scale poisons every later step. When `amax` is 0
  (a tensor of zeros, or a layer that did not run) or not finite (the tensor holds inf/NaN, which no scale
  can fix) we keep the previous scale, or 1.0 when there is none. A finite but tiny amax whose reciprocal
  overflows fp32 gives the largest power of two below the fp32 max instead of inf.
- A cast to `float8_e4m3fn` saturates (even inf becomes 448) and a cast to `float8_e5m2` overflows to inf,
  so we clamp explicitly before casting: both formats then behave the same, and the Gaudi2 E4M3 maximum
  (240, below the dtype's 448) is honoured. Because the clamp also turns inf into the maximum, infinities
  must be *counted before the cast* (`count_nonfinite`); NaN passes through the clamp and the cast. So that
  an overflow is not hidden from the training loop, `Fp8Linear` multiplies out the GEMM of a non-finite
  operand with a NaN scale (`nonfinite_guard` in linear.py): its output becomes NaN, as nn.Linear's would be
  non-finite.
"""
from __future__ import annotations

from typing import Protocol

import torch


# Largest power of two representable in fp32; used when fp8_max / amax overflows.
_FP32_MAX_POW2 = 2.0**127


def compute_scale(
    amax: torch.Tensor,
    fp8_max: float | torch.Tensor,
    margin: int = 0,
    power_of_two: bool = False,
    previous: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 scale mapping `amax` to `fp8_max / 2**margin`; the previous scale if amax is 0 or not finite.

    Pure tensor arithmetic (no `.item()`), so it never synchronises with the device.
    """
    amax = amax.float()
    if previous is None:
        previous = torch.ones((), dtype=torch.float32, device=amax.device)
    usable = torch.isfinite(amax) & (amax > 0)
    # Divide by a safe denominator so unusable amaxes do not produce inf/NaN in the branch not taken.
    raw = (fp8_max / 2.0**margin) / torch.where(usable, amax, torch.ones_like(amax))
    raw = torch.clamp(raw, max=_FP32_MAX_POW2)
    if power_of_two:
        # Round down: the quantized amax then lands at or below fp8_max, never above it.
        raw = torch.exp2(torch.floor(torch.log2(raw)))
    return torch.where(usable, raw, previous.float())


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-d tensor; NaN if x holds a NaN, inf if it holds an inf (torch.max propagates NaN)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def count_nonfinite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of NaNs, number of infs) in x as int64 0-d tensors. Call *before* quantizing."""
    return torch.isnan(x).sum(), torch.isinf(x).sum()


class RoundingGrid(Protocol):
    """What quantizing needs of a number format: `Fp8FormatSpec`, or a moment format of the optimizer."""

    torch_dtype: torch.dtype
    max: float  # largest finite magnitude
    min_subnormal: float  # grid spacing below the smallest normal
    mantissa_bits: int


def stochastic_round(y: torch.Tensor, grid: RoundingGrid, noise: torch.Tensor) -> torch.Tensor:
    """Round fp32 `y` (already scaled into the format's range) onto `grid`, stochastically and unbiasedly.

    A value between two neighbours a < |y| < b becomes b with probability (|y| - a) / (b - a), so
    E[round(y)] = y. The spacing (ulp) at |y| is 2**(floor(log2|y|) - mantissa_bits) in the normal range
    and min_subnormal below it: one formula, `ulp = max(2**(exponent - mantissa_bits), min_subnormal)`,
    covers both. floor(log2|y|) is read from the fp32 exponent bits (exact, no log2/frexp, friendly to
    torch.compile). `noise` is uniform in [0, 1) with y's shape; taking it as an argument lets callers
    draw it from their own generator, outside a compiled region. The result lies exactly on the grid,
    so the later cast does not round again. NaN stays NaN; values beyond `grid.max` saturate.
    """
    a = y.abs()
    ulp_exp = ((a.view(torch.int32) >> 23) & 0xFF) - grid.mantissa_bits
    # An fp32 with exponent field ulp_exp and mantissa 0 is 2**(ulp_exp - 127); below field 1 it would be
    # subnormal, but there the clamp to min_subnormal (far larger) takes over anyway.
    ulp = torch.where(ulp_exp >= 1, ulp_exp.clamp_min(1) << 23, torch.zeros_like(ulp_exp)).view(torch.float32)
    ulp = ulp.clamp_min(grid.min_subnormal)
    rounded = torch.floor(a / ulp + noise) * ulp
    return torch.copysign(rounded.clamp_max(grid.max), y)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    spec: RoundingGrid,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 tensor `cast(clamp(x * scale, -max, max))` in `spec.torch_dtype` (same shape as x).

    `scale` broadcasts against `x`: a 0-d tensor for per-tensor scaling, or one scale per row of a
    (blocks, block_len) view for blockwise scaling (the optimizer's moments).
    Rounding is round-to-nearest-even (the cast's), or stochastic when asked: with uniform `noise` of x's
    shape if given, else with noise drawn from `generator` (torch's default generator when None).
    """
    y = x.float() * scale.float()
    y = torch.clamp(y, -spec.max, spec.max)
    if stochastic_rounding or noise is not None:
        if noise is None:
            noise = torch.rand(y.shape, dtype=torch.float32, device=y.device, generator=generator)
        y = stochastic_round(y, spec, noise.view(y.shape))
    return y.to(spec.torch_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q / scale` in `dtype` (computed in fp32, then cast)."""
    return (q.float() / scale.float()).to(dtype)
