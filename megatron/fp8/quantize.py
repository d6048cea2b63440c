"""Per-tensor FP8 quantization: scales, saturating casts, stochastic rounding, inf/NaN counting.

Everything here is a small pure function of tensors; the modules that keep state (amax histories,
cached weights) live in `scaling.py` and `linear.py`.

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
  must be *counted before the cast* (`count_nonfinite`); NaN passes through the clamp and the cast, so a
  NaN in the input still shows up as NaN in the loss.
"""
from __future__ import annotations

import torch

from megatron.fp8.formats import Fp8FormatSpec

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


def _stochastic_round(y: torch.Tensor, spec: Fp8FormatSpec, generator: torch.Generator | None) -> torch.Tensor:
    """Round fp32 `y` (already within +-spec.max) onto the FP8 grid of `spec`, stochastically and unbiasedly.

    Normal range: fp32 has 23 mantissa bits, the FP8 format `m`. Adding a uniform random integer in
    [0, 2**(23-m)) to the fp32 bit pattern and then clearing the low 23-m bits rounds the magnitude up with
    probability equal to the distance from the lower grid point divided by the grid spacing, i.e.
    E[round(y)] = y. A carry out of the mantissa increments the exponent, which is exactly the next grid point.
    Subnormal range (|y| < min_normal): the FP8 grid is uniform with step min_subnormal while fp32 is still
    normal there, so the bit trick would use the wrong spacing; we use floor(|y|/step + u) * step instead.
    The result is exactly representable, so the following cast does not round again.
    """
    drop = 23 - spec.mantissa_bits
    bits = y.contiguous().view(torch.int32)
    noise = torch.randint(0, 2**drop, y.shape, dtype=torch.int32, device=y.device, generator=generator)
    # Adding to the magnitude bits is sign-agnostic: fp32 is sign-magnitude, and |y| <= 57344 cannot carry
    # into the sign bit.
    rounded = ((bits + noise) & ~(2**drop - 1)).view(torch.float32)
    step = spec.min_subnormal
    uniform = torch.rand(y.shape, dtype=torch.float32, device=y.device, generator=generator)
    sub = torch.floor(y.abs() / step + uniform) * step * torch.sign(y)
    out = torch.where(y.abs() < spec.min_normal, sub, rounded)
    # Rounding up can never pass fp8_max (max is on the grid), but keep the clamp as a cheap guarantee;
    # NaN stays NaN through both branches only if we restore it explicitly.
    out = torch.clamp(out, -spec.max, spec.max)
    return torch.where(torch.isnan(y), y, out)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    spec: Fp8FormatSpec,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """FP8 tensor `cast(clamp(x * scale, -max, max))` in `spec.torch_dtype` (same shape as x).

    Rounding is round-to-nearest-even (the cast's), or stochastic when asked (used for gradients).
    """
    y = x.float() * scale.float()
    y = torch.clamp(y, -spec.max, spec.max)
    if stochastic_rounding:
        y = _stochastic_round(y, spec, generator)
    return y.to(spec.torch_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q / scale` in `dtype` (computed in fp32, then cast)."""
    return (q.float() / scale.float()).to(dtype)
