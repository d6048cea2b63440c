"""FP8 quantization, the one numerics core: scales, saturating casts, stochastic rounding, inf/NaN counting.

Everything here is a small pure function of tensors; the modules that keep state (amax histories,
cached weights) live in `scaling.py` and `layer_state.py`. The FP8 layers and the optimizer's FP8 moments
(`megatron/optimizer/fp8_state_quant.py`) both quantize through `compute_scale` + `quantize`; the
optimizer applies them per block and stores `1 / scale` (its `scale_inv`) next to the data.

Conventions (the same as Transformer Engine and torchao):
- `scale` multiplies: `q = cast(clamp(x * scale, -max, max))`, and dequantization divides: `x ~ q / scale`.
  The GEMM backends that want a dequantization factor receive `1 / scale` (`div_like_eager`).
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
  operand with a NaN scale (`nonfinite_guard` below): its output becomes NaN, as nn.Linear's would be
  non-finite.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron.dtypes import exp2_int, frexp_fp32


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
    # Usable: finite and > 0 (a NaN fails both comparisons). An unusable amax gives inf, 0 or NaN in the branch
    # not taken, which the final `where` discards: no safe denominator is needed. Seven small kernels, which an
    # eager layer launches per tensor (tests/unit/test_fp8_eager_ops.py counts them).
    usable = (amax > 0) & (amax < float("inf"))
    if power_of_two:
        raw = _pow2_scale(amax, fp8_max / 2.0**margin)
    else:
        raw = div_like_eager(fp8_max / 2.0**margin, amax)
    return torch.where(usable, torch.clamp(raw, max=_FP32_MAX_POW2), previous.float())


def div_like_eager(num: float | torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """`num / den` (fp32) with eager PyTorch's bits, in compiled code too. Eager division is IEEE on every
    device (and a Python float over a tensor is `den.reciprocal() * num`), but Triton lowers an fp32 division or
    reciprocal to an approximate one (PTX div.full.f32, within 2 ulp), so a scale computed in a compiled CUDA
    kernel would differ in its last bits from the eager layer's. There the division goes through fp64
    (`fp64_division`), which gives the eager bits."""
    if den.device.type == "cuda" and torch.compiler.is_compiling():
        return fp64_division(num, den)
    if not torch.is_tensor(num) and num == 1.0:
        return den.reciprocal()  # one kernel (eager's `1.0 / den` is reciprocal, then a product by 1)
    return num / den


def fp64_division(num: float | torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """Eager PyTorch's fp32 `num / den` computed through fp64: a tensor quotient is fp32(fp64(num) / fp64(den)),
    the correctly rounded fp32 quotient (rounding to 53 bits, then to 24, is innocuous for a quotient, as
    53 >= 2 * 24 + 2); a Python float over a tensor is the correctly rounded fp32 reciprocal times `num`."""
    if torch.is_tensor(num):
        return (num.double() / den.double()).float()
    reciprocal = (1.0 / den.double()).float()
    return reciprocal if num == 1.0 else reciprocal * num


def _pow2_scale(amax: torch.Tensor, target: float | torch.Tensor) -> torch.Tensor:
    """The largest power of two `s` with `amax * s <= target`, exactly (no rounding of a division or a log2).

    With amax = m 2^e and target = t 2^f (frexp: m, t in [0.5, 1)), amax 2^(f-e) = (m/t) target fits iff
    m <= t, else one binade less does. `floor(log2(target / amax))` computed in fp32 gets the binade wrong
    when the quotient rounds onto a power of two, and then amax * s exceeds target by an fp32 ulp. This is
    also MXFP8's shared-exponent rule (see `quantize_tiles`): the dequantization factor 1/s =
    2^ceil(log2(amax / target)), one binade above the OCP spec's 2^(floor(log2 amax) - emax) exactly when the
    block's amax mantissa exceeds target's (448 = 1.75 x 2^8), where the spec's rule would clip.
    """
    m, e = frexp_fp32(amax)
    # torch.full, not as_tensor: a host value copied to a CUDA device synchronises the stream; a fill does not.
    target = (target.to(device=amax.device, dtype=torch.float32) if torch.is_tensor(target)
              else torch.full((), float(target), dtype=torch.float32, device=amax.device))
    t, f = frexp_fp32(target)
    exponent = (f - e) - (m > t).to(e.dtype)
    return exp2_int(exponent.clamp(-149, 128))


def column_scaled(w: torch.Tensor, column_scale: torch.Tensor) -> torch.Tensor:
    """W diag(c) in fp32: each input channel (column) j of W times c_j (Smooth-SwiGLU's folded fc2 weight)."""
    return w.float() * column_scale.float()


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-d tensor; NaN if x holds a NaN, inf if it holds an inf (torch.max propagates NaN)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    with torch.no_grad():  # not x.detach(): that is one more dispatched op per tensor in an eager layer
        return x.abs().amax().float()


def nonfinite_guard(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """`scale`, or NaN when `amax` is not finite (the quantized tensor held an inf or NaN).

    Quantization clamps before casting, so an inf becomes +-fp8_max and a GEMM on it returns finite values
    where nn.Linear returns inf. Passing the GEMM a NaN scale for such an operand makes its whole output NaN,
    so the overflow reaches the loss or the gradient norm and the step is skipped, not silently taken.
    One 0-d kernel, no host synchronisation: scale + 0 * amax, which is scale exactly for a finite amax and NaN
    for an inf or NaN one (`add` with alpha 0 computes a + 0 * b, it does not skip b).
    """
    return torch.add(scale, amax, alpha=0)


def count_nonfinite(x: torch.Tensor, dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of NaNs, number of infs) in x as 0-d tensors of `dtype`. Call *before* quantizing. NaN is what differs
    from itself, inf what has an infinite magnitude: the counts of isnan and isinf, as comparisons that inductor's
    CPU code vectorizes (it tests isnan and isinf element by element: the FP8 statistics pass took 587 us for a
    [2048, 352] bf16 tensor, 2 cores of an AMD EPYC, torch 2.13.0+cpu)."""
    return (x != x).sum(dtype=dtype), (x.abs() == float("inf")).sum(dtype=dtype)


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
    return div_like_eager(q.float(), scale.float()).to(dtype)


# --- Fine-grained scaling: one scale per tile of a 2-D GEMM operand --------------------------------------------
#
# A GEMM operand is a 2-D [rows, K] matrix whose last dimension is the one the GEMM contracts. A `Tile` of
# (r, c) gives every r x c block its own scale from its own amax (current scaling); 0 means the whole
# dimension, so Tile(1, 0) is one scale per row (rowwise) and Tile(0, 0) one per tensor. Ragged edges form
# partial tiles (zero padding adds nothing to an amax). The recipes (recipe.py) choose the tiles; this is the
# only code that computes, applies and undoes them.


@dataclass(frozen=True)
class Tile:
    """Block shape sharing one scale: `rows` x `cols` of a [rows, K] operand; 0 = the whole dimension."""

    rows: int
    cols: int

    def resolve(self, shape: tuple[int, int]) -> tuple[int, int]:
        return (self.rows or shape[0]) or 1, (self.cols or shape[1]) or 1

    def transposed(self) -> "Tile":
        return Tile(self.cols, self.rows)


@dataclass
class TiledFp8:
    """An FP8 operand with one scale per tile: `data` [R, K], `scale` [ceil(R/r), ceil(K/c)] (the multiplying
    scale, NaN for a tile that held inf/NaN so a GEMM on it cannot return finite values), `amax` per tile."""

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    tile: Tile

    def t(self) -> "TiledFp8":
        """The transposed operand: exact only for square tiles (the same blocks seen from the other side)."""
        r, c = self.tile.resolve(tuple(self.data.shape))
        if r != c:
            raise ValueError(f"only square tiles transpose without requantizing, not {r}x{c}")
        return TiledFp8(self.data.t(), self.scale.t(), self.amax.t(), self.tile.transposed())


def tile_blocks(x: torch.Tensor, tile: Tile) -> tuple[torch.Tensor, tuple[int, int]]:
    """x [R, K] as a [R/r, r, K/c, c] view (zero padded to whole tiles); also returns (R, K)."""
    rows, cols = x.shape
    r, c = tile.resolve((rows, cols))
    pr, pc = -rows % r, -cols % c
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.reshape(x.shape[0] // r, r, x.shape[1] // c, c), (rows, cols)


def _untile_blocks(y: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    y = y.reshape(y.shape[0] * y.shape[1], y.shape[2] * y.shape[3])
    return y[:shape[0], :shape[1]] if tuple(y.shape) != tuple(shape) else y


def quantize_tiles(
    x: torch.Tensor,
    tile: Tile,
    spec: RoundingGrid,
    margin: int = 0,
    power_of_two: bool = False,
    stochastic_rounding: bool = False,
) -> TiledFp8:
    """Quantize a 2-D `x` with one current scale per tile: `compute_scale` of the tile's amax, then `quantize`.

    With `power_of_two` every scale is a power of two chosen so the tile's amax never exceeds `spec.max`
    (`_pow2_scale`): this is how MXFP8's E8M0 scales are made (the range of a finite fp32 amax keeps them
    inside E8M0's 2^-127..2^127). A tile of zeros gets scale 1; a tile holding inf/NaN gets a NaN GEMM scale.
    """
    blocks, shape = tile_blocks(x.detach(), tile)
    amax = blocks.abs().amax(dim=(1, 3)).float()
    scale = compute_scale(amax, spec.max, margin, power_of_two)
    q = quantize(blocks, scale[:, None, :, None], spec, stochastic_rounding)
    guarded = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
    return TiledFp8(_untile_blocks(q, shape), guarded, amax, tile)


def to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales as OCP E8M0 bytes (uint8): the biased exponent of the *dequantization* factor
    X = 1/scale = 2^k, stored as k + 127 (0..254); 255 is E8M0's NaN (a tile that held inf/NaN)."""
    _, exponent = frexp_fp32(scale)  # scale = 0.5 x 2^exponent
    k = (1 - exponent).clamp(-127, 127)
    return torch.where(torch.isnan(scale), torch.full_like(k, 255), k + 127).to(torch.uint8)


def from_e8m0(code: torch.Tensor) -> torch.Tensor:
    """The fp32 quantization scales of `to_e8m0`'s bytes (NaN for 255)."""
    k = code.to(torch.int32) - 127
    scale = exp2_int(-k)
    return torch.where(code == 255, torch.full_like(scale, float("nan")), scale)


def dequantize_tiles(t: TiledFp8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`data / scale` tile by tile, in fp32 (then `dtype`): the exact values a block-scaled GEMM multiplies."""
    blocks, shape = tile_blocks(t.data.float(), t.tile)
    return _untile_blocks(div_like_eager(blocks, t.scale[:, None, :, None]), shape).to(dtype)
